"""kvjax against vLLM 0.33.0's own Triton kernels (optional: skipped without vLLM).

Install the oracle with ``bash scripts/install_vllm_oracle.sh``. On a CPU the
kernels run in Triton's interpreter (``kvjax.testing.vllm`` sets
``TRITON_INTERPRET=1`` and, while importing vLLM, ``CUDA_VISIBLE_DEVICES=""``).

What is compared, whole arrays every time:

* ``combine_sampled_and_draft_tokens``: ``input_ids`` and ``logits_indices``
  exactly (kvjax's jnp reference and its Pallas kernels in interpret mode).
* ``reshape_and_cache_flash``: whole caches bitwise (NaN-poisoned null block
  included). fp8: bitwise against vLLM where every quotient ``x / scale`` is
  an fp8 value (the interpreter converts those exactly); for inputs that need
  rounding or saturation the interpreter's float -> fp8 conversion is wrong,
  so kvjax's bytes are checked against the documented rule (saturate, round
  to nearest even) and vLLM's against kvjax on every byte it must not touch.
* ``selective_state_update`` / ``causal_conv1d_update``: outputs and state
  within float32 tolerances (vLLM uses ``exp2`` for ``exp``), NaN-poisoned
  null rows bitwise unchanged in both, conv state (a copy) bitwise. bfloat16
  cases run in float32 on the vLLM side (its interpreter mishandles bf16
  arithmetic) and are compared with bf16 tolerances.

The kvjax functions are imported inside the tests (``pallas_kernels.kv_write``
and ``pallas_kernels.mamba`` are separate modules with their own owners).
"""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import pytest

from kvjax.testing import vllm as oracle
from kvjax.testing.asserts import assert_bitwise, bits  # noqa: E402

FP8 = ml_dtypes.float8_e4m3fn
BF16 = ml_dtypes.bfloat16
CVD_AT_IMPORT = os.environ.get("CUDA_VISIBLE_DEVICES")


@pytest.fixture(scope="module", autouse=True)
def _vllm_oracle(vllm_oracle):
    """Every test here needs the oracle (conftest's ``vllm_oracle``: skips, or fails in CI)."""


def assert_close(actual, expected, name, rtol, atol):
    a = np.asarray(actual).astype(np.float32)
    e = np.asarray(expected).astype(np.float32)
    assert a.shape == e.shape, f"{name}: shape {a.shape} != {e.shape}"
    np.testing.assert_array_equal(np.isnan(a), np.isnan(e), err_msg=f"{name}: NaN positions")
    np.testing.assert_allclose(a, e, rtol=rtol, atol=atol, equal_nan=True, err_msg=name)


# --------------------------------------------------------------------------
# combine_sampled_and_draft_tokens
# --------------------------------------------------------------------------


def combine_cases():
    from test_token_combine import Req, build, random_reqs

    yield "decode 0..3 drafts", build(
        [Req(5, 20, 1, 12, 0), Req(2, 20, 2, 12, 1), Req(7, 20, 3, 12, 2), Req(0, 20, 4, 12, 3)]
    )
    yield "prompt tail straddling prefill_len", build(
        [Req(1, 8, 4, 10, 2), Req(3, 6, 4, 10), Req(4, 10, 3, 10, 2)]
    )
    yield "mid-prefill chunks", build([Req(6, 0, 8, 30), Req(2, 8, 8, 30)])
    yield "no new sampled token", build(
        [Req(2, 20, 2, 3, 2), Req(5, 20, 1, 3, 0), Req(1, 3, 3, 5, 1)], num_new=0
    )
    yield "all padding", build([])
    rng = np.random.default_rng(7)
    for k in range(6):
        num_new = k % 2
        # vLLM has padding only after the real rows: drop interior padded rows.
        reqs = [r for r in random_reqs(rng, num_new) if r is not None]
        yield f"random {k}", build(reqs, num_new=num_new)


