"""build_step_batch: one function for every padding rule."""

import functools

import jax
import numpy as np
import pytest
from jax.experimental import checkify

import kvjax
from kvjax import (
    NULL_BLOCK_ID, PAD_SLOT_ID, BlockTables, KVGroupSpec, RequestState, ScheduledBatch,
    build_step_batch, dummy_step_batch,
)


SPECS = (KVGroupSpec(block_size=4, max_num_blocks=4), KVGroupSpec(block_size=8, max_num_blocks=2, kernel_block_size=4))


def make_state():
    """Row 2: 6-token prompt, 4 computed (prefill chunk left). Row 0: decoding with drafts."""
    s = RequestState.create(4, 16, num_speculative_tokens=2)
    s = s.add_request(2, [11, 12, 13, 14, 15, 16], num_computed_tokens=4)
    s = s.add_request(0, [21, 22, 23])
    s = s.post_update(np.array([0]), np.array([3]), np.array([[24, 0, 0]]), np.array([1]))  # nc=3, total 4
    s = s.set_draft_tokens(np.array([0]), np.array([[31, 32]]))
    t = BlockTables.create(SPECS, 4, num_cache_blocks=32)
    t = t.append_block_ids(2, [[5, 6], [7]], overwrite=True)
    t = t.append_block_ids(0, [[9, 10], [11]], overwrite=True)
    return s, t


def test_real_batch_fields():
    s, t = make_state()
    sched = ScheduledBatch.from_lists([0, 2], [3, 2], [2, 0], pad_to=4)
    b = build_step_batch(s, t, sched, num_tokens_padded=8, num_logits_padded=6)
    # decode row 0: positions 3,4,5 with [last_sampled, d0, d1]; prefill row 2: positions 4,5.
    np.testing.assert_array_equal(b.input_ids, [24, 31, 32, 15, 16, 0, 0, 0])
    np.testing.assert_array_equal(b.positions, [3, 4, 5, 4, 5, 0, 0, 0])
    np.testing.assert_array_equal(b.query_start_loc, [0, 3, 5, 5, 5])
    np.testing.assert_array_equal(b.seq_lens, [6, 6, 0, 0])
    np.testing.assert_array_equal(b.is_prefilling, [False, True, False, False])
    np.testing.assert_array_equal(b.logits_indices, [0, 1, 2, 4, 0, 0])
    np.testing.assert_array_equal(b.logits_valid, [True, True, True, True, False, False])
    np.testing.assert_array_equal(b.cu_num_logits, [0, 3, 4, 4, 4])
    # Slots: row 0 block 10 (pos 3 -> block 0 = 9; pos 4,5 -> block 10); row 2 block 6.
    np.testing.assert_array_equal(b.slot_mappings[0], [9 * 4 + 3, 40, 41, 24, 25, -1, -1, -1])
    np.testing.assert_array_equal(b.slot_mappings[1], [22 * 4 + 3, 23 * 4, 23 * 4 + 1, 15 * 4, 15 * 4 + 1, -1, -1, -1])
    np.testing.assert_array_equal(b.block_tables[0], [[9, 10, 0, 0], [5, 6, 0, 0], [0] * 4, [0] * 4])
    np.testing.assert_array_equal(b.block_tables[1], [[22, 23, 0, 0], [14, 15, 0, 0], [0] * 4, [0] * 4])
    assert (int(b.num_tokens), int(b.num_reqs), int(b.num_logits)) == (5, 2, 4)
    assert (b.num_tokens_padded, b.num_reqs_padded, b.num_logits_padded) == (8, 4, 6)
    kvjax.assert_step_batch(b, SPECS)


def test_jit_matches_eager():
    s, t = make_state()
    sched = ScheduledBatch.from_lists([0, 2], [3, 2], [2, 0], pad_to=4)
    eager = build_step_batch(s, t, sched, num_tokens_padded=8, num_logits_padded=6)
    f = jax.jit(functools.partial(build_step_batch, num_tokens_padded=8, num_logits_padded=6))
    jitted = f(s, t, sched)
    for a, c in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted)):
        np.testing.assert_array_equal(a, c)


def test_dummy_batch_is_all_padding_even_after_real_steps():
    s, t = make_state()
    d = dummy_step_batch(s, t, num_reqs_padded=4, num_tokens_padded=8)
    np.testing.assert_array_equal(d.slot_mappings, np.full((2, 8), PAD_SLOT_ID))
    for tbl in d.block_tables:
        np.testing.assert_array_equal(tbl, np.full(tbl.shape, NULL_BLOCK_ID))
    for name in ("input_ids", "positions", "query_start_loc", "seq_lens", "logits_indices"):
        assert not np.asarray(getattr(d, name)).any(), name
    assert not np.asarray(d.logits_valid).any() and int(d.num_tokens) == 0
    np.testing.assert_array_equal(d.idx_mapping, [-1] * 4)
    kvjax.assert_step_batch(d, SPECS)


