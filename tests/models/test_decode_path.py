"""Decode-only steps compile no prefill path (issue 24 item 2).

A step whose rows all decode runs in a decode-only bucket (:mod:`kvjax.host.buckets`), whose
program has ``ctx.decode_only`` (its staging takes no prefilling row): ``mamba_mixer`` then runs only its decode path
(``causal_conv1d_update`` + ``selective_state_update``); a mixed bucket's program runs both
paths, each over the whole batch, with no conditional. Which kernels ran is observable at run
time: each kernel is wrapped (monkeypatched in ``kvjax.models.mamba_layer``) with a
``jax.debug.callback`` that counts its executions. The runner serves a workload with
prefill-only, mixed and decode-only steps, and the counts per step are checked against the
step's bucket.

Planted (by hand, then restored): ``mamba_mixer`` ignoring ``ctx.decode_only`` ->
``test_decode_only_steps_run_no_scan`` fails; the scheduler choosing mixed buckets for
decode steps -> the same test fails (decode steps in mixed buckets); a decode-only program
that drops the decode path's outputs -> ``test_decode_only_programs_match_mixed`` fails.
"""

from __future__ import annotations

import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax.models.mamba_layer as ml
from kvjax.host.scheduler import Request
from kvjax.runner import Runner, RunnerConfig
from kvjax.testing.fast_compile import FAST_COMPILER_OPTIONS


TOL = 1e-5
FAST = FAST_COMPILER_OPTIONS  # kvjax.testing.fast_compile (also in XLA_FLAGS, tests/conftest.py)
# One token size: its decode-only and its mixed bucket are the two programs compared here (a second
# size would add a third compile and no other kind of step).
CONFIG = RunnerConfig(block_size=4, num_blocks=20, max_model_len=32, max_num_seqs=3,
                      max_num_batched_tokens=12, token_sizes=(12,))
PATHS = {
    "causal_conv1d_varlen": "prefill",
    "selective_scan_varlen": "prefill",
    "causal_conv1d_update": "decode",
    "selective_state_update": "decode",
}


def _count_kernels(monkeypatch, counts):
    for name in PATHS:
        orig = getattr(ml, name)

        def wrapped(*a, _orig=orig, _name=name, **kw):
            out = _orig(*a, **kw)
            leaf = jax.tree.leaves(out)[0]
            jax.debug.callback(lambda _x, n=_name: counts.update([n]), leaf.reshape(-1)[0])
            return out

        monkeypatch.setattr(ml, name, wrapped)


def _workload():
    # a alone (prefill only), then a decoding while b prefills (mixed), then decodes only.
    return [Request("a", [3, 4, 5], 8, 0), Request("b", list(range(10, 20)), 3, 2)]


def test_decode_only_steps_run_no_scan(monkeypatch):
    counts = collections.Counter()
    _count_kernels(monkeypatch, counts)
    runner = Runner(CONFIG, compiler_options=FAST)
    runner.precompile()
    runner.warm_up()
    assert any(b.decode_only for b in runner.buckets.buckets)
    n_mamba = None
    seen = collections.Counter()
    sched = runner.config.make_scheduler()
    for r in _workload():
        sched.add_request(r)
    while sched.has_work:
        plan = sched.schedule()
        if plan is None:
            continue
        kinds = {("decode" if s.req.is_decoding else "prefill") for s in plan.scheduled}
        counts.clear()
        out = runner.execute(plan)
        jax.effects_barrier()
        sched.update(plan, out.sampled, out.num_sampled, out.logits)
        ran = {path for name, path in PATHS.items() if counts[name]}
        assert plan.bucket.decode_only == (kinds == {"decode"}), (plan.step, kinds, plan.bucket)
        assert ran == ({"decode"} if kinds == {"decode"} else {"prefill", "decode"}), (plan.step, kinds, dict(counts))
        per = set(counts.values())
        assert len(per) == 1, dict(counts)  # every kernel that ran, once per Mamba layer
        n_mamba = n_mamba or per.pop()
        seen[frozenset(kinds)] += 1
    assert n_mamba and n_mamba >= 1
    # the workload had all three kinds of step
    assert seen[frozenset({"prefill"})] and seen[frozenset({"decode"})]
    assert seen[frozenset({"prefill", "decode"})], seen


