"""Where the host's time goes when it enqueues one runner step (issue 11: dispatch cost).

    PYTHONPATH=. python benchmarks/dispatch_probe.py --json OUT.json [--requests 8,64] [--steps 40]
        [--trace] [--no-env-child]

For the tiny model's decode step of N requests (one bucket of N tokens, the configuration
of ``profile_gpu.py --step``), every *variant* below is timed four ways, medians:

* ``idle_call_us``: host time for the call to return when the device is idle (synchronised
  before each call);
* ``enqueue_us``: host time per call of ``--steps`` calls back to back (no synchronisation);
* ``pipelined_us``: wall time per call of the same, synchronised once at the end (the rate
  a serving loop could reach if the host did nothing else);
* ``sync_us``: one call and wait for its outputs.

Variants (``exe`` = the executable, ``in`` = how the packed int32 input is passed):

* ``step[opts]``: the Runner's step (``step_fn``, state donated) compiled with XLA's
  default options (``xla``), with :data:`GPU_COMPILER_OPTIONS` (``cmdbuf``) or with command
  buffers off (``nocmdbuf``);
* ``in=np``: the numpy buffer (host-to-device copy inside the call, as the Runner does);
  ``in=dev_fresh``: arrays put on the device beforehand, a different one on each call
  (the input's address changes); ``in=dev_same``: the same device array on every call;
* ``stable_out[cmdbuf]``: the same step, its outputs written into donated buffers of the
  same shapes (every argument and output buffer keeps its address from call to call);
* ``closed_params[cmdbuf]``: the params closed over instead of passed;
* ``noop_donated`` / ``noop_kept``: an executable taking the step's argument tree that
  only touches the input (state donated and returned, or not donated and not returned):
  the cost of passing the arguments; ``noop_buf``: the input alone;
* ``env_cmdbuf`` (``--no-env-child`` skips it): the step in a child process whose
  ``XLA_FLAGS`` set the same command-buffer options process-wide instead of per executable.

``hlo_params`` is the executable's parameter count (``jax.jit`` drops unused arguments before
XLA sees them), ``leaves`` the argument leaves passed.
``--trace`` adds a profiler trace (CUPTI) of a few calls of selected variants: device
kernel time per step, and the host-side events per step (XLA's own annotations, e.g.
command-buffer recording or updates), summed by name.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import functools
import glob
import gzip
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from kvjax.host.scheduler import Request  # noqa: E402
from kvjax.runner import Runner, RunnerConfig  # noqa: E402
from kvjax.runner.packing import pack  # noqa: E402
from kvjax.runner.runner import GPU_COMPILER_OPTIONS, step_fn  # noqa: E402

OPTIONS = {
    "xla": {},
    "cmdbuf": dict(GPU_COMPILER_OPTIONS),
    "nocmdbuf": {"xla_gpu_enable_command_buffer": ""},
}
ENV_FLAGS = " ".join(f"--{k}={v}" for k, v in GPU_COMPILER_OPTIONS.items())
FRESH_POOL = 8  # distinct pre-transferred input arrays cycled by in=dev_fresh


def log(*a):
    print(*a, flush=True)


# --------------------------------------------------------------------------- timing


def timings(call, steps: int, rounds: int) -> dict:
    """The four host/wall times of ``call()`` (see the module docstring), microseconds."""
    jax.block_until_ready(call())
    idle, sync, enq, pipe = [], [], [], []
    for _ in range(rounds):
        for _ in range(max(3, steps // 4)):
            jax.block_until_ready(call())
            t0 = time.perf_counter()
            out = call()
            idle.append(time.perf_counter() - t0)
            jax.block_until_ready(out)
            sync.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        out = None
        for _ in range(steps):
            out = call()
        t1 = time.perf_counter()
        jax.block_until_ready(out)
        t2 = time.perf_counter()
        enq.append((t1 - t0) / steps)
        pipe.append((t2 - t0) / steps)
    med = lambda xs: statistics.median(xs) * 1e6  # noqa: E731
    return {"idle_call_us": med(idle), "enqueue_us": med(enq), "pipelined_us": med(pipe), "sync_us": med(sync)}


def hlo_param_count(exe) -> int | None:
    try:
        text = exe.as_text()
    except Exception:  # noqa: BLE001
        return None
    entry = re.search(r"^ENTRY [^\n]*\n(.*?)^}", text, re.M | re.S)
    return len(re.findall(r"\bparameter\(\d+\)", entry.group(1))) if entry else None


# --------------------------------------------------------------------------- traces


def trace_events(call, n: int) -> dict:
    """Device kernel time and host-side annotations per call of ``n`` calls (profiler trace)."""
    jax.block_until_ready(call())
    d = tempfile.mkdtemp(prefix="kvjax-dispatch-")
    with jax.profiler.trace(d, create_perfetto_trace=True):
        out = None
        for _ in range(n):
            out = call()
        jax.block_until_ready(out)
    files = glob.glob(os.path.join(d, "**", "*.trace.json.gz"), recursive=True)
    if not files:
        return {"error": f"no perfetto trace under {d}"}
    doc = json.load(gzip.open(files[0]))
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    pname, tname = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            pname[e["pid"]] = e["args"].get("name", "")
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            tname[(e["pid"], e["tid"])] = e["args"].get("name", "")
    gpu = {p for p, nm in pname.items() if "gpu" in nm.lower()}
    derived = ("XLA Ops", "XLA Modules", "Steps", "TensorFlow", "Source", "Framework", "Launch Stats")
    kern_us = kern_n = copy_n = 0.0
    host = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("ph") != "X":
            continue
        name, dur = e.get("name", ""), float(e.get("dur", 0.0))
        if e.get("pid") in gpu:
            th = tname.get((e["pid"], e.get("tid")), "")
            if any(th.startswith(x) for x in derived):
                continue
            if "emcpy" in name or "emset" in name:
                copy_n += 1
            else:
                kern_n += 1
                kern_us += dur
        else:
            key = re.sub(r"\d{3,}", "#", name)[:120]  # fold ids into one name
            host[key][0] += 1
            host[key][1] += dur
    top = sorted(host.items(), key=lambda kv: -kv[1][1])[:40]
    return {"calls": n, "kernels_per_call": kern_n / n, "memcpys_per_call": copy_n / n,
            "device_kernel_us_per_call": kern_us / n,
            "host_events": [{"name": k, "count_per_call": v[0] / n, "us_per_call": v[1] / n} for k, v in top]}


# --------------------------------------------------------------------------- the step


def make_runner(n: int) -> tuple[Runner, np.ndarray]:
    """A runner in steady decode for ``n`` requests, and the packed input of its next step."""
    cfg = RunnerConfig(max_num_seqs=n, max_num_batched_tokens=max(n, 8), num_blocks=4 * n + 8,
                       max_model_len=64, token_sizes=(max(n, 8),))
    runner = Runner(cfg, compiler_options={})
    sched = cfg.make_scheduler()
    for i in range(n):
        sched.add_request(Request(f"r{i}", [1 + i % 200], 10_000, 0))
    runner.precompile()
    for _ in range(3):  # prefill, then decode
        plan = sched.schedule()
        out = runner.execute(plan)
        sched.update(plan, out.sampled, out.num_sampled, out.logits)
    buf, _ = pack(runner.pack(sched.schedule()))
    return runner, buf


def compile_step(runner: Runner, opts: dict, *, mode: str = "plain"):
    """The step of the runner's one bucket under ``opts``; ``mode``: plain, stable_out, closed_params."""
    bucket = runner.buckets.buckets[0]
    buf, spec = pack(runner.pack(None, bucket))
    f = functools.partial(step_fn, config=runner.config, bucket=bucket, spec=spec)
    if mode == "plain":
        fn, donate, args = f, (1,), (runner.params, runner.state, buf)
    elif mode == "stable_out":
        outs = jax.eval_shape(f, runner.params, runner.state, buf)[1]
        outs = jax.tree.map(lambda s: jax.numpy.zeros(s.shape, s.dtype), outs)
        fn, donate, args = (lambda p, s, o, b: f(p, s, b)), (1, 2), (runner.params, runner.state, outs, buf)
    elif mode == "closed_params":
        params = runner.params
        fn, donate, args = (lambda s, b: f(params, s, b)), (0,), (runner.state, buf)
    else:
        raise ValueError(f"mode must be plain, stable_out or closed_params, got {mode!r}")
    with jax.default_matmul_precision(runner.config.matmul_precision):
        exe = jax.jit(fn, donate_argnums=donate, compiler_options=opts or None).lower(*args).compile()
    return exe, args


