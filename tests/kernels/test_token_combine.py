"""combine_sampled_and_draft_tokens: every backend against an independent numpy loop.

Each scenario runs the jnp reference, the TPU (Mosaic) kernel in TPU interpret
mode (race detector on, uninitialised memory = NaN) and the GPU (Triton)
kernel in generic interpret mode, and compares the whole ``input_ids`` and
``logits_indices`` against a plain Python loop over the batch rows written
from vLLM 0.33.0's rule. ``input_ids`` starts as distinct sentinel values
(9000 + t), so any write to a wrong position shows. One batch geometry is
shared by every test so each backend compiles only a few times.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.state.request_state import RequestRows, RequestState
from pallas_kernels.token_combine import (
    combine_sampled_and_draft_tokens,
    combine_sampled_and_draft_tokens_reference,
)
from kvjax.testing.asserts import assert_no_races  # noqa: E402

BACKENDS = ("reference", "pallas_tpu", "pallas_gpu")
# T tokens, R batch rows, MR request rows, S speculative steps, L logits rows.
T, R, MR, S, L = 24, 6, 8, 3, 16
SENTINEL = 9000


# --------------------------------------------------------------------------
# scenarios and the independent oracle
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Req:
    """One scheduled request: its row, progress, query length, prefill length, drafts."""

    row: int
    num_computed: int
    qlen: int
    prefill_len: int
    drafts: int = 0


def build(reqs, *, num_new=1):
    """Kernel arguments (numpy) for ``reqs``; ``None`` entries are padded (-1) rows.

    Rows after the list are padding too. Request row ``s`` has last sampled
    token ``100 + s`` and drafts ``1000 + 10 s + j``; unused request rows get a
    huge prefill_len so that reading them by mistake changes the result.
    """
    idx = np.full((R,), -1, np.int32)
    qsl = np.zeros((R + 1,), np.int32)
    seq = np.zeros((R,), np.int32)
    cu = np.zeros((R + 1,), np.int32)
    prefill = np.full((MR,), 10_000, np.int32)
    for b in range(R):
        r = reqs[b] if b < len(reqs) else None
        qsl[b + 1], cu[b + 1] = qsl[b], cu[b]
        if r is None:
            continue
        idx[b] = r.row
        qsl[b + 1] += r.qlen
        seq[b] = r.num_computed + r.qlen
        prefill[r.row] = r.prefill_len
        cu[b + 1] += r.drafts + num_new
    return dict(
        input_ids=SENTINEL + np.arange(T, dtype=np.int32),
        idx_mapping=idx,
        last_sampled_tokens=(100 + np.arange(MR, dtype=np.int32))[:, None],
        query_start_loc=qsl,
        seq_lens=seq,
        prefill_len=prefill,
        draft_tokens=1000 + 10 * np.arange(MR, dtype=np.int32)[:, None] + np.arange(S, dtype=np.int32),
        cu_num_logits=cu,
        num_logits=L,
        num_new_sampled_tokens=num_new,
    )


def oracle(a):
    """vLLM 0.33.0's rule, one batch row at a time; -1 rows skipped; unwritten logits 0."""
    ids = a["input_ids"].copy()
    li = np.zeros((a["num_logits"],), np.int64)
    num_new = a["num_new_sampled_tokens"]
    last = a["last_sampled_tokens"].reshape(-1)
    for b, s in enumerate(a["idx_mapping"].tolist()):
        if s < 0:
            continue
        cs, ce = int(a["cu_num_logits"][b]), int(a["cu_num_logits"][b + 1])
        nl, qe = ce - cs, int(a["query_start_loc"][b + 1])
        nd = nl - num_new
        for i in range(nl):
            li[cs + i] = qe - nl + i
        seq, pre = int(a["seq_lens"][b]), int(a["prefill_len"][s])
        if seq <= pre:
            continue
        if num_new == 1 and seq - nl >= pre:
            ids[qe - nl] = last[s]
        for i in range(nd):
            ids[qe - nd + i] = a["draft_tokens"][s, i]
    return ids, li


def run(a, backend):
    out = combine_sampled_and_draft_tokens(
        **{k: jnp.asarray(v) if isinstance(v, np.ndarray) else v for k, v in a.items()},
        backend=backend,
        interpret=None if backend == "reference" else True,
    )
    assert_no_races(backend)
    return out