@pytest.mark.parametrize(
    "rows, q, d, match",
    [
        ([0, 2], [3, 9], [2, 0], r"the schedule has 12 tokens, more than the bucket's num_tokens_padded=8"),
        ([2, 2], [1, 1], [0, 0], r"idx_mapping must not repeat a request row"),
        ([0], [2], [0], r"batch row 0 is a decode row: its query must be 1 \+ num_draft_tokens = 1 tokens, got 2"),
        ([2], [2], [1], r"batch row 0 has 1 drafts, so it must be a decode row"),
        ([0], [4], [3], r"num_draft_tokens\[0\]=3 exceeds num_speculative_tokens=2"),
        ([7], [1], [0], r"idx_mapping must have values in \[0, 4\) \(or -1\); got 7"),
    ],
)
def test_bad_schedules_are_rejected(rows, q, d, match):
    s, t = make_state()
    with pytest.raises(ValueError, match=match):
        build_step_batch(s, t, ScheduledBatch.from_lists(rows, q, d, pad_to=4), num_tokens_padded=8)


def test_a_row_with_no_tokens_may_repeat_a_request_row():
    # A 0-token row is padding (it reads and writes nothing), so its entry is not read: it may name
    # the row a row with tokens names, before or after it. Two rows with tokens may not.
    s, t = make_state()
    eager = functools.partial(build_step_batch, num_tokens_padded=8, num_logits_padded=6)
    want = eager(s, t, ScheduledBatch.from_lists([0], [3], [2], pad_to=4))
    for build in (JIT_BUILD, eager):
        assert_batches_equal(build(s, t, ScheduledBatch.from_lists([0, 0, 2], [3, 0, 0], [2, 0, 0], pad_to=4)), want)
        b = build(s, t, ScheduledBatch.from_lists([0, 0], [0, 3], [0, 2], pad_to=4))
        np.testing.assert_array_equal(b.idx_mapping, [-1, 0, -1, -1])
        np.testing.assert_array_equal(b.query_start_loc, [0, 0, 3, 3, 3])
        kvjax.assert_step_batch(b, SPECS)
    with pytest.raises(ValueError, match=r"idx_mapping must not repeat a request row among rows with tokens: "
                                         r"batch row 2 names request row 0, as an earlier one does, got "
                                         r"\[0, 2, 0, -1\]"):
        eager(s, t, ScheduledBatch.from_lists([0, 2, 0], [3, 2, 1], [2, 0, 0], pad_to=4))


def test_repeated_rows_are_the_later_real_rows_naming_an_earlier_real_rows_request_row():
    """_row_faults' repeated_row against the pairwise definition, for numpy (the eager check),
    jax.numpy and under jit (the mask)."""
    from kvjax.state.step_batch import _row_faults
    s = RequestState.create(4, 64, num_speculative_tokens=2)
    rng = np.random.default_rng(0)
    jitted = jax.jit(lambda i, q, d: _row_faults(s, i, q, d)["repeated_row"])
    for _ in range(200):
        R = int(rng.integers(1, 9))
        idx = rng.integers(-2, 6, R).astype(np.int32)  # -2, 4 and 5: not rows (never real)
        q = rng.integers(-1, 3, R).astype(np.int32)  # 0 and -1: no tokens (never real)
        d = np.zeros(R, np.int32)
        real = (idx >= 0) & (idx < 4) & (q > 0)
        want = [bool(real[b] and any(real[j] and idx[j] == idx[b] for j in range(b))) for b in range(R)]
        for got in (_row_faults(s, idx, q, d, xp=np)["repeated_row"], _row_faults(s, idx, q, d)["repeated_row"],
                    jitted(idx, q, d)):
            assert np.asarray(got).tolist() == want, (idx, q, got)


def test_a_row_with_no_tokens_needs_no_logits_row_eagerly_either():
    # A 0-token row is padding with no logits row (_real_rows), eagerly as under jit: a schedule
    # whose real rows fit num_logits_padded is accepted whatever its 0-token rows' drafts.
    s, t = make_state()
    sched = ScheduledBatch.from_lists([0, 2], [3, 0], [2, 0], pad_to=4)  # row 0: 3 logits rows
    eager = build_step_batch(s, t, sched, num_tokens_padded=8, num_logits_padded=3)
    jitted = jax.jit(functools.partial(build_step_batch, num_tokens_padded=8, num_logits_padded=3))(s, t, sched)
    assert_batches_equal(eager, jitted)
    np.testing.assert_array_equal(eager.cu_num_logits, [0, 3, 3, 3, 3])
    with pytest.raises(ValueError, match="needs 4 logits rows, more than num_logits_padded=3"):
        build_step_batch(s, t, ScheduledBatch.from_lists([0, 2], [3, 1], [2, 0], pad_to=4),
                         num_tokens_padded=8, num_logits_padded=3)


