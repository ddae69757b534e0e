"""Zero freshly allocated KV blocks in every cache array, in one launch.

The JAX counterpart of vLLM's ``KVBlockZeroer`` (``vllm/v1/worker/utils.py``,
PR 43990): a block handed to a new owner may hold bytes that read as NaN/Inf
(for instance fp32 SSM state reinterpreted as fp8 KV), and attention kernels
that read whole pages turn them into NaN through ``0 * NaN``. The runner
therefore zeroes every newly allocated block before its first use.

Block ids are *logical* (allocator) ids. With ``kernel_blocks_per_block = r``,
each cache array's axis 0 counts kernel blocks and logical block ``b`` covers
kernel blocks ``b*r .. b*r + r - 1``; all of them are zeroed. An id ``< 0`` is
padding and zeroes nothing; the null block ``NULL_BLOCK_ID = 0`` and an id
``>= num_kernel_blocks // r`` are a ``ValueError`` when concrete and zero
nothing under ``jit``. Repeated ids are
allowed (zeroing twice is harmless). Nothing else of any array changes.

All arrays must have the same axis-0 size (every layer's K and V cache has the
same number of blocks in a vLLM-style pool); their dtypes and trailing shapes
may differ. Zero means all bits zero (``+0.0`` for floats).

Implementations:

* reference: one ``.at[rows].set(0, mode="drop")`` per array (through an unsigned
  view for 2-byte floats, see ``pallas_kernels._xla.scatter_set``).
* TPU (Mosaic): ids in SMEM via scalar prefetch, arrays left in HBM and
  aliased to the outputs; per valid id one DMA per array from an HBM zeros
  buffer of ``r`` kernel blocks. A padding id issues no DMA.
* GPU (Pallas Triton): arrays viewed as ``[num_logical_blocks, r * page]`` of
  same-width unsigned ints, grid (id, column tile), masked zero stores; the id
  range check runs in the kernel, so a call is one launch.

Either Pallas flavour is a single ``pallas_call`` for all arrays.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import contract as validation
from pallas_kernels import backend as _backend
from pallas_kernels import gpu_tiling
from pallas_kernels.contract import NULL_BLOCK_ID
from pallas_kernels._xla import scatter_set
from pallas_kernels.gpu_tiling import UINT_OF_WIDTH

__all__ = ["ZeroBlocksConfig", "zero_blocks", "zero_blocks_reference"]

OP_ZERO = "zero_blocks"


@dataclasses.dataclass(frozen=True)
class ZeroBlocksConfig:
    """Tuning knobs of the GPU zeroing kernel (a static argument; defaults: BENCHMARKS.md,
    "Kernel design notes").

    Attributes:
      gpu_max_tile_bytes, gpu_min_tile_bytes: bounds on the bytes of each array
        one program zeroes (a power of two).
      gpu_min_programs: aim for at least this many programs per call.
      gpu_max_programs: at most this many programs per call: each program then zeroes every
        ``P``-th column tile of its id's row (``P`` programs per id), and a program whose id
        names nothing (padding, the common case in a decode step) exits at once.
      gpu_tile_bytes, gpu_num_warps: fixed values instead of the rules.
    """

    gpu_max_tile_bytes: int = 8192
    gpu_min_tile_bytes: int = 2048
    gpu_min_programs: int = 512
    gpu_max_programs: int = 8192
    gpu_tile_bytes: int | None = None
    gpu_num_warps: int | None = None

    def __post_init__(self):
        validation.check_config_ints(self, ("gpu_max_tile_bytes", "gpu_min_tile_bytes", "gpu_tile_bytes"))


def _uint_view(a):
    """``a`` as same-width unsigned ints (a bitcast, no copy)."""
    if jnp.issubdtype(a.dtype, jnp.integer):
        return a
    return jax.lax.bitcast_convert_type(a, UINT_OF_WIDTH[np.dtype(a.dtype).itemsize])


# --------------------------------------------------------------------------
# Reference (plain XLA)
# --------------------------------------------------------------------------


@_backend.register(OP_ZERO, "reference")
def _reference_zero(block_ids, arrays, *, r, config, interpret):
    del config, interpret
    num_kernel_blocks = arrays[0].shape[0]
    ids = validation.live_block_ids(block_ids, num_kernel_blocks // r)
    # [N, r] kernel-block rows; padding goes to row num_kernel_blocks (dropped).
    rows = ids[:, None] * r + jnp.arange(r, dtype=jnp.int32)[None, :]
    rows = jnp.where(ids[:, None] >= 0, rows, num_kernel_blocks).reshape(-1)
    # In place under donation where XLA scatters the dtype natively (XLA:CPU
    # upcasts bfloat16/float8 arrays around a scatter: a copy XLA makes).
    return tuple(scatter_set(a, rows, jnp.zeros((), a.dtype)) for a in arrays)


# --------------------------------------------------------------------------
# TPU (Mosaic): scalar-prefetched ids, DMA from an HBM zeros buffer
# --------------------------------------------------------------------------


@_backend.register(OP_ZERO, "tpu")
def _tpu_zero(block_ids, arrays, *, r, config, interpret):
    del config
    num_kernel_blocks = arrays[0].shape[0]
    ids = validation.live_block_ids(block_ids, num_kernel_blocks // r)
    # One zeros buffer of r kernel blocks per distinct (dtype, block shape);
    # K and V of every layer usually share one.
    kinds = list(dict.fromkeys((np.dtype(a.dtype), a.shape[1:]) for a in arrays))
    zeros = [jnp.zeros((r,) + shape, dtype) for dtype, shape in kinds]
    zeros_of = [kinds.index((np.dtype(a.dtype), a.shape[1:])) for a in arrays]
    n_zeros, n_arr = len(zeros), len(arrays)

    def kernel(ids_ref, *refs):
        # Prefetch: ids_ref  SMEM i32[N] (-1 = skip)
        # Inputs:   zeros    HBM [r, *block_shape], one per kind
        #           arrays   HBM (aliased to the outputs; not read)
        # Outputs:  arrays   HBM [num_kernel_blocks, *block_shape]
        # Scratch:  sems     DMA semaphores, one per array
        zero_refs = refs[:n_zeros]
        out_refs = refs[n_zeros + n_arr : n_zeros + 2 * n_arr]
        sems = refs[-1]
        b = ids_ref[pl.program_id(0)]

        def copies():
            first = b * r
            return [
                pltpu.make_async_copy(zero_refs[zeros_of[a]], out.at[pl.ds(first, r)], sems.at[a])
                for a, out in enumerate(out_refs)
            ]

        @pl.when(b >= 0)
        def _zero_logical_block():
            cs = copies()
            for c in cs:
                c.start()
            for c in cs:
                c.wait()

    hbm = pl.BlockSpec(memory_space=pl.ANY)
    call = pl.pallas_call(
        kernel,
        out_shape=tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(ids.shape[0],),
            in_specs=[hbm] * (n_zeros + n_arr),
            out_specs=tuple([hbm] * n_arr),
            scratch_shapes=[pltpu.SemaphoreType.DMA((n_arr,))],
        ),
        input_output_aliases={1 + n_zeros + a: a for a in range(n_arr)},
        # Repeated ids may target one block from two steps: keep steps ordered.
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=interpret,
        name="zero_blocks_tpu",
    )
    return tuple(call(ids, *zeros, *arrays))


# --------------------------------------------------------------------------
# GPU (Pallas Triton): masked zero stores on [num_logical_blocks, r * page] views
# --------------------------------------------------------------------------


def _gpu_zero_views(arrays, num_logical_blocks):
    views = [_uint_view(a).reshape(num_logical_blocks, -1) for a in arrays]
    for k, v in enumerate(views):
        gpu_tiling.check_int32_offsets(f"caches[{k}]", v.shape)
    return views


def _gpu_zero_tile_bytes(num_ids: int, row_bytes: int, cfg: ZeroBlocksConfig) -> int:
    """Bytes of each array one program zeroes: about ``cfg.gpu_min_programs``
    programs per call, within ``[gpu_min_tile_bytes, gpu_max_tile_bytes]``."""
    if cfg.gpu_tile_bytes is not None:
        return cfg.gpu_tile_bytes
    want = row_bytes * num_ids // cfg.gpu_min_programs
    tile = 1 << max(int(want), 1).bit_length() - 1
    return int(min(cfg.gpu_max_tile_bytes, max(cfg.gpu_min_tile_bytes, tile)))


@_backend.register(OP_ZERO, "gpu")
def _gpu_zero(block_ids, arrays, *, r, config, interpret):
    """Programs ``(id, p)``, ``P`` per id; program ``p`` stores zeros into column tiles ``p,
    p + P, ...`` of its id's row in every array, or nothing at all when the id names no block.

    The id's range check runs in the kernel (one launch per call, no XLA pass
    over the ids). Each array's tile is ``tile_bytes`` of its row (fewer when
    the row is shorter), and the warps are sized so that a thread stores 16
    bytes at a time. ``P`` is the column tiles of the widest row, capped so that the call has
    at most ``config.gpu_max_programs`` programs: a launch of one program per tile costs the
    grid's size even where every id is padding (a decode step's), and a wide row (every
    layer's state of a slot in one pool) has thousands of tiles.
    """
    num_kernel_blocks = arrays[0].shape[0]
    num_logical_blocks = num_kernel_blocks // r
    views = _gpu_zero_views(arrays, num_logical_blocks)
    widths = [v.shape[1] for v in views]
    sizes = [np.dtype(v.dtype).itemsize for v in views]
    n = block_ids.shape[0]
    tile_bytes = _gpu_zero_tile_bytes(n, max(w * s for w, s in zip(widths, sizes)), config)
    # at least one element (a tile of fewer bytes than an element: one element)
    tiles = [int(min(max(1, tile_bytes // s), pl.next_power_of_2(w))) for w, s in zip(widths, sizes)]
    num_col_tiles = max(pl.cdiv(w, t) for w, t in zip(widths, tiles))
    P = int(max(1, min(num_col_tiles, config.gpu_max_programs // n)))  # programs per id
    per = pl.cdiv(num_col_tiles, P)  # column tiles per program
    num_warps = config.gpu_num_warps or int(min(8, max(1, tile_bytes // (32 * 16))))

    def kernel(ids_ref, *refs):
        # Inputs:  ids_ref int[N] (raw ids); views [num_logical_blocks, W_a] (aliased)
        # Outputs: views
        out_refs = refs[len(views) :]
        i, p = pl.program_id(0), pl.program_id(1)
        b = ids_ref[i]
        live = (b > NULL_BLOCK_ID) & (b < num_logical_blocks)

        @pl.when(live)
        def _zero_the_row():
            row = b.astype(jnp.int32)

            def column_tile(k, carry):
                j = p + k * P
                for out, width, tile in zip(out_refs, widths, tiles):
                    start = j * tile
                    cols = start + jnp.arange(tile, dtype=jnp.int32)
                    zeros = jnp.zeros((tile,), out.dtype)
                    _backend.triton.store(out.at[row, pl.ds(start, tile)], zeros, mask=cols < width)
                return carry

            jax.lax.fori_loop(0, per, column_tile, 0)

    call = pl.pallas_call(
        kernel,
        out_shape=tuple(jax.ShapeDtypeStruct(v.shape, v.dtype) for v in views),
        grid=(n, P),
        input_output_aliases={1 + a: a for a in range(len(views))},
        compiler_params=_backend.gpu_compiler_params(num_warps),
        interpret=interpret,
        name="zero_blocks_gpu",
    )
    outs = call(block_ids, *views)
    return tuple(
        jax.lax.bitcast_convert_type(o.reshape(a.shape), a.dtype) for o, a in zip(outs, arrays)
    )


# --------------------------------------------------------------------------
# Dispatch and public API
# --------------------------------------------------------------------------


def _check(caches, block_ids, r):
    """Static checks, plus the id range check where concrete; returns the ids to use."""
    if not isinstance(caches, (list, tuple)):
        raise ValueError(f"caches must be a list or tuple of arrays, got {type(caches).__name__}")
    r = validation.static_int("kernel_blocks_per_block", r)
    validation.check_rank("block_ids", block_ids, 1)
    validation.check_dtype("block_ids", block_ids, (np.int32, np.int64))
    if not caches:
        return block_ids
    for k, a in enumerate(caches):
        if np.ndim(a) < 1:
            raise ValueError(f"caches[{k}] must have rank >= 1, got shape {list(np.shape(a))}")
        dt = np.dtype(a.dtype)
        if not (jnp.issubdtype(dt, jnp.floating) or jnp.issubdtype(dt, jnp.integer)):
            raise ValueError(f"caches[{k}] must have a float or integer dtype, got {dt}")
    num_kernel_blocks = np.shape(caches[0])[0]
    for k, a in enumerate(caches):
        if np.shape(a)[0] != num_kernel_blocks:
            raise ValueError(
                f"caches must all have the same axis-0 size (kernel blocks); "
                f"caches[0] has {num_kernel_blocks}, caches[{k}] has {np.shape(a)[0]} "
                f"(shape {list(np.shape(a))})"
            )
    num_logical_blocks, rem = divmod(num_kernel_blocks, r)
    if rem:
        raise ValueError(
            f"the caches' axis-0 size must be a multiple of kernel_blocks_per_block; "
            f"got {num_kernel_blocks=} and kernel_blocks_per_block={r}"
        )
    v = validation.concrete_values(block_ids)
    if v is not None and (v == NULL_BLOCK_ID).any():
        i = int(np.flatnonzero(v == NULL_BLOCK_ID)[0])
        raise ValueError(
            f"block_ids must not contain the null block {NULL_BLOCK_ID} (never allocated, "
            f"never written); got it at index {i}"
        )
    return validation.check_ids(
        "block_ids", block_ids, num_logical_blocks,
        what=f"num_kernel_blocks={num_kernel_blocks} // kernel_blocks_per_block={r}")


def zero_blocks(
    caches,  # list | tuple of [num_kernel_blocks, ...] arrays
    block_ids,  # int32 | int64 [N] logical block ids, < 0 = padding
    *,
    kernel_blocks_per_block: int = 1,
    backend: str = "auto",
    interpret: bool | None = None,
    config: ZeroBlocksConfig = ZeroBlocksConfig(),
):
    """Zero logical blocks ``block_ids`` (all ``r`` kernel sub-blocks) in every array.

    Args:
      caches: list or tuple of float/integer arrays, all with the same axis-0
        size ``num_kernel_blocks`` (a multiple of ``r``); trailing shapes and
        dtypes may differ (K and V of every layer, say).
      block_ids: int32 (or int64) ``[N]`` logical block ids; ``< 0`` is padding.
      kernel_blocks_per_block: ``r``, kernel blocks per logical block.
      backend, interpret: see :mod:`pallas_kernels.backend`.
      config: :class:`ZeroBlocksConfig` tuning knobs (static).

    Returns:
      The arrays, updated, in the same container type. Donate them to update in
      place. Kernel blocks ``b*r .. b*r + r - 1`` of each valid id ``b`` are all
      bits zero; every other byte is unchanged.

    Raises:
      ValueError: bad container, shapes, dtypes or ``r`` (at trace time), or a
        concrete id equal to ``NULL_BLOCK_ID`` or ``>= num_kernel_blocks // r``.
    """
    choice = _backend.choose(OP_ZERO, backend, interpret)
    block_ids = _check(caches, block_ids, kernel_blocks_per_block)
    if not isinstance(config, ZeroBlocksConfig):
        raise ValueError(f"config must be a ZeroBlocksConfig, got {config!r}")
    if np.shape(block_ids)[0] == 0 or not caches:
        out = tuple(caches)
    else:
        out = _backend.run(OP_ZERO, choice, block_ids, tuple(caches),
                           r=int(kernel_blocks_per_block), config=config)
    if isinstance(caches, list):
        return list(out)
    return caches._make(out) if hasattr(caches, "_make") else type(caches)(out)


def zero_blocks_reference(caches, block_ids, *, kernel_blocks_per_block: int = 1):
    """Plain-XLA :func:`zero_blocks` (same contract and checks)."""
    return zero_blocks(
        caches, block_ids, kernel_blocks_per_block=kernel_blocks_per_block, backend="reference"
    )
