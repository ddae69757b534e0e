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

    def always(run, path, spec, k, ctx, *operands_and_backend):
        del run
        *operands, backend = operands_and_backend
        return path(spec, k, ctx, *operands, backend)

    monkeypatch.setattr(ml, "_skippable", always)
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
