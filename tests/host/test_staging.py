"""Every plan the scheduler makes fits its bucket's staging (issue 25 item 1), host only.

The runner packs a plan into fixed-shape arrays whose lengths :func:`bucket_staging` gives;
a plan with more cleared rows, new requests, block writes, ids per write, zeroed blocks or
zeroed slots than its bucket stages used to crash ``Runner.pack`` mid-serving.
"""

import dataclasses
import random

import numpy as np
import pytest
from hypothesis import event, given, settings, strategies as st

from kvjax import KVGroupSpec
from kvjax.host.block_pool import BlockPool
from kvjax.host.buckets import Bucket, BucketSpec, Staging, bucket_staging
from kvjax.host.scheduler import Request, RequestTooLargeError, Scheduler


def _block_sizes(block_size, groups=1, same_block_size=False):
    """The KV groups' block sizes: ``block_size`` for every group, or ``block_size * (g + 1)``."""
    return tuple(block_size * (1 if same_block_size else g + 1) for g in range(groups))


def _scheduler(*, block_size, num_blocks, max_model_len, max_num_seqs, k, budget, token_sizes,
               max_new_requests, groups=1, same_block_size=False):
    specs = tuple(KVGroupSpec.for_model_len(b, max_model_len)
                  for b in _block_sizes(block_size, groups, same_block_size))
    buckets = (BucketSpec(tuple(token_sizes), max_num_seqs, k) if token_sizes
               else BucketSpec.default(budget, max_num_seqs, k))
    return Scheduler(specs, buckets, num_blocks=num_blocks, max_model_len=max_model_len,
                     num_state_slots=1 + max_num_seqs * (1 + k), max_new_requests=max_new_requests)


def _check_plan(sched, plan, block_sizes):
    """The plan fits the staging computed from the configuration (not the scheduler's own)."""
    cap = bucket_staging(plan.bucket, block_size=block_sizes, num_speculative_tokens=sched.k,
                         max_new_requests=sched.max_new_requests, max_num_seqs=sched.buckets.max_num_seqs)
    need = plan.staging_need()
    assert cap.holds(need), (plan.step, plan.bucket, cap.excess(need))
    rows = [s.req.row for s in plan.scheduled]
    assert len(set(plan.cleared_rows)) == len(plan.cleared_rows), plan.cleared_rows
    assert {a[0] for a in plan.added} <= set(rows), "an added row is not scheduled"
    assert {w[0] for w in plan.block_writes} <= set(rows), "a block write to an unscheduled row"
    held = {b for r in sched.running for ids in r.blocks for b in ids}
    assert set(plan.blocks_to_zero) <= held, "a block to zero that no request holds"


def _drive(sched, rng, block_sizes, max_steps):
    steps = 0
    while sched.has_work:
        assert steps < max_steps, f"no completion after {steps} steps"
        steps += 1
        plan = sched.schedule()
        if plan is None:
            continue
        _check_plan(sched, plan, block_sizes)
        R = plan.bucket.num_reqs
        num_sampled = np.zeros((R,), np.int32)
        for b, s in enumerate(plan.scheduled):
            num_sampled[b] = 1 + rng.randrange(len(s.drafts) + 1)
        sched.update(plan, np.full((R, 1 + sched.k), 3, np.int32), num_sampled)
    return steps


@st.composite
def configs(draw):
    k = draw(st.sampled_from([0, 0, 1, 3]))
    max_num_seqs = draw(st.integers(1, 8))
    budget = draw(st.integers(1 + k, 24))
    token_sizes = None
    if draw(st.booleans()):
        token_sizes = sorted(set(draw(st.lists(st.integers(1 + k, budget), max_size=3))) | {budget})
    return dict(
        block_size=draw(st.sampled_from([1, 2, 4, 8])), num_blocks=draw(st.integers(3, 24)),
        max_model_len=draw(st.sampled_from([16, 32, 64])), max_num_seqs=max_num_seqs, k=k, budget=budget,
        token_sizes=token_sizes, max_new_requests=draw(st.integers(1, max_num_seqs)),
        groups=draw(st.sampled_from([1, 1, 2, 3, 4])), same_block_size=draw(st.booleans()),
    )


requests = st.lists(st.tuples(st.integers(1, 16), st.integers(1, 8), st.integers(0, 4)), min_size=1, max_size=8)


