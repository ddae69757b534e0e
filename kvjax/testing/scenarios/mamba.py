"""Scenarios of the Mamba ops: the decode updates (``selective_state_update``,
``causal_conv1d_update``) and the varlen prefill (``selective_scan_varlen``,
``causal_conv1d_varlen``)."""

from __future__ import annotations

import numpy as np

from kvjax.testing.scenarios.common import (
    BF16, BITWISE, F32, NULL, SCAN_BF16, SCAN_F32, SSM_BF16, SSM_F32, nan_rows, normal,
    op_scenarios, pick, poisoned,
)

SSU = dict(L=10, T=6, H=4, P=4, N=8, G=2, K=3)


def _ssu_base(rng, *, dtype=F32, heads=True, tied=False):
    L, T, H, P, N, G = (SSU[k] for k in ("L", "T", "H", "P", "N", "G"))
    a = dict(
        state=poisoned(rng, (L, H, P, N), F32), x=normal(rng, (T, H, P)),
        dt=normal(rng, (T, H, P), F32, 0.5), A=-np.abs(normal(rng, (H, P, N))),
        B=normal(rng, (T, G, N)), C=normal(rng, (T, G, N)), D=normal(rng, (H, P)),
        dt_bias=normal(rng, (H, P), F32, 0.1), z=normal(rng, (T, H, P)),
    )
    if tied:
        a.update(dt=a["dt"][:, :, :1].copy(), A=a["A"][:, :1, :1].copy(), D=a["D"][:, :1].copy(),
                 dt_bias=a["dt_bias"][:, :1].copy())
    if not heads:
        a = dict(state=a["state"][:, 0].copy(), x=a["x"][:, 0].copy(), dt=a["dt"][:, 0].copy(),
                 A=a["A"][0].copy(), B=a["B"][:, 0].copy(), C=a["C"][:, 0].copy(),
                 D=a["D"][0].copy(), dt_bias=a["dt_bias"][0].copy(), z=a["z"][:, 0].copy())
    a = {k: v.astype(dtype) for k, v in a.items()}
    a.update(dt_softplus=True, state_batch_indices=None, dst_state_batch_indices=None,
             null_block_id=NULL, num_accepted_tokens=None, cu_seqlens=None)
    return a


def _ssu_plain(sbi, dst=None, **kw):
    def make(seed):
        a = _ssu_base(np.random.default_rng(seed), **kw)
        a["state_batch_indices"] = np.asarray(sbi, np.int32)
        if dst is not None:
            a["dst_state_batch_indices"] = np.asarray(dst, np.int32)
        return a
    return make


def _ssu_spec(cu, src, dst, acc, *, nan_tokens=()):
    def make(seed):
        a = _ssu_base(np.random.default_rng(seed))
        a.update(cu_seqlens=np.asarray(cu, np.int32), state_batch_indices=np.asarray(src, np.int32),
                 dst_state_batch_indices=None if dst is None else np.asarray(dst, np.int32),
                 num_accepted_tokens=None if acc is None else np.asarray(acc, np.int32))
        for k in ("x", "dt", "B", "C", "z"):
            a[k] = nan_rows(a[k], list(nan_tokens))
        return a
    return make


def _ssu_random(seed):
    rng = np.random.default_rng(seed)
    L, T, K = SSU["L"], SSU["T"], SSU["K"]
    mode = pick(rng, ("plain", "dst", "spec", "varlen"))
    a = _ssu_base(rng)
    a["dt_softplus"] = bool(rng.integers(2))
    rows = rng.permutation(np.arange(1, L))
    if mode in ("plain", "dst"):
        sbi = rows[:T].astype(np.int32)
        sbi[rng.random(T) < 0.25] = NULL
        a["state_batch_indices"] = sbi
        if mode == "dst":  # write elsewhere: fresh rows, or in place; null only where src is null
            dst = np.where(rng.random(T) < 0.5, sbi, 0)
            fresh = rows[T:]
            for b in range(T):
                if sbi[b] != NULL and dst[b] == 0:
                    dst[b] = fresh[0] if len(fresh) else sbi[b]
                    fresh = fresh[1:]
            a["dst_state_batch_indices"] = dst.astype(np.int32)
        return a
    lens = rng.integers(0, K + 1, size=3)
    while lens.sum() > T:
        lens[int(np.argmax(lens))] -= 1
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    a["cu_seqlens"] = cu
    pad = list(range(int(cu[-1]), T))
    for k in ("x", "dt", "B", "C", "z"):
        a[k] = nan_rows(a[k].astype(np.float32), pad).astype(a[k].dtype)
    if mode == "varlen":
        sbi = rows[:3].astype(np.int32)
        sbi[rng.random(3) < 0.25] = NULL
        a["state_batch_indices"] = sbi
        return a
    src = rows[:9].reshape(3, K).astype(np.int32)
    dst = src.copy()
    src[rng.random(3) < 0.2] = NULL
    dst[rng.random((3, K)) < 0.2] = NULL
    a.update(state_batch_indices=src, dst_state_batch_indices=dst,
             num_accepted_tokens=rng.integers(1, K + 1, size=3).astype(np.int32))
    return a


