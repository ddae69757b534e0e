"""The bucketed runner end to end: parity with the dense reference, poison, fp8,
speculative decoding, preemption, row reuse, dummy steps and no serving-time compiles; the
overlapped serving loop gives bitwise the lockstep loop's tokens and logits."""

import dataclasses
import json
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from kvjax import NULL_BLOCK_ID
from kvjax.host.buckets import BatchTooLargeError, BucketSpec, default_token_sizes
from kvjax.runner.compile_guard import ServingCompileError, ServingGuard
from kvjax.runner.packing import pack, pack_device, spec_of, unpack
from kvjax.runner import Runner, RunnerConfig, serving
from kvjax.runner.serving import run_to_completion
from kvjax.host.scheduler import Request
from kvjax.cli.demo import serve
from kvjax.cli.workload import WorkloadError, validate_workload
from kvjax.testing.fast_compile import FAST_COMPILER_OPTIONS


FAST = FAST_COMPILER_OPTIONS  # kvjax.testing.fast_compile (also in XLA_FLAGS, tests/conftest.py)

BASE = RunnerConfig(block_size=4, num_blocks=14, max_model_len=32, max_num_seqs=3,
                    max_num_batched_tokens=12, token_sizes=(4, 12), poison=True)
SPEC_FP8 = RunnerConfig(block_size=4, num_blocks=40, max_model_len=32, max_num_seqs=3,
                        max_num_batched_tokens=12, token_sizes=(3, 12), num_speculative_tokens=2,
                        kv_cache_dtype="fp8", poison=True)


@pytest.fixture(scope="module")
def base_runner():
    r = Runner(BASE, compiler_options=FAST)
    r.precompile()
    return r


@pytest.fixture(scope="module")
def spec_runner():
    r = Runner(SPEC_FP8, compiler_options=FAST)
    r.precompile()
    return r


def assert_report_ok(report):
    bad = {k: v for k, v in report.requests.items() if not v["matches_reference"]}
    assert not bad, bad
    assert report.serving_compiles == 0
    assert report.nan_count == 0


requests_strategy = st.lists(
    st.tuples(
        st.lists(st.integers(0, 255), min_size=1, max_size=10),
        st.integers(1, 8),
        st.integers(0, 4),
    ),
    min_size=1,
    max_size=4,
)


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(reqs=requests_strategy)
def test_random_workloads_match_dense_reference_with_poison(base_runner, reqs):
    requests = [Request(f"q{i}", p, m, a) for i, (p, m, a) in enumerate(reqs)]
    report, _ = serve(BASE, requests, runner=base_runner, progress_stream=None)
    assert_report_ok(report)
    assert all(len(r["output"]) == m for r, (_, m, _) in zip(report.requests.values(), reqs))


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(reqs=requests_strategy)
def test_random_workloads_speculative_fp8_poison_match_reference(spec_runner, reqs):
    requests = [Request(f"s{i}", p * 2, m, a) for i, (p, m, a) in enumerate(reqs)]  # repeats: drafts hit
    report, _ = serve(SPEC_FP8, requests, runner=spec_runner, progress_stream=None)
    assert_report_ok(report)


def test_preemption_by_recompute_keeps_outputs(base_runner):
    # 3 requests of up to 28 tokens need up to 21 blocks; 13 exist, so some are preempted.
    rng = random.Random(1)
    requests = [Request(f"p{i}", [rng.randrange(256) for _ in range(14)], 14, 0) for i in range(3)]
    report, _ = serve(BASE, requests, runner=base_runner, progress_stream=None)
    assert report.preemptions > 0
    assert_report_ok(report)


def test_speculative_decoding_fp8_poison_matches_reference_and_accepts_drafts(spec_runner):
    # Repetitive prompts make the n-gram drafter propose drafts the model may accept.
    prompts = [[7, 8, 9] * 4, [1, 2] * 5, [50, 60, 70, 80] * 2]
    requests = [Request(f"s{i}", p, 10, i) for i, p in enumerate(prompts)]
    report, runner = serve(SPEC_FP8, requests, runner=spec_runner, progress_stream=None)
    assert_report_ok(report)
    assert all(len(r["output"]) == 10 for r in report.requests.values())
    assert report.drafts_proposed > 0  # speculation really ran (acceptance depends on the weights)


@pytest.mark.parametrize("good_drafts", [2, 1, 0])
def test_accepted_and_rejected_drafts_give_the_greedy_output(spec_runner, good_drafts):
    """A drafter that knows the model's greedy continuation gets its drafts accepted; one that
    corrupts the later drafts gets them rejected at the right place. Either way the output is
    the plain greedy one, and KV and Mamba states past a rejection do not leak."""
    runner = spec_runner
    L = SPEC_FP8.max_model_len

    def greedy_next(tokens):
        toks = np.zeros((L,), np.int32)
        toks[: len(tokens)] = tokens
        return int(np.asarray(runner.dense_reference(jnp.asarray(toks)))[len(tokens) - 1].argmax())

    def drafter(tokens, k):
        out, seq = [], list(tokens)
        for i in range(k):
            t = greedy_next(seq)
            out.append(t if i < good_drafts else (t + 1) % 256)
            seq.append(t)
        return out

    requests = [Request("g0", [5, 6, 7, 8], 9, 0), Request("g1", [200, 3], 7, 0)]
    report, _ = serve(SPEC_FP8, requests, runner=runner, progress_stream=None, drafter=drafter)
    assert_report_ok(report)
    assert report.drafts_proposed > 0
    if good_drafts == 2:
        assert report.drafts_accepted == report.drafts_proposed
    elif good_drafts == 0:
        assert report.drafts_accepted == 0
    else:
        assert 0 < report.drafts_accepted < report.drafts_proposed