def _serve_in(runner, requests, mixed_only: bool):
    """Serves ``requests``; per step: outputs. ``mixed_only``: every step in a mixed bucket."""
    runner.precompile()
    runner.warm_up()
    sched = runner.config.make_scheduler()
    for r in requests:
        sched.add_request(r)
    steps = []
    while sched.has_work:
        plan = sched.schedule()
        if plan is None:
            continue
        bucket = runner.buckets.bucket_for(plan.bucket.num_tokens) if mixed_only else plan.bucket
        out = runner.step(plan, bucket).outputs[runner.local_ranks[0]]
        steps.append((plan.bucket.decode_only, out))
        sched.update(plan, out.sampled, out.num_sampled, out.logits)
    return steps


@pytest.mark.parametrize("backend", ["auto", "pallas_gpu"])
def test_decode_only_programs_match_mixed(backend):
    """The same workload with decode steps in decode-only buckets and with every step in a mixed
    bucket: tokens identical, logits and pools within float32 rounding (XLA fuses and orders the
    two programs' float32 arithmetic differently; the differences are a few ulps). With the GPU
    kernels (interpreted) the decode-only step's conv and SSM read their operands as columns of
    the projection in place, where the mixed step gathers them."""
    runner = Runner(dataclasses.replace(CONFIG, backend=backend), compiler_options=FAST)
    split = _serve_in(runner, _workload(), mixed_only=False)
    state_split = [np.asarray(x) for x in jax.tree.leaves(runner.read_state().pools)]
    runner.reset()  # the initial device state again; its executables (every bucket's) compiled once
    mixed = _serve_in(runner, _workload(), mixed_only=True)
    state_mixed = [np.asarray(x) for x in jax.tree.leaves(runner.read_state().pools)]
    assert len(split) == len(mixed) >= 4
    assert sum(d for d, _ in split) >= 2  # decode-only steps ran
    for (_, a), (_, b) in zip(split, mixed):
        np.testing.assert_array_equal(a.sampled, b.sampled)
        np.testing.assert_array_equal(a.num_sampled, b.num_sampled)
        np.testing.assert_allclose(a.logits, b.logits, rtol=0, atol=TOL)
    assert len(state_split) == len(state_mixed)
    for x, y in zip(state_split, state_mixed):
        np.testing.assert_allclose(x, y, rtol=0, atol=TOL)


def test_decode_only_bucket_refuses_a_prefilling_plan():
    """Packing a plan with a prefilling row into a decode-only bucket is a ValueError naming the
    requests (its prefill tokens would otherwise run through no Mamba path)."""
    runner = Runner(CONFIG, compiler_options=FAST)
    sched = runner.config.make_scheduler()
    sched.add_request(Request("a", [3, 4, 5], 4, 0))
    plan = sched.schedule()
    assert not plan.bucket.decode_only
    decode = runner.buckets.bucket_for(plan.bucket.num_tokens, decode_only=True)
    with pytest.raises(ValueError, match=r"does not hold"):
        runner.pack(plan, decode)
    # a plan that claims a decode-only bucket (a scheduler bug) is refused by what its rows are
    with pytest.raises(ValueError, match=r"decode-only .*\['a'\] are prefilling"):
        runner.pack(dataclasses.replace(plan, bucket=decode))


@pytest.mark.parametrize("fp8,sm_scale", [(False, None), (True, None), (False, 0.3)])
def test_flash_attention_op_is_the_models_gather_bitwise(fp8, sm_scale):
    """``live_paged_attention`` (``pallas_kernels.paged_attention``, reference flavour) equals the
    model's ``paged_attention`` bit for bit (jitted, float32; fp8 caches with a scale)."""
    from kvjax.models.attention import live_paged_attention, paged_attention
    from kvjax.models.step_context import StepContext

    rng = np.random.default_rng(0)
    T, R, W, bs, Hq, Hkv, D, nb = 9, 3, 4, 4, 4, 2, 16, 13
    q = jnp.asarray(rng.standard_normal((T, Hq, D)), jnp.float32)
    dtype = jnp.float8_e4m3fn if fp8 else jnp.float32
    kc = jnp.asarray(rng.standard_normal((nb, bs, Hkv, D)), jnp.float32).astype(dtype)
    vc = jnp.asarray(rng.standard_normal((nb, bs, Hkv, D)), jnp.float32).astype(dtype)
    bt = jnp.asarray(rng.integers(1, nb, (R, W)), jnp.int32)
    seq = jnp.asarray([5, 16, 0], jnp.int32)
    row = jnp.asarray([0, 0, 0, 1, 1, 1, 1, 3, 3], jnp.int32)
    pos = jnp.asarray([2, 3, 4, 12, 13, 14, 15, 0, 0], jnp.int32)
    scale = 0.7 if fp8 else None

    class Ctx:  # the fields live_paged_attention reads
        block_table, seq_lens, positions, token_row = bt, seq, pos, row

    old = jax.jit(lambda *a: paged_attention(*a, k_scale=scale, v_scale=scale, sm_scale=sm_scale))(
        q, kc, vc, bt, seq, pos, row)
    new = jax.jit(lambda q, kc, vc: live_paged_attention(
        q, kc, vc, Ctx, backend="reference", k_scale=scale, v_scale=scale, sm_scale=sm_scale))(q, kc, vc)
    assert new.dtype == old.dtype == jnp.float32
    assert np.asarray(new).tobytes() == np.asarray(old).tobytes()
    assert np.abs(np.asarray(old)).sum() > 0