def check(a, backend):
    ids, li = run(a, backend)
    want_ids, want_li = oracle(a)
    assert ids.dtype == jnp.int32 and li.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(ids), want_ids, err_msg=f"{backend}: input_ids")
    np.testing.assert_array_equal(np.asarray(li), want_li, err_msg=f"{backend}: logits_indices")
    return np.asarray(ids), np.asarray(li)


# --------------------------------------------------------------------------
# scenarios
# --------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_with_0_to_k_drafts(backend):
    # Four decode rows with 0, 1, 2, 3 drafts (query = 1 + drafts), rows shuffled.
    reqs = [Req(row=r, num_computed=20, qlen=1 + d, prefill_len=12, drafts=d)
            for r, d in ((5, 0), (2, 1), (7, 2), (0, 3))]
    ids, li = check(build(reqs), backend)
    # By hand: queries [0,1) [1,3) [3,6) [6,10); each window = [last, drafts...].
    assert ids[:10].tolist() == [105, 102, 1020, 107, 1070, 1071, 100, 1000, 1001, 1002]
    assert ids[10:].tolist() == (SENTINEL + np.arange(10, T)).tolist()
    assert li[:10].tolist() == list(range(10)) and not li[10:].any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_prompt_tail_straddling_prefill_len(backend):
    reqs = [
        # seq 12 > prefill 10, but the first logits token (position 9) is still
        # prompt: it keeps its id; only the drafts (positions 10, 11) are written.
        Req(row=1, num_computed=8, qlen=4, prefill_len=10, drafts=2),
        # seq == prefill: the chunk that ends prefill counts as prefill.
        Req(row=3, num_computed=6, qlen=4, prefill_len=10),
        # first logits token exactly at prefill_len: written with the last sample.
        Req(row=4, num_computed=10, qlen=3, prefill_len=10, drafts=2),
    ]
    ids, li = check(build(reqs), backend)
    assert ids[:4].tolist() == [SENTINEL + 0, SENTINEL + 1, 1010, 1011]
    assert ids[4:8].tolist() == [SENTINEL + t for t in range(4, 8)]
    assert ids[8:11].tolist() == [104, 1040, 1041]
    assert li[:7].tolist() == [1, 2, 3, 7, 8, 9, 10]


@pytest.mark.parametrize("backend", BACKENDS)
def test_mid_prefill_chunk_writes_no_ids(backend):
    reqs = [Req(row=6, num_computed=0, qlen=8, prefill_len=30),
            Req(row=2, num_computed=8, qlen=8, prefill_len=30)]
    ids, li = check(build(reqs), backend)
    assert ids.tolist() == (SENTINEL + np.arange(T)).tolist()
    assert li[:2].tolist() == [7, 15]


@pytest.mark.parametrize("backend", BACKENDS)
def test_padded_rows_write_nothing(backend):
    # A padded row between real rows and padded rows at the end; the padded
    # rows' request row would be -1: nothing may be read or written through it.
    reqs = [Req(row=3, num_computed=9, qlen=2, prefill_len=5, drafts=1), None,
            Req(row=0, num_computed=4, qlen=1, prefill_len=4)]
    a = build(reqs)
    ids, li = check(a, backend)
    assert ids[:3].tolist() == [103, 1030, 100]
    assert li.tolist() == [0, 1, 2] + [0] * (L - 3)
    # All padding (a dummy step): nothing changes, every logits row is 0.
    ids, li = check(build([]), backend)
    assert ids.tolist() == (SENTINEL + np.arange(T)).tolist() and not li.any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_new_sampled_token(backend):
    # num_new_sampled_tokens=0: every logits row is a draft; the last sampled
    # token is never written.
    reqs = [Req(row=2, num_computed=20, qlen=2, prefill_len=3, drafts=2),
            Req(row=5, num_computed=20, qlen=1, prefill_len=3, drafts=0),
            Req(row=1, num_computed=3, qlen=3, prefill_len=5, drafts=1)]
    ids, li = check(build(reqs, num_new=0), backend)
    assert ids[:2].tolist() == [1020, 1021] and ids[2] == SENTINEL + 2
    assert li[:3].tolist() == [0, 1, 5]


