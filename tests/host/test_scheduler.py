"""The host scheduler without a model: progress, preemption policy, capacity rule, validation."""

import json
import random

import numpy as np
import pytest
from hypothesis import event, given, settings, strategies as st

from kvjax.host.scheduler import Request, RequestTooLargeError, peak_tokens
from kvjax.state import step_progress
from kvjax.runner import Runner, RunnerConfig


def drive(sched, max_steps: int, seed: int = 0) -> int:
    """Run ``sched`` with random samples and acceptances until idle; returns the steps taken.

    Each step checks that every scheduled row is a running request with a row, that rows
    and the block pool are consistent, and that no two live requests share a block.
    """
    rng = random.Random(seed)
    steps = 0
    while sched.has_work:
        if steps >= max_steps:
            raise AssertionError(
                f"no completion after {steps} steps: {len(sched.finished)} finished, "
                f"{sched.num_preemptions} preemptions"
            )
        steps += 1
        plan = sched.schedule()
        if plan is None:
            continue
        R, S = plan.bucket.num_reqs, 1 + sched.k
        assert plan.num_tokens <= sched.buckets.max_num_tokens
        for s in plan.scheduled:
            assert s.req in sched.running and s.req.row is not None and s.num_tokens > 0
        owned = [b for r in sched.running for ids in r.blocks for b in ids]
        assert len(owned) == len(set(owned)) and not any(sched.pool.is_free(b) for b in owned)
        sched.rows.check()
        sched.pool.check()
        sampled = np.array([[rng.randrange(256) for _ in range(S)] for _ in range(R)], np.int32)
        num_sampled = np.zeros((R,), np.int32)
        for b, s in enumerate(plan.scheduled):
            num_sampled[b] = 1 + rng.randrange(len(s.drafts) + 1)
        before = [(s.req.num_computed, s.req.prefill_len, s.num_tokens) for s in plan.scheduled]
        sched.update(plan, sampled, num_sampled)
        for b, s in enumerate(plan.scheduled):  # accepted drafts never run past max_tokens
            assert len(s.req.output) <= s.req.max_tokens, (s.req.req_id, len(s.req.output))
            if not s.req.finished:  # every row's counter follows the one rule, row by row
                want = int(step_progress(*before[b], int(num_sampled[b]))[1])
                assert s.req.num_computed == want, (b, s.req.req_id, s.req.num_computed, want)
    return steps


def make_sched(block_size=4, num_blocks=6, budget=12, max_num_seqs=4, k=0, max_model_len=32):
    return RunnerConfig(
        block_size=block_size, num_blocks=num_blocks, max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs, num_speculative_tokens=k, max_model_len=max_model_len,
    ).make_scheduler()


def test_drafts_rejected_on_any_row_are_not_computed():
    """A decode step with drafts where each row accepts a different number: every row's
    num_computed follows step_progress (rejected drafts are not computed), not only row 0's."""
    sched = make_sched(block_size=4, num_blocks=40, budget=16, max_num_seqs=4, k=2)
    for i in range(3):
        sched.add_request(Request(f"r{i}", [7, 7, 7, 7], 8))
    step(sched)  # prefill: each samples a 7, so the n-gram drafter proposes 7s
    plan = sched.schedule()
    d = [len(s.drafts) for s in plan.scheduled]
    assert len(d) == 3 and min(d) >= 1
    before = [(s.req.num_computed, s.req.prefill_len, s.num_tokens) for s in plan.scheduled]
    R = plan.bucket.num_reqs
    num_sampled = np.zeros((R,), np.int32)
    num_sampled[:3] = [1 + d[0], 1, 1 + d[2]]  # all drafts accepted / all rejected / all accepted
    sched.update(plan, np.full((R, 1 + sched.k), 7, np.int32), num_sampled)
    got = [s.req.num_computed for s in plan.scheduled]
    assert got == [int(step_progress(*bf, int(n))[1]) for bf, n in zip(before, num_sampled)]
    assert got == [4 + 1 + d[0], 4 + 1, 4 + 1 + d[2]]  # row 1 computed none of its drafts


def test_two_requests_that_each_fit_alone_both_finish():
    # Issue 10 item 1: each needs 3 of the 5 blocks; the newcomer used to preempt the
    # older request forever (161,129 steps, 0 finished).
    sched = make_sched(block_size=4, num_blocks=6, budget=12)
    for rid in ("a", "b"):
        sched.add_request(Request(rid, list(range(1, 12)), 2))
    steps = drive(sched, max_steps=50)
    assert sorted(r.req_id for r in sched.finished) == ["a", "b"]
    assert all(len(r.output) == 2 for r in sched.finished)
    assert steps <= 10


