"""Random schedules through the state functions; every invariant checked every step."""

import random

from hypothesis import given, settings, strategies as st

from kvjax import KVGroupSpec
from kvjax.host.trace import StateTrace

SPECS = (
    KVGroupSpec(block_size=2, max_num_blocks=12),
    KVGroupSpec(block_size=4, max_num_blocks=6, kernel_block_size=2),
)


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**31), spec_k=st.sampled_from([0, 2]))
def test_random_schedules_keep_every_invariant(seed, spec_k):
    rng = random.Random(seed)
    T, R = 8, 3
    tr = StateTrace(SPECS, num_blocks=48, max_num_reqs=R, max_model_len=24, num_speculative_tokens=spec_k)
    next_id = 0
    for _ in range(10):
        op = rng.random()
        if op < 0.35 and len(tr.reqs) < R:
            tr.add(f"r{next_id}", [rng.randrange(1, 99) for _ in range(rng.randrange(1, 9))])
            next_id += 1
        elif op < 0.5 and tr.reqs:
            victim = rng.choice(sorted(tr.reqs))
            row = tr.remove(victim)
            if rng.random() < 0.7:  # immediate reuse of the same row
                assert tr.add(f"r{next_id}", [rng.randrange(1, 99) for _ in range(rng.randrange(1, 9))]) == row
                next_id += 1
        schedule, drafts, budget = {}, {}, T
        for rid, req in sorted(tr.reqs.items()):
            room = 24 - len(req.tokens) - spec_k - 1
            if req.num_computed < req.prefill_len:
                n = min(budget, req.prefill_len - req.num_computed, rng.randrange(1, 6))
            elif room > 0:
                d = [rng.randrange(1, 99) for _ in range(rng.randrange(0, spec_k + 1))]
                n = 1 + len(d)
                if n <= budget:
                    drafts[rid] = d
            else:
                n = 0
            if 0 < n <= budget and rng.random() < 0.85:
                schedule[rid] = n
                budget -= n
        tr.step(schedule, drafts, num_tokens_padded=T, num_reqs_padded=R,
                accept=lambda rid, n: rng.randrange(0, n + 1))  # steps check every invariant