def ssu_scenarios(cases):
    """Scenarios of ``selective_state_update``: ``cases`` random, then the adversarial ones."""
    L = SSU["L"]
    f32, bf16 = {"*": SSM_F32}, {"*": SSM_BF16}
    random_case = (_ssu_random,
                   "random path (plain / separate dst / varlen / speculative), random null rows")
    fixed = [
        ("null-mamba-rows", _ssu_plain([3, 0, 5, 1, 0, 7]), f32,
         "null src rows read a zero state and write nothing; row 0 is NaN"),
        ("null-dst", _ssu_plain([1, 2, 3, 4, 5, 6], [7, 0, 3, 4, 5, 6]), f32,
         "valid src 2 with a null dst: kvjax writes no state (vLLM writes the null row)"),
        ("speculative-mamba-rows",
         _ssu_spec([0, 3, 4, 6], [[1, 2, 3], [0, 0, 0], [5, 6, 7]], [[4, 2, 0], [0, 0, 0], [7, 6, 5]],
                   [2, 1, 3]), f32,
         "per-token dst columns, initial column num_accepted-1, a null dst entry, a null src"),
        ("spec-decode-0..k-drafts",
         _ssu_spec([0, 1, 1, 3, 6], [[1, 0, 0], [0, 0, 0], [2, 3, 0], [4, 5, 6]], None, [1, 1, 2, 0]),
         f32, "sequences of 1, 0, 2, 3 tokens (0..2 drafts); num_accepted 1, 1, 2, 0"),
        ("chunked-prefill-gap", _ssu_spec([0, 2, 2, 4], [3, 1, 5], None, None, nan_tokens=[4, 5]),
         f32, "varlen: tokens 4, 5 belong to no sequence (NaN inputs): out 0, no state"),
        ("last-block", _ssu_plain([L - 1, 2, 0, 4, 6, 8], [L - 1, 2, 0, 4, 6, 8]), f32,
         "the last state row (L-1) read and written"),
        ("bf16", _ssu_plain([3, 0, 5, 1, 8, 2], dtype=BF16), bf16, "bfloat16 state and inputs"),
        ("no-heads", _ssu_plain([1, 4, 0, 2, 9, 5], heads=False), f32,
         "the headless layout: state [L, P, N]"),
        ("tied-head-dim", _ssu_plain([3, 1, 0, 5, 7, 9], tied=True), f32,
         "per-head dt [T, H, 1], A [H, 1, 1], D and dt_bias [H, 1]"),
    ]
    return op_scenarios("selective_state_update", cases, f32, random_case, fixed)


CONV = dict(L=6, dim=8, W=4)


def _conv_base(rng, S, dtype=F32, bias=True):
    L, dim, W = CONV["L"], CONV["dim"], CONV["W"]
    return dict(conv_state=poisoned(rng, (L, dim, S), dtype),
                weight=normal(rng, (dim, W), F32, 0.5).astype(dtype),
                bias=normal(rng, (dim,)).astype(dtype) if bias else None)


def _conv_case(x_shape, idx, *, S=None, qsl=None, acc=None, activation="silu", bias=True,
               dtype=F32, max_query_len=-1, nan_tokens=()):
    W = CONV["W"]

    def make(seed):
        rng = np.random.default_rng(seed)
        a = _conv_base(rng, S or W - 1, dtype, bias)
        x = normal(rng, x_shape)
        x = nan_rows(x, list(nan_tokens))
        a.update(x=x.astype(dtype), activation=activation,
                 conv_state_indices=None if idx is None else np.asarray(idx, np.int32),
                 num_accepted_tokens=None if acc is None else np.asarray(acc, np.int32),
                 query_start_loc=None if qsl is None else np.asarray(qsl, np.int32),
                 max_query_len=max_query_len, null_block_id=NULL)
        return a
    return make


