"""The Mamba mixer runs only the paths a step needs (issue 24 item 2).

``mamba_mixer`` puts its prefill path (``causal_conv1d_varlen`` + ``selective_scan_varlen``)
and its decode path (``causal_conv1d_update`` + ``selective_state_update``) each under a
``lax.cond`` on "the step has a row of that kind". Which branch ran is observable at run
time: each kernel is wrapped (monkeypatched in ``kvjax.models.mamba_layer``) with a
``jax.debug.callback`` that counts its executions; a callback inside a branch that is not
taken never runs. The runner then serves a workload with prefill-only, mixed and
decode-only steps, and the counts per step are checked against the step's rows.

Planted (by hand, then restored): ``_skippable`` returning ``path(...)`` without the cond ->
``test_decode_only_steps_run_no_scan`` fails (the scan runs on every decode-only step, the
decode kernels on every prefill-only step); the outputs test passes either way (it checks
that the cond changes no token and moves logits and pools only by float32 rounding).
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax.models.mamba_layer as ml
from kvjax.host.scheduler import Request
from kvjax.runner import Runner, RunnerConfig

TOL = 1e-5
FAST = {"xla_backend_optimization_level": 0}
CONFIG = RunnerConfig(block_size=4, num_blocks=20, max_model_len=32, max_num_seqs=3,
                      max_num_batched_tokens=12, token_sizes=(4, 12))
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


def _serve(runner, requests):
    """Serves ``requests``; per step: (kinds of rows, outputs)."""
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
        kinds = {("decode" if s.req.is_decoding else "prefill") for s in plan.scheduled}
        out = runner.execute(plan)
        jax.effects_barrier()
        steps.append((kinds, out))
        sched.update(plan, out.sampled, out.num_sampled, out.logits)
    return steps


def _workload():
    # a alone (prefill only), then a decoding while b prefills (mixed), then decodes only.
    return [Request("a", [3, 4, 5], 8, 0), Request("b", list(range(10, 20)), 3, 2)]


def test_decode_only_steps_run_no_scan(monkeypatch):
    counts = collections.Counter()
    _count_kernels(monkeypatch, counts)
    runner = Runner(CONFIG, compiler_options=FAST)
    runner.precompile()
    runner.warm_up()
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
        assert ran == kinds, (plan.step, kinds, dict(counts))
        per = set(counts.values())
        assert len(per) == 1, dict(counts)  # every kernel that ran, once per Mamba layer
        n_mamba = n_mamba or per.pop()
        seen[frozenset(kinds)] += 1
    assert n_mamba and n_mamba >= 1
    # the workload had all three kinds of step
    assert seen[frozenset({"prefill"})] and seen[frozenset({"decode"})]
    assert seen[frozenset({"prefill", "decode"})], seen


def test_skipping_changes_no_bit(monkeypatch):
    """Tokens of every step identical, logits and pools within float32 rounding, with the conds
    and with both paths always run. (Not bitwise on the CPU: XLA compiles a conditional's
    branches as separate computations, so the paths' float32 arithmetic is fused and
    ordered differently; the differences are a few ulps.)"""
    runner = Runner(CONFIG, compiler_options=FAST)
    with_cond = _serve(runner, _workload())
    state_cond = [np.asarray(x) for x in jax.tree.leaves(runner.read_state().pools)]

    monkeypatch.setattr(ml, "SKIP_IDLE_PATHS", False)  # KVJAX_MAMBA_SKIP_IDLE_PATHS=0: both paths always
    runner = Runner(CONFIG, compiler_options=FAST)
    without = _serve(runner, _workload())
    state_without = [np.asarray(x) for x in jax.tree.leaves(runner.read_state().pools)]
    assert len(with_cond) == len(without) >= 4
    for (k1, a), (k2, b) in zip(with_cond, without):
        assert k1 == k2
        np.testing.assert_array_equal(a.sampled, b.sampled)
        np.testing.assert_array_equal(a.num_sampled, b.num_sampled)
        np.testing.assert_allclose(a.logits, b.logits, rtol=0, atol=TOL)
    assert len(state_cond) == len(state_without)
    for x, y in zip(state_cond, state_without):
        np.testing.assert_allclose(x, y, rtol=0, atol=TOL)


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