def variants(runner: Runner, buf_np: np.ndarray, which: set[str]):
    """Yield ``(name, inputs, call, leaves, hlo_params)`` for the selected variants."""
    dev_same = jax.device_put(buf_np)
    pool = [jax.device_put(buf_np.copy()) for _ in range(FRESH_POOL)]
    jax.block_until_ready((dev_same, pool))
    inputs = {"np": lambda i: buf_np, "dev_fresh": lambda i: pool[i % FRESH_POOL], "dev_same": lambda i: dev_same}
    ctr = [0]

    def nxt():
        ctr[0] += 1
        return ctr[0]

    for opt in ("cmdbuf", "xla", "nocmdbuf"):
        if f"step[{opt}]" not in which:
            continue
        exe, _ = compile_step(runner, OPTIONS[opt])
        hp = hlo_param_count(exe)
        for inp, get in inputs.items():
            def call(exe=exe, get=get):
                runner.state, outs = exe(runner.params, runner.state, get(nxt()))
                return outs
            yield f"step[{opt}]", inp, call, 53, hp
        del exe
    if "stable_out[cmdbuf]" in which:
        exe, args = compile_step(runner, OPTIONS["cmdbuf"], mode="stable_out")
        hp = hlo_param_count(exe)
        held = [args[2]]
        for inp in ("dev_same", "dev_fresh", "np"):
            get = inputs[inp]

            def call(exe=exe, get=get):
                runner.state, held[0] = exe(runner.params, runner.state, held[0], get(nxt()))
                return held[0]
            yield "stable_out[cmdbuf]", inp, call, len(jax.tree.leaves(args)), hp
        del exe
    if "closed_params[cmdbuf]" in which:
        exe, args = compile_step(runner, OPTIONS["cmdbuf"], mode="closed_params")
        hp = hlo_param_count(exe)
        for inp in ("np", "dev_same"):
            get = inputs[inp]

            def call(exe=exe, get=get):
                runner.state, outs = exe(runner.state, get(nxt()))
                return outs
            yield "closed_params[cmdbuf]", inp, call, len(jax.tree.leaves(args)), hp
        del exe
    if "noop" in which:
        donated = jax.jit(lambda p, s, b: (s, b[:1] + 1), donate_argnums=(1,)).lower(
            runner.params, runner.state, dev_same).compile()
        kept = jax.jit(lambda p, s, b: b[:1] + 1).lower(runner.params, runner.state, dev_same).compile()
        alone = jax.jit(lambda b: b[:1] + 1).lower(dev_same).compile()

        def c_donated(get):
            runner.state, out = donated(runner.params, runner.state, get(nxt()))
            return out

        for inp in ("dev_same", "np"):
            get = inputs[inp]
            yield "noop_donated", inp, functools.partial(c_donated, get), 53, hlo_param_count(donated)
            yield "noop_kept", inp, (lambda get=get: kept(runner.params, runner.state, get(nxt()))), 53, \
                hlo_param_count(kept)
            yield "noop_buf", inp, (lambda get=get: alone(get(nxt()))), 1, hlo_param_count(alone)


