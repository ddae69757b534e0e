"""``residual_rms_norm``: a block's residual add and the next block's RMS norm as one op.

The reference is the models' own two expressions (bitwise); the GPU kernel (interpreted here)
agrees with it, keeps masked rows exactly as they were (a NaN in a masked row's ``out`` stays
out), is one launch under jit and lowers for CUDA; bad arguments are refused by name."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.models.attention import rms_norm
from pallas_kernels import residual_rms_norm
from tests.kernels.test_gpu_launches import assert_one_launch, lower_for_cuda

CASES = [  # (rows, width, weight dtype, scale)
    (2, 64, jnp.float32, 1.0),
    (3, 96, jnp.bfloat16, 0.22),  # a width that is not a power of two, a residual multiplier
    (5, 100, jnp.float32, 1.0),
    (1, 32, jnp.float32, 2.0),
]


def _inputs(T, D, wdt, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((T, D)), jnp.float32)
    out = rng.standard_normal((T, D)).astype(np.float32)
    keep = jnp.asarray([True] * max(T - 1, 1) + [False] * (T > 1))
    if T > 1:
        out[-1] = np.nan  # the last row is masked: its output must never be read
    w = jnp.asarray(rng.standard_normal(D) + 1.0, wdt)
    return x, jnp.asarray(out), keep, w


@pytest.mark.parametrize("T,D,wdt,scale", CASES)
def test_reference_is_the_models_residual_add_then_rms_norm_bitwise(T, D, wdt, scale):
    x, out, keep, w = _inputs(T, D, wdt)

    def models(x, out, keep, w):  # the hybrid's code before the op
        o = out * jnp.float32(scale) if scale != 1.0 else out
        x = x + jnp.where(keep[:, None], o, 0.0)
        return x, rms_norm(x, w, 1e-5)

    want = jax.jit(models)(x, out, keep, w)
    got = jax.jit(lambda *a: residual_rms_norm(*a, eps=1e-5, scale=scale, backend="reference"))(x, out, keep, w)
    for g, e in zip(got, want):
        assert g.dtype == e.dtype == jnp.float32
        assert np.asarray(g).tobytes() == np.asarray(e).tobytes()


@pytest.mark.parametrize("T,D,wdt,scale", CASES)
def test_gpu_kernel_matches_the_reference(T, D, wdt, scale):
    """The residual ``x'`` bitwise (an add), ``h`` to float32 rounding (the row sum's order is
    the kernel's own); a masked row keeps ``x`` bit for bit and nothing is NaN."""
    x, out, keep, w = _inputs(T, D, wdt)
    ref = residual_rms_norm(x, out, keep, w, eps=1e-5, scale=scale, backend="reference")
    got = residual_rms_norm(x, out, keep, w, eps=1e-5, scale=scale, backend="pallas_gpu")
    assert [g.shape for g in got] == [(T, D)] * 2 and [g.dtype for g in got] == [jnp.float32] * 2
    assert np.asarray(got[0]).tobytes() == np.asarray(ref[0]).tobytes()
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(ref[1]), rtol=2e-6, atol=1e-6)
    if T > 1:
        assert np.asarray(got[0])[-1].tobytes() == np.asarray(x)[-1].tobytes()
    assert not any(np.isnan(np.asarray(g)).any() for g in got)
    assert np.abs(np.asarray(got[1])).sum() > 0


def test_gpu_kernel_is_one_launch_and_lowers_for_cuda(verified_triton_modules):
    x, out, keep, w = _inputs(2, 64, jnp.float32)

    def call(x, out, keep, w):
        return residual_rms_norm(x, out, keep, w, eps=1e-6, scale=0.5, backend="pallas_gpu", interpret=False)

    assert_one_launch(call, x, out, keep, w)
    assert lower_for_cuda(call, x, out, keep, w).count("custom_call") == 1


def test_no_rows():
    x = jnp.zeros((0, 8), jnp.float32)
    got = residual_rms_norm(x, x, jnp.zeros((0,), bool), jnp.ones((8,)), eps=1e-6, backend="pallas_gpu")
    assert [g.shape for g in got] == [(0, 8)] * 2


@pytest.mark.parametrize("change,match", [
    (dict(x=np.ones((2, 4), np.float16)), "x must have dtype float32"),
    (dict(x=np.ones((2, 4, 1), np.float32)), "x must have rank 2"),
    (dict(out=np.ones((2, 3), np.float32)), r"out must have shape \[2, 4\], got \[2, 3\]"),
    (dict(out=np.ones((2, 4), np.int32)), "out must have dtype a floating dtype"),
    (dict(keep=np.ones((3,), bool)), r"keep must have shape \[2\], got \[3\]"),
    (dict(weight=np.ones((5,), np.float32)), r"weight must have shape \[4\], got \[5\]"),
    (dict(eps=0.0), "eps must be a finite float > 0, got 0.0"),
    (dict(eps=True), "eps must be a finite float > 0, got True"),
    (dict(scale=float("nan")), "scale must be a finite float, got nan"),
])
def test_bad_arguments_are_refused_by_name(change, match):
    a = dict(x=np.ones((2, 4), np.float32), out=np.ones((2, 4), np.float32), keep=np.ones((2,), bool),
             weight=np.ones((4,), np.float32), eps=1e-6, scale=1.0)
    a.update(change)
    with pytest.raises(ValueError, match=match):
        residual_rms_norm(a["x"], a["out"], a["keep"], a["weight"], eps=a["eps"], scale=a["scale"],
                          backend="pallas_gpu")
