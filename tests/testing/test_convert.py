"""kvjax.testing.convert: numpy / JAX <-> torch round trips are bit-exact.

Every supported dtype goes numpy -> torch -> numpy and JAX -> torch -> JAX,
and the raw bits must come back unchanged, including NaN payloads (quiet and
signalling, both signs), -0.0, subnormals, infinities and the extreme finite
values. The torch side is checked too: the tensor holds the same bits and the
values torch itself reads from them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvjax.testing.convert import SUPPORTED_DTYPES, to_jax, to_numpy, to_torch  # noqa: E402

BF16, FP8 = np.dtype(ml_dtypes.bfloat16), np.dtype(ml_dtypes.float8_e4m3fn)
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def bits(a):
    a = np.asarray(a)
    return a.view(UINT[a.dtype.itemsize]) if a.dtype.kind in "fV" or a.dtype in (BF16, FP8) else a


def special_bit_patterns(dtype: np.dtype) -> np.ndarray:
    """Every interesting bit pattern of a float dtype (plus a random sweep)."""
    n = dtype.itemsize * 8
    u = UINT[dtype.itemsize]
    if dtype == FP8:  # small enough to take all 256 patterns (0x7f / 0xff are NaN)
        return np.arange(256, dtype=np.uint8).view(FP8)
    mant = {16: 10 if dtype == np.float16 else 7, 32: 23, 64: 52}[n]
    sign = 1 << (n - 1)
    exp_all = ((1 << (n - 1 - mant)) - 1) << mant
    pats = [
        0, sign,  # +0.0, -0.0
        1, sign | 1,  # smallest subnormals
        (1 << mant) - 1,  # largest subnormal
        1 << mant,  # smallest normal
        exp_all - 1, sign | (exp_all - 1),  # largest finite
        exp_all, sign | exp_all,  # +-inf
        exp_all | (1 << (mant - 1)),  # canonical quiet NaN
        sign | exp_all | (1 << (mant - 1)) | 5,  # negative quiet NaN with payload
        exp_all | 1,  # signalling NaN, payload 1
        exp_all | ((1 << (mant - 1)) - 1),  # signalling NaN, all-ones payload
    ]
    rng = np.random.default_rng(n)
    sweep = rng.integers(0, np.iinfo(u).max, size=64, dtype=u, endpoint=True)
    return np.concatenate([np.array(pats, dtype=u), sweep]).view(dtype)


def sample(dtype: np.dtype) -> np.ndarray:
    if dtype.kind == "b":
        return np.array([True, False, True, True])
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return np.array([info.min, -1 if info.min else 0, 0, 1, info.max], dtype=dtype)
    return special_bit_patterns(dtype)


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=str)
def test_numpy_torch_round_trip_is_bit_exact(dtype):
    a = sample(dtype).reshape(-1, 1)  # 2-D: shapes survive too
    t = to_torch(a)
    assert tuple(t.shape) == a.shape
    back = to_numpy(t)
    assert back.dtype == dtype
    np.testing.assert_array_equal(bits(back), bits(a))
    if dtype.kind == "f" or dtype in (BF16, FP8):
        # torch reads the same bits: compare through torch's own integer view.
        width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]
        tb = t.view(width).numpy().view(UINT[dtype.itemsize])
        np.testing.assert_array_equal(tb, bits(a))


@pytest.mark.parametrize("dtype", [d for d in SUPPORTED_DTYPES if d.itemsize < 8], ids=str)
def test_jax_torch_round_trip_is_bit_exact(dtype):
    a = jnp.asarray(sample(dtype))
    t = to_torch(a)
    back = to_jax(t)
    assert back.dtype == a.dtype
    np.testing.assert_array_equal(bits(back), bits(a))


def test_values_read_by_torch_match():
    x = np.array([1.5, -0.0, 3.0e-41, np.inf, -2.0**-133], np.float32)
    for dtype in (np.float32, BF16, np.float16):
        a = x.astype(dtype)
        t = to_torch(a)
        np.testing.assert_array_equal(t.float().numpy(), a.astype(np.float32))
        assert np.signbit(t.float().numpy()[1])
    q = np.array([448.0, -448.0, 2.0**-9, -0.0, 0.3], np.float32).astype(FP8)
    np.testing.assert_array_equal(to_torch(q).float().numpy(), q.astype(np.float32))


def test_to_torch_copies_and_moves():
    a = jnp.arange(4, dtype=jnp.int32)
    t = to_torch(a, device="cpu")
    t[0] = 7  # must not touch the JAX buffer
    assert int(a[0]) == 0
    n = np.arange(3, dtype=np.int64)
    to_torch(n)[1] = 9
    assert n[1] == 1


def test_64_bit_to_jax_without_x64():
    if jax.config.jax_enable_x64:
        pytest.skip("x64 is on in this process")
    fits = torch.tensor([-(2**31), 0, 2**31 - 1], dtype=torch.int64)
    out = to_jax(fits)
    assert out.dtype == jnp.int32 and out.tolist() == [-(2**31), 0, 2**31 - 1]
    with pytest.raises(ValueError, match="int32 cannot hold exactly"):
        to_jax(torch.tensor([2**31], dtype=torch.int64))
    f = to_jax(torch.tensor([1.5, -0.0, float("inf")], dtype=torch.float64))
    assert f.dtype == jnp.float32 and np.signbit(np.asarray(f)[1])
    with pytest.raises(ValueError, match="float32 cannot hold exactly"):
        to_jax(torch.tensor([0.1], dtype=torch.float64))


def test_64_bit_to_jax_with_x64():
    prev = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        big = torch.tensor([2**40 + 3, -(2**62)], dtype=torch.int64)
        out = to_jax(big)
        assert out.dtype == jnp.int64 and out.tolist() == big.tolist()
        f = special_bit_patterns(np.dtype(np.float64))
        np.testing.assert_array_equal(bits(to_jax(to_torch(f))), bits(f))
    finally:
        jax.config.update("jax_enable_x64", prev)


def test_unsupported_dtypes_are_rejected():
    with pytest.raises(ValueError, match="complex64"):
        to_torch(np.zeros(2, np.complex64))
    with pytest.raises(ValueError, match="complex64"):
        to_numpy(torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(ValueError, match="torch.Tensor"):
        to_numpy(np.zeros(2))
