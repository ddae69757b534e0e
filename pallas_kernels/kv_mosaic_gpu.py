"""Mosaic GPU flavour (``backend="mosaic_gpu"``) of the flash KV write and of block zeroing.

Same contracts as :func:`pallas_kernels.kv_write.reshape_and_cache_flash` and
:func:`pallas_kernels.block_zero.zero_blocks` (slot / id masking included); this module
only registers the ``"mosaic_gpu"`` implementations of their ops. Needs JAX >= 0.11 on an
NVIDIA GPU of compute capability >= 9.0 (bulk async copies); :func:`pallas_kernels.backend.resolve`
rejects the backend elsewhere.

In place: ``plgpu.kernel`` takes no ``input_output_aliases``, so each cache is wrapped in a
mutable ``jax.new_ref``, the kernel writes the Refs (``out_type=()``), and the updated
values are read back from the Refs; under a jit that donates the caches, XLA keeps the
donated buffers (no copy).

KV write (flash layout; ``concat_and_cache_mla`` runs the reference on this flavour):
a 1-D grid of CTAs, one warpgroup each, ``bt`` tokens per CTA. Per token, its slot is
read as a scalar from global memory, and its K and V rows (``[H, D]``, contiguous in the
source and in the cache) go global -> shared -> global by bulk async copies. The loads
are predicated on ``t < N`` only (they start while the slot is read), the stores on the
token being live (``t < N``, ``0 <= slot < num_slots``): a skipped token stores nothing,
and a token past ``N`` loads nothing (its barrier completes at once). fp8: rows of a multiple of
128 elements are quantised in the kernel (shared memory -> registers -> fp8 stage), with
:func:`pallas_kernels.fp8.quantize_fp8`'s arithmetic, when ``KVWriteConfig.mosaic_fp8_in_kernel``
(:func:`fp8_in_kernel`); other rows are quantised by XLA before the kernel. Either way the
cache bytes equal the reference's.

Block zeroing: a zero-filled shared-memory buffer per element width; a 2-D grid of CTAs
(id, group of arrays, :func:`array_groups`), each storing the buffer by bulk copies over
every kernel block of its id in each array of its group (arrays viewed as
same-width unsigned ints ``[num_kernel_blocks, E]``), predicated on the id being live
(not padding, not the null block, in range).

Limits (``NotImplementedError`` at trace time): a K/V row and a kernel block of a zeroed
array must each be a multiple of 16 bytes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import backend as _backend
from pallas_kernels import contract as validation
from pallas_kernels.block_zero import OP_ZERO
from pallas_kernels.contract import NULL_BLOCK_ID
from pallas_kernels.fp8 import quantize_fp8
from pallas_kernels.gpu_tiling import UINT_OF_WIDTH
from pallas_kernels.kv_write import OP_WRITE, reference_write
from pallas_kernels.segments import FLASH_SEGMENTS

__all__ = ["ROW_BYTES_MULTIPLE", "ZERO_CHUNK_BYTES", "tokens_per_cta"]

# Bulk async copies move multiples of 16 bytes between 16-byte aligned addresses: a K/V
# row (and a kernel block of a zeroed array) must be a multiple of this many bytes.
ROW_BYTES_MULTIPLE = 16
_BULK_ALIGN = ROW_BYTES_MULTIPLE
# Bytes of the shared-memory zeros buffer (one per element width) of the zeroing kernel.
ZERO_CHUNK_BYTES = 16384
_GRID_AXIS = "cta"
_GROUP_AXIS = "group"
# The zeroing kernel splits the arrays over CTAs until a call has about this many CTAs.
ZERO_MIN_CTAS = 512


def tokens_per_cta(n: int) -> int:
    """Tokens one CTA writes: 1 up to 511 tokens, then 2, 4, 8 (at most 8) so that a call
    keeps at least 256 CTAs."""
    per = max(1, n // 256)
    return int(min(8, 1 << (per.bit_length() - 1)))


def array_groups(num_ids: int, num_arrays: int) -> int:
    """Groups of arrays the zeroing kernel spreads over CTAs: 1 (one CTA per id zeroes every
    array) when the ids alone give :data:`ZERO_MIN_CTAS` CTAs, up to one group per array."""
    return int(min(num_arrays, max(1, -(-ZERO_MIN_CTAS // max(num_ids, 1)))))


# --------------------------------------------------------------------------
# KV write
# --------------------------------------------------------------------------


def fp8_in_kernel(row_shape, config) -> bool:
    """Whether the fp8 quantisation runs in the kernel (else XLA quantises before it): when
    ``config.mosaic_fp8_in_kernel`` and a row has a multiple of 128 elements (one register
    layout over the warpgroup's 128 threads)."""
    return bool(config.mosaic_fp8_in_kernel) and int(np.prod(row_shape)) % 128 == 0


@_backend.register(OP_WRITE, "mosaic_gpu")
def _mosaic_write(slot_mapping, sources, caches, scales, *, segments, config, interpret):
    if segments != FLASH_SEGMENTS:  # the MLA layout: no Mosaic kernel, the reference
        return reference_write(slot_mapping, sources, caches, scales, segments=segments,
                                config=config, interpret=interpret)
    n = slot_mapping.shape[0]
    num_blocks, block_size = caches[0].shape[:2]
    num_slots = num_blocks * block_size
    row_shape = tuple(caches[0].shape[2:])
    quantize = scales is not None and fp8_in_kernel(row_shape, config)
    if scales is not None and not quantize:  # quantised by XLA, the reference's arithmetic
        sources = tuple(quantize_fp8(s[:n], sc) for s, sc in zip(sources, scales))
    for dt in {np.dtype(sources[0].dtype), np.dtype(caches[0].dtype)}:
        row_bytes = int(np.prod(row_shape)) * dt.itemsize
        if row_bytes % ROW_BYTES_MULTIPLE:
            raise NotImplementedError(
                f"the mosaic_gpu KV write copies whole [H, D] rows whose bytes must be a "
                f"multiple of {ROW_BYTES_MULTIPLE}; got H, D = {row_shape} of {dt} "
                f"({row_bytes} bytes)")
    if slot_mapping.dtype != jnp.int32:  # a traced int64 mapping: masked before narrowing
        slot_mapping = validation.live_ids(slot_mapping, num_slots)
    bt = config.mosaic_tokens_per_cta or tokens_per_cta(n)
    num_ctas = pl.cdiv(n, bt)
    scale_args = list(scales) if quantize else []

    def body(slots_ref, k_ref, v_ref, *refs):
        # slots_ref GMEM i32[N]; k_ref / v_ref GMEM [T, H, D];
        # fp8 in kernel only: k_scale / v_scale GMEM f32[H, D];
        # kc_ref / vc_ref the caches (mutable Refs) [num_blocks, block_size, H, D];
        # k_smem / v_smem SMEM [bt, H, D] (source dtype);
        # fp8 in kernel only: kq_smem / vq_smem SMEM fp8[bt, H, D], scale_smem f32[2, H, D];
        # bars: one barrier per token row (its K and V loads), then the scales' barrier.
        if quantize:
            ks_ref, vs_ref, kc_ref, vc_ref, k_smem, v_smem, kq_smem, vq_smem, scale_smem, bars = refs
        else:
            kc_ref, vc_ref, k_smem, v_smem, bars = refs
        first = jax.lax.axis_index(_GRID_AXIS) * bt
        tokens = [first + i for i in range(bt)]
        in_batch = [t < n for t in tokens]
        # The row loads depend only on t < N, so they start while the slots are read.
        for i, (t, inb) in enumerate(zip(tokens, in_batch)):
            row = jnp.where(inb, t, 0)
            for src, stage in ((k_ref, k_smem), (v_ref, v_smem)):
                plgpu.copy_gmem_to_smem(
                    src.at[row], stage.at[i], bars.at[i], predicate=inb,
                    oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)
        if quantize:
            for j, sc in enumerate((ks_ref, vs_ref)):
                plgpu.copy_gmem_to_smem(sc, scale_smem.at[j], bars.at[bt],
                                        oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)
        live, blk, off = [], [], []
        for t, inb in zip(tokens, in_batch):
            slot = slots_ref[jnp.where(inb, t, 0)]
            ok = inb & (slot >= 0) & (slot < num_slots)
            s = jnp.where(ok, slot, 0)  # skipped stores keep in-range addresses
            live.append(ok)
            blk.append(jax.lax.div(s, jnp.int32(block_size)))
            off.append(jax.lax.rem(s, jnp.int32(block_size)))
        if quantize:
            plgpu.barrier_wait(bars.at[bt])
            stores = ((kq_smem, kc_ref), (vq_smem, vc_ref))
        else:
            stores = ((k_smem, kc_ref), (v_smem, vc_ref))
        for i in range(bt):
            plgpu.barrier_wait(bars.at[i])
            if quantize:
                for j, (stage, q) in enumerate(((k_smem, kq_smem), (v_smem, vq_smem))):
                    q.at[i][...] = quantize_fp8(stage.at[i][...], scale_smem.at[j][...],
                                                divide=jnp.divide)
                plgpu.commit_smem()
            for stage, dst in stores:
                plgpu.copy_smem_to_gmem(stage.at[i], dst.at[blk[i], off[i]], predicate=live[i])
        plgpu.wait_smem_to_gmem(0)

    scratch = [plgpu.SMEM((bt,) + row_shape, sources[0].dtype)] * 2
    if quantize:
        scratch += [plgpu.SMEM((bt,) + row_shape, caches[0].dtype)] * 2
        scratch += [plgpu.SMEM((2,) + row_shape, jnp.float32)]
    scratch += [plgpu.Barrier(num_arrivals=2, num_barriers=bt + quantize)]
    kernel = plgpu.kernel(
        body,
        out_type=(),
        scratch_types=scratch,
        grid=(num_ctas,),
        grid_names=(_GRID_AXIS,),
        kernel_name="kv_write_mosaic_gpu",
    )
    refs = [jax.new_ref(c) for c in caches]
    kernel(slot_mapping, sources[0], sources[1], *scale_args, *refs)
    return tuple(r[...] for r in refs)


# --------------------------------------------------------------------------
# Block zeroing
# --------------------------------------------------------------------------


def _unsigned(a):
    """``a`` bitcast to the unsigned int of its width (the zeros buffers' dtypes)."""
    u = UINT_OF_WIDTH[np.dtype(a.dtype).itemsize]
    return a if a.dtype == u else jax.lax.bitcast_convert_type(a, u)


@_backend.register(OP_ZERO, "mosaic_gpu")
def _mosaic_zero(block_ids, arrays, *, r, config, interpret):
    del config, interpret
    num_kernel_blocks = arrays[0].shape[0]
    num_logical_blocks = num_kernel_blocks // r
    views = [_unsigned(a).reshape(num_kernel_blocks, -1) for a in arrays]
    for k, v in enumerate(views):
        block_bytes = v.shape[1] * np.dtype(v.dtype).itemsize
        if block_bytes % _BULK_ALIGN:
            raise NotImplementedError(
                f"the mosaic_gpu zeroing kernel stores whole kernel blocks whose bytes must "
                f"be a multiple of {_BULK_ALIGN}; caches[{k}] has {block_bytes}")
    if block_ids.dtype != jnp.int32:
        block_ids = validation.live_block_ids(block_ids, num_logical_blocks)
    widths = sorted({np.dtype(v.dtype).itemsize for v in views})
    chunk = {w: ZERO_CHUNK_BYTES // w for w in widths}  # elements of each zeros buffer
    n_arr = len(views)
    groups = array_groups(block_ids.shape[0], n_arr)

    def body(ids_ref, *refs):
        # ids_ref GMEM int32[N]; refs: n_arr mutable Refs [num_kernel_blocks, E_a], then one
        # SMEM zeros buffer per element width (ascending). CTA (i, g) zeroes id i in the
        # arrays of group g (arrays a with a * groups // n_arr == g).
        out_refs, zero_refs = refs[:n_arr], dict(zip(widths, refs[n_arr:]))
        for w in widths:
            zero_refs[w][...] = jnp.zeros((chunk[w],), zero_refs[w].dtype)
        plgpu.commit_smem()
        b = ids_ref[jax.lax.axis_index(_GRID_AXIS)]
        live = (b > NULL_BLOCK_ID) & (b < num_logical_blocks)
        first = jnp.where(live, b, 0) * r
        group = jax.lax.axis_index(_GROUP_AXIS)

        def zero_group(g):
            for a in range(n_arr):
                if a * groups // n_arr != g:
                    continue
                out, width = out_refs[a], views[a].shape[1]
                zeros = zero_refs[np.dtype(views[a].dtype).itemsize]
                step = chunk[np.dtype(views[a].dtype).itemsize]
                for j in range(r):
                    for start in range(0, width, step):
                        size = min(step, width - start)
                        plgpu.copy_smem_to_gmem(
                            zeros.at[pl.ds(0, size)], out.at[first + j, pl.ds(start, size)],
                            predicate=live)

        if groups == 1:
            zero_group(0)
        for g in range(groups if groups > 1 else 0):
            pl.when(group == g)(lambda g=g: zero_group(g))
        plgpu.wait_smem_to_gmem(0)

    kernel = plgpu.kernel(
        body,
        out_type=(),
        scratch_types=[plgpu.SMEM((chunk[w],), UINT_OF_WIDTH[w]) for w in widths],
        grid=(block_ids.shape[0], groups),
        grid_names=(_GRID_AXIS, _GROUP_AXIS),
        kernel_name="zero_blocks_mosaic_gpu",
    )
    refs = [jax.new_ref(v) for v in views]
    kernel(block_ids, *refs)
    return tuple(
        jax.lax.bitcast_convert_type(ref[...].reshape(a.shape), a.dtype)
        for ref, a in zip(refs, arrays)
    )