@settings(max_examples=300, deadline=None)
@given(cfg=configs(), reqs=requests, seed=st.integers(0, 2**16))
def test_every_plan_fits_its_buckets_staging(cfg, reqs, seed):
    rng = random.Random(seed)
    sched = _scheduler(**cfg)
    n = 0
    for i, (p, m, arrival) in enumerate(sorted(reqs, key=lambda r: r[2])):
        try:
            sched.add_request(Request(f"r{i}", [rng.randrange(1, 5) for _ in range(p)], m, arrival))
            n += 1
        except RequestTooLargeError:
            pass
    event(f"{n} requests run")
    _drive(sched, rng, _block_sizes(cfg["block_size"], cfg["groups"], cfg["same_block_size"]), max_steps=400)
    event(f"preempted: {sched.num_preemptions > 0}")
    assert len(sched.finished) == n and sched.pool.num_used == 0


def test_issue_25_admitted_then_preempted_requests_fit_the_one_token_bucket():
    # Issue 25 item 1's reproduction: a (9 tokens) runs; b and c arrive, were admitted,
    # preempted in the same step, and their fresh slots overflowed the 1-token bucket.
    cfg = dict(block_size=4, num_blocks=4, max_model_len=32, max_num_seqs=3, k=0, budget=16,
               token_sizes=[1, 16], max_new_requests=3)
    sched = _scheduler(**cfg)
    sched.add_request(Request("a", list(range(1, 10)), 3, 0))
    for rid in "bc":
        sched.add_request(Request(rid, [5, 6], 1, 1))
    _drive(sched, random.Random(0), (4,), max_steps=30)
    assert sorted(r.req_id for r in sched.finished) == ["a", "b", "c"]


def test_a_token_budget_below_max_num_seqs_admits_only_what_it_schedules():
    # Issue 25 item 1: added-but-unscheduled rows pushed block_writes past the bucket.
    cfg = dict(block_size=4, num_blocks=30, max_model_len=32, max_num_seqs=6, k=0, budget=2,
               token_sizes=None, max_new_requests=6)
    sched = _scheduler(**cfg)
    for i in range(6):
        sched.add_request(Request(f"r{i}", [1, 2, 3], 2, 0))
    plan = sched.schedule()
    assert len(plan.added) == len(plan.scheduled) == 1 and plan.bucket.num_reqs == 2
    _check_plan(sched, plan, (4,))


def test_staging_of_a_bucket():
    b = Bucket(num_tokens=9, num_reqs=3, num_logits=6)
    st_ = bucket_staging(b, block_size=4, num_speculative_tokens=1, max_new_requests=2, max_num_seqs=5)
    assert st_ == Staging(cleared_rows=5, new_requests=2, block_writes=3, ids_per_write=4, zero_blocks=12,
                          zero_slots=6, prefill_rows=3)
    # one int per KV group: ids per write by the smallest block size, zeroed blocks summed over
    # the groups (3 writes of up to cdiv(9, 4) + 1 = 4, 4 and cdiv(9, 8) + 1 = 3 ids)
    st3 = bucket_staging(b, block_size=(4, 4, 8), num_speculative_tokens=1, max_new_requests=2, max_num_seqs=5)
    assert (st3.ids_per_write, st3.zero_blocks) == (4, 3 * (4 + 4 + 3))
    assert bucket_staging(b, block_size=(4,), num_speculative_tokens=1, max_new_requests=2, max_num_seqs=5) == st_
    # prefilling rows: the admissions plus one request left mid-prefill, at most the bucket's rows
    assert bucket_staging(Bucket(16, 5, 5), block_size=4, num_speculative_tokens=0, max_new_requests=1,
                          max_num_seqs=5).prefill_rows == 2
    # a decode-only bucket (compiled without the prefill path) takes none
    assert bucket_staging(Bucket(4, 3, 3, decode_only=True), block_size=4, num_speculative_tokens=0,
                          max_new_requests=2, max_num_seqs=5).prefill_rows == 0
    need = Staging(cleared_rows=5, new_requests=3, block_writes=3, ids_per_write=5, zero_blocks=0, zero_slots=0)
    assert st_.excess(need) == ["new_requests: 3 > 2", "ids_per_write: 5 > 4"] and not st_.holds(need)


@pytest.mark.parametrize("kw, match", [
    (dict(max_new_requests=6), r"max_new_requests must be <= max_num_seqs=5 .*got 6"),
    (dict(max_new_requests=0), r"max_new_requests must be a positive int, got 0"),
    (dict(block_size=0), r"block_size must be a positive int, got 0"),
    (dict(block_size=(4, 0)), r"block_size\[1\] must be a positive int, got 0"),
    (dict(block_size=()), r"block_size must be a positive int or a non-empty sequence of them \(one per KV "
                          r"group\), got \(\)"),
    (dict(num_speculative_tokens=-1), r"num_speculative_tokens must be a non-negative int, got -1"),
    (dict(bucket=Bucket(4, 6, 6)), r"bucket must be a Bucket of 1..min\(num_tokens, max_num_seqs=5\) rows, got"),
])
def test_staging_refuses_bad_sizes(kw, match):
    args = dict(bucket=Bucket(4, 4, 4), block_size=4, num_speculative_tokens=0, max_new_requests=2, max_num_seqs=5)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        bucket_staging(args.pop("bucket"), **args)


