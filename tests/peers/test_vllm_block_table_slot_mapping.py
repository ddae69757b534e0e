"""vLLM's slot-mapping tests, ported onto kvjax's ``BlockTables`` and ``compute_slot_mapping``.

Source: vllm-project/vllm, ``tests/v1/worker/test_block_table_slot_mapping.py`` at commit
842652e18ad7305767a6b5dd03086d665319833e. The test logic is re-written here; no peer code
is copied.

Kept: the hand-computed cases (block boundaries, two request rows; hybrid 32-token KV
blocks over 16-token kernel blocks), the block-boundary / ragged / prefix-offset cases
checked against an independent reference that expands KV-manager block ids into kernel
block ids itself, the 1030-token case (vLLM's Triton tile is 1024 tokens; kvjax has no
tile, the case stays as a long one), the hybrid (32, 16) / (64, 16) cases, and every
assertion: real tokens equal the reference and every slot of the padded tail is
``PAD_SLOT_ID`` (vLLM's buffer of 2048 tokens is kvjax's ``num_tokens_padded``).

Dropped: decode-context-parallel cases (kvjax has no DCP) and ``SlotMappingMode.NONE``
(kvjax's Mamba state indices never go through the slot mapping). No block id of these
cases is 0, so kvjax's null block plays no part. Slot mapping is one jnp function with
no Pallas flavour: everything runs in CI.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvjax import BlockTables, KVGroupSpec
from kvjax.constants import PAD_SLOT_ID

MAX_NUM_REQS, MAX_BLOCKS, MAX_TOKENS = 8, 32, 2048


def compute(kv_ids, positions_per_req, *, kv_block=16, kernel_block=None, max_tokens=MAX_TOKENS,
            max_blocks=MAX_BLOCKS):
    """Fill rows 0.. with the KV-manager ids, map the step; returns (slots, real token count)."""
    spec = KVGroupSpec(block_size=kv_block, max_num_blocks=max_blocks,
                       kernel_block_size=kernel_block or kv_block)
    tables = BlockTables.create((spec,), MAX_NUM_REQS)
    for row, ids in enumerate(kv_ids):
        tables = tables.append_block_ids(row, [ids], overwrite=True)
    lens = [len(p) for p in positions_per_req]
    qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    positions = np.concatenate(positions_per_req).astype(np.int32)
    slots = tables.slot_mappings(np.arange(len(kv_ids), dtype=np.int32), qsl, positions, max_tokens)[0]
    return np.asarray(slots), int(qsl[-1])


def reference(kv_ids, positions_per_req, *, kv_block=16, kernel_block=None, max_tokens=MAX_TOKENS):
    """Expected slots from the inputs alone: KV block ``b`` covers kernel blocks ``b*r .. b*r+r-1``."""
    kernel_block = kernel_block or kv_block
    r = kv_block // kernel_block
    expected = np.full(max_tokens, PAD_SLOT_ID, np.int64)
    t = 0
    for ids, positions in zip(kv_ids, positions_per_req):
        kernel_ids = [b * r + k for b in ids for k in range(r)]
        for pos in positions:
            offset = pos % kv_block
            block = kernel_ids[(pos // kv_block) * r + offset // kernel_block]
            expected[t] = block * kernel_block + offset % kernel_block
            t += 1
    return expected


def check(kv_ids, positions_per_req, **kw):
    actual, n = compute(kv_ids, positions_per_req, **kw)
    expected = reference(kv_ids, positions_per_req, **{k: v for k, v in kw.items() if k != "max_blocks"})
    np.testing.assert_array_equal(actual[:n], expected[:n])
    assert (actual[n:] == PAD_SLOT_ID).all()
    return actual[:n]


@pytest.mark.parametrize(
    "kv_ids, positions, expected",
    [
        ([[5, 6, 7]], [[0, 15, 16, 47]], [80, 95, 96, 127]),
        ([[9, 2], [7, 4]], [[3], [20]], [147, 68]),
    ],
    ids=["single_request_block_boundaries", "multiple_request_rows"],
)
def test_slot_mapping_matches_hand_computed_slots(kv_ids, positions, expected):
    actual, n = compute(kv_ids, positions)
    np.testing.assert_array_equal(actual[:n], expected)
    np.testing.assert_array_equal(reference(kv_ids, positions)[:n], expected)
    assert (actual[n:] == PAD_SLOT_ID).all()


@pytest.mark.parametrize(
    "kv_ids, positions",
    [
        ([[9]], [[0]]),
        ([[8, 2, 5]], [[0, 15, 16, 31, 32]]),
        ([[3, 7, 1, 5]], [list(range(64))]),
        ([[100, 3, 57, 12, 88, 1]], [list(range(96))]),
        ([[1, 2, 3, 4], [10, 11], [20, 21, 22], [30], [40, 41]],
         [list(range(60)), list(range(20)), list(range(33)), [0], list(range(17))]),
        ([[5, 6, 7, 8, 9, 10]], [list(range(70, 90))]),
    ],
    ids=["single_token", "first_and_last_position_in_block", "spans_many_blocks",
         "non_contiguous_blocks", "ragged_multi_request", "prefix_offset"],
)
def test_slot_mapping_covers_block_boundaries_and_ragged_batches(kv_ids, positions):
    check(kv_ids, positions)


def test_slot_mapping_pads_beyond_a_long_step():
    num_tokens, block = 1030, 16
    num_blocks = -(-num_tokens // block)
    actual = check([list(range(1, num_blocks + 1))], [list(range(num_tokens))], kv_block=block,
                   max_tokens=2100, max_blocks=num_blocks)
    # ids start at 1: position 1023 is block 64 offset 15 (slot 1039), 1024 block 65 offset 0.
    np.testing.assert_array_equal(actual[1023:1030], np.arange(1039, 1046))


@pytest.mark.parametrize("kv_block, kernel_block", [(32, 16), (64, 16)])
def test_slot_mapping_with_hybrid_kernel_blocks(kv_block, kernel_block):
    check([[5, 9, 2]], [list(range(3 * kv_block))], kv_block=kv_block, kernel_block=kernel_block)


def test_slot_mapping_hybrid_matches_hand_computed_slots():
    """KV blocks [5, 9] of 32 tokens are kernel blocks [10, 11, 18, 19] of 16."""
    actual, n = compute([[5, 9]], [[0, 15, 16, 31, 32, 47, 48]], kv_block=32, kernel_block=16)
    np.testing.assert_array_equal(actual[:n], [160, 175, 176, 191, 288, 303, 304])
