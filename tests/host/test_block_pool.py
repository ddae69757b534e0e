"""Host block pool."""

import pytest

from kvjax import BlockPool, OutOfBlocksError


def test_allocate_never_hands_out_block_zero_and_reports_fresh_ids_once():
    pool = BlockPool(5)
    ids = pool.allocate(4)
    assert sorted(ids) == [1, 2, 3, 4] and 0 not in ids
    assert pool.take_ids_to_zero() == ids
    assert pool.take_ids_to_zero() == []
    with pytest.raises(OutOfBlocksError, match="cannot allocate 1 KV blocks: only 0 of 4 are free"):
        pool.allocate(1)


def test_lifo_reuse_and_reused_ids_are_zeroed_again():
    pool = BlockPool(6)
    a = pool.allocate(2)
    pool.take_ids_to_zero()
    pool.free(a)
    b = pool.allocate(2)
    assert b == a[::-1]  # last freed, first reused
    assert pool.take_ids_to_zero() == b
    pool.check()


@pytest.mark.parametrize(
    "ids, match",
    [
        ([0], "cannot free KV block 0: it is the reserved null id"),
        ([7], r"cannot free unknown KV block 7: ids are 1..5"),
        ([-1], r"cannot free unknown KV block -1"),
        ([3], "double free of KV block 3"),
        ([1, 1], "double free of KV block 1"),
    ],
)
def test_free_errors(ids, match):
    pool = BlockPool(6)
    pool.allocate(2)  # 1, 2 used
    with pytest.raises(ValueError, match=match):
        pool.free(ids)
    assert pool.num_used == 2  # a rejected free changes nothing


def test_constructor_errors_and_kind_in_messages():
    with pytest.raises(ValueError, match="num_blocks must be an int >= 2"):
        BlockPool(1)
    slots = BlockPool(2, kind="recurrent slot")
    slots.allocate(1)
    with pytest.raises(OutOfBlocksError, match="recurrent slot"):
        slots.allocate(1)
