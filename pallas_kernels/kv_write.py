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

Implementations (picked by :func:`pallas_kernels._backend.resolve`):

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
* GPU (Pallas Triton, :func:`pallas_kernels._backend.gpu_compiler_params`): grid (block of
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
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import contract as validation
from pallas_kernels.contract import KV_CACHE_DTYPES, PAD_SLOT_ID
from pallas_kernels import _backend
from pallas_kernels._xla import scatter_set

__all__ = [
    "FP8_DTYPE",
    "KVWriteConfig",
    "FP8_MAX",
    "KV_CACHE_DTYPES",
    "concat_and_cache_mla",
    "concat_and_cache_mla_reference",
    "ieee_divide",
    "quantize_fp8",
    "reshape_and_cache_flash",
    "reshape_and_cache_flash_reference",
]

FP8_DTYPE = jnp.float8_e4m3fn
# Largest finite float8_e4m3fn value; "saturate" clamps to +-FP8_MAX.
FP8_MAX = float(jnp.finfo(FP8_DTYPE).max)  # 448.0



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
      gpu_fp8_columns_per_thread: columns each thread quantises there (sets the warps):
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


_INT32_MAX = int(np.iinfo(np.int32).max)
OP_WRITE = "kv_write"


# --------------------------------------------------------------------------
# fp8 quantisation (shared by every implementation)
# --------------------------------------------------------------------------


def ieee_divide(x, scale):
    """IEEE float32 ``x / scale`` (round to nearest even), exact under any XLA backend.

    Plain ``x / scale`` is not: XLA:GPU divides float32 with ``div.full.f32``
    (up to 1 ulp off, openxla/xla#37181), and XLA's simplifier rewrites
    ``x / broadcast(s)`` as ``x * broadcast(1 / s)`` (two roundings: -90 / 0.9
    becomes -100.00001, not -100). Either moves some quotients across an fp8
    rounding boundary. So the quotient is computed here by integer long
    division of the significands, which every backend does exactly:

    1. unpack ``x`` and ``scale`` into 24-bit significands ``a``, ``b`` and
       exponents (subnormal ``x`` normalised with ``clz``);
    2. make ``b <= a < 2b`` and take 26 quotient bits, one per step, plus a
       sticky bit for a non-zero remainder;
    3. round to nearest even at bit 24 (further down for a subnormal result)
       and repack; overflow gives +-inf.

    Lanes where ``x`` is 0, inf or NaN, or ``scale`` is not a positive normal
    float32, use ``x / scale`` (exact for those, or the caller's problem).

    Args:
      x: float32 array.
      scale: float32, broadcastable to ``x``.

    Returns:
      float32 array of ``x``'s shape, bit-identical to numpy's ``x / scale``.
    """
    x = x.astype(jnp.float32)
    scale = jnp.broadcast_to(scale, x.shape).astype(jnp.float32)
    xb = jax.lax.bitcast_convert_type(x, jnp.int32)
    sb = jax.lax.bitcast_convert_type(scale, jnp.int32)
    sign = xb & jnp.int32(-(2**31))
    x_exp, x_frac = (xb & 0x7FFFFFFF) >> 23, xb & 0x7FFFFF
    subnormal = x_exp == 0
    norm_shift = jnp.where(subnormal, jax.lax.clz(x_frac) - 8, 0)
    a = jnp.where(subnormal, x_frac << norm_shift, x_frac | 0x800000)  # [2^23, 2^24)
    x_exp = jnp.where(subnormal, 1 - norm_shift, x_exp)
    b = (sb & 0x7FFFFF) | 0x800000  # [2^23, 2^24)
    below = a < b
    a = jnp.where(below, a << 1, a)  # now b <= a < 2b: the quotient is in [1, 2)
    biased_exp = x_exp - (sb >> 23) + 127 - below.astype(jnp.int32)
    q = jnp.zeros_like(a)
    for _ in range(26):  # 24 significand bits + 2 below them
        bit = a >= b
        q = (q << 1) | bit.astype(jnp.int32)
        a = jnp.where(bit, a - b, a) << 1
    bits = (q << 1) | (a != 0).astype(jnp.int32)  # 27 bits: quotient, then sticky
    exp_field = jnp.maximum(biased_exp, 1)  # a subnormal result has exponent field 0
    drop = jnp.minimum(3 + (exp_field - biased_exp), 28)  # bits below the last kept one
    kept = jax.lax.shift_right_logical(bits, drop)
    rest = bits & ((1 << drop) - 1)
    half = 1 << (drop - 1)
    kept = kept + ((rest > half) | ((rest == half) & ((kept & 1) == 1))).astype(jnp.int32)
    # The kept significand carries the implicit 1 (0x800000), so exponent and a
    # rounding carry add up; a subnormal result (exp_field 1, kept < 2^23) too.
    magnitude = ((jnp.minimum(exp_field, 255) - 1) << 23) + kept
    magnitude = jnp.minimum(magnitude, 0x7F800000)  # overflow: inf
    quotient = jax.lax.bitcast_convert_type(sign | magnitude, jnp.float32)
    regular = (
        jnp.isfinite(x) & (x != 0) & (sb >= 0x00800000) & (sb < 0x7F800000)  # scale normal, > 0
    )
    return jnp.where(regular, quotient, x / scale)


def quantize_fp8(x, scale, *, divide=ieee_divide):
    """``saturate(x / scale)`` in float32, rounded to nearest even, as float8_e4m3fn.

    Args:
      x: any float array.
      scale: float32, broadcastable to ``x``.
      divide: the float32 division: :func:`ieee_divide` (the default) for
        anything XLA executes; the GPU kernel passes ``div.rn.f32``.

    Returns:
      float8_e4m3fn array of ``x``'s shape. NaN stays NaN; values beyond
      +-448 (including +-inf) become +-448.
    """
    y = divide(x.astype(jnp.float32), scale)
    # Written as two selects, not jnp.clip: comparisons with NaN are false, so
    # NaN passes through unchanged on every lowering (min/max NaN semantics
    # differ between backends).
    y = jnp.where(y > FP8_MAX, FP8_MAX, y)
    y = jnp.where(y < -FP8_MAX, -FP8_MAX, y)
    return y.astype(FP8_DTYPE)


def _ptx_div_rn(x, y):
    """Correctly rounded float32 ``x / y`` inside a Pallas Triton kernel.

    Triton lowers float32 ``/`` to ``div.full.f32`` (up to 2 ulp off), which
    would move some quotients across an fp8 rounding boundary; ``div.rn.f32``
    is IEEE division, identical to XLA's and numpy's.
    """
    [q] = _backend.triton.elementwise_inline_asm(
        "div.rn.f32 $0, $1, $2;",
        args=[x, jnp.broadcast_to(y, x.shape)],
        constraints="=f,f,f",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)],
    )
    return q


