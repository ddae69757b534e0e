"""The Mosaic GPU flavour's selection and host-side limits (its kernels run only on an
H100: benchmarks/gpu_check_mosaic.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import backend as kernel_backend, kv_mosaic_gpu, kv_write, block_zero, segments
from pallas_kernels import reshape_and_cache_flash, zero_blocks
from pallas_kernels.backend import Choice, choose, resolve


@pytest.fixture
def gpu(monkeypatch):
    """Pretend to be on a GPU of capability ``cap`` with JAX ``version``."""
    monkeypatch.delenv(kernel_backend.INTERPRET_ENV, raising=False)

    def set_up(cap=(9, 0), version=(0, 11), plat="gpu"):
        monkeypatch.setattr(kernel_backend, "platform", lambda: plat)
        monkeypatch.setattr(kernel_backend, "_jax_version", lambda: version)
        monkeypatch.setattr(kernel_backend, "gpu_capability", lambda: ("cuda:0", cap))

    return set_up


def test_mosaic_gpu_is_chosen_only_by_name(gpu):
    gpu()
    assert resolve("mosaic_gpu", None) == Choice("mosaic_gpu", False)
    assert resolve("mosaic_gpu", False) == Choice("mosaic_gpu", False)
    assert resolve("auto", None) == Choice("gpu", False)
    assert resolve("pallas", None) == Choice("gpu", False)
    assert choose("kv_write", "mosaic_gpu", None) == Choice("mosaic_gpu", False)
    assert choose("zero_blocks", "mosaic_gpu", None) == Choice("mosaic_gpu", False)
    # ops without a Mosaic GPU kernel run their reference, as for any missing flavour
    assert choose("selective_state_update", "mosaic_gpu", None) == Choice("reference", False)
    assert Choice("mosaic_gpu", False).interpret_arg() is False


@pytest.mark.parametrize(
    "setup,interpret,match",
    [
        (dict(plat="cpu"), None, "needs an NVIDIA GPU .* JAX >= 0.11; got platform 'cpu'"),
        (dict(plat="tpu"), None, "got platform 'tpu'"),
        (dict(version=(0, 10)), None, "got JAX "),
        (dict(cap=(8, 0)), None, "got device cuda:0 with compute capability 8.0"),
        (dict(cap=None), None, "compute capability unknown"),
        (dict(), True, 'backend="mosaic_gpu" has no interpret mode'),
    ],
)
def test_mosaic_gpu_refused_where_it_cannot_run(gpu, setup, interpret, match):
    gpu(**setup)
    with pytest.raises(ValueError, match=match):
        resolve("mosaic_gpu", interpret)


def test_public_ops_name_the_backend_on_cpu():
    k = jnp.zeros((2, 1, 64), jnp.bfloat16)
    c = jnp.zeros((4, 16, 1, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match='backend="mosaic_gpu" needs'):
        reshape_and_cache_flash(k, k, c, c, jnp.zeros((2,), jnp.int32), backend="mosaic_gpu")
    with pytest.raises(ValueError, match='backend="mosaic_gpu" needs'):
        zero_blocks([c], jnp.ones((1,), jnp.int32), backend="mosaic_gpu")


def test_tokens_per_cta():
    assert [kv_mosaic_gpu.tokens_per_cta(n) for n in (1, 511, 512, 1024, 2047, 2048, 32768)] \
        == [1, 1, 2, 4, 4, 8, 8]


def test_array_groups():
    groups = kv_mosaic_gpu.array_groups
    assert [groups(n, 64) for n in (1, 8, 64, 511, 512, 1024)] == [64, 64, 8, 2, 1, 1]
    assert groups(1, 3) == 3 and groups(0, 2) == 2


def test_fp8_in_kernel_rule():
    rule = kv_mosaic_gpu.fp8_in_kernel
    assert rule((8, 128), kv_write.KVWriteConfig())
    assert not rule((1, 64), kv_write.KVWriteConfig())
    assert not rule((8, 128), kv_write.KVWriteConfig(mosaic_fp8_in_kernel=False))


def _trace_write(h, d, dtype, fp8):
    choice = Choice("mosaic_gpu", False)
    k = jax.ShapeDtypeStruct((4, h, d), jnp.bfloat16)
    c = jax.ShapeDtypeStruct((8, 16, h, d), dtype)
    scales = (jnp.ones((h, d), jnp.float32),) * 2 if fp8 else None
    return jax.eval_shape(
        lambda k, v, kc, vc, sm: kernel_backend.run(
            kv_write.OP_WRITE, choice, sm, (k, v), (kc, vc), scales,
            segments=segments.FLASH_SEGMENTS, config=kv_write.KVWriteConfig()),
        k, k, c, c, jax.ShapeDtypeStruct((4,), jnp.int32))


def test_rows_not_a_multiple_of_16_bytes_are_not_implemented():
    with pytest.raises(NotImplementedError, match=r"multiple of 16; got H, D = \(1, 8\)"):
        _trace_write(1, 8, kv_write.FP8_DTYPE, True)
    with pytest.raises(NotImplementedError, match=r"multiple of 16; got H, D = \(3, 4\)"):
        _trace_write(3, 4, jnp.bfloat16, False)


def test_zero_blocks_below_16_bytes_are_not_implemented():
    a = jax.ShapeDtypeStruct((8, 3), jnp.float32)
    with pytest.raises(NotImplementedError, match=r"multiple of 16; caches\[0\] has 12"):
        jax.eval_shape(lambda ids, a: kernel_backend.run(
            block_zero.OP_ZERO, Choice("mosaic_gpu", False), ids, (a,), r=1,
            config=block_zero.ZeroBlocksConfig()), jax.ShapeDtypeStruct((2,), jnp.int32), a)
