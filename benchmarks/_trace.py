"""Device kernels of a few calls, read from a JAX profiler trace (CUPTI) or torch's profiler.

Shared by ``bench_kernels.py`` (device time per op call beside the wall-clock rows) and
``profile_gpu.py`` (kernels, memcpys and their time per KV write call and per decode step).
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import tempfile

import jax


def record(body, *, device_only: bool = False):
    """Run ``body()`` under JAX's profiler: ``(events, process names, thread names, gpu pids)`` of
    its perfetto trace, or None when no trace was written. ``device_only``: no Python or host
    tracer (the host then runs at nearly its untraced speed; device events only)."""
    d = tempfile.mkdtemp(prefix="kvjax-prof-")
    opts = None
    if device_only:
        opts = jax.profiler.ProfileOptions()
        opts.python_tracer_level = 0
        opts.host_tracer_level = 0
    with jax.profiler.trace(d, create_perfetto_trace=True, profiler_options=opts):
        body()
    files = glob.glob(os.path.join(d, "**", "*.trace.json.gz"), recursive=True)
    if not files:
        return None
    doc = json.load(gzip.open(files[0]))
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    pname, tname = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            pname[e["pid"]] = e["args"].get("name", "")
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            tname[(e["pid"], e["tid"])] = e["args"].get("name", "")
    gpu_pids = {p for p, nm in pname.items() if "GPU" in nm or "gpu" in nm}
    return events, pname, tname, gpu_pids


#: Profiler threads that re-list device events (per XLA op, module, step...) rather than record them.
DERIVED_THREADS = ("XLA Ops", "XLA Modules", "Steps", "TensorFlow", "Source", "Framework", "Launch Stats")


def device_timeline(got) -> list[dict]:
    """Every device event (kernels, copies, memsets) of :func:`record`'s result in time order:
    ``t`` (from the first event), ``dur``, ``gap`` (idle time before it), ``name``, ``module``;
    none when no trace was written."""
    if got is None:
        return []
    events, _, tname, gpu_pids = got
    ev = sorted((float(e["ts"]), float(e.get("dur", 0.0)), e.get("name", "")[:70],
                 (e.get("args") or {}).get("hlo_module", "")[:40])
                for e in events if e.get("ph") == "X" and e.get("pid") in gpu_pids
                and not tname.get((e["pid"], e.get("tid")), "").startswith(DERIVED_THREADS))
    rows, prev_end = [], None
    for ts, dur, name, mod in ev:
        gap = 0.0 if prev_end is None else ts - prev_end
        prev_end = max(prev_end or 0.0, ts + dur)
        rows.append({"t": ts - ev[0][0], "dur": dur, "gap": gap, "name": name, "module": mod})
    return rows


def trace_device(run, n: int) -> dict:
    """Device kernels and memcpys of ``n`` calls of ``run()`` (profiler trace, CUPTI)."""
    jax.block_until_ready(run())

    def body():
        out = None
        for _ in range(n):
            out = run()
        jax.block_until_ready(out)

    got = record(body)
    if got is None:
        return {"error": "no perfetto trace written"}
    events, pname, tname, gpu_pids = got
    kernels, copies = [], []
    threads = collections.Counter()
    for e in events:
        if e.get("ph") != "X" or e.get("pid") not in gpu_pids:
            continue
        th = tname.get((e["pid"], e.get("tid")), "")
        threads[th] += 1
        if th.startswith(DERIVED_THREADS):
            continue
        name = e.get("name", "")
        args = e.get("args", {}) or {}
        item = (name, float(e.get("dur", 0.0)), float(e.get("ts", 0.0)), args.get("hlo_op", ""))
        (copies if "emcpy" in name or "emset" in name else kernels).append(item)
    kernels.sort(key=lambda k: k[2])
    busy = sum(k[1] for k in kernels)
    span = (kernels[-1][2] + kernels[-1][1] - kernels[0][2]) if kernels else 0.0
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for name, dur, _, hlo in kernels:
        key = name if hlo.startswith("command_buffer") or not hlo else hlo
        by_name[key][0] += 1
        by_name[key][1] += dur
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:25]
    return {
        "calls": n,
        "kernels_per_call": len(kernels) / n,
        "memcpys_per_call": len(copies) / n,
        "memcpy_names": sorted(collections.Counter(c[0] for c in copies).items())[:10],
        "device_busy_us_per_call": busy / n,
        "first_to_last_kernel_us_per_call": span / n,
        "top_kernels": [{"name": k, "count_per_call": v[0] / n, "us_per_call": v[1] / n}
                        for k, v in top],
        "device_threads": dict(threads),
        "_kernels": kernels,
    }


def jax_device_us(run, n: int, calls_per_run: int) -> dict:
    """Kernels and summed kernel time per op call of ``n`` runs of ``run()`` (each ``calls_per_run`` calls)."""
    t = trace_device(run, n)
    if "error" in t:
        return {"device_time_error": t["error"]}
    k = len(t["_kernels"])
    return {"kernels_per_call": k / (n * calls_per_run),
            "device_us_per_call": sum(x[1] for x in t["_kernels"]) / (n * calls_per_run)}


def torch_device_us(fn, calls: int) -> dict:
    """Kernels and summed kernel time per call of ``calls`` eager calls ``fn(i)``.

    Read from the same JAX profiler trace (CUPTI sees every kernel of the process): a
    second profiler (torch's) in the process would take CUPTI from JAX's for good.
    """
    import torch  # optional dependency of the benchmarks

    def run():
        for i in range(calls):
            fn(i)
        torch.cuda.synchronize()

    return jax_device_us(run, 1, calls)
