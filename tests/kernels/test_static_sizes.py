"""Static sizes a kernel cannot run are refused where they are given, by name (or the call
runs): SSUConfig's Triton blocks, grouped_matmul's GPU ``tile_rows``, a zero-blocks tile
narrower than an element, BucketSpec's token sizes as a 0-d array. Each had been taken and
failed later, with Pallas' generic lowering error, a ZeroDivisionError or numpy's TypeError.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from tests.cuda_lowering import lower_for_cuda


@pytest.mark.parametrize("field,bad", [("gpu_block_m", 3), ("gpu_block_m", 24), ("gpu_tile_elems", 48),
                                       ("gpu_tile_elems", 3000)])
def test_ssu_config_tile_sizes_are_powers_of_two(field, bad):
    """``SSUConfig.gpu_block_m`` is the GPU program's block of state rows (a Triton block:
    ``block_m=3`` lowers to "Encountered an array of shape (3, 16)"), and ``gpu_tile_elems //
    pow2(dstate)`` is that block where ``gpu_block_m`` is None (48 // 16 = 3 rows, the same
    error). Both were taken by ``check_config_ints`` (no field of SSUConfig named a power of
    two)."""
    from pallas_kernels.mamba_ssu import SSUConfig

    with pytest.raises(ValueError, match=rf"^SSUConfig\.{field} must be a power of two"):
        SSUConfig(**{field: bad})


def test_ssu_config_power_of_two_sizes_still_taken():
    from pallas_kernels.mamba_ssu import SSUConfig

    assert SSUConfig(gpu_block_m=np.int64(4), gpu_tile_elems=2048).gpu_block_m == 4


@pytest.mark.parametrize("tile_rows", [24, 48])
def test_grouped_matmul_gpu_refuses_tile_rows_not_a_power_of_two_by_name(tile_rows):
    """``tile_rows`` goes through ``static_int`` (an int >= 1) and the GPU flavour refuses
    ``< 16`` by name, but 24 or 48 reach the Triton lowering, which fails with Pallas' generic
    "Encountered an array of shape (24, 64)" that does not say which argument."""
    from pallas_kernels.grouped_matmul import grouped_matmul

    x = jnp.zeros((2 * tile_rows, 64), jnp.bfloat16)
    w = jnp.zeros((4, 64, 32), jnp.bfloat16)

    def fn(x, w):
        return grouped_matmul(x, w, np.array([1, 2], np.int32), tile_rows=tile_rows,
                              backend="pallas_gpu", interpret=False)

    with pytest.raises((ValueError, NotImplementedError), match=rf"tile_rows.*{tile_rows}"):
        lower_for_cuda(fn, x, w)


@pytest.mark.parametrize("cfg", [dict(gpu_tile_bytes=2), dict(gpu_tile_bytes=1),
                                 dict(gpu_max_tile_bytes=2, gpu_min_tile_bytes=1)])
def test_zero_blocks_tile_narrower_than_an_element(cfg):
    """``ZeroBlocksConfig`` takes any power of two >= 1 as tile bytes; a tile narrower than one
    float32 element made ``tile_bytes // itemsize`` 0 and the GPU flavour raised
    ZeroDivisionError (``cdiv(width, 0)``). Either refused by name or run: here, run."""
    from pallas_kernels.block_zero import ZeroBlocksConfig, zero_blocks

    a = np.arange(8 * 4 * 8, dtype=np.float32).reshape(8, 4, 8) + 1
    ids = np.asarray([3, -1, 5], np.int32)
    (got,) = zero_blocks([jnp.asarray(a)], ids, backend="pallas_gpu", interpret=True,
                         config=ZeroBlocksConfig(**cfg))
    want = a.copy()
    want[[3, 5]] = 0
    np.testing.assert_array_equal(np.asarray(got), want)


def test_bucket_spec_refuses_a_zero_d_array_by_name():
    """A 0-d numpy array is an ``Iterable`` (it defines ``__iter__``) but ``tuple()`` of it
    raises numpy's TypeError; the rule's promise is a ValueError naming token_sizes, as for
    ``np.int64(16)``."""
    from kvjax.host.buckets import BucketSpec

    with pytest.raises(ValueError, match="token_sizes"):
        BucketSpec(np.int64(16), 4)
    with pytest.raises(ValueError, match="token_sizes"):
        BucketSpec(np.array(16), 4)


def test_kv_write_fp8_columns_per_thread_give_a_power_of_two_of_warps():
    """The fp8 decode rule's warps are ``tile // (32 * gpu_fp8_columns_per_thread)``: 3 columns
    gave 512 // 96 = 5 warps, which Triton refuses; the config refuses 3 by name."""
    from pallas_kernels import gpu_tiling
    from pallas_kernels.kv_write import KVWriteConfig

    with pytest.raises(ValueError, match=r"^KVWriteConfig\.gpu_fp8_columns_per_thread must be a power of two, got 3$"):
        KVWriteConfig(gpu_fp8_columns_per_thread=3)
    for c in (1, 2, 4, 8):
        for tile in (16, 64, 512, 2048):
            w = gpu_tiling.num_warps(tile, 2, KVWriteConfig(gpu_fp8_columns_per_thread=c), fp8_decode=True)
            assert w & (w - 1) == 0, (c, tile, w)