# --------------------------------------------------------------------------
# Argument checks
# --------------------------------------------------------------------------


def _check_cache_dtype(name: str, cache, mode: str, input_name: str, input_dtype) -> None:
    if mode == "auto":
        if np.dtype(cache.dtype) != np.dtype(input_dtype):
            raise ValueError(
                f'{name} must have the dtype of {input_name} ({np.dtype(input_dtype)}) when '
                f'kv_cache_dtype="auto", got {np.dtype(cache.dtype)}'
            )
    elif np.dtype(cache.dtype) != np.dtype(FP8_DTYPE):
        raise ValueError(
            f"{name} must have dtype float8_e4m3fn for an fp8 kv_cache_dtype, got "
            f"{np.dtype(cache.dtype)} (view a uint8 cache with lax.bitcast_convert_type)"
        )


def _check_slot_mapping(slot_mapping, num_tokens: int, num_blocks: int, block_size: int):
    """Static and (when concrete) value checks; returns the slot mapping to use.

    A concrete int64 mapping is narrowed to int32 here, on the host, after the
    range check: without ``jax_enable_x64`` JAX would wrap it, and e.g.
    ``-2**32 + 5`` would become the valid slot 5.
    """
    validation.check_rank("slot_mapping", slot_mapping, 1)
    n = np.shape(slot_mapping)[0]
    if n > num_tokens:
        raise ValueError(
            f"slot_mapping must not be longer than the number of tokens: "
            f"{n=} > num_tokens={num_tokens}"
        )
    num_slots = num_blocks * block_size
    if num_slots > _INT32_MAX - 1:
        raise ValueError(
            f"num_blocks * block_size must be < {_INT32_MAX} (slots are int32 internally), "
            f"got {num_blocks} * {block_size} = {num_slots}"
        )
    slot_mapping = validation.check_ids(
        "slot_mapping", slot_mapping, num_slots,
        what=f"num_blocks={num_blocks} * block_size={block_size}")
    v = validation.concrete_values(slot_mapping)
    if v is None or v.size == 0:
        return slot_mapping
    uniq, counts = np.unique(v[v >= 0], return_counts=True)
    if (counts > 1).any():
        slot = int(uniq[np.argmax(counts > 1)])
        first, second = (int(i) for i in np.flatnonzero(v == slot)[:2])
        raise ValueError(
            f"slot_mapping must not repeat a valid slot (which token lands would be "
            f"unspecified); got slot {slot} at indices {first} and {second}"
        )
    return slot_mapping


