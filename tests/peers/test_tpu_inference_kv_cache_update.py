"""tpu-inference's KV-cache update test, ported onto kvjax.interop.tpu_inference.

Source: vllm-project/tpu-inference, ``tests/kernels/ragged_kv_cache_update_v2_test.py``
at commit b8692ff01fa191343836996c27a39dc95f008b88 (2026-08-22). The test logic is
re-written here; no peer code is copied.

Kept: the data (20 pages, 128 padded tokens, bf16 ``new_kv`` from ``jax.random.key(1234)``,
seven slices of lengths 7, page, page, 1, 1, 1, 9 at the same cache offsets), the
``test_basic`` product (page_size 32 / 33, combined heads 2 / 16, head_dim 128 / 256,
with and without host validation -- 4 of its 16 cases in CI, covering each value, the
rest behind the slow switch --: tpu-inference's ``dynamic_validate_inputs=True`` runs
eagerly, ``False`` under ``jit``), the loop-over-slices reference and the tolerance
(``atol = rtol = 1e-4``; kvjax's write is an exact copy, so the cache is also compared
bitwise), and the nine malformed inputs of ``test_invalid_inputs``, each still a
``ValueError`` (kvjax's messages name ``slices`` and the field; the pattern each case
matches is kvjax's).

Dropped: ``num_slices_per_block`` (a tpu-inference TPU kernel knob with no kvjax
counterpart) and the shard_map test (one CPU device). The cache is kvjax's own pages
of the same flat layout; page 0 is an ordinary page here (the slices are cache rows,
kvjax's null page plays no part in this input form).
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _flavours import flavours, slow
from kvjax.interop import kv_cache_update

NUM_PAGES, NUM_TOKENS = 20, 128


def make_data(page_size, combined, head_dim):
    kv_cache = jnp.zeros((NUM_PAGES * page_size, combined, head_dim), jnp.bfloat16)
    new_kv = jax.random.normal(jax.random.key(1234), (NUM_TOKENS, combined, head_dim), jnp.bfloat16)
    lens = np.array([7, page_size, page_size, 1, 1, 1, 9], np.int32)
    starts = np.array([page_size * 2 - 7, page_size * 2, page_size * 3, page_size * 4 + 6,
                       page_size * 5 + 7, page_size * 6 + 8, page_size * 15 + 3], np.int32)
    new_starts = np.concatenate([[0], np.cumsum(lens[:-1])]).astype(np.int32)
    slices = np.stack([starts, new_starts, lens]).astype(np.int32)  # [3, num_slices]
    return new_kv, slices, kv_cache, np.array([lens.size], np.int32)


def basic_cases():
    ci = {(32, 2, 128, True), (33, 16, 256, False), (33, 2, 128, False), (32, 16, 256, True)}
    for args in itertools.product([32, 33], [2, 16], [128, 256], [False, True]):
        yield pytest.param(*args) if args in ci else slow(*args)


def reference_update(new_kv, slices, kv_cache):
    cache = np.asarray(kv_cache).copy()
    src = np.asarray(new_kv)
    for cache_start, new_start, length in slices.T:
        cache[cache_start:cache_start + length] = src[new_start:new_start + length]
    return cache


@pytest.mark.parametrize("backend", flavours("pallas_tpu", "pallas_gpu"))
@pytest.mark.parametrize("page_size, combined, head_dim, validate", basic_cases())
def test_basic(page_size, combined, head_dim, validate, backend):
    new_kv, slices, kv_cache, num_slices = make_data(page_size, combined, head_dim)
    want = reference_update(new_kv, slices, kv_cache)
    if validate:  # concrete inputs: tpu-inference's host checks run
        got = kv_cache_update(new_kv, slices, kv_cache, num_slices, page_size=page_size,
                              backend=backend)
    else:
        got = jax.jit(
            lambda n, s, c, k: kv_cache_update(n, s, c, k, page_size=page_size, backend=backend)
        )(new_kv, slices, kv_cache, num_slices)
    got = np.asarray(got)
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), atol=1e-4, rtol=1e-4)
    assert np.array_equal(got.view(np.uint16), want.view(np.uint16))


# (row, column, new value or callable of the slices, kvjax's message) per peer case.
INVALID = [
    ("new_kv_start < 0", 1, 0, -1, r"slices\[:, 0\].*new_kv_start must be >= 0, got -1"),
    ("kv_cache_start < 0", 0, 0, -1, r"slices\[:, 0\].*kv_cache_start must be >= 0, got -1"),
    ("slice_len <= 0", 2, 0, 0, r"slice_len must be in \[1, page_size=32\], got 0"),
    ("slice_len > page_size", 2, 0, 33, r"slice_len must be in \[1, page_size=32\], got 33"),
    ("past new_kv", 1, 0, NUM_TOKENS,
     r"new_kv_start \+ slice_len must be <= the 128 tokens of new_kv, got 135"),
    ("past the cache", 0, 0, NUM_PAGES * 32,
     r"kv_cache_start \+ slice_len must be <= the 640 rows of kv_cache \(beyond the cache\), got 647"),
    ("slice crosses a page", None, 0, None, r"a slice must lie in one page of 32 rows"),
    ("new_kv slices not contiguous", 1, 1, "+1", r"new_kv slices must be contiguous"),
    ("overlapping cache slices", 0, 4, "=[0, 3]", r"kv_cache slices must not overlap"),
]


@pytest.mark.parametrize("case, row, col, value, match", INVALID, ids=[c[0] for c in INVALID])
def test_invalid_inputs(case, row, col, value, match):
    page_size = 32
    new_kv, slices, kv_cache, num_slices = make_data(page_size, 2, 128)
    bad = slices.copy()
    if row is None:  # the peer sets kv_cache_start = page_size - 1 and slice_len = page_size
        bad[0, 0], bad[2, 0] = page_size - 1, page_size
    elif value == "+1":
        bad[row, col] = slices[row, col] + 1
    elif value == "=[0, 3]":
        bad[row, col] = slices[0, 3]
    else:
        bad[row, col] = value
    with pytest.raises(ValueError, match=match):
        kv_cache_update(new_kv, bad, kv_cache, num_slices, page_size=page_size)