TRACED = {("step[cmdbuf]", "np"), ("step[cmdbuf]", "dev_same"), ("stable_out[cmdbuf]", "dev_same"),
          ("step[xla]", "np"), ("step[nocmdbuf]", "np")}


def host_costs(runner: Runner, buf_np: np.ndarray, reps: int) -> dict:
    """Host microseconds of packing and of the input transfer, and of fetching a step's outputs."""
    bucket = runner.buckets.buckets[0]
    t_pack, t_put, t_put_sync, t_fetch = [], [], [], []
    exe, _ = runner.executables[bucket]
    for _ in range(reps):
        t0 = time.perf_counter()
        pack(runner.pack(None, bucket))
        t_pack.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        a = jax.device_put(buf_np)
        t_put.append(time.perf_counter() - t0)
        jax.block_until_ready(a)
        t_put_sync.append(time.perf_counter() - t0)
        runner.state, outs = exe(runner.params, runner.state, buf_np)
        jax.block_until_ready(outs)
        t0 = time.perf_counter()
        [np.asarray(o) for o in outs]
        t_fetch.append(time.perf_counter() - t0)
    med = lambda xs: statistics.median(xs) * 1e6  # noqa: E731
    return {"pack_dummy_us": med(t_pack), "device_put_us": med(t_put), "device_put_sync_us": med(t_put_sync),
            "fetch_outputs_us": med(t_fetch), "packed_words": int(buf_np.size)}