@pytest.mark.parametrize("backend", ["reference", "pallas_tpu", "pallas_gpu"])
def test_combine_sampled_and_draft_tokens(backend):
    import jax.numpy as jnp

    from pallas_kernels.token_combine import combine_sampled_and_draft_tokens

    for name, a in combine_cases():
        want_ids, want_li = oracle.combine_sampled_and_draft_tokens(**a)
        ids, li = combine_sampled_and_draft_tokens(
            **{k: jnp.asarray(v) if isinstance(v, np.ndarray) else v for k, v in a.items()},
            backend=backend, interpret=None if backend == "reference" else True,
        )
        np.testing.assert_array_equal(np.asarray(ids), want_ids, err_msg=f"{name}: input_ids")
        np.testing.assert_array_equal(np.asarray(li), want_li, err_msg=f"{name}: logits_indices")


# --------------------------------------------------------------------------
# reshape_and_cache_flash
# --------------------------------------------------------------------------

T, H, D, NB, BS = 6, 2, 8, 4, 4
# N = 5 < T slots: a PAD in the middle, the last block's last slot, block 0 never.
SLOTS = np.array([5, -1, 15, 4, 9], np.int64)


def poisoned_cache(rng, dtype):
    if np.dtype(dtype) == np.dtype(FP8):
        c = rng.integers(0, 256, size=(NB, BS, H, D), dtype=np.uint8)
        c[0] = 0x7F  # fp8 NaN
        return c.view(FP8)
    c = rng.standard_normal((NB, BS, H, D)).astype(dtype)
    c[0] = np.nan
    return c


def written(slots):
    """bool [NB, BS, 1, 1]: the slots a write may change."""
    m = np.zeros((NB * BS,), bool)
    m[[s for s in slots.tolist() if s >= 0]] = True
    return m.reshape(NB, BS, 1, 1)


@pytest.mark.parametrize("dtype", [np.float32, BF16, np.float16], ids=["f32", "bf16", "f16"])
def test_reshape_and_cache_flash_copy(dtype):
    from pallas_kernels.kv_write import reshape_and_cache_flash

    rng = np.random.default_rng(1)
    key = rng.standard_normal((T, H, D)).astype(dtype)
    value = rng.standard_normal((T, H, D)).astype(dtype)
    key[2, 0, 0] = -0.0
    kc, vc = poisoned_cache(rng, dtype), poisoned_cache(rng, dtype)
    want_k, want_v = oracle.triton_reshape_and_cache_flash(key, value, kc, vc, SLOTS)
    got_k, got_v = reshape_and_cache_flash(key, value, kc, vc, SLOTS, backend="reference")
    assert_bitwise(got_k, want_k, "key_cache")
    assert_bitwise(got_v, want_v, "value_cache")
    assert_bitwise(want_k[0], kc[0], "vLLM null block")  # vLLM itself never touches block 0


@pytest.mark.parametrize("src_dtype", [np.float32, BF16], ids=["f32", "bf16"])
def test_reshape_and_cache_flash_fp8_exact_values(src_dtype):
    """Quotients that are fp8 values (scale a power of two): bitwise against vLLM."""
    from pallas_kernels.kv_write import reshape_and_cache_flash

    rng = np.random.default_rng(2)
    finite = np.arange(256, dtype=np.uint8).view(FP8)
    finite = finite[np.isfinite(finite.astype(np.float32))]
    k_scale, v_scale = np.float32(2.0), np.float32(0.25)
    q = rng.choice(finite, size=(2, T, H, D)).astype(np.float32)
    q[0, 0, 0, :4] = [448.0, -448.0, 2.0**-9, -(2.0**-9)]  # extremes and subnormals
    key, value = (q[0] * k_scale).astype(src_dtype), (q[1] * v_scale).astype(src_dtype)
    kc, vc = poisoned_cache(rng, FP8), poisoned_cache(rng, FP8)
    want = oracle.triton_reshape_and_cache_flash(key, value, kc, vc, SLOTS, "fp8", k_scale, v_scale)
    got = reshape_and_cache_flash(key, value, kc, vc, SLOTS, "fp8", k_scale, v_scale,
                                  backend="reference")
    for g, w, name in zip(got, want, ("key_cache", "value_cache")):
        assert_bitwise(g, w, name)


