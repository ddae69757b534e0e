"""Launch rules shared by the GPU (Pallas Triton and Mosaic GPU) kernels of several ops.

How many tokens a program writes, how many warps it runs, the int32 element-offset
bound of Triton's addressing, and the unsigned views that the zeroing kernels store
through. The numbers (``KVWriteConfig``'s defaults) are BENCHMARKS.md's "Kernel design
notes"; ``config`` arguments are any object with ``KVWriteConfig``'s ``gpu_*`` fields.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from pallas_kernels.contract import INT32_MAX

__all__ = [
    "UINT_OF_WIDTH",
    "check_int32_offsets",
    "num_warps",
    "pow2_floor",
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