def test_a_scheduler_with_more_new_requests_than_rows_is_refused():
    with pytest.raises(ValueError, match=r"max_new_requests must be <= max_num_seqs=2 .*got 3"):
        _scheduler(block_size=4, num_blocks=8, max_model_len=32, max_num_seqs=2, k=0, budget=8,
                   token_sizes=None, max_new_requests=3)


def test_ids_freed_before_they_are_handed_out_are_not_zeroed():
    pool = BlockPool(8)
    a = pool.allocate(3)
    pool.free(a[1:])  # e.g. a request preempted in the step that allocated its blocks
    assert pool.take_ids_to_zero() == a[:1]
    b = pool.allocate(2)  # reused: recorded again
    assert pool.take_ids_to_zero() == b


def test_a_step_prefills_at_most_max_prefill_rows_oldest_first():
    """Three running requests mid-prefill and one waiting, one admission per step: the step
    prefills max_prefill_rows(1) = 2 rows, the two oldest, and admits nobody (the model's prefill
    path is sized by that bound: bucket_staging's prefill_rows). Planted: the cap dropped from the
    running loop fails here (3 prefill rows); dropped from admissions, the waiting one is admitted."""
    from kvjax.host.buckets import max_prefill_rows
    from kvjax.host.scheduler import Request

    sched = _scheduler(block_size=4, num_blocks=64, max_model_len=64, max_num_seqs=6, k=0, budget=32,
                       token_sizes=(32,), max_new_requests=3)
    for name in "abc":
        sched.add_request(Request(name, list(range(1, 11)), 4, 0))
    first = sched.schedule()  # a, b, c admitted with their whole prompts
    assert [s.req.req_id for s in first.scheduled] == ["a", "b", "c"]
    for s in first.scheduled:  # as if each had been cut short: all three still prefilling
        s.req.num_computed = 5
    sched.max_new_requests = 1
    sched.add_request(Request("d", [7, 8], 2, 0))
    plan = sched.schedule()
    assert max_prefill_rows(1) == 2
    assert [s.req.req_id for s in plan.scheduled] == ["a", "b"] and not plan.added
    assert plan.staging_need().prefill_rows == 2 <= sched.staging(plan.bucket).prefill_rows


def test_three_kv_groups_of_one_block_size_fit_the_staging():
    """Three KV groups share one pool: a 64-token prefill in a one-row bucket allocates 3 x 4 fresh
    blocks. The staging held 2 * R * M = 10 (right for at most two groups), so schedule() raised
    mid-step after admitting the request and allocating its blocks. Now zero_blocks sums the groups."""
    sched = _scheduler(block_size=16, num_blocks=64, max_model_len=128, max_num_seqs=1, k=0, budget=64,
                       token_sizes=None, max_new_requests=1, groups=3, same_block_size=True)
    sched.add_request(Request("a", list(range(1, 65)), 4))
    plan = sched.schedule()
    assert plan.staging_need().zero_blocks == 12 <= sched.staging(plan.bucket).zero_blocks
    _check_plan(sched, plan, (16, 16, 16))
    sched.update(plan, np.full((1, 1), 3, np.int32), np.ones((1,), np.int32))
    _drive(sched, random.Random(0), (16, 16, 16), max_steps=10)
    assert [r.req_id for r in sched.finished] == ["a"] and sched.pool.num_used == 0


@pytest.mark.parametrize("field, value, match", [
    ("zero_slots", -1, r"Staging\.zero_slots must be a non-negative int, got -1"),
    ("prefill_rows", True, r"Staging\.prefill_rows must be a non-negative int, got True"),
    ("block_writes", 2.0, r"Staging\.block_writes must be a non-negative int, got 2\.0"),
])
def test_staging_sizes_are_refused_by_name(field, value, match):
    sizes = dict(cleared_rows=1, new_requests=1, block_writes=1, ids_per_write=1, zero_blocks=1, zero_slots=1)
    with pytest.raises(ValueError, match=match):
        Staging(**{**sizes, field: value})


def test_staging_takes_numpy_ints_as_plain_ints():
    st_ = Staging(*[np.int64(i) for i in range(7)])
    assert dataclasses.astuple(st_) == tuple(range(7)) and {type(v) for v in dataclasses.astuple(st_)} == {int}
