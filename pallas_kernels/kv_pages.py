"""``write_kv_pages``: the KV write for JAX's ragged-paged-attention cache layout.

JAX's ``ragged_paged_attention`` (and the serving stacks built on it) read one
cache per layer, ``kv_pages [num_pages, page_size, 2 * H, D]``, with K and V
interleaved on the combined-heads axis: K of kv head ``h`` at ``2h``, V at
``2h + 1``. Sub-32-bit caches may also be kept packed,
``[num_pages, page_size, 2 * H // packing, packing, D]`` with
``packing = 4 // itemsize``; combined head ``c`` lives at ``[c // packing,
c % packing]``, so both ranks hold the same elements in the same row-major
order and the op picks the layout from the cache's rank.

Token ``t < N = slot_mapping.shape[0]`` with slot ``s = slot_mapping[t]`` writes
the row ``kv_pages[s // page_size, s % page_size]``. The slot, fp8 and bounds
rules are those of :func:`pallas_kernels.kv_write.reshape_and_cache_flash`
(the same check functions run): a negative slot writes nothing, a slot beyond
the cache is a ``ValueError`` when concrete and writes nothing under ``jit``,
valid slots must be distinct, every other byte of the cache is unchanged.

Implementations (``backend=`` as for every op, registered as op ``"kv_pages"``):
the combined row of a token (``[2H, D]``, K and V interleaved, fp8-quantised
with per-combined-head scales) is one contiguous row of the cache. The jnp
reference is the paged KV write's scatter with one destination. The GPU
(Triton) kernel reads K and V rows and stores each head straight into its
interleaved columns (masked stores, no separate interleave pass). The TPU (Mosaic) kernel copies token runs
(:func:`token_runs`: consecutive tokens whose slots are consecutive in one
page, as in a prefill chunk) with one DMA per power-of-two piece of the run,
HBM to HBM, so a page-long prefill run costs ``log2(page_size) + 1`` DMAs at
most instead of ``page_size``. All alias the cache to the output: donate it at
the enclosing ``jit`` to write in place.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import backend as _backend
from pallas_kernels import contract as validation
from pallas_kernels import gpu_tiling
from pallas_kernels import kv_write
from pallas_kernels.contract import PAD_SLOT_ID
from pallas_kernels.fp8 import ieee_divide, ptx_div_rn, quantize_fp8
from pallas_kernels.segments import ONE_ROW

__all__ = [
    "interleave_kv",
    "kv_packing",
    "token_runs",
    "write_kv_pages",
    "write_kv_pages_reference",
]

def kv_packing(dtype) -> int:
    """Elements of ``dtype`` per 32-bit word (1 for 32-bit, 2 for bf16, 4 for fp8)."""
    return max(1, 4 // np.dtype(dtype).itemsize)


def _check_pages(key, value, kv_pages, slot_mapping, kv_cache_dtype, k_scale, v_scale):
    """Static checks, value checks where concrete; returns ``(slot_mapping, scale_row)``.

    ``scale_row``: float32 ``[2H, D]`` (interleaved K/V scales) for fp8, else None.
    """
    mode = validation.kv_cache_storage(kv_cache_dtype)
    validation.check_rank("key", key, 3)
    num_tokens, num_heads, head_size = np.shape(key)
    validation.check_shape("value", value, (num_tokens, num_heads, head_size))
    validation.check_dtype("key", key, "floating")
    validation.check_dtype("value", value, np.dtype(key.dtype))
    validation.check_rank("kv_pages", kv_pages, (4, 5))
    validation.check_cache_dtype("kv_pages", kv_pages, mode, "key", key.dtype)
    combined = 2 * num_heads
    if np.ndim(kv_pages) == 4:
        validation.check_shape("kv_pages", kv_pages, (None, None, combined, head_size))
    else:
        packing = kv_packing(kv_pages.dtype)
        if packing == 1 or combined % packing:
            raise ValueError(
                f"kv_pages of rank 5 (packed layout) needs a sub-32-bit dtype whose packing "
                f"divides 2 * num_kv_heads = {combined}; got dtype "
                f"{np.dtype(kv_pages.dtype)} (packing {packing})"
            )
        validation.check_shape(
            "kv_pages", kv_pages, (None, None, combined // packing, packing, head_size)
        )
    num_pages, page_size = np.shape(kv_pages)[:2]
    slot_mapping = validation.check_slot_mapping(slot_mapping, num_tokens, num_pages, page_size)
    if mode == "auto":
        return slot_mapping, None
    k, v = (
        validation.fp8_scale_array(name, s, (1, num_heads))
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale))
    )
    per_head = jnp.stack(
        [jnp.broadcast_to(k, (num_heads,)), jnp.broadcast_to(v, (num_heads,))], axis=1
    ).reshape(combined)
    return slot_mapping, jnp.broadcast_to(per_head[:, None], (combined, head_size))


def interleave_kv(key, value):
    """``[T, H, D]`` K and V -> ``[T, 2H, D]`` with K of head h at ``2h``, V at ``2h + 1``."""
    t, h, d = key.shape
    return jnp.stack([key, value], axis=2).reshape(t, 2 * h, d)


OP_PAGES = "kv_pages"


def _rows(key, value, kv_pages):
    """Interleaved rows in the cache's row shape: ``[T, *kv_pages.shape[2:]]``."""
    return interleave_kv(key, value).reshape((key.shape[0],) + kv_pages.shape[2:])


