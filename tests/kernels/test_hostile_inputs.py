"""Hostile integer inputs to every op: ids beyond int32, malformed offsets, bad scales.

Concrete values -> ``ValueError`` naming the argument; traced values -> masked (the
op writes nothing for them), identically on every backend, with and without
``JAX_ENABLE_X64`` (the x64 half runs in one small subprocess).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.testing.asserts import assert_bitwise
from pallas_kernels import (
    causal_conv1d_update,
    causal_conv1d_varlen,
    combine_sampled_and_draft_tokens,
    reshape_and_cache_flash,
    selective_scan_varlen,
    selective_state_update,
)

BACKENDS = ("reference", "pallas_tpu", "pallas_gpu")
BIG = 2**32 + 1  # wraps to row 1 when narrowed to int32
f32 = np.float32


def _poison_state(shape):
    # Finite and unlike any value an op writes here: a stray write changes the bits
    # (a NaN poison would not show a write computed from a NaN row).
    return np.full(shape, 7.0, f32)


def _ssu_args(T=2, L=4):
    x = np.ones((T, 1, 2), f32)
    return dict(state=_poison_state((L, 1, 2, 2)), x=x, dt=x, A=-np.ones((1, 2, 2), f32),
                B=np.ones((T, 1, 2), f32), C=np.ones((T, 1, 2), f32))


def _conv_args(T=2, L=4):
    return dict(x=np.ones((T, 2), f32), conv_state=_poison_state((L, 2, 3)),
                weight=np.ones((2, 4), f32))


def _scan_args(T=2, L=4):
    x = np.ones((T, 1, 2), f32)
    return dict(x=x, dt=np.ones((T, 1), f32), A=-np.ones((1,), f32), B=np.ones((T, 1, 2), f32),
                C=np.ones((T, 1, 2), f32), state=_poison_state((L, 1, 2, 2)))


# --------------------------------------------------------------------------
# item 3: int64 ids beyond int32, concrete -> ValueError
# --------------------------------------------------------------------------


def _concrete_cases():
    i64 = lambda *v: np.array(v, np.int64)  # noqa: E731
    s, c, sc = _ssu_args(T=1), _conv_args(T=1), _scan_args(T=1)
    cv = dict(x=np.ones((2, 1), f32), weight=np.ones((2, 4), f32), bias=None,
              conv_states=_poison_state((4, 2, 3)))
    comb = dict(input_ids=np.zeros((2,), np.int32), idx_mapping=np.array([0], np.int32),
                last_sampled_tokens=np.array([7], np.int32),
                query_start_loc=np.array([0, 2], np.int32), seq_lens=np.array([5], np.int32),
                prefill_len=np.array([3], np.int32), draft_tokens=np.zeros((1, 0), np.int32),
                cu_num_logits=np.array([0, 1], np.int32), num_logits=1)
    return {
        "ssu-state_batch_indices": ("state_batch_indices", lambda: selective_state_update(
            **s, state_batch_indices=i64(BIG), backend="reference")),
        "ssu-dst_state_batch_indices": ("dst_state_batch_indices", lambda: selective_state_update(
            **s, state_batch_indices=i64(2), dst_state_batch_indices=i64(BIG),
            backend="reference")),
        "conv-conv_state_indices": ("conv_state_indices", lambda: causal_conv1d_update(
            **c, conv_state_indices=i64(BIG), backend="reference")),
        "scan-cache_indices": ("cache_indices", lambda: selective_scan_varlen(
            **sc, query_start_loc=i64(0, 1), cache_indices=i64(BIG),
            has_initial_state=np.array([True]), backend="reference")),
        "conv_varlen-cache_indices": ("cache_indices", lambda: causal_conv1d_varlen(
            **cv, query_start_loc=i64(0, 1), cache_indices=i64(BIG),
            has_initial_state=np.array([True]), backend="reference")),
        "combine-idx_mapping": ("idx_mapping", lambda: combine_sampled_and_draft_tokens(
            **{**comb, "idx_mapping": i64(2**32)}, backend="reference")),
        "combine-seq_lens": ("seq_lens", lambda: combine_sampled_and_draft_tokens(
            **{**comb, "seq_lens": i64(2**32 + 5)}, backend="reference")),
        "combine-last_sampled_tokens": ("last_sampled_tokens", lambda:
            combine_sampled_and_draft_tokens(**{**comb, "last_sampled_tokens": i64(2**32 + 7)},
                                             backend="reference")),
    }


@pytest.mark.parametrize("case", sorted(_concrete_cases()))
def test_concrete_int64_beyond_int32_is_a_value_error(case):
    name, call = _concrete_cases()[case]
    with pytest.raises(ValueError, match=name):
        call()


# --------------------------------------------------------------------------
# item 4: malformed offsets under jit are masked the same way by every backend
# --------------------------------------------------------------------------

# T = 2 tokens. [0, 1, 5]: sequence 1 ends past T. [0, 1, 0]: sequence 1 decreases.
# [0, 1, -1]: a negative offset. Only sequence 0 (token 0 -> row 2) is real in each.
MALFORMED = ([0, 1, 5], [0, 1, 0], [0, 1, -1])


def _ssu_expected():
    a = _ssu_args()
    out, st = selective_state_update(**{**a, "x": a["x"][:1], "dt": a["dt"][:1],
                                        "B": a["B"][:1], "C": a["C"][:1]},
                                     state_batch_indices=np.array([2], np.int32),
                                     backend="reference")
    return np.concatenate([np.asarray(out), np.zeros((1, 1, 2), f32)]), np.asarray(st)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ssu_malformed_cu_seqlens_traced(backend):
    a = _ssu_args()
    fn = jax.jit(lambda st, cu: selective_state_update(
        st, a["x"], a["dt"], a["A"], a["B"], a["C"], state_batch_indices=np.array([2, 1]),
        cu_seqlens=cu, backend=backend))
    want_out, want_st = _ssu_expected()
    for cu in MALFORMED:
        out, st = fn(a["state"], np.array(cu, np.int32))
        assert_bitwise(st, want_st, f"state ({backend}, cu={cu})")
        assert_bitwise(out, want_out, f"out ({backend}, cu={cu})")


@pytest.mark.parametrize("backend", BACKENDS)
def test_conv_malformed_query_start_loc_traced(backend):
    a = _conv_args()
    fn = jax.jit(lambda cs, q: causal_conv1d_update(
        a["x"], cs, a["weight"], conv_state_indices=np.array([2, 1], np.int32),
        query_start_loc=q, max_query_len=2, backend=backend))
    want_out, want_cs = causal_conv1d_update(
        a["x"][:1], a["conv_state"], a["weight"], conv_state_indices=np.array([2], np.int32),
        backend="reference")
    for qsl in MALFORMED:
        out, cs = fn(a["conv_state"], np.array(qsl, np.int32))
        assert_bitwise(cs, want_cs, f"conv_state ({backend}, {qsl})")
        assert_bitwise(np.asarray(out)[:1], want_out, f"out ({backend}, {qsl})")
        assert_bitwise(np.asarray(out)[1:], a["x"][1:], f"unnamed token keeps x ({backend})")


@pytest.mark.parametrize("backend", ("reference", "pallas_gpu"))  # token scan, chunked form
def test_varlen_malformed_query_start_loc_traced(backend):
    s, c = _scan_args(), _conv_args()
    ci, his = np.array([2, 1], np.int32), np.array([False, True])
    x = np.ones((2, 2), f32)
    scan = jax.jit(lambda st, q: selective_scan_varlen(
        s["x"], s["dt"], s["A"], s["B"], s["C"], st, q, ci, his, backend=backend))
    conv = jax.jit(lambda cs, q: causal_conv1d_varlen(
        x, c["weight"], None, cs, q, ci, his, backend=backend))
    one, ref_in = np.array([0, 1], np.int32), {k: v[:1] for k, v in s.items() if k != "state"}
    want_out, want_st = selective_scan_varlen(
        **ref_in, state=s["state"], query_start_loc=one, cache_indices=ci[:1],
        has_initial_state=his[:1], backend="reference")
    want_cout, want_cs = causal_conv1d_varlen(
        x[:, :1], c["weight"], None, c["conv_state"], one, ci[:1], his[:1], backend="reference")
    for qsl in MALFORMED:
        out, st = scan(s["state"], np.array(qsl, np.int32))
        assert_bitwise(st, want_st, f"state ({backend}, {qsl})")
        np.testing.assert_allclose(np.asarray(out)[:1], want_out, rtol=1e-6)
        assert not np.asarray(out)[1:].any()
        out, cs = conv(c["conv_state"], np.array(qsl, np.int32))
        assert_bitwise(cs, want_cs, f"conv_states ({backend}, {qsl})")
        assert_bitwise(np.asarray(out)[:, :1], want_cout, f"conv out ({backend}, {qsl})")


# --------------------------------------------------------------------------
# item 7: fp8 scales, negative seq_lens
# --------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [np.nan, 0.0, -1.0, np.inf, 1e-45, 1e-39], ids=str)
def test_fp8_scale_must_be_a_positive_normal_float(bad):
    k = np.ones((1, 1, 16), f32)
    cache = np.zeros((2, 2, 1, 16), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="k_scale must be finite and > 0"):
        reshape_and_cache_flash(k, k, cache, cache, np.array([2], np.int32), "fp8",
                                np.float32(bad), np.float32(1.0), backend="reference")


def test_combine_negative_seq_lens_is_a_value_error():
    with pytest.raises(ValueError, match=r"seq_lens\[:num_reqs\] must have values in \[0, "):
        combine_sampled_and_draft_tokens(
            np.zeros((2,), np.int32), np.array([0], np.int32), np.array([7], np.int32),
            np.array([0, 2], np.int32), np.array([-1], np.int32), np.array([3], np.int32),
            np.zeros((1, 0), np.int32), np.array([0, 1], np.int32), 1, backend="reference")


# --------------------------------------------------------------------------
# item 3 under JAX_ENABLE_X64=1: traced int64 ids beyond int32 write nothing
# --------------------------------------------------------------------------

_X64_SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    assert jax.config.jax_enable_x64
    from pallas_kernels import (causal_conv1d_update, causal_conv1d_varlen,
        combine_sampled_and_draft_tokens, selective_scan_varlen, selective_state_update)
    f32, BIG = np.float32, 2**32 + 1
    def nan(shape):  # finite poison: a stray write computed from it changes the bits
        return np.full(shape, 7.0, f32)
    def same(a, b, what):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), what
    x3, A = np.ones((1, 1, 2), f32), -np.ones((1, 2, 2), f32)
    for be in ("reference", "pallas_tpu", "pallas_gpu"):
        st = nan((4, 1, 2, 2))
        # valid int64 input runs (the Pallas flavours raised TypeError under x64)
        _, new = selective_state_update(np.zeros_like(st), x3, x3, A, x3, x3,
                                        state_batch_indices=np.array([1], np.int64), backend=be)
        assert np.isfinite(np.asarray(new)[1]).all(), be
        f = jax.jit(lambda s, i: selective_state_update(s, x3, x3, A, x3, x3,
                                                        state_batch_indices=i, backend=be)[1])
        same(f(st, jnp.array([BIG], jnp.int64)), st, "ssu " + be)
        # num_accepted_tokens 2**32 + 1 would wrap to the valid count 1
        f = jax.jit(lambda s, na: selective_state_update(
            s, x3, x3, A, x3, x3, state_batch_indices=np.array([[1]]), num_accepted_tokens=na,
            backend=be)[1])
        same(f(st, jnp.array([BIG], jnp.int64)), st, "ssu num_accepted_tokens " + be)
        cs = nan((4, 2, 3))
        f = jax.jit(lambda c, i: causal_conv1d_update(np.ones((1, 2), f32), c, np.ones((2, 4), f32),
                                                      conv_state_indices=i, backend=be)[1])
        same(f(cs, jnp.array([BIG], jnp.int64)), cs, "conv " + be)
        ids = np.zeros((2,), np.int32)
        f = jax.jit(lambda i: combine_sampled_and_draft_tokens(
            ids, i, np.array([7]), np.array([0, 2]), np.array([5]), np.array([3]),
            np.zeros((1, 0), np.int64), np.array([0, 1]), 1, backend=be))
        got_ids, got_li = f(jnp.array([2**32], jnp.int64))
        same(got_ids, ids, "combine ids " + be)
        same(got_li, np.zeros((1,), np.int32), "combine logits " + be)
    for be in ("reference", "pallas_gpu"):
        st = nan((4, 1, 2, 2))
        f = jax.jit(lambda s, i: selective_scan_varlen(
            np.ones((1, 1, 2), f32), np.ones((1, 1), f32), -np.ones((1,), f32),
            np.ones((1, 1, 2), f32), np.ones((1, 1, 2), f32), s, np.array([0, 1]), i,
            np.array([True]), backend=be)[1])
        same(f(st, jnp.array([BIG], jnp.int64)), st, "scan " + be)
        cs = nan((4, 2, 3))
        f = jax.jit(lambda c, i: causal_conv1d_varlen(
            np.ones((2, 1), f32), np.ones((2, 4), f32), None, c, np.array([0, 1]), i,
            np.array([True]), backend=be)[1])
        same(f(cs, jnp.array([BIG], jnp.int64)), cs, "conv varlen " + be)
        # offsets beyond int32 (2**32 + 1 would wrap to 1): the sequence is masked
        f = jax.jit(lambda s, q: selective_state_update(
            s, x3, x3, A, x3, x3, state_batch_indices=np.array([1]), cu_seqlens=q,
            backend=be)[1])
        same(f(st, jnp.array([0, BIG], jnp.int64)), st, "ssu cu_seqlens " + be)
    print("x64 ok")
    """
)


def test_traced_int64_ids_are_masked_under_x64():
    env = dict(os.environ, JAX_ENABLE_X64="1", JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", _X64_SCRIPT], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0 and "x64 ok" in r.stdout, r.stderr[-3000:]
