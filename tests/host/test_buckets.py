"""BucketSpec and default_token_sizes refuse bad sizes by name (host only).

A negative draft count used to divide by zero (``BucketSpec.default(32, 4, -1)``) or give a
0-token size (``default_token_sizes(16, -3)``); ``choose`` answered negative sizes with the
smallest bucket; a float row count and ``True`` as a token size were taken as sizes.
"""

import numpy as np
import pytest

from kvjax.host.buckets import Bucket, BucketSpec, default_token_sizes


@pytest.mark.parametrize("args, match", [
    ((16, -3), r"num_speculative_tokens must be a non-negative int, got -3"),
    ((16, 0.5), r"num_speculative_tokens must be a non-negative int, got 0.5"),
    ((16, True), r"num_speculative_tokens must be a non-negative int, got True"),
    ((0,), r"max_num_batched_tokens must be a positive int, got 0"),
    ((10.0,), r"max_num_batched_tokens must be a positive int, got 10.0"),
])
def test_default_token_sizes_refuses_bad_sizes(args, match):
    with pytest.raises(ValueError, match=match):
        default_token_sizes(*args)


def test_default_bucket_spec_refuses_a_negative_draft_count():
    with pytest.raises(ValueError, match=r"num_speculative_tokens must be a non-negative int, got -1"):
        BucketSpec.default(32, 4, -1)


@pytest.mark.parametrize("args, match", [
    (((4, 8), 2.5), r"max_num_seqs must be a positive int, got 2.5"),
    (((4, 8), "4"), r"max_num_seqs must be a positive int, got '4'"),
    (((4, 8), True), r"max_num_seqs must be a positive int, got True"),
    (((4, 8), 0), r"max_num_seqs must be a positive int, got 0"),
    (((4, 8), 2, 0.5), r"num_speculative_tokens must be a non-negative int, got 0.5"),
    (((4, 8), 2, -1), r"num_speculative_tokens must be a non-negative int, got -1"),
    (((True, 4), 2), r"token_sizes\[0\] must be a positive int, got True"),
    (((4, 8.0), 2), r"token_sizes\[1\] must be a positive int, got 8.0"),
    (((4, 0), 2), r"token_sizes\[1\] must be a positive int, got 0"),
    (((), 2), r"token_sizes must be a non-empty sequence of distinct ascending positive ints, got \(\)"),
    ((8, 2), r"token_sizes must be a non-empty sequence of distinct ascending positive ints, got 8"),
    (((8, 4), 2), r"token_sizes must be distinct ascending positive ints, got \(8, 4\)"),
    (((4, 4), 2), r"token_sizes must be distinct ascending positive ints, got \(4, 4\)"),
])
def test_bucket_spec_refuses_bad_sizes(args, match):
    with pytest.raises(ValueError, match=match):
        BucketSpec(*args)


def test_bucket_spec_takes_numpy_ints_as_plain_ints():
    spec = BucketSpec(tuple(np.array([4, 8])), np.int64(2), np.int32(1))
    assert spec == BucketSpec((4, 8), 2, 1) == BucketSpec(np.array([4, 8]), 2, 1) == BucketSpec([4, 8], 2, 1)
    assert all(type(v) is int for v in (*spec.token_sizes, spec.max_num_seqs, spec.num_speculative_tokens))


@pytest.mark.parametrize("args, match", [
    ((-5, -2, -9), r"num_tokens must be a positive int, got -5"),
    ((0, 1), r"num_tokens must be a positive int, got 0"),
    ((3, 0), r"num_reqs must be a positive int, got 0"),
    ((3, 1, 0), r"num_logits must be a positive int, got 0"),
    ((3.5, 1), r"num_tokens must be a positive int, got 3.5"),
    ((3, 1.5), r"num_reqs must be a positive int, got 1.5"),
    ((3, True), r"num_reqs must be a positive int, got True"),
])
def test_choose_refuses_bad_sizes(args, match):
    spec = BucketSpec((4, 8, 16), max_num_seqs=4)
    with pytest.raises(ValueError, match=match):
        spec.choose(*args)


def test_choose_takes_numpy_ints():
    spec = BucketSpec((4, 8, 16), max_num_seqs=4)
    assert spec.choose(np.int64(5), np.int32(2)) == spec.bucket_for(8)


@pytest.mark.parametrize("size, match", [
    (0, r"num_tokens_padded must be a positive int, got 0"),
    (8.0, r"num_tokens_padded must be a positive int, got 8.0"),
    (5, r"num_tokens_padded must be one of token_sizes \(4, 8, 16\), got 5"),
])
def test_bucket_for_refuses_a_size_that_is_not_a_token_size(size, match):
    spec = BucketSpec((4, 8, 16), max_num_seqs=4)
    with pytest.raises(ValueError, match=match):
        spec.bucket_for(size)
    assert spec.bucket_for(8) == Bucket(8, 4, 4)