def test_immediate_row_reuse(base_runner):
    """A request that arrives right after another finishes gets its row at once (LIFO)."""
    c = BASE
    sched = c.make_scheduler()
    sched.add_request(Request("a", [3, 4, 5], 2, 0))
    sched.add_request(Request("b", [9, 9], 3, 3))
    base_runner.warm_up()
    rows = {}
    freed = None
    while sched.has_work:
        plan = sched.schedule()
        if plan is None:
            continue
        for row, toks, _ in plan.added:
            rows[tuple(toks)] = row
        if plan.cleared_rows:
            freed = plan.cleared_rows[-1]
        out = base_runner.execute(plan)
        sched.update(plan, out.sampled, out.num_sampled, out.logits)
    assert rows[(9, 9)] == rows[(3, 4, 5)] == freed


def _bits(tree):
    return [np.asarray(x).view(np.uint8).copy() for x in jax.tree.leaves(tree)]


def test_dummy_step_leaves_every_cache_and_state_byte_unchanged(base_runner):
    # Serve something first so rows, tables and caches hold real data; block 0 is NaN (poison).
    serve(BASE, [Request("d", [1, 2, 3, 4, 5], 3, 0)], runner=base_runner, progress_stream=None)
    key0 = np.asarray(base_runner.read_state().pools["key[0]"][NULL_BLOCK_ID])
    assert np.isnan(key0).all()
    for bucket in base_runner.buckets.buckets:
        before = _bits(base_runner.read_state())
        out = base_runner.dummy_step(bucket)
        after = _bits(base_runner.read_state())
        assert len(before) == len(after) > 10
        assert all((a == b).all() for a, b in zip(before, after)), bucket
        assert not out.outputs[0].num_sampled.any()


def test_strict_guard_turns_a_serving_time_compile_into_an_error():
    guard = ServingGuard(strict=True)
    with pytest.raises(ServingCompileError, match="at serving time"):
        with guard.serving():
            jax.jit(lambda x: x * 3 + 1)(jnp.arange(7.0))
    lenient = ServingGuard(strict=False)
    with pytest.warns(RuntimeWarning, match="compile"):
        with lenient.serving():
            jax.jit(lambda x: x * 5 - 2)(jnp.arange(9.0))
    assert lenient.serving_compiles >= 1


def test_unknown_bucket_is_an_error_not_a_compile(base_runner):
    from kvjax.host.buckets import Bucket

    with pytest.raises(RuntimeError, match="was not precompiled"):
        base_runner.dummy_step(Bucket(7, 3, 7))


def test_buckets():
    assert default_token_sizes(32) == (1, 2, 4, 8, 16, 24, 32)
    assert all(s % 3 == 0 or s == 20 for s in default_token_sizes(20, 2))
    spec = BucketSpec((4, 16, 32), max_num_seqs=4, num_speculative_tokens=1)
    assert spec.choose(3, 2, 3).num_tokens == 4
    assert spec.choose(5, 4, 8).num_tokens == 16  # 8 logits need R*(1+k) >= 8
    with pytest.raises(BatchTooLargeError, match="the scheduler must split it"):
        spec.choose(33, 1, 1)
    with pytest.raises(ValueError, match="distinct ascending"):
        BucketSpec((8, 4), 2)


def test_decode_only_buckets():
    """Decode-only buckets exist for the sizes a decode-only step can have (up to the first size
    holding ``max_num_seqs * (1 + k)`` tokens); choose picks one only for a decode-only step and
    falls back to the mixed bucket; join is decode-only only if every bucket joined is."""
    spec = BucketSpec((4, 16, 32), max_num_seqs=4, num_speculative_tokens=1)  # decode steps: <= 8 tokens
    assert [(b.num_tokens, b.decode_only) for b in spec.buckets] == [
        (4, True), (4, False), (16, True), (16, False), (32, False)]
    assert spec.choose(3, 2, 3, decode_only=True) == spec.bucket_for(4, decode_only=True)
    assert spec.choose(3, 2, 3) == spec.bucket_for(4)
    assert spec.choose(20, 4, 8, decode_only=True) == spec.bucket_for(32)  # no decode-only bucket that big
    d4, m4, d16 = spec.bucket_for(4, True), spec.bucket_for(4), spec.bucket_for(16, True)
    assert m4.holds(d4) and not d4.holds(m4) and d16.holds(d4) and not d16.holds(m4)
    assert spec.join([d4, d16]) == d16
    assert spec.join([d4, m4]) == m4
    assert spec.join([d16, m4]) == spec.bucket_for(16)
    with pytest.raises(ValueError, match="at least one"):
        spec.join([])


