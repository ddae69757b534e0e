"""rpa_metadata and its inverse: kvjax's step batch <-> ragged-paged-attention metadata."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from kvjax import BlockTables, KVGroupSpec, RequestState, ScheduledBatch, build_step_batch
from kvjax.constants import NULL_BLOCK_ID, PAD_SLOT_ID
from kvjax.interop import (
    RPAMetadata,
    rpa_metadata,
    rpa_metadata_from_batch,
    rpa_positions,
    rpa_slot_mapping,
)

SPECS = (
    KVGroupSpec(block_size=4, max_num_blocks=4),
    KVGroupSpec(block_size=8, max_num_blocks=2, kernel_block_size=4),
)


def step_batch():
    """Row 2: a prefill chunk (4 of 6 prompt tokens cached); row 0: a decode with 2 drafts."""
    s = RequestState.create(4, 16, num_speculative_tokens=2)
    s = s.add_request(2, [11, 12, 13, 14, 15, 16], num_computed_tokens=4)
    s = s.add_request(0, [21, 22, 23])
    s = s.post_update(np.array([0]), np.array([3]), np.array([[24, 0, 0]]), np.array([1]))
    s = s.set_draft_tokens(np.array([0]), np.array([[31, 32]]))
    t = BlockTables.create(SPECS, 4, num_cache_blocks=32)
    t = t.append_block_ids(2, [[5, 6], [7]], overwrite=True)
    t = t.append_block_ids(0, [[9, 10], [11]], overwrite=True)
    sched = ScheduledBatch.from_lists([0, 2], [3, 2], [2, 0], pad_to=4)
    return build_step_batch(s, t, sched, num_tokens_padded=8, num_logits_padded=6)


# A batch with padded rows between real ones (kvjax's builder never makes one,
# other callers may): rows 1 and 3 are padding with stale table rows.
HOLES = dict(
    query_start_loc=np.asarray([0, 3, 3, 4, 4, 6], np.int32),
    seq_lens=np.asarray([3, 9, 10, 4, 7], np.int32),
    block_table=np.asarray(
        [[4, 0, 0], [8, 8, 8], [5, 6, 7], [9, 9, 9], [2, 3, 0]], np.int32
    ),
    row_valid=np.asarray([True, False, True, False, True]),
)


def test_real_rows_first_padding_nulled():
    m = rpa_metadata(**HOLES, page_size=4)
    np.testing.assert_array_equal(m.kv_lens, [3, 10, 7, 0, 0])
    np.testing.assert_array_equal(
        m.page_indices, [[4, 0, 0], [5, 6, 7], [2, 3, 0], [0, 0, 0], [0, 0, 0]]
    )
    np.testing.assert_array_equal(m.cu_q_lens, [0, 3, 4, 6, 6, 6])
    np.testing.assert_array_equal(m.num_seqs, [3])
    for leaf in jax.tree.leaves(m):
        assert leaf.dtype == np.int32


def test_pages_past_kv_len_are_null():
    """A table row longer than the sequence (stale ids) keeps only cdiv(kv_len, page_size) pages."""
    m = rpa_metadata(
        np.asarray([0, 1], np.int32), np.asarray([5], np.int32),
        np.asarray([[3, 4, 7, 9]], np.int32), np.asarray([True]), page_size=4,
    )
    np.testing.assert_array_equal(m.page_indices, [[3, 4, NULL_BLOCK_ID, NULL_BLOCK_ID]])


def test_jit_matches_eager():
    eager = rpa_metadata(**HOLES, page_size=4)
    jitted = jax.jit(functools.partial(rpa_metadata, page_size=4))(**HOLES)
    assert isinstance(jitted, RPAMetadata)
    for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("group", [0, 1])
def test_inverse_reproduces_kvjax_slot_mapping_and_positions(group):
    """Differential: kvjax's own slot mapping == rpa_slot_mapping(rpa_metadata(batch))."""
    b = step_batch()
    page_size = SPECS[group].kernel_block_size
    m = rpa_metadata_from_batch(b, group=group, page_size=page_size)
    T = b.num_tokens_padded
    np.testing.assert_array_equal(
        rpa_slot_mapping(m, page_size=page_size, num_tokens=T), b.slot_mappings[group]
    )
    real = np.asarray(b.token_valid)
    pos = np.asarray(rpa_positions(m, num_tokens=T))
    np.testing.assert_array_equal(pos[real], np.asarray(b.positions)[real])
    assert not pos[~real].any()