def _conv_random(seed):
    rng = np.random.default_rng(seed)
    L, dim, W = CONV["L"], CONV["dim"], CONV["W"]
    rows = rng.permutation(np.arange(1, L))
    mode = pick(rng, ("2d", "3d", "3d-spec", "varlen", "varlen-spec"))
    act = pick(rng, ("silu", None))
    idx = rows[:4].astype(np.int32)
    idx[rng.random(4) < 0.25] = NULL
    if mode == "2d":
        return _conv_case((4, dim), idx, activation=act)(seed)
    if mode == "3d":
        return _conv_case((4, dim, 2), idx, activation=act)(seed)
    if mode == "3d-spec":
        return _conv_case((4, dim, 2), idx, S=W, acc=rng.integers(1, 3, size=4),
                          activation=act)(seed)
    q = 3
    lens = np.full(4, q) if mode == "varlen" else rng.integers(0, q + 1, size=4)
    lens[rng.random(4) < 0.2] = 0
    qsl = np.concatenate([[0], np.cumsum(lens)])
    T = 4 * q + 2  # one shape for every case; tokens past qsl[-1] are NaN padding
    pad = list(range(int(qsl[-1]), T))
    if mode == "varlen":
        return _conv_case((T, dim), idx, qsl=qsl, activation=act, max_query_len=q,
                          nan_tokens=pad)(seed)
    return _conv_case((T, dim), idx, S=W - 1 + q - 1, qsl=qsl, acc=rng.integers(1, q + 1, size=4),
                      activation=act, max_query_len=q, nan_tokens=pad)(seed)


def conv_scenarios(cases):
    """Scenarios of ``causal_conv1d_update``: ``cases`` random, then the adversarial ones."""
    L, dim, W = CONV["L"], CONV["dim"], CONV["W"]
    # out: float math -> tolerance; conv_state: a copy of x (cast to the state dtype) -> bitwise.
    f32 = {"out": SSM_F32, "conv_state": BITWISE}
    bf16 = {"out": SSM_BF16, "conv_state": BITWISE}
    random_case = (_conv_random,
                   "random layout (2d / 3d / 3d-spec / varlen / varlen-spec), random null rows")
    fixed = [
        ("null-mamba-rows", _conv_case((4, dim), [2, 0, 5, 1]), f32,
         "single token; a null row: no state read/write, out keeps x"),
        ("multi-token-3d", _conv_case((2, dim, 3), [3, 1], activation=None, bias=False), f32,
         "x [batch, dim, seqlen], no bias, no activation"),
        ("chunked-prefill-gap",
         _conv_case((11, dim), [2, 3, 0, 4], qsl=[0, 3, 3, 6, 9], max_query_len=3, nan_tokens=[9, 10]),
         f32, "varlen, every live sequence max_query_len long; tokens 9, 10 are NaN padding"),
        ("varlen-short-sequences",
         _conv_case((6, dim), [2, 3, 0, 4], qsl=[0, 3, 3, 4, 6], max_query_len=3), f32,
         "varlen sequences shorter than max_query_len (vLLM state quirk)"),
        ("speculative-mamba-rows",
         _conv_case((6, dim), [2, 3, 0, 4], S=W + 1, qsl=[0, 3, 3, 4, 6], acc=[2, 1, 1, 3],
                    max_query_len=3), f32,
         "speculative sliding window with num_accepted offsets 1..3"),
        ("spec-decode-0..k-drafts",
         _conv_case((4, dim, 2), [1, 3, 0, 5], S=W, acc=[1, 0, 1, 2]), f32,
         "3d speculative, num_accepted 0..2 (0 reads offset 0 in kvjax)"),
        ("last-block", _conv_case((4, dim), [L - 1, 2, 0, 1]), f32, "the last conv-state row"),
        ("bf16", _conv_case((4, dim), [2, 0, 4, 5], dtype=BF16), bf16, "bfloat16 state and x"),
    ]
    return op_scenarios("causal_conv1d_update", cases, f32, random_case, fixed)


SCAN = dict(T=12, H=2, P=4, N=8, G=1, L=6)


def _prefill_layout(rng, R=3):
    """Random (query_start_loc, cache_indices, has_initial_state) for R requests."""
    T, L = SCAN["T"], SCAN["L"]
    lens = rng.integers(0, 5, size=R)
    qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    ci = rng.permutation(np.arange(1, L))[:R].astype(np.int32)
    ci[rng.random(R) < 0.2] = NULL
    his = rng.random(R) < 0.5
    assert qsl[-1] <= T
    return qsl, ci, his


