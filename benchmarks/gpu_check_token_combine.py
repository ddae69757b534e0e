"""GPU check of ``combine_sampled_and_draft_tokens`` (compiled, not interpreted).

Run on a machine with an NVIDIA GPU, from the repository root:

    PYTHONPATH=. python benchmarks/gpu_check_token_combine.py

For every case it runs the GPU flavour (``backend="pallas_gpu"``, compiled
through the Pallas GPU lowering) and the jnp reference on the GPU, and compares
the whole ``input_ids`` and ``logits_indices`` bit for bit with an independent
numpy loop over the batch rows written from vLLM 0.33.0's rule (plus kvjax's
rules for padded and malformed rows: they write nothing). ``input_ids`` starts
as distinct sentinel values, so a write to a wrong position shows. One
PASS/FAIL line per case; exit status 1 if any case fails.

Cases: seeded random batches (prefill, decode, prompt-straddling and padded
rows, 0..S drafts, num_new_sampled_tokens 1 and 0, small and 256-request
batches); adversarial ones: an all-padding dummy step, padded rows first /
between / last, windows ending at the last token, seq_len == prefill_len and
seq_len - nl == prefill_len exactly, no speculative steps, a logits bucket
larger than needed, ``last_sampled_tokens`` as ``[MR]`` and ``[MR, 1]``, int64
index arrays (x64); and, under ``jit`` where values are not checked,
out-of-range and negative request rows and every kind of malformed row
(too many / too few logits rows, logits past ``num_logits``, a query past
``input_ids``, logits rows before the query start, a decreasing
``cu_num_logits`` whose padded rows' ranges cover a live row's: the kernel
writes every ``logits_indices`` entry itself, zeros included). Then: a donated
``input_ids`` is updated in place (same buffer, aliased in the compiled
module, small temporary memory), and repeated calls give identical results.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.token_combine import combine_sampled_and_draft_tokens
from _gpu_check import case, on_gpu_or_allowed, run_cases, summary  # noqa: E402

GPU = "pallas_gpu"
SENTINEL = 900_000
KEYS = ("input_ids", "idx_mapping", "last_sampled_tokens", "query_start_loc", "seq_lens",
        "prefill_len", "draft_tokens", "cu_num_logits")


# --------------------------------------------------------------------------
# the oracle: one batch row at a time, vLLM 0.33.0's rule + kvjax's masking
# --------------------------------------------------------------------------


def oracle(a):
    ids = np.asarray(a["input_ids"]).astype(np.int64).copy()
    num_logits, num_new = a["num_logits"], a["num_new_sampled_tokens"]
    li = np.zeros((num_logits,), np.int64)
    idx = np.asarray(a["idx_mapping"]).astype(np.int64)
    last = np.asarray(a["last_sampled_tokens"]).astype(np.int64).reshape(-1)
    qsl = np.asarray(a["query_start_loc"]).astype(np.int64)
    seq = np.asarray(a["seq_lens"]).astype(np.int64)
    pre = np.asarray(a["prefill_len"]).astype(np.int64)
    drafts = np.asarray(a["draft_tokens"]).astype(np.int64)
    cu = np.asarray(a["cu_num_logits"]).astype(np.int64)
    max_num_reqs, S = drafts.shape
    T = ids.shape[0]
    for b, s in enumerate(idx.tolist()):
        if not 0 <= s < max_num_reqs:
            continue  # padded (-1) or out of range: writes nothing
        cs, ce, qs, qe = cu[b], cu[b + 1], qsl[b], qsl[b + 1]
        nl = ce - cs
        start = qe - nl
        if not (num_new <= nl <= S + num_new and cs >= 0 and ce <= num_logits and qs >= 0
                and start >= qs and qe <= T):
            continue  # malformed: writes nothing
        for i in range(nl):
            li[cs + i] = start + i
        if seq[b] <= pre[s]:
            continue  # still prefilling
        if num_new == 1 and seq[b] - nl >= pre[s]:
            ids[start] = last[s]
        nd = nl - num_new
        for i in range(nd):
            ids[qe - nd + i] = drafts[s, i]
    return ids.astype(np.int32), li.astype(np.int32)


# --------------------------------------------------------------------------
# batches
# --------------------------------------------------------------------------


def build(rows, *, R, MR, S, T, L, num_new=1, rng=None, last_2d=True):
    """Arguments for ``rows``: a list of None (padded) or dicts (row, nc, qlen, pre, drafts).

    Unused request rows get a huge prefill_len, random last tokens and drafts,
    so that reading one by mistake changes the result.
    """
    rng = rng or np.random.default_rng(0)
    idx = np.full((R,), -1, np.int32)
    qsl = np.zeros((R + 1,), np.int32)
    seq = np.zeros((R,), np.int32)
    cu = np.zeros((R + 1,), np.int32)
    prefill = np.full((MR,), 10**6, np.int32)
    for b in range(R):
        r = rows[b] if b < len(rows) else None
        qsl[b + 1], cu[b + 1] = qsl[b], cu[b]
        if r is None:
            continue
        idx[b] = r["row"]
        qsl[b + 1] += r["qlen"]
        seq[b] = r["nc"] + r["qlen"]
        prefill[r["row"]] = r["pre"]
        cu[b + 1] += r["drafts"] + num_new
    assert qsl[-1] <= T and cu[-1] <= L, (qsl[-1], T, cu[-1], L)
    last = rng.integers(1, 50_000, size=MR).astype(np.int32)
    return dict(
        input_ids=SENTINEL + np.arange(T, dtype=np.int32),
        idx_mapping=idx,
        last_sampled_tokens=last[:, None] if last_2d else last,
        query_start_loc=qsl,
        seq_lens=seq,
        prefill_len=prefill,
        draft_tokens=rng.integers(50_000, 100_000, size=(MR, S)).astype(np.int32),
        cu_num_logits=cu,
        num_logits=L,
        num_new_sampled_tokens=num_new,
    )


def random_rows(rng, *, R, MR, S, T, L, num_new, pad_frac=0.15):
    rows, tokens, logits = [], 0, 0
    perm = rng.permutation(MR)
    for b in range(R):
        if rng.random() < pad_frac:
            rows.append(None)
            continue
        kind = rng.choice(["prefill", "decode", "straddle"], p=[0.2, 0.6, 0.2])
        d = int(rng.integers(0, S + 1))
        if kind == "decode":
            qlen, pre = max(d + num_new, 1), int(rng.integers(1, 50))
            nc = pre + int(rng.integers(0, 20))
        elif kind == "straddle":
            pre, qlen = int(rng.integers(2, 30)), d + num_new + int(rng.integers(1, 4))
            nc = max(pre - int(rng.integers(0, qlen)), 0)
        else:
            d, qlen, pre = 0, int(rng.integers(max(num_new, 1), 9)), 100
            nc = int(rng.integers(0, 80))
        if tokens + qlen > T or logits + d + num_new > L:
            break
        rows.append(dict(row=int(perm[b]), nc=nc, qlen=qlen, pre=pre, drafts=d))
        tokens, logits = tokens + qlen, logits + d + num_new
    return rows


def dec(row, drafts=0, nc=50, pre=10, qlen=None, num_new=1):
    return dict(row=row, nc=nc, qlen=drafts + num_new if qlen is None else qlen, pre=pre,
                drafts=drafts)


# --------------------------------------------------------------------------
# running and comparing
# --------------------------------------------------------------------------


def call(a, backend, *, jit=False, x64=False):
    num_logits, num_new = a["num_logits"], a["num_new_sampled_tokens"]

    def f(*arrays):
        return combine_sampled_and_draft_tokens(*arrays, num_logits, num_new, backend=backend)

    fn = jax.jit(f) if jit else f
    dtype = jnp.int64 if x64 else None
    if x64:
        with jax.enable_x64(True):
            args = [jnp.asarray(a[k]) if k == "input_ids" else jnp.asarray(a[k], dtype) for k in KEYS]
            ids, li = fn(*args)
            return np.asarray(ids), np.asarray(li)
    ids, li = fn(*(jnp.asarray(a[k]) for k in KEYS))
    return np.asarray(ids), np.asarray(li)


def compare(a, *, jit=False, x64=False, backends=(GPU, "reference")) -> str:
    want_ids, want_li = oracle(a)
    problems = []
    for backend in backends:
        ids, li = call(a, backend, jit=jit, x64=x64)
        for label, got, want in (("input_ids", ids, want_ids), ("logits_indices", li, want_li)):
            if got.dtype != np.int32:
                problems.append(f"{backend} {label}: dtype {got.dtype}")
            elif got.shape != want.shape:
                problems.append(f"{backend} {label}: shape {got.shape} != {want.shape}")
            elif not np.array_equal(got, want):
                bad = np.flatnonzero(got != want)
                problems.append(f"{backend} {label}: {bad.size} entries differ, first at {bad[0]}: "
                                f"{got[bad[0]]} vs {want[bad[0]]}")
    return "; ".join(problems)


# --------------------------------------------------------------------------
# cases
# --------------------------------------------------------------------------

SMALL = dict(R=6, MR=8, S=3, T=24, L=16)
BIG = dict(R=256, MR=512, S=4, T=1536, L=1280)


@case("random small batches (6 rows, S=3), num_new 1 and 0, 8 seeds each")
def _():
    out = []
    for num_new in (1, 0):
        for seed in range(8):
            rng = np.random.default_rng(100 * num_new + seed)
            a = build(random_rows(rng, num_new=num_new, **SMALL), num_new=num_new, rng=rng, **SMALL)
            msg = compare(a)
            if msg:
                out.append(f"num_new={num_new} seed={seed}: {msg}")
    return "; ".join(out)


@case("random 256-request batches (S=4), num_new 1 and 0, padded rows mixed in")
def _():
    out = []
    for num_new in (1, 0):
        for seed in range(4):
            rng = np.random.default_rng(1000 + 10 * num_new + seed)
            a = build(random_rows(rng, num_new=num_new, **BIG), num_new=num_new, rng=rng, **BIG)
            msg = compare(a)
            if msg:
                out.append(f"num_new={num_new} seed={seed}: {msg}")
    return "; ".join(out)


@case("256 decode requests x 4 drafts, every row full (the benchmark's shape)")
def _():
    rng = np.random.default_rng(7)
    rows = [dec(int(r), drafts=4) for r in rng.permutation(512)[:256]]
    return compare(build(rows, R=256, MR=512, S=4, T=1280, L=1280, rng=rng))


@case("all padding (dummy step): nothing written, every logits row 0")
def _():
    return compare(build([], **SMALL)) + compare(build([], **BIG))


@case("padded rows first, between and last")
def _():
    rows = [None, None, dec(3, 2), None, dec(0, 0), dec(5, 3), None]
    return compare(build(rows, R=8, MR=8, S=3, T=24, L=16))


@case("windows ending exactly at the last token of input_ids")
def _():
    rows = [dec(1, 3), dec(2, 1), dec(4, 2)]  # 4 + 2 + 3 = 9 tokens
    return compare(build(rows, R=3, MR=8, S=3, T=9, L=9))


@case("seq_len == prefill_len (prefill) and seq_len - nl == prefill_len (writes last)")
def _():
    rows = [
        dict(row=1, nc=6, qlen=4, pre=10, drafts=0),  # seq == pre: prefill, nothing written
        dict(row=2, nc=10, qlen=3, pre=10, drafts=2),  # seq - nl == pre: last + drafts
        dict(row=3, nc=8, qlen=4, pre=10, drafts=2),  # straddles: drafts only
        dict(row=4, nc=9, qlen=2, pre=10, drafts=0),  # seq - nl == pre - 1 + ...: prompt tail
    ]
    return compare(build(rows, **SMALL))


@case("no speculative steps (S = 0)")
def _():
    rows = [dec(1, 0), None, dec(6, 0), dict(row=2, nc=0, qlen=5, pre=9, drafts=0)]
    return compare(build(rows, R=5, MR=8, S=0, T=12, L=8))


@case("logits bucket larger than needed (tail stays 0), last_sampled_tokens as [MR]")
def _():
    rows = [dec(1, 2), dec(0, 1)]
    return compare(build(rows, R=4, MR=8, S=3, T=40, L=33, last_2d=False))


@case("int64 index arrays (x64)")
def _():
    rng = np.random.default_rng(5)
    a = build(random_rows(rng, num_new=1, **SMALL), rng=rng, **SMALL)
    return compare(a, x64=True) + compare(a, x64=True, jit=True)


@case("under jit: request rows out of range (MR + 5, -2, 2**31 - 1) write nothing")
def _():
    rows = [dec(2, 1), dec(4, 1), dec(6, 1), dec(7, 2)]
    a = build(rows, **SMALL)
    a["idx_mapping"][1] = SMALL["MR"] + 5
    a["idx_mapping"][2] = -2
    a["idx_mapping"][3] = 2**31 - 1
    return compare(a, jit=True)


@case("under jit: malformed rows write nothing (logits counts, bounds, query ranges)")
def _():
    out = []
    R, MR, S, T, L = 6, 8, 3, 24, 16
    base = [dec(1, 1), dec(2, 1), dec(3, 1)]  # rows 0..2, queries [0,2) [2,4) [4,6)

    def variant(name, change):
        a = build(base, R=R, MR=MR, S=S, T=T, L=L)
        change(a)
        msg = compare(a, jit=True)
        if msg:
            out.append(f"{name}: {msg}")

    def too_many(a):  # row 1: 6 logits rows > S + 1
        a["cu_num_logits"][2:] = a["cu_num_logits"][2:] + 4
        a["query_start_loc"][2:] = a["query_start_loc"][2:] + 4

    def too_few(a):  # row 1: 0 logits rows < num_new
        a["cu_num_logits"][2:] -= 2

    def past_num_logits(a):  # row 2 ends past num_logits
        a["cu_num_logits"][3:] = L + 1

    def query_past_ids(a):  # row 2's query ends past input_ids
        a["query_start_loc"][3:] = T + 2
        a["query_start_loc"][2] = T

    def logits_before_query(a):  # row 1: qe - nl < qs
        a["query_start_loc"][2] = a["query_start_loc"][1] + 1

    def negative_cu(a):  # row 0 starts before 0
        a["cu_num_logits"][0] = -2

    def decreasing_cu(a):  # padded rows 1, 2: row 2's range [0, 4) covers live row 0's
        a["idx_mapping"][1:3] = -1
        a["cu_num_logits"][2:] = [0, 4, 6, 6, 6]
        a["query_start_loc"][3] = a["query_start_loc"][2]

    for name, change in (("decreasing cu_num_logits", decreasing_cu),
                         ("too many logits rows", too_many), ("too few", too_few),
                         ("past num_logits", past_num_logits), ("query past input_ids", query_past_ids),
                         ("logits rows before the query", logits_before_query),
                         ("negative cu_num_logits", negative_cu)):
        variant(name, change)
    return "; ".join(out)


@case("donated input_ids updated in place; repeated calls identical")
def _():
    rng = np.random.default_rng(11)
    # A long input_ids (64 Ki tokens, 256 KiB) so that a copy of it would show.
    big = dict(BIG, T=1 << 16)
    a = build(random_rows(rng, num_new=1, **big), rng=rng, **big)
    L = a["num_logits"]
    fn = jax.jit(lambda ids, *r: combine_sampled_and_draft_tokens(ids, *r, L, backend=GPU),
                 donate_argnums=0)
    rest = [jnp.asarray(a[k]) for k in KEYS[1:]]
    ids = jnp.asarray(a["input_ids"])
    compiled = fn.lower(ids, *rest).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    aliased = "input_output_alias" in compiled.as_text()
    ptr = ids.unsafe_buffer_pointer()
    out_ids, li = fn(ids, *rest)
    same = out_ids.unsafe_buffer_pointer() == ptr
    first = (np.asarray(out_ids), np.asarray(li))
    want = oracle(a)
    problems = []
    if not (np.array_equal(first[0], want[0]) and np.array_equal(first[1], want[1])):
        problems.append("result differs from the oracle")
    for _ in range(5):
        again = fn(jnp.asarray(a["input_ids"]), *rest)
        if not (np.array_equal(np.asarray(again[0]), first[0]) and np.array_equal(np.asarray(again[1]), first[1])):
            problems.append("a repeated call gave a different result")
            break
    if not same:
        problems.append("output input_ids is not the donated buffer")
    if not aliased:
        problems.append("no input_output_alias in the compiled module")
    if temp >= ids.size * 4 // 4:
        problems.append(f"temporary memory {temp} B >= a quarter of input_ids ({ids.size * 4} B)")
    print(f"INFO in-place: same buffer={same} alias={aliased} temp={temp} B", flush=True)
    return "; ".join(problems)


def main() -> int:
    if not on_gpu_or_allowed("the compiled GPU kernel"):
        return 1
    run_cases()
    return summary()


if __name__ == "__main__":
    sys.exit(main())
