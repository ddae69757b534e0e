"""The overlapped serving loop gives bitwise the lockstep loop's tokens and logits."""

import random

import numpy as np
import pytest

from kvjax.cli.demo import serve
from kvjax.host.scheduler import Request
from kvjax.runner import Runner, RunnerConfig
from kvjax.runner import serving
from kvjax.runner.serving import run_to_completion

# What the programs compute is checked, not their speed: XLA compiles at optimisation level 0
# (fast_compiles_module, tests/conftest.py).
pytestmark = pytest.mark.usefixtures("fast_compiles_module")

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


def _serve(runner, overlap, workload=None):
    runner.reset()
    sched = CONFIG.make_scheduler()
    for r in workload or _workload():
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


def _sampled_workload(stop=None):
    """The workload with every other request sampled (temperature, top-k / top-p, its own seed);
    ``stop``: request id -> stop token ids."""
    reqs = _workload()
    for i, r in enumerate(reqs):
        if i % 2:
            r.temperature, r.top_k, r.top_p, r.seed = 0.9, (0, 20)[i % 4 == 1], 0.95, 100 + i
        r.stop_token_ids = tuple((stop or {}).get(r.req_id, ()))
    return reqs


def test_sampled_requests_and_stop_tokens_are_the_same_in_both_loops(runner):
    """Sampling keyed by (seed, position) gives the same tokens lockstep and overlapped; a stop
    token ends a request at its first occurrence in both loops (overlapped: seen one step late,
    the extra token dropped); sampled tokens differ from greedy ones."""
    _, _, greedy = _serve(runner, overlap=False)
    _, _, a = _serve(runner, overlap=False, workload=_sampled_workload())
    assert any(a[r].output != greedy[r].output for r in ("r1", "r3"))
    assert all(a[r].output == greedy[r].output for r in ("r0", "r2", "r4"))
    stops = {"r0": [greedy["r0"].output[3]], "r1": [a["r1"].output[2]]}
    for overlap in (False, True):
        _, _, b = _serve(runner, overlap=overlap, workload=_sampled_workload(stops))
        for rid, req in a.items():
            want = req.output
            if rid in stops:
                want = want[: want.index(stops[rid][0]) + 1]
            assert b[rid].output == want, (overlap, rid)
            assert len(b[rid].logits) == len(want)


def test_sampled_requests_match_the_reference_sampler(runner):
    """serve() checks a sampled request by drawing from the dense reference's logits with the same
    seed and positions: identical tokens."""
    report, _ = serve(CONFIG, _sampled_workload(), runner=runner, progress_stream=None)
    assert report.all_match, {k: v for k, v in report.requests.items() if not v["matches_reference"]}
