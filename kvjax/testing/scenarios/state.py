"""Scenarios of the runner-state functions: ``compute_slot_mapping``, the block tables'
write + gather, and ``RequestState.add_requests`` + ``post_update``."""

from __future__ import annotations

import numpy as np

from kvjax.testing.scenarios.common import BITWISE, EXACT, NULL, PAD, op_scenarios

SLOTMAP = dict(MR=6, KBS=4, NCB=12, MAXB=4, R=4, T=32)  # NCB logical cache blocks


def _slotmap_case(reqs=None, *, r=1, gap_positions=True, last_block=False):
    """reqs: (row, num_computed, qlen) per batch row; row -1: a padded row (with tokens if
    qlen > 0); None entries and rows past the list: padded, no tokens. reqs=None: random."""
    MR, KBS, NCB, MAXB, R, T = (SLOTMAP[k] for k in ("MR", "KBS", "NCB", "MAXB", "R", "T"))
    W = MAXB * r

    def make(seed):
        rng = np.random.default_rng(seed)
        nkb = NCB * r
        table = np.full((MR, W), NULL, np.int32)
        live = rng.integers(1, MAXB + 1, size=MR)  # logical blocks of each row
        for row, nc, qlen in [q for q in (reqs or []) if q is not None and q[0] >= 0]:
            live[row] = max(live[row], -(-(nc + qlen) // (r * KBS)))  # room for the tokens
        for row in range(MR):
            logical = rng.choice(np.arange(1, NCB), size=live[row], replace=False)
            kern = (logical[:, None] * r + np.arange(r)).reshape(-1)
            table[row, :len(kern)] = kern
        if last_block:
            live[MR - 1] = MAXB
            table[MR - 1, -1] = nkb - 1
        batch = reqs
        if batch is None:
            rows = rng.permutation(MR)
            batch = []
            for b in range(int(rng.integers(0, R + 1))):
                cap = int(live[rows[b]]) * r * KBS
                nc = int(rng.integers(0, cap))
                batch.append((int(rows[b]), nc, int(rng.integers(1, min(cap - nc, 6) + 1))))
        idx = np.full((R,), -1, np.int32)
        qsl = np.zeros((R + 1,), np.int32)
        positions = np.zeros((T,), np.int32)
        for b in range(R):
            qsl[b + 1] = qsl[b]
            if b >= len(batch) or batch[b] is None:
                continue
            row, nc, qlen = batch[b]
            idx[b] = row
            positions[qsl[b]: qsl[b] + qlen] = nc + np.arange(qlen) if row >= 0 else 0
            qsl[b + 1] += qlen
        if gap_positions:  # stale positions of an earlier chunk after the real tokens (PR 36580)
            positions[qsl[-1]:] = rng.integers(0, KBS * W, size=T - int(qsl[-1]))
        return dict(block_table=table, idx_mapping=idx, query_start_loc=qsl, positions=positions,
                    block_size=KBS, num_tokens_padded=T)
    return make


def slotmap_scenarios(cases):
    """Scenarios of ``compute_slot_mapping``: ``cases`` random, then the adversarial ones."""
    KBS, MAXB = SLOTMAP["KBS"], SLOTMAP["MAXB"]
    cmp = {"*": EXACT}
    random_case = (_slotmap_case(),
                   "random rows, progress and query lengths; stale positions after the real tokens")
    fixed = [
        ("all-pad-dummy-step", _slotmap_case([]), "no real token: every slot PAD"),
        ("pad-inside-and-tail", _slotmap_case([(2, 0, 3), (-1, 0, 2), (4, 1, 2)]),
         "a padded batch row (with 2 tokens) between real rows, padded rows after them"),
        ("chunked-prefill-gap", _slotmap_case([(1, 0, 5), (3, 2, 4)]),
         "9 real tokens of 32; stale positions of an earlier chunk in [9, 32) -> PAD"),
        ("last-block", _slotmap_case([(5, MAXB * KBS - 2, 2), (0, 0, 1)], last_block=True),
         "the last kernel block id in the last table column, the last slot of the cache"),
        ("kernel-blocks-per-block-2", _slotmap_case([(1, 0, 7), (2, 3, 6)], r=2),
         "logical blocks of 8 tokens split into kernel blocks of 4 (ids b*2, b*2+1)"),
    ]
    return op_scenarios("compute_slot_mapping", cases, cmp, random_case, fixed)


GATHER = dict(MR=6, KBS=4, MAXB=5, NCB=20, U=3, R=4, M=3)


def _gather_case(writes=None, batch=None, *, r=1, sliding_window=None, stale_tail=True,
                 live=None):
    """writes: (row, [logical ids], overwrite) per entry; batch: request rows (-1 padded);
    live: {row: live logical blocks} (others random)."""
    MR, KBS, MAXB, NCB, U, R, M = (GATHER[k] for k in ("MR", "KBS", "MAXB", "NCB", "U", "R", "M"))
    W = MAXB * r

    def make(seed):
        rng = np.random.default_rng(seed)
        tables = np.full((MR, W), NULL, np.int32)
        counts = np.zeros((MR,), np.int32)
        for row in range(MR):
            n = int(rng.integers(0, MAXB + 1)) * r
            if live is not None and row in live:
                n = live[row] * r
            if stale_tail:  # a previous tenant's ids everywhere, live prefix or not (vLLM leaves them)
                tables[row] = rng.integers(1, NCB * r, size=W)
            else:
                tables[row, :n] = rng.integers(1, NCB * r, size=n)
            counts[row] = n
        w = writes
        if w is None:
            rows = rng.permutation(MR)[:int(rng.integers(0, U + 1))]
            w = []
            for row in rows:
                over = bool(rng.integers(2))
                room = MAXB - (0 if over else counts[row] // r)
                w.append((int(row), rng.integers(1, NCB, size=int(rng.integers(0, min(room, M) + 1))).tolist(), over))
        w_rows = np.full((U,), -1, np.int32)
        w_ids = np.zeros((U, M), np.int32)
        w_num = np.zeros((U,), np.int32)
        w_over = np.zeros((U,), bool)
        for u, (row, ids, over) in enumerate(w):
            w_rows[u], w_num[u], w_over[u] = row, len(ids), over
            w_ids[u, :len(ids)] = ids
        b = batch
        if b is None:
            b = [int(v) for v in rng.permutation(MR)[:R]]
            for i in range(R):
                if rng.random() < 0.25:
                    b[i] = -1
        idx = np.asarray(list(b) + [-1] * (R - len(b)), np.int32)
        first = rng.integers(0, MAXB * r * KBS, size=R).astype(np.int32)
        return dict(tables=tables, num_blocks=counts, block_size=KBS * r, kernel_block_size=KBS,
                    max_num_blocks=MAXB, sliding_window=sliding_window, num_cache_blocks=NCB,
                    write_rows=w_rows, write_block_ids=w_ids, write_num_new=w_num,
                    write_overwrite=w_over, idx_mapping=idx,
                    first_positions=first if sliding_window else None)
    return make


def gather_scenarios(cases):
    """Scenarios of ``BlockTables.write_rows`` + ``gather``: ``cases`` random, then the adversarial ones."""
    NCB = GATHER["NCB"]
    cmp = {"*": EXACT}
    random_case = (_gather_case(),
                   "random appends / overwrites on rows with stale tails, random padded batch rows")
    fixed = [
        ("reused-row-overwrite", _gather_case([(2, [7, 3], True)], [2, 0, 4, -1]),
         "a new tenant in row 2 (previous tenant's ids everywhere): the row is NULL past 2 ids"),
        ("append-to-live-row", _gather_case([(1, [9], False), (3, [4, 5], False)], [3, 1, -1, -1],
                                            stale_tail=False, live={1: 2, 3: 1}),
         "appends after the live length"),
        ("all-pad-dummy-step", _gather_case([], [-1, -1, -1, -1]),
         "no write, every batch row padded: gathered tables all NULL"),
        ("pad-inside-and-tail", _gather_case([(4, [1], True)], [4, -1, 5, -1]),
         "padded batch rows between and after real ones are all NULL"),
        ("kernel-blocks-per-block-2", _gather_case([(0, [3, 8, 2], True), (5, [6], False)],
                                                   [5, 0, 1, -1], r=2, live={5: 2}),
         "r=2: logical ids b expand to kernel ids 2b, 2b+1"),
        ("last-block", _gather_case([(1, [NCB - 1, NCB - 2], True)], [1, 2, 3, 4]),
         "the last cache block id written and gathered"),
        ("sliding-window", _gather_case([(2, [5, 6, 7], True)], [2, 1, 0, 3], sliding_window=6,
                                        stale_tail=False),
         "sliding window 6: blocks no query of the step can see are NULL in the gathered table"),
    ]
    return op_scenarios("gather_block_tables", cases, cmp, random_case, fixed)


REQSTATE = dict(MR=5, LEN=16, S=3, U=3, R=4)
REQSTATE_FIELDS = ("prompt_len", "prefill_len", "total_len", "num_computed_tokens",
                   "all_token_ids", "last_sampled_tokens", "draft_tokens", "num_accepted_tokens",
                   "temperature", "top_p", "top_k", "seed")


def _stale_state(rng):
    """Rows left by previous tenants: junk everywhere, loosely consistent counters."""
    MR, LEN, S = REQSTATE["MR"], REQSTATE["LEN"], REQSTATE["S"]
    prefill = rng.integers(1, 9, size=MR)
    total = prefill + rng.integers(0, 4, size=MR)
    return dict(
        prompt_len=np.maximum(prefill - rng.integers(0, 2, size=MR), 1).astype(np.int32),
        prefill_len=prefill.astype(np.int32), total_len=total.astype(np.int32),
        num_computed_tokens=np.minimum(total, prefill + rng.integers(0, 3, size=MR)).astype(np.int32),
        all_token_ids=rng.integers(1, 500, size=(MR, LEN)).astype(np.int32),
        last_sampled_tokens=rng.integers(1, 500, size=MR).astype(np.int32),
        draft_tokens=rng.integers(1, 500, size=(MR, S)).astype(np.int32),
        num_accepted_tokens=rng.integers(1, S + 2, size=MR).astype(np.int32),
        temperature=rng.random(MR).astype(np.float32), top_p=rng.random(MR).astype(np.float32),
        top_k=rng.integers(0, 50, size=MR).astype(np.int32), seed=rng.integers(0, 2**31, size=MR).astype(np.int32))


def _reqstate_case(adds=None, steps=None):
    """adds: (row, num_tokens, prompt_len, num_computed); steps: (row | -1, qlen, num_sampled)."""
    MR, LEN, S, U, R = (REQSTATE[k] for k in ("MR", "LEN", "S", "U", "R"))

    def make(seed):
        rng = np.random.default_rng(seed)
        state = _stale_state(rng)
        a = adds
        if a is None:
            rows = rng.permutation(MR)[:int(rng.integers(0, U + 1))]
            a = []
            for row in rows:
                n = int(rng.integers(1, 11))
                a.append((int(row), n, int(rng.integers(1, n + 1)), int(rng.integers(0, n + 1))))
        new = dict(rows=np.full((U,), -1, np.int32), token_ids=np.zeros((U, LEN), np.int32),
                   num_tokens=np.zeros((U,), np.int32), prompt_len=np.zeros((U,), np.int32),
                   num_computed_tokens=np.zeros((U,), np.int32),
                   temperature=np.zeros((U,), np.float32), top_p=np.ones((U,), np.float32),
                   top_k=np.zeros((U,), np.int32), seed=np.zeros((U,), np.int32))
        for u, (row, n, p, nc) in enumerate(a):
            new["rows"][u], new["num_tokens"][u], new["prompt_len"][u] = row, n, p
            new["num_computed_tokens"][u] = nc
            new["token_ids"][u, :n] = rng.integers(1, 500, size=n)
            new["temperature"][u], new["top_p"][u] = rng.random(), rng.random()
            new["top_k"][u] = rng.integers(0, 50)
            new["seed"][u] = rng.integers(0, 2**31)
        # The state after the adds, to make the step consistent with it.
        after = {k: v.copy() for k, v in state.items()}
        for row, n, p, nc in a:
            after["prefill_len"][row], after["num_computed_tokens"][row] = n, nc
        st = steps
        if st is None:
            rows = [int(v) for v in rng.permutation(MR)[:R]]
            st = []
            for row in rows:
                if rng.random() < 0.2:
                    st.append((-1, 0, 0))
                    continue
                nc, pre = int(after["num_computed_tokens"][row]), int(after["prefill_len"][row])
                if nc < pre:  # prefill chunk (maybe the last one)
                    qlen = int(rng.integers(1, pre - nc + 1))
                    st.append((row, qlen, int(nc + qlen >= pre)))
                else:  # decode with 0..S drafts
                    nd = int(rng.integers(0, S + 1))
                    st.append((row, nd + 1, int(rng.integers(1, nd + 2))))
        post = dict(idx_mapping=np.full((R,), -1, np.int32), query_lens=np.zeros((R,), np.int32),
                    sampled=rng.integers(500, 900, size=(R, S + 1)).astype(np.int32),
                    num_sampled=np.zeros((R,), np.int32))
        for b, (row, qlen, ns) in enumerate(st):
            post["idx_mapping"][b], post["query_lens"][b], post["num_sampled"][b] = row, qlen, ns
        return dict(state=state, new=new, post=post)
    return make


def reqstate_scenarios(cases):
    """Scenarios of ``RequestState.add_requests`` + ``post_update``: ``cases`` random, then the adversarial ones."""
    MR, LEN = REQSTATE["MR"], REQSTATE["LEN"]
    cmp = {"*": EXACT, "added.temperature": BITWISE, "added.top_p": BITWISE,
           "updated.temperature": BITWISE, "updated.top_p": BITWISE}
    random_case = (_reqstate_case(),
                   "random adds into stale rows, then a random step (prefill chunks, decode, pads)")
    fixed = [
        ("reused-row-pd-disagg", _reqstate_case([(2, 6, 6, 6)], [(2, 1, 1)]),
         "row 2 re-added with 6 computed tokens: last_sampled = token 5, drafts 0 (PR 39833)"),
        ("reused-row-fresh-prefill", _reqstate_case([(1, 9, 7, 0)], [(1, 4, 1)]),
         "row 1 re-added fresh: last_sampled 0, stale tail zeroed; a mid-prefill chunk samples nothing"),
        ("finishing-prefill-chunk", _reqstate_case([(0, 5, 5, 3)], [(0, 2, 1)]),
         "the chunk that ends prefill samples one token"),
        ("decode-0..k-drafts", _reqstate_case([(0, 4, 4, 4), (3, 3, 3, 3), (4, 5, 5, 5)],
                                              [(0, 1, 1), (3, 3, 2), (4, 4, 4), (1, 2, 1)]),
         "decode windows with 0, 2, 3, 1 drafts and partial acceptance"),
        ("pad-inside-and-tail", _reqstate_case([(2, 4, 4, 4)], [(2, 2, 2), (-1, 0, 0), (0, 1, 1)]),
         "padded batch rows between and after real ones touch nothing"),
        ("all-pad-dummy-step", _reqstate_case([], [(-1, 0, 0)] * 4),
         "no add, every batch row padded: nothing changes"),
        ("last-block", _reqstate_case([(MR - 1, LEN, LEN - 1, LEN - 2)], [(MR - 1, 2, 1)]),
         "the last row, the chunk that finishes a max_model_len-token prefill: its one sample, "
         "past max_model_len, is dropped"),
    ]
    return op_scenarios("request_state", cases, cmp, random_case, fixed)
