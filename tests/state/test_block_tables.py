"""Block tables and compute_slot_mapping."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax.experimental import checkify

import kvjax
from kvjax import NULL_BLOCK_ID, PAD_SLOT_ID, BlockTables, KVGroupSpec, compute_slot_mapping


def numpy_slot_mapping(table, idx_mapping, qsl, positions, block_size, T):
    """Independent loop implementation of the slot-mapping rule."""
    out = np.full(T, PAD_SLOT_ID, np.int64)
    for b in range(len(idx_mapping)):
        row = idx_mapping[b]
        for t in range(qsl[b], qsl[b + 1]):
            if row < 0:
                continue
            pos = positions[t]
            out[t] = table[row][pos // block_size] * block_size + pos % block_size
    return out


def test_public_signature():
    sig = inspect.signature(kvjax.compute_slot_mapping)
    assert list(sig.parameters) == [
        "block_table", "idx_mapping", "query_start_loc", "positions", "block_size", "num_tokens_padded",
    ]
    assert sig.parameters["block_size"].kind is inspect.Parameter.KEYWORD_ONLY
    assert sig.parameters["num_tokens_padded"].kind is inspect.Parameter.KEYWORD_ONLY
    assert kvjax.PAD_SLOT_ID == -1 and kvjax.NULL_BLOCK_ID == 0


def test_append_expand_and_overwrite_rewrites_whole_row():
    specs = (KVGroupSpec(block_size=4, max_num_blocks=4), KVGroupSpec(block_size=8, max_num_blocks=2, kernel_block_size=4))
    bt = BlockTables.create(specs, max_num_reqs=3)
    bt = bt.append_block_ids(1, [[5, 6, 7], [3]], overwrite=True)
    bt = bt.append_block_ids(1, [[9], [4]])
    np.testing.assert_array_equal(bt.tables[0][1], [5, 6, 7, 9])
    np.testing.assert_array_equal(bt.tables[1][1], [6, 7, 8, 9])  # 3 -> 6,7 ; 4 -> 8,9
    np.testing.assert_array_equal(bt.num_blocks[:, 1], [4, 4])
    # A new tenant in the same row: the whole row is rewritten, no stale tail.
    bt = bt.append_block_ids(1, [[2], []], overwrite=True)
    np.testing.assert_array_equal(bt.tables[0][1], [2, 0, 0, 0])
    np.testing.assert_array_equal(bt.tables[1][1], [0, 0, 0, 0])
    np.testing.assert_array_equal(bt.num_blocks[:, 1], [1, 0])
    # Other rows untouched.
    assert int(jnp.abs(bt.tables[0][0]).sum() + jnp.abs(bt.tables[0][2]).sum()) == 0
    kvjax.assert_block_tables(bt)


def test_clear_row():
    bt = BlockTables.create((KVGroupSpec(block_size=2, max_num_blocks=3),), 2)
    bt = bt.append_block_ids(0, [[4, 5]], overwrite=True).append_block_ids(1, [[6]], overwrite=True)
    bt = bt.clear_row(0)
    np.testing.assert_array_equal(bt.tables[0], [[0, 0, 0], [6, 0, 0]])
    np.testing.assert_array_equal(bt.num_blocks, [[0, 1]])


def test_write_rows_batched_matches_sequential():
    specs = (KVGroupSpec(block_size=2, max_num_blocks=4, kernel_block_size=1),)
    bt = BlockTables.create(specs, 4).append_block_ids(2, [[7]], overwrite=True)
    batched = bt.write_rows(
        np.array([2, -1, 0], np.int32),
        [np.array([[8, 9], [1, 1], [3, 0]], np.int32)],
        np.array([[2, 2, 1]], np.int32),
        np.array([False, True, True]),
    )
    seq = bt.append_block_ids(2, [[8, 9]]).append_block_ids(0, [[3]], overwrite=True)
    for a, b in zip(jax.tree.leaves(batched), jax.tree.leaves(seq)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda bt: bt.append_block_ids(0, [[-1]]), r"block_ids\[0\] must not contain negative ids, got -1: PAD_SLOT_ID"),
        (lambda bt: bt.append_block_ids(5, [[1]]), r"row must have values in \[0, 3\); got 5"),
        (lambda bt: bt.append_block_ids(0, [[1, 2, 3, 4, 5]]), r"would hold 5 kernel blocks, more than the table width 4"),
        (lambda bt: bt.append_block_ids(0, [[1], [2]]), r"one list per KV-cache group \(1\), got 2"),
        (lambda bt: bt.append_block_ids(0, [[10]]), r"block_ids\[0\] must have values in \[0, 10\); got 10"),
    ],
)
def test_append_rejects_bad_input(call, match):
    bt = BlockTables.create((KVGroupSpec(block_size=4, max_num_blocks=4),), 3, num_cache_blocks=10)
    with pytest.raises(ValueError, match=match):
        call(bt)


def test_gather_pads_with_null_and_masks_past_live_length():
    specs = (KVGroupSpec(block_size=2, max_num_blocks=4),)
    bt = BlockTables.create(specs, 3).append_block_ids(0, [[4, 5]], overwrite=True).append_block_ids(2, [[6]], overwrite=True)
    # Plant a stale id past row 2's live length (as vLLM would leave it): gather must not show it.
    stale = bt.replace(tables=(bt.tables[0].at[2, 3].set(9),))
    (g,) = stale.gather(jnp.array([2, 0, -1, -1]))
    np.testing.assert_array_equal(g, [[6, 0, 0, 0], [4, 5, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]])


def test_gather_sliding_window_nulls_invisible_leading_blocks():
    specs = (KVGroupSpec(block_size=4, max_num_blocks=4, sliding_window=4),)
    bt = BlockTables.create(specs, 1).append_block_ids(0, [[3, 4, 5, 6]], overwrite=True)
    # First query position 9: visible positions start at 6 -> block 0 (pos 0-3) invisible.
    (g,) = bt.gather(jnp.array([0]), first_positions=jnp.array([9]))
    np.testing.assert_array_equal(g, [[0, 4, 5, 6]])
    (g,) = bt.gather(jnp.array([0]), first_positions=jnp.array([14]))  # visible from 11
    np.testing.assert_array_equal(g, [[0, 0, 5, 6]])
    (g,) = bt.gather(jnp.array([0]))  # no positions given: nothing nulled
    np.testing.assert_array_equal(g, [[3, 4, 5, 6]])


def test_slot_mapping_values():
    table = np.array([[0, 0, 0], [7, 8, 9], [3, 0, 0]], np.int32)
    idx = np.array([1, -1, 2], np.int32)
    qsl = np.array([0, 3, 5, 6], np.int32)
    pos = np.array([2, 3, 4, 0, 1, 1, 0, 0], np.int32)
    sm = compute_slot_mapping(table, idx, qsl, pos, block_size=2, num_tokens_padded=8)
    np.testing.assert_array_equal(sm, [16, 17, 18, -1, -1, 7, -1, -1])


def test_slot_mapping_view_independent_of_kernel_block_size():
    # Same logical blocks seen as block_size 8 and as kernel block size 4 (r = 2).
    logical = BlockTables.create((KVGroupSpec(block_size=8, max_num_blocks=3),), 1)
    split = BlockTables.create((KVGroupSpec(block_size=8, max_num_blocks=3, kernel_block_size=4),), 1)
    logical = logical.append_block_ids(0, [[5, 2, 9]], overwrite=True)
    split = split.append_block_ids(0, [[5, 2, 9]], overwrite=True)
    pos = jnp.arange(20, dtype=jnp.int32)
    args = (jnp.array([0]), jnp.array([0, 20]), pos, 24)
    np.testing.assert_array_equal(logical.slot_mappings(*args), split.slot_mappings(*args))


MAX_REQS, WIDTH, R_PAD, T_PAD = 5, 5, 5, 24  # fixed shapes: one compile for every example


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_slot_mapping_matches_numpy(data):
    bs = data.draw(st.sampled_from([1, 2, 4, 16]))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    table = rng.integers(1, 1000, size=(MAX_REQS, WIDTH)).astype(np.int32)
    idx = np.array([data.draw(st.integers(-1, MAX_REQS - 1)) for _ in range(R_PAD)], np.int32)
    qlens = [data.draw(st.integers(0, 4)) for _ in range(R_PAD)]
    qsl = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
    pos = rng.integers(0, WIDTH * bs, size=T_PAD).astype(np.int32)
    got = compute_slot_mapping(table, idx, qsl, pos, block_size=bs, num_tokens_padded=T_PAD)
    want = numpy_slot_mapping(table, idx, qsl, pos, bs, T_PAD)
    np.testing.assert_array_equal(np.asarray(got), want)


def test_slot_mapping_rejects_position_past_table_and_unallocated_block():
    table = np.array([[4, 0]], np.int32)
    with pytest.raises(ValueError, match=r"positions\[0\]=9 .* outside the block table: it holds positions \[0, 8\)"):
        compute_slot_mapping(table, np.array([0]), np.array([0, 1]), np.array([9]), block_size=4, num_tokens_padded=2)
    with pytest.raises(ValueError, match=r"positions\[1\]=5 .* NULL_BLOCK_ID"):
        compute_slot_mapping(table, np.array([0]), np.array([0, 2]), np.array([3, 5]), block_size=4, num_tokens_padded=2)
    with pytest.raises(ValueError, match=r"query_start_loc must be non-decreasing"):
        compute_slot_mapping(table, np.array([0, 0]), np.array([0, 2, 1]), np.array([1, 2]), block_size=4, num_tokens_padded=2)
    with pytest.raises(ValueError, match=r"num_tokens_padded=1, got 2"):
        compute_slot_mapping(table, np.array([0]), np.array([0, 2]), np.array([1, 2]), block_size=4, num_tokens_padded=1)
    with pytest.raises(ValueError, match=r"query_start_loc must have shape \[2\], got \[3\]"):
        compute_slot_mapping(table, np.array([0]), np.array([0, 1, 1]), np.array([1]), block_size=4, num_tokens_padded=1)
    with pytest.raises(ValueError, match=r"idx_mapping must have values in \[0, 1\) \(or -1\); got 3"):
        compute_slot_mapping(table, np.array([3]), np.array([0, 1]), np.array([1]), block_size=4, num_tokens_padded=1)


def test_slot_mapping_under_jit_never_writes_null_block_and_checkify_reports():
    table = jnp.array([[4, 0]], jnp.int32)
    args = (table, jnp.array([0]), jnp.array([0, 2]), jnp.array([3, 5]))
    f = jax.jit(lambda *a: compute_slot_mapping(*a, block_size=4, num_tokens_padded=4))
    np.testing.assert_array_equal(f(*args), [19, PAD_SLOT_ID, PAD_SLOT_ID, PAD_SLOT_ID])

    def checked(*a):
        kvjax.checkify_slot_mapping_inputs(*a, block_size=4, num_tokens_padded=4)
        return compute_slot_mapping(*a, block_size=4, num_tokens_padded=4)

    err, _ = jax.jit(checkify.checkify(checked))(*args)
    with pytest.raises(checkify.JaxRuntimeError, match="maps outside the block table or to NULL_BLOCK_ID"):
        err.throw()
    ok_args = (table, jnp.array([0]), jnp.array([0, 2]), jnp.array([2, 3]))
    err, out = jax.jit(checkify.checkify(checked))(*ok_args)
    err.throw()  # no error
    np.testing.assert_array_equal(out, [18, 19, -1, -1])


def test_multi_group_and_dummy():
    specs = (KVGroupSpec(block_size=2, max_num_blocks=2), KVGroupSpec(block_size=4, max_num_blocks=1, kernel_block_size=2))
    bt = BlockTables.create(specs, 2).append_block_ids(0, [[3, 4], [5]], overwrite=True)
    sm = bt.slot_mappings(jnp.array([0]), jnp.array([0, 3]), jnp.array([0, 1, 2, 0]), 5)
    assert sm.shape == (2, 5)
    np.testing.assert_array_equal(sm, [[6, 7, 8, -1, -1], [20, 21, 22, -1, -1]])
    np.testing.assert_array_equal(kvjax.dummy_slot_mappings(2, 3), np.full((2, 3), PAD_SLOT_ID))
    for t, s in zip(kvjax.dummy_block_tables(specs, 2), specs):
        np.testing.assert_array_equal(t, np.full((2, s.table_width), NULL_BLOCK_ID))


def test_spec_validation():
    with pytest.raises(ValueError, match="kernel_block_size=3 must divide block_size=8"):
        KVGroupSpec(block_size=8, max_num_blocks=2, kernel_block_size=3)
    with pytest.raises(ValueError, match="max_num_blocks must be a positive int, got 0"):
        KVGroupSpec(block_size=8, max_num_blocks=0)
    s = KVGroupSpec.for_model_len(16, 100, kernel_block_size=8)
    assert (s.max_num_blocks, s.blocks_per_kv_block, s.table_width) == (7, 2, 14)