def test_reshape_and_cache_flash_fp8_rounding_against_the_rule():
    """Ties, saturation, subnormal rounding: kvjax = the rule; vLLM = kvjax where nothing is written."""
    from pallas_kernels.kv_write import reshape_and_cache_flash

    rng = np.random.default_rng(3)
    vals = np.array([1.0625, 17.0, 232.0, 500.0, -1000.0, 464.0, 0.001, 3 * 2.0**-10,
                     7 * 2.0**-10, 1.1875, -0.0, 0.3, 123.4, 449.0, -465.0, 2.5], np.float32)
    key = np.resize(vals, (T, H, D)) * np.float32(1.5)
    value = -np.resize(vals[::-1], (T, H, D))
    k_scale, v_scale = np.float32(1.5), np.float32(1.0)
    kc, vc = poisoned_cache(rng, FP8), poisoned_cache(rng, FP8)
    want = oracle.triton_reshape_and_cache_flash(key, value, kc, vc, SLOTS, "fp8", k_scale, v_scale)
    got = reshape_and_cache_flash(key, value, kc, vc, SLOTS, "fp8", k_scale, v_scale,
                                  backend="reference")
    mask = np.broadcast_to(written(SLOTS), kc.shape)
    for x, scale, before, g, w, name in ((key, k_scale, kc, got[0], want[0], "key_cache"),
                                         (value, v_scale, vc, got[1], want[1], "value_cache")):
        rule = before.copy()
        for t, s in enumerate(SLOTS.tolist()):
            if s >= 0:
                y = np.clip(x[t].astype(np.float32) / scale, -448.0, 448.0)
                rule[s // BS, s % BS] = y.astype(FP8)  # ml_dtypes: round to nearest even
        assert_bitwise(g, rule, f"{name} vs the documented rule")
        assert_bitwise(np.where(mask, 0, bits(w)), np.where(mask, 0, bits(g)),
                       f"{name}: bytes outside the written slots, vLLM vs kvjax")
        if np.array_equal(bits(w), bits(g)):
            continue  # an interpreter without the fp8 conversion bug agrees everywhere
        assert (bits(w) != bits(g))[mask].any()


# --------------------------------------------------------------------------
# selective_state_update
# --------------------------------------------------------------------------

F32_TOL = dict(rtol=2e-5, atol=2e-5)
BF16_TOL = dict(rtol=2e-2, atol=2e-2)


def ssu_inputs(rng, *, L=6, T=4, H=4, P=8, N=16, G=2, heads=True, dtype=np.float32):
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    a = dict(
        state=f(L, H, P, N), x=f(T, H, P), dt=f(T, H, P) * 0.5, A=-np.abs(f(H, P, N)),
        B=f(T, G, N), C=f(T, G, N), D=f(H, P), dt_bias=f(H, P) * 0.1, z=f(T, H, P),
    )
    a["state"][0] = np.nan  # the null row: never read, never written
    if not heads:
        a = dict(state=a["state"][:, 0], x=a["x"][:, 0], dt=a["dt"][:, 0], A=a["A"][0],
                 B=a["B"][:, 0], C=a["C"][:, 0], D=a["D"][0], dt_bias=a["dt_bias"][0],
                 z=a["z"][:, 0])
    return {k: v.astype(dtype) for k, v in a.items()}


def compare_ssu(kwargs, tol):
    from pallas_kernels.mamba import selective_state_update

    want_out, want_state = oracle.selective_state_update(**kwargs)
    out, state = selective_state_update(**kwargs, backend="reference")
    assert_close(out, want_out, "out", **tol)
    assert_close(state, want_state, "state", **tol)
    assert_bitwise(np.asarray(state)[0], kwargs["state"][0], "kvjax null row")
    assert_bitwise(want_state[0], kwargs["state"][0], "vLLM null row")
    assert np.isfinite(np.asarray(out)).all() and np.isfinite(want_out).all()


def test_selective_state_update_heads_groups_null_rows():
    rng = np.random.default_rng(10)
    a = ssu_inputs(rng)
    compare_ssu(dict(a, dt_softplus=True, state_batch_indices=np.array([3, 0, 5, 1], np.int32)),
                F32_TOL)
    # Separate destinations (src row 2 -> dst row 4), a null src row.
    compare_ssu(dict(a, state_batch_indices=np.array([2, 0, 1, 3], np.int32),
                     dst_state_batch_indices=np.array([4, 0, 5, 3], np.int32)), F32_TOL)


def test_selective_state_update_without_heads_and_optional_args():
    rng = np.random.default_rng(11)
    a = ssu_inputs(rng, heads=False)
    a.pop("D"), a.pop("dt_bias"), a.pop("z")
    compare_ssu(dict(a, state_batch_indices=np.array([1, 4, 0, 2], np.int64)), F32_TOL)


def test_selective_state_update_tied_head_dim():
    """dt [T, H, 1], A [H, 1, 1], D and dt_bias [H, 1]: vLLM's TIE_HDIM path."""
    rng = np.random.default_rng(12)
    a = ssu_inputs(rng)
    a.update(dt=a["dt"][:, :, :1], A=a["A"][:, :1, :1], D=a["D"][:, :1], dt_bias=a["dt_bias"][:, :1])
    compare_ssu(dict(a, dt_softplus=True, state_batch_indices=np.array([3, 1, 0, 5], np.int32)),
                F32_TOL)


def test_selective_state_update_speculative_varlen():
    """cu_seqlens + num_accepted_tokens: per-token dst columns, null dst entries skipped."""
    rng = np.random.default_rng(13)
    a = ssu_inputs(rng, L=10, T=6)
    cu = np.array([0, 3, 4, 6], np.int32)  # sequences of 3, 1, 2 tokens
    src = np.array([[1, 2, 3], [0, 0, 0], [6, 7, 8]], np.int32)  # sequence 1: null
    dst = np.array([[4, 5, 0], [0, 0, 0], [9, 7, 8]], np.int32)  # token 2 of seq 0: null dst
    acc = np.array([2, 1, 3], np.int32)  # initial columns 1, 0, 2
    compare_ssu(dict(a, dt_softplus=True, state_batch_indices=src, dst_state_batch_indices=dst,
                     num_accepted_tokens=acc, cu_seqlens=cu), F32_TOL)


def test_selective_state_update_bf16():
    rng = np.random.default_rng(14)
    a = ssu_inputs(rng, dtype=BF16)
    compare_ssu(dict(a, dt_softplus=True, state_batch_indices=np.array([3, 0, 5, 1], np.int32)),
                BF16_TOL)


# --------------------------------------------------------------------------
# causal_conv1d_update
# --------------------------------------------------------------------------


def conv_inputs(rng, *, L=5, dim=12, S=5, width=4, dtype=np.float32):
    cs = rng.standard_normal((L, dim, S)).astype(np.float32)
    cs[0] = np.nan  # the null row
    w = rng.standard_normal((dim, width)).astype(np.float32) * 0.5
    b = rng.standard_normal((dim,)).astype(np.float32)
    return cs.astype(dtype), w.astype(dtype), b.astype(dtype)


def compare_conv(x, cs, w, b, tol, **kw):
    from pallas_kernels.mamba import causal_conv1d_update

    want_out, want_state = oracle.causal_conv1d_update(x, cs, w, b, **kw)
    out, state = causal_conv1d_update(x, cs, w, b, **kw, backend="reference")
    assert_close(out, want_out, "out", **tol)
    assert_bitwise(state, want_state, "conv_state")  # a copy: bitwise
    assert_bitwise(want_state[0], cs[0], "vLLM null row")


def test_causal_conv1d_update_single_token_with_null_row():
    rng = np.random.default_rng(20)
    cs, w, b = conv_inputs(rng)
    x = rng.standard_normal((3, 12)).astype(np.float32)
    compare_conv(x, cs, w, b, F32_TOL, activation="silu",
                 conv_state_indices=np.array([2, 0, 4], np.int32))


def test_causal_conv1d_update_multi_token_no_bias():
    rng = np.random.default_rng(21)
    cs, w, _ = conv_inputs(rng)
    x = rng.standard_normal((2, 12, 3)).astype(np.float32)  # [batch, dim, seqlen]
    compare_conv(x, cs, w, None, F32_TOL, conv_state_indices=np.array([3, 1], np.int32))


def test_causal_conv1d_update_varlen_and_speculative():
    rng = np.random.default_rng(22)
    cs, w, b = conv_inputs(rng, S=6)
    x = rng.standard_normal((9, 12)).astype(np.float32)  # varlen tokens
    idx = np.array([2, 3, 0, 4], np.int32)  # batch row 2 is null
    # Plain varlen: every live sequence max_query_len long (see the xfail below).
    compare_conv(x, cs, w, b, F32_TOL, activation="silu", conv_state_indices=idx,
                 query_start_loc=np.array([0, 3, 3, 6, 9], np.int32), max_query_len=3)
    # Speculative: lengths 3, 0, 1, 2 with accepted-token offsets.
    qsl = np.array([0, 3, 3, 4, 6], np.int32)
    acc = np.array([2, 1, 1, 3], np.int32)
    compare_conv(x[:6], cs, w, b, F32_TOL, activation="silu", conv_state_indices=idx,
                 num_accepted_tokens=acc, query_start_loc=qsl, max_query_len=3)


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "vLLM 0.33.0 quirk: plain (non-speculative) varlen update of a sequence shorter than "
    "max_query_len shrinks its state_len, writing the new tokens to columns [0, len) and "
    "keeping old columns [len, width-1), instead of the last width-1 entries of window ++ x "
    "(kvjax). Outputs agree; only such rows' conv state differs."))