def _granite_like():
    from kvjax.models.attention import AttnSpec
    from kvjax.models.hf.hybrid import Block, HybridConfig, HybridModel
    from kvjax.models.mamba_layer import MambaSpec
    from kvjax.models.moe import MLPSpec

    return HybridModel(HybridConfig(
        "GraniteMoeHybridForCausalLM", vocab_size=96, d_model=32, rms_eps=1e-5,
        blocks=(Block("mamba"), Block("attn"), Block("mlp")), attn=AttnSpec(4, 2, 16),
        mamba=MambaSpec(4, 8, 8, conv_width=4), mlp=MLPSpec(48)))


def _deepseek_like():
    from kvjax.models.hf import deepseek_v3 as ds

    return ds.DeepseekV3(ds.config_from_hf(dict(
        vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1,
        n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=16,
        qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=8, n_group=2, topk_group=1,
        num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=64)))


@pytest.mark.parametrize("make", [_granite_like, _deepseek_like], ids=["hybrid", "deepseek"])
def test_one_token_steps_run_two_rows(monkeypatch, make):
    """Off the CPU a one-token step runs its residual stream, norms and products as two rows (the
    second zero and masked; ``attention.row_count``): the hybrid's conv and SSM read the token's
    row of the two-row projection in place, DeepSeek's attention the token's rows of q and the
    latent, its MoE routes the masked row to no expert. Forced on the CPU
    (``PAD_ONE_ROW_ON_CPU``) with the GPU kernels interpreted, a Granite-like hybrid (Mamba,
    attention, MLP) and a DeepSeek-V3-like model (MLA, a dense layer, a grouped-routed MoE layer)
    serve the same tokens as with one row, logits and pools within float32 rounding (XLA orders a
    two-row norm's sums otherwise). A token budget of one: every step is a one-token step, the
    prompt's (one-token prefill chunks, the mixed bucket) and the decodes (the decode-only
    bucket), and a runner compiles those two programs only (a second, larger token size would
    compile two more programs, the same with one or two rows). Planted: the token placed in the
    second row -> fails."""
    import kvjax.models.attention as attention

    model = make()
    config = RunnerConfig(model=model, block_size=4, num_blocks=37, max_model_len=32, max_num_seqs=2,
                          max_num_batched_tokens=1, token_sizes=(1,), backend="pallas_gpu")

    def serve(two_rows):
        monkeypatch.setattr(attention, "PAD_ONE_ROW_ON_CPU", two_rows)
        runner = Runner(config, compiler_options=FAST)
        steps = _serve_in(runner, [Request("a", [3, 4, 5, 6, 7], 6, 0)], mixed_only=False)
        return steps, [np.asarray(x) for x in jax.tree.leaves(runner.read_state().pools)]

    one, pools_one = serve(False)
    two, pools_two = serve(True)
    assert attention.row_count(1) == 2  # still forced: the second run padded
    assert sum(1 for d, _ in two if d) >= 4 and sum(1 for d, _ in two if not d) >= 4  # decodes, prefill chunks
    assert all(out.sampled.shape[0] == 1 for _, out in two)  # every step a one-token step
    for (_, a), (_, b) in zip(one, two):
        np.testing.assert_array_equal(a.sampled, b.sampled)
        np.testing.assert_allclose(a.logits, b.logits, rtol=0, atol=TOL)
    for x, y in zip(pools_one, pools_two):
        np.testing.assert_allclose(x, y, rtol=0, atol=TOL)
