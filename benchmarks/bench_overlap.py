"""Host/device overlap of the serving loop: how long the device waits for the host per step.

    PYTHONPATH=. python benchmarks/bench_overlap.py [--requests 8,64,256] [--steps 40] [--json OUT]

For N decoding requests of the tiny model (one bucket of N tokens and N rows), measures per
decode step, medians over ``--steps`` steps after warm-up:

* ``device_us``: the step alone — one prepared dummy step (``Runner.prepare``) launched back to
  back (``Runner.launch``), so the device never waits for the host (the floor of a serving step);
* ``*_schedule_us``: ``Scheduler.schedule`` alone, inside each loop;
* ``lockstep_us`` / ``overlap_us``: wall time per step of :func:`run_to_completion` with
  ``overlap=False`` / ``True`` (plan and pack step N+1 while N runs);
* ``gap_us = overlap_us - device_us``: the wall time per step the device sits idle between
  two steps when the host plans step N+1 while step N runs (``lockstep_gap_us`` likewise);
* ``enqueue_us``: host time per ``Runner.launch`` of the back-to-back launches of ``device_us``
  (when it equals ``device_us`` the host's enqueue, not the device, sets the floor).

Results written before the runners were merged also hold ``layout`` variants and
``overlap_dispatch_*`` columns (an ``overlap="dispatch"`` mode that no longer exists).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time

import jax
import numpy as np

from kvjax.host.scheduler import Request
from kvjax.runner import Runner, RunnerConfig
from kvjax.runner.serving import run_to_completion


def _config(n: int) -> RunnerConfig:
    return RunnerConfig(max_num_seqs=n, max_num_batched_tokens=max(n, 16), num_blocks=8 * n + 8,
                        max_model_len=64, token_sizes=(n,) if n >= 16 else (n, 16),
                        max_new_requests_per_step=n)


def _requests(n: int, decode_steps: int) -> list[Request]:
    return [Request(f"r{i}", [1 + i % 200, 2, 3], max_tokens=decode_steps, arrival_step=0)
            for i in range(n)]


def measure(n: int, steps: int) -> dict:
    cfg = _config(n)
    runner = Runner(cfg)
    runner.precompile(workers=2)
    runner.warm_up()
    bucket = cfg.bucket_spec.buckets[0]
    prepared = runner.prepare(None, bucket)  # a dummy step: launching it again and again is harmless
    # device floor: back-to-back launches of one step
    for _ in range(3):
        out = runner.launch(prepared)
    out.wait()
    t0 = time.perf_counter()
    for _ in range(steps):
        out = runner.launch(prepared)
    t1 = time.perf_counter()
    out.wait()
    device_us = (time.perf_counter() - t0) / steps * 1e6

    row = {"requests": n, "device_us": device_us, "enqueue_us": (t1 - t0) / steps * 1e6}
    for overlap in (False, True):
        runner.reset()
        sched = cfg.make_scheduler()
        for r in _requests(n, steps + 4):
            sched.add_request(r)
        stamps = []
        host = []

        def on_step(step, plans, stamps=stamps):
            stamps.append(time.perf_counter())

        orig_schedule, orig_update = sched.schedule, sched.update

        def timed_schedule():
            t = time.perf_counter(); p = orig_schedule(); host.append(time.perf_counter() - t); return p

        sched.schedule = timed_schedule
        t0 = time.perf_counter()
        run_to_completion(sched, runner, overlap=overlap, on_step=on_step)
        total = time.perf_counter() - t0
        gaps = np.diff(stamps[2:])  # steady decode steps (after the prefill step)
        key = "overlap" if overlap else "lockstep"
        row[f"{key}_us"] = float(np.median(gaps)) * 1e6
        row[f"{key}_schedule_us"] = statistics.median(host[2:]) * 1e6
        row[f"{key}_total_s"] = total
    row["gap_us"] = max(0.0, row["overlap_us"] - device_us)
    row["lockstep_gap_us"] = max(0.0, row["lockstep_us"] - device_us)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", default="8,64,256", help="comma-separated request counts")
    ap.add_argument("--steps", type=int, default=40, help="decode steps timed per loop")
    ap.add_argument("--json", metavar="OUT")
    a = ap.parse_args(argv)
    rows = []
    for n in (int(x) for x in a.requests.split(",")):
        rows.append(measure(n, a.steps))
        print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in rows[-1].items()}),
              flush=True)
        jax.clear_caches()
    meta = {"date": datetime.date.today().isoformat(), "device": str(jax.devices()[0].device_kind),
            "platform": jax.default_backend(), "jax": jax.__version__, "python": platform.python_version(),
            "method": __doc__.split("\n\n", 2)[1].strip()}
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
