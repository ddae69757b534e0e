"""Validation of the state functions: bad input is a ValueError naming the argument (concrete),
or masked so that it writes nothing (traced); never a wrap, a clamp or a silent no-op."""

import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from kvjax import BlockTables, KVGroupSpec, NewRequests, RequestState, compute_slot_mapping
from kvjax.state import block_id_limit, expand_to_kernel_blocks

WIDE = 2**32  # an int64 id this far up used to wrap onto id - 2**32
SPECS = (KVGroupSpec(block_size=4, max_num_blocks=3),)


def tables():
    t = BlockTables.create(SPECS, 3)
    t = t.append_block_ids(0, [[7]], overwrite=True)
    return t.append_block_ids(1, [[5, 6]], overwrite=True)


def requests():
    s = RequestState.create(3, 8, num_speculative_tokens=2)
    return s.add_request(1, [4, 5, 6], num_computed_tokens=2)


# -------------------------------------------------- ids above 2**31 (issue 10 item 3)

@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: compute_slot_mapping(np.asarray(tables().tables[0]), np.array([WIDE + 1], np.int64),
                                      np.array([0, 1]), np.array([0]), block_size=4, num_tokens_padded=2),
         r"idx_mapping must have values in \[0, 3\) \(or -1\); got 4294967297"),
        (lambda: compute_slot_mapping(np.array([[WIDE + 7, 0, 0]], np.int64), np.array([0]),
                                      np.array([0, 1]), np.array([0]), block_size=4, num_tokens_padded=2),
         r"block_table must have values in \[-2147483648, 536870912\); got 4294967303"),
        (lambda: compute_slot_mapping(np.asarray(tables().tables[0]), np.array([0]), np.array([0, 1]),
                                      np.array([WIDE + 1], np.int64), block_size=4, num_tokens_padded=2),
         r"positions must have values in"),
        (lambda: tables().append_block_ids(0, [[WIDE + 5]]), r"block_ids\[0\] must have values in \[0, 536870912\)"),
        (lambda: BlockTables.create(SPECS, 3, num_cache_blocks=9).append_block_ids(0, [[WIDE + 5]]),
         r"block_ids\[0\] must have values in \[0, 9\); got 4294967301"),
        (lambda: tables().append_block_ids(WIDE + 1, [[5]]), r"row must have values in \[0, 3\); got 4294967297"),
        (lambda: tables().write_rows(np.array([WIDE + 1], np.int64), [np.array([[5]])], np.array([[1]]),
                                     np.array([False])), r"rows must have values in \[0, 3\) \(or -1\)"),
        (lambda: tables().write_rows(np.array([2]), [np.array([[WIDE + 5]], np.int64)], np.array([[1]]),
                                     np.array([False])), r"block_ids\[0\] must have values in"),
        (lambda: requests().clear_rows(np.array([WIDE + 1], np.int64)), r"rows must have values in \[0, 3\)"),
        (lambda: requests().post_update(np.array([WIDE + 1], np.int64), np.array([1]), np.array([[9]]),
                                        np.array([1])), r"idx_mapping must have values in \[0, 3\)"),
        (lambda: requests().set_draft_tokens(np.array([WIDE + 1], np.int64), np.array([[1, 2]])),
         r"idx_mapping must have values in \[0, 3\)"),
        (lambda: NewRequests.from_lists([0], [np.array([3, WIDE + 1])], max_model_len=4),
         r"token_ids\[0\] must have values in \[0, 2147483648\); got 4294967297 at index 1"),
        (lambda: NewRequests.from_lists([WIDE], [[3]], max_model_len=4), r"rows must have values in"),
    ],
)
def test_wide_ids_are_rejected_before_narrowing(call, match):
    with pytest.raises(ValueError, match=match):
        call()