@pytest.mark.parametrize("backend", BACKENDS)
def test_reused_row_reads_only_the_new_tenant(backend):
    """A row freed and reused at once (LIFO) must feed the new request's tokens.

    Request A leaves row r with a last sampled token and drafts of its own; B,
    a resumed request (3 tokens already computed), is added into the same row.
    ``add_requests`` rewrites last_sampled (= B's token 2) and zeroes the
    drafts (PR 39833), and B's first decode step feeds exactly those.
    """
    rows = RequestRows(MR)
    state = RequestState.create(MR, 32, S)
    r = rows.add("A")
    state = state.add_request(r, [11, 12, 13, 14])
    state = state.replace(
        last_sampled_tokens=state.last_sampled_tokens.at[r].set(777),
        draft_tokens=state.draft_tokens.at[r].set(jnp.array([555, 556, 557])),
    )
    rows.remove("A")
    assert rows.add("B") == r  # the row just freed is reused
    state = state.add_request(r, [21, 22, 23], num_computed_tokens=3)
    a = build([Req(row=r, num_computed=3, qlen=3, prefill_len=3, drafts=2)])
    a["last_sampled_tokens"] = np.asarray(state.last_sampled_tokens)
    a["draft_tokens"] = np.asarray(state.draft_tokens)
    a["prefill_len"] = np.asarray(state.prefill_len)
    ids, _ = check(a, backend)
    assert ids[:3].tolist() == [23, 0, 0]
    assert not np.isin(ids, [777, 555, 556, 557]).any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_random_batches(backend):
    """Seeded random batches (mixed prefill / straddle / decode rows, padding) against the loop."""
    rng = np.random.default_rng(1234)
    for num_new in (1, 0):
        for _ in range(4):
            a = build(random_reqs(rng, num_new), num_new=num_new)
            check(a, backend)


def random_reqs(rng, num_new):
    reqs, tokens, logits = [], 0, 0
    rows = rng.permutation(MR)
    for b in range(int(rng.integers(0, R + 1))):
        if rng.random() < 0.15:
            reqs.append(None)
            continue
        kind = rng.choice(["prefill", "decode", "straddle"])
        d = int(rng.integers(0, S + 1))
        if kind == "decode":
            qlen, pre = max(d + num_new, 1), int(rng.integers(1, 6))
            nc = pre + int(rng.integers(0, 4))
        elif kind == "straddle":
            pre, qlen = int(rng.integers(2, 8)), d + num_new + int(rng.integers(1, 3))
            nc = pre - int(rng.integers(0, qlen))
        else:
            d, qlen, pre = 0, int(rng.integers(max(num_new, 1), 6)), 20
            nc = int(rng.integers(0, 15))
        if tokens + qlen > T or logits + d + num_new > L:
            break
        reqs.append(Req(int(rows[b]), max(nc, 0), qlen, pre, d))
        tokens, logits = tokens + qlen, logits + d + num_new
    return reqs


# --------------------------------------------------------------------------
# jit, masking of bad rows, errors
# --------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_under_jit_out_of_range_rows_write_nothing(backend):
    a = build([Req(row=2, num_computed=20, qlen=2, prefill_len=3, drafts=1),
               Req(row=4, num_computed=20, qlen=2, prefill_len=3, drafts=1),
               Req(row=6, num_computed=20, qlen=2, prefill_len=3, drafts=1)])
    a["idx_mapping"][1] = MR + 5  # out of range: unchecked under jit, must be masked
    a["idx_mapping"][2] = -2  # negative but not -1: must never wrap around

    @jax.jit
    def f(ids, idx, last, qsl, seq, pre, drafts, cu):
        return combine_sampled_and_draft_tokens(
            ids, idx, last, qsl, seq, pre, drafts, cu, L, backend=backend,
            interpret=None if backend == "reference" else True,
        )

    keys = ("input_ids", "idx_mapping", "last_sampled_tokens", "query_start_loc", "seq_lens",
            "prefill_len", "draft_tokens", "cu_num_logits")
    ids, li = f(*(jnp.asarray(a[k]) for k in keys))
    assert np.asarray(ids).tolist() == [102, 1020] + (SENTINEL + np.arange(2, T)).tolist()
    assert np.asarray(li).tolist() == [0, 1] + [0] * (L - 2)


