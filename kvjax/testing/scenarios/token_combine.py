"""Scenarios of ``combine_sampled_and_draft_tokens``."""

from __future__ import annotations

import numpy as np

from kvjax.testing.scenarios.common import EXACT, op_scenarios, pick

COMBINE = dict(T=24, R=6, MR=8, S=3, L=16)
_SENTINEL = 9000


def _combine_inputs(reqs, *, num_new=1):
    """Arguments for ``reqs``: tuples (row, num_computed, qlen, prefill_len, drafts) or None (padded)."""
    T, R, MR, S, L = (COMBINE[k] for k in ("T", "R", "MR", "S", "L"))
    idx = np.full((R,), -1, np.int32)
    qsl = np.zeros((R + 1,), np.int32)
    seq = np.zeros((R,), np.int32)
    cu = np.zeros((R + 1,), np.int32)
    prefill = np.full((MR,), 10_000, np.int32)  # unused rows: a read by mistake shows
    for b in range(R):
        r = reqs[b] if b < len(reqs) else None
        qsl[b + 1], cu[b + 1] = qsl[b], cu[b]
        if r is None:
            continue
        row, nc, qlen, pre, nd = r
        idx[b] = row
        qsl[b + 1] += qlen
        seq[b] = nc + qlen
        prefill[row] = pre
        cu[b + 1] += nd + num_new
    return dict(
        input_ids=_SENTINEL + np.arange(T, dtype=np.int32), idx_mapping=idx,
        last_sampled_tokens=(100 + np.arange(MR, dtype=np.int32))[:, None], query_start_loc=qsl,
        seq_lens=seq, prefill_len=prefill,
        draft_tokens=1000 + 10 * np.arange(MR, dtype=np.int32)[:, None] + np.arange(S, dtype=np.int32),
        cu_num_logits=cu, num_logits=L, num_new_sampled_tokens=num_new)


def _combine_random(seed):
    rng = np.random.default_rng(seed)
    T, R, MR, S, L = (COMBINE[k] for k in ("T", "R", "MR", "S", "L"))
    num_new = int(rng.random() < 0.8)
    rows = rng.permutation(MR)
    reqs, tokens, logits = [], 0, 0
    for b in range(int(rng.integers(0, R + 1))):
        kind = pick(rng, ("decode", "prefill", "straddle"))
        pre = int(rng.integers(2, 20))
        if kind == "decode":
            nd = int(rng.integers(0, S + 1))
            nc, qlen = pre + int(rng.integers(0, 5)), nd + 1
        elif kind == "prefill":
            nd, qlen = 0, int(rng.integers(1, 6))
            nc = int(rng.integers(0, pre))
            qlen = max(qlen, num_new)
        else:
            nd = int(rng.integers(1, S + 1))
            qlen = nd + 1
            nc = pre - int(rng.integers(0, qlen))
        nl = nd + num_new
        if qlen < nl or qlen == 0 or tokens + qlen > T or logits + nl > L:
            break
        tokens, logits = tokens + qlen, logits + nl
        reqs.append((int(rows[b]), nc, qlen, pre, nd))
    return _combine_inputs(reqs, num_new=num_new)


def _combine_fixed(reqs, num_new):
    return lambda seed: _combine_inputs(reqs, num_new=num_new)


def combine_scenarios(cases):
    """Scenarios of ``combine_sampled_and_draft_tokens``: ``cases`` random, then the adversarial ones."""
    cmp = {"*": EXACT}
    random_case = (_combine_random, "random decode / prefill / straddling rows, padding after them")
    fixed = [
        ("decode-0..k-drafts",
         [(5, 20, 1, 12, 0), (2, 20, 2, 12, 1), (7, 20, 3, 12, 2), (0, 20, 4, 12, 3)], 1,
         "four decode rows with 0..3 drafts, rows shuffled"),
        ("prompt-tail-straddling", [(1, 8, 4, 10, 2), (3, 6, 4, 10, 0), (4, 10, 3, 10, 2)], 1,
         "a window starting inside the prompt keeps its prompt id; seq == prefill_len"),
        ("mid-prefill-chunks", [(6, 0, 8, 30, 0), (2, 8, 8, 30, 0)], 1,
         "prefill chunks write no ids, only logits rows"),
        ("no-new-sampled-token", [(2, 20, 2, 3, 2), (5, 20, 1, 3, 1), (1, 3, 3, 5, 1)], 0,
         "num_new_sampled_tokens=0: every logits row is a draft"),
        ("all-pad-dummy-step", [], 1, "every batch row padded: nothing written, logits rows 0"),
        ("pad-inside-and-tail", [(3, 9, 2, 5, 1), None, (0, 4, 1, 4, 0)], 1,
         "a padded (-1) row between real rows and after them writes nothing"),
        ("last-block", [(7, 30, 4, 12, 3), (0, 12, 1, 12, 0)], 1,
         "the last request row (MR-1) with the most drafts"),
    ]
    fixed = [(n, _combine_fixed(reqs, k), d) for n, reqs, k, d in fixed]
    return op_scenarios("combine_sampled_and_draft_tokens", cases, cmp, random_case, fixed)
