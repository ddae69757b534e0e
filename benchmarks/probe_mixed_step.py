"""Steps that mix decoding rows with a prefill, through the Runner's compiled step (issue 24).

    PYTHONPATH=. python benchmarks/probe_mixed_step.py --preset deepseek-v2-lite --out DIR

``bench_model.py``'s matrix times decode-only steps and steps that prefill one request alone.
This probe times the steps between them, in one Runner of ``--rows`` request rows with a
``--context``-token context per decoding row, each the steady-state step of the compiled
bucket (``Bench.time_plan``):

* ``decode``: ``rows`` rows decoding (a decode-only bucket);
* ``mixed-fresh``: ``rows - 1`` rows decoding and a new request prefilling ``--prefill`` tokens
  in the last row (a mixed bucket);
* ``mixed-chunk``: the same, the new request's prompt ``2 * prefill`` tokens of which the first
  half is already cached (a chunked prefill: the row has context);
* ``fresh-alone``: the new request alone (the other rows empty), in the mixed bucket.

Run it on two commits in one call to see what a change to the mixed path costs. Writes
``DIR/probe_mixed_step.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_model as bm  # noqa: E402


def mixed_plan(bench, rows: int, context: int, prefill: int, cached: int, *, alone: bool):
    """``rows - 1`` decoding rows (none when ``alone``) and one request in the last row
    prefilling ``prefill`` tokens after ``cached`` cached ones (blocks after the decoders')."""
    from kvjax.host.scheduler import Request, ScheduledRequest, StepPlan

    np = bench.np
    dec = bench.fabricate_decode(rows - 1, context)  # writes rows 0..rows-2 and their tables
    row = rows - 1
    per_row = math.ceil((context + bm.SLACK) / bm.BLOCK_SIZE)
    first = 1 + (rows - 1) * per_row
    total = cached + prefill
    nb = math.ceil(total / bm.BLOCK_SIZE)
    ids = list(range(first, first + nb))
    toks = [int(t) for t in np.random.default_rng(total).integers(1, bench.model.vocab_size, total)]
    q = Request("p0", toks, 1)
    q.row, q.num_computed, q.prefill_len = row, cached, total
    q.blocks = [ids]
    q.state_slots = [rows] if bench.model.uses_state else []
    scheduled = [] if alone else list(dec.scheduled)
    n_tokens = prefill + len(scheduled)
    bucket = bench.runner.buckets.choose(n_tokens, len(scheduled) + 1)
    if cached:  # the request is already installed (its first chunk ran): write its row directly
        req, tables = bench._rows()
        req = bench.jax.tree.map(np.array, req)
        tabs = [np.array(t) for t in tables.tables]
        nblk = np.array(tables.num_blocks)
        req.all_token_ids[row, :] = 0
        req.all_token_ids[row, :total] = toks
        req.prompt_len[row] = total
        req.prefill_len[row] = total
        req.total_len[row] = total
        req.num_computed_tokens[row] = cached
        req.temperature[row], req.top_p[row], req.top_k[row] = 0.0, 1.0, 0
        tabs[0][row, :] = 0
        tabs[0][row, :nb] = ids
        nblk[0, row] = nb
        bench._put_rows(req, tables.replace(tables=tuple(tabs), num_blocks=nblk))
        added, writes, zero, slots = [], [], [], []
    else:
        added, writes, zero, slots = [(row, toks, total)], [(row, [ids], True)], ids, list(q.state_slots)
    return StepPlan(step=0, bucket=bucket, scheduled=scheduled + [ScheduledRequest(q, prefill, [])],
                    added=added, cleared_rows=[], block_writes=writes, blocks_to_zero=zero,
                    slots_to_zero=slots, freed_blocks=[], freed_slots=[])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="deepseek-v2-lite", choices=sorted(bm.PRESETS))
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--label", default="", help="names the code in the rows (e.g. a commit)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    R, C, N = a.rows, a.context, a.prefill
    mixed_tokens = R - 1 + N
    matrix = {"decode": [(C, [R])], "prefill": [mixed_tokens, N],
              "num_blocks": 1 + R * math.ceil((C + bm.SLACK) / bm.BLOCK_SIZE) + 2 * N // bm.BLOCK_SIZE + 2,
              "max_model_len": max(C + bm.SLACK, 2 * N) + bm.BLOCK_SIZE}
    bench = bm.Bench(a.preset, matrix)
    bench.compile_all()
    rows = []
    cases = [("decode", lambda: bench.fabricate_decode(R, C)),
             ("mixed-fresh", lambda: mixed_plan(bench, R, C, N, 0, alone=False)),
             ("mixed-chunk", lambda: mixed_plan(bench, R, C, N, N, alone=False)),
             ("fresh-alone", lambda: mixed_plan(bench, R, C, N, 0, alone=True))]
    for name, make in cases:
        plan = make()
        t = bench.time_plan(plan)
        row = {"case": name, "label": a.label, "preset": a.preset, "rows": R, "context": C,
               "prefill": N, "bucket_tokens": plan.bucket.num_tokens, "bucket_rows": plan.bucket.num_reqs,
               "bucket_decode_only": plan.bucket.decode_only, **t}
        rows.append(row)
        bm.log(json.dumps({k: row[k] for k in ("case", "label", "bucket_tokens", "device_us",
                                                "device_us_groups", "launch_enqueue_us")}))
    with open(os.path.join(a.out, "probe_mixed_step.json"), "w") as f:
        json.dump({"meta": {"label": a.label, **bm._versions()}, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