X64_SCRIPT = textwrap.dedent("""
    import jax, numpy as np
    assert jax.config.jax_enable_x64
    from kvjax import BlockTables, KVGroupSpec, NewRequests, RequestState, compute_slot_mapping
    W = 2**32
    t = BlockTables.create((KVGroupSpec(block_size=4, max_num_blocks=3),), 3)
    t = t.append_block_ids(1, [[5, 6]], overwrite=True)
    tbl = np.asarray(t.tables[0]).astype(np.int64)
    sm = jax.jit(lambda i: compute_slot_mapping(tbl, i, np.array([0, 2]), np.array([0, 5]),
                                                block_size=4, num_tokens_padded=3))
    assert np.asarray(sm(np.array([1]))).tolist() == [20, 25, -1]
    assert np.asarray(sm(np.array([W + 1]))).tolist() == [-1, -1, -1], "wide row read row 1"
    w = jax.jit(lambda r, b: t.write_rows(r, [b], np.array([[1]]), np.array([False])))
    before = [np.asarray(a).tolist() for a in (t.tables[0], t.num_blocks)]
    for r, b in ((np.array([2]), np.array([[W + 5]])), (np.array([W + 1]), np.array([[7]]))):
        u = w(r, b)
        assert [np.asarray(a).tolist() for a in (u.tables[0], u.num_blocks)] == before, (r, b)
    assert np.asarray(w(np.array([2]), np.array([[7]])).tables[0])[2].tolist() == [7, 0, 0]
    s = RequestState.create(3, 8).add_request(1, [4, 5, 6])
    c = jax.jit(lambda r: s.clear_rows(r))
    assert int(c(np.array([W + 1])).total_len[1]) == 3, "wide row cleared row 1"
    assert int(c(np.array([1])).total_len[1]) == 0
    g = jax.jit(lambda i: t.gather(i)[0])
    assert np.asarray(g(np.array([W + 1]))).tolist() == [[0, 0, 0]], "wide row gathered row 1"
    from kvjax import ScheduledBatch, build_step_batch
    b = jax.jit(lambda i: build_step_batch(s, t, ScheduledBatch(i, np.array([2]), np.array([0])),
                                           num_tokens_padded=4).num_tokens)
    assert int(b(np.array([1]))) == 2 and int(b(np.array([W + 1]))) == 0, "wide row built as row 1"
    try:
        t.append_block_ids(0, [[W + 5]])
    except ValueError as e:
        assert "block_ids[0] must have values" in str(e)
    else:
        raise AssertionError("no error")
    print("ok")
""")


