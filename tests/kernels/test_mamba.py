"""Tests for pallas_kernels.mamba: decode-step SSM / conv updates and the prefill scans.

Every implementation (jnp reference, TPU kernel in TPU interpret mode, GPU kernel in
generic interpret mode) is checked against an independent float64 numpy oracle written
here, token by token. State rows that must not be touched — the null row 0 and every
unused row — are poisoned with NaN and compared bitwise after the call.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvjax.testing.asserts import assert_no_races
from pallas_kernels import mamba
from pallas_kernels.mamba_scan import ScanConfig, _chunk_len
from pallas_kernels.mamba_ssu import SSUConfig
from pallas_kernels.mamba import (
    causal_conv1d_update,
    causal_conv1d_varlen,
    selective_scan_varlen,
    selective_state_update,
)

NULL = 0
FLAVORS = [
    pytest.param(("reference", None), id="reference"),
    pytest.param(("pallas_tpu", True), id="tpu-interpret"),
    pytest.param(("pallas_gpu", True), id="gpu-interpret"),
]


# --------------------------------------------------------------------------- #
# helpers
# --------------------------------------------------------------------------- #


def _bits(a):
    a = np.asarray(a)
    return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def assert_rows_bitwise_equal(got, want, rows, what="state"):
    got, want = np.asarray(got), np.asarray(want)
    for r in rows:
        assert np.array_equal(_bits(got[r]), _bits(want[r])), f"{what} row {r} changed"


def run(fn, flavor, *args, **kwargs):
    backend, interpret = flavor
    res = fn(*args, backend=backend, interpret=interpret, **kwargs)
    res = jax.block_until_ready(res)
    assert_no_races(backend)
    return res


def close(got, want, rtol=1e-5, what=""):
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    scale = max(1.0, float(np.max(np.abs(want))) if want.size else 1.0)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale, err_msg=what)


def f32(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def _softplus64(v):
    return np.where(v <= 20.0, np.log1p(np.exp(np.minimum(v, 20.0))), v)


def _sigmoid64(v):
    return 1.0 / (1.0 + np.exp(-v))


# --------------------------------------------------------------------------- #
# float64 oracles, token by token
# --------------------------------------------------------------------------- #


def oracle_ssu(state, x, dt, A, B, C, D=None, dt_bias=None, z=None, dt_softplus=False,
               sbi=None, dsbi=None, na=None, cu=None, null=NULL):
    """selective_state_update, float64, with heads form. Returns (out, state, written rows)."""
    st_ = np.array(state, np.float64)  # keeps NaN rows
    x, dt, A, B, C = (np.asarray(v, np.float64) for v in (x, dt, A, B, C))
    T, H, P = x.shape
    L, _, _, N = st_.shape
    G = B.shape[1]
    out = np.zeros((T, H, P))
    written = set()
    bounds = [(t, t + 1) for t in range(T)] if cu is None else list(zip(cu[:-1], cu[1:]))
    if sbi is not None:
        sbi = np.asarray(sbi).reshape(len(sbi), -1)
        dsbi = sbi if dsbi is None else np.asarray(dsbi).reshape(len(dsbi), -1)
    orig = st_.copy()
    for b, (s, e) in enumerate(bounds):
        if e == s:
            continue
        col = max(int(na[b]) - 1, 0) if na is not None else 0
        src = b if sbi is None else int(sbi[b, col])
        ok = sbi is None or (src != null and 0 <= src < L)
        h = orig[src].copy() if ok else np.zeros((H, P, N))
        for i, t in enumerate(range(s, e)):
            for hh in range(H):
                g = hh // (H // G)
                d = np.broadcast_to(dt[t, hh], (P,)).copy()
                if dt_bias is not None:
                    d = d + np.broadcast_to(np.asarray(dt_bias, np.float64)[hh], (P,))
                if dt_softplus:
                    d = _softplus64(d)
                a = np.broadcast_to(A[hh], (P, N))
                h[hh] = h[hh] * np.exp(a * d[:, None]) + (d[:, None] * B[t, g][None, :]) * x[t, hh][:, None]
                y = h[hh] @ C[t, g]
                if D is not None:
                    y = y + x[t, hh] * np.broadcast_to(np.asarray(D, np.float64)[hh], (P,))
                if z is not None:
                    zz = np.asarray(z, np.float64)[t, hh]
                    y = y * zz * _sigmoid64(zz)
                out[t, hh] = y
            if na is not None and ok and i < dsbi.shape[1]:
                d_row = int(dsbi[b, i])
                if d_row != null and 0 <= d_row < L:
                    st_[d_row] = h
                    written.add(d_row)
        if na is None and ok:
            d_row = b if sbi is None else int(dsbi[b, 0])
            if sbi is None or (d_row != null and 0 <= d_row < L):
                st_[d_row] = h
                written.add(d_row)
    return out, st_, written


def oracle_conv(seqs, conv_state, weight, bias, silu, rows, na=None, null=NULL):
    """causal_conv1d_update per sequence. seqs: list of [dim, n]. Returns (outs, state, written)."""
    cs = np.array(conv_state, np.float64)
    w = np.asarray(weight, np.float64)
    W = w.shape[1]
    outs, written = [], set()
    for b, xb in enumerate(seqs):
        xb = np.asarray(xb, np.float64)
        r = rows[b]
        n = xb.shape[1]
        if r == null or not 0 <= r < cs.shape[0] or n == 0:
            outs.append(None)
            continue
        off = max(int(na[b]) - 1, 0) if na is not None else 0
        seq = np.concatenate([cs[r, :, off:off + W - 1], xb], axis=1)
        o = np.stack([(w * seq[:, t:t + W]).sum(1) for t in range(n)], 1)
        if bias is not None:
            o = o + np.asarray(bias, np.float64)[:, None]
        if silu:
            o = o * _sigmoid64(o)
        outs.append(o)
        if na is None:
            cs[r, :, :W - 1] = seq[:, n:n + W - 1]
        else:
            cs[r, :, :W - 2 + n] = seq[:, 1:]
        written.add(r)
    return outs, cs, written


def oracle_scan(x, dt, A, B, C, state, qsl, ci, his, D=None, dt_bias=None, z=None,
                dt_softplus=False, null=NULL):
    x, dt, A, B, C = (np.asarray(v, np.float64) for v in (x, dt, A, B, C))
    st_ = np.array(state, np.float64)
    T, H, P = x.shape
    G = B.shape[1]
    out = np.zeros((T, H, P))
    written = set()
    for r in range(len(ci)):
        s, e = int(qsl[r]), int(qsl[r + 1])
        if ci[r] == null or e == s:
            continue
        h = st_[ci[r]].copy() if his[r] else np.zeros(st_.shape[1:])
        for t in range(s, e):
            for hh in range(H):
                g = hh // (H // G)
                d = dt[t, hh] + (float(dt_bias[hh]) if dt_bias is not None else 0.0)
                if dt_softplus:
                    d = float(_softplus64(d))
                h[hh] = h[hh] * np.exp(d * A[hh]) + d * np.outer(x[t, hh], B[t, g])
                y = h[hh] @ C[t, g]
                if D is not None:
                    Dh = np.asarray(D, np.float64)
                    y = y + x[t, hh] * (Dh[hh] if Dh.ndim == 1 else Dh[hh])
                if z is not None:
                    zz = np.asarray(z, np.float64)[t, hh]
                    y = y * zz * _sigmoid64(zz)
                out[t, hh] = y
        st_[ci[r]] = h
        written.add(int(ci[r]))
    return out, st_, written


def oracle_conv_varlen(x, weight, bias, conv_states, qsl, ci, his, silu, null=NULL):
    x = np.asarray(x, np.float64)  # [dim, T]
    cs = np.array(conv_states, np.float64)
    w = np.asarray(weight, np.float64)
    W = w.shape[1]
    out = x.copy()
    done = np.zeros(x.shape[1], bool)
    written = set()
    for r in range(len(ci)):
        s, e = int(qsl[r]), int(qsl[r + 1])
        if ci[r] == null or e == s:
            continue
        init = cs[ci[r], :, :W - 1] if his[r] else np.zeros((x.shape[0], W - 1))
        seq = np.concatenate([init, x[:, s:e]], axis=1)
        for i in range(e - s):
            o = (w * seq[:, i:i + W]).sum(1)
            if bias is not None:
                o = o + np.asarray(bias, np.float64)
            out[:, s + i] = o * _sigmoid64(o) if silu else o
        done[s:e] = True
        cs[ci[r], :, :W - 1] = seq[:, -(W - 1):]
        written.add(int(ci[r]))
    return out, cs, written, done


# --------------------------------------------------------------------------- #
# case builders
# --------------------------------------------------------------------------- #


def ssu_case(rng, *, T, H=2, P=4, N=8, G=1, L=10, heads=True, tied=False, dtype=np.float32):
    """Random SSU inputs (heads form) with NaN-poisoned state; returns a dict."""
    state = f32(rng, L, H, P, N).astype(dtype)
    c = dict(
        x=f32(rng, T, H, P),
        dt=f32(rng, T, H, 1 if tied else P, scale=0.5),
        A=-np.exp(f32(rng, H, 1 if tied else P, 1 if tied else N, scale=0.5)),
        B=f32(rng, T, G, N),
        C=f32(rng, T, G, N),
        D=f32(rng, H, 1 if tied else P),
        dt_bias=f32(rng, H, 1 if tied else P, scale=0.5),
        z=f32(rng, T, H, P),
    )
    c["state"] = state
    return c


def poison(arr, rows):
    arr = np.array(arr)
    for r in rows:
        arr[r] = np.nan
    return arr


def check_ssu(flavor, c, *, sbi=None, dsbi=None, na=None, cu=None, heads=True, softplus=True,
              rtol=1e-5, state_rtol=None):
    """Runs selective_state_update on `c` and checks it against the oracle."""
    state = c["state"]
    L = state.shape[0]
    used = set()
    if sbi is not None:
        used |= {int(v) for v in np.asarray(sbi).ravel()}
        used |= {int(v) for v in np.asarray(dsbi if dsbi is not None else sbi).ravel()}
        unused = [r for r in range(L) if r not in used or r == NULL]
    else:  # no indices: sequence b owns row b, there is no null row
        used |= set(range(c["x"].shape[0] if cu is None else len(cu) - 1))
        unused = [r for r in range(L) if r not in used]
    state = poison(state, unused)
    args = dict(c)
    args.pop("state")
    if not heads:  # drop the (size-1) heads axis
        args = {k: v[:, 0] if k in ("x", "dt", "z", "B", "C") else v[0] for k, v in args.items()}
        state_in = state[:, 0]
    else:
        state_in = state
    out, new_state = run(
        selective_state_update, flavor, jnp.asarray(state_in), args["x"], args["dt"], args["A"],
        args["B"], args["C"], D=args["D"], dt_bias=args["dt_bias"], z=args["z"],
        dt_softplus=softplus, state_batch_indices=sbi, dst_state_batch_indices=dsbi,
        num_accepted_tokens=na, cu_seqlens=cu)
    out, new_state = np.asarray(out), np.asarray(new_state)
    if not heads:
        out, new_state = out[:, None], new_state[:, None]
    want_out, want_state, written = oracle_ssu(
        state, c["x"], c["dt"], c["A"], c["B"], c["C"], c["D"], c["dt_bias"], c["z"], softplus,
        sbi, dsbi, na, cu)
    assert np.isfinite(out).all(), "outputs must be finite (null rows read zeros, not row 0)"
    close(out, want_out, rtol, "out")
    for r in range(L):
        if r in written:
            close(new_state[r], want_state[r], state_rtol or rtol, f"state row {r}")
        else:
            assert_rows_bitwise_equal(new_state, state, [r])
    return out, new_state, written


# --------------------------------------------------------------------------- #
# selective_state_update
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("flavor", FLAVORS)
def test_ssu_heads_grouped_null_padding(flavor):
    rng = np.random.default_rng(0)
    c = ssu_case(rng, T=4, H=2, G=2, L=9)
    sbi = np.array([5, NULL, 2, NULL], np.int32)  # two padded rows
    _, _, written = check_ssu(flavor, c, sbi=sbi)
    assert written == {5, 2}


@pytest.mark.parametrize("flavor", FLAVORS)
def test_ssu_no_heads_axis(flavor):
    rng = np.random.default_rng(1)
    c = ssu_case(rng, T=3, H=1, G=1, L=6)
    check_ssu(flavor, c, sbi=np.array([4, NULL, 1], np.int64), heads=False, softplus=False)


@pytest.mark.parametrize("flavor", FLAVORS)
def test_ssu_per_head_dt_A_and_shared_group(flavor):
    # Mamba2 / TIE_HDIM layout: dt [T, H, 1], A [H, 1, 1], D and dt_bias [H, 1]; 2 heads, 1 group.
    rng = np.random.default_rng(2)
    c = ssu_case(rng, T=3, H=2, G=1, L=7, tied=True)
    check_ssu(flavor, c, sbi=np.array([[3], [6], [NULL]], np.int32))


@pytest.mark.parametrize("flavor", FLAVORS)
def test_ssu_no_indices_uses_row_b(flavor):
    rng = np.random.default_rng(3)
    c = ssu_case(rng, T=3, H=2, L=5)
    _, _, written = check_ssu(flavor, c)
    assert written == {0, 1, 2}


@pytest.mark.parametrize("flavor", FLAVORS)
def test_ssu_spec_varlen_num_accepted(flavor):
    # vLLM's test_selective_state_update_with_num_accepted_tokens, plus null dst columns,
    # a fully padded row, and an empty sequence.
    rng = np.random.default_rng(4)
    c = ssu_case(rng, T=8, H=2, G=1, L=20)
    cu = np.array([0, 3, 3, 5, 8, 8], np.int32)  # lens 3, 0, 2, 3, 0
    na = np.array([0, 1, 3, 1, 1], np.int32)  # 0, 1, max; padded rows get 1
    sbi = np.array([[7, 0, 0], [0, 0, 0], [0, 0, 9], [11, 0, 0], [0, 0, 0]], np.int32)
    dsbi = np.array([[12, 13, 14], [0, 0, 0], [15, 0, 0], [16, 0, 17], [0, 0, 0]], np.int32)
    _, new_state, written = check_ssu(flavor, c, sbi=sbi, dsbi=dsbi, na=na, cu=cu)
    assert written == {12, 13, 14, 15, 16, 17}
    # src rows are only read (they are not dst): unchanged
    assert_rows_bitwise_equal(new_state, c["state"], [7, 9, 11])


@pytest.mark.parametrize("flavor", FLAVORS)
def test_ssu_spec_single_token_in_place(flavor):
    # Non-varlen spec path: one token per row, in place (dst defaults to src table).
    rng = np.random.default_rng(5)
    c = ssu_case(rng, T=3, H=2, G=2, L=8)
    sbi = np.array([[3, 4], [5, 6], [0, 0]], np.int32)
    na = np.array([2, 0, 1], np.int32)
    _, _, written = check_ssu(flavor, c, sbi=sbi, na=na)
    assert written == {3, 5}  # token 0 -> column 0 of each valid row


@pytest.mark.parametrize("flavor", FLAVORS)
def test_ssu_varlen_src_dst_differ(flavor):
    # APC-like: read state_batch_indices, write dst_state_batch_indices; a null dst is skipped.
    rng = np.random.default_rng(6)
    c = ssu_case(rng, T=5, H=2, G=1, L=10)
    cu = np.array([0, 2, 4, 5], np.int32)
    sbi = np.array([2, 4, 6], np.int32)
    dsbi = np.array([3, 5, NULL], np.int32)
    _, new_state, written = check_ssu(flavor, c, sbi=sbi, dsbi=dsbi, cu=cu)
    assert written == {3, 5}
    assert_rows_bitwise_equal(new_state, c["state"], [2, 4, 6])


@pytest.mark.parametrize("flavor", FLAVORS)
def test_ssu_bf16_state(flavor):
    rng = np.random.default_rng(7)
    c = ssu_case(rng, T=3, H=2, L=6, dtype=jnp.bfloat16)
    c["state"] = np.asarray(c["state"])
    check_ssu(flavor, c, sbi=np.array([1, 5, NULL], np.int32), state_rtol=1e-2)


@pytest.mark.parametrize("flavor", FLAVORS)
def test_ssu_jit_out_of_range_is_masked(flavor):
    """Under jit the concrete check cannot run: out-of-range rows read zeros, write nothing."""
    rng = np.random.default_rng(8)
    L = 6
    c = ssu_case(rng, T=4, H=1, L=L)
    state = poison(c["state"], [0, 2, 4, 5])
    backend, interpret = flavor

    @jax.jit
    def step(state, sbi):
        return selective_state_update(state, c["x"], c["dt"], c["A"], c["B"], c["C"], D=c["D"],
                                      state_batch_indices=sbi, backend=backend, interpret=interpret)

    sbi = jnp.array([3, L + 2, -1, 1], jnp.int32)
    out, new_state = jax.block_until_ready(step(jnp.asarray(state), sbi))
    assert_no_races(backend)
    want, _, _ = oracle_ssu(state, c["x"], c["dt"], c["A"], c["B"], c["C"], c["D"],
                            sbi=np.array([3, NULL, NULL, 1]))
    close(out, want)
    assert_rows_bitwise_equal(new_state, state, [0, 2, 4, 5])


def test_ssu_validation_errors():
    rng = np.random.default_rng(9)
    c = ssu_case(rng, T=2, H=2, L=4)
    base = dict(x=c["x"], dt=c["dt"], A=c["A"], B=c["B"], C=c["C"])

    def call(**kw):
        a = dict(base)
        a.update(kw)
        return selective_state_update(c["state"], a.pop("x"), a.pop("dt"), a.pop("A"), a.pop("B"),
                                      a.pop("C"), **a)

    with pytest.raises(ValueError, match=r"x must have shape \[2, 2, 4\], got \[2, 3, 4\]"):
        call(x=np.zeros((2, 3, 4), np.float32))
    with pytest.raises(ValueError, match="dt must have shape"):
        call(dt=np.zeros((2, 2, 3), np.float32))
    with pytest.raises(ValueError, match="A must have shape"):
        call(A=np.zeros((2, 3, 8), np.float32))
    with pytest.raises(ValueError, match="C must have shape"):
        call(C=np.zeros((2, 1, 7), np.float32))
    with pytest.raises(ValueError, match="group count"):
        call(B=np.zeros((2, 3, 8), np.float32), C=np.zeros((2, 3, 8), np.float32))
    with pytest.raises(ValueError, match="D must have shape"):
        call(D=np.zeros((3, 4), np.float32))
    with pytest.raises(ValueError, match="x must have dtype a floating dtype, got int32"):
        call(x=np.zeros((2, 2, 4), np.int32))
    with pytest.raises(ValueError, match=r"state_batch_indices must have values in \[0, 4\).*got 4"):
        call(state_batch_indices=np.array([1, 4], np.int32))
    with pytest.raises(ValueError, match="state_batch_indices.*got -1"):
        call(state_batch_indices=np.array([-1, 2], np.int32))
    with pytest.raises(ValueError, match="dst_state_batch_indices.*got 9"):
        call(state_batch_indices=np.array([1, 2], np.int32),
             dst_state_batch_indices=np.array([9, 2], np.int32))
    with pytest.raises(ValueError, match="state_batch_indices must have dtype an integer dtype"):
        call(state_batch_indices=np.array([1.0, 2.0], np.float32))
    with pytest.raises(ValueError, match="num_accepted_tokens.*got 3"):
        call(state_batch_indices=np.array([[1, 2], [3, 0]], np.int32),
             num_accepted_tokens=np.array([3, 1], np.int32))
    with pytest.raises(ValueError, match="num_accepted_tokens requires"):
        call(num_accepted_tokens=np.array([1, 1], np.int32))
    with pytest.raises(ValueError, match="cu_seqlens must be non-decreasing"):
        call(cu_seqlens=np.array([0, 2, 1], np.int32), state_batch_indices=np.array([1, 2], np.int32))
    with pytest.raises(ValueError, match="backend must be one of"):
        call(backend="cuda")


_ssu_cfg = st.fixed_dictionaries(dict(
    seed=st.integers(0, 2**31 - 1),
    heads=st.booleans(),
    G=st.sampled_from([1, 2]),
    tied=st.booleans(),
    spec=st.booleans(),
    varlen=st.booleans(),
    N=st.integers(1, 4),
))


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=_ssu_cfg)
def test_ssu_reference_random(cfg):
    rng = np.random.default_rng(cfg["seed"])
    H = 2 if cfg["heads"] else 1
    G = min(cfg["G"], H)
    n = cfg["N"]
    L = 3 * n + 3
    lens = rng.integers(0 if cfg["varlen"] else 1, 3, n) if cfg["varlen"] else np.ones(n, int)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    T = max(int(cu[-1]), 1)
    if not cfg["varlen"]:
        T = n
    c = ssu_case(rng, T=T, H=H, G=G, L=L, tied=cfg["tied"] and cfg["heads"])
    rows = rng.permutation(np.arange(1, L))
    W = 3
    if cfg["spec"]:
        sbi = rows[: n * W].reshape(n, W).astype(np.int32)
        dsbi = rows[n * W: 2 * n * W].reshape(n, W).astype(np.int32) if len(rows) >= 2 * n * W else None
        sbi[rng.random((n, W)) < 0.3] = NULL
        na = rng.integers(0, W + 1, n).astype(np.int32)
    else:
        sbi = rows[:n].astype(np.int32)
        sbi[rng.random(n) < 0.3] = NULL
        dsbi, na = None, None
    check_ssu(("reference", None), c, sbi=sbi, dsbi=dsbi, na=na,
              cu=cu if cfg["varlen"] else None, heads=cfg["heads"])


# --------------------------------------------------------------------------- #
# causal_conv1d_update
# --------------------------------------------------------------------------- #


def check_conv(flavor, x, conv_state, weight, bias, activation, rows, *, na=None, qsl=None,
               max_query_len=-1, rtol=1e-5):
    L = conv_state.shape[0]
    used = {int(r) for r in np.asarray(rows).ravel()}
    unused = [r for r in range(L) if r not in used or r == NULL]
    conv_state = poison(conv_state, unused)
    out, new_cs = run(causal_conv1d_update, flavor, x, jnp.asarray(conv_state), weight, bias,
                      activation, rows, na, qsl, max_query_len)
    out, new_cs = np.asarray(out), np.asarray(new_cs)
    assert out.shape == x.shape and out.dtype == x.dtype
    if qsl is None:
        x3 = x[..., None] if x.ndim == 2 else x
        out3 = out[..., None] if x.ndim == 2 else out
        seqs = [x3[b] for b in range(x3.shape[0])]
        spans = [(b, None) for b in range(x3.shape[0])]
    else:
        seqs = [x[qsl[b]:qsl[b + 1]].T for b in range(len(qsl) - 1)]
        spans = [(qsl[b], qsl[b + 1]) for b in range(len(qsl) - 1)]
    rows1 = [int(r) for r in (np.asarray(rows) if np.ndim(rows) == 1 else np.asarray(rows)[:, 0])]
    silu = activation in ("silu", "swish", True)
    outs, want_cs, written = oracle_conv(seqs, conv_state, weight, bias, silu, rows1, na)
    covered = np.zeros(x.shape[0], bool)
    for b, o in enumerate(outs):
        if qsl is None:
            got_b = out3[b]
            if o is None:  # null row: output untouched, equal to x bitwise
                assert np.array_equal(_bits(got_b), _bits(x3[b])), f"null row {b} output changed"
            else:
                close(got_b, o, rtol, f"out row {b}")
        else:
            s, e = spans[b]
            if o is not None:
                close(out[s:e].T, o, rtol, f"out seq {b}")
                covered[s:e] = True
    if qsl is not None:
        assert np.array_equal(_bits(out[~covered]), _bits(x[~covered])), "skipped tokens changed"
    for r in range(L):
        if r in written:
            close(new_cs[r], want_cs[r], rtol, f"conv_state row {r}")
        else:
            assert_rows_bitwise_equal(new_cs, conv_state, [r], "conv_state")
    return out, new_cs, written


@pytest.mark.parametrize("flavor", FLAVORS)
def test_conv_update_single_token_null_padding(flavor):
    rng = np.random.default_rng(10)
    dim, W, L = 6, 4, 8
    x = f32(rng, 5, dim)
    cs = f32(rng, L, dim, W - 1)
    rows = np.array([3, NULL, 6, 1, NULL], np.int32)
    _, _, written = check_conv(flavor, x, cs, f32(rng, dim, W), f32(rng, dim), "silu", rows)
    assert written == {3, 6, 1}


@pytest.mark.parametrize("flavor", FLAVORS)
def test_conv_update_seqlen_and_wide_state(flavor):
    # x [batch, dim, seqlen]; state_len > width-1: extra columns are left untouched.
    rng = np.random.default_rng(11)
    dim, W, L, q = 5, 3, 6, 3
    x = f32(rng, 3, dim, q)
    cs = f32(rng, L, dim, W + 2)
    rows = np.array([[2, 9], [NULL, 0], [4, 1]], np.int32)  # 2-D: column 0 is used
    _, new_cs, _ = check_conv(flavor, x, cs, f32(rng, dim, W), None, None, rows)
    assert np.array_equal(_bits(new_cs[2, :, W - 1:]), _bits(cs[2, :, W - 1:]))


@pytest.mark.parametrize("flavor", FLAVORS)
def test_conv_update_spec_varlen(flavor):
    rng = np.random.default_rng(12)
    dim, W, L, q = 4, 4, 8, 3
    qsl = np.array([0, 3, 3, 5, 6, 8], np.int32)  # lens 3, 0, 2, 1, 2 ; token 8 is padding
    x = f32(rng, 9, dim)
    cs = f32(rng, L, dim, W - 1 + q - 1 + 1)
    rows = np.array([5, 2, 3, NULL, 7], np.int32)
    na = np.array([1, 1, 0, 1, 3], np.int32)  # 1, 0 and max
    _, _, written = check_conv(flavor, x, cs, f32(rng, dim, W), f32(rng, dim), True, rows,
                               na=na, qsl=qsl, max_query_len=q)
    assert written == {5, 3, 7}  # row 2's sequence is empty


@pytest.mark.parametrize("flavor", FLAVORS)
def test_conv_update_spec_3d(flavor):
    rng = np.random.default_rng(13)
    dim, W, L, q = 3, 2, 6, 2
    x = f32(rng, 3, dim, q)
    cs = f32(rng, L, dim, W - 1 + q - 1)
    rows = np.array([4, 1, NULL], np.int32)
    na = np.array([2, 1, 1], np.int32)
    check_conv(flavor, x, cs, f32(rng, dim, W), f32(rng, dim), "swish", rows, na=na)


@pytest.mark.parametrize("flavor", FLAVORS)
def test_conv_update_dtype_mix_null_row_is_x(flavor):
    # bf16 state, f32 x: x is rounded to bf16 for the math (as vLLM), a null row keeps x exactly.
    rng = np.random.default_rng(14)
    dim, W, L = 4, 4, 5
    x = f32(rng, 3, dim)
    cs = f32(rng, L, dim, W - 1).astype(jnp.bfloat16)
    rows = np.array([NULL, 2, 3], np.int32)
    check_conv(flavor, x, np.asarray(cs), f32(rng, dim, W), None, "silu", rows, rtol=2e-2)


@pytest.mark.parametrize("flavor", FLAVORS)
def test_conv_update_jit_out_of_range_is_masked(flavor):
    rng = np.random.default_rng(15)
    dim, W, L = 4, 3, 5
    x = f32(rng, 3, dim)
    cs = poison(f32(rng, L, dim, W - 1), [0, 1, 3])
    w = f32(rng, dim, W)
    backend, interpret = flavor
    step = jax.jit(lambda cs, r: causal_conv1d_update(x, cs, w, None, None, r, backend=backend,
                                                        interpret=interpret))
    out, new_cs = jax.block_until_ready(step(jnp.asarray(cs), jnp.array([L + 1, 2, -2], jnp.int32)))
    assert_no_races(backend)
    out = np.asarray(out)
    assert np.array_equal(_bits(out[[0, 2]]), _bits(x[[0, 2]]))
    assert_rows_bitwise_equal(new_cs, cs, [0, 1, 3, 4], "conv_state")
    outs, want, _ = oracle_conv([x[1][:, None]], cs[[0, 2]], w, None, False, [1])
    close(out[1], outs[0][:, 0])
    close(np.asarray(new_cs)[2], want[1])


def test_conv_update_validation_errors():
    rng = np.random.default_rng(16)
    x = f32(rng, 2, 4)
    cs = f32(rng, 5, 4, 3)
    w = f32(rng, 4, 4)
    with pytest.raises(ValueError, match=r"weight must have shape \[4, \*\], got \[3, 4\]"):
        causal_conv1d_update(x, cs, f32(rng, 3, 4))
    with pytest.raises(ValueError, match=r"bias must have shape \[4\]"):
        causal_conv1d_update(x, cs, w, f32(rng, 3))
    with pytest.raises(ValueError, match="activation must be"):
        causal_conv1d_update(x, cs, w, activation="gelu")
    with pytest.raises(ValueError, match="conv_state_indices must have values.*got 5"):
        causal_conv1d_update(x, cs, w, conv_state_indices=np.array([1, 5], np.int32))
    with pytest.raises(ValueError, match="conv_state must have state_len >= 4"):
        causal_conv1d_update(f32(rng, 2, 4, 2), cs, w, conv_state_indices=np.array([1, 2]),
                             num_accepted_tokens=np.array([1, 1], np.int32))
    with pytest.raises(ValueError, match="requires conv_state_indices"):
        causal_conv1d_update(x, cs, w, query_start_loc=np.array([0, 1, 2], np.int32))
    with pytest.raises(ValueError, match="more than max_query_len=1"):
        causal_conv1d_update(f32(rng, 3, 4), cs, w, conv_state_indices=np.array([1, 2]),
                             query_start_loc=np.array([0, 1, 3], np.int32), max_query_len=1)
    with pytest.raises(ValueError, match="x must have rank 2 or 3"):
        causal_conv1d_update(f32(rng, 4), cs, w)


# --------------------------------------------------------------------------- #
# operands as Columns of one projection (read in place by the GPU kernels)
# --------------------------------------------------------------------------- #


def _projection_case(rng, T=5, H=2, P=4, G=1, N=8, W=4, L=7):
    """One Mamba decode step's operands as columns of one array, laid out as the mixer's
    projection ``[z | x B C | dt]`` with a poisoned column before and after."""
    di, conv_dim = H * P, H * P + 2 * G * N
    width = 1 + di + conv_dim + H + 1
    parent = f32(rng, T, width)
    parent[:, 0] = parent[:, -1] = np.nan  # columns no operand names: must come back unchanged
    return dict(parent=parent, T=T, H=H, P=P, G=G, N=N, W=W, L=L, di=di, conv_dim=conv_dim,
                cs=f32(rng, L, conv_dim, W - 1), weight=f32(rng, conv_dim, W), bias=f32(rng, conv_dim),
                state=f32(rng, L, H, P, N), A=-np.exp(f32(rng, H, 1, 1, scale=0.5)),
                D=f32(rng, H, 1), dt_bias=f32(rng, H, 1, scale=0.5),
                rows=np.array([3, NULL, 6, 1, 2][:T], np.int32))


@pytest.mark.parametrize("flavor", FLAVORS)
@pytest.mark.parametrize("extra_rows", [0, 1], ids=["rows", "fewer-rows"])
def test_columns_operands_match_sliced_arrays(flavor, extra_rows):
    # the conv reads x from the projection's xBC columns and writes its output there; the SSU
    # reads x, B, C from those columns and z, dt from the projection: bitwise what the same
    # kernels give for the sliced arrays, the other columns of the parent unchanged. With
    # extra_rows the parent has NaN rows after the T tokens' (a single token's projection run as
    # two rows): never read, never written.
    from pallas_kernels.mamba_common import Columns

    c = _projection_case(np.random.default_rng(40))
    T, H, P, G, N, di, conv_dim = (c[k] for k in ("T", "H", "P", "G", "N", "di", "conv_dim"))
    host = np.concatenate([c["parent"], np.full((extra_rows, c["parent"].shape[1]), np.nan, c["parent"].dtype)])
    parent = jnp.asarray(host)
    z0, x0, dt0 = 1, 1 + di, 1 + di + conv_dim

    out_cols, cs_cols = run(causal_conv1d_update, flavor, Columns(parent, x0, (T, conv_dim)), c["cs"],
                            c["weight"], c["bias"], "silu", c["rows"])
    out_arr, cs_arr = run(causal_conv1d_update, flavor, parent[:T, x0:x0 + conv_dim], c["cs"],
                          c["weight"], c["bias"], "silu", c["rows"])
    assert isinstance(out_cols, Columns) and out_cols.start == x0
    assert np.array_equal(_bits(out_cols.value()), _bits(out_arr))
    assert np.array_equal(_bits(cs_cols), _bits(cs_arr))
    new_parent = np.asarray(out_cols.parent)
    assert new_parent.shape == host.shape
    assert np.array_equal(_bits(new_parent[T:]), _bits(host[T:]))  # the rows past T
    for lo, hi in ((0, x0), (x0 + conv_dim, parent.shape[1])):
        assert np.array_equal(_bits(new_parent[:T, lo:hi]), _bits(host[:T, lo:hi])), (lo, hi)

    p = out_cols.parent
    views = dict(x=Columns(p, x0, (T, H, P)), B=Columns(p, x0 + di, (T, G, N)),
                 C=Columns(p, x0 + di + G * N, (T, G, N)), z=Columns(p, z0, (T, H, P)),
                 dt=Columns(p, dt0, (T, H, 1)))
    # A: one column of an [H, layers] table of rates
    table = jnp.concatenate([jnp.full((H, 1), jnp.nan), jnp.asarray(c["A"]).reshape(H, 1), jnp.full((H, 1), jnp.nan)], 1)
    views["A"] = Columns(table, 1, (H, 1, 1))
    arrays = {k: v.value() for k, v in views.items()}
    # block_m 2 < P: each head's rows are read in two blocks (the column offset of the second)
    kw = dict(D=c["D"], dt_bias=c["dt_bias"], dt_softplus=True, state_batch_indices=c["rows"],
              config=SSUConfig(gpu_block_m=2))
    got = run(selective_state_update, flavor, c["state"], views["x"], views["dt"], views["A"], views["B"],
              views["C"], z=views["z"], **kw)
    want = run(selective_state_update, flavor, c["state"], arrays["x"], arrays["dt"], arrays["A"], arrays["B"],
               arrays["C"], z=arrays["z"], **kw)
    for g, w, what in zip(got, want, ("out", "state")):
        assert np.array_equal(_bits(g), _bits(w)), what
    assert np.isfinite(np.asarray(got[0])).all()  # the poisoned columns were never read


def test_columns_errors():
    from pallas_kernels.mamba_common import Columns

    c = _projection_case(np.random.default_rng(41))
    parent = jnp.asarray(c["parent"])
    T = c["T"]
    with pytest.raises(ValueError, match=r"Columns \[33, 37\) must lie within the parent's 36 columns"):
        Columns(parent, 33, (T, 4))
    for bad in ((T + 1, 4), (float(T), 4), (T, True), (T, 0)):
        with pytest.raises(ValueError, match=r"Columns shape must be \[rows <= 5, \.\.\.\] of positive ints"):
            Columns(parent, 0, bad)
    # JAX rebuilds a Columns without the checks: one can come out of vmap (a batched parent)
    stacked = jnp.stack([parent, parent])
    out = jax.vmap(lambda q: Columns(q, 1, (T, 4, 2)))(stacked)
    assert out.parent.shape == (2,) + parent.shape and out.start == 1 and out.shape == (T, 4, 2)
    with pytest.raises(ValueError, match=r"Columns parent must have rank 2"):
        Columns(parent[None], 0, (1, 4))
    x3 = Columns(parent, 1, (T, 4, 2))
    with pytest.raises(ValueError, match=r"x given as Columns must be 2-D"):
        causal_conv1d_update(x3, c["cs"][:, :4], c["weight"][:4], activation="silu")
    with pytest.raises(ValueError, match=r"D cannot be given as Columns"):
        selective_state_update(c["state"], x3, x3, c["A"], x3, x3, D=Columns(parent, 0, (T, 1)))


# --------------------------------------------------------------------------- #
# prefill: selective_scan_varlen and causal_conv1d_varlen
# --------------------------------------------------------------------------- #


SCAN_BACKENDS = [
    pytest.param(("reference", 64), id="token-scan"),
    pytest.param(("pallas_gpu", 4), id="chunked-4"),
    pytest.param(("pallas", 64), id="chunked-64"),
]


def scan_case(rng, T=14, H=2, P=3, N=4, G=1, L=9):
    return dict(
        x=f32(rng, T, H, P), dt=f32(rng, T, H, scale=0.5), A=-np.exp(f32(rng, H, scale=0.5)),
        B=f32(rng, T, G, N), C=f32(rng, T, G, N), D=f32(rng, H), dt_bias=f32(rng, H, scale=0.5),
        z=f32(rng, T, H, P), state=f32(rng, L, H, P, N))


@pytest.mark.parametrize("backend", SCAN_BACKENDS)
def test_scan_fresh_start_null_skip_padding(backend):
    rng = np.random.default_rng(20)
    c = scan_case(rng)
    # requests: fresh (slot holds NaN), cached, null, empty, cached; tokens 12, 13 are padding
    qsl = np.array([0, 5, 7, 9, 9, 12], np.int32)
    ci = np.array([3, 5, NULL, 7, 1], np.int32)
    his = np.array([False, True, True, True, True])
    state = poison(c["state"], [0, 2, 3, 4, 6, 8])  # slot 3 belongs to a fresh request
    be, chunk = backend
    out, new_state = selective_scan_varlen(
        c["x"], c["dt"], c["A"], c["B"], c["C"], jnp.asarray(state), qsl, ci, his, D=c["D"],
        dt_bias=c["dt_bias"], z=c["z"], dt_softplus=True, chunk_size=chunk, backend=be)
    out, new_state = np.asarray(out), np.asarray(new_state)
    want, want_state, written = oracle_scan(c["x"], c["dt"], c["A"], c["B"], c["C"], state, qsl, ci,
                                            his, c["D"], c["dt_bias"], c["z"], True)
    assert written == {3, 5, 1}
    assert np.isfinite(out).all() and np.isfinite(new_state[3]).all()
    close(out, want)
    assert not out[7:9].any() and not out[12:].any(), "null-row and pad outputs must be zero"
    for r in range(state.shape[0]):
        if r in written:
            close(new_state[r], want_state[r], what=f"state row {r}")
        else:
            assert_rows_bitwise_equal(new_state, state, [r])


@pytest.mark.parametrize("backend", SCAN_BACKENDS[:2])
def test_scan_grouped_bf16_state_D_per_dim(backend):
    rng = np.random.default_rng(21)
    c = scan_case(rng, T=9, H=4, G=2, L=6)
    c["D"] = f32(rng, 4, 3)
    state = np.asarray(jnp.asarray(c["state"]).astype(jnp.bfloat16))
    qsl = np.array([0, 4, 9], np.int32)
    ci = np.array([2, 4], np.int32)
    his = np.array([True, False])
    be, chunk = backend
    out, new_state = selective_scan_varlen(c["x"], c["dt"], c["A"], c["B"], c["C"], state, qsl, ci,
                                           his, D=c["D"], chunk_size=chunk, backend=be)
    want, want_state, _ = oracle_scan(c["x"], c["dt"], c["A"], c["B"], c["C"], state, qsl, ci, his, c["D"])
    close(out, want, rtol=1e-4)
    close(np.asarray(new_state)[[2, 4]], want_state[[2, 4]], rtol=1e-2)
    assert_rows_bitwise_equal(new_state, state, [0, 1, 3, 5])


@pytest.mark.parametrize("backend", SCAN_BACKENDS[:2])
def test_scan_jit_out_of_range_is_masked(backend):
    rng = np.random.default_rng(22)
    c = scan_case(rng, T=6, L=5)
    state = poison(c["state"], [0, 1, 3, 4])
    be, chunk = backend
    f = jax.jit(lambda s, ci: selective_scan_varlen(
        c["x"], c["dt"], c["A"], c["B"], c["C"], s, np.array([0, 2, 4, 6], np.int32), ci,
        np.array([True, True, False]), chunk_size=chunk, backend=be))
    out, new_state = f(jnp.asarray(state), jnp.array([9, -1, 2], jnp.int32))
    out = np.asarray(out)
    assert not out[:4].any()
    want, want_state, _ = oracle_scan(c["x"], c["dt"], c["A"], c["B"], c["C"], state,
                                      [0, 2, 4, 6], [0, 0, 2], [True, True, False])
    close(out, want)
    close(np.asarray(new_state)[2], want_state[2])
    assert_rows_bitwise_equal(new_state, state, [0, 1, 3, 4])


@pytest.mark.parametrize("backend", SCAN_BACKENDS[:2])
def test_scan_nan_state_does_not_reach_next_request(backend):
    # Request 0 starts from a cached state that is all NaN (its own outputs are NaN);
    # requests 1 and 2 (several chunks each at chunk 4) must not see any of it.
    rng = np.random.default_rng(25)
    c = scan_case(rng, T=14, L=6)
    state = c["state"].copy()
    state[2] = np.nan
    qsl = np.array([0, 5, 10, 14], np.int32)
    ci = np.array([2, 4, 1], np.int32)
    his = np.array([True, True, False])
    be, chunk = backend
    out, new_state = selective_scan_varlen(
        c["x"], c["dt"], c["A"], c["B"], c["C"], jnp.asarray(state), qsl, ci, his, D=c["D"],
        chunk_size=chunk, backend=be)
    out, new_state = np.asarray(out), np.asarray(new_state)
    want, want_state, _ = oracle_scan(c["x"], c["dt"], c["A"], c["B"], c["C"], state, qsl, ci, his,
                                      c["D"])
    assert np.isnan(out[:5]).all() and np.isnan(new_state[2]).all()
    assert np.isfinite(out[5:]).all(), "a NaN state leaked into a later request"
    close(out[5:], want[5:])
    close(new_state[[4, 1]], want_state[[4, 1]])
    assert_rows_bitwise_equal(new_state, state, [0, 3, 5])


def test_scan_decode_heavy_batch_adapts_chunk():
    # 12 one-token requests (and one of 3) in 15 tokens: chunk_size 128 shrinks to 16 tokens
    # per chunk (padded work T + R * Q, not R * 128); the result is the oracle's.
    assert _chunk_len(128, 256, 256) == 16 and _chunk_len(128, 2048, 8) == 128
    assert _chunk_len(128, 4096, 64) == 64 and _chunk_len(4, 15, 13) == 4
    rng = np.random.default_rng(26)
    c = scan_case(rng, T=16, L=16)
    qsl = np.array(list(range(13)) + [15], np.int32)
    ci = np.arange(1, 14, dtype=np.int32)
    his = np.arange(13) % 2 == 0
    out, new_state = selective_scan_varlen(
        c["x"], c["dt"], c["A"], c["B"], c["C"], jnp.asarray(c["state"]), qsl, ci, his,
        D=c["D"], dt_bias=c["dt_bias"], z=c["z"], dt_softplus=True, backend="pallas_gpu")
    want, want_state, written = oracle_scan(c["x"], c["dt"], c["A"], c["B"], c["C"], c["state"], qsl,
                                            ci, his, c["D"], c["dt_bias"], c["z"], True)
    close(np.asarray(out), want)
    close(np.asarray(new_state)[sorted(written)], want_state[sorted(written)])


@pytest.mark.parametrize("chunk", [4, 128])
def test_scan_max_sequences_bounds_the_chunk_table(chunk):
    """A mixed step's prefill path: 8 rows, of which 2 prefill (valid slots) and the rest are
    decode or padding rows (NULL slots, one token each). With ``max_sequences=2`` the chunked
    form sizes its table for 2 sequences (and its chunks by T / 2); the outputs and states are
    the oracle's, as with no bound. Planted: the table without its per-sequence term
    (``NC = ceil(T / Q)``) fails here (5 + 9 tokens need 5 chunks of 4, the table had 4)."""
    rng = np.random.default_rng(27)
    c = scan_case(rng, T=16, L=10)
    qsl = np.array([0, 1, 6, 7, 16, 16, 16, 16, 16], np.int32)  # rows 1 and 3 prefill 5 and 9 tokens
    ci = np.array([NULL, 3, NULL, 5, NULL, NULL, NULL, NULL], np.int32)
    his = np.array([False, True, False, False, False, False, False, False])
    outs = {}
    for bound in (None, 2):
        out, st = selective_scan_varlen(
            c["x"], c["dt"], c["A"], c["B"], c["C"], jnp.asarray(c["state"]), qsl, ci, his, D=c["D"],
            dt_bias=c["dt_bias"], z=c["z"], dt_softplus=True, chunk_size=chunk, max_sequences=bound,
            backend="pallas_gpu")
        outs[bound] = (np.asarray(out), np.asarray(st))
    want, want_state, written = oracle_scan(c["x"], c["dt"], c["A"], c["B"], c["C"], c["state"], qsl, ci,
                                            his, c["D"], c["dt_bias"], c["z"], True)
    assert written == {3, 5}
    for out, st in outs.values():
        close(out, want)
        close(st[[3, 5]], want_state[[3, 5]])
        assert_rows_bitwise_equal(st, c["state"], [0, 1, 2, 4, 6, 7, 8, 9])
    with pytest.raises(ValueError, match="max_sequences"):
        selective_scan_varlen(c["x"], c["dt"], c["A"], c["B"], c["C"], c["state"], qsl, ci, his,
                              max_sequences=0, backend="pallas_gpu")


def test_scan_validation_errors():
    rng = np.random.default_rng(23)
    c = scan_case(rng, T=4, L=4)
    a = (c["x"], c["dt"], c["A"], c["B"], c["C"], c["state"])
    qsl, ci, his = np.array([0, 4], np.int32), np.array([1], np.int32), np.array([True])
    with pytest.raises(ValueError, match=r"cache_indices must have values in \[0, 4\).*got 4"):
        selective_scan_varlen(*a, qsl, np.array([4], np.int32), his)
    with pytest.raises(ValueError, match=r"dt must have shape \[4, 2\]"):
        selective_scan_varlen(c["x"], c["dt"][:, :1], *a[2:], qsl, ci, his)
    with pytest.raises(ValueError, match=r"cache_indices must have at least .*>= 2 entries\), got shape \[1\]"):
        selective_scan_varlen(*a, np.array([0, 2, 4], np.int32), ci, his)
    with pytest.raises(ValueError, match=r"query_start_loc must have values in \[0, 5\)"):
        selective_scan_varlen(*a, np.array([0, 5], np.int32), ci, his)
    with pytest.raises(ValueError, match=r"state must have shape \[\*, 2, 3, 4\]"):
        selective_scan_varlen(*a[:5], c["state"][:, :1], qsl, ci, his)


def test_scan_bf16_products_kernel_matches_jnp_chunked_form():
    """``dot_dtype=bf16``: the GPU kernels (interpreted) round the same product operands as the jnp
    chunked form (x, B, C, the intra-chunk weights, the entering states), so the two agree to
    float32 summation order, while both sit a bf16 rounding away from the float32 token scan.
    Three requests over several chunks (one with a cached state), a null row, padding; the
    untouched state rows stay bitwise. Planted: the kernels' products taking unrounded float32
    operands moves them off the jnp form and fails the 1e-4 check."""
    rng = np.random.default_rng(31)
    c = scan_case(rng, T=24, H=4, P=16, N=16, G=2, L=8)
    qsl = np.array([0, 9, 11, 20, 22], np.int32)
    ci = np.array([2, NULL, 5, 6], np.int32)
    his = np.array([True, True, False, True])
    state = poison(c["state"], [0, 1, 3, 4, 7])
    args = (c["x"], c["dt"], c["A"], c["B"], c["C"], jnp.asarray(state), qsl, ci, his)
    kw = dict(D=c["D"], dt_bias=c["dt_bias"], z=c["z"], dt_softplus=True, chunk_size=4)
    got, got_state = selective_scan_varlen(*args, dot_dtype=jnp.bfloat16, backend="pallas_gpu", **kw)
    jnp_out, jnp_state = selective_scan_varlen(*args, dot_dtype=jnp.bfloat16, backend="pallas_tpu", **kw)
    exact, exact_state = selective_scan_varlen(*args, backend="reference", **kw)
    got, got_state = np.asarray(got), np.asarray(got_state)
    close(got, np.asarray(jnp_out), rtol=1e-4)
    close(got_state[[2, 5, 6]], np.asarray(jnp_state)[[2, 5, 6]], rtol=1e-4)
    err = np.max(np.abs(got - np.asarray(exact))) / np.max(np.abs(np.asarray(exact)))
    assert 1e-5 < err < 3e-2, f"bf16 products should differ from the float32 scan by a bf16 rounding, got {err:.1e}"
    assert not got[9:11].any() and not got[22:].any(), "null-row and pad outputs must be zero"
    assert_rows_bitwise_equal(got_state, state, [0, 1, 3, 4, 7])


def test_scan_dot_dtype_and_config_errors():
    rng = np.random.default_rng(32)
    c = scan_case(rng, T=4, L=4)
    a = (c["x"], c["dt"], c["A"], c["B"], c["C"], c["state"], np.array([0, 4], np.int32),
         np.array([1], np.int32), np.array([True]))
    with pytest.raises(ValueError, match=r"dot_dtype must be None, jnp.bfloat16 or jnp.float16, got .*float32"):
        selective_scan_varlen(*a, dot_dtype=jnp.float32)
    with pytest.raises(ValueError, match=r"dot_dtype must be None, jnp.bfloat16 or jnp.float16, got 5"):
        selective_scan_varlen(*a, dot_dtype=5)
    with pytest.raises(ValueError, match=r"config must be a ScanConfig"):
        selective_scan_varlen(*a, config={"gpu_block_q": 64})
    with pytest.raises(ValueError, match=r"gpu_block_q must be a power of two, got 48"):
        ScanConfig(gpu_block_q=48)
    with pytest.raises(ValueError, match=r"gpu_num_warps must be a power of two, got 0"):
        ScanConfig(gpu_num_warps=0)


@pytest.mark.parametrize("activation", [None, "silu"])
def test_conv_varlen_fresh_start_null_skip(activation):
    rng = np.random.default_rng(24)
    dim, W, L, T = 5, 4, 7, 13
    x = f32(rng, dim, T)
    w = f32(rng, dim, W)
    bias = f32(rng, dim)
    cs = f32(rng, L, dim, W + 1)
    qsl = np.array([0, 2, 8, 10, 10, 11], np.int32)  # short, long, null, empty, 1 token; 11.. pad
    ci = np.array([2, 4, NULL, 5, 6], np.int32)
    his = np.array([True, False, True, True, False])
    cs = poison(cs, [0, 1, 3, 4, 5])  # row 4: fresh request's slot holds NaN
    out, new_cs = causal_conv1d_varlen(x, w, bias, jnp.asarray(cs), qsl, ci, his, activation)
    out, new_cs = np.asarray(out), np.asarray(new_cs)
    want, want_cs, written, done = oracle_conv_varlen(x, w, bias, cs, qsl, ci, his, activation == "silu")
    assert written == {2, 4, 6}
    close(out[:, done], want[:, done])
    assert np.array_equal(_bits(out[:, ~done]), _bits(x[:, ~done])), "skipped tokens must keep x"
    for r in range(L):
        if r in written:
            close(new_cs[r, :, :W - 1], want_cs[r, :, :W - 1])
            assert np.array_equal(_bits(new_cs[r, :, W - 1:]), _bits(cs[r, :, W - 1:]))
        else:
            assert_rows_bitwise_equal(new_cs, cs, [r], "conv_state")


def test_conv_varlen_validation_errors():
    rng = np.random.default_rng(25)
    x, w, cs = f32(rng, 4, 6), f32(rng, 4, 3), f32(rng, 3, 4, 2)
    qsl, ci, his = np.array([0, 6], np.int32), np.array([1], np.int32), np.array([True])
    with pytest.raises(ValueError, match="cache_indices must have values.*got 3"):
        causal_conv1d_varlen(x, w, None, cs, qsl, np.array([3], np.int32), his)
    with pytest.raises(ValueError, match="conv_states must have state_len >= width-1 = 3"):
        causal_conv1d_varlen(x, f32(rng, 4, 4), None, cs, qsl, ci, his)
    with pytest.raises(ValueError, match=r"has_initial_state must have at least .*>= 1 entries\), got shape \[0\]"):
        causal_conv1d_varlen(x, w, None, cs, qsl, ci, np.zeros((0,), bool))
    with pytest.raises(ValueError, match=r"cache_indices must have at least .*>= 2 entries\), got shape \[1\]"):
        causal_conv1d_varlen(x, w, None, cs, np.array([0, 3, 6], np.int32), ci, his)


@pytest.mark.parametrize("op", ["conv", "scan"])
def test_varlen_more_cache_indices_than_sequences(op):
    """vLLM's varlen batch is ``query_start_loc``'s: ``cache_indices`` / ``has_initial_state``
    may be longer (vLLM's tests pass 10 or 13 for 8 sequences); the extra entries are padding.
    They name real rows here, which must stay bitwise unchanged; the result equals the call
    with the arrays cut to the sequences."""
    rng = np.random.default_rng(26)
    qsl = np.array([0, 2, 5, 6], np.int32)
    ci_short, his_short = np.array([3, 1, 4], np.int32), np.array([True, False, True])
    ci_long = np.array([3, 1, 4, 2, 5, 6], np.int32)  # rows 2, 5, 6: padding entries
    his_long = np.array([True, False, True, True, True, False])
    if op == "conv":
        x, w, cs = f32(rng, 4, 8), f32(rng, 4, 3), f32(rng, 7, 4, 2)
        run = lambda ci, his: causal_conv1d_varlen(x, w, None, jnp.asarray(cs), qsl, ci, his)
        pool = cs
    else:
        c = scan_case(rng, T=8, L=7)
        a = (c["x"], c["dt"], c["A"], c["B"], c["C"], jnp.asarray(c["state"]))
        run = lambda ci, his: selective_scan_varlen(*a, qsl, ci, his)
        pool = c["state"]
    out_s, pool_s = run(ci_short, his_short)
    out_l, pool_l = run(ci_long, his_long)
    assert np.array_equal(_bits(np.asarray(out_l)), _bits(np.asarray(out_s)))
    assert np.array_equal(_bits(np.asarray(pool_l)), _bits(np.asarray(pool_s)))
    assert_rows_bitwise_equal(np.asarray(pool_l), pool, [0, 2, 5, 6], "state pool")


# --------------------------------------------------------------------------- #
# torch differential (kvjax.testing.torch_ref.mamba)
# --------------------------------------------------------------------------- #


def _torch_ref():
    torch = pytest.importorskip("torch")
    from kvjax.testing.torch_ref import mamba as tref

    return torch, tref


@pytest.mark.parametrize("spec", [False, True])
def test_torch_differential_ssu(spec):
    torch, tref = _torch_ref()
    rng = np.random.default_rng(30)
    c = ssu_case(rng, T=6, H=4, G=2, L=14, P=3, N=5)
    state = poison(c["state"], [0])
    if spec:
        cu = np.array([0, 2, 5, 6], np.int32)
        sbi = np.array([[1, 2, 0], [3, 0, 0], [0, 0, 0]], np.int32)
        dsbi = np.array([[4, 5, 0], [6, 0, 7], [0, 0, 0]], np.int32)
        na = np.array([2, 0, 1], np.int32)
    else:
        cu, dsbi, na = None, None, None
        sbi = np.array([5, 0, 9, 2, 11, 0], np.int32)
    out, new_state = selective_state_update(
        jnp.asarray(state), c["x"], c["dt"], c["A"], c["B"], c["C"], c["D"], c["dt_bias"], c["z"],
        True, sbi, dsbi, NULL, na, cu, backend="reference")
    t = {k: torch.from_numpy(np.asarray(v)) for k, v in c.items()}
    tstate = torch.from_numpy(state.copy())
    tout, tstate = tref.selective_state_update(
        tstate, t["x"], t["dt"], t["A"], t["B"], t["C"], t["D"], t["dt_bias"], t["z"], True,
        torch.from_numpy(sbi), None if dsbi is None else torch.from_numpy(dsbi), NULL,
        None if na is None else torch.from_numpy(na), None if cu is None else torch.from_numpy(cu))
    close(out, tout.numpy())
    np.testing.assert_allclose(np.asarray(new_state), tstate.numpy(), rtol=1e-5, atol=1e-5)
    assert np.array_equal(_bits(np.asarray(new_state)[0]), _bits(state[0]))


@pytest.mark.parametrize("mode", ["2d", "3d-spec", "varlen-spec"])
def test_torch_differential_conv_update(mode):
    torch, tref = _torch_ref()
    rng = np.random.default_rng(31)
    dim, W, L = 6, 4, 9
    w, bias = f32(rng, dim, W), f32(rng, dim)
    rows = np.array([3, 0, 5, 8], np.int32)
    qsl = na = None
    if mode == "2d":
        x, cs = f32(rng, 4, dim), f32(rng, L, dim, W - 1)
    elif mode == "3d-spec":
        x, cs = f32(rng, 4, dim, 2), f32(rng, L, dim, W)
        na = np.array([1, 1, 2, 0], np.int32)
    else:
        x, cs = f32(rng, 7, dim), f32(rng, L, dim, W + 1)
        qsl = np.array([0, 2, 3, 3, 6], np.int32)
        na = np.array([3, 1, 2, 1], np.int32)
    cs = poison(cs, [0])
    out, new_cs = causal_conv1d_update(x, jnp.asarray(cs), w, bias, "silu", rows, na, qsl,
                                       3 if qsl is not None else -1, backend="reference")
    T = lambda v: None if v is None else torch.from_numpy(np.asarray(v))  # noqa: E731
    tout, tcs = tref.causal_conv1d_update(T(x), T(cs.copy()), T(w), T(bias), "silu", T(rows),
                                          T(na), T(qsl))
    close(out, tout.numpy())
    np.testing.assert_allclose(np.asarray(new_cs), tcs.numpy(), rtol=1e-5, atol=1e-5)


def test_torch_differential_prefill():
    torch, tref = _torch_ref()
    rng = np.random.default_rng(32)
    c = scan_case(rng, T=10, H=2, G=2, L=6)
    state = poison(c["state"], [0, 4])
    qsl = np.array([0, 3, 3, 7, 9], np.int32)
    ci = np.array([1, 2, 0, 4], np.int32)
    his = np.array([True, True, False, False])
    out, new_state = selective_scan_varlen(
        c["x"], c["dt"], c["A"], c["B"], c["C"], jnp.asarray(state), qsl, ci, his, c["D"],
        c["dt_bias"], c["z"], True, backend="pallas")
    t = {k: torch.from_numpy(np.asarray(v)) for k, v in c.items()}
    tout, tstate = tref.selective_scan_varlen(
        t["x"], t["dt"], t["A"], t["B"], t["C"], torch.from_numpy(state.copy()),
        torch.from_numpy(qsl), torch.from_numpy(ci), torch.from_numpy(his), t["D"], t["dt_bias"],
        t["z"], True)
    close(out, tout.numpy())
    np.testing.assert_allclose(np.asarray(new_state), tstate.numpy(), rtol=1e-5, atol=1e-5)
    # conv prefill
    dim, W = 5, 3
    x, w, bias = f32(rng, dim, 10), f32(rng, dim, W), f32(rng, dim)
    cs = poison(f32(rng, 6, dim, W - 1), [0, 4])
    out, new_cs = causal_conv1d_varlen(x, w, bias, jnp.asarray(cs), qsl, ci, his, "silu")
    tout, tcs = tref.causal_conv1d_varlen(torch.from_numpy(x), torch.from_numpy(w),
                                          torch.from_numpy(bias), torch.from_numpy(cs.copy()),
                                          torch.from_numpy(qsl), torch.from_numpy(ci),
                                          torch.from_numpy(his), "silu")
    close(out, tout.numpy())
    np.testing.assert_allclose(np.asarray(new_cs), tcs.numpy(), rtol=1e-5, atol=1e-5)


def test_public_names():
    for name in ("selective_state_update", "causal_conv1d_update", "selective_scan_varlen",
                 "causal_conv1d_varlen", "selective_state_update_reference",
                 "causal_conv1d_update_reference", "selective_scan_varlen_reference"):
        assert callable(getattr(mamba, name)), name
    import inspect

    params = list(inspect.signature(selective_state_update).parameters)
    assert params[:15] == ["state", "x", "dt", "A", "B", "C", "D", "dt_bias", "z", "dt_softplus",
                           "state_batch_indices", "dst_state_batch_indices", "null_block_id",
                           "num_accepted_tokens", "cu_seqlens"]
    params = list(inspect.signature(causal_conv1d_update).parameters)
    assert params[:10] == ["x", "conv_state", "weight", "bias", "activation", "conv_state_indices",
                           "num_accepted_tokens", "query_start_loc", "max_query_len", "null_block_id"]


def test_scan_config_variants_agree_with_the_reference():
    """The chunked form's knobs (ScanConfig) change how, never what."""
    from pallas_kernels.mamba_scan import ScanConfig, selective_scan_varlen

    rng = np.random.default_rng(7)
    T, H, P, N, L = 11, 2, 4, 4, 4
    x = jnp.asarray(rng.standard_normal((T, H, P)), jnp.float32)
    dt = jnp.asarray(rng.uniform(0.1, 0.5, (T, H)), jnp.float32)
    A = -jnp.asarray(rng.uniform(0.5, 1.5, (H,)), jnp.float32)
    B = jnp.asarray(rng.standard_normal((T, 1, N)), jnp.float32)
    C = jnp.asarray(rng.standard_normal((T, 1, N)), jnp.float32)
    state = jnp.asarray(rng.standard_normal((L, H, P, N)), jnp.float32)
    args = (x, dt, A, B, C, state, jnp.array([0, 4, 5, 11]), jnp.array([1, 2, 3]),
            jnp.array([True, False, True]))
    ref_out, ref_state = selective_scan_varlen(*args, backend="reference")
    for cfg in (ScanConfig(), ScanConfig(adapt_chunk=False, chunk_states="sequential")):
        out, st = selective_scan_varlen(*args, chunk_size=4, config=cfg, backend="pallas_gpu")
        np.testing.assert_allclose(out, ref_out, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(st, ref_state, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="chunk_states"):
        ScanConfig(chunk_states="parallel")
