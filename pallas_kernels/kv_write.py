"""Paged KV-cache writes: ``reshape_and_cache_flash`` and ``concat_and_cache_mla``.

Both ops mirror vLLM 0.33's cache ops (``csrc/cache_kernels.cu``): token ``t``
of the first ``N = slot_mapping.shape[0]`` tokens goes to flat slot
``s = slot_mapping[t]``, i.e. to ``cache[s // block_size, s % block_size]``.

Sentinels and guarantees (every implementation, under ``jit`` too):

* ``s < 0`` (``PAD_SLOT_ID = -1``, or any negative value) writes nothing, not
  even to the null block 0. This is the rule whose violation was vLLM PR 39444.
* ``s >= num_blocks * block_size`` writes nothing. When ``slot_mapping`` is
  concrete it is rejected with a ``ValueError`` instead; it is never clamped.
* Tokens ``N .. T-1`` of the inputs are ignored (inputs may be padded while the
  slot mapping is not).
* Every byte of the cache outside the written slots is unchanged.
* Two tokens must not share a valid slot (which of them lands is unspecified);
  a concrete ``slot_mapping`` with a repeated slot is rejected.

``kv_cache_dtype`` is ``"auto"`` (cache dtype == input dtype, a plain copy) or
``"fp8"`` / ``"fp8_e4m3"`` (``float8_e4m3fn`` cache, stored value
``saturate(x / scale)`` computed in float32, rounded to nearest even; NaN stays
NaN, +-inf and anything beyond +-448 become +-448).

Implementations (picked by :func:`pallas_kernels.backend.resolve`):

* reference: one ``.at[].set(mode="drop")`` scatter per cache; invalid slots are
  mapped to an out-of-range row, never to ``-1``. Wherever XLA runs the fp8
  quantisation (reference, interpret mode) it divides with :func:`ieee_divide`,
  because XLA's own float32 division is not always correctly rounded.
* TPU (Mosaic): slots in SMEM via scalar prefetch, caches left in HBM
  (``pl.ANY``) and aliased to the outputs, one DMA per valid token and
  destination issued under ``pl.when``; a skipped token issues no DMA at all.
  ``KVWriteConfig.tpu_tokens_per_step`` tokens share a grid step so their DMAs overlap.
  fp8 inputs are staged through VMEM and quantised there before the DMA
  (compiled, Mosaic's float32 division; its rounding is not yet checked on a TPU).
* GPU (Pallas Triton, :func:`pallas_kernels.backend.gpu_compiler_params`): grid (block of
  tokens, column tile), masked loads/stores, the slot range check in the
  kernel (one launch per call); a skipped token's stores are fully masked.
  fp8 divides with PTX ``div.rn.f32`` (Triton's ``/`` is ``div.full.f32``).

Callers donate the caches (``jax.jit(..., donate_argnums=...)``) so that the
write happens in place: every implementation aliases the cache buffers to its
outputs, so no whole-cache copy is made.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import contract as validation
from pallas_kernels import gpu_tiling
from pallas_kernels.contract import KV_CACHE_DTYPES, PAD_SLOT_ID
from pallas_kernels import backend as _backend
from pallas_kernels._xla import scatter_set
from pallas_kernels.fp8 import FP8_DTYPE, FP8_MAX, ieee_divide, ptx_div_rn, quantize_fp8
from pallas_kernels.segments import FLASH_SEGMENTS, mla_segments

__all__ = [
    "FP8_DTYPE",
    "KVWriteConfig",
    "FP8_MAX",
    "KV_CACHE_DTYPES",
    "concat_and_cache_mla",
    "concat_and_cache_mla_reference",
    "ieee_divide",
    "quantize_fp8",
    "reference_write",
    "reshape_and_cache_flash",
    "reshape_and_cache_flash_reference",
]


@dataclasses.dataclass(frozen=True)
class KVWriteConfig:
    """Tuning knobs of the write kernels (a static argument; defaults: BENCHMARKS.md,
    "Kernel design notes").

    Attributes:
      tpu_tokens_per_step: tokens per TPU grid step (their DMAs overlap).
      gpu_max_tile: most columns one GPU program copies (a power of two).
      gpu_max_tokens_per_program: most tokens one GPU program writes.
      gpu_min_programs: aim for at least this many GPU programs per call.
      gpu_fp8_max_tokens_per_program: the same bound when quantising to fp8.
      gpu_fp8_max_tile: ``gpu_max_tile`` when quantising fewer than ``gpu_min_programs``
        tokens to fp8 (decode sizes).
      gpu_fp8_columns_per_thread: columns each thread quantises there (a power of two; sets the warps):
        the correctly rounded division is a long dependent sequence, so at decode sizes a
        call's time is one thread's divisions.
      gpu_tokens_per_program, gpu_num_warps: fixed values instead of the rules.
      gpu_eviction: eviction policy of the GPU row loads and stores (None: default).
      mosaic_tokens_per_cta: tokens one CTA of the Mosaic GPU kernel writes (None: the
        rule of ``pallas_kernels.kv_mosaic_gpu.tokens_per_cta``).
      mosaic_fp8_in_kernel: the Mosaic GPU kernel quantises to fp8 itself (rows of a
        multiple of 128 elements); False: XLA quantises before it.
    """

    tpu_tokens_per_step: int = 8
    gpu_max_tile: int = 2048
    gpu_max_tokens_per_program: int = 8
    gpu_min_programs: int = 512
    gpu_fp8_max_tokens_per_program: int = 1
    gpu_fp8_max_tile: int = 512
    gpu_fp8_columns_per_thread: int = 2
    gpu_tokens_per_program: int | None = None
    gpu_num_warps: int | None = None
    gpu_eviction: str | None = None
    mosaic_tokens_per_cta: int | None = None
    mosaic_fp8_in_kernel: bool = True

    def __post_init__(self):
        # the fp8 decode rule's warps are a tile over 32 x gpu_fp8_columns_per_thread: a power of two
        validation.check_config_ints(self, ("gpu_max_tile", "gpu_fp8_max_tile", "gpu_fp8_columns_per_thread"))


OP_WRITE = "kv_write"


# --------------------------------------------------------------------------
# Reference (plain XLA)
# --------------------------------------------------------------------------


@_backend.register(OP_WRITE, "reference")
def reference_write(slot_mapping, sources, caches, scales, *, segments, config, interpret):
    """One drop-mode scatter per cache; an invalid slot maps to row ``num_slots``.

    The reference of every KV write op (``write_kv_pages``' too, and the Mosaic GPU
    flavour's MLA layout): ``segments`` (:mod:`pallas_kernels.segments`) say which
    source row goes where; ``scales`` are per-source float32 rows (fp8) or None.
    In place under donation wherever XLA scatters the cache dtype natively.
    XLA:CPU does not for bfloat16/float8: it upcasts the cache around the
    scatter (a copy XLA makes, not this code; the Pallas flavours never do).
    """
    del config, interpret
    n = slot_mapping.shape[0]
    outs = []
    for d, cache in enumerate(caches):
        num_slots = cache.shape[0] * cache.shape[1]
        rows = validation.live_ids(slot_mapping, num_slots)
        rows = jnp.where(rows >= 0, rows, num_slots)  # out of range: dropped
        parts = []
        for seg in segments:
            if seg.dst != d:
                continue
            x = sources[seg.src][:n]
            parts.append(x if scales is None else quantize_fp8(x, scales[seg.src]))
        new_rows = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)
        flat = cache.reshape((num_slots,) + cache.shape[2:])
        flat = scatter_set(flat, rows, new_rows)
        outs.append(flat.reshape(cache.shape))
    return tuple(outs)


# --------------------------------------------------------------------------
# TPU (Mosaic): scalar-prefetched slots, manual DMA into aliased HBM caches
# --------------------------------------------------------------------------


@_backend.register(OP_WRITE, "tpu")
def _tpu_write(slot_mapping, sources, caches, scales, *, segments, config, interpret):
    """Mosaic kernel; see the module docstring. ``scales``: per-source float32 rows or None."""
    # The interpreter runs the body through XLA: exact integer division there.
    # Compiled, Mosaic lowers "/" to its own divf (exactness on hardware not
    # yet checked; clz-based long division may not lower in Mosaic).
    divide = ieee_divide if interpret else jnp.divide
    n = slot_mapping.shape[0]
    num_slots = caches[0].shape[0] * caches[0].shape[1]
    block_size = caches[0].shape[1]
    quantize = scales is not None
    tokens_per_step = min(config.tpu_tokens_per_step, n)
    num_steps = pl.cdiv(n, tokens_per_step)
    # Pad to whole steps with PAD so the kernel never reads SMEM out of range.
    slots = jnp.full((num_steps * tokens_per_step,), PAD_SLOT_ID, jnp.int32)
    slots = slots.at[:n].set(validation.live_ids(slot_mapping, num_slots))
    row_shapes = [s.shape[1:] for s in sources]
    n_src, n_dst = len(sources), len(caches)

    def token_block(step, slots_ref, *, rank):  # source rows of this step
        del slots_ref
        return (step,) + (0,) * rank

    def whole_row(step, slots_ref, *, rank):  # the per-column scales
        del step, slots_ref
        return (0,) * (rank + 1)

    hbm = pl.BlockSpec(memory_space=pl.ANY)
    if quantize:
        src_specs = [
            pl.BlockSpec((tokens_per_step,) + r, functools.partial(token_block, rank=len(r)))
            for r in row_shapes
        ]
        scale_specs = [
            pl.BlockSpec((1,) + r, functools.partial(whole_row, rank=len(r))) for r in row_shapes
        ]
        scale_args = [s.reshape((1,) + r) for s, r in zip(scales, row_shapes)]
        stage_shapes = [pltpu.VMEM((tokens_per_step,) + r, FP8_DTYPE) for r in row_shapes]
    else:
        src_specs, scale_specs, scale_args, stage_shapes = [hbm] * n_src, [], [], []

    def kernel(slots_ref, *refs):
        # Prefetch: slots_ref  SMEM i32[num_steps * tokens_per_step]  (-1 = skip)
        # Inputs:   sources    auto: HBM [T, *row]; fp8: VMEM [tokens_per_step, *row]
        #           scales     fp8 only: VMEM f32[1, *row]
        #           caches     HBM (aliased to the outputs; not read)
        # Outputs:  caches     HBM [num_blocks, block_size, *cache_row]
        # Scratch:  stages     fp8 only: VMEM fp8[tokens_per_step, *row]
        #           sems       DMA semaphores, one per segment
        src_refs = refs[:n_src]
        scale_refs = refs[n_src : n_src + len(scale_args)]
        out_refs = refs[n_src + len(scale_args) + n_dst : n_src + len(scale_args) + 2 * n_dst]
        stage_refs = refs[len(refs) - 1 - len(stage_shapes) : len(refs) - 1]
        sems = refs[-1]
        step = pl.program_id(0)
        first = step * tokens_per_step

        if quantize:
            for stage, src, scale in zip(stage_refs, src_refs, scale_refs):
                stage[...] = quantize_fp8(src[...], scale[...], divide=divide)
            copy_from = stage_refs
        else:
            copy_from = src_refs

        def copies(i, slot):
            # Row i of this step (token first + i) -> cache[slot // bs, slot % bs].
            row = i if quantize else first + i
            # slot >= 0 here (pl.when): truncating division is floor division.
            bs = jnp.asarray(block_size, slot.dtype)
            blk, off = jax.lax.div(slot, bs), jax.lax.rem(slot, bs)
            out = []
            for k, seg in enumerate(segments):
                src = copy_from[seg.src].at[pl.ds(row, 1)]
                if seg.col is None:
                    dst = out_refs[seg.dst].at[blk, pl.ds(off, 1)]
                else:
                    width = row_shapes[seg.src][-1]
                    dst = out_refs[seg.dst].at[blk, pl.ds(off, 1), pl.ds(seg.col, width)]
                out.append(pltpu.make_async_copy(src, dst, sems.at[k]))
            return out

        def for_live_tokens(action):
            def body(i, carry):
                slot = slots_ref[first + i]

                @pl.when(slot >= 0)
                def _():
                    for c in copies(i, slot):
                        action(c)

                return carry

            jax.lax.fori_loop(0, tokens_per_step, body, 0)

        for_live_tokens(lambda c: c.start())
        for_live_tokens(lambda c: c.wait())

    first_cache_arg = 1 + n_src + len(scale_args)
    call = pl.pallas_call(
        kernel,
        out_shape=tuple(jax.ShapeDtypeStruct(c.shape, c.dtype) for c in caches),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(num_steps,),
            in_specs=src_specs + scale_specs + [hbm] * n_dst,
            out_specs=tuple([hbm] * n_dst),
            scratch_shapes=stage_shapes + [pltpu.SemaphoreType.DMA((len(segments),))],
        ),
        input_output_aliases={first_cache_arg + d: d for d in range(n_dst)},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret,
        name="kv_write_tpu",
    )
    return tuple(call(slots, *sources, *scale_args, *caches))


# --------------------------------------------------------------------------
# GPU: Pallas Triton lowering, several tokens per program, masked stores
# --------------------------------------------------------------------------


@_backend.register(OP_WRITE, "gpu")
def _gpu_write(slot_mapping, sources, caches, scales, *, segments, config, interpret):
    """Pallas Triton kernel on 2-D views: sources ``[T, W_s]``, caches ``[num_slots, W_d]``.

    Program ``(p, j)`` writes tokens ``p * bt .. p * bt + bt - 1`` (``bt`` from
    :func:`pallas_kernels.gpu_tiling.tokens_per_program`), columns ``[j * tile_s, (j + 1) * tile_s)``
    of each segment ``s``. It loads every row first and stores afterwards, so
    all of a program's loads are in flight together. A token's store mask is
    empty when it is past ``N`` or its slot is negative or beyond the cache:
    the range check runs in the kernel (no separate XLA pass over the slot
    mapping, so a call is one launch), on the mapping's own dtype.

    fp8: the scale rows are constant along each source's last axis (per head
    for the flash layout, one scale for MLA: see ``_check_flash`` and
    ``_check_mla``), so the kernel gets one float32 per group (``[H]`` or
    ``[1]``) and gathers it per column, instead of re-reading a full float32
    row per token.
    """
    n = slot_mapping.shape[0]
    num_slots = caches[0].shape[0] * caches[0].shape[1]
    flat_src = [s.reshape(s.shape[0], -1) for s in sources]
    flat_caches = [c.reshape(num_slots, -1) for c in caches]
    for k, c in enumerate(flat_caches):
        gpu_tiling.check_int32_offsets(f"cache {k}", c.shape)
    widths = [s.shape[1] for s in flat_src]
    quantize = scales is not None
    # fp8 at decode sizes (fewer tokens than gpu_min_programs): narrow tiles, more warps.
    fp8_decode = quantize and n < config.gpu_min_programs
    max_tile = config.gpu_fp8_max_tile if fp8_decode else config.gpu_max_tile
    tiles = [int(min(max_tile, pl.next_power_of_2(w))) for w in widths]
    num_col_tiles = max(pl.cdiv(w, t) for w, t in zip(widths, tiles))
    bt = gpu_tiling.tokens_per_program(n, quantize, config)
    num_warps = gpu_tiling.num_warps(
        max(tiles), max(np.dtype(s.dtype).itemsize for s in flat_src), config, fp8_decode)
    # Columns per scale value of each source: its last axis (D, or all of L / R).
    groups = [s.shape[-1] for s in sources]
    scale_args = [s.reshape(-1, g)[:, 0] for s, g in zip(scales, groups)] if quantize else []
    divide = ieee_divide if interpret else ptx_div_rn
    evict = config.gpu_eviction
    n_src, n_dst = len(sources), len(caches)

    def kernel(slots_ref, *refs):
        # Inputs:  slots_ref int[N] (raw slot mapping); sources [T, W_s];
        #          fp8 only: scales f32[W_s / group_s]; caches [num_slots, W_d] (aliased)
        # Outputs: caches [num_slots, W_d]
        src_refs = refs[:n_src]
        scale_refs = refs[n_src : n_src + len(scale_args)]
        out_refs = refs[len(refs) - n_dst :]
        p, j = pl.program_id(0), pl.program_id(1)
        tokens = [p * bt + i for i in range(bt)]
        # Rows read: clamped into [0, N) so every load is in bounds; a token
        # past N is masked at the store.
        src_rows = [jnp.minimum(t, n - 1) for t in tokens]
        slots = [slots_ref[r] for r in src_rows]
        live = [(t < n) & (s >= 0) & (s < num_slots) for t, s in zip(tokens, slots)]
        # Masked-off stores keep their addresses in range (row 0).
        dst_rows = [jnp.where(ok, s, 0).astype(jnp.int32) for ok, s in zip(live, slots)]
        loaded = []
        for seg in segments:
            tile = tiles[seg.src]
            start = j * tile
            cols = start + jnp.arange(tile, dtype=jnp.int32)
            in_row = cols < widths[seg.src]
            if quantize:
                group_of_col = jax.lax.div(cols, jnp.int32(groups[seg.src]))
                scale = _backend.triton.load(scale_refs[seg.src].at[group_of_col], mask=in_row)
            rows = []
            for r in src_rows:
                x = _backend.triton.load(src_refs[seg.src].at[r, pl.ds(start, tile)], mask=in_row,
                             eviction_policy=evict)
                rows.append(quantize_fp8(x, scale, divide=divide) if quantize else x)
            loaded.append((seg, start, in_row, rows))
        for seg, start, in_row, rows in loaded:
            out = out_refs[seg.dst]
            col = (0 if seg.col is None else seg.col) + start
            for x, row, ok in zip(rows, dst_rows, live):
                _backend.triton.store(out.at[row, pl.ds(col, tiles[seg.src])], x.astype(out.dtype),
                          mask=in_row & ok, eviction_policy=evict)

    call = pl.pallas_call(
        kernel,
        out_shape=tuple(jax.ShapeDtypeStruct(c.shape, c.dtype) for c in flat_caches),
        grid=(pl.cdiv(n, bt), num_col_tiles),
        input_output_aliases={1 + n_src + len(scale_args) + d: d for d in range(n_dst)},
        compiler_params=_backend.gpu_compiler_params(num_warps),
        interpret=interpret,
        name="kv_write_gpu",
    )
    outs = call(slot_mapping, *flat_src, *scale_args, *flat_caches)
    return tuple(o.reshape(c.shape) for o, c in zip(outs, caches))


# --------------------------------------------------------------------------
# Dispatch
# --------------------------------------------------------------------------


def _write(choice, slot_mapping, sources, caches, scales, *, segments, config):
    """Run the chosen implementation. ``scales``: tuple of float32 rows (fp8) or None."""
    if not isinstance(config, KVWriteConfig):
        raise ValueError(f"config must be a KVWriteConfig, got {config!r}")
    if np.shape(slot_mapping)[0] == 0:
        return tuple(caches)
    return _backend.run(OP_WRITE, choice, slot_mapping, tuple(sources), tuple(caches), scales,
                        segments=segments, config=config)


def _check_flash(
    key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale
):
    """All static checks, plus value checks where concrete.

    Returns ``(slot_mapping, scales)``: the slot mapping to pass on, and the
    per-element float32 scale rows ``([H, D], [H, D])`` (None for ``"auto"``).
    """
    mode = validation.kv_cache_storage(kv_cache_dtype)
    validation.check_rank("key", key, 3)
    num_tokens, num_heads, head_size = np.shape(key)
    validation.check_shape("value", value, (num_tokens, num_heads, head_size))
    validation.check_dtype("key", key, "floating")
    validation.check_dtype("value", value, np.dtype(key.dtype))
    validation.check_rank("key_cache", key_cache, 4)
    num_blocks, block_size = np.shape(key_cache)[:2]
    validation.check_shape("key_cache", key_cache, (None, None, num_heads, head_size))
    validation.check_shape("value_cache", value_cache, np.shape(key_cache))
    validation.check_cache_dtype("key_cache", key_cache, mode, "key", key.dtype)
    validation.check_dtype("value_cache", value_cache, np.dtype(key_cache.dtype))
    slot_mapping = validation.check_slot_mapping(slot_mapping, num_tokens, num_blocks, block_size)
    if mode == "auto":
        return slot_mapping, None
    # [], [1] or [H] -> [H, D]: one scale per element of a token's row.
    scales = tuple(
        jnp.broadcast_to(validation.fp8_scale_array(name, s, (1, num_heads))[:, None],
                         (num_heads, head_size))
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale))
    )
    return slot_mapping, scales


def _check_mla(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale):
    """Like :func:`_check_flash`; the scale rows are ``([L], [R])``."""
    mode = validation.kv_cache_storage(kv_cache_dtype)
    validation.check_rank("kv_c", kv_c, 2)
    num_tokens, kv_lora_rank = np.shape(kv_c)
    validation.check_rank("k_pe", k_pe, 2)
    validation.check_shape("k_pe", k_pe, (num_tokens, None))
    pe_dim = np.shape(k_pe)[1]
    validation.check_dtype("kv_c", kv_c, "floating")
    validation.check_dtype("k_pe", k_pe, np.dtype(kv_c.dtype))
    validation.check_rank("kv_cache", kv_cache, 3)
    validation.check_shape("kv_cache", kv_cache, (None, None, kv_lora_rank + pe_dim))
    validation.check_cache_dtype("kv_cache", kv_cache, mode, "kv_c", kv_c.dtype)
    num_blocks, block_size = np.shape(kv_cache)[:2]
    slot_mapping = validation.check_slot_mapping(slot_mapping, num_tokens, num_blocks, block_size)
    if mode == "auto":
        return slot_mapping, None
    s = validation.fp8_scale_array("scale", scale, (1,))
    return slot_mapping, (jnp.broadcast_to(s, (kv_lora_rank,)), jnp.broadcast_to(s, (pe_dim,)))


# --------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------


def reshape_and_cache_flash(
    key,  # [T, H, D]
    value,  # [T, H, D]
    key_cache,  # [num_blocks, block_size, H, D]
    value_cache,  # [num_blocks, block_size, H, D]
    slot_mapping,  # int32 | int64 [N], N <= T
    kv_cache_dtype: str = "auto",
    k_scale=None,  # float32 [], [1] or [H] (fp8 only)
    v_scale=None,  # float32 [], [1] or [H] (fp8 only)
    *,
    backend: str = "auto",
    interpret: bool | None = None,
    config: KVWriteConfig = KVWriteConfig(),
):
    """Write K/V of the first ``N`` tokens into a paged flash-layout cache.

    ``key_cache[s // block_size, s % block_size] = key[t]`` (likewise value) for
    ``t < N`` with ``s = slot_mapping[t]`` in ``[0, num_blocks * block_size)``.
    A negative slot (``PAD_SLOT_ID``) writes nothing; an out-of-range one is a
    ``ValueError`` when concrete and writes nothing under ``jit``.

    Args:
      key, value: ``[T, H, D]``, one float dtype.
      key_cache, value_cache: ``[num_blocks, block_size, H, D]``; dtype equal to
        ``key``'s for ``"auto"``, ``float8_e4m3fn`` for ``"fp8"``/``"fp8_e4m3"``.
      slot_mapping: int32 or int64 ``[N]`` with ``N <= T``; valid slots unique.
      kv_cache_dtype: ``"auto"``, ``"fp8"`` or ``"fp8_e4m3"``.
      k_scale, v_scale: fp8 only (ignored for ``"auto"``): float32 scalar, ``[1]``
        or per-head ``[H]``; stored value is ``saturate(x / scale)``.
      backend, interpret: see :mod:`pallas_kernels.backend`.
      config: :class:`KVWriteConfig` tuning knobs (static).

    Returns:
      ``(key_cache, value_cache)``, updated. Donate the inputs to update in place.

    Raises:
      ValueError: bad shape/dtype/``kv_cache_dtype`` (at trace time), or a
        concrete ``slot_mapping`` with a slot beyond the cache or a repeated
        slot, or a concrete scale that is not finite and positive.
    """
    choice = _backend.choose(OP_WRITE, backend, interpret)
    slot_mapping, scales = _check_flash(
        key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale
    )
    return _write(
        choice,
        slot_mapping,
        (key, value),
        (key_cache, value_cache),
        scales,
        segments=FLASH_SEGMENTS,
        config=config,
    )


def reshape_and_cache_flash_reference(
    key,
    value,
    key_cache,
    value_cache,
    slot_mapping,
    kv_cache_dtype="auto",
    k_scale=None,
    v_scale=None,
):
    """Plain-XLA :func:`reshape_and_cache_flash` (same contract and checks)."""
    return reshape_and_cache_flash(
        key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale,
        backend="reference",
    )


def concat_and_cache_mla(
    kv_c,  # [T, L]
    k_pe,  # [T, R]
    kv_cache,  # [num_blocks, block_size, L + R]
    slot_mapping,  # int32 | int64 [N], N <= T
    kv_cache_dtype: str = "auto",
    scale=None,  # float32 [] or [1] (fp8 only)
    *,
    backend: str = "auto",
    interpret: bool | None = None,
    config: KVWriteConfig = KVWriteConfig(),
):
    """Write ``concat(kv_c[t], k_pe[t])`` of the first ``N`` tokens into an MLA cache.

    ``kv_cache[s // block_size, s % block_size, :L] = kv_c[t]`` and
    ``[..., L:] = k_pe[t]`` for ``t < N``, ``s = slot_mapping[t]``; the slot
    rules are those of :func:`reshape_and_cache_flash`.

    Args:
      kv_c: ``[T, L]``; k_pe: ``[T, R]``, same float dtype.
      kv_cache: ``[num_blocks, block_size, L + R]``; dtype of ``kv_c`` for
        ``"auto"``, ``float8_e4m3fn`` for ``"fp8"``/``"fp8_e4m3"``.
      slot_mapping: int32 or int64 ``[N]`` with ``N <= T``; valid slots unique.
      kv_cache_dtype: ``"auto"``, ``"fp8"`` or ``"fp8_e4m3"``.
      scale: fp8 only: one float32 scale (scalar or ``[1]``).
      backend, interpret: see :mod:`pallas_kernels.backend`.
      config: :class:`KVWriteConfig` tuning knobs (static).

    Returns:
      ``kv_cache``, updated. Donate it to update in place.
    """
    choice = _backend.choose(OP_WRITE, backend, interpret)
    slot_mapping, scales = _check_mla(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale)
    (out,) = _write(
        choice,
        slot_mapping,
        (kv_c, k_pe),
        (kv_cache,),
        scales,
        segments=mla_segments(kv_c.shape[1]),
        config=config,
    )
    return out


def concat_and_cache_mla_reference(
    kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype="auto", scale=None
):
    """Plain-XLA :func:`concat_and_cache_mla` (same contract and checks)."""
    return concat_and_cache_mla(
        kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale, backend="reference"
    )