def test_wide_ids_under_jit_with_x64_write_nothing():
    env = dict(os.environ, JAX_ENABLE_X64="1", JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", X64_SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


# ------------------------------ ids within int32 whose slots would not be (block_id_limit)

def test_block_id_limit_keeps_every_slot_in_int32():
    for bs in (1, 4, 16, 32, 64, 3):
        lim = block_id_limit(bs)
        assert (lim - 1) * bs + bs - 1 <= 2**31 - 1 < lim * bs + bs - 1


@pytest.mark.parametrize(
    "call, match",
    [
        # 2**27 + 1 is an int32, but * 32 is 2**32 + 32: it wrapped onto block 1's slots 32..34
        (lambda: compute_slot_mapping(np.array([[2**27 + 1, 0]], np.int32), np.array([0]), np.array([0, 3]),
                                      np.arange(3), block_size=32, num_tokens_padded=4),
         r"block_table must have values in \[-2147483648, 67108864\); got 134217729"),
        # * 32 wrapped to a negative slot: the writes were dropped
        (lambda: compute_slot_mapping(np.array([[3 * 2**26, 0]], np.int32), np.array([0]), np.array([0, 3]),
                                      np.arange(3), block_size=32, num_tokens_padded=4),
         r"block_table must have values in \[-2147483648, 67108864\); got 201326592"),
        # without num_cache_blocks the logical id's kernel ids 4 * (2**30 + 1) + k wrapped to 4..7
        (lambda: BlockTables.create((KVGroupSpec(64, 4, kernel_block_size=16),), 2)
         .append_block_ids(0, [[2**30 + 1]], overwrite=True),
         r"block_ids\[0\] must have values in \[0, 33554432\); got 1073741825"),
        (lambda: expand_to_kernel_blocks(np.array([[2**30 + 1]], np.int32), 4),
         r"block_ids must have values in \[-2147483648, 536870912\); got 1073741825"),
        # a negative table entry is named as such, not as the null block
        (lambda: compute_slot_mapping(np.array([[-3, 0]], np.int32), np.array([0]), np.array([0, 1]),
                                      np.arange(1), block_size=4, num_tokens_padded=2),
         r"which holds -3: block ids are >= 0"),
    ],
)
def test_block_ids_whose_slots_pass_int32_are_refused(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_block_ids_whose_slots_pass_int32_write_nothing_under_jit():
    sm = jax.jit(lambda t: compute_slot_mapping(t, np.array([0]), np.array([0, 3]), np.arange(3),
                                                block_size=32, num_tokens_padded=4))
    for wide in (2**27 + 1, 3 * 2**26, 2**26):
        assert np.asarray(sm(np.array([[wide, 0]], np.int32))).tolist() == [-1, -1, -1, -1], wide
    assert np.asarray(sm(np.array([[2**26 - 1, 0]], np.int32))).tolist() == [
        (2**26 - 1) * 32, (2**26 - 1) * 32 + 1, (2**26 - 1) * 32 + 2, -1]
    t = BlockTables.create((KVGroupSpec(64, 4, kernel_block_size=16),), 2)
    w = jax.jit(lambda b: t.write_rows(np.array([0]), [b], np.array([[1]]), np.array([True])))
    assert np.asarray(w(np.array([[2**30 + 1]], np.int32)).tables[0])[0].tolist() == [0] * 16
    assert np.asarray(w(np.array([[3]], np.int32)).tables[0])[0, :4].tolist() == [12, 13, 14, 15]


# ------------------------------------- silent no-ops and truncations (issue 10 item 7)

@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: tables().append_block_ids(-1, [[5]]), r"row must have values in \[0, 3\); got -1"),
        (lambda: tables().clear_row(-1), r"row must have values in \[0, 3\); got -1"),
        (lambda: requests().add_request(-1, [1, 2]), r"row must have values in \[0, 3\); got -1"),
        (lambda: requests().set_draft_tokens(np.array([3]), np.array([[1, 2]])),
         r"idx_mapping must have values in \[0, 3\) \(or -1\); got 3"),
        (lambda: requests().set_draft_tokens(np.array([1]), np.array([[1.5, 2.0]])),
         r"drafts must have dtype an integer dtype, got float64"),
        (lambda: requests().set_draft_tokens(np.array([1]), np.array([[1, -4]])), r"drafts must have values in \[0, "),
        (lambda: requests().post_update(np.array([1]), np.array([-1]), np.array([[9]]), np.array([0])),
         r"query_lens must have values in \[0, 9\); got -1"),
        (lambda: requests().post_update(np.array([1]), np.array([7]), np.array([[9]]), np.array([1])),
         r"query_lens\[0\]=7: request row 1 has 2 tokens computed, so its query would end past max_model_len=8"),
        (lambda: requests().post_update(np.array([1]), np.array([1]), np.array([[9]]), np.array([2])),
         r"num_sampled must have values in \[0, 2\); got 2"),
    ],
)
def test_state_functions_reject_bad_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_post_update_under_jit_skips_a_row_whose_query_cannot_be():
    s = requests()
    f = jax.jit(lambda q: s.post_update(np.array([1]), q, np.array([[9]]), np.array([1])))
    for q in (-1, 7):
        got = f(np.array([q], np.int32))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(s)):
            np.testing.assert_array_equal(a, b)
    assert int(f(np.array([1], np.int32)).num_computed_tokens[1]) == 3


def test_one_row_conveniences_accept_every_real_row():
    t = BlockTables.create(SPECS, 3)
    for row in range(3):
        t = t.append_block_ids(row, [[row + 1]], overwrite=True).clear_row(row)
    assert not np.asarray(t.num_blocks).any()


# ------------------------------------------ a step's schedule and state slots (step_batch)

def _prompt_row():
    from kvjax import ScheduledBatch, build_step_batch  # noqa: F401
    rs = RequestState.create(4, 16).add_request(0, [11, 12, 13, 14, 15])  # a 5-token prompt
    tb = BlockTables.create((KVGroupSpec(block_size=4, max_num_blocks=4),), 4, num_cache_blocks=32)
    return rs, tb.append_block_ids(0, [[3, 4]], overwrite=True)


