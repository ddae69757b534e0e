"""Scenarios of ``zero_blocks``."""

from __future__ import annotations

import numpy as np

from kvjax.testing.scenarios.common import BF16, BITWISE, F32, FP8, op_scenarios, pick, poisoned

ZERO_NKB = 8  # kernel blocks
_ZERO_ARRAYS = (((ZERO_NKB, 4, 2, 4), F32), ((ZERO_NKB, 4, 8), BF16), ((ZERO_NKB, 16), FP8),
                ((ZERO_NKB, 3), np.dtype(np.int32)))


def _zero_inputs(rng, ids, r):
    caches = []
    for shape, dtype in _ZERO_ARRAYS:
        if dtype == np.dtype(np.int32):
            a = rng.integers(1, 1000, size=shape).astype(np.int32)
            a[0] = -1
        else:  # never 0 outside the null block, so a zeroed element always shows
            a = poisoned(rng, shape, dtype, positive=True)
        caches.append(a)
    return dict(caches=caches, block_ids=np.asarray(ids, np.int32), kernel_blocks_per_block=r)


def _zero_random(seed):
    rng = np.random.default_rng(seed)
    r = pick(rng, (1, 2, 4))
    ids = rng.integers(-2, ZERO_NKB // r, size=5)
    return _zero_inputs(rng, np.where(ids == 0, -1, ids), r)  # block 0 is null: never zeroed


def _zero_fixed(ids, r):
    return lambda seed: _zero_inputs(np.random.default_rng(seed), ids, r)


def zero_scenarios(cases):
    """Scenarios of ``zero_blocks``: ``cases`` random, then the adversarial ones."""
    cmp = {"*": BITWISE}
    random_case = (_zero_random,
                   "random r in {1,2,4}, 5 ids in [-2, NKB/r) but not 0 (repeats allowed)")
    fixed = [
        ("all-pad-dummy-step", _zero_fixed([-1] * 5, 1), "every id negative: nothing zeroed"),
        ("pad-inside-and-tail", _zero_fixed([3, -1, 1, -1, -1], 1), "padding between and after ids"),
        ("null-block-nan", _zero_fixed([1, 2, -1, -1, -1], 1),
         "ids next to the NaN null block: block 0 keeps its NaN"),
        ("last-block", _zero_fixed([ZERO_NKB // 2 - 1, -1, -1, -1, -1], 2),
         "the last logical block (r=2): the last two kernel blocks"),
        ("kernel-blocks-per-block-2", _zero_fixed([2, 1, -1, 2, -1], 2),
         "r=2: both kernel sub-blocks of each id, a repeated id"),
        ("kernel-blocks-per-block-4", _zero_fixed([1, -1, -1, -1, -1], 4),
         "r=4: all four kernel sub-blocks of block 1"),
    ]
    return op_scenarios("zero_blocks", cases, cmp, random_case, fixed)
