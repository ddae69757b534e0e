"""The invariant checker: each rule fires on the batch or table that breaks it, and only then."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import kvjax
import kvjax.state.step_batch as step_batch_module
from kvjax import BlockTables, KVGroupSpec, RequestState, ScheduledBatch, build_step_batch
from kvjax.state.block_tables import block_id_limit
from kvjax.state import (
    assert_block_tables, block_table_violations, checkify_slot_mapping_inputs, free_rows_are_empty,
    step_batch_violations,
)

SPECS = (KVGroupSpec(block_size=4, max_num_blocks=4), KVGroupSpec(block_size=8, max_num_blocks=2, kernel_block_size=4))


def make_state():
    """4 rows. Row 0 decodes (2 drafts), row 2 is mid-prefill (4 of 6 computed)."""
    s = RequestState.create(4, 16, num_speculative_tokens=2)
    s = s.add_request(2, [11, 12, 13, 14, 15, 16], num_computed_tokens=4)
    s = s.add_request(0, [21, 22, 23], num_computed_tokens=3)
    s = s.set_draft_tokens(np.array([0]), np.array([[31, 32]]))
    t = BlockTables.create(SPECS, 4, num_cache_blocks=32)
    t = t.append_block_ids(2, [[5, 6], [7]], overwrite=True)
    t = t.append_block_ids(0, [[9, 10], [11]], overwrite=True)
    return s, t


def _old_real_rows(requests, sched, T, L):
    """The padding rule as it was before issue 10 item 5: only -1 made a row padding."""
    q = jnp.asarray(sched.num_scheduled_tokens, jnp.int32)
    d = jnp.asarray(sched.num_draft_tokens, jnp.int32)
    valid = jnp.asarray(sched.idx_mapping) >= 0
    return valid, jnp.where(valid, q, 0), jnp.where(valid, d, 0)


def violated(batch):
    return sorted(k for k, v in step_batch_violations(batch, SPECS).items() if bool(v))


@pytest.mark.parametrize(
    "rows, q, d, T, L, rules",
    [
        ([0, 4], [3, 2], [2, 0], 8, 6, ["pad_row_has_tokens", "pad_row_seq_len_nonzero"]),
        ([0, 2], [3, 2], [2, 0], 4, 6, ["tokens_exceed_bucket"]),
        ([0, 2], [3, 0], [2, 0], 8, 6, ["logits_index_outside_its_row", "row_without_tokens_has_logits"]),
    ],
)
def test_the_checker_flags_each_batch_the_old_padding_rule_built(monkeypatch, rows, q, d, T, L, rules):
    s, t = make_state()
    sched = ScheduledBatch.from_lists(rows, q, d, pad_to=4)
    build = functools.partial(build_step_batch, num_tokens_padded=T, num_logits_padded=L)
    good = jax.jit(build)(s, t, sched)
    assert violated(good) == []
    monkeypatch.setattr(step_batch_module, "_real_rows", _old_real_rows)
    bad = jax.jit(lambda *a: build(*a))(s, t, sched)  # a fresh function: a fresh trace
    assert set(rules) <= set(violated(bad)), violated(bad)
    with pytest.raises(AssertionError, match=rules[0]):
        kvjax.assert_step_batch(bad, SPECS)


def test_a_logits_row_pointing_into_another_row_is_flagged():
    s, t = make_state()
    b = build_step_batch(s, t, ScheduledBatch.from_lists([0, 2], [3, 2], [2, 0], pad_to=4),
                         num_tokens_padded=8, num_logits_padded=6)
    assert violated(b) == []
    bad = b.replace(logits_indices=b.logits_indices.at[3].set(0))  # row 2's logits -> row 0's token 0
    assert violated(bad) == ["logits_index_outside_its_row"]


def test_an_idx_mapping_entry_that_is_neither_a_row_nor_PAD_is_flagged():
    s, t = make_state()
    b = build_step_batch(s, t, ScheduledBatch.from_lists([0], [3], [2], pad_to=4),
                         num_tokens_padded=8, num_logits_padded=6)
    for v in (4, -2):
        assert violated(b.replace(idx_mapping=b.idx_mapping.at[2].set(v))) == ["idx_mapping_neither_row_nor_PAD"]


def test_block_table_rules_fire_one_at_a_time():
    t = BlockTables.create(SPECS, 4, num_cache_blocks=32).append_block_ids(1, [[3], [4]], overwrite=True)
    assert not any(bool(v) for v in block_table_violations(t).values())
    assert_block_tables(t)
    planted = [
        ("entry_past_live_length_not_NULL", t.replace(tables=(t.tables[0].at[1, 2].set(7), t.tables[1]))),
        ("negative_block_table_entry", t.replace(tables=(t.tables[0].at[1, 0].set(-1), t.tables[1]))),
        ("live_length_exceeds_width", t.replace(num_blocks=t.num_blocks.at[0, 1].set(5))),
        # logical block 32 of a 32-block cache: group 0 directly, group 1 as kernel id 64 = 32 * 2
        ("live_entry_past_the_cache", t.replace(tables=(t.tables[0].at[1, 0].set(32), t.tables[1]))),
        ("live_entry_past_the_cache", t.replace(tables=(t.tables[0], t.tables[1].at[1, 1].set(64)))),
    ]
    for rule, bad in planted:
        got = [k for k, v in block_table_violations(bad).items() if bool(v)]
        assert got == [rule], (rule, got)
        with pytest.raises(AssertionError, match=rule):
            assert_block_tables(bad)


def test_live_entries_name_blocks_the_cache_has():
    """Below num_cache_blocks (logical ids: kernel id // blocks_per_kv_block) when known, else below
    block_id_limit; an entry past the live length is another rule's, a NULL one is a skipped block."""
    t = BlockTables.create(SPECS, 4, num_cache_blocks=32).append_block_ids(1, [[31], [31]], overwrite=True)
    np.testing.assert_array_equal(t.tables[1][1, :2], [62, 63])  # logical 31 of group 1: kernel 62, 63
    assert not bool(block_table_violations(t)["live_entry_past_the_cache"])
    assert not bool(block_table_violations(t.replace(tables=(t.tables[0].at[1, 0].set(0), t.tables[1])))[
        "live_entry_past_the_cache"])
    unknown = BlockTables.create(SPECS, 4).append_block_ids(1, [[31], [31]], overwrite=True)
    limit = block_id_limit(4)  # group 0: blocks of 4 tokens
    for entry, bad in ((limit - 1, False), (limit, True)):
        v = block_table_violations(unknown.replace(tables=(unknown.tables[0].at[1, 0].set(entry), unknown.tables[1])))
        assert bool(v["live_entry_past_the_cache"]) == bad, entry
    v = block_table_violations(unknown.replace(tables=(unknown.tables[0].at[1, 0].set(99), unknown.tables[1])))
    assert not bool(v["live_entry_past_the_cache"])  # no num_cache_blocks: 99 is a block


def test_a_real_slot_outside_its_rows_table_is_flagged():
    s, t = make_state()
    b = build_step_batch(s, t, ScheduledBatch.from_lists([0, 2], [3, 2], [2, 0], pad_to=4),
                         num_tokens_padded=8, num_logits_padded=6)
    assert violated(b) == []
    # token 0 (row 0, position 3) into row 2's block 5 / into block 20, no row's: both off its table
    for slot in (5 * 4 + 3, 20 * 4 + 3):
        assert violated(b.replace(slot_mappings=b.slot_mappings.at[0, 0].set(slot))) == ["real_slot_beyond_its_table"]
    # the table moved instead: row 0's position 3 is no longer in block 9
    tbl = b.block_tables[0].at[0, 0].set(12)
    assert violated(b.replace(block_tables=(tbl, b.block_tables[1]))) == ["real_slot_beyond_its_table"]


def test_free_rows_are_empty():
    t = BlockTables.create(SPECS, 4).append_block_ids(1, [[3], [4]], overwrite=True)
    assert bool(free_rows_are_empty(t, [0, 2, 3]))
    assert bool(free_rows_are_empty(t, []))
    assert not bool(free_rows_are_empty(t, [1]))
    assert not bool(free_rows_are_empty(t.replace(num_blocks=t.num_blocks.at[1, 2].set(1)), [2]))


def test_checkify_slot_mapping_inputs_reports_each_fault():
    table = np.array([[1, 2, 0]], np.int32)  # row 0 holds blocks 1, 2; column 2 unallocated

    def run(qsl, positions, T=4, rows=(0,)):
        f = jax.jit(checkify.checkify(functools.partial(
            checkify_slot_mapping_inputs, block_size=4, num_tokens_padded=T)))
        err, _ = f(table, np.array(rows, np.int32), np.array(qsl, np.int32), np.array(positions, np.int32))
        return err

    run([0, 2], [6, 7, 0, 0]).throw()  # block 2: fine
    run([0, 2, 2], [6, 7, 0, 0], rows=(0, -1)).throw()  # a padding row
    for qsl, positions, T, rows, match in [
        ([0, 2], [8, 9, 0, 0], 4, (0,), "NULL_BLOCK_ID"),  # column 2 is the null block
        ([0, 2], [12, 13, 0, 0], 4, (0,), "outside the block table"),
        ([1, 2], [6, 7, 0, 0], 4, (0,), r"query_start_loc\[0\] must be 0"),
        ([0, 5], [6, 7, 0, 0, 0], 4, (0,), "exceeds num_tokens_padded"),
        # the table has one row: row 1 is past it (its tokens would silently write nothing)
        ([0, 1, 2], [6, 7, 0, 0], 4, (0, 1), r"idx_mapping must have values in \[0, 1\) \(or -1\); got 1 at index 1"),
        ([0, 1, 2], [6, 7, 0, 0], 4, (-2, 0), r"idx_mapping must have values in \[0, 1\) \(or -1\); got -2 at index 0"),
        ([0, 3], [6, 7], 4, (0,), r"positions must cover the 3 real tokens \(query_start_loc\[-1\]\), got shape \[2\]"),
    ]:
        with pytest.raises(checkify.JaxRuntimeError, match=match):
            run(qsl, positions, T, rows).throw()
        with pytest.raises(ValueError):  # the eager check of the same inputs
            kvjax.compute_slot_mapping(table, np.array(rows), np.array(qsl), np.array(positions), block_size=4,
                                       num_tokens_padded=T)


def test_checkify_slot_mapping_inputs_makes_the_static_checks():
    with pytest.raises(ValueError, match=r"query_start_loc must have shape \[2\], got \[3\]"):
        checkify_slot_mapping_inputs(jnp.zeros((1, 3), jnp.int32), jnp.zeros((1,), jnp.int32),
                                     jnp.zeros((3,), jnp.int32), jnp.zeros((4,), jnp.int32),
                                     block_size=4, num_tokens_padded=4)
