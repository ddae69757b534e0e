"""One real-size decode step, kernel by kernel, and the overlapped loop's launches, on a GPU (issue 24).

    PYTHONPATH=. python benchmarks/probe_decode_step.py timeline --preset granite-4.0-h-micro --batch 1 --out DIR
    PYTHONPATH=. python benchmarks/probe_decode_step.py loop --preset granite-4.0-h-micro --batch 16,64 --out DIR
    PYTHONPATH=. python benchmarks/probe_decode_step.py gap --preset granite-4.0-h-micro --batch 1 --out DIR

``timeline``: the decode step of ``--batch`` requests (context ``--context``), or with ``--prefill N``
one request's prefill of ``N`` tokens, traced over three calls; writes the middle call's kernels in launch order (name, XLA op, duration, idle time before
it) to ``timeline-<preset>-b<batch>.tsv``, the step's optimized HLO to ``hlo-<preset>-b<batch>.txt``,
and a summary by kernel family to ``timeline.json``.

``loop``: the overlapped serving loop's launch pattern at each batch (step N+1 enqueued, then step
N's outputs read), each of the Runner's launch calls timed on the host (input ``device_put``, the
staging program, the step, the output copy, ``copy_to_host_async``, the read of the step before),
in variants (a fresh input per step or one input kept; the previous outputs read or not); then a
host trace of a few loop iterations summed by event name, with every event over 300 us listed.

``gap``: where the step's time above its kernels goes: the step back to back with the staging
and fetch programs left out in turn, the step ``--loop`` times inside one executable (no host
between steps), and a device-only trace (no host tracer) whose fourth step's events of every
kind, memcpys included, go to ``events-<preset>-b<batch><tag>.tsv``; ``--bucket-tokens`` runs
the batch in a bucket of that many tokens.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _family(name: str) -> str:
    base = re.sub(r"(_\d+)+$", "", name)
    base = re.sub(r"__\d+$", "", base)
    return base


def _boundaries(call, log) -> list:
    """Every device event (kernels, copies, memsets) around the two boundaries between three
    back-to-back calls: name, start relative to the first event, duration, idle time before it."""
    import jax

    from _trace import device_timeline, record

    jax.block_until_ready(call())

    def body():
        o = None
        for _ in range(3):
            o = call()
        jax.block_until_ready(o)

    rows = device_timeline(record(body))
    if not rows:
        return []
    big = [r for r in rows if r["gap"] > 20]
    log(f"  {len(rows)} device events over 3 calls, span {rows[-1]['t'] + rows[-1]['dur']:.0f} us; "
        f"idle gaps > 20 us: {len(big)}, {sum(r['gap'] for r in big):.0f} us")
    for r in big[:30]:
        log(f"    at {r['t']:9.1f} idle {r['gap']:7.1f} us before {r['name']} [{r['module']}]")
    return rows


def timeline(a, log) -> dict:
    import jax

    from _trace import trace_device
    from bench_model import Bench

    out = {}
    for b in [int(x) for x in a.batch.split(",")] if not a.prefill else [1]:
        if a.prefill:  # one request's prefill of that many tokens instead of a decode step
            bench = Bench(a.preset, {"decode": [], "prefill": (a.prefill,), "max_model_len": 32768})
        else:
            bench = Bench(a.preset, {"decode": [(a.context, (b,))], "prefill": (), "max_model_len": 32768})
        bench.compile_all()
        r = bench.runner
        plan = bench.fabricate_prefill(a.prefill) if a.prefill else bench.fabricate_decode(b, a.context)
        prepared = r.prepare(plan)
        r.launch(prepared).fetch()
        buf = r.put_inputs(prepared)

        def call():
            return r._enqueue(prepared.bucket, buf)[0]

        exe, _ = r.executables[prepared.bucket]
        tag = f"{a.preset}-prefill{a.prefill}" if a.prefill else f"{a.preset}-b{b}"
        with open(os.path.join(a.out, f"hlo-{tag}.txt"), "w") as f:
            f.write(exe.as_text())
        tr = trace_device(call, 3)
        kern = tr.pop("_kernels", [])
        out[f"{tag}-copies"] = {"memcpys_per_call": tr.get("memcpys_per_call"), "names": tr.get("memcpy_names")}
        out[f"{tag}-boundaries"] = _boundaries(call, log)
        # the middle call: kernels between the second and third occurrences of the first kernel name
        per = len(kern) // 3
        mid = kern[per: 2 * per]
        rows, fam = [], collections.defaultdict(lambda: [0, 0.0, 0.0])
        prev_end = None
        for name, dur, ts, hlo in mid:
            gap = 0.0 if prev_end is None else max(ts - prev_end, 0.0)
            prev_end = ts + dur
            key = hlo if hlo and not hlo.startswith("command_buffer") else name
            rows.append((key[:90], name[:60], dur, gap))
            f_ = fam[_family(key)]
            f_[0] += 1
            f_[1] += dur
            f_[2] += gap
        with open(os.path.join(a.out, f"timeline-{tag}.tsv"), "w") as f:
            f.write("op\tkernel\tdur_us\tgap_before_us\n")
            for row in rows:
                f.write(f"{row[0]}\t{row[1]}\t{row[2]:.2f}\t{row[3]:.2f}\n")
        fams = sorted(fam.items(), key=lambda kv: -kv[1][1])
        out[tag] = {"kernels": len(mid), "busy_us": sum(r_[2] for r_ in rows),
                    "gaps_us": sum(r_[3] for r_ in rows),
                    "span_us": (mid[-1][2] + mid[-1][1] - mid[0][2]) if mid else 0.0,
                    "families": [{"family": k, "count": v[0], "us": v[1], "gap_before_us": v[2]} for k, v in fams]}
        log(f"{tag}: {len(mid)} kernels, busy {out[tag]['busy_us']:.0f} us, gaps {out[tag]['gaps_us']:.0f} us, "
            f"span {out[tag]['span_us']:.0f} us")
        for k, v in fams[:40]:
            log(f"   {v[1]:8.1f} us  x{v[0]:<4d} gaps {v[2]:7.1f}  {k}")
        del bench, r, exe
        jax.clear_caches()
    return out


def _timed_steps(one, r, steps: int, warm: int) -> tuple[float, float]:
    """``(wall, host)`` us per call of ``one()`` (``one(False)`` ``warm`` times first, untimed):
    ``steps`` calls back to back until the Runner's rows are ready, and the host's share."""
    import jax

    for _ in range(warm):
        one(False)
    jax.block_until_ready(r._rows)
    t0 = time.perf_counter()
    for _ in range(steps):
        one()
    t1 = time.perf_counter()
    jax.block_until_ready(r._rows)
    return (time.perf_counter() - t0) / steps * 1e6, (t1 - t0) / steps * 1e6


def _decode_steps(a):
    """``(bench, runner, steps)``: a Bench of ``--preset`` compiled for decode at each ``--batch``
    (context ``--context``); ``steps`` yields, per batch, ``(batch, plan, prepared, step
    executable, staging program, fetch program)`` after one step through the Runner's own path.
    ``--bucket-tokens`` (gap mode): the runner's decode buckets have that many tokens, whatever
    the batch (a batch of 1 in a bucket of 2: its second token is padding)."""
    from bench_model import Bench

    batches = [int(x) for x in a.batch.split(",")]
    sizes = [a.bucket_tokens or b for b in batches]
    bench = Bench(a.preset, {"decode": [(a.context, tuple(sizes))], "prefill": (), "max_model_len": a.max_model_len,
                             "max_num_seqs": a.max_num_seqs, "num_blocks": a.num_blocks})
    bench.compile_all()
    r = bench.runner

    def steps():
        for b in batches:
            plan = bench.fabricate_decode(b, a.context)
            prepared = r.prepare(plan)
            r.launch(prepared).fetch()
            exe, _ = r.executables[prepared.bucket]
            yield b, plan, prepared, exe, r._stage, r._fetch(r.output_spec(prepared.bucket).size)

    return bench, r, steps()


def loop(a, log) -> dict:
    import jax
    import numpy as np

    from probe_launch import host_events

    bench, r, steps = _decode_steps(a)
    res = {}
    for b, plan, prepared, exe, stage, fetch in steps:
        same = r.put_inputs(prepared)
        for variant in ("fresh_in_read_prev", "same_in_read_prev", "fresh_in_no_read", "fresh_in_no_copy",
                        "fresh_in_read_prev_prepare"):
            fresh = variant.startswith("fresh")
            read = "read_prev" in variant
            copy = "no_copy" not in variant
            times = collections.defaultdict(list)
            prev = [None]

            def one(rec=True):
                t = [time.perf_counter()]
                buf = r.put_inputs(prepared) if fresh else same
                t.append(time.perf_counter())
                r._rows = stage(r._rows, buf)
                t.append(time.perf_counter())
                r._rows, r._pools, _checks = exe(r.params, r._rows, r._pools)
                t.append(time.perf_counter())
                o = fetch(r._rows)
                t.append(time.perf_counter())
                if copy:
                    o.copy_to_host_async()
                t.append(time.perf_counter())
                if read and prev[0] is not None:
                    np.asarray(prev[0])
                t.append(time.perf_counter())
                if variant.endswith("prepare"):
                    r.prepare(plan)
                t.append(time.perf_counter())
                prev[0] = o
                if rec:
                    for k, (x, y) in zip(("put", "stage", "step", "fetch", "copy_async", "read_prev", "prepare"),
                                         zip(t, t[1:])):
                        times[k].append((y - x) * 1e6)
                    times["total"].append((t[-1] - t[0]) * 1e6)
                return r._rows

            wall, _ = _timed_steps(one, r, a.steps, warm=5)
            med = {k: statistics.median(v) for k, v in times.items()}
            row = {"batch": b, "variant": variant, "wall_per_step_us": wall, "host_us": med}
            tr = host_events(lambda: one(False), 3)
            row["host_trace_top"] = tr.get("top", [])[:25]
            row["long_events"] = tr.get("long_events", [])[:40]
            log(f"b{b:<3d} {variant:28s} wall/step {wall:7.0f} | " +
                " ".join(f"{k} {v:6.0f}" for k, v in med.items()))
            for e in row["host_trace_top"][:10]:
                log(f"      {e['us_per_call']:8.0f} us x{e['count_per_call']:<6.1f} max {e['max_us']:7.0f} {e['name'][:90]}")
            res[f"b{b}-{variant}"] = row
            prev[0] = None
        # device time of the step alone (same input, back to back, nothing read)
        jax.block_until_ready(r._rows)
        t0 = time.perf_counter()
        for _ in range(a.steps):
            r._rows = stage(r._rows, same)
            r._rows, r._pools, _c = exe(r.params, r._rows, r._pools)
        jax.block_until_ready(r._rows)
        res[f"b{b}-device"] = {"step_us": (time.perf_counter() - t0) / a.steps * 1e6}
        log(f"b{b} back to back, nothing read: {res[f'b{b}-device']['step_us']:.0f} us per step")
    return res


def launches(a, log) -> dict:
    """``Runner.launch`` of one prepared decode step back to back, as ``bench_overlap``'s device
    floor does, with the previous launches' handles and staged inputs dropped or kept: which
    release waits for the device."""
    bench, r, steps = _decode_steps(a)
    res = {}
    for b, plan, prepared, exe, stage, fetch in steps:
        variants = a.variants.split(",")
        exe2 = None
        if any(v.startswith("alternate") for v in variants):
            lowered, _ = r._lower(prepared.bucket)
            exe2 = lowered.compile()
        for variant in variants:
            kept = collections.deque(maxlen=2)
            times = collections.defaultdict(list)
            flip = [False]

            def one(rec=True):
                if variant.startswith("launch"):
                    t0 = time.perf_counter()
                    p = r.launch(prepared)
                    t1 = time.perf_counter()
                    if variant == "launch_keep2":
                        kept.append(p)
                    del p
                    t2 = time.perf_counter()
                    if rec:
                        times["launch"].append((t1 - t0) * 1e6)
                        times["release"].append((t2 - t1) * 1e6)
                    return
                t = [time.perf_counter()]
                buf = r.put_inputs(prepared)
                t.append(time.perf_counter())
                r._rows = stage(r._rows, buf)
                use = exe
                if variant.startswith("alternate"):
                    flip[0] = not flip[0]
                    use = exe2 if flip[0] else exe
                r._rows, r._pools, checks = use(r.params, r._rows, r._pools)
                o = fetch(r._rows)
                o.copy_to_host_async()
                t.append(time.perf_counter())
                if variant in ("replica_keep_buf", "replica_keep_both", "alternate_keep_both"):
                    kept.append((buf, checks) if variant == "replica_keep_buf" else (buf, checks, o))
                elif variant == "replica_keep_out":
                    kept.append((o, checks))
                del buf, checks, o
                t.append(time.perf_counter())
                if rec:
                    for k, (x, y) in zip(("put", "enqueue", "release"), zip(t, t[1:])):
                        times[k].append((y - x) * 1e6)

            wall, host = _timed_steps(one, r, a.steps, warm=4)
            kept.clear()
            med = {k: statistics.median(v) for k, v in times.items()}
            res[f"b{b}-{variant}"] = {"wall_per_step_us": wall, "host_per_step_us": host,
                                      "host_us": med}
            log(f"b{b:<3d} {variant:20s} wall/step {wall:7.0f}  host/step {host:7.0f} | " +
                " ".join(f"{k} {v:6.0f}" for k, v in med.items()))
    return res


def serve(a, log) -> dict:
    """``bench_overlap``'s overlapped serving loop at ``--batch`` requests (one N), once timed and
    once under the profiler: the host events over 200 us of the middle steps, in time order, and
    every host event summed by name per step (what a launch waits in)."""
    from _trace import record
    from bench_overlap import PresetBench

    n = int(a.batch.split(",")[0])
    pb = PresetBench(a.preset, [n], prompt_len=16, steps=a.steps, skip=3, max_new=None, seed=0, workers=2)
    extra = json.loads(os.environ.get("KVJAX_PROBE_OPTIONS", "{}"))
    if extra:  # compile-option variant of the Runner's own
        pb.runner.compiler_options = {**(pb.runner.compiler_options or {}), **extra}
        log(f"compiler options: {pb.runner.compiler_options}")
    total = pb.max_tokens
    plans = pb.dry_run(pb.requests(n, total)) + pb.dry_run(pb.requests(n, pb.admit_steps[n] + 3))
    pb.compile(sorted({p.bucket for p in plans}))
    pb.warm(n)
    res = pb.serve(n, total, True)
    marks = res["marks"]
    mid = marks[len(marks) // 3: 2 * len(marks) // 3]
    per = statistics.median(b[0] - a_[0] for a_, b in zip(mid, mid[1:])) * 1e6
    launch = statistics.median(m[4] for m in mid) * 1e6
    log(f"overlap serve N={n}: {per:.0f} us per step, launch {launch:.0f} us (median of {len(mid)} middle steps)")
    got = record(lambda: pb.serve(n, total, True))
    events, _, tname, gpu = got
    host = [e for e in events if e.get("ph") == "X" and e.get("pid") not in gpu
            and not tname.get((e["pid"], e.get("tid")), "").startswith(("tf_PjRtCompiler", "tf_xla-"))]
    host.sort(key=lambda e: float(e["ts"]))
    t0, t1 = float(host[0]["ts"]), float(host[-1]["ts"])
    lo, hi = t0 + 0.45 * (t1 - t0), t0 + 0.55 * (t1 - t0)
    window = [e for e in host if lo <= float(e["ts"]) <= hi]
    steps_in = max(1, sum(1 for e in window if e.get("name", "").startswith("PjitFunction(jit(sm))")))
    by = collections.defaultdict(lambda: [0, 0.0])
    for e in window:
        by[e.get("name", "")[:120]][0] += 1
        by[e.get("name", "")[:120]][1] += float(e.get("dur", 0.0))
    top = sorted(by.items(), key=lambda kv: -kv[1][1])[:60]
    log(f"traced: {steps_in} steps in the middle 10% of the run; host events summed per step:")
    for k, v in top:
        log(f"   {v[1] / steps_in:9.0f} us  x{v[0] / steps_in:<6.1f} {k}")
    long_ = [(float(e["ts"]) - lo, float(e.get("dur", 0.0)), e.get("name", "")[:110],
              tname.get((e["pid"], e.get("tid")), "")[:30]) for e in window if float(e.get("dur", 0.0)) > 200]
    log("events over 200 us in time order (us from the window start, duration, thread):")
    for ts, du, nm, th in long_[:120]:
        log(f"   {ts:9.0f} {du:8.0f}  [{th}] {nm}")
    return {"per_step_us": per, "launch_us": launch,
            "summed_per_step": [{"name": k, "count": v[0] / steps_in, "us": v[1] / steps_in} for k, v in top],
            "long_events": [{"t": x[0], "dur": x[1], "name": x[2], "thread": x[3]} for x in long_]}


def _looped(r, prepared, stage, same, K, b, log) -> dict:
    """The step ``K`` times inside one executable (a ``fori_loop``): its device time per step
    with no host between steps."""
    import jax

    fn, args, _ = r.jitted_step(prepared.bucket)
    fn = fn.__wrapped__  # the traced function: compiler options go on the outer jit only

    def looped(params, rows, pools):
        return jax.lax.fori_loop(0, K, lambda i, c: tuple(fn(params, c[0], c[1])[:2]), (rows, pools))

    with jax.default_matmul_precision(r.config.matmul_precision):
        lo = jax.jit(looped, donate_argnums=(1, 2), compiler_options=r.compiler_options).lower(*args)
    t0 = time.perf_counter()
    lexe = lo.compile()
    log(f"  compiled the {K}-step loop in {time.perf_counter() - t0:.1f} s")
    r._rows = stage(r._rows, same)
    for _ in range(2):
        r._rows, r._pools = lexe(r.params, r._rows, r._pools)
    jax.block_until_ready(r._rows)
    walls = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(4):
            r._rows, r._pools = lexe(r.params, r._rows, r._pools)
        jax.block_until_ready(r._rows)
        walls.append((time.perf_counter() - t0) / (4 * K) * 1e6)
    log(f"b{b:<3d} {K}-step fori_loop   per step  {statistics.median(walls):7.0f} {[round(w) for w in walls]}")
    return {"us_per_step": statistics.median(walls), "walls": walls, "K": K}


def gap(a, log) -> dict:
    """Where a batch-``--batch`` step's time above its kernels goes: the step back to back as the
    Runner launches it (stage, step, fetch), then with parts left out, each call's host time, and
    the same step ``--loop`` times inside one executable (a ``fori_loop``: no host between
    steps); then a device-only trace of the launched steps: the idle time at each boundary between
    two steps and the device events in it."""
    import jax

    from _trace import device_timeline, record

    bench, r, steps = _decode_steps(a)
    res = {}
    for b, plan, prepared, exe, stage, fetch in steps:
        same = r.put_inputs(prepared)
        parts = {"stage_step_fetch": ("stage", "step", "fetch"), "stage_step": ("stage", "step"),
                 "step": ("step",), "step_fetch": ("step", "fetch")}
        for variant, use in parts.items():
            times = collections.defaultdict(list)

            def one(rec=True):
                t = [time.perf_counter()]
                if "stage" in use:
                    r._rows = stage(r._rows, same)
                t.append(time.perf_counter())
                r._rows, r._pools, _c = exe(r.params, r._rows, r._pools)
                t.append(time.perf_counter())
                if "fetch" in use:
                    fetch(r._rows)
                t.append(time.perf_counter())
                if rec:
                    for k, (x, y) in zip(("stage", "step", "fetch"), zip(t, t[1:])):
                        times[k].append((y - x) * 1e6)

            walls = [_timed_steps(one, r, a.steps, warm=3)[0] for _ in range(3)]
            med = {k: statistics.median(v) for k, v in times.items() if k.split("_")[0] in use}
            res[f"b{b}-{variant}"] = {"wall_per_step_us": statistics.median(walls), "walls": walls, "host_us": med}
            log(f"b{b:<3d} {variant:18s} wall/step {statistics.median(walls):7.0f} {[round(w) for w in walls]} | "
                + " ".join(f"{k} {v:6.0f}" for k, v in med.items()))
        if a.loop:
            res[f"b{b}-device_loop"] = _looped(r, prepared, stage, same, a.loop, b, log)
        # device-only trace of launched steps: idle time at each boundary
        for variant, use in (("stage_step_fetch", True), ("step", False)):
            def body():
                for _ in range(6):
                    if use:
                        r._rows = stage(r._rows, same)
                    r._rows, r._pools, _c = exe(r.params, r._rows, r._pools)
                    if use:
                        fetch(r._rows)
                jax.block_until_ready(r._rows)

            body()
            rows_ = [(x["t"], x["dur"], x["gap"], x["name"]) for x in device_timeline(record(body, device_only=True))]
            if not rows_:
                log(f"b{b:<3d} trace {variant}: no device events (not a GPU)")
                continue
            busy = sum(x[1] for x in rows_)
            span = rows_[-1][0] + rows_[-1][1]
            big = [x for x in rows_ if x[2] > 15]
            log(f"b{b:<3d} trace {variant}: {len(rows_)} device events in 6 steps, span {span:.0f} us "
                f"({span / 6:.0f} per step), busy {busy / 6:.0f} per step, idle > 15 us: {len(big)} gaps, "
                f"{sum(x[2] for x in big) / 6:.0f} us per step")
            for x in big[:20]:
                log(f"      at {x[0]:9.1f} idle {x[2]:7.1f} us before {x[3]}")
            res[f"b{b}-trace-{variant}"] = {"span_per_step": span / 6, "busy_per_step": busy / 6,
                                            "gaps": [{"t": x[0], "idle": x[2], "before": x[3]} for x in big]}
            if variant == "step":  # the fourth step's events, every kind, in order
                per = len(rows_) // 6  # every step launches the same events
                lo_, hi_ = 3 * per, 4 * per
                with open(os.path.join(a.out, f"events-{a.preset}-b{b}{a.tag}.tsv"), "w") as f:
                    f.write("name\tdur_us\tgap_before_us\n")
                    for x in rows_[lo_:hi_]:
                        f.write(f"{x[3]}\t{x[1]:.2f}\t{x[2]:.2f}\n")
        with open(os.path.join(a.out, f"hlo-{a.preset}-b{b}{a.tag}.txt"), "w") as f:
            f.write(exe.as_text())
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=("timeline", "loop", "launches", "serve", "gap"))
    ap.add_argument("--preset", default="granite-4.0-h-micro")
    ap.add_argument("--batch", default="1")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--prefill", type=int, default=0, help="timeline: one request's prefill of this many "
                    "tokens in place of the decode batches")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--loop", type=int, default=8, help="gap: steps in the looped executable (0: none)")
    ap.add_argument("--bucket-tokens", type=int, default=0, help="gap: the decode buckets' token count")
    ap.add_argument("--max-model-len", type=int, default=32768, help="gap: the table's width in tokens")
    ap.add_argument("--max-num-seqs", type=int, default=0, help="gap: request rows (0: the largest batch)")
    ap.add_argument("--num-blocks", type=int, default=0, help="gap: KV blocks (0: what the batches need)")
    ap.add_argument("--tag", default="", help="gap: suffix of the written file names")
    ap.add_argument("--variants", default="launch_drop,replica_drop_buf,replica_keep_both,alternate,alternate_keep_both",
                    help="launches: the launch patterns")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    from bench_model import log

    res = {"timeline": timeline, "loop": loop, "launches": launches, "serve": serve, "gap": gap}[a.mode](a, log)
    with open(os.path.join(a.out, f"{a.mode}-{a.preset}{a.tag}.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
