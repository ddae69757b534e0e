"""``null_block_id=`` of the RPA interop: kvjax's null page 0, another reserved page, or none.

JAX's ragged-paged-attention tests and tpu-inference give page 0 to real sequences; with
``null_block_id=None`` kvjax's builders treat it as an ordinary page. kvjax's rule (page 0
reserved, never written) stays the default, and PAD tokens write nothing in every mode.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from kvjax.constants import NULL_BLOCK_ID, PAD_SLOT_ID
from kvjax.interop import RPAMetadata, rpa_metadata, rpa_slot_mapping

PS = 4

# seq 0: kv 6, q 3 -> positions 3, 4, 5 on pages 0 (offset 3) and 2 (offsets 0, 1);
# seq 1: kv 3, q 1 -> position 2 on page 5 (offset 2); row 2 padding; tokens 4, 5 padding.
META = RPAMetadata(
    kv_lens=np.asarray([6, 3, 0], np.int32),
    page_indices=np.asarray([[0, 2], [5, 0], [0, 0]], np.int32),
    cu_q_lens=np.asarray([0, 3, 4, 4], np.int32),
    num_seqs=np.asarray([2], np.int32),
)
WANT = [0 * PS + 3, 2 * PS + 0, 2 * PS + 1, 5 * PS + 2, PAD_SLOT_ID, PAD_SLOT_ID]


def slots(meta, **kw):
    return np.asarray(rpa_slot_mapping(meta, page_size=PS, num_tokens=6, **kw))


def jit_slots(meta, **kw):
    f = jax.jit(functools.partial(rpa_slot_mapping, page_size=PS, num_tokens=6, **kw))
    return np.asarray(f(meta))


def test_default_keeps_page_0_reserved():
    with pytest.raises(ValueError, match="NULL_BLOCK_ID"):
        slots(META)
    np.testing.assert_array_equal(jit_slots(META), [PAD_SLOT_ID] + WANT[1:])


@pytest.mark.parametrize("null_block_id", [None, 7, -1])
def test_page_0_is_ordinary_without_kvjax_null_page(null_block_id):
    np.testing.assert_array_equal(slots(META, null_block_id=null_block_id), WANT)
    np.testing.assert_array_equal(jit_slots(META, null_block_id=null_block_id), WANT)


def test_another_reserved_page_is_refused_and_masked():
    with pytest.raises(ValueError, match=r"null_block_id=5: the null page here is page 5"):
        slots(META, null_block_id=5)
    np.testing.assert_array_equal(jit_slots(META, null_block_id=5), WANT[:3] + [PAD_SLOT_ID] * 3)


def test_negative_page_ids_are_refused_without_a_null_page():
    bad = META.replace(page_indices=np.asarray([[0, -3], [5, 0], [0, 0]], np.int32))
    with pytest.raises(ValueError, match=r"page_indices must hold page ids >= 0 .*page_indices\[0, 1\]=-3"):
        slots(bad, null_block_id=None)
    np.testing.assert_array_equal(jit_slots(bad, null_block_id=None), WANT[:1] + [PAD_SLOT_ID] * 2 + WANT[3:])
    # -1 as the null page (vLLM's padding value) is allowed and masks its tokens.
    np.testing.assert_array_equal(
        jit_slots(META.replace(page_indices=np.asarray([[0, -1], [5, 0], [0, 0]], np.int32)),
                  null_block_id=-1),
        WANT[:1] + [PAD_SLOT_ID] * 2 + WANT[3:],
    )


@pytest.mark.parametrize("null_block_id", [None, 7])
def test_every_token_past_num_seqs_is_pad(null_block_id):
    """Stale cu_q_lens / kv_lens / pages past num_seqs (page 0 among them) map to nothing."""
    m = META.replace(num_seqs=np.asarray([1], np.int32), cu_q_lens=np.asarray([0, 3, 5, 6], np.int32))
    want = WANT[:3] + [PAD_SLOT_ID] * 3
    np.testing.assert_array_equal(slots(m, null_block_id=null_block_id), want)
    np.testing.assert_array_equal(jit_slots(m, null_block_id=null_block_id), want)


@pytest.mark.parametrize("null_block_id, fill", [(NULL_BLOCK_ID, 0), (None, 0), (7, 7)])
def test_metadata_fills_padding_with_the_null_page(null_block_id, fill):
    m = rpa_metadata(
        np.asarray([0, 0, 3, 4], np.int32),
        np.asarray([0, 6, 3], np.int32),
        np.asarray([[9, 9, 9], [0, 2, 9], [5, 9, 9]], np.int32),
        np.asarray([False, True, True]),
        page_size=PS,
        null_block_id=null_block_id,
    )
    np.testing.assert_array_equal(m.page_indices, [[0, 2, fill], [5, fill, fill], [fill] * 3])
    np.testing.assert_array_equal(m.kv_lens, [6, 3, 0])
    np.testing.assert_array_equal(m.cu_q_lens, [0, 3, 4, 4])
    np.testing.assert_array_equal(m.num_seqs, [2])


@pytest.mark.parametrize("bad", [True, 1.0, "0"])
def test_null_block_id_must_be_an_int_or_none(bad):
    with pytest.raises(ValueError, match=r"null_block_id must be an int page id or None .*got"):
        slots(META, null_block_id=bad)
    with pytest.raises(ValueError, match=r"null_block_id must be an int page id or None"):
        rpa_metadata(np.asarray([0, 1]), np.asarray([1]), np.asarray([[3]]), np.asarray([True]),
                     page_size=PS, null_block_id=bad)