def test_position_past_max_model_len_rejected():
    s = RequestState.create(1, 4).add_request(0, [1, 2, 3, 4])
    t = BlockTables.create((KVGroupSpec(block_size=4, max_num_blocks=1),), 1).append_block_ids(0, [[1]], overwrite=True)
    with pytest.raises(ValueError, match="would reach position 4, past max_model_len=4"):
        build_step_batch(s, t, ScheduledBatch.from_lists([0], [5], pad_to=1), num_tokens_padded=8)


def test_invariant_checks_catch_planted_violations_eagerly_and_under_checkify():
    s, t = make_state()
    sched = ScheduledBatch.from_lists([0, 2], [3, 2], [2, 0], pad_to=4)
    b = build_step_batch(s, t, sched, num_tokens_padded=8, num_logits_padded=6)
    planted = {
        "pad_token_slot_not_PAD": b.replace(slot_mappings=b.slot_mappings.at[0, 7].set(0)),
        "real_slot_in_null_block": b.replace(slot_mappings=b.slot_mappings.at[0, 0].set(2)),
        "two_tokens_share_a_slot": b.replace(slot_mappings=b.slot_mappings.at[0, 1].set(b.slot_mappings[0, 2])),
        "pad_row_table_not_NULL": b.replace(block_tables=(b.block_tables[0].at[3, 0].set(-1), b.block_tables[1])),
        "query_start_loc_decreasing": b.replace(query_start_loc=b.query_start_loc.at[2].set(1)),
        "pad_token_id_or_position_nonzero": b.replace(positions=b.positions.at[6].set(3)),
        "pad_row_seq_len_nonzero": b.replace(seq_lens=b.seq_lens.at[3].set(1)),
        "logits_index_not_real_token": b.replace(logits_indices=b.logits_indices.at[3].set(6)),
        "real_slot_beyond_its_table": b.replace(slot_mappings=b.slot_mappings.at[0, 0].set(20 * 4 + 3)),
    }
    for rule, bad in planted.items():
        with pytest.raises(AssertionError, match=rule):
            kvjax.assert_step_batch(bad, SPECS)
        err, _ = jax.jit(checkify.checkify(lambda x: kvjax.checkify_step_batch(x, SPECS)))(bad)
        with pytest.raises(checkify.JaxRuntimeError, match=rule):
            err.throw()
    err, _ = jax.jit(checkify.checkify(lambda x: kvjax.checkify_step_batch(x, SPECS)))(b)
    err.throw()


JIT_BUILD = jax.jit(functools.partial(build_step_batch, num_tokens_padded=8, num_logits_padded=6))


def assert_batches_equal(got, want):
    for a, c in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, c)


@pytest.mark.parametrize(
    "rows, q, d, build",
    [
        # Issue 10 item 5: a row past max_num_reqs used to read the last real row's tokens.
        ([0, 4], [3, 2], [2, 0], JIT_BUILD),
        ([0, 2**20], [3, 2], [2, 0], JIT_BUILD),
        # T=4 holds row 0's 3 tokens only: row 2 (2 more) is padding, not a clipped row.
        ([0, 2], [3, 2], [2, 0], jax.jit(functools.partial(build_step_batch, num_tokens_padded=4, num_logits_padded=6))),
        # L=3 holds row 0's 3 logits only.
        ([0, 2], [3, 2], [2, 0], jax.jit(functools.partial(build_step_batch, num_tokens_padded=8, num_logits_padded=3))),
        # Negative counts, and more drafts than the state holds.
        ([0, 2], [3, -2], [2, 0], JIT_BUILD),
        ([0, 2], [3, 3], [2, 5], JIT_BUILD),
    ],
)
def test_rows_the_schedule_cannot_hold_are_padding_under_jit(rows, q, d, build):
    s, t = make_state()
    got = build(s, t, ScheduledBatch.from_lists(rows, q, d, pad_to=4))
    want = build(s, t, ScheduledBatch.from_lists(rows[:1], q[:1], d[:1], pad_to=4))
    assert_batches_equal(got, want)
    np.testing.assert_array_equal(got.idx_mapping, [0, -1, -1, -1])
    kvjax.assert_step_batch(got, SPECS)


def test_a_row_scheduled_with_no_tokens_is_padding():
    # Row 2 is mid-prefill and scheduled with 0 tokens: its logits row used to be valid,
    # pointing at row 0's token 0.
    s, t = make_state()
    eager = functools.partial(build_step_batch, num_tokens_padded=8, num_logits_padded=6)
    want = eager(s, t, ScheduledBatch.from_lists([0], [3], [2], pad_to=4))
    for build in (JIT_BUILD, eager):
        b = build(s, t, ScheduledBatch.from_lists([0, 2], [3, 0], [2, 0], pad_to=4))
        assert_batches_equal(b, want)
        np.testing.assert_array_equal(b.cu_num_logits, [0, 3, 3, 3, 3])
        np.testing.assert_array_equal(b.logits_valid, [True] * 3 + [False] * 3)
        kvjax.assert_step_batch(b, SPECS)
