"""The overlapped serving loop gives bitwise the lockstep loop's tokens and logits."""

import random

import numpy as np
import pytest

from kvjax.host.scheduler import Request
from kvjax.runner import Runner, RunnerConfig
from kvjax.runner import serving
from kvjax.runner.serving import run_to_completion

FAST = {"xla_backend_optimization_level": 0}
# 13 allocatable blocks of 4 tokens for 5 requests of up to 22 tokens: preemptions happen,
# so the overlapped loop must re-admit requests whose last token is still on the device.
CONFIG = RunnerConfig(block_size=4, num_blocks=14, max_model_len=32, max_num_seqs=3,
                      max_num_batched_tokens=12, token_sizes=(4, 12), poison=True)


def _workload(seed=3):
    # Prompts of 9-18 tokens against a 12-token budget: prefill chunks that sample nothing sit
    # between decode rows that do, so a placeholder's index is not its batch row.
    rng = random.Random(seed)
    return [Request(f"r{i}", [rng.randrange(1, 200) for _ in range(rng.randint(9, 18))],
                    max_tokens=10, arrival_step=rng.randint(0, 3)) for i in range(5)]


def _serve(runner, overlap):
    runner.reset()
    sched = CONFIG.make_scheduler()
    for r in _workload():
        sched.add_request(r)
    stats = run_to_completion(sched, runner, overlap=overlap)
    done = {r.req_id: r for r in sched.finished}
    return stats.steps, sched.num_preemptions, done


@pytest.fixture(scope="module")
def runner():
    r = Runner(CONFIG, compiler_options=FAST)
    r.precompile()
    return r


def check_overlap_is_bitwise_the_lockstep_loop(runner):
    steps_a, pre_a, a = _serve(runner, overlap=False)
    steps_b, pre_b, b = _serve(runner, overlap=True)
    assert pre_a > 0, "the workload must preempt (re-admission path)"
    assert (steps_a, pre_a) == (steps_b, pre_b)
    assert sorted(a) == sorted(b) == [f"r{i}" for i in range(5)]
    for rid in a:
        assert a[rid].output == b[rid].output, rid
        assert serving.PENDING_TOKEN not in b[rid].output
        la, lb = np.stack(a[rid].logits), np.stack(b[rid].logits)
        assert la.shape == lb.shape and np.array_equal(la.view(np.uint32), lb.view(np.uint32)), rid
    assert runner.guard.serving_compiles + runner.guard.serving_traces == 0


def test_overlap_is_bitwise_the_lockstep_loop(runner):
    check_overlap_is_bitwise_the_lockstep_loop(runner)


def test_overlap_writing_values_by_placeholder_order_is_caught(runner, monkeypatch):
    """Planted (issue 25): the overlapped loop writes the k-th sampled row to the k-th placeholder
    instead of the placeholder's own batch row; the bitwise comparison fails."""

    def by_order(step):
        result = step.output.fetch()
        for d, placeholders in step.placeholders.items():
            out = result.outputs[d]
            for k, (req, i, _) in enumerate(placeholders):
                req.output[i] = int(out.sampled[k, 0])
                req.logits.append(out.logits[k])

    monkeypatch.setattr(serving, "_resolve", by_order)
    with pytest.raises(AssertionError):
        check_overlap_is_bitwise_the_lockstep_loop(runner)


def test_overlap_refuses_speculative_decoding_and_unknown_modes(runner):
    with pytest.raises(ValueError, match="num_speculative_tokens == 0"):
        serving.check_overlap_supported(2)
    with pytest.raises(ValueError, match=r"overlap must be True or False, got 'async'"):
        run_to_completion(CONFIG.make_scheduler(), runner, overlap="async")


def test_a_readmitted_request_waits_for_its_pending_tokens():
    """A re-admitted request is packed with its real tokens, never with placeholders."""
    from types import SimpleNamespace

    req = Request("r", [5, 6], max_tokens=4, output=[7, serving.PENDING_TOKEN])
    req.row = 2
    plan = SimpleNamespace(added=[(2, req.tokens, 2)], scheduled=[SimpleNamespace(req=req)])
    assert serving._needs_values({0: plan, 1: None})
    req.output[1] = 9  # what resolving the step in flight writes
    serving._refresh_added({0: plan, 1: None})
    assert plan.added == [(2, [5, 6, 7, 9], 2)] and not serving._needs_values({0: plan})


def test_resolve_refuses_a_row_that_sampled_other_than_one_token():
    """The overlapped loop assumed one token per row; a step that says otherwise is an error
    naming the row, and nothing is written for any row."""
    from types import SimpleNamespace

    from kvjax.runner.runner import StepOutput, StepResult

    reqs = [Request(f"r{i}", [5], max_tokens=4, output=[serving.PENDING_TOKEN]) for i in range(3)]
    out = StepOutput(sampled=np.array([[7], [8], [9]], np.int32), num_sampled=np.array([1, 2, 1], np.int32),
                     logits=np.zeros((3, 4), np.float32))
    step = serving._InFlight(5, {0: SimpleNamespace(step=5)},
                             SimpleNamespace(fetch=lambda: StepResult(None, {0: out})),
                             {0: [(r, 0, b) for b, r in enumerate(reqs)]})
    with pytest.raises(RuntimeError, match=r"step 5 \(rank 0\): batch row 1 sampled 2 tokens, the host assumed 1"):
        serving._resolve(step)
    assert all(r.output == [serving.PENDING_TOKEN] and not r.logits for r in reqs)
    out.num_sampled[1] = 1
    serving._resolve(step)
    assert [r.output for r in reqs] == [[7], [8], [9]] and all(len(r.logits) == 1 for r in reqs)
