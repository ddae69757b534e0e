"""The kernels' contract helpers (pallas_kernels.contract, pallas_kernels.mamba_common)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import contract
from pallas_kernels import mamba_common as mc


def test_sentinels():
    assert (contract.PAD_SLOT_ID, contract.PAD_ROW_ID, contract.NULL_BLOCK_ID) == (-1, -1, 0)


@pytest.mark.parametrize("s,mode", [("auto", "auto"), ("fp8", "fp8"), ("fp8_e4m3", "fp8")])
def test_kv_cache_storage_accepts(s, mode):
    assert contract.kv_cache_storage(s) == mode


@pytest.mark.parametrize("s", ["fp8_e5m2", "int8", None, b"auto", "FP8"])
def test_kv_cache_storage_rejects(s):
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \['auto', 'fp8', "):
        contract.kv_cache_storage(s)


def test_check_fp8_scale():
    contract.check_fp8_scale("s", np.float32([1.0, 448.0, np.finfo(np.float32).tiny]))
    jax.jit(lambda v: contract.check_fp8_scale("s", v))(np.float32([0.0]))  # traced: no check
    for bad in (np.nan, 0.0, -0.0, -2.0, np.inf, 1e-45, 1e-39):
        with pytest.raises(ValueError, match=r"s must be finite and > 0"):
            contract.check_fp8_scale("s", np.float32([1.0, bad]))


def test_check_ids_range_checks_before_narrowing():
    ok = contract.check_ids("ids", np.array([3, -1, -(2**40), 0], np.int64), 4, what="n=4")
    assert ok.dtype == np.int32 and ok.tolist() == [3, -1, -1, 0]
    i32 = np.array([1, -1], np.int32)
    assert contract.check_ids("ids", i32, 4, what="n=4") is i32
    for bad, at in (([1, 4], "4 at index 1"), ([2**32 + 1], "4294967297 at index 0")):
        with pytest.raises(ValueError, match=rf"ids values must be in \[0, 4\) \(n=4\).*{at}"):
            contract.check_ids("ids", np.array(bad, np.int64), 4, what="n=4")
    with pytest.raises(ValueError, match=r"ids values must be in \[1, 4\)"):
        contract.check_ids("ids", np.array([0], np.int32), 4, what="n=4", lower=1)
    with pytest.raises(ValueError, match="ids must have dtype int32 or int64, got uint32"):
        contract.check_ids("ids", np.array([0], np.uint32), 4, what="")
    with pytest.raises(ValueError, match="ids must have rank 1"):
        contract.check_ids("ids", np.zeros((1, 1), np.int32), 4, what="")


def test_live_ids_compare_before_narrowing():
    with jax.enable_x64(True):
        ids = jnp.array([2**32 + 1, 3, -5, 0, 4], jnp.int64)
        got = jax.jit(lambda i: contract.live_ids(i, 4, lower=1))(ids)
    assert got.dtype == jnp.int32 and got.tolist() == [-1, 3, -1, -1, -1]


def test_as_int32():
    assert contract.as_int32("x", np.array([5, -7], np.int64)).tolist() == [5, -7]
    with pytest.raises(ValueError, match=r"x must have values in \[-2147483648, 2147483648\)"):
        contract.as_int32("x", np.array([2**32 + 1], np.int64))
    with jax.enable_x64(True):
        got = jax.jit(lambda v: contract.as_int32("x", v))(jnp.array([2**32 + 1, 7], jnp.int64))
    assert got.dtype == jnp.int32 and got.tolist() == [-1, 7]


def test_range_and_order_checks():
    contract.check_values_in_range("v", np.array([0, 3, -1]), 0, 4, allow=(-1,))
    with pytest.raises(ValueError, match=r"v must have values in \[0, 4\) \(or -1\); got 4 at index 1"):
        contract.check_values_in_range("v", np.array([0, 4]), 0, 4, allow=(-1,))
    contract.check_non_decreasing("cu", np.array([0, 0, 2]))
    with pytest.raises(ValueError, match="cu must be non-decreasing; got 2 then 1 at index 1"):
        contract.check_non_decreasing("cu", np.array([0, 2, 1]))
    with pytest.raises(ValueError, match=r"a must have shape \[2, \*\], got \[3, 1\]"):
        contract.check_shape("a", np.zeros((3, 1)), (2, None))
    with pytest.raises(ValueError, match="a must have dtype float32 or an integer dtype, got bool"):
        contract.check_dtype("a", np.zeros(1, bool), (np.float32, "integer"))


@pytest.mark.parametrize(
    "cu,bos,lens",
    [
        ([0, 1, 3, 3], [0, 1, 3], [1, 2, 0]),  # well formed (an empty sequence too)
        ([0, 1, 5], [0, 4], [1, 0]),  # ends past T = 4
        ([0, 3, 1, 4], [0, 4, 4], [3, 0, 0]),  # a decrease masks it and all later ones
        ([-1, 2, 3], [4, 4], [0, 0]),  # a negative offset
        ([0, 2, -2**31], [0, 4], [2, 0]),  # no overflow in the offset arithmetic
    ],
)
def test_sequence_bounds(cu, bos, lens):
    b, n = jax.jit(lambda c: mc.sequence_bounds(c, 4))(np.array(cu, np.int32))
    assert b.tolist() == bos and n.tolist() == lens