def _via_kv_write(impl, slot_mapping, key, value, kv_pages, scale_row, config, interpret):
    scales = None if scale_row is None else (scale_row.reshape(kv_pages.shape[2:]),)
    (out,) = impl(slot_mapping, (_rows(key, value, kv_pages),), (kv_pages,), scales,
                  segments=ONE_ROW, config=config, interpret=interpret)
    return out


@_backend.register(OP_PAGES, "reference")
def _reference_pages(slot_mapping, key, value, kv_pages, scale_row, *, config, interpret):
    """The paged KV write's reference scatter, one combined row per token."""
    return _via_kv_write(kv_write.reference_write, slot_mapping, key, value, kv_pages,
                         scale_row, config, interpret)


@_backend.register(OP_PAGES, "gpu")
def _gpu_pages(slot_mapping, key, value, kv_pages, scale_row, *, config, interpret):
    """Triton kernel: K and V rows go straight to their interleaved columns (no interleave pass).

    Program ``(p, h)`` writes head ``h`` of tokens ``p * bt .. p * bt + bt - 1``:
    ``key[t, h]`` to columns ``[2h D, 2h D + D)`` of the cache row of slot
    ``s``, ``value[t, h]`` to ``[(2h + 1) D, ...)``; loads first, then stores,
    each masked as in ``kv_write``'s GPU kernel (a PAD, out-of-range or
    past-``N`` token stores nothing; the range check runs in the kernel).
    fp8: one float32 scale per head, division ``div.rn.f32``.
    """
    n = slot_mapping.shape[0]
    t_in, heads, d = key.shape
    num_slots = kv_pages.shape[0] * kv_pages.shape[1]
    flat_cache = kv_pages.reshape(num_slots, 2 * heads * d)
    gpu_tiling.check_int32_offsets("kv_pages", flat_cache.shape)
    flat_k, flat_v = key.reshape(t_in, heads * d), value.reshape(t_in, heads * d)
    tile = int(pl.next_power_of_2(d))
    quantize = scale_row is not None
    bt = gpu_tiling.tokens_per_program(n, quantize, config)
    num_warps = gpu_tiling.num_warps(tile, np.dtype(key.dtype).itemsize, config)
    # scale_row is [2H, D], constant along D: K scales at even rows, V at odd.
    scale_args = [scale_row[0::2, 0], scale_row[1::2, 0]] if quantize else []
    divide = ieee_divide if interpret else ptx_div_rn
    evict = config.gpu_eviction
    triton = _backend.triton

    def kernel(slots_ref, k_ref, v_ref, *refs):
        # Inputs:  slots_ref int[N] (raw); k_ref, v_ref [T, H * D];
        #          fp8 only: k/v scales f32[H]; kv_pages [num_slots, 2 H D] (aliased)
        # Outputs: kv_pages [num_slots, 2 H D]
        scale_refs, out = refs[: len(scale_args)], refs[-1]
        p, h = pl.program_id(0), pl.program_id(1)
        tokens = [p * bt + i for i in range(bt)]
        src_rows = [jnp.minimum(t, n - 1) for t in tokens]  # in bounds; masked at the store
        slots = [slots_ref[r] for r in src_rows]
        live = [(t < n) & (s >= 0) & (s < num_slots) for t, s in zip(tokens, slots)]
        dst_rows = [jnp.where(ok, s, 0).astype(jnp.int32) for ok, s in zip(live, slots)]
        lane = jnp.arange(tile, dtype=jnp.int32)
        in_head = lane < d
        loaded = []
        for src, half in ((k_ref, 0), (v_ref, 1)):
            if quantize:
                head_of_lane = jax.lax.div(h * d + lane, jnp.int32(d))  # == h on live lanes
                scale = triton.load(scale_refs[half].at[head_of_lane], mask=in_head)
            rows = []
            for r in src_rows:
                x = triton.load(src.at[r, pl.ds(h * d, tile)], mask=in_head, eviction_policy=evict)
                rows.append(quantize_fp8(x, scale, divide=divide) if quantize else x)
            loaded.append(((2 * h + half) * d, rows))
        for col, rows in loaded:
            for x, row, ok in zip(rows, dst_rows, live):
                triton.store(out.at[row, pl.ds(col, tile)], x.astype(out.dtype),
                             mask=in_head & ok, eviction_policy=evict)

    call = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(flat_cache.shape, flat_cache.dtype),
        grid=(pl.cdiv(n, bt), heads),
        input_output_aliases={3 + len(scale_args): 0},
        compiler_params=_backend.gpu_compiler_params(num_warps),
        interpret=interpret,
        name="kv_pages_gpu",
    )
    return call(slot_mapping, flat_k, flat_v, *scale_args, flat_cache).reshape(kv_pages.shape)