def test_the_newest_request_yields_even_when_it_asks():
    sched = make_sched(block_size=4, num_blocks=6, budget=12)
    a, b = Request("a", list(range(1, 12)), 2), Request("b", list(range(1, 12)), 2)
    sched.add_request(a)
    sched.add_request(b)
    sched.update(plan := sched.schedule(), np.ones((plan.bucket.num_reqs, 1), np.int32),
                 np.ones((plan.bucket.num_reqs,), np.int32))
    sched.schedule()  # b's prefill needs 2 more blocks, 1 is free: b (newest) yields, not a
    assert a.num_preemptions == 0 and b.num_preemptions == 1
    assert sched.running == [a] and sched.waiting[0] is b


workloads = st.fixed_dictionaries({
    "block_size": st.sampled_from([2, 4]),
    "num_blocks": st.integers(3, 9),
    "budget": st.integers(3, 16),
    "max_num_seqs": st.integers(1, 4),
    "k": st.sampled_from([0, 2]),
    "requests": st.lists(
        st.tuples(st.integers(1, 14), st.integers(1, 6), st.integers(0, 3)), min_size=1, max_size=5
    ),
})


@settings(max_examples=100, deadline=None)
@given(w=workloads, seed=st.integers(0, 2**16))
def test_every_workload_whose_requests_fit_alone_finishes(w, seed):
    sched = make_sched(w["block_size"], w["num_blocks"], w["budget"], w["max_num_seqs"], w["k"])
    rng = random.Random(seed)
    accepted = []
    for i, (n, m, arrival) in enumerate(sorted(w["requests"], key=lambda r: r[2])):
        req = Request(f"r{i}", [rng.randrange(1, 9) for _ in range(n)], m, arrival)
        need = -(-peak_tokens(n, m, 32) // w["block_size"])
        if need > w["num_blocks"] - 1:
            with pytest.raises(RequestTooLargeError, match=f"request 'r{i}' needs"):
                sched.add_request(req)
        else:
            sched.add_request(req)
            accepted.append(req)
    bound = 2 + max((a for _, _, a in w["requests"]), default=0) + len(accepted) * sum(
        len(r.prompt) + r.max_tokens for r in accepted
    )
    event(f"{len(accepted)} requests run")
    steps = drive(sched, max_steps=bound, seed=seed)
    event(f"preempted: {sched.num_preemptions > 0}")
    assert {r.req_id for r in sched.finished} == {r.req_id for r in accepted}
    for r in accepted:
        assert len(r.output) == r.max_tokens or len(r.tokens) >= 32
    assert sched.pool.num_used == 0 and len(sched.rows) == 0


def test_a_request_larger_than_the_cache_is_rejected_at_admission():
    sched = make_sched(block_size=8, num_blocks=3)  # 2 usable blocks = 16 tokens
    sched.add_request(Request("fits", list(range(10)), 7))  # 10 + 6 = 16 tokens
    with pytest.raises(RequestTooLargeError) as e:
        sched.add_request(Request("big", list(range(10)), 8))  # 17 tokens
    msg = str(e.value)
    assert "'big'" in msg and "17 tokens" in msg and "3 blocks" in msg and "2 blocks (16 tokens)" in msg
    assert [r.req_id for r in sched.waiting] == ["fits"]


def test_peak_tokens_is_capped_below_max_model_len():
    assert peak_tokens(5, 1, 32) == 5  # one output, never fed back
    assert peak_tokens(5, 100, 32) == 31
    assert peak_tokens(40, 3, 32) == 40  # a prompt longer than the window still needs its blocks


@pytest.mark.parametrize("with_file", [False, True])
def test_cli_rejects_a_request_larger_than_the_cache_before_compiling(tmp_path, monkeypatch, capsys, with_file):
    # `demo --num-blocks 3 --block-size 8` used to hang: the generated requests need more
    # than the 2 usable blocks.
    from kvjax.cli import main as cli

    def boom(*a, **k):
        raise AssertionError("compiled before validating the workload")

    monkeypatch.setattr(Runner, "precompile", boom)
    args = ["demo", "--num-blocks", "3", "--block-size", "8"]
    if with_file:
        path = tmp_path / "w.json"
        path.write_text(json.dumps({"requests": [{"id": "long", "prompt": list(range(1, 15)), "max_tokens": 5}]}))
        args += ["--workload", str(path)]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert "needs" in err and "the cache holds 2 blocks (16 tokens)" in err
    if with_file:
        assert "request 'long' needs 18 tokens" in err


def step(sched, tokens=7):
    plan = sched.schedule()
    R = plan.bucket.num_reqs
    sched.update(plan, np.full((R, 1 + sched.k), tokens, np.int32), np.ones((R,), np.int32))
    return plan


def test_fresh_blocks_are_zeroed_once_and_finished_requests_free_everything():
    sched = make_sched(block_size=4, num_blocks=10, budget=8)
    sched.add_request(Request("a", [1, 2, 3, 4, 5], 3))
    p0 = step(sched)  # prefill 5 tokens: 2 blocks
    assert p0.added == [(p0.scheduled[0].req.row, [1, 2, 3, 4, 5], 5)]
    assert p0.blocks_to_zero == [1, 2] and p0.block_writes == [(p0.scheduled[0].req.row, [[1, 2]], True)]
    sched.add_request(Request("b", [9, 9, 9], 2))
    p1 = step(sched)  # a decodes (no new block), b prefills 3 tokens: block 3
    assert [s.req.req_id for s in p1.scheduled] == ["a", "b"]  # decode windows first
    rows = sorted(s.req.row for s in p1.scheduled)
    assert p1.blocks_to_zero == [3]
    p2 = step(sched)  # a: 3rd token -> done; b: decode -> done
    assert {r.req_id for r in sched.finished} == {"a", "b"} and p2.blocks_to_zero == []
    assert not sched.has_work and sched.pool.num_used == 0
    sched.add_request(Request("c", [5], 1))
    p3 = step(sched)
    assert sorted(p3.cleared_rows) == rows and sorted(p3.freed_blocks) == [1, 2, 3]
    assert p3.blocks_to_zero == [3]  # LIFO: the last freed block is handed out first


def test_a_preempted_request_resumes_with_its_output_as_prompt():
    sched = make_sched(block_size=4, num_blocks=6, budget=12)
    a, b = Request("a", list(range(1, 9)), 6), Request("b", list(range(1, 9)), 6)
    sched.add_request(a)
    sched.add_request(b)
    while b.num_preemptions == 0:
        step(sched)
    assert a.num_preemptions == 0 and b.row is None and b.num_computed == 0
    out = list(b.output)
    while b.row is None or b.is_decoding is False:
        step(sched)
    assert b.prefill_len == 8 + len(out) and b.output[: len(out)] == out


# ------------------------------------------------ refused at add_request / at construction

def _sched(k=0, max_model_len=64, specs=None, num_blocks=64, **kw):
    from kvjax import KVGroupSpec
    from kvjax.host.buckets import BucketSpec
    from kvjax.host.scheduler import Scheduler

    specs = (KVGroupSpec(16, 4),) if specs is None else specs
    return Scheduler(specs, BucketSpec.default(32, 4, k), num_blocks=num_blocks, max_model_len=max_model_len, **kw)


def cdiv_(a, b):
    return -(-a // b)


@pytest.mark.parametrize("max_tokens", [0, -2, 1.5, True, None])
def test_max_tokens_below_one_is_refused(max_tokens):
    # max_tokens=-2 with drafts used to be admitted and keep rows[b][:-2] of a window: rejected drafts
    sched = _sched(k=3)
    with pytest.raises(ValueError, match=rf"request 'a': max_tokens must be a positive int, got {max_tokens!r}"):
        sched.add_request(Request("a", [1, 2, 3, 1, 2, 3], max_tokens))
    assert not sched.has_work


def test_an_empty_prompt_is_refused():
    # used to be scheduled as a 0-token decode row
    sched = _sched()
    with pytest.raises(ValueError, match=r"request 'c': prompt must be a non-empty list of token ids, got \[\]"):
        sched.add_request(Request("c", [], 3))
    assert not sched.has_work


@pytest.mark.parametrize("n", [16, 30])
def test_a_prompt_of_max_model_len_tokens_or_more_is_refused(n):
    sched = _sched(max_model_len=16)
    with pytest.raises(RequestTooLargeError, match=rf"request 'b': prompt has {n} tokens; max_model_len=16 "
                                                   r"leaves no room to generate"):
        sched.add_request(Request("b", list(range(1, n + 1)), 1))
    assert not sched.has_work
    sched.add_request(Request("ok", list(range(1, 16)), 5))  # 15 tokens: room for one output
    drive(sched, max_steps=5)
    assert [len(r.output) for r in sched.finished] == [1]


@pytest.mark.parametrize("prompt, max_tokens, tokens", [(100, 1, 100), (10, 100, 109)])
def test_a_request_wider_than_the_block_table_is_refused(prompt, max_tokens, tokens):
    # the table holds 4 blocks of 16 = 64 tokens, max_model_len 200: a 100-token prompt used to be
    # admitted and given 7 blocks for a 4-block row
    from kvjax import KVGroupSpec

    sched = _sched(max_model_len=200, specs=(KVGroupSpec(16, 4),))
    with pytest.raises(RequestTooLargeError, match=(
            rf"request 'f' needs {tokens} tokens of KV cache, {cdiv_(tokens, 16)} blocks in KV group 0, but a "
            r"block-table row of that group holds 4 blocks \(64 tokens\); raise max_num_blocks")):
        sched.add_request(Request("f", list(range(1, prompt + 1)), max_tokens))
    assert not sched.has_work
    sched.add_request(Request("fits", list(range(1, 61)), 5))  # 64 tokens: exactly the table
    drive(sched, max_steps=20)
    assert [len(r.output) for r in sched.finished] == [5]


def test_a_duplicate_request_id_is_refused_while_the_first_is_waiting_or_running():
    # the second 'd' used to be queued; schedule() then raised and dropped it from waiting
    sched = _sched()
    sched.add_request(Request("d", [1, 2], 3))
    with pytest.raises(ValueError, match=r"request id 'd' is already waiting or running"):
        sched.add_request(Request("d", [5, 6], 3))
    step(sched)  # 'd' runs
    assert [r.req_id for r in sched.running] == ["d"]
    with pytest.raises(ValueError, match=r"request id 'd' is already waiting or running"):
        sched.add_request(Request("d", [5, 6], 3))
    drive(sched, max_steps=10)
    sched.add_request(Request("d", [5, 6], 1))  # finished: its id may be used again
    drive(sched, max_steps=10)
    assert [(r.req_id, r.prompt) for r in sched.finished] == [("d", [1, 2]), ("d", [5, 6])]


def test_a_finished_request_is_not_queued_again():
    sched = _sched()
    r = Request("a", [1, 2], 1)
    sched.add_request(r)
    drive(sched, max_steps=5)
    with pytest.raises(ValueError, match=r"request 'a' has finished"):
        sched.add_request(r)
    assert not sched.has_work


@pytest.mark.parametrize("k, slots", [(0, 1), (2, 1), (2, 2), (2, 3)])
def test_too_few_state_slots_for_one_request_is_refused(k, slots):
    # each request holds 1 + k slots: with num_state_slots=2, k=2 a request used to be accepted
    # and never scheduled (has_work stayed True); num_state_slots=1 blamed num_blocks
    with pytest.raises(ValueError, match=(
            rf"num_state_slots must be 0 \(no recurrent layers\) or an int >= {2 + k} \(the reserved slot 0 and "
            rf"1 \+ num_speculative_tokens = {1 + k} slots for one request\), got {slots}")):
        _sched(k=k, num_state_slots=slots)


def test_the_fewest_state_slots_run_requests_one_at_a_time():
    sched = _sched(k=2, num_state_slots=4)
    for i in range(3):
        sched.add_request(Request(f"r{i}", [1, 2, 3], 3))
    drive(sched, max_steps=40)
    assert len(sched.finished) == 3 and sched.slots.num_used == 0


@pytest.mark.parametrize("kw, match", [
    (dict(num_blocks=1), r"num_blocks must be an int >= 2 \(id 0 is reserved\), got 1"),
    (dict(max_model_len=1), r"max_model_len must be an int >= 2 \(a prompt token and an output\), got 1"),
    (dict(max_model_len=64.0), r"max_model_len must be an int >= 2 \(a prompt token and an output\), got 64.0"),
    (dict(specs=()), r"specs must be a non-empty sequence of KVGroupSpec, got \(\)"),
    (dict(max_model_len=True), r"max_model_len must be an int >= 2 \(a prompt token and an output\), got True"),
    (dict(num_state_slots="4"), r"num_state_slots must be a non-negative int, got '4'"),
    (dict(num_state_slots=-1), r"num_state_slots must be a non-negative int, got -1"),
    (dict(max_new_requests=2.0), r"max_new_requests must be a positive int, got 2.0"),
])
def test_bad_scheduler_sizes_are_refused_by_name(kw, match):
    with pytest.raises(ValueError, match=match):
        _sched(**kw)


def test_numpy_int_sizes_are_taken_as_plain_ints():
    """The scheduler's sizes go through the host's one size rule (buckets.check_size), which takes
    numpy ints and keeps them as plain ints."""
    sched = _sched(k=1, max_model_len=np.int64(64), num_blocks=np.int64(64), num_state_slots=np.int32(5),
                   max_new_requests=np.int64(2))
    sizes = (sched.max_model_len, sched.pool.num_blocks, sched.slots.num_blocks, sched.max_new_requests)
    assert sizes == (64, 64, 5, 2) and {type(v) for v in sizes} == {int}
    sched.add_request(Request("a", [1, 2, 3], np.int64(2)))
    drive(sched, max_steps=10)
    assert [len(r.output) for r in sched.finished] == [2]


def _decode_plan(sched):
    """A scheduler whose request 'a' decodes with no drafts (each window one token)."""
    sched.add_request(Request("a", [1, 2, 3], 10))
    step(sched)  # prefill: one output
    plan = sched.schedule()
    assert [(s.num_tokens, s.drafts) for s in plan.scheduled] == [(1, [])]
    return plan


@pytest.mark.parametrize("sampled, num_sampled, match", [
    (np.zeros((0, 3), np.int32), np.ones((1,), np.int32),
     r"sampled must be an int array of shape \[>= 1, >= 1\] \(a row per scheduled request, a column per token "
     r"it may accept: 1 \+ its drafts\), got int32 of shape \(0, 3\)"),
    (np.zeros((3,), np.int32), np.ones((1,), np.int32), r"sampled must be an int array .* got int32 of shape \(3,\)"),
    (np.zeros((1, 3), np.float32), np.ones((1,), np.int32), r"sampled must be an int array .* got float32 of shape"),
    (np.zeros((1, 3), np.int32), np.ones((0,), np.int32),
     r"num_sampled must be an int array of shape \[>= 1\] \(a count per scheduled request\), got int32 of "
     r"shape \(0,\)"),
    (np.zeros((1, 3), np.int32), np.array([3]),
     r"num_sampled\[0\] = 3 for request 'a', whose row has 0 drafts: it must be in \[0, 1\]"),
    (np.zeros((1, 3), np.int32), np.array([-1]),
     r"num_sampled\[0\] = -1 for request 'a', whose row has 0 drafts: it must be in \[0, 1\]"),
])
def test_update_refuses_results_that_do_not_match_the_plan(sampled, num_sampled, match):
    # a short sampled used to raise a raw IndexError; 3 'accepted' from a 1-token window moved
    # num_computed past the K/V written
    sched = _sched(k=2, drafter=lambda tokens, k: [])
    plan = _decode_plan(sched)
    req = plan.scheduled[0].req
    before = (req.num_computed, list(req.output), sched.step_count)
    with pytest.raises(ValueError, match=match):
        sched.update(plan, sampled, num_sampled)
    assert (req.num_computed, req.output, sched.step_count) == before  # nothing applied
    sched.update(plan, np.full((1, 3), 5, np.int32), np.ones((1,), np.int32))
    assert req.output[-1] == 5


@pytest.mark.parametrize("count", [3, -1])
def test_update_reads_no_count_of_a_mid_prefill_chunk(count):
    # The bound is the state's sample_window: a mid-prefill chunk samples nothing, so its count is
    # not read (as step_progress and the device's post_update treat it), while the chunk that
    # finishes the prompt may sample one token.
    sched = _sched()
    sched.add_request(Request("a", list(range(1, 41)), 4))
    plan = sched.schedule()
    req = plan.scheduled[0].req
    assert [(s.num_tokens, s.drafts) for s in plan.scheduled] == [(32, [])] and req.prefill_len == 40
    sched.update(plan, np.full((1, 1), 5, np.int32), np.array([count]))
    assert (req.num_computed, req.output) == (32, [])
    assert [int(v) for v in step_progress(0, 40, 32, count)] == [0, 32]  # (kept, num_computed)
    plan = sched.schedule()
    with pytest.raises(ValueError, match=r"num_sampled\[0\] = 2 for request 'a', whose row has 0 drafts: "
                                         r"it must be in \[0, 1\]"):
        sched.update(plan, np.full((1, 1), 5, np.int32), np.array([2]))
    sched.update(plan, np.full((1, 1), 5, np.int32), np.array([1]))
    assert (req.num_computed, req.output) == (40, [5])
