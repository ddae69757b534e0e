"""A step of one fresh prefill attends over its own tokens with a dense causal attention
(``kvjax.models.attention``: ``one_fresh_prefill``, ``dense_causal_attention``,
``self_attention_impl``; cuDNN's flash kernel on a Hopper GPU, the same function through XLA
here), in the GQA mixer and, through the same owner, in MLA's split form
(``tests/models/hf/test_mla_self_attention.py``). Every other step takes the paged path, bitwise.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax.models.attention as attention
from kvjax import BlockTables, KVGroupSpec, RequestState, ScheduledBatch, build_step_batch
from kvjax.models.attention import AttnSpec, attention_mixer, dense_causal_attention, one_fresh_prefill
from kvjax.models.step_context import make_step_context

Hq, Hkv, D, d = 4, 2, 8, 16
BS, NB, MAX_LEN = 4, 32, 32
SPEC = KVGroupSpec.for_model_len(BS, MAX_LEN)


@pytest.mark.parametrize("hq,hkv,dv", [(2, 2, 8), (4, 2, 8), (2, 2, 4), (6, 2, 5)])
def test_dense_causal_attention_against_numpy(hq, hkv, dv):
    """Causal, scaled, query head ``h`` on key head ``h // (hq / hkv)``, values narrower than
    the keys padded and their columns dropped. The sequence ends at ``n < T``: the pad tokens'
    keys and values (large, finite) reach no real token; their rows are the caller's."""
    rng = np.random.default_rng(2)
    T, n, Dk = 7, 5, 8
    q, k = rng.standard_normal((T, hq, Dk)), rng.standard_normal((T, hkv, Dk))
    val = rng.standard_normal((T, hkv, dv))
    k[n:], val[n:] = 40.0 * rng.standard_normal((T - n, hkv, Dk)), 1e4
    got = np.asarray(dense_causal_attention(*(jnp.asarray(a, jnp.float32) for a in (q, k, val)), 0.5,
                                            implementation="xla"))
    assert got.shape == (T, hq, dv) and got.dtype == np.float32
    g = hq // hkv
    for i in range(n):
        for h in range(hq):
            s = k[: i + 1, h // g] @ q[i, h] * 0.5
            p = np.exp(s - s.max())
            np.testing.assert_allclose(got[i, h], (p / p.sum()) @ val[: i + 1, h // g], atol=1e-5)


@pytest.mark.parametrize("query_len,seq_lens,want", [
    ([7], [7], True), ([0, 6, 0], [0, 6, 0], True), ([0, 6, 0], [3, 6, 0], True),  # another row's context
    ([7], [9], False), ([3, 4], [3, 4], False), ([0, 0], [0, 0], False), ([0, 1, 0], [0, 5, 2], False)])
def test_one_fresh_prefill(query_len, seq_lens, want):
    """Exactly one row with tokens, and that row without context (the others' contexts are
    read by no token)."""
    got = one_fresh_prefill(jnp.asarray(query_len, jnp.int32), jnp.asarray(seq_lens, jnp.int32))
    assert bool(got) is want


def test_impl_is_paged_off_a_cuda_gpu():
    assert attention.self_attention_impl("pallas_gpu", jnp.bfloat16) == "paged"  # this CPU
    assert attention.self_attention_impl("reference", jnp.bfloat16) == "paged"


@pytest.mark.parametrize("platform,cap,dtype,want", [
    ("gpu", (9, 0), jnp.bfloat16, "cudnn"), ("gpu", (10, 0), jnp.float16, "cudnn"),
    ("gpu", (8, 0), jnp.bfloat16, "paged"),  # cuDNN takes heads only up to 128 wide before Hopper
    ("gpu", None, jnp.bfloat16, "paged"),  # a GPU that reports no CUDA capability (ROCm)
    ("tpu", (9, 0), jnp.bfloat16, "paged"),  # lowering for a TPU on a GPU host
    ("gpu", (9, 0), jnp.float32, "paged")])
def test_impl_on_a_pretend_gpu(monkeypatch, platform, cap, dtype, want):
    monkeypatch.setattr(attention.kernel_backend, "platform", lambda: platform)
    monkeypatch.setattr(attention, "reads_live_keys_only", lambda backend: True)
    monkeypatch.setattr(attention.kernel_backend, "gpu_capability", lambda: ("gpu:0", cap))
    assert attention.self_attention_impl("pallas_gpu", dtype) == want


# -- the GQA mixer

def step(rows, new, context, *, T=12, decode_only=False):
    """``rows`` rows, row ``b`` scheduling ``new[b]`` tokens after ``context[b]`` cached ones
    (a row with neither is empty), in a ``T``-token bucket: ``(ctx, h, caches, token_real)``;
    the caches' context keys random, every other slot NaN."""
    rng = np.random.default_rng(sum(new) * 7 + sum(context))
    reqs = RequestState.create(rows, MAX_LEN)
    tables = BlockTables.create([SPEC], rows, num_cache_blocks=NB)
    kc = np.full((NB, BS, Hkv, D), np.nan, np.float32)
    vc = np.full((NB, BS, Hkv, D), np.nan, np.float32)
    nxt = 1
    for b in range(rows):
        total = new[b] + context[b]
        if not total:
            continue
        reqs = reqs.add_request(b, list(rng.integers(1, 100, total)), num_computed_tokens=context[b])
        ids = list(range(nxt, nxt + -(-total // BS)))
        nxt += len(ids)
        tables = tables.append_block_ids(b, [ids])
        for j in range(context[b]):
            kc[ids[j // BS], j % BS] = rng.standard_normal((Hkv, D))
            vc[ids[j // BS], j % BS] = rng.standard_normal((Hkv, D))
    idx = np.where(np.asarray(new) > 0, np.arange(rows), -1).astype(np.int32)
    sched = ScheduledBatch(idx_mapping=idx, num_scheduled_tokens=np.asarray(new, np.int32),
                           num_draft_tokens=np.zeros((rows,), np.int32))
    batch = build_step_batch(reqs, tables, sched, num_tokens_padded=T, num_logits_padded=rows)
    ctx = make_step_context(batch, jnp.zeros((rows,), jnp.int32), None, kv_group=0,
                            max_prefill_rows=0 if decode_only else None)
    h = jnp.asarray(rng.standard_normal((T, d)), jnp.float32)
    return ctx, h, (jnp.asarray(kc), jnp.asarray(vc)), np.asarray(batch.token_real)


W = {n: jnp.asarray(np.random.default_rng(9).standard_normal(s) / np.sqrt(s[0]), jnp.float32)
     for n, s in (("wq", (d, Hq * D)), ("wk", (d, Hkv * D)), ("wv", (d, Hkv * D)), ("wo", (Hq * D, d)))}


def mix(monkeypatch, impl, args, *, spec=AttnSpec(Hq, Hkv, D, rope_theta=100.0, sm_scale=0.3),
        kv="auto", weights=jnp.float32, cache=None):
    """The mixer's output and caches (as float32) with the fresh-prefill choice forced to
    ``impl``; ``weights`` / ``cache``: the weights' and the caches' dtypes (default float32)."""
    monkeypatch.setattr(attention, "self_attention_impl", lambda backend, dtype: impl)
    ctx, h, (kc, vc), _ = args
    if kv != "auto":
        kc, vc = jnp.zeros(kc.shape, jnp.float8_e4m3fn), jnp.zeros(vc.shape, jnp.float8_e4m3fn)
    elif cache is not None:
        kc, vc = kc.astype(cache), vc.astype(cache)
    w = {n: a.astype(weights) for n, a in W.items()}
    out, kc, vc = attention_mixer(h, ctx, kc, vc, w, spec, kv_cache_dtype=kv, backend="reference")
    return tuple(np.asarray(a.astype(jnp.float32)) for a in (out, kc, vc))


@pytest.mark.parametrize("rows,new,context", [(1, [9], [0]), (3, [0, 7, 0], [0, 0, 4]), (2, [6, 0], [0, 0])])
@pytest.mark.parametrize("spec", [AttnSpec(Hq, Hkv, D, rope_theta=100.0, sm_scale=0.3),
                                  AttnSpec(Hq, Hkv, D, rope_theta=None)])  # NoPE, 1 / sqrt(D)
def test_one_fresh_prefill_dense_equals_paged(monkeypatch, rows, new, context, spec):
    """A fresh prefill alone (the bucket's other rows empty, one with a context no token reads):
    the dense attention, within float32 rounding of the paged path; the caches bitwise; pad
    tokens finite."""
    args = step(rows, new, context)
    paged, dense = mix(monkeypatch, "paged", args, spec=spec), mix(monkeypatch, "xla", args, spec=spec)
    real = args[3]
    assert np.isfinite(dense[0][real]).all() and np.abs(dense[0][real]).max() > 0.1
    np.testing.assert_allclose(dense[0][real], paged[0][real], atol=3e-6, rtol=0)
    for a, b in zip(dense[1:], paged[1:]):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("rows,new,context", [(1, [9], [0]), (3, [0, 7, 0], [0, 0, 4])])
def test_the_dense_branch_is_the_one_that_runs(monkeypatch, rows, new, context):
    """Both branches of the conditional are traced; a doubled dense attention comes out in the
    output (through ``wo``, linear) for a fresh prefill only, and its pad tokens are zero
    whatever the dense kernel leaves in their rows (NaN here)."""
    real_fn = attention.dense_causal_attention
    args = step(rows, new, context)
    n = sum(new)  # one fresh row: its tokens are the step's first

    def doubled_nan_tail(q, k, v, scale, *, implementation):
        o = 2.0 * real_fn(q, k, v, scale, implementation=implementation)
        return jnp.where(jnp.arange(o.shape[0])[:, None, None] < n, o, jnp.nan)

    want = mix(monkeypatch, "paged", args)[0]
    monkeypatch.setattr(attention, "dense_causal_attention", doubled_nan_tail)
    ctx, h, caches, real = args
    got = mix(monkeypatch, "xla", args)[0]
    assert np.isfinite(got).all()
    # out = o @ wo: a doubled attention doubles the mixer's output
    np.testing.assert_allclose(got[real], 2.0 * want[real], atol=6e-6, rtol=0)


@pytest.mark.parametrize("rows,new,context,decode_only", [
    (1, [5], [6], False), (2, [4, 3], [0, 0], False), (2, [4, 3], [0, 5], False), (2, [0, 0], [0, 0], False),
    (3, [0, 4, 2], [3, 0, 0], False), (2, [1, 1], [5, 3], True)])
def test_other_steps_take_the_paged_path_bitwise(monkeypatch, rows, new, context, decode_only):
    """A row with context, several rows, no tokens, a decode-only step: the paged path, bitwise
    (the dense attention poisoned, so running it would show; a decode-only step does not even
    trace it)."""
    args = step(rows, new, context, decode_only=decode_only)
    want = mix(monkeypatch, "paged", args)
    traced = []
    monkeypatch.setattr(attention, "dense_causal_attention",
                        lambda q, *a, **k: traced.append(1) or jnp.full(q.shape, jnp.nan, jnp.float32))
    for a, b in zip(mix(monkeypatch, "xla", args), want):
        np.testing.assert_array_equal(a, b)
    assert bool(traced) is not decode_only  # a decode-only program has no dense branch at all


def test_an_fp8_cache_and_refused_shapes_take_the_paged_path(monkeypatch):
    """An fp8 cache's keys are quantised (the paged path reads them); a shape cuDNN refuses
    while tracing (NotImplementedError) falls back to the paged path instead of failing."""
    args = step(1, [9], [0])
    calls = []
    real_fn = attention.dense_causal_attention
    monkeypatch.setattr(attention, "dense_causal_attention",
                        lambda *a, **k: calls.append(1) or real_fn(*a, **k))
    for a, b in zip(mix(monkeypatch, "xla", args, kv="fp8"), mix(monkeypatch, "paged", args, kv="fp8")):
        np.testing.assert_array_equal(a, b)
    assert not calls

    def refuses(*a, **k):
        raise NotImplementedError("not this head size")

    monkeypatch.setattr(attention, "dense_causal_attention", refuses)
    for a, b in zip(mix(monkeypatch, "xla", args), mix(monkeypatch, "paged", args)):
        np.testing.assert_array_equal(a, b)


def test_pad_tokens_reach_no_real_token_on_the_dense_path(monkeypatch):
    """A pad token's row of ``h`` non-finite (its keys and values with it): the dense path zeroes
    them before the attention, as the paged path never reads them."""
    ctx, h, caches, real = step(3, [0, 7, 0], [0, 0, 4])
    h = jnp.where(jnp.asarray(real)[:, None], h, jnp.inf)
    args = (ctx, h, caches, real)
    dense, paged = mix(monkeypatch, "xla", args)[0], mix(monkeypatch, "paged", args)[0]
    assert np.isfinite(dense[real]).all()
    np.testing.assert_allclose(dense[real], paged[real], atol=3e-6, rtol=0)


def test_bf16_weights_and_cache_dense_within_rounding_a_wider_cache_paged(monkeypatch):
    """A bf16 model with a bf16 cache takes the dense path, within bf16 rounding of the paged
    one; with a float32 cache its keys are wider than its queries, and the paged path runs,
    bitwise (the dense attention not even traced)."""
    args = step(1, [9], [0])
    real = args[3]
    dense = mix(monkeypatch, "xla", args, weights=jnp.bfloat16, cache=jnp.bfloat16)[0]
    paged = mix(monkeypatch, "paged", args, weights=jnp.bfloat16, cache=jnp.bfloat16)[0]
    assert np.abs(dense[real] - paged[real]).max() <= 2e-2 * np.abs(paged[real]).max()
    traced = []
    real_fn = attention.dense_causal_attention
    monkeypatch.setattr(attention, "dense_causal_attention",
                        lambda *a, **k: traced.append(1) or real_fn(*a, **k))
    for a, b in zip(mix(monkeypatch, "xla", args, weights=jnp.bfloat16),
                    mix(monkeypatch, "paged", args, weights=jnp.bfloat16)):
        np.testing.assert_array_equal(a, b)
    assert not traced


@pytest.mark.parametrize("broken", ["missing", "signature"])
def test_a_jax_without_the_cudnn_entry_point_is_a_refusal(monkeypatch, broken):
    """The cuDNN call goes through JAX's private entry point: where a JAX lacks it or changed its
    signature, the call is refused as a shape cuDNN refuses (NotImplementedError while tracing,
    so the step takes the paged path), not an ImportError or TypeError that stops the step."""
    import sys
    import types

    fake = types.ModuleType("fused_attention_stablehlo")
    if broken == "signature":
        fake.MaskType = types.SimpleNamespace(CAUSAL=2)
        fake.dot_product_attention = lambda q, k, v, *, scale: q  # no mask_type
    monkeypatch.setitem(sys.modules, "jax._src.cudnn.fused_attention_stablehlo", fake)
    import jax._src.cudnn as cudnn_pkg
    monkeypatch.setattr(cudnn_pkg, "fused_attention_stablehlo", fake, raising=False)
    x = jnp.zeros((4, 2, 8), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="cuDNN attention entry point"):
        dense_causal_attention(x, x, x[..., :4], 0.5, implementation="cudnn")
