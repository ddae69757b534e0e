"""Host/device overlap of the serving loop: how long the device waits for the host per step.

    PYTHONPATH=. python benchmarks/bench_overlap.py [--requests 8,64,256] [--steps 40] [--json OUT]
    PYTHONPATH=. python benchmarks/bench_overlap.py --preset granite-4.0-h-micro --requests 16,64 \\
        --steps 30 --budget-s 240 --json OUT

For N decoding requests, measures per decode step, medians over ``--steps`` steps after warm-up:

* ``device_us``: the step alone, launched back to back (``Runner.launch``) so the device never
  waits for the host: with ``--preset``, one steady decode step of the overlapped run (its plan,
  prepared once) replayed after the run; without, one prepared dummy step
  (``Runner.prepare(None, bucket)``). ``device_dummy_us`` (``--preset``) is the dummy step's: it
  does the same matmuls, but its rows name no state slot, so it reads and writes no Mamba state
  (a real step at 64 requests moves ~9.6 GB of float32 state: ~3 ms on an H100), which made the
  dummy step a floor too low for a hybrid and the gap too large;
* ``enqueue_us``: host time per ``Runner.launch`` of those back-to-back launches (the step's
  enqueue cost: input staging plus the executable calls; when it equals ``device_us`` the
  host's enqueue, not the device, sets the floor);
* ``*_schedule_us``: ``Scheduler.schedule`` alone, inside each loop;
* ``lockstep_us`` / ``overlap_us``: wall time per step of :func:`run_to_completion` with
  ``overlap=False`` / ``True`` (plan and pack step N+1 while N runs);
* ``gap_us = overlap_us - device_us`` (clamped at 0; ``gap_raw_us`` unclamped): the wall time
  per step the device sits idle between two steps when the host plans step N+1 while step N
  runs (``lockstep_gap_us`` likewise); ``gap_fraction = gap_us / device_us`` (issue 24 item 6:
  <= 0.05 at batch >= 16 on a real-size model).

Default (no ``--preset``): kvjax's default tiny model, one runner per N (one bucket of N tokens
and N rows, every bucket precompiled), prompts of 3 tokens, as before.

``--preset NAME`` (a preset of ``benchmarks/bench_model.py``: real checkpoint shapes with
random seeded bf16 weights drawn on the device by bench_model's ``device_params``, the model
built by its ``build_model``; ``tiny`` / ``tiny-mla`` run the same code on a CPU): one Runner for
every N, configured as bench_model's (block size 16, ``return_logits=False``: only token ids come
back; ``max_num_seqs`` = the largest N, ``num_blocks`` and ``max_model_len`` sized for the
requests). The context is short on purpose: each request has a ``--prompt-len`` (16) token random
prompt, so prefill is cheap, and then decodes; the timed decode steps read contexts of
``prompt + 1`` to ``prompt + max_tokens`` tokens (about 20 to 60; the row's ``context_tokens``), so
the numbers are a weight- and state-bound decode step, not a long-context one. What one run and one step contain:

* ``max_new_requests_per_step`` M (``--max-new``; default the smallest of 16.. such that M x prompt
  exceeds the largest N): requests are admitted M per step, each with its whole prompt in one
  chunk; request ``i``, admitted at step ``i // M``, has ``max_tokens`` shortened by that step, so
  all N finish at the same step. Token sizes are the Ns plus one mixed size ``M x prompt +
  max N`` that holds every admission step.
* The buckets a run uses are found by a host-only dry run of the same scheduler (the plans
  depend only on counts), and only those are compiled (``Runner.jitted_step`` lowered and
  compiled, as ``precompile`` does, ``--workers`` at a time; the Runner's serving guard raises if
  anything else would compile). Typically one mixed bucket (shared by every N) and one
  decode-only bucket per N: ``compile_s`` per row is the wall of the compiles that row added.
* After warm-up (one dummy step per new bucket, then one short served run per mode), each timed
  run serves N requests from an empty runner (``Runner.reset``): the admission steps (mixed
  bucket), then decode steps. A timed step is a decode step of the steady state: its bucket is
  decode-only (the scheduler picks one exactly when no scheduled row is prefilling; a
  decode-only bucket's executable has no prefill path), all N rows are scheduled one token each,
  nothing is admitted or cleared. The step between two such steps is timed (the first ``--skip``
  of them dropped); the row says which bucket they ran in and how many were timed.
* Host time per step inside the loops is split into ``*_schedule_us``, ``*_prepare_us`` (pack
  the plan into the input buffer) and ``*_launch_us`` (enqueue), medians over the timed steps.
* ``--budget-s`` (default 240 with ``--preset``): wall seconds since start after which no new N
  is started (a started N runs to its end); rows print and the JSON is rewritten as each N ends.

Results written before the runners were merged also hold ``layout`` variants and
``overlap_dispatch_*`` columns (an ``overlap="dispatch"`` mode that no longer exists).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

T_START = time.perf_counter()

import jax  # noqa: E402
import numpy as np  # noqa: E402

from kvjax.host.scheduler import Request  # noqa: E402
from kvjax.runner import Runner, RunnerConfig  # noqa: E402
from kvjax.runner.serving import run_to_completion  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_model  # noqa: E402  (benchmarks/bench_model.py: presets, build_model, device_params)


def log(*a):
    print(f"[{time.perf_counter() - T_START:7.1f} s]", *a, flush=True)


# ------------------------------------------------------------------ default: kvjax's tiny model


def _config(n: int) -> RunnerConfig:
    return RunnerConfig(max_num_seqs=n, max_num_batched_tokens=max(n, 16), num_blocks=8 * n + 8,
                        max_model_len=64, token_sizes=(n,) if n >= 16 else (n, 16),
                        max_new_requests_per_step=n)


def _requests(n: int, decode_steps: int) -> list[Request]:
    return [Request(f"r{i}", [1 + i % 200, 2, 3], max_tokens=decode_steps, arrival_step=0)
            for i in range(n)]


def _device_floor(runner: Runner, bucket, steps: int, groups: int = 1, prepared=None) -> tuple[float, float]:
    """``(device_us, enqueue_us)``: one prepared step of ``bucket`` launched back to back (median
    over ``groups`` groups of ``steps`` launches): ``prepared`` (a served decode step, as packed in
    the run: replayed, it rewrites its own KV slots and advances its rows' states, harmless once
    the run is over), or the dummy step."""
    prepared = runner.prepare(None, bucket) if prepared is None else prepared
    for _ in range(3):
        out = runner.launch(prepared)
    out.wait()
    dev, enq = [], []
    for _ in range(groups):
        t0 = time.perf_counter()
        for _ in range(steps):
            out = runner.launch(prepared)
        t1 = time.perf_counter()
        out.wait()
        dev.append((time.perf_counter() - t0) / steps * 1e6)
        enq.append((t1 - t0) / steps * 1e6)
    return statistics.median(dev), statistics.median(enq)


def measure(n: int, steps: int) -> dict:
    cfg = _config(n)
    runner = Runner(cfg)
    _, compile_s = runner.precompile(workers=2)
    runner.warm_up()
    bucket = cfg.bucket_spec.buckets[0]
    device_us, enqueue_us = _device_floor(runner, bucket, steps)

    row = {"model": "kvjax default tiny", "requests": n, "device_us": device_us, "enqueue_us": enqueue_us}
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
    row["gap_fraction"] = row["gap_us"] / device_us
    row["compile_s"] = compile_s
    return row


# ------------------------------------------------------------------ --preset: bench_model's models


class PresetBench:
    """One Runner of a bench_model preset for every N; compiles only the buckets a run uses."""

    def __init__(self, preset: str, ns: list[int], *, prompt_len: int, steps: int, skip: int,
                 max_new: int | None, seed: int, workers: int, model=None, mesh=None, params=None):
        """``model``: default built from ``preset``; ``mesh``: the Runner's (default 1x1; one data
        rank: the dry run plans with one scheduler); ``params``: host params the Runner lays out
        and shards (default: random ones drawn replicated on the devices, a 1x1 mesh only)."""
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        from kvjax.runner.mesh import make_mesh

        self.preset, self.prompt_len, self.steps, self.skip, self.seed = preset, prompt_len, steps, skip, seed
        self.workers = workers
        maxn = max(ns)
        if max_new is None:
            max_new = min(maxn, max(16, maxn // prompt_len + 1))
        self.max_new = max_new
        self.admit_steps = {n: math.ceil(n / max_new) for n in ns}
        # outputs of the longest-lived request: the admission step's token, the decode steps
        # while the others are admitted, the skipped steps, the timed steps and one to spare
        self.max_tokens = max(self.admit_steps.values()) + skip + steps + 2
        B = bench_model.BLOCK_SIZE
        self.max_model_len = B * math.ceil((prompt_len + self.max_tokens) / B) + B
        num_blocks = 1 + maxn * math.ceil(self.max_model_len / B)
        mixed = max_new * prompt_len + maxn
        token_sizes = tuple(sorted(set(ns) | {mixed}))
        t0 = time.perf_counter()
        self.model = bench_model.build_model(preset) if model is None else model
        self.cfg = RunnerConfig(model=self.model, block_size=B, num_blocks=num_blocks,
                                max_model_len=self.max_model_len, max_num_seqs=maxn,
                                max_num_batched_tokens=max(token_sizes), token_sizes=token_sizes,
                                max_new_requests_per_step=max_new, seed=seed,
                                **bench_model.RETURN_LOGITS)
        mesh = make_mesh(1, 1) if mesh is None else mesh
        if mesh.shape["data"] != 1:
            raise ValueError(f"mesh must have one data rank (the dry run plans for one), got {dict(mesh.shape)}")
        if params is None:
            params = bench_model.device_params(self.model, seed, NamedSharding(mesh, P()))
            jax.block_until_ready(params)
        self.param_init_s = time.perf_counter() - t0
        self.runner = Runner(self.cfg, mesh=mesh, params=params)
        del params
        self.params_b = bench_model.count_params(self.model)["total"] / 1e9
        self.compile_s: dict = {}
        log(f"{preset}: {getattr(self.model, 'description', type(self.model).__name__)}, "
            f"{self.params_b:.2f} B params, init {self.param_init_s:.1f} s; max_num_seqs {maxn}, "
            f"token_sizes {token_sizes}, max_new {max_new}, max_model_len {self.max_model_len}, "
            f"{num_blocks} blocks, prompt {prompt_len}, max_tokens <= {self.max_tokens}, "
            f"input words/step {self.runner._input_words}")

    # -- the workload
    def requests(self, n: int, total: int) -> list[Request]:
        """N requests of random prompts; request i (admitted at step i // M) stops after
        ``total - i // M`` tokens, so every request finishes at the same step."""
        rng = np.random.default_rng(self.seed * 1000 + n)
        V = self.model.vocab_size
        return [Request(f"r{i}", [int(t) for t in rng.integers(1, V, self.prompt_len)],
                        max_tokens=total - i // self.max_new, arrival_step=0) for i in range(n)]

    def dry_run(self, reqs: list[Request]) -> list:
        """The plans' buckets of serving ``reqs`` (host only: the scheduler with placeholder tokens)."""
        sched = self.cfg.make_scheduler()
        for r in reqs:
            sched.add_request(r)
        out = []
        while sched.has_work:
            plan = sched.schedule()
            if plan is None:
                raise RuntimeError("dry run: the scheduler planned nothing with work left")
            R = plan.bucket.num_reqs
            sched.update(plan, np.full((R, 1), 7, np.int32), np.ones((R,), np.int32))
            out.append(plan)
            if len(out) > 10 * self.max_tokens + 100:
                raise RuntimeError("dry run: too many steps")
        return out

    def compile(self, buckets) -> float:
        r = self.runner
        todo = sorted(b for b in set(buckets) if b not in r.executables)
        if not todo:
            return 0.0

        def build(b):
            t0 = time.perf_counter()
            lowered, spec = r._lower(b)
            return b, (lowered.compile(), spec), time.perf_counter() - t0

        t0 = time.perf_counter()
        log(f"  compiling {len(todo)} bucket(s): " + ", ".join(_bname(b) for b in todo))
        with ThreadPoolExecutor(max(1, min(self.workers, len(todo)))) as ex:
            for b, built, s in ex.map(build, todo):
                r.executables[b] = built
                self.compile_s[b] = s
                log(f"  compiled {_bname(b)} in {s:.1f} s")
        for b in todo:  # first execution of each (module load, allocations)
            r.dummy_step(b)
        return time.perf_counter() - t0

    # -- one served run
    def serve(self, n: int, total: int, overlap: bool) -> dict:
        r = self.runner
        r.reset()
        sched = self.cfg.make_scheduler()
        for q in self.requests(n, total):
            sched.add_request(q)
        t_sched, t_prep, t_launch, marks, preps = [], [], [], [], []
        orig_schedule, orig_prepare, orig_launch = sched.schedule, r.prepare, r.launch

        def timed_schedule():
            t = time.perf_counter(); p = orig_schedule(); t_sched.append(time.perf_counter() - t); return p

        def timed_prepare(*a, **k):
            t = time.perf_counter(); p = orig_prepare(*a, **k); t_prep.append(time.perf_counter() - t)
            preps.append(p)
            return p

        def timed_launch(p):
            t = time.perf_counter(); o = orig_launch(p); t_launch.append(time.perf_counter() - t)
            return o

        def on_step(step, plans):
            plan = plans[r.local_ranks[0]]
            marks.append((time.perf_counter(), plan, t_sched[-1], t_prep[-1], t_launch[-1], preps[-1]))

        sched.schedule, r.prepare, r.launch = timed_schedule, timed_prepare, timed_launch
        try:
            t0 = time.perf_counter()
            run_to_completion(sched, r, overlap=overlap, on_step=on_step)
            total_s = time.perf_counter() - t0
        finally:
            del r.prepare, r.launch  # back to the class's methods
        return {"marks": marks, "total_s": total_s}

    def warm(self, n: int) -> None:
        """One short served run per mode (Python paths, first executions)."""
        total = self.admit_steps[n] + 3
        self.serve(n, total, False)
        self.serve(n, total, True)

    def measure(self, n: int) -> dict:
        t_row = time.perf_counter()
        total = self.max_tokens
        plans = self.dry_run(self.requests(n, total)) + self.dry_run(self.requests(n, self.admit_steps[n] + 3))
        decode_bucket = self.runner.buckets.choose(n, n, decode_only=True)
        steady = [p for p in plans if _steady(p, n)]
        if not steady or any(p.bucket != decode_bucket for p in steady):
            raise RuntimeError(f"N={n}: steady decode steps ran in {sorted({_bname(p.bucket) for p in steady})}, "
                               f"expected {_bname(decode_bucket)}")
        buckets = sorted({p.bucket for p in plans})
        log(f"N={n}: dry run: {len(plans)} plans, buckets {[_bname(b) for b in buckets]}")
        compile_s = self.compile(buckets)
        self.warm(n)
        log(f"  warm")
        dummy_us, _ = _device_floor(self.runner, decode_bucket, self.steps, groups=3)
        row = {"preset": self.preset, "requests": n, "device_dummy_us": dummy_us}
        steady = None
        for overlap in (False, True):
            key = "overlap" if overlap else "lockstep"
            res = self.serve(n, total, overlap)
            marks = res["marks"]
            iv = [i for i in range(1, len(marks)) if _steady(marks[i][1], n) and _steady(marks[i - 1][1], n)]
            iv = iv[self.skip:]
            if not iv:
                raise RuntimeError(f"N={n} {key}: no steady decode step to time ({len(marks)} steps)")
            bad = {_bname(marks[i][1].bucket) for i in iv if marks[i][1].bucket != decode_bucket}
            if bad:
                raise RuntimeError(f"N={n} {key}: timed steps ran in {bad}, not {_bname(decode_bucket)}")
            med = lambda xs: statistics.median(xs) * 1e6  # noqa: E731
            row[f"{key}_us"] = med([marks[i][0] - marks[i - 1][0] for i in iv])
            row[f"{key}_schedule_us"] = med([marks[i][2] for i in iv])
            row[f"{key}_prepare_us"] = med([marks[i][3] for i in iv])
            row[f"{key}_launch_us"] = med([marks[i][4] for i in iv])
            row[f"{key}_total_s"] = res["total_s"]
            row[f"{key}_timed_steps"] = len(iv)
            steady = marks[iv[len(iv) // 2]][5]
            row[f"{key}_served_steps"] = len(marks)
            log(f"  {key}: {row[f'{key}_us']:.1f} us/step over {len(iv)} decode steps "
                f"(schedule {row[f'{key}_schedule_us']:.1f}, prepare {row[f'{key}_prepare_us']:.1f}, "
                f"launch {row[f'{key}_launch_us']:.1f} us); {len(marks)} steps in {res['total_s']:.2f} s")
        device_us, enqueue_us = _device_floor(self.runner, decode_bucket, self.steps, groups=3, prepared=steady)
        log(f"  device floor {device_us:.1f} us/step (a served step replayed; the dummy step's {dummy_us:.1f}), "
            f"enqueue {enqueue_us:.1f} us")
        row.update({"device_us": device_us, "enqueue_us": enqueue_us})
        row["gap_raw_us"] = row["overlap_us"] - device_us
        row["gap_us"] = max(0.0, row["gap_raw_us"])
        row["gap_fraction"] = row["gap_us"] / device_us
        row["lockstep_gap_us"] = max(0.0, row["lockstep_us"] - device_us)
        row["lockstep_gap_fraction"] = row["lockstep_gap_us"] / device_us
        row.update({
            "compile_s": compile_s,
            "compile_buckets_s": {_bname(b): round(s, 2) for b, s in self.compile_s.items() if b in buckets},
            "decode_bucket": _bname(decode_bucket), "prompt_len": self.prompt_len,
            "context_tokens": [self.prompt_len + 1, self.prompt_len + total],
            "max_new_requests_per_step": self.max_new, "max_num_seqs": self.cfg.max_num_seqs,
            "max_model_len": self.max_model_len, "num_blocks": self.cfg.num_blocks,
            "block_size": self.cfg.block_size, "return_logits": getattr(self.cfg, "return_logits", True),
            "input_words": self.runner._input_words, "params_b": self.params_b,
            "param_init_s": self.param_init_s, "row_wall_s": time.perf_counter() - t_row,
            "memory_gb": _memory_gb(),
        })
        return row


def _steady(plan, n: int) -> bool:
    """A steady decode step: decode-only bucket, all ``n`` rows one token each, nothing added or cleared."""
    return (plan is not None and plan.bucket.decode_only and len(plan.scheduled) == n
            and all(s.num_tokens == 1 for s in plan.scheduled) and not plan.added and not plan.cleared_rows)


def _bname(b) -> str:
    return f"{'decode' if b.decode_only else 'mixed'}(T={b.num_tokens},R={b.num_reqs})"


def _memory_gb():
    try:
        st = jax.devices()[0].memory_stats() or {}
        return st.get("peak_bytes_in_use", 0) / 1e9 or None
    except Exception:  # noqa: BLE001
        return None


# ------------------------------------------------------------------------------------- driver


def _meta(a) -> dict:
    return {"date": datetime.date.today().isoformat(), "device": str(jax.devices()[0].device_kind),
            "platform": jax.default_backend(), "jax": jax.__version__, "python": platform.python_version(),
            "preset": a.preset, "steps": a.steps, "argv": sys.argv[1:],
            "method": __doc__.split("\n\n", 2)[2].strip()}


def _round(row: dict) -> dict:
    return {k: round(v, 3 if k.endswith("fraction") else 1) if isinstance(v, float) else v for k, v in row.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(bench_model.PRESETS),
                    help="a bench_model preset (default: kvjax's default tiny model, as before)")
    ap.add_argument("--requests", default=None,
                    help="comma-separated request counts (default 8,64,256; with --preset 16,64)")
    ap.add_argument("--steps", type=int, default=40, help="decode steps timed per loop")
    ap.add_argument("--prompt-len", type=int, default=16, help="--preset: prompt tokens per request")
    ap.add_argument("--skip", type=int, default=3, help="--preset: steady decode steps not timed (warm-up)")
    ap.add_argument("--max-new", type=int, default=None, help="--preset: max_new_requests_per_step")
    ap.add_argument("--workers", type=int, default=2, help="--preset: compile threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no new N after this many seconds (default: 240 with --preset, none without)")
    ap.add_argument("--json", metavar="OUT")
    a = ap.parse_args(argv)
    budget = a.budget_s if a.budget_s is not None else (240.0 if a.preset else math.inf)
    ns = [int(x) for x in (a.requests or ("16,64" if a.preset else "8,64,256")).split(",")]
    meta = _meta(a)
    log(f"jax {jax.__version__} on {meta['device']} ({meta['platform']}); "
        f"{'preset ' + a.preset if a.preset else 'default tiny model'}; N {ns}; budget {budget} s")
    rows, skipped = [], []

    def write():
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"meta": {**meta, "skipped_requests": skipped,
                                    "wall_s": time.perf_counter() - T_START}, "rows": rows}, f, indent=1)

    bench = None
    if a.preset:
        bench = PresetBench(a.preset, ns, prompt_len=a.prompt_len, steps=a.steps, skip=a.skip,
                            max_new=a.max_new, seed=a.seed, workers=a.workers)
    for n in ns:
        elapsed = time.perf_counter() - T_START
        if elapsed >= budget:
            log(f"budget: {elapsed:.0f} s >= {budget:.0f} s, N={n} not started")
            skipped.append(n)
            continue
        if bench is None:
            row = measure(n, a.steps)
            jax.clear_caches()
        else:
            row = bench.measure(n)
        row.update({"jax": jax.__version__, "device": meta["device"]})
        rows.append(row)
        print(json.dumps(_round(row)), flush=True)
        write()
    write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