def token_runs(slots, page_size: int):
    """int32 ``[N]``: at the first token of each run, the run's length; 0 elsewhere.

    A run is a maximal stretch of consecutive tokens with consecutive valid
    (``>= 0``) slots inside one page, so it is one contiguous block of source
    rows and one of cache rows. ``slots``: int32 ``[N]``, invalid ones negative.
    """
    n = slots.shape[0]
    idx = jnp.arange(n, dtype=jnp.int32)
    live = slots >= 0
    prev = jnp.concatenate([jnp.full((1,), PAD_SLOT_ID, slots.dtype), slots[:-1]])
    ps = jnp.asarray(page_size, slots.dtype)  # lax.rem takes one dtype (int64 under x64)
    cont = live & (prev >= 0) & (slots == prev + 1) & (jax.lax.rem(slots, ps) != 0)
    start = live & ~cont
    breaks = jnp.where(cont, n, idx)  # a run ends before the next start or invalid token
    next_break = jax.lax.cummin(jnp.concatenate([breaks[1:], jnp.full((1,), n, jnp.int32)]),
                                reverse=True)
    return jnp.where(start, next_break - idx, 0).astype(jnp.int32)


@_backend.register(OP_PAGES, "tpu")
def _tpu_pages(slot_mapping, key, value, kv_pages, scale_row, *, config, interpret):
    """Mosaic kernel: one DMA per power-of-two piece of each token run, HBM to HBM.

    fp8 rows are quantised by XLA first (the exact :func:`pallas_kernels.fp8.ieee_divide`),
    so the kernel only copies. ``kv_pages`` is aliased to the output and never
    read; a token that starts no run issues no DMA.
    """
    rows = _rows(key, value, kv_pages)
    if scale_row is not None:
        rows = quantize_fp8(rows, scale_row.reshape((1,) + kv_pages.shape[2:]))
    n = slot_mapping.shape[0]
    num_pages, page_size = kv_pages.shape[:2]
    slots = validation.live_ids(slot_mapping, num_pages * page_size)
    runs = token_runs(slots, page_size)
    tokens_per_step = min(config.tpu_tokens_per_step, n)
    num_steps = pl.cdiv(n, tokens_per_step)
    pad = num_steps * tokens_per_step - n  # whole steps: SMEM is never read out of range
    slots = jnp.pad(slots, (0, pad), constant_values=PAD_SLOT_ID)
    runs = jnp.pad(runs, (0, pad))
    piece_sizes = [1 << b for b in range(page_size.bit_length())]  # a run is <= page_size

    def kernel(slots_ref, runs_ref, rows_ref, pages_in_ref, pages_ref, sem):
        # Prefetch: slots_ref, runs_ref  SMEM i32[num_steps * tokens_per_step]
        # Inputs:   rows_ref  HBM [T, *row]; pages_in_ref  HBM (aliased to pages_ref; not read)
        # Output:   pages_ref HBM [num_pages, page_size, *row]
        del pages_in_ref
        first = pl.program_id(0) * tokens_per_step

        def for_pieces(action):
            def body(i, carry):
                t = first + i
                length = runs_ref[t]

                @pl.when(length > 0)
                def _():
                    slot = slots_ref[t]  # >= 0: truncating division is floor division
                    ps = jnp.asarray(page_size, slot.dtype)
                    page, off = jax.lax.div(slot, ps), jax.lax.rem(slot, ps)
                    for size in piece_sizes:
                        @pl.when((length & size) != 0)
                        def _():
                            done = length & (size - 1)  # tokens in the smaller pieces before
                            action(pltpu.make_async_copy(
                                rows_ref.at[pl.ds(t + done, size)],
                                pages_ref.at[page, pl.ds(off + done, size)],
                                sem.at[0],
                            ))

                return carry

            jax.lax.fori_loop(0, tokens_per_step, body, 0)

        for_pieces(lambda c: c.start())
        for_pieces(lambda c: c.wait())

    hbm = pl.BlockSpec(memory_space=pl.ANY)
    call = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(kv_pages.shape, kv_pages.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(num_steps,),
            in_specs=[hbm, hbm],
            out_specs=hbm,
            scratch_shapes=[pltpu.SemaphoreType.DMA((1,))],
        ),
        input_output_aliases={3: 0},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret,
        name="kv_pages_tpu",
    )
    return call(slots, runs, rows, kv_pages)


