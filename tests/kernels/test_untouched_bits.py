"""Every op leaves every byte it does not target bit-for-bit unchanged, NaN payloads
included, in every backend — for bfloat16 too, where XLA:CPU's scatter would otherwise
canonicalise every NaN of the whole array (0x7fe5 -> 0x7fc0)."""

import jax
import ml_dtypes
import numpy as np
import pytest

from kvjax.testing.asserts import assert_bitwise, bits
from pallas_kernels.block_zero import zero_blocks
from pallas_kernels.kv_write import concat_and_cache_mla, reshape_and_cache_flash
from pallas_kernels.mamba import (
    causal_conv1d_update, causal_conv1d_varlen, selective_scan_varlen, selective_state_update,
)

BF16 = np.dtype(ml_dtypes.bfloat16)
PAYLOAD = 0x7FE5  # a quiet NaN with a non-canonical payload
BACKENDS = (
    "reference",
    "pallas_tpu",
    pytest.param("pallas_gpu", marks=pytest.mark.skipif(
        jax.default_backend() == "cpu",
        reason="the generic Pallas interpreter runs the GPU kernel body through XLA:CPU, which "
        "canonicalises bf16 NaNs; compiled on a GPU the kernel stores only the bits it writes")),
)


def poisoned(shape):
    return np.full(shape, PAYLOAD, np.uint16).view(BF16)


def assert_rows_untouched(after, before, rows, name):
    keep = np.setdiff1d(np.arange(before.shape[0]), rows)
    assert_bitwise(np.asarray(after)[keep], before[keep], name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_kv_writes(backend):
    rng = np.random.default_rng(0)
    key = rng.standard_normal((4, 2, 8)).astype(BF16)
    cache = poisoned((5, 4, 2, 8))
    slots = np.array([5, -1, 18, 6], np.int32)  # blocks 1 and 4
    kc, vc = reshape_and_cache_flash(key, key, cache, cache.copy(), slots, backend=backend)
    for c in (kc, vc):
        flat = np.asarray(c).reshape(20, 2, 8)
        written = [5, 18, 6]
        assert_bitwise(np.delete(flat, written, axis=0), np.delete(cache.reshape(20, 2, 8), written, axis=0), "kv")
        assert_bitwise(flat[written], key[[0, 2, 3]], "written")
    mla = poisoned((5, 4, 12))
    out = concat_and_cache_mla(key[:, 0, :], key[:, 1, :4], mla, slots, backend=backend)
    assert_bitwise(np.delete(np.asarray(out).reshape(20, 12), [5, 18, 6], axis=0),
                   np.delete(mla.reshape(20, 12), [5, 18, 6], axis=0), "mla")


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_blocks(backend):
    arrays = [poisoned((6, 4, 2)), poisoned((6, 3))]
    out = zero_blocks(arrays, np.array([2, -1], np.int32), kernel_blocks_per_block=2, backend=backend)
    for a, o in zip(arrays, out):
        assert_rows_untouched(o, a, [4, 5], "zero_blocks")
        assert (bits(np.asarray(o)[[4, 5]]) == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_mamba_decode(backend):
    rng = np.random.default_rng(1)
    nh, dim, ds = 2, 4, 4
    state = poisoned((5, nh, dim, ds))
    idx = np.array([3, 0], np.int32)  # row 1 is a null (padded) row
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    _, st = selective_state_update(state, f(2, nh, dim), f(2, nh, dim), -np.abs(f(nh, dim, ds)),
                                   f(2, 1, ds), f(2, 1, ds), state_batch_indices=idx, backend=backend)
    assert_rows_untouched(st, state, [3], "ssm state")
    conv = poisoned((5, 6, 3))
    _, cs = causal_conv1d_update(f(2, 6), conv, f(6, 4), conv_state_indices=idx, backend=backend)
    assert_rows_untouched(cs, conv, [3], "conv state")


def test_mamba_prefill():
    rng = np.random.default_rng(2)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    T, H, P, N = 5, 2, 4, 4
    qsl = np.array([0, 3, 5], np.int32)
    idx = np.array([2, 0], np.int32)  # second request has a null cache index
    fresh = np.array([False, False])
    state = poisoned((4, H, P, N))
    _, st = selective_scan_varlen(f(T, H, P), f(T, H), -np.abs(f(H)), f(T, 1, N), f(T, 1, N), state,
                                  qsl, idx, fresh, backend="reference")
    assert_rows_untouched(st, state, [2], "scan state")
    conv = poisoned((4, 6, 3))
    _, cs = causal_conv1d_varlen(f(6, T), f(6, 4), None, conv, qsl, idx, fresh, backend="reference")
    assert_rows_untouched(cs, conv, [2], "conv varlen state")