def test_a_prefill_chunk_cannot_pass_the_prompt():
    from kvjax import ScheduledBatch, build_step_batch
    rs, tb = _prompt_row()
    # 7 tokens of a 5-token prompt: positions 5, 6 took slots 17, 18 with made-up token 0
    with pytest.raises(ValueError, match=r"prefill row with 5 of its 5 tokens left.*num_scheduled_tokens\[0\]=7"):
        build_step_batch(rs, tb, ScheduledBatch.from_lists([0], [7], pad_to=2), num_tokens_padded=8)
    rs3 = rs.replace(num_computed_tokens=rs.num_computed_tokens.at[0].set(3))
    with pytest.raises(ValueError, match=r"prefill row with 2 of its 5 tokens left"):
        build_step_batch(rs3, tb, ScheduledBatch.from_lists([0], [3], pad_to=2), num_tokens_padded=8)
    b = build_step_batch(rs, tb, ScheduledBatch.from_lists([0], [5], pad_to=2), num_tokens_padded=8)
    assert np.asarray(b.input_ids).tolist()[:5] == [11, 12, 13, 14, 15]


@pytest.mark.parametrize("si, match", [
    (np.array([2**32 + 3, 7], np.int64), r"state_indices must have values in \[0, 2147483648\); got 4294967299"),
    (np.array([-1, 5]), r"state_indices must have values in \[0, 2147483648\); got -1"),
    (np.array([[1, 2], [2**31, 0]], np.int64), r"state_indices must have values in"),
])
def test_state_indices_are_range_checked_before_narrowing(si, match):
    from kvjax import ScheduledBatch, build_step_batch
    rs, tb = _prompt_row()
    with pytest.raises(ValueError, match=match):
        build_step_batch(rs, tb, ScheduledBatch.from_lists([0], [5], pad_to=2), num_tokens_padded=8,
                         state_indices=si)


def test_negative_state_indices_read_as_null_under_jit():
    from kvjax import ScheduledBatch, build_step_batch
    rs, tb = _prompt_row()
    f = jax.jit(lambda si: build_step_batch(rs, tb, ScheduledBatch.from_lists([0], [5], pad_to=2),
                                            num_tokens_padded=8, state_indices=si).state_indices)
    assert np.asarray(f(np.array([-1, 5], np.int32))).tolist() == [[0], [0]]
    assert np.asarray(f(np.array([6, 5], np.int32))).tolist() == [[6], [0]]


@pytest.mark.parametrize("rows, match", [
    ([4], r"free_rows must have values in \[0, 4\); got 4"),      # was clamped to row 3
    ([-1], r"free_rows must have values in \[0, 4\); got -1"),    # wrapped to row 3
    ([-3], r"free_rows must have values in \[0, 4\); got -3"),    # wrapped to row 1
    ([1.9], r"free_rows must have dtype an integer dtype"),       # truncated to row 1
])
def test_free_rows_are_empty_refuses_rows_outside_the_table(rows, match):
    from kvjax.state import free_rows_are_empty
    tb = BlockTables.create(SPECS, 4, num_cache_blocks=32).append_block_ids(1, [[3]], overwrite=True)
    with pytest.raises(ValueError, match=match):
        free_rows_are_empty(tb, rows)
    assert not bool(free_rows_are_empty(tb, [1])) and bool(free_rows_are_empty(tb, [0, 2, 3]))
    assert bool(free_rows_are_empty(tb, []))


@pytest.mark.parametrize("call, match", [
    (lambda S: S.from_lists([0.7], [3], pad_to=2), r"rows must have dtype an integer dtype, got float64"),
    (lambda S: S.from_lists([0], [3.9], pad_to=2), r"num_scheduled_tokens must have dtype an integer dtype"),
    (lambda S: S.from_lists([2**32], [3], pad_to=2), r"rows must have values in \[-2147483648, 2147483648\); got 4294967296"),
    (lambda S: S.from_lists([0], [1], [2**40], pad_to=2), r"num_draft_tokens must have values in"),
    (lambda S: S.from_lists([0, 1], [1], pad_to=2), r"num_scheduled_tokens must have shape \[2\]"),
])
def test_scheduled_batch_from_lists_refuses_what_int32_cannot_hold(call, match):
    from kvjax import ScheduledBatch
    with pytest.raises(ValueError, match=match):
        call(ScheduledBatch)