def test_inverse_with_holes_under_jit():
    m = rpa_metadata(**HOLES, page_size=4)
    f = jax.jit(functools.partial(rpa_slot_mapping, page_size=4, num_tokens=8))
    # seq 0: kv 3, q 3 -> positions 0..2 on page 4; seq 1: kv 10, q 1 -> position 9,
    # page 7 offset 1; seq 2: kv 7, q 2 -> positions 5, 6 on page 3.
    want = [16, 17, 18, 29, 13, 14, PAD_SLOT_ID, PAD_SLOT_ID]
    np.testing.assert_array_equal(f(m), want)
    np.testing.assert_array_equal(rpa_slot_mapping(m, page_size=4, num_tokens=8), want)


def test_inverse_null_page_for_a_real_token():
    """A query whose page is NULL_BLOCK_ID: ValueError when concrete, PAD under jit."""
    m = RPAMetadata(
        kv_lens=np.asarray([6, 0], np.int32),
        page_indices=np.asarray([[3, NULL_BLOCK_ID], [0, 0]], np.int32),
        cu_q_lens=np.asarray([0, 2, 2], np.int32),
        num_seqs=np.asarray([1], np.int32),
    )
    with pytest.raises(ValueError, match="NULL_BLOCK_ID"):
        rpa_slot_mapping(m, page_size=4, num_tokens=4)
    f = jax.jit(functools.partial(rpa_slot_mapping, page_size=4, num_tokens=4))
    np.testing.assert_array_equal(f(m), [PAD_SLOT_ID] * 4)


def test_rows_past_num_seqs_are_ignored_by_the_inverse():
    """RPA reads only num_seqs rows; stale cu_q_lens / kv_lens beyond them map nothing."""
    m = RPAMetadata(
        kv_lens=np.asarray([2, 9], np.int32),
        page_indices=np.asarray([[3, 0], [5, 6]], np.int32),
        cu_q_lens=np.asarray([0, 2, 5], np.int32),
        num_seqs=np.asarray([1], np.int32),
    )
    np.testing.assert_array_equal(rpa_slot_mapping(m, page_size=4, num_tokens=6), [12, 13] + [-1] * 4)


@pytest.mark.parametrize(
    "override, match",
    [
        (dict(query_start_loc=np.asarray([1, 3, 3, 4, 4, 6], np.int32)), r"query_start_loc\[0\] must be 0"),
        (dict(query_start_loc=np.asarray([0, 3, 2, 4, 4, 6], np.int32)), "query_start_loc must be non-decreasing"),
        (dict(query_start_loc=np.asarray([0, 3, 4, 5, 5, 7], np.int32)), r"padded rows \(row_valid False\) no tokens; row 1 has 1"),
        (dict(seq_lens=np.asarray([2, 9, 10, 4, 7], np.int32)), r"seq_lens\[0\] must be in \[query length 3, 12\]"),
        (dict(seq_lens=np.asarray([3, 9, 13, 4, 7], np.int32)), r"seq_lens\[2\] must be in"),
        (dict(seq_lens=np.asarray([3, 9, 10, 4], np.int32)), r"seq_lens must have shape \[5\]"),
        (dict(block_table=np.zeros((5, 3), np.float32)), "block_table must have dtype an integer dtype"),
    ],
)
def test_malformed_batches_are_rejected(override, match):
    with pytest.raises(ValueError, match=match):
        rpa_metadata(**{**HOLES, **override}, page_size=4)


def test_page_size_must_be_a_positive_int():
    with pytest.raises(ValueError, match="page_size must be a positive int, got 0"):
        rpa_metadata(**HOLES, page_size=0)