def test_under_jit_malformed_rows_write_nothing():
    a = build([Req(row=2, num_computed=20, qlen=2, prefill_len=3, drafts=1),
               Req(row=3, num_computed=20, qlen=2, prefill_len=3, drafts=1)])
    a["cu_num_logits"][2:] = a["cu_num_logits"][1] + 7  # row 1: 7 logits > S + 1
    f = jax.jit(lambda *xs: combine_sampled_and_draft_tokens(*xs, L, backend="reference"))
    keys = ("input_ids", "idx_mapping", "last_sampled_tokens", "query_start_loc", "seq_lens",
            "prefill_len", "draft_tokens", "cu_num_logits")
    ids, li = f(*(jnp.asarray(a[k]) for k in keys))
    assert np.asarray(ids)[2:4].tolist() == [SENTINEL + 2, SENTINEL + 3]
    assert np.asarray(li).tolist() == [0, 1] + [0] * (L - 2)


def test_reference_name_and_one_dim_last_sampled():
    a = build([Req(row=1, num_computed=9, qlen=1, prefill_len=4)])
    a["last_sampled_tokens"] = a["last_sampled_tokens"].reshape(-1)  # kvjax's [MR] layout
    ids, li = combine_sampled_and_draft_tokens_reference(**a)
    assert int(ids[0]) == 101 and int(li[0]) == 0


def test_no_speculative_steps():
    a = build([Req(row=1, num_computed=9, qlen=1, prefill_len=4)])
    a["draft_tokens"] = np.zeros((MR, 0), np.int32)
    for backend in BACKENDS:
        ids, li = run(a, backend)
        assert int(ids[0]) == 101 and int(li[0]) == 0


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda a: a["idx_mapping"].__setitem__(0, MR), r"idx_mapping must have values in \[0, 8\)"),
        (lambda a: a["idx_mapping"].__setitem__(0, -2), r"idx_mapping must have values"),
        (lambda a: a.__setitem__("num_new_sampled_tokens", 2), "num_new_sampled_tokens must be 0 or 1"),
        (lambda a: a.__setitem__("num_logits", -1), "num_logits must be a static int"),
        (lambda a: a.__setitem__("input_ids", a["input_ids"].astype(np.int16)), "input_ids must have dtype int32"),
        (lambda a: a.__setitem__("prefill_len", a["prefill_len"][:3]), r"prefill_len must have shape \[8\]"),
        (lambda a: a.__setitem__("seq_lens", a["seq_lens"][:1]), "seq_lens must have at least 6 entries"),
        (lambda a: a["cu_num_logits"].__setitem__(slice(2, None), 9), "has 7 logits rows"),
        (lambda a: a.__setitem__("num_logits", 2), r"must lie in \[0, num_logits=2\]"),
        (lambda a: a["query_start_loc"].__setitem__(1, 1), "hold its 2 logits rows"),
        (lambda a: a["query_start_loc"].__setitem__(slice(2, None), 30), r"must lie in \[0, 24\]"),
        (lambda a: a["query_start_loc"].__setitem__(2, 1), "query_start_loc.* must be non-decreasing"),
    ],
)
def test_concrete_errors_name_the_argument(change, match):
    a = build([Req(row=2, num_computed=20, qlen=2, prefill_len=3, drafts=1),
               Req(row=4, num_computed=20, qlen=2, prefill_len=3, drafts=1)])
    change(a)
    with pytest.raises(ValueError, match=match):
        combine_sampled_and_draft_tokens(**a, backend="reference")


# --------------------------------------------------------------------------
# torch reference (kvjax.testing.torch_ref) on the same scenarios
# --------------------------------------------------------------------------


def test_torch_reference_matches_kvjax():
    torch = pytest.importorskip("torch")
    from kvjax.testing.torch_ref.token_combine import combine_sampled_and_draft_tokens as torch_combine

    rng = np.random.default_rng(99)
    cases = [build(random_reqs(rng, n), num_new=n) for n in (1, 0) for _ in range(6)]
    cases.append(build([Req(row=1, num_computed=8, qlen=4, prefill_len=10, drafts=2), None,
                        Req(row=3, num_computed=6, qlen=4, prefill_len=10)]))
    for a in cases:
        t = {k: torch.from_numpy(v.copy()) if isinstance(v, np.ndarray) else v for k, v in a.items()}
        t["last_sampled_tokens"] = t["last_sampled_tokens"].long()
        t["draft_tokens"] = t["draft_tokens"].long()
        ids_t, li_t = torch_combine(**t)
        ids, li = combine_sampled_and_draft_tokens(**a, backend="reference")
        np.testing.assert_array_equal(ids_t.numpy(), np.asarray(ids))
        np.testing.assert_array_equal(li_t.numpy(), np.asarray(li))
        assert li_t.dtype == torch.int64  # vLLM's dtype