def test_a_schedule_with_float_or_wide_counts_is_refused():
    from kvjax import ScheduledBatch, build_step_batch
    rs, tb = _prompt_row()
    for q, match in ((np.array([2.9, 0.0]), r"num_scheduled_tokens must have dtype an integer dtype"),
                     (np.array([2**32 + 2, 0], np.int64), r"num_scheduled_tokens must have values in")):
        s = ScheduledBatch(idx_mapping=np.array([0, -1], np.int32), num_scheduled_tokens=q,
                           num_draft_tokens=np.array([0, 0], np.int32))
        with pytest.raises(ValueError, match=match):
            build_step_batch(rs, tb, s, num_tokens_padded=8)


def test_rows_breaking_the_schedule_rules_are_padding_under_jit():
    """The eager refusals of validate_schedule, as the jit mask (_row_faults owns both)."""
    from kvjax import ScheduledBatch, build_step_batch
    rs, tb = _prompt_row()
    f = jax.jit(lambda rs, s: build_step_batch(rs, tb, s, num_tokens_padded=8, num_logits_padded=4))

    def real_rows(rs, rows, q, d=None):
        b = f(rs, ScheduledBatch.from_lists(rows, q, d, pad_to=3))
        return np.asarray(b.idx_mapping).tolist(), int(b.num_tokens)

    assert real_rows(rs, [0], [5]) == ([0, -1, -1], 5)
    assert real_rows(rs, [0, 0], [2, 2]) == ([0, -1, -1], 2)          # a repeated row: the first stays
    assert real_rows(rs, [0], [7]) == ([-1, -1, -1], 0)               # past the 5-token prompt
    assert real_rows(rs, [0], [3], [2]) == ([-1, -1, -1], 0)          # drafts on a prefill row
    assert real_rows(rs, [0], [3], [-1]) == ([-1, -1, -1], 0)         # negative drafts
    with pytest.raises(ValueError, match=r"num_draft_tokens\[0\] must be non-negative, got -1"):
        build_step_batch(rs, tb, ScheduledBatch.from_lists([0], [3], [-1], pad_to=3), num_tokens_padded=8)
    with pytest.raises(ValueError, match=r"num_scheduled_tokens\[0\] must be non-negative, got -2"):
        build_step_batch(rs, tb, ScheduledBatch.from_lists([0], [-2], pad_to=3), num_tokens_padded=8)
    full = RequestState.create(4, 16).add_request(0, list(range(1, 17)), num_computed_tokens=16)
    assert real_rows(full, [0], [1]) == ([-1, -1, -1], 0)             # position 16 of max_model_len 16
    dec = RequestState.create(4, 16, num_speculative_tokens=2).add_request(0, [1, 2, 3], num_computed_tokens=3)
    assert real_rows(dec, [0], [2], [0]) == ([-1, -1, -1], 0)         # a decode row's query is its window
    assert real_rows(dec, [0], [3], [2]) == ([0, -1, -1], 3)


@pytest.mark.parametrize("first, match", [
    (np.array([2**32 + 12, 0], np.int64), r"first_positions must have values in \[0, 2147483648\); got 4294967308"),
    (np.array([12.9, 0.0]), r"first_positions must have dtype an integer dtype"),
    (np.array([-3, 0]), r"first_positions must have values in \[0, 2147483648\); got -3"),
])
def test_gather_range_checks_first_positions(first, match):
    t = BlockTables.create((KVGroupSpec(block_size=4, max_num_blocks=8, sliding_window=8),), 3)
    t = t.append_block_ids(0, [[1, 2, 3, 4, 5]], overwrite=True)
    with pytest.raises(ValueError, match=match):
        t.gather(np.array([0, -1]), first_positions=first)
    # 12 - 8 + 1 = 5: blocks 0 (positions 0-3) hidden, block 1 (4-7) seen
    assert np.asarray(t.gather(np.array([0, -1]), first_positions=np.array([12, 0]))[0])[0].tolist() == [
        0, 2, 3, 4, 5, 0, 0, 0]