def _scan_case(layout=None, *, dtype=F32, poison_rows=(0,)):
    T, H, P, N, G, L = (SCAN[k] for k in ("T", "H", "P", "N", "G", "L"))

    def make(seed):
        rng = np.random.default_rng(seed)
        qsl, ci, his = layout if layout is not None else _prefill_layout(rng)
        qsl = np.asarray(qsl, np.int32)
        pad = list(range(int(qsl[-1]), T))
        arr = dict(x=normal(rng, (T, H, P)), dt=normal(rng, (T, H), F32, 0.5),
                   B=normal(rng, (T, G, N)), C=normal(rng, (T, G, N)), z=normal(rng, (T, H, P)))
        arr = {k: nan_rows(v, pad).astype(dtype) for k, v in arr.items()}
        return dict(arr, A=-np.abs(normal(rng, (H,))).astype(dtype),
                    state=poisoned(rng, (L, H, P, N), dtype, rows=poison_rows),
                    query_start_loc=qsl, cache_indices=np.asarray(ci, np.int32),
                    has_initial_state=np.asarray(his, bool), D=normal(rng, (H,)).astype(dtype),
                    dt_bias=normal(rng, (H,), F32, 0.1).astype(dtype), dt_softplus=True,
                    null_block_id=NULL)
    return make


def _conv_varlen_case(layout=None, *, dtype=F32, poison_rows=(0,), activation="silu"):
    T, L = SCAN["T"], SCAN["L"]
    dim, W = CONV["dim"], CONV["W"]

    def make(seed):
        rng = np.random.default_rng(seed)
        qsl, ci, his = layout if layout is not None else _prefill_layout(rng)
        qsl = np.asarray(qsl, np.int32)
        x = nan_rows(normal(rng, (T, dim)), list(range(int(qsl[-1]), T))).T.copy()
        return dict(x=x.astype(dtype), weight=normal(rng, (dim, W), F32, 0.5).astype(dtype),
                    bias=normal(rng, (dim,)).astype(dtype),
                    conv_states=poisoned(rng, (L, dim, W), dtype, rows=poison_rows),
                    query_start_loc=qsl, cache_indices=np.asarray(ci, np.int32),
                    has_initial_state=np.asarray(his, bool), activation=activation,
                    null_block_id=NULL)
    return make


_PREFILL_FIXED = [
    ("reused-row-fresh-start", ([0, 4, 7, 12], [2, 3, 5], [False, True, False]), (0, 2, 5),
     "fresh requests on NaN-poisoned reused rows 2, 5: the old state is never read"),
    ("null-mamba-rows", ([0, 3, 8, 12], [1, 0, 4], [True, True, False]), (0,),
     "a null cache index: no read, no write"),
    ("chunked-prefill-gap", ([0, 3, 5, 8], [4, 1, 3], [True, False, True]), (0,),
     "8 real tokens, 4 NaN padding tokens after them"),
    ("empty-request", ([0, 4, 4, 9], [2, 3, 1], [True, True, True]), (0,),
     "a zero-length request between two real ones: its row is untouched"),
    ("last-block", ([0, 5, 6, 12], [5, 1, 2], [True, False, True]), (0,),
     "the last state row (L-1)"),
]


def _prefill_scenarios(op, case, f32, bf16, cases):
    fixed = [(n, case(layout, poison_rows=rows), d) for n, layout, rows, d in _PREFILL_FIXED]
    fixed.append(("bf16", case(([0, 4, 7, 10], [1, 4, 2], [True, False, True]), dtype=BF16), bf16,
                  "bfloat16 state and inputs"))
    random_case = (case(), "3 random requests (0-4 tokens), random null rows and has_initial_state")
    return op_scenarios(op, cases, f32, random_case, fixed)


def scan_varlen_scenarios(cases):
    """Scenarios of ``selective_scan_varlen``: ``cases`` random, then the adversarial ones."""
    return _prefill_scenarios("selective_scan_varlen", _scan_case, {"*": SCAN_F32},
                              {"*": SCAN_BF16}, cases)


def conv_varlen_scenarios(cases):
    """Scenarios of ``causal_conv1d_varlen``: ``cases`` random, then the adversarial ones."""
    return _prefill_scenarios("causal_conv1d_varlen", _conv_varlen_case,
                              {"out": SSM_F32, "conv_states": BITWISE},
                              {"out": SSM_BF16, "conv_states": BITWISE}, cases)
