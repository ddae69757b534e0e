"""Does a step executable compiled beside others run slower? (issue 24, batch-1 decode)

    PYTHONPATH=. python benchmarks/probe_compile_workers.py --preset granite-4.0-h-micro --workers 4

Builds ``bench_model.Bench`` with the matrix's decode buckets (batch 1 / 16 / 64 / 256 at a 1k
context, 256 request rows, ``max_model_len`` 32768), compiles them with ``--workers`` threads
(``Bench.compile_all``; ``--only-b1``: the batch-1 bucket alone), then times the batch-1 step
three ways in the same process: ``Bench.time_plan`` (the table's ``device_us``), the staging
program, step and fetch called directly back to back, and ``time_plan`` again; and traces one
step's device events (kernels and memcpys, busy and idle time).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="granite-4.0-h-micro")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--only-b1", action="store_true")
    a = ap.parse_args(argv)
    import jax

    from _trace import device_timeline, record
    from bench_model import Bench, log

    batches = (1,) if a.only_b1 else (1, 16, 64, 256)
    bench = Bench(a.preset, {"decode": [(1024, batches)], "prefill": (), "max_model_len": 32768,
                             "max_num_seqs": 256, "num_blocks": 17409}, workers=a.workers)
    t0 = time.perf_counter()
    bench.compile_all()
    log(f"{a.preset}: {len(bench.compile_s)} buckets compiled with {a.workers} workers in "
        f"{time.perf_counter() - t0:.1f} s")
    r = bench.runner
    plan = bench.fabricate_decode(1, 1024)
    t1 = bench.time_plan(plan)["device_us"]
    prepared = r.prepare(plan)
    buf = r.put_inputs(prepared)
    exe, _ = r.executables[prepared.bucket]
    stage, fetch = r._stage, r._fetch(r.output_spec(prepared.bucket).size)

    def one():
        r._rows = stage(r._rows, buf)
        r._rows, r._pools, _ = exe(r.params, r._rows, r._pools)
        return fetch(r._rows)

    for _ in range(3):
        one()
    jax.block_until_ready(r._rows)
    walls, hosts = [], []
    for _ in range(3):
        s = time.perf_counter()
        for _ in range(16):
            out = one()
        h = time.perf_counter()
        jax.block_until_ready(out)
        walls.append((time.perf_counter() - s) / 16 * 1e6)
        hosts.append((h - s) / 16 * 1e6)
    t2 = bench.time_plan(plan)["device_us"]

    def body():
        for _ in range(6):
            one()
        jax.block_until_ready(r._rows)

    body()
    ev = device_timeline(record(body, device_only=True))
    busy = sum(x["dur"] for x in ev) / 6
    span = (ev[-1]["t"] + ev[-1]["dur"]) / 6 if ev else 0
    log(f"b1: time_plan {t1:.0f} us; direct calls {statistics.median(walls):.0f} us/step "
        f"(host {statistics.median(hosts):.0f}); time_plan again {t2:.0f} us; trace: {len(ev) // 6} events "
        f"per step, busy {busy:.0f} us, span {span:.0f} us per step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
