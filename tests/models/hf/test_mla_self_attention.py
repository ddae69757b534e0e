"""The MLA split form's dense self-attention of a step of one fresh prefill
(``self_attention="cudnn"`` on a CUDA GPU; ``"xla"``, the same function through XLA, here): the
same attention as the paged path, and taken only where it applies (one row with tokens, no
context). The shared parts (the dense attention, the step's condition, the implementation's
choice) are tested with their owner, ``tests/models/test_fresh_prefill_attention.py``."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import kvjax.models.hf.mla as mla
from kvjax.models.hf.mla import split_latent_attention

H, r, pe, nope, v, BS = 3, 16, 8, 8, 6, 4


def case(rng, *, rows, T, new, context, pad=0.0):
    """``rows`` rows with ``new[b]`` tokens this step over ``context[b]`` cached ones, in a
    ``T``-token bucket; the pool's unused rows NaN, the pad tokens' latent rows ``pad``."""
    new, context = list(new), list(context)
    W = 8
    cache = np.full((1 + rows * W, BS, r + pe), np.nan, np.float32)
    table = np.zeros((rows, W), np.int32)
    for b in range(rows):
        table[b] = 1 + b * W + np.arange(W)
        for j in range(context[b]):
            cache[table[b, j // BS], j % BS] = rng.standard_normal(r + pe)
    n = sum(new)
    latent = np.full((T, r + pe), pad, np.float32)
    latent[:n] = rng.standard_normal((n, r + pe))
    token_row = np.full((T,), rows, np.int32)
    positions = np.zeros((T,), np.int32)
    qsl = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    for b in range(rows):
        token_row[qsl[b]:qsl[b + 1]] = b
        positions[qsl[b]:qsl[b + 1]] = context[b] + np.arange(new[b])
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    args = (f(T, H, nope), f(T, H, pe), jnp.asarray(latent), jnp.asarray(cache), f(H, r, nope) / 4,
            f(H, v, r) / 4, jnp.asarray(table), jnp.asarray(np.add(new, context), np.int32),
            jnp.asarray(qsl), jnp.asarray(new, np.int32), jnp.asarray(positions), jnp.asarray(token_row))
    return args, token_row < rows


def run(args, impl):
    return np.asarray(split_latent_attention(*args, softmax_scale=0.3, self_attention=impl))


def test_one_fresh_row_dense_equals_paged_and_pad_tokens_are_zero():
    rng = np.random.default_rng(0)
    args, real = case(rng, rows=1, T=12, new=[9], context=[0])
    paged, dense = run(args, "paged"), run(args, "xla")
    assert np.isfinite(dense).all()
    assert (dense[~real] == 0).all()
    np.testing.assert_allclose(dense, paged, atol=2e-6, rtol=0)
    assert np.abs(dense[real]).max() > 0.1


@pytest.mark.parametrize("rows,new,context", [(3, [0, 7, 0], [0, 0, 4]), (2, [6, 0], [0, 0])])
def test_one_fresh_row_among_empty_rows_dense_equals_paged(rows, new, context):
    """The bucket's other rows schedule nothing (one of them with a cached context, which no
    token reads): the one fresh row still attends densely."""
    args, real = case(np.random.default_rng(5), rows=rows, T=12, new=new, context=context)
    dense, paged = run(args, "xla"), run(args, "paged")
    assert (dense[~real] == 0).all() and np.isfinite(dense).all()
    np.testing.assert_allclose(dense, paged, atol=2e-6, rtol=0)


@pytest.mark.parametrize("rows,new,context", [(1, [5], [6]), (2, [4, 3], [0, 0]), (2, [4, 3], [0, 5]),
                                              (2, [0, 0], [0, 0]), (3, [0, 4, 2], [3, 0, 0])])
def test_with_context_or_several_rows_the_paged_path_runs(rows, new, context):
    """A row with context needs the merged log-sum-exps, several rows would share one dense
    sequence, and a step with no tokens has nothing to attend: the paged path, bitwise."""
    args, _ = case(np.random.default_rng(1), rows=rows, T=12, new=new, context=context)
    np.testing.assert_array_equal(run(args, "xla"), run(args, "paged"))


def test_bad_self_attention_names_refused():
    args, _ = case(np.random.default_rng(3), rows=1, T=4, new=[2], context=[0])
    with pytest.raises(ValueError, match="self_attention must be"):
        run(args, "flash")


def test_shapes_the_dense_kernel_refuses_take_the_paged_path(monkeypatch):
    """cuDNN refuses some shapes while tracing (NotImplementedError): the step takes the paged
    path, bitwise, instead of failing."""
    args, _ = case(np.random.default_rng(6), rows=1, T=8, new=[6], context=[0])
    want = run(args, "paged")

    def refuses(*a, **k):
        raise NotImplementedError("not this head size")

    monkeypatch.setattr(mla, "dense_causal_attention", refuses)
    np.testing.assert_array_equal(run(args, "xla"), want)


def test_pad_tokens_are_zero_whatever_the_dense_kernel_leaves_in_their_rows(monkeypatch):
    """``dense_causal_attention``'s rows past the sequence are anything (the pad tokens'
    own attention): poisoned here with NaN, the pad tokens still come out 0."""
    real_fn = mla.dense_causal_attention

    def poisoned(q, k, v, scale, *, implementation):
        o = real_fn(q, k, v, scale, implementation=implementation)
        return jnp.where(jnp.arange(o.shape[0])[:, None, None] < 7, o, jnp.nan)

    monkeypatch.setattr(mla, "dense_causal_attention", poisoned)
    args, real = case(np.random.default_rng(4), rows=1, T=12, new=[7], context=[0])
    got = run(args, "xla")
    assert (got[~real] == 0).all() and np.isfinite(got).all()


@pytest.mark.parametrize("rows,new,context", [(1, [8], [0]), (3, [0, 7, 0], [0, 0, 4])])
def test_the_dense_branch_is_the_one_that_runs(monkeypatch, rows, new, context):
    """Both branches of the step's conditional are traced; which one ran shows in the output:
    the dense attention doubled here comes out doubled for one fresh row only."""
    real_fn = mla.dense_causal_attention
    monkeypatch.setattr(mla, "dense_causal_attention", lambda *a, **k: 2.0 * real_fn(*a, **k))
    fresh, real = case(np.random.default_rng(7), rows=rows, T=10, new=new, context=context)
    np.testing.assert_allclose(run(fresh, "xla")[real], 2.0 * run(fresh, "paged")[real], atol=4e-6, rtol=0)
    cached, _ = case(np.random.default_rng(8), rows=2, T=10, new=[4, 3], context=[0, 0])
    np.testing.assert_array_equal(run(cached, "xla"), run(cached, "paged"))


def test_pad_tokens_latent_reaches_no_real_token_on_the_dense_path():
    """The pad tokens' latent rows NaN (their keys and values with them): zeroed before the
    attention (the dense path's real query reads keys past it with weight 0, and 0 times NaN is
    NaN), as the paged path never reads them."""
    args, real = case(np.random.default_rng(9), rows=1, T=12, new=[7], context=[0], pad=np.nan)
    clean, _ = case(np.random.default_rng(9), rows=1, T=12, new=[7], context=[0])
    dense = run(args, "xla")
    assert np.isfinite(dense).all() and (dense[~real] == 0).all()
    np.testing.assert_allclose(dense, run(clean, "paged"), atol=2e-6, rtol=0)
