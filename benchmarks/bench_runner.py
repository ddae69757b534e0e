"""Runner benchmarks: precompile time and executable count, host-side step preparation,
and device step time of decode batches.

    PYTHONPATH=. python benchmarks/bench_runner.py [--device-steps] [--sizes 1,8,64,256] [--json OUT]

Host preparation = ``Scheduler.schedule`` + ``Runner.pack`` + packing into the one int32
buffer that crosses to the device, for a steady decode step of N running requests (target:
under 200 us for 64). ``--device-steps`` also times one decode step of the tiny model for
1, 8, 64 and 256 requests on the default JAX device: ``Runner.launch`` of a prepared step
through ``PendingStep.wait`` (median over repeated steps after warm-up; the host packing
and the outputs' read-back are outside the timed region).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import jax

from kvjax.runner.packing import pack
from kvjax.runner import Runner, RunnerConfig
from kvjax.host.scheduler import Request


def _decode_ready(cfg: RunnerConfig, n: int):
    """A scheduler with ``n`` requests already past prefill (host bookkeeping only)."""
    sched = cfg.make_scheduler()
    for i in range(n):
        sched.add_request(Request(f"r{i}", [1 + i % 200, 2, 3, 4], 10_000, 0))
    while len(sched.running) < n or not all(r.is_decoding for r in sched.running):
        plan = sched.schedule()  # admits up to max_new_requests and prefills them
        for s in plan.scheduled:
            if not s.req.is_decoding:
                s.req.num_computed = s.req.prefill_len
                s.req.output.append(5)
        sched.step_count += 1
    return sched


def host_prep_us(n: int, repeats: int = 300) -> dict:
    """Median microseconds of a steady decode step's host work: the scheduler's decision,
    and the runner's preparation (``Runner.pack`` + packing into the one transfer buffer)."""
    cfg = RunnerConfig(max_num_seqs=n, max_num_batched_tokens=max(4 * n, 32), num_blocks=40 * n + 72,
                       max_model_len=512, token_sizes=(n, 4 * n) if n > 1 else (1, 32))
    runner = Runner.__new__(Runner)  # packing needs only the config and buckets; skip params and compile
    runner.config = cfg
    runner.buckets = cfg.bucket_spec
    runner.sanitizers = None  # poison is off: no checked-mode inputs
    sched = _decode_ready(cfg, n)
    sch, prep = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        plan = sched.schedule()
        t1 = time.perf_counter()
        buf, _ = pack(runner.pack(plan))
        t2 = time.perf_counter()
        sch.append(t1 - t0)
        prep.append(t2 - t1)
        for s in plan.scheduled:  # pretend one token was sampled and kept
            s.req.num_computed += 1
            s.req.output.append(6)
        sched.step_count += 1
    return {"scheduler_us": statistics.median(sch) * 1e6, "runner_prep_us": statistics.median(prep) * 1e6,
            "packed_bytes": int(buf.nbytes)}


def precompile(cfg: RunnerConfig) -> dict:
    r = Runner(cfg)
    n, secs = r.precompile()
    return {"executables": n, "seconds": secs, "buckets": [b.num_tokens for b in cfg.bucket_spec.buckets]}


def device_step_us(n: int, steps: int = 30) -> float:
    cfg = RunnerConfig(max_num_seqs=n, max_num_batched_tokens=max(n, 8), num_blocks=4 * n + 8,
                       max_model_len=64, token_sizes=(max(n, 8),))
    runner = Runner(cfg)
    runner.precompile()
    sched = cfg.make_scheduler()
    for i in range(n):
        sched.add_request(Request(f"r{i}", [1 + i % 200], 10_000, 0))
    times = []
    for i in range(steps + 5):
        plan = sched.schedule()
        prepared = runner.prepare(plan)  # host packing, outside the timed region
        t0 = time.perf_counter()
        pending = runner.launch(prepared)
        pending.wait()
        times.append(time.perf_counter() - t0)
        out = pending.fetch().outputs[runner.local_ranks[0]]
        sched.update(plan, out.sampled, out.num_sampled, out.logits)
    return statistics.median(times[5:]) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device-steps", action="store_true")
    ap.add_argument("--sizes", default="1,8,64,256", help="comma-separated request counts (CPU smoke: 1,8)")
    ap.add_argument("--json")
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    res = {"date": time.strftime("%Y-%m-%d"), "jax": jax.__version__, "device": str(jax.devices()[0]),
           "python": platform.python_version()}
    res["host_prep_us"] = {n: host_prep_us(n) for n in sizes}
    res["precompile_demo_default"] = precompile(RunnerConfig(token_sizes=(4, 16, 32), num_blocks=96, max_model_len=96))
    if args.device_steps:
        res["device_decode_step_us"] = {n: device_step_us(n) for n in sizes}
    print(json.dumps(res, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
