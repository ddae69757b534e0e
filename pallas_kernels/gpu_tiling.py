"""Launch rules shared by the GPU (Pallas Triton and Mosaic GPU) kernels of several ops.

How many tokens a program writes, how many warps it runs, how much shared memory a
program's tiles may take on the GPU at hand, the int32 element-offset bound of Triton's
addressing, and the unsigned views that the zeroing kernels store through. The numbers
(``KVWriteConfig``'s defaults) are BENCHMARKS.md's "Kernel design notes"; ``config``
arguments are any object with ``KVWriteConfig``'s ``gpu_*`` fields.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from pallas_kernels import backend
from pallas_kernels.contract import INT32_MAX

__all__ = [
    "SHARED_MEMORY_FRACTION",
    "UINT_OF_WIDTH",
    "check_int32_offsets",
    "device_shared_memory_budget",
    "num_warps",
    "pow2_floor",
    "shared_memory_budget",
    "shared_memory_per_block",
    "tokens_per_program",
]

# Same-width unsigned ints, by element width in bytes: the GPU zeroing kernels store
# integer zeros through these views, which every lowering supports for every width
# (float8 constants it may not).
UINT_OF_WIDTH = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def check_int32_offsets(name: str, shape) -> None:
    """``NotImplementedError`` unless an array of ``shape`` is addressable with int32 offsets.

    Triton computes element offsets in int32.
    """
    size = int(np.prod(shape))
    if size > INT32_MAX:
        raise NotImplementedError(
            f"the GPU kernel indexes with int32 offsets; {name} has {size} elements "
            f"(shape {list(shape)}), more than {INT32_MAX}"
        )


#: The share of a block's shared memory a kernel's tile rule may plan for: the rest is headroom
#: for Triton's own buffers (layout conversions, reductions). Hopper's 227 KiB gives 192 KiB,
#: the budget the H100 / H200 measurements were made with.
SHARED_MEMORY_FRACTION = 0.85


def shared_memory_per_block(capability: tuple[int, ...] | None) -> int:
    """Bytes of shared memory one thread block may use (CUDA's opt-in maximum) on a GPU of compute
    ``capability`` ``(major, minor)``: 227 KiB on Hopper and the data-centre Blackwells (9.x,
    10.x), 163 KiB on the A100 and Orin (8.0, 8.7), 99 KiB on the other 8.x and 12.x parts (RTX,
    A10, L4, L40) and later ones not named here, 96 KiB on Volta (7.0, 7.2), 64 KiB on Turing
    (7.5), 48 KiB before. None (no CUDA device: a CPU, interpret mode, lowering for CUDA from
    a CPU host): Hopper's."""
    KiB = 1024
    if capability is None:
        return 227 * KiB
    major, minor = (tuple(capability) + (0,))[:2]
    if major in (9, 10):
        return 227 * KiB
    if (major, minor) in ((8, 0), (8, 7)):
        return 163 * KiB
    if major < 7:
        return 48 * KiB
    if major == 7:
        return 64 * KiB if minor >= 5 else 96 * KiB
    return 99 * KiB


def shared_memory_budget(capability: tuple[int, ...] | None) -> int:
    """The bytes a tile rule may plan one program's tiles for: :data:`SHARED_MEMORY_FRACTION` of
    :func:`shared_memory_per_block`, rounded down to whole KiB (Hopper: 192 KiB)."""
    return int(shared_memory_per_block(capability) * SHARED_MEMORY_FRACTION) // 1024 * 1024


def device_shared_memory_budget() -> int:
    """:func:`shared_memory_budget` of the GPU JAX runs on (:func:`backend.gpu_capability`;
    Hopper's where there is no CUDA device): what the GPU kernels' tile rules plan for."""
    return shared_memory_budget(backend.gpu_capability()[1])


def pow2_floor(n: int) -> int:
    """The largest power of two ``<= max(n, 1)``."""
    return 1 << (max(int(n), 1).bit_length() - 1)


def tokens_per_program(n: int, quantize: bool, cfg) -> int:
    """Tokens one GPU program writes: enough programs to spread over the SMs
    (``cfg.gpu_min_programs`` where ``n`` allows), at most
    ``cfg.gpu_max_tokens_per_program`` (``gpu_fp8_...`` when quantising)."""
    if cfg.gpu_tokens_per_program is not None:
        return cfg.gpu_tokens_per_program
    most = cfg.gpu_fp8_max_tokens_per_program if quantize else cfg.gpu_max_tokens_per_program
    return int(min(most, pow2_floor(n // cfg.gpu_min_programs)))


def num_warps(tile: int, itemsize: int, cfg, fp8_decode: bool = False) -> int:
    """Warps that give each thread 16 bytes of a ``tile``-wide row of ``itemsize`` elements,
    or (``fp8_decode``: quantising fewer than ``gpu_min_programs`` tokens)
    ``cfg.gpu_fp8_columns_per_thread`` columns; at most 8."""
    if cfg.gpu_num_warps is not None:
        return cfg.gpu_num_warps
    per_warp = 32 * cfg.gpu_fp8_columns_per_thread if fp8_decode else 32 * 16 // itemsize
    return int(min(8, max(1, tile // per_warp)))