def _scale_array(name: str, scale, sizes: Sequence[int]):
    """A float32 ``[size]`` array from a Python number or a float32 ``[]``/``[size]`` scale."""
    if scale is None:
        raise ValueError(f"{name} is required for an fp8 kv_cache_dtype, got None")
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        scale = np.float32(scale)
    validation.check_dtype(name, scale, np.float32)
    shape = tuple(np.shape(scale))
    allowed = [()] + [(s,) for s in dict.fromkeys(sizes)]
    if shape not in allowed:
        want = " or ".join("[" + ", ".join(map(str, a)) + "]" for a in allowed)
        raise ValueError(f"{name} must have shape {want}, got {list(shape)}")
    validation.check_fp8_scale(name, scale)
    return jnp.reshape(jnp.asarray(scale, jnp.float32), (-1,))


# --------------------------------------------------------------------------
# What gets written where (one description for all implementations)
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Segment:
    """Copy row ``t`` of source ``src`` into slot ``slot_mapping[t]`` of cache ``dst``.

    ``col`` is the first column of the cache's last axis that the row fills
    (``None``: the source row is the whole cache row).
    """

    src: int
    dst: int
    col: int | None = None


_FLASH_SEGMENTS = (_Segment(0, 0), _Segment(1, 1))


def _mla_segments(kv_lora_rank: int) -> tuple[_Segment, ...]:
    return (_Segment(0, 0, 0), _Segment(1, 0, kv_lora_rank))


# --------------------------------------------------------------------------
# Reference (plain XLA)
# --------------------------------------------------------------------------