def test_pack_roundtrip_under_jit():
    tree = {"a": np.arange(6, dtype=np.int32).reshape(2, 3), "b": np.array([True, False]),
            "c": np.array([1.5, -0.0, np.nan], np.float32)}
    buf, spec = pack(tree)
    out = jax.jit(lambda b: unpack(b, spec))(buf)
    np.testing.assert_array_equal(out["a"], tree["a"])
    np.testing.assert_array_equal(out["b"], tree["b"])
    np.testing.assert_array_equal(np.asarray(out["c"]).view(np.uint32), tree["c"].view(np.uint32))


def test_pack_device_and_host_unpack():
    """pack_device (under jit) is pack; unpack of a numpy buffer is unpack."""
    tree = {"a": np.arange(6, dtype=np.int32).reshape(2, 3), "b": np.array([True, False]),
            "c": np.array([1.5, -0.0, np.nan], np.float32), "d": np.zeros((2, 0), np.int32)}
    buf, spec = pack(tree)
    assert spec_of(tree) == spec
    np.testing.assert_array_equal(np.asarray(jax.jit(pack_device)(tree)), buf)
    host = unpack(buf, spec)
    assert host["b"].dtype == np.bool_ and host["d"].shape == (2, 0)
    np.testing.assert_array_equal(host["c"].view(np.uint32), tree["c"].view(np.uint32))


@pytest.mark.parametrize(
    "workload, match",
    [
        ({"requests": [{"id": "a", "prompt": [], "max_tokens": 2}]}, "prompt must be a non-empty list"),
        ({"requests": [{"id": "a", "prompt": [1, 256], "max_tokens": 2}]}, r"prompt\[1\]=256 is not a token id in \[0, 256\)"),
        ({"requests": [{"id": "a", "prompt": [1] * 40, "max_tokens": 2}]}, "prompt has 40 tokens; max_model_len=32"),
        ({"requests": [{"id": "a", "prompt": [1], "max_tokens": 0}]}, "max_tokens must be a positive int, got 0"),
        ({"requests": [{"id": "a", "prompt": [1], "max_tokens": 1}, {"id": "a", "prompt": [2], "max_tokens": 1}]}, "duplicate request id 'a'"),
        ({"requests": []}, "no requests"),
        ({"reqs": []}, '"requests" list'),
    ],
)
def test_bad_workloads_are_rejected(workload, match):
    with pytest.raises(WorkloadError, match=match):
        validate_workload(workload, vocab_size=256, max_model_len=32)


def test_cli_rejects_bad_workload_before_any_compile(tmp_path, monkeypatch, capsys):
    from kvjax.cli import main as cli
    import kvjax.runner

    def boom(*a, **k):
        raise AssertionError("compiled before validating the workload")

    monkeypatch.setattr(kvjax.runner.Runner, "precompile", boom)
    path = tmp_path / "w.json"
    path.write_text(json.dumps({"requests": [{"id": "x", "prompt": [1, 2, 999], "max_tokens": 3}]}))
    assert cli.main(["demo", "--workload", str(path)]) == 2
    assert "prompt[2]=999" in capsys.readouterr().err
    assert cli.main(["demo", "--workload", str(tmp_path / "missing.json")]) == 2


# ------------------------------------------------------------------ the overlapped serving loop
# The overlapped serving loop gives bitwise the lockstep loop's tokens and logits, on the BASE
# runner: 13 allocatable blocks of 4 tokens for 5 requests of up to 22 tokens, so preemptions
# happen and the overlapped loop must re-admit requests whose last token is still on the device.
CONFIG = BASE


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


@pytest.fixture
def runner(base_runner):
    """The module's BASE runner (the overlapped loop's tests were tests/runner/test_serving.py, whose
    runner had BASE's settings: one compile serves both)."""
    return base_runner


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


@pytest.mark.parametrize("field, value, match", [
    ("block_size", 0, "block_size must be a positive int, got 0"),
    ("max_model_len", True, "max_model_len must be a positive int, got True"),
    ("max_num_seqs", 2.0, "max_num_seqs must be a positive int, got 2.0"),
    ("num_blocks", 1, r"num_blocks must be an int >= 2 \(block 0 is reserved\), got 1"),
    ("max_new_requests_per_step", 0, "max_new_requests_per_step must be a positive int, got 0"),
    ("num_speculative_tokens", -1, "num_speculative_tokens must be a non-negative int, got -1"),
])
def test_config_sizes_are_refused_by_name(field, value, match):
    """RunnerConfig's sizes follow the host's one size rule (``buckets.check_size``): a bool or a
    float is not a size, numpy ints are taken as plain ints."""
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(BASE, **{field: value})
    got = dataclasses.replace(BASE, max_num_seqs=np.int64(3))
    assert type(got.max_num_seqs) is int and got.max_num_seqs == 3
