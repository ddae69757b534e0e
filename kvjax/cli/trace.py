"""``python -m kvjax trace``: a seeded scheduling trace through the state functions.

Requests arrive, prefill in chunks, decode with drafts, finish, and a new
request immediately reuses a freed row; an idle (dummy) step runs between real
ones. Each step prints what the scheduler did, and the run ends with the
invariant results, including one check per seed bug. Every check is a rule of
:mod:`kvjax.state.invariants` (the owner of the invariants), named here by the
bug it catches; nothing is re-derived.
"""

from __future__ import annotations

import json
import random
import sys

import numpy as np

from kvjax.spec import KVGroupSpec
from kvjax.state import dummy_step_batch
from kvjax.state.invariants import step_batch_violations
from kvjax.host.trace import StateTrace


def _holds(violations: dict, rule: str) -> bool:
    """True when :func:`~kvjax.state.invariants.step_batch_violations` found ``rule`` unbroken."""
    return not bool(np.asarray(violations[rule]))


def run_trace(seed: int = 0, num_requests: int = 4, out=None) -> dict:
    """Run the trace; print the log to ``out`` (default: ``sys.stdout`` at the call); return the
    summary dict."""
    out = sys.stdout if out is None else out
    rng = random.Random(seed)
    specs = (
        KVGroupSpec(block_size=4, max_num_blocks=16),
        KVGroupSpec(block_size=8, max_num_blocks=8, kernel_block_size=4),
    )
    tr = StateTrace(specs, num_blocks=64, max_num_reqs=2, max_model_len=64, num_speculative_tokens=2)
    T, R = 16, 2
    checks: dict[str, bool] = {}
    pending = [(f"req{i}", [rng.randrange(1, 255) for _ in range(rng.randrange(5, 12))])
               for i in range(num_requests)]
    max_tokens = {rid: rng.randrange(3, 7) for rid, _ in pending}
    generated = {rid: 0 for rid, _ in pending}
    last_removed_row = None
    printed = 0
    invariant_error = None
    try:
        while pending or tr.reqs:
            while pending and len(tr.reqs) < R:
                rid, prompt = pending.pop(0)
                row = tr.add(rid, prompt)
                if last_removed_row is not None:
                    checks.setdefault("freed row reused immediately (LIFO)", row == last_removed_row)
            schedule, drafts, budget = {}, {}, T
            for rid, req in tr.reqs.items():
                if req.num_computed < req.prefill_len:
                    n = min(budget, req.prefill_len - req.num_computed, 6)  # chunked prefill
                else:
                    d = [rng.randrange(1, 255) for _ in range(rng.randrange(0, 3))]
                    n = 1 + len(d)
                    if n <= budget:
                        drafts[rid] = d
                if 0 < n <= budget:
                    schedule[rid] = n
                    budget -= n
            batch = tr.step(schedule, drafts, num_tokens_padded=T, num_reqs_padded=R,
                            accept=lambda rid, n: rng.randrange(0, n + 1))
            for line in tr.log[printed:]:
                print(line, file=out)
            printed = len(tr.log)
            for rid in list(schedule):
                req = tr.reqs[rid]
                if req.num_computed >= req.prefill_len:
                    generated[rid] = len(req.tokens) - req.prefill_len
                    if generated[rid] >= max_tokens[rid]:
                        last_removed_row = tr.remove(rid)
                        print(tr.log[-1], file=out)
                        printed = len(tr.log)
            # An idle data-parallel rank's step between real ones: all padding, so the invariants'
            # padding rules cover every token (PAD slots) and every row (NULL tables).
            if tr.steps == 2:
                d = dummy_step_batch(tr.state, tr.tables, num_reqs_padded=R, num_tokens_padded=T)
                tr.check(d)
                v = step_batch_violations(d, specs)
                all_padding = not (np.asarray(d.token_valid).any() or np.asarray(d.row_valid).any())
                checks["dummy step: every slot PAD"] = all_padding and _holds(v, "pad_token_slot_not_PAD")
                checks["dummy step: every block-table row NULL"] = (
                    all_padding and _holds(v, "pad_row_table_not_NULL"))
                print("dummy step: all PAD slots, all NULL block tables", file=out)
            checks["no real slot in block 0"] = (checks.get("no real slot in block 0", True)
                                                 and _holds(step_batch_violations(batch, specs),
                                                            "real_slot_in_null_block"))
    except AssertionError as e:  # StateTrace checks every invariant each step and raises
        invariant_error = str(e)
        print(f"invariant violated: {invariant_error}", file=out)
    checks["all step-batch, table, row and pool invariants"] = invariant_error is None
    summary = {
        "requests": num_requests,
        "steps": tr.steps,
        "generated_tokens": sum(generated.values()),
        "blocks_in_use_at_end": tr.pool.num_used,
        "checks": checks,
    }
    print("\ninvariant checks:", file=out)
    for name, ok in checks.items():
        print(f"  [{'ok' if ok else 'FAIL'}] {name}", file=out)
    print(json.dumps({k: v for k, v in summary.items() if k != "checks"}), file=out)
    return summary