def write_kv_pages(
    key,  # [T, H, D]
    value,  # [T, H, D]
    kv_pages,  # [num_pages, page_size, 2H, D] or [num_pages, page_size, 2H // p, p, D]
    slot_mapping,  # int32 | int64 [N], N <= T
    kv_cache_dtype: str = "auto",
    k_scale=None,  # float32 [], [1] or [H] (fp8 only)
    v_scale=None,  # float32 [], [1] or [H] (fp8 only)
    *,
    backend: str = "auto",
    interpret: bool | None = None,
    config: kv_write.KVWriteConfig = kv_write.KVWriteConfig(),
):
    """Write K/V of the first ``N`` tokens into a ragged-paged-attention cache.

    ``kv_pages[s // page_size, s % page_size, 2h] = key[t, h]`` and
    ``[..., 2h + 1] = value[t, h]`` for ``t < N`` and ``s = slot_mapping[t]`` in
    ``[0, num_pages * page_size)`` (rank-5 packed caches: the same elements,
    combined head ``c`` at ``[c // packing, c % packing]``). A negative slot
    (``PAD_SLOT_ID``) writes nothing; an out-of-range one is a ``ValueError``
    when concrete and writes nothing under ``jit``.

    Args:
      key, value: ``[T, H, D]``, one float dtype.
      kv_pages: ``[num_pages, page_size, 2H, D]``, or for a sub-32-bit dtype the
        packed ``[num_pages, page_size, 2H // packing, packing, D]``
        (``packing = 4 // itemsize``); dtype of ``key`` for ``"auto"``,
        ``float8_e4m3fn`` for ``"fp8"``/``"fp8_e4m3"``.
      slot_mapping: int32 or int64 ``[N]`` with ``N <= T``; valid slots unique.
      kv_cache_dtype: ``"auto"``, ``"fp8"`` or ``"fp8_e4m3"``.
      k_scale, v_scale: fp8 only: float32 scalar, ``[1]`` or per-head ``[H]``;
        the stored value is ``saturate(x / scale)``.
      backend, interpret: see :mod:`pallas_kernels.backend`.
      config: tuning knobs (``KVWriteConfig``; the TPU kernel reads
        ``tpu_tokens_per_step``, the GPU kernel the ``gpu_*`` fields).

    Returns:
      ``kv_pages``, updated. Donate it to update in place.

    Raises:
      ValueError: bad shape/dtype/``kv_cache_dtype`` (at trace time), or a
        concrete ``slot_mapping`` with a slot beyond the cache or a repeated
        slot, or a concrete scale that is not finite and positive.
    """
    choice = _backend.choose(OP_PAGES, backend, interpret)
    if not isinstance(config, kv_write.KVWriteConfig):
        raise ValueError(f"config must be a KVWriteConfig, got {config!r}")
    slot_mapping, scale_row = _check_pages(
        key, value, kv_pages, slot_mapping, kv_cache_dtype, k_scale, v_scale
    )
    if np.shape(slot_mapping)[0] == 0:
        return jnp.asarray(kv_pages)
    return _backend.run(OP_PAGES, choice, slot_mapping, key, value, kv_pages, scale_row,
                        config=config)


def write_kv_pages_reference(
    key, value, kv_pages, slot_mapping, kv_cache_dtype="auto", k_scale=None, v_scale=None
):
    """Plain-XLA :func:`write_kv_pages` (same contract and checks)."""
    return write_kv_pages(
        key, value, kv_pages, slot_mapping, kv_cache_dtype, k_scale, v_scale, backend="reference"
    )