def probe(n: int, steps: int, rounds: int, which: set[str], trace: bool, rows: list, traces: dict, errors: list,
          save) -> None:
    runner, buf_np = make_runner(n)
    host = host_costs(runner, buf_np, 20)
    log(f"n={n} host: " + json.dumps({k: round(v, 1) for k, v in host.items()}))
    traces[f"host_costs n={n}"] = host
    gen = variants(runner, buf_np, which)
    while True:
        try:
            item = next(gen)
        except StopIteration:
            break
        except Exception as e:  # noqa: BLE001  (a variant that does not compile here)
            errors.append(f"n={n}: {type(e).__name__}: {e}"[:2000])
            log(f"ERROR n={n}: {type(e).__name__}: {str(e)[:800]}")
            break
        name, inp, call, leaves, hp = item
        try:
            row = {"requests": n, "variant": name, "inputs": inp, "leaves": leaves, "hlo_params": hp,
                   **timings(call, steps, rounds)}
            if trace and (name, inp) in TRACED:
                tr = trace_events(call, 10)
                traces[f"{name} in={inp} n={n}"] = tr
                row["device_kernel_us"] = tr.get("device_kernel_us_per_call")
                row["kernels"] = tr.get("kernels_per_call")
        except Exception as e:  # noqa: BLE001
            errors.append(f"n={n} {name} in={inp}: {type(e).__name__}: {e}"[:2000])
            log(f"ERROR n={n} {name} in={inp}: {type(e).__name__}: {str(e)[:800]}")
            continue
        rows.append(row)
        log(fmt_row(row))
        save()


COLS = ("requests", "variant", "inputs", "leaves", "hlo_params", "idle_call_us", "enqueue_us", "pipelined_us",
        "sync_us", "device_kernel_us", "kernels")


def fmt_row(r: dict) -> str:
    out = []
    for c in COLS:
        v = r.get(c)
        out.append(f"{v:.1f}" if isinstance(v, float) else ("-" if v is None else str(v)))
    return "| " + " | ".join(out) + " |"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True, metavar="OUT")
    ap.add_argument("--requests", default="8,64")
    ap.add_argument("--steps", type=int, default=40, help="calls back to back per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--variants", default="step[cmdbuf],step[xla],step[nocmdbuf],stable_out[cmdbuf],"
                    "closed_params[cmdbuf],noop")
    ap.add_argument("--trace", action="store_true", help="profiler traces of selected variants")
    ap.add_argument("--no-env-child", action="store_true", help="skip the XLA_FLAGS child process")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    which = set(a.variants.split(","))
    t_start = time.perf_counter()
    res = {"meta": {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": str(getattr(jax.devices()[0], "device_kind", jax.devices()[0])),
        "platform": jax.default_backend(), "jax": jax.__version__,
        "jaxlib": getattr(__import__("jaxlib"), "__version__", "?"), "python": platform.python_version(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""), "gpu_compiler_options": GPU_COMPILER_OPTIONS,
        "argv": sys.argv[1:], "method": __doc__.split("\n\n", 2)[2].strip(),
    }, "rows": [], "traces": {}, "errors": []}

    def save():
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1, default=str)

    log("| " + " | ".join(COLS) + " |")
    for n in (int(x) for x in a.requests.split(",")):
        try:
            probe(n, a.steps, a.rounds, which, a.trace, res["rows"], res["traces"], res["errors"], save)
        except Exception as e:  # noqa: BLE001
            res["errors"].append(f"n={n}: {type(e).__name__}: {e}"[:2000])
            log(f"ERROR n={n}: {type(e).__name__}: {str(e)[:800]}")
        jax.clear_caches()
        save()
    if not a.child and not a.no_env_child and jax.default_backend() == "gpu":
        child_json = a.json + ".env-child.json"
        env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + ENV_FLAGS).strip())
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--json", child_json, "--requests", a.requests,
               "--steps", str(a.steps), "--rounds", str(a.rounds), "--variants", "step[xla]"]
        log(f"child: XLA_FLAGS={env['XLA_FLAGS']!r}")
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        log(p.stdout[-4000:] + p.stderr[-2000:])
        try:
            with open(child_json) as f:
                child = json.load(f)
            for r in child["rows"]:
                r["variant"] = "env_cmdbuf"
                res["rows"].append(r)
            res["errors"] += [f"env child: {e}" for e in child["errors"]]
        except (OSError, ValueError) as e:
            res["errors"].append(f"env child: {type(e).__name__}: {e}; rc={p.returncode}")
    res["meta"]["seconds"] = time.perf_counter() - t_start
    save()
    log("\n| " + " | ".join(COLS) + " |\n|" + "---|" * len(COLS))
    for r in res["rows"]:
        log(fmt_row(r))
    if res["errors"]:
        log("errors:\n  " + "\n  ".join(res["errors"]))
    log(f"{res['meta']['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