def test_causal_conv1d_update_varlen_short_sequence_state():
    rng = np.random.default_rng(24)
    cs, w, b = conv_inputs(rng, S=6)
    x = rng.standard_normal((6, 12)).astype(np.float32)
    compare_conv(x, cs, w, b, F32_TOL, activation="silu",
                 conv_state_indices=np.array([2, 3, 0, 4], np.int32),
                 query_start_loc=np.array([0, 3, 3, 4, 6], np.int32), max_query_len=3)


def test_causal_conv1d_update_bf16():
    rng = np.random.default_rng(23)
    cs, w, b = conv_inputs(rng, dtype=BF16)
    x = rng.standard_normal((3, 12)).astype(BF16)
    compare_conv(x, cs, w, b, BF16_TOL, activation="silu",
                 conv_state_indices=np.array([2, 0, 4], np.int32))


# --------------------------------------------------------------------------
# the adapter module itself
# --------------------------------------------------------------------------


def test_environment_left_for_jax():
    import jax.numpy as jnp

    assert oracle.interpreted() == (os.environ.get("TRITON_INTERPRET") == "1")
    # CUDA_VISIBLE_DEVICES is only set while vLLM imports; JAX sees the original.
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == CVD_AT_IMPORT
    assert int(jnp.arange(5).sum()) == 10


def test_adapters_do_not_modify_their_inputs():
    rng = np.random.default_rng(30)
    cs, w, b = conv_inputs(rng)
    x = rng.standard_normal((3, 12)).astype(np.float32)
    before = [a.copy() for a in (x, cs)]
    oracle.causal_conv1d_update(x, cs, w, b, conv_state_indices=np.array([2, 1, 4], np.int32))
    for a, c in zip((x, cs), before):
        assert_bitwise(a, c, "input")


def test_padded_rows_must_trail_for_vllm():
    from test_token_combine import Req, build

    a = build([Req(1, 9, 1, 4), None, Req(2, 9, 1, 4)])
    with pytest.raises(ValueError, match="must trail"):
        oracle.combine_sampled_and_draft_tokens(**a)