@_backend.register(OP_WRITE, "reference")
def _reference_write(slot_mapping, sources, caches, scales, *, segments, config, interpret):
    """One drop-mode scatter per cache; an invalid slot maps to row ``num_slots``.

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


def _check_gpu_int32_offsets(name: str, shape) -> None:
    # Triton computes element offsets in int32.
    size = int(np.prod(shape))
    if size > _INT32_MAX:
        raise NotImplementedError(
            f"the GPU kernel indexes with int32 offsets; {name} has {size} elements "
            f"(shape {list(shape)}), more than {_INT32_MAX}"
        )


def _pow2_floor(n: int) -> int:
    return 1 << (max(int(n), 1).bit_length() - 1)


def _gpu_tokens_per_program(n: int, quantize: bool, cfg: KVWriteConfig) -> int:
    """Tokens one GPU program writes: enough programs to spread over the SMs
    (``cfg.gpu_min_programs`` where ``n`` allows), at most
    ``cfg.gpu_max_tokens_per_program`` (``gpu_fp8_...`` when quantising)."""
    if cfg.gpu_tokens_per_program is not None:
        return cfg.gpu_tokens_per_program
    most = cfg.gpu_fp8_max_tokens_per_program if quantize else cfg.gpu_max_tokens_per_program
    return int(min(most, _pow2_floor(n // cfg.gpu_min_programs)))


def _gpu_num_warps(tile: int, itemsize: int, cfg: KVWriteConfig, fp8_decode: bool = False) -> int:
    """Warps that give each thread 16 bytes of a ``tile``-wide row of ``itemsize`` elements,
    or (``fp8_decode``: quantising fewer than ``gpu_min_programs`` tokens)
    ``cfg.gpu_fp8_columns_per_thread`` columns; at most 8."""
    if cfg.gpu_num_warps is not None:
        return cfg.gpu_num_warps
    per_warp = 32 * cfg.gpu_fp8_columns_per_thread if fp8_decode else 32 * 16 // itemsize
    return int(min(8, max(1, tile // per_warp)))


@_backend.register(OP_WRITE, "gpu")
def _gpu_write(slot_mapping, sources, caches, scales, *, segments, config, interpret):
    """Pallas Triton kernel on 2-D views: sources ``[T, W_s]``, caches ``[num_slots, W_d]``.

    Program ``(p, j)`` writes tokens ``p * bt .. p * bt + bt - 1`` (``bt`` from
    :func:`_gpu_tokens_per_program`), columns ``[j * tile_s, (j + 1) * tile_s)``
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
        _check_gpu_int32_offsets(f"cache {k}", c.shape)
    widths = [s.shape[1] for s in flat_src]
    quantize = scales is not None
    # fp8 at decode sizes (fewer tokens than gpu_min_programs): narrow tiles, more warps.
    fp8_decode = quantize and n < config.gpu_min_programs
    max_tile = config.gpu_fp8_max_tile if fp8_decode else config.gpu_max_tile
    tiles = [int(min(max_tile, pl.next_power_of_2(w))) for w in widths]
    num_col_tiles = max(pl.cdiv(w, t) for w, t in zip(widths, tiles))
    bt = _gpu_tokens_per_program(n, quantize, config)
    num_warps = _gpu_num_warps(
        max(tiles), max(np.dtype(s.dtype).itemsize for s in flat_src), config, fp8_decode)
    # Columns per scale value of each source: its last axis (D, or all of L / R).
    groups = [s.shape[-1] for s in sources]
    scale_args = [s.reshape(-1, g)[:, 0] for s, g in zip(scales, groups)] if quantize else []
    divide = ieee_divide if interpret else _ptx_div_rn
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
    _check_cache_dtype("key_cache", key_cache, mode, "key", key.dtype)
    validation.check_dtype("value_cache", value_cache, np.dtype(key_cache.dtype))
    slot_mapping = _check_slot_mapping(slot_mapping, num_tokens, num_blocks, block_size)
    if mode == "auto":
        return slot_mapping, None
    # [], [1] or [H] -> [H, D]: one scale per element of a token's row.
    scales = tuple(
        jnp.broadcast_to(_scale_array(name, s, (1, num_heads))[:, None], (num_heads, head_size))
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
    _check_cache_dtype("kv_cache", kv_cache, mode, "kv_c", kv_c.dtype)
    num_blocks, block_size = np.shape(kv_cache)[:2]
    slot_mapping = _check_slot_mapping(slot_mapping, num_tokens, num_blocks, block_size)
    if mode == "auto":
        return slot_mapping, None
    s = _scale_array("scale", scale, (1,))
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
      backend, interpret: see :mod:`pallas_kernels._backend`.
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
        segments=_FLASH_SEGMENTS,
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
      backend, interpret: see :mod:`pallas_kernels._backend`.
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
        segments=_mla_segments(kv_c.shape[1]),
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
