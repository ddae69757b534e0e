"""Where the host spends a real-size step's launch (issue 24, item 6), on a GPU.

    PYTHONPATH=. python benchmarks/probe_launch.py --preset granite-4.0-h-micro --batch 1,64 --out DIR

For each decode batch and each compile-option variant of the Runner's step executable, from an
idle device: the host time of the input ``device_put``, of the executable call and of
``copy_to_host_async``, then the wait for the result; the back-to-back step and enqueue; and a
profiler trace of two idle-start launches whose host-side events (CUDA driver API calls,
XLA's annotations) are summed by name. If a launch returns only when the step has run, the
trace names the call it waits in. Each variant's row also has the steady-state step (the slope
of 24 against 8 calls, as ``bench_model``) and the step's kernels (count, busy time, the largest).

``--dispatch``: each of the Runner's three launch programs (stage, step, fetch) called alone
from an idle device, against no-op executables taking the step's arguments (read, or with the
rows and pools donated) and no-ops of 1 / 128 / 512 small arrays: how much of a launch's host
time is argument handling.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

def _variants():
    from kvjax.runner.runner import GPU_COMPILER_OPTIONS

    return {
        "runner": None,  # the Runner's own (GPU_COMPILER_OPTIONS)
        "xla_default": {},
        "no_command_buffer": {"xla_gpu_enable_command_buffer": ""},
        "no_while_cond": {**GPU_COMPILER_OPTIONS,
                          "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN"},
        "skip_temp": {**GPU_COMPILER_OPTIONS, "xla_gpu_command_buffer_update_mode": "SKIP_TEMP"},
        "skip_temp_va": {**GPU_COMPILER_OPTIONS, "xla_gpu_command_buffer_update_mode": "SKIP_TEMP",
                         "xla_gpu_enable_command_buffer_va_remapping": True},
        "skip_profiled": {**GPU_COMPILER_OPTIONS, "xla_gpu_command_buffer_update_mode": "SKIP_PROFILED"},
        # the products' kernels: XLA's autotuner over every Triton tiling, or cuBLAS for all
        "exhaustive_tiling": {**GPU_COMPILER_OPTIONS, "xla_gpu_exhaustive_tiling_search": True},
        "cublas": {**GPU_COMPILER_OPTIONS, "xla_gpu_enable_triton_gemm": False},
        # the graph's shape: one chain of nodes, or XLA's dependency DAG; programmatic dependent launch
        "serialize": {**GPU_COMPILER_OPTIONS, "xla_gpu_command_buffer_scheduling_mode": "SERIALIZE"},
        "concurrent": {**GPU_COMPILER_OPTIONS, "xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"},
        "lhs": {**GPU_COMPILER_OPTIONS, "xla_gpu_command_buffer_scheduling_mode": "LHS"},
        "no_pdl": {**GPU_COMPILER_OPTIONS, "xla_gpu_enable_pdl": False},
        # XLA's experimental fusions: Triton fusions with several outputs (a residual add and the
        # norm after it), fusions without a reduction or product at their root, every fusion in Triton
        "mof": {**GPU_COMPILER_OPTIONS, "xla_gpu_unsupported_enable_triton_multi_output_fusion": True},
        "heroless": {**GPU_COMPILER_OPTIONS, "xla_gpu_experimental_enable_triton_heroless_priority_fusion": True},
        "mof_heroless": {**GPU_COMPILER_OPTIONS, "xla_gpu_unsupported_enable_triton_multi_output_fusion": True,
                         "xla_gpu_experimental_enable_triton_heroless_priority_fusion": True},
        "all_triton": {**GPU_COMPILER_OPTIONS, "xla_gpu_experimental_all_fusions_with_triton": True},
        # the Runner's options and the XLA options of $KVJAX_XLA_EXTRA (a JSON object), e.g. the
        # autotuner's results dumped or loaded (probe_gemm_pins.py)
        "extra": {**GPU_COMPILER_OPTIONS, **json.loads(os.environ.get("KVJAX_XLA_EXTRA", "{}"))},
    }


def host_events(run, n: int) -> dict:
    """Host-side trace events of ``n`` idle-start calls of ``run()`` summed by name."""
    import jax

    from _trace import record

    def body():
        for _ in range(n):
            jax.block_until_ready(run())

    got = record(body)
    if got is None:
        return {"error": "no trace"}
    events, _, _, gpu = got
    by = collections.defaultdict(lambda: [0, 0.0, 0.0])
    long = []
    for e in events:
        if e.get("ph") != "X" or e.get("pid") in gpu:
            continue
        name, dur = e.get("name", ""), float(e.get("dur", 0.0))
        b = by[name]
        b[0] += 1
        b[1] += dur
        b[2] = max(b[2], dur)
        if dur > 300:
            long.append((float(e.get("ts", 0.0)), name, dur))
    long.sort()
    top = sorted(by.items(), key=lambda kv: -kv[1][1])[:45]
    return {"calls": n,
            "top": [{"name": k[:160], "count_per_call": v[0] / n, "us_per_call": v[1] / n, "max_us": v[2]}
                    for k, v in top],
            "long_events": [{"ts": t, "name": nm[:160], "us": du} for t, nm, du in long[:80]]}


def _install(r, bucket, opts):
    """Compile ``bucket``'s step with compiler options ``opts`` (None: the Runner's own) and make
    it the Runner's executable of that bucket; the Runner's options are left as they were."""
    keep = r.compiler_options
    if opts is not None:
        r.compiler_options = opts
    try:
        lowered, spec = r._lower(bucket)
        exe = lowered.compile()
    finally:
        r.compiler_options = keep
    r.executables[bucket] = (exe, spec)
    return exe


def probe(bench, batch: int, opts, tag: str, log, base) -> dict:
    """``base``: a copy of the state every variant starts from (its first three outputs are
    compared across variants: compile options must not change a token)."""
    import jax
    import jax.numpy as jnp

    r = bench.runner
    plan = bench.fabricate_decode(batch, 1024)
    t0 = time.perf_counter()
    exe = _install(r, plan.bucket, opts)
    compile_s = time.perf_counter() - t0
    prepared = r.prepare(plan)

    def call(buf):
        return r._enqueue(plan.bucket, buf)[0]

    r._rows, r._pools = jax.tree.map(jnp.copy, base)
    first = []
    for _ in range(3):
        out = call(r.put_inputs(prepared))
        first.append(jax.device_get(out))
    put, ex, cp, wait = [], [], [], []
    for _ in range(7):
        jax.block_until_ready((r._rows, r._pools))
        t0 = time.perf_counter()
        buf = r.put_inputs(prepared)
        t1 = time.perf_counter()
        out = call(buf)
        t2 = time.perf_counter()
        out.copy_to_host_async()
        t3 = time.perf_counter()
        jax.block_until_ready(out)
        t4 = time.perf_counter()
        put.append((t1 - t0) * 1e6)
        ex.append((t2 - t1) * 1e6)
        cp.append((t3 - t2) * 1e6)
        wait.append((t4 - t3) * 1e6)
    from bench_model import steady_step_us

    buf = r.put_inputs(prepared)
    jax.block_until_ready(buf)
    med = lambda xs: statistics.median(xs)  # noqa: E731
    steady = steady_step_us(lambda: call(buf))  # as bench_model: runs of 8 and 24 calls
    row = {"tag": tag, "batch": batch, "options": opts, "compile_s": compile_s, "_first": first,
           "steady_step_us": med(steady["slopes"]),
           "idle_start": {"device_put_us": med(put), "exe_call_us": med(ex), "copy_to_host_async_us": med(cp),
                          "wait_after_us": med(wait)},
           "back_to_back": {"step_us": med(steady["cold_us"]), "enqueue_us": med(steady["enqueue_us"])}}
    log(f"{tag:18s} b{batch:<4d} put {row['idle_start']['device_put_us']:8.0f}  exe {row['idle_start']['exe_call_us']:8.0f}"
        f"  copy {row['idle_start']['copy_to_host_async_us']:6.0f}  wait {row['idle_start']['wait_after_us']:8.0f}"
        f"  | b2b step {row['back_to_back']['step_us']:8.0f} enqueue {row['back_to_back']['enqueue_us']:8.0f}"
        f"  (compile {compile_s:.0f} s) | steady step {row['steady_step_us']:8.0f}")
    try:
        from _trace import trace_device

        tr = trace_device(lambda: call(buf), 3)
        tr.pop("_kernels", None)
        row["kernels"] = {"per_step": tr.get("kernels_per_call"), "busy_us": tr.get("device_busy_us_per_call"),
                          "top": tr.get("top_kernels", [])[:16]}
        log(f"    kernels {row['kernels']['per_step']}, busy {row['kernels']['busy_us']} us per step")
        for t in row["kernels"]["top"][:8]:
            log(f"      {t}")
    except Exception as e:  # noqa: BLE001
        row["kernels"] = {"error": f"{type(e).__name__}: {e}"[:300]}
    try:
        row["host_trace"] = host_events(lambda: call(buf), 2)
        conds = sum(t["us_per_call"] for t in row["host_trace"]["top"] if t["name"].startswith("cond"))
        launch = sum(t["us_per_call"] for t in row["host_trace"]["top"] if t["name"].startswith("cuGraphLaunch"))
        upd = sum(t["us_per_call"] for t in row["host_trace"]["top"] if t["name"] == "command_buffer::update")
        row["host_summary"] = {"cond_us": conds, "graph_launch_us": launch, "graph_update_us": upd}
        log(f"    host: conditionals {conds:.0f} us, cuGraphLaunch {launch:.0f} us, update {upd:.0f} us")
        for t in row["host_trace"]["top"][:14]:
            log(f"    {t['us_per_call']:9.0f} us/call  x{t['count_per_call']:<7.0f} max {t['max_us']:8.0f}  {t['name'][:100]}")
    except Exception as e:  # noqa: BLE001
        row["host_trace"] = {"error": f"{type(e).__name__}: {e}"[:300]}
    del exe
    r.executables.pop(plan.bucket)
    return row


def probe_sampling(log, rows: int = 256, vocab: int = 100_352) -> list[dict]:
    """``sample_rows`` alone at ``[rows, vocab]`` under the Runner's options: greedy, sampled
    (temperature 0.8) and filtered (top-p 0.9, top-k 50): the call's host time, the conditionals'
    host time and the device time per call."""
    import jax
    import jax.numpy as jnp

    from kvjax.runner.runner import GPU_COMPILER_OPTIONS
    from kvjax.runner.sampling import sample_rows

    fn = jax.jit(sample_rows, compiler_options=dict(GPU_COMPILER_OPTIONS))
    logits = jax.random.normal(jax.random.key(0), (rows, vocab), jnp.float32)
    full = lambda v, dt: jnp.full((rows,), v, dt)  # noqa: E731
    out = []
    for tag, t, k, p in (("greedy", 0.0, 0, 1.0), ("sampled", 0.8, 0, 1.0), ("filtered", 0.8, 50, 0.9)):
        args = (logits, full(t, jnp.float32), full(k, jnp.int32), full(p, jnp.float32), full(7, jnp.int32),
                jnp.arange(rows, dtype=jnp.int32))
        jax.block_until_ready(fn(*args))
        t0 = time.perf_counter()
        for _ in range(10):
            o = fn(*args)
        t1 = time.perf_counter()
        jax.block_until_ready(o)
        t2 = time.perf_counter()
        tr = host_events(lambda: fn(*args), 2)
        conds = sum(e["us_per_call"] for e in tr.get("top", []) if e["name"].startswith("cond"))
        row = {"sampling": tag, "rows": rows, "vocab": vocab, "enqueue_us": (t1 - t0) / 10 * 1e6,
               "step_us": (t2 - t0) / 10 * 1e6, "cond_host_us": conds}
        log(f"sample_rows {tag:8s} [{rows}, {vocab}]: {row['step_us']:8.0f} us/call, enqueue {row['enqueue_us']:6.0f} us, "
            f"conditionals on the host {conds:.0f} us")
        out.append(row)
    return out


def probe_patterns(bench, batch: int, log, opts=None, tag: str = "runner") -> list[dict]:
    """The Runner's own executable launched back to back in three patterns: the same input
    buffer with each output kept alive until the next call returns (the serving loop's), the
    same input with each output dropped at once, and a fresh input per call with outputs
    dropped. Which buffers' new addresses make the command buffer update and relaunch."""
    import jax

    r = bench.runner
    plan = bench.fabricate_decode(batch, 1024)
    _install(r, plan.bucket, opts)
    prepared = r.prepare(plan)
    same = r.put_inputs(prepared)
    rows = []
    for name, fresh_in, keep_out in (("same_in_keep_out", False, True), ("same_in_drop_out", False, False),
                                    ("fresh_in_drop_out", True, False), ("fresh_in_keep_out", True, True)):
        kept = [None]

        def call():
            buf = r.put_inputs(prepared) if fresh_in else same
            out = r._enqueue(plan.bucket, buf)[0]
            if keep_out:
                kept[0] = out
            return r._rows

        for _ in range(4):
            call()
        jax.block_until_ready(r._rows)
        enq, per = [], []
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(8):
                call()
            t1 = time.perf_counter()
            jax.block_until_ready(r._rows)
            t2 = time.perf_counter()
            enq.append((t1 - t0) / 8 * 1e6)
            per.append((t2 - t0) / 8 * 1e6)
        tr = host_events(call, 3)
        pick = lambda f: sum(t["us_per_call"] for t in tr.get("top", []) if f(t["name"]))  # noqa: E731
        row = {"pattern": name, "options": tag, "batch": batch, "enqueue_us": statistics.median(enq),
               "per_call_us": statistics.median(per),
               "graph_update_us": pick(lambda n: n == "command_buffer::update"),
               "graph_launch_us": pick(lambda n: n.startswith("cuGraphLaunch"))}
        log(f"{tag} pattern {name:18s} b{batch:<4d} enqueue {row['enqueue_us']:7.0f} us, per call {row['per_call_us']:7.0f} us;"
            f" traced: update {row['graph_update_us']:6.0f} us, cuGraphLaunch {row['graph_launch_us']:6.0f} us")
        rows.append(row)
    r.executables.pop(plan.bucket)
    return rows


def probe_dispatch(bench, batch: int, log) -> dict:
    """Where an executable call's host time goes: each of the Runner's three launch programs
    (stage, step, fetch) called alone from an idle device, against no-op executables that take
    the step's arguments (the params' and the state's buffers) and against no-ops of N small
    arguments: if the step's call costs what a no-op of the same arguments costs, its host time
    is per-argument work, not the CUDA graph's launch."""
    import jax
    import jax.numpy as jnp

    from kvjax.runner.runner import GPU_COMPILER_OPTIONS

    r = bench.runner
    plan = bench.fabricate_decode(batch, 1024)
    exe = _install(r, plan.bucket, None)
    prepared = r.prepare(plan)
    r.launch(prepared).fetch()
    buf = r.put_inputs(prepared)
    stage, fetch = r._stage, r._fetch(r.output_spec(plan.bucket).size)
    opts = dict(GPU_COMPILER_OPTIONS)
    count = lambda t: len(jax.tree.leaves(t))  # noqa: E731
    row = {"batch": batch, "leaves": {"params": count(r.params), "rows": count(r._rows), "pools": count(r._pools)}}
    log(f"dispatch b{batch}: leaves {row['leaves']}")

    def idle(fn, n: int = 15) -> float:
        ts = []
        for _ in range(n + 2):
            jax.block_until_ready((r._rows, r._pools))
            t0 = time.perf_counter()
            out = fn()
            ts.append((time.perf_counter() - t0) * 1e6)
            jax.block_until_ready(out)
        return statistics.median(ts[2:])

    def set_rows(x):
        r._rows = x
        return x

    def step():
        r._rows, r._pools, checks = exe(r.params, r._rows, r._pools)
        return checks

    def donated_noop():
        r._rows, r._pools = noop_donate(r.params, r._rows, r._pools)
        return r._rows

    noop_all = jax.jit(lambda p, rows, pools: rows[2][:, :1], compiler_options=opts).lower(
        r.params, r._rows, r._pools).compile()
    noop_state = jax.jit(lambda rows, pools: rows[2][:, :1], compiler_options=opts).lower(r._rows, r._pools).compile()
    noop_params = jax.jit(lambda p: jax.tree.leaves(p)[0].ravel()[:1], compiler_options=opts).lower(r.params).compile()
    noop_donate = jax.jit(lambda p, rows, pools: (rows, pools), donate_argnums=(1, 2), compiler_options=opts).lower(
        r.params, r._rows, r._pools).compile()
    timed = {"stage": lambda: set_rows(stage(r._rows, buf)), "step": step, "fetch": lambda: fetch(r._rows),
             "noop(params, rows, pools)": lambda: noop_all(r.params, r._rows, r._pools),
             "noop(rows, pools)": lambda: noop_state(r._rows, r._pools),
             "noop(params)": lambda: noop_params(r.params),
             "noop(params, rows, pools) donated": donated_noop}
    for n in (1, 128, 512):
        xs = [jnp.full((256,), i, jnp.bfloat16) for i in range(n)]
        fn = jax.jit(lambda xs: xs[0][:1], compiler_options=opts).lower(xs).compile()
        timed[f"noop({n} arrays)"] = lambda fn=fn, xs=xs: fn(xs)
    row["idle_call_us"] = {}
    for name, fn in timed.items():
        row["idle_call_us"][name] = us = idle(fn)
        log(f"    {name:36s} {us:8.0f} us host per call (idle start)")
    # the step back to back: enqueue per call
    jax.block_until_ready((r._rows, r._pools))
    t0 = time.perf_counter()
    for _ in range(16):
        checks = step()
    t1 = time.perf_counter()
    jax.block_until_ready(checks)
    t2 = time.perf_counter()
    row["step_back_to_back"] = {"enqueue_us": (t1 - t0) / 16 * 1e6, "per_call_us": (t2 - t0) / 16 * 1e6}
    log(f"    step back to back: enqueue {row['step_back_to_back']['enqueue_us']:.0f} us, "
        f"per call {row['step_back_to_back']['per_call_us']:.0f} us")
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="granite-4.0-h-micro")
    ap.add_argument("--batch", default="1,64")
    ap.add_argument("--variants", default="runner,xla_default,no_command_buffer")
    ap.add_argument("--out", required=True)
    ap.add_argument("--patterns", action="store_true", help="the Runner's executable in four launch patterns")
    ap.add_argument("--pattern-variants", default="runner", help="--patterns: compile-option variants")
    ap.add_argument("--sampling", action="store_true", help="also time sample_rows alone (greedy / sampled / filtered)")
    ap.add_argument("--dispatch", action="store_true", help="the host time of each launch program and of no-ops")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    from bench_model import Bench, log

    batches = [int(b) for b in a.batch.split(",")]
    bench = Bench(a.preset, {"decode": [(1024, tuple(batches))], "prefill": (), "max_model_len": 32768})
    import jax
    import jax.numpy as jnp
    import numpy as np

    variants = _variants()
    rows = []
    if a.sampling:
        try:
            rows = probe_sampling(log)
        except Exception as e:  # noqa: BLE001
            log(f"sampling probe: {type(e).__name__}: {str(e)[:300]}")
    for b in batches if a.dispatch else ():
        rows.append(probe_dispatch(bench, b, log))
        with open(os.path.join(a.out, "probe_launch.json"), "w") as f:
            json.dump({"preset": a.preset, "rows": rows}, f, indent=1)
    for b in batches if a.patterns else ():
        for v in a.pattern_variants.split(","):
            rows += probe_patterns(bench, b, log, variants[v], v)
    for b in batches if a.variants else ():
        bench.fabricate_decode(b, 1024)
        base = jax.tree.map(jnp.copy, (bench.runner._rows, bench.runner._pools))
        ref = None
        for v in a.variants.split(","):
            try:
                row = probe(bench, b, variants[v], v, log, base)
            except Exception as e:  # noqa: BLE001 - an option this XLA lacks: the others run
                log(f"{v} b{b}: {type(e).__name__}: {str(e)[:300]}")
                rows.append({"tag": v, "batch": b, "error": f"{type(e).__name__}: {e}"[:500]})
                continue
            first = row.pop("_first")
            if ref is None:
                ref = (v, first)
            row["same_outputs_as"] = ref[0]
            row["same_outputs"] = all(np.array_equal(x, y) for x, y in zip(first, ref[1]))
            log(f"    outputs of the first 3 steps equal to {ref[0]}'s: {row['same_outputs']}")
            rows.append(row)
            with open(os.path.join(a.out, "probe_launch.json"), "w") as f:
                json.dump({"preset": a.preset, "rows": rows}, f, indent=1)
        del base
    return 0


if __name__ == "__main__":
    sys.exit(main())
