"""Host/device overlap of the serving loop: how long the device waits for the host per step.

    PYTHONPATH=. python benchmarks/bench_overlap.py [--requests 8,64,256] [--steps 40] [--json OUT]
        [--layouts default,tree,packed,packed+stable]

For N decoding requests of the tiny model (one bucket of N tokens and N rows), measures per
decode step, medians over ``--steps`` steps after warm-up:

* ``device_us``: the step alone — the same packed inputs dispatched back to back, so the
  device never waits for the host (the floor of a serving step);
* ``*_schedule_us``: ``Scheduler.schedule`` alone, inside each loop;
* ``lockstep_us`` / ``overlap_us`` / ``overlap_dispatch_us``: wall time per step of
  :func:`run_to_completion` with ``overlap=False`` / ``True`` (plan step N+1 while N runs) /
  ``"dispatch"`` (also enqueue N+1 before waiting for N);
* ``gap_us = overlap_us - device_us``: the wall time per step the device sits idle between
  two steps when the host plans step N+1 while step N runs (``lockstep_gap_us``,
  ``overlap_dispatch_gap_us`` likewise);
* ``enqueue_us``: host time per call of the back-to-back dispatches of ``device_us`` (when it
  equals ``device_us`` the host's dispatch, not the device, sets the floor).

``--layouts``: the Runner's argument layouts to measure (``default``: the Runner's default;
``tree``; ``packed``; ``packed+stable``: ``layout="packed", stable_input=True``;
``packed+stable+params``: also ``pack_params=True``), one row each.
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
from kvjax.runner.packing import pack

LAYOUTS = {"default": {}, "tree": {"layout": "tree"}, "packed": {"layout": "packed"},
           "packed+stable": {"layout": "packed", "stable_input": True},
           "packed+stable+params": {"layout": "packed", "stable_input": True, "pack_params": True}}
from kvjax.runner.serving import run_to_completion


def _config(n: int) -> RunnerConfig:
    return RunnerConfig(max_num_seqs=n, max_num_batched_tokens=max(n, 16), num_blocks=8 * n + 8,
                        max_model_len=64, token_sizes=(n,) if n >= 16 else (n, 16),
                        max_new_requests_per_step=n)


def _requests(n: int, decode_steps: int) -> list[Request]:
    return [Request(f"r{i}", [1 + i % 200, 2, 3], max_tokens=decode_steps, arrival_step=0)
            for i in range(n)]


def measure(n: int, steps: int, layout: str = "default") -> dict:
    cfg = _config(n)
    runner = Runner(cfg, **LAYOUTS[layout])
    runner.precompile(workers=2)
    runner.warm_up()
    bucket = cfg.bucket_spec.buckets[0]
    buf, _ = pack(runner.pack(None, bucket))
    # device floor: back-to-back dispatches of one step
    for _ in range(3):
        out = runner.enqueue(bucket, buf)
    out.fetch()
    t0 = time.perf_counter()
    for _ in range(steps):
        out = runner.enqueue(bucket, buf)
    t1 = time.perf_counter()
    out.fetch()
    device_us = (time.perf_counter() - t0) / steps * 1e6

    row = {"requests": n, "layout": runner.layout + ("+stable" if runner.stable_input else "")
           + ("+params" if runner.pack_params else ""),
           "device_us": device_us, "enqueue_us": (t1 - t0) / steps * 1e6}
    for overlap in (False, True, "dispatch"):
        runner.reset()
        sched = cfg.make_scheduler()
        for r in _requests(n, steps + 4):
            sched.add_request(r)
        stamps = []
        host = []

        def on_step(plan, stamps=stamps):
            stamps.append(time.perf_counter())

        orig_schedule, orig_update = sched.schedule, sched.update

        def timed_schedule():
            t = time.perf_counter(); p = orig_schedule(); host.append(time.perf_counter() - t); return p

        sched.schedule = timed_schedule
        t0 = time.perf_counter()
        run_to_completion(sched, runner, overlap=overlap, on_step=on_step)
        total = time.perf_counter() - t0
        gaps = np.diff(stamps[2:])  # steady decode steps (after the prefill step)
        key = {False: "lockstep", True: "overlap", "dispatch": "overlap_dispatch"}[overlap]
        row[f"{key}_us"] = float(np.median(gaps)) * 1e6
        row[f"{key}_schedule_us"] = statistics.median(host[2:]) * 1e6
        row[f"{key}_total_s"] = total
    row["gap_us"] = max(0.0, row["overlap_us"] - device_us)
    row["lockstep_gap_us"] = max(0.0, row["lockstep_us"] - device_us)
    row["overlap_dispatch_gap_us"] = max(0.0, row["overlap_dispatch_us"] - device_us)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", default="8,64,256", help="comma-separated request counts")
    ap.add_argument("--steps", type=int, default=40, help="decode steps timed per loop")
    ap.add_argument("--json", metavar="OUT")
    ap.add_argument("--layouts", default="default", help=f"comma-separated, of {','.join(LAYOUTS)}")
    a = ap.parse_args(argv)
    layouts = a.layouts.split(",")
    for name in layouts:
        if name not in LAYOUTS:
            ap.error(f"--layouts: {name!r} is not one of {', '.join(LAYOUTS)}")
    rows = []
    for n in (int(x) for x in a.requests.split(",")):
        for name in layouts:
            rows.append(measure(n, a.steps, name))
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
