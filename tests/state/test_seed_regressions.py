"""One regression test per seed bug (DESIGN.md), each in the scenario of its PR."""

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import (
    NULL_BLOCK_ID, PAD_SLOT_ID, BlockPool, BlockTables, KVGroupSpec, RequestRows, RequestState,
    ScheduledBatch, build_step_batch, dummy_step_batch,
)
from kvjax.testing.asserts import assert_bitwise
from pallas_kernels.kv_write import reshape_and_cache_flash

SPECS = (KVGroupSpec(block_size=4, max_num_blocks=4),)


def _one_request_state():
    s = RequestState.create(2, 16).add_request(1, [1, 2, 3, 4, 5])
    t = BlockTables.create(SPECS, 2).append_block_ids(1, [[3, 4]], overwrite=True)
    return s, t


def test_pr39444_dummy_step_after_real_step_writes_nothing_to_null_block():
    """A DP-idle dummy step used a zero-filled slot mapping: slot 0 is block 0, so the
    KV write put NaN into the null block. Here the dummy step's slots are all PAD, and
    the KV write with them leaves a NaN-poisoned block 0 (and every other byte) unchanged.
    The payload (finite K/V, distinct per token and for K and V) differs from the poison,
    so a PAD token written anywhere changes bits."""
    s, t = _one_request_state()
    real = build_step_batch(s, t, ScheduledBatch.from_lists([1], [5], pad_to=2), num_tokens_padded=8)
    assert (np.asarray(real.slot_mappings[0, :5]) >= 0).all()
    dummy = dummy_step_batch(s, t, num_reqs_padded=2, num_tokens_padded=8)
    np.testing.assert_array_equal(dummy.slot_mappings, np.full((1, 8), PAD_SLOT_ID))
    cache = jnp.full((5, 4, 1, 2), jnp.nan, jnp.float32)
    k = jnp.arange(1.0, 17.0, dtype=jnp.float32).reshape(8, 1, 2)
    kc, vc = reshape_and_cache_flash(k, -k, cache, cache, dummy.slot_mappings[0], backend="reference")
    assert_bitwise(kc, cache, "key_cache")
    assert_bitwise(vc, cache, "value_cache")


def test_pr35431_block_tables_pad_with_null_block_never_minus_one():
    s, t = _one_request_state()
    b = build_step_batch(s, t, ScheduledBatch.from_lists([1], [5], pad_to=2), num_tokens_padded=8)
    np.testing.assert_array_equal(b.block_tables[0][1], [NULL_BLOCK_ID] * 4)  # padded row
    assert (np.asarray(b.block_tables[0]) >= 0).all()
    with pytest.raises(ValueError, match="PAD_SLOT_ID \\(-1\\) belongs in slot mappings"):
        t.append_block_ids(0, [[-1]])


def test_pr43990_every_fresh_block_is_reported_once_for_zeroing_and_zeroed():
    from pallas_kernels.block_zero import zero_blocks

    pool = BlockPool(8)
    first = pool.allocate(3)
    assert pool.take_ids_to_zero() == first
    pool.free(first[:2])
    reused = pool.allocate(2)  # reused blocks hold a previous tenant's bytes
    to_zero = pool.take_ids_to_zero()
    assert to_zero == reused and pool.take_ids_to_zero() == []
    cache = jnp.full((8, 4, 2), jnp.nan, jnp.float32)
    (out,) = zero_blocks([cache], jnp.array(to_zero + [-1], jnp.int32), backend="reference")
    out = np.asarray(out)
    assert (out[to_zero] == 0).all()
    others = [i for i in range(8) if i not in to_zero]
    assert np.isnan(out[others]).all()


def test_pr39833_reused_row_first_decode_reads_new_requests_last_token():
    """MRv2 reused a row with the previous request's last_sampled_tokens / draft_tokens."""
    rows = RequestRows(2)
    s = RequestState.create(2, 16, num_speculative_tokens=2)
    t = BlockTables.create(SPECS, 2)
    r_old = rows.add("old")
    s = s.add_request(r_old, [7, 7, 7], num_computed_tokens=0)
    s = s.post_update(np.array([r_old]), np.array([3]), np.array([[99, 0, 0]]), np.array([1]))
    s = s.set_draft_tokens(np.array([r_old]), np.array([[98, 97]]))
    rows.remove("old")
    r_new = rows.add("new")
    assert r_new == r_old  # LIFO: the same row, immediately
    # PD-disaggregation: the request arrives with its prompt already computed.
    s = s.add_request(r_new, [5, 6, 8], num_computed_tokens=3)
    t = t.append_block_ids(r_new, [[2]], overwrite=True)
    b = build_step_batch(s, t, ScheduledBatch.from_lists([r_new], [1], pad_to=2), num_tokens_padded=4)
    assert int(b.input_ids[0]) == 8  # the new request's last token, not 99
    assert np.asarray(s.draft_tokens[r_new]).tolist() == [0, 0]


def test_pr38359_pad_rows_never_feed_sampling():
    s, t = _one_request_state()
    b = build_step_batch(s, t, ScheduledBatch.from_lists([1], [5], pad_to=2), num_tokens_padded=8, num_logits_padded=2)
    valid = np.asarray(b.logits_valid)
    np.testing.assert_array_equal(valid, [True, False])
    assert (np.asarray(b.logits_indices)[valid] < int(b.num_tokens)).all()


def test_pr36580_chunked_prefill_gap_between_real_and_padded_tokens_is_pad():
    """The V2 pad started at the padded count, leaving stale slots in [t, T)."""
    s = RequestState.create(1, 32).add_request(0, list(range(1, 21)))
    t = BlockTables.create(SPECS, 1).append_block_ids(0, [[1, 2, 3, 4]], overwrite=True)
    big = build_step_batch(s, t, ScheduledBatch.from_lists([0], [12], pad_to=1), num_tokens_padded=16)
    assert (np.asarray(big.slot_mappings[0, :12]) >= 0).all()
    s = s.post_update(np.array([0]), np.array([12]), np.zeros((1, 1), np.int32), np.array([0]))
    small = build_step_batch(s, t, ScheduledBatch.from_lists([0], [3], pad_to=1), num_tokens_padded=16)
    np.testing.assert_array_equal(small.slot_mappings[0, 3:], [PAD_SLOT_ID] * 13)


def test_pr49757_dummy_tables_are_null_not_last_steps_rows():
    s, t = _one_request_state()
    d = dummy_step_batch(s, t, num_reqs_padded=2, num_tokens_padded=4)
    assert int(np.asarray(t.tables[0]).sum()) > 0
    np.testing.assert_array_equal(d.block_tables[0], np.zeros((2, 4), np.int32))
