"""kvjax.interop.tpu_inference: slice-encoded KV updates converted once to a slot mapping.

(tpu-inference's own test suite, ported, is tests/peers/test_tpu_inference_kv_cache_update.py.)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.constants import PAD_SLOT_ID
from kvjax.interop import kv_cache_update, slices_to_slot_mapping

PS = 4
# (kv_cache_start, new_kv_start, slice_len): 2 tokens ending page 1, 3 starting page 3,
# 1 in page 0 (an ordinary page here); slice 3 is padding past num_slices.
SLICES = np.asarray([[6, 12, 1, 99], [0, 2, 5, 99], [2, 3, 1, 99]], np.int32)
NUM = np.asarray([3], np.int32)
WANT = [6, 7, 12, 13, 14, 1, PAD_SLOT_ID, PAD_SLOT_ID]


def convert(slices=SLICES, num=NUM, **kw):
    kw = dict(num_tokens=8, page_size=PS, num_cache_tokens=16) | kw
    return np.asarray(slices_to_slot_mapping(slices, num, **kw))


def test_slices_become_slots_tokens_outside_every_slice_are_pad():
    np.testing.assert_array_equal(convert(), WANT)
    f = jax.jit(functools.partial(slices_to_slot_mapping, num_tokens=8, page_size=PS,
                                  num_cache_tokens=16))
    np.testing.assert_array_equal(f(SLICES, NUM), WANT)
    np.testing.assert_array_equal(convert(num=np.asarray([0], np.int32)), [PAD_SLOT_ID] * 8)


@pytest.mark.parametrize(
    "row, col, value, match",
    [
        (1, 0, -1, r"slices\[:, 0\].*new_kv_start must be >= 0, got -1"),
        (0, 0, -1, r"slices\[:, 0\].*kv_cache_start must be >= 0, got -1"),
        (2, 1, 0, r"slices\[:, 1\].*slice_len must be in \[1, page_size=4\], got 0"),
        (2, 1, 5, r"slice_len must be in \[1, page_size=4\], got 5"),
        (1, 0, 7, r"new_kv_start \+ slice_len must be <= the 8 tokens of new_kv, got 9"),
        (0, 1, 14, r"kv_cache_start \+ slice_len must be <= the 16 rows of kv_cache \(beyond the cache\), got 17"),
        (0, 1, 10, r"a slice must lie in one page of 4 rows, got rows 10..12"),
        (1, 2, 6, r"new_kv slices must be contiguous.*slice 1 ends at token 5, the next, slice 2, starts at 6"),
        (0, 2, 7, r"kv_cache slices must not overlap; slice 0 covers rows \[6, 8\) and slice 2 rows \[7, 8\)"),
    ],
)
def test_malformed_slices_raise_and_write_nothing_under_jit(row, col, value, match):
    bad = SLICES.copy()
    bad[row, col] = value
    with pytest.raises(ValueError, match=match):
        convert(bad)
    got = np.asarray(jax.jit(functools.partial(
        slices_to_slot_mapping, num_tokens=8, page_size=PS, num_cache_tokens=16))(bad, NUM))
    if "contiguous" in match or "overlap" in match:
        return  # not a per-slice rule: under jit tpu-inference leaves it unspecified too
    want = list(WANT)  # the malformed slice writes nothing; the others are unchanged
    for t in range(SLICES[1, col], SLICES[1, col] + SLICES[2, col]):
        want[t] = PAD_SLOT_ID
    np.testing.assert_array_equal(got, want)


def test_argument_shapes_and_num_slices_are_checked():
    with pytest.raises(ValueError, match=r"slices must have shape \[3, \*\]"):
        convert(SLICES[:2])
    with pytest.raises(ValueError, match=r"num_slices must have values in \[0, 5\)"):
        convert(num=np.asarray([5], np.int32))
    with pytest.raises(ValueError, match="page_size must be a positive int, got 0"):
        convert(page_size=0)


def test_kv_cache_update_writes_only_the_slices():
    rng = np.random.default_rng(0)
    new_kv = rng.standard_normal((8, 4, 8)).astype(np.float32)
    cache = rng.standard_normal((16, 4, 8)).astype(np.float32)
    got = np.asarray(kv_cache_update(new_kv, SLICES, jnp.asarray(cache), NUM, page_size=PS))
    want = cache.copy()
    for t, s in enumerate(WANT):
        if s >= 0:
            want[s] = new_kv[t]
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    with pytest.raises(ValueError, match=r"kv_cache must hold a whole number of pages of page_size=4 rows, got shape \[15, 4, 8\]"):
        kv_cache_update(new_kv, SLICES, cache[:15], NUM, page_size=PS)
    with pytest.raises(ValueError, match=r"new_kv must have an even combined-head count"):
        kv_cache_update(new_kv[:, :3], SLICES, cache[:, :3], NUM, page_size=PS)
