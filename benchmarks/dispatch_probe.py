"""Where the host's time goes when it enqueues one runner step (issue 11: dispatch cost).

    PYTHONPATH=. python benchmarks/dispatch_probe.py --json OUT.json [--requests 8,64] [--steps 40]
        [--trace] [--no-children] [--child-requests 64]

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
* ``packed[opts]`` / ``packed_stable[opts]`` / ``packed_all[opts]``: the Runner's
  ``layout="packed"`` (rows and tables one donated buffer, outputs one buffer) without / with
  ``stable_input=True``, and with the params packed too (``pack_params=True``), called through
  ``Runner.enqueue`` (which also queues the output's copy to the host, as serving does; the
  other variants call the executables bare);
* ``stable_out[...]`` / ``closed_params[...]`` / ``step[...]`` take any of the option sets.

Child processes (``--no-children`` skips them; GPU only), each with its own environment,
run the ``n`` of ``--child-requests`` (JAX reads these settings once per process):

* ``env_cmdbuf``: ``XLA_FLAGS`` set the Runner's command-buffer options process-wide (and
  ``--xla_enable_command_buffers_during_profiling``, so that its ``--trace`` shows the
  command buffers' host events: ``command_buffer::update`` is a re-recording of the
  graph's changed nodes before a launch, ``command_buffer::execute`` the launch);
* ``vlog``: the same with XLA's own log of every command-buffer update (how many commands
  were updated / skipped and how long the update took, how many allocations had moved),
  summarised per variant under ``vlog``; its timings include the logging, not reported;
* ``vmm_skip_temp`` (``XLA_PYTHON_CLIENT_ALLOCATOR=vmm``,
  ``--xla_gpu_command_buffer_update_mode=SKIP_TEMP``: temporaries at stable virtual
  addresses, so only nodes touching moved arguments or outputs are updated),
  ``vmm_skip_profiled`` (``SKIP_PROFILED``: after 3 profiled runs, arguments and outputs
  that move are mapped to stable virtual addresses too), ``vmm``,
  ``cuda_async`` (allocators; ``cuda_async_vlog`` with the update log), ``vmm_compile_opt`` /
  ``skip_temp_no_vmm`` (``SKIP_TEMP`` as a per-executable compile option, option set
  ``cmdbuf_skip_temp``, with / without the VMM allocator) and ``tfrt_client``
  (``XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT=1``).

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
    # the Runner's options + temporaries at stable virtual addresses (needs the VMM allocator)
    "cmdbuf_skip_temp": {**GPU_COMPILER_OPTIONS, "xla_gpu_command_buffer_update_mode": "SKIP_TEMP"},
}
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
    cmdbuf = collections.defaultdict(lambda: [0, 0.0])
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
            key = re.sub(r"\d{3,}", "#", name.split("#")[0])[:120]  # TraceMe arguments, ids folded
            host[key][0] += 1
            host[key][1] += dur
            if re.search(r"command.?buffer|graph", name, re.I):
                cmdbuf[key][0] += 1
                cmdbuf[key][1] += dur
    top = sorted(host.items(), key=lambda kv: -kv[1][1])[:40]
    return {"calls": n, "kernels_per_call": kern_n / n, "memcpys_per_call": copy_n / n,
            "device_kernel_us_per_call": kern_us / n,
            "host_events": [{"name": k, "count_per_call": v[0] / n, "us_per_call": v[1] / n} for k, v in top],
            "command_buffer_events": {k: {"count_per_call": v[0] / n, "us_per_call": v[1] / n}
                                      for k, v in sorted(cmdbuf.items())}}


# --------------------------------------------------------------------------- the step


def make_runner(n: int, opts: dict) -> tuple[Runner, np.ndarray]:
    """A runner (step compiled with ``opts``) in steady decode for ``n`` requests, and the
    packed input of its next step."""
    cfg = RunnerConfig(max_num_seqs=n, max_num_batched_tokens=max(n, 8), num_blocks=4 * n + 8,
                       max_model_len=64, token_sizes=(max(n, 8),))
    runner = Runner(cfg, compiler_options=opts, layout="tree")  # the variants call its executables
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


def compile_step(runner: Runner, opts: dict, *, mode: str = "step"):
    """The step of the runner's one bucket under ``opts``; ``mode``: step, stable_out, closed_params."""
    bucket = runner.buckets.buckets[0]
    buf, spec = pack(runner.pack(None, bucket))
    f = functools.partial(step_fn, config=runner.config, bucket=bucket, spec=spec)
    if mode == "step":
        fn, donate, args = f, (1,), (runner.params, runner.state, buf)
    elif mode == "stable_out":
        outs = jax.eval_shape(f, runner.params, runner.state, buf)[1]
        outs = jax.tree.map(lambda s: jax.numpy.zeros(s.shape, s.dtype), outs)
        fn, donate, args = (lambda p, s, o, b: f(p, s, b)), (1, 2), (runner.params, runner.state, outs, buf)
    elif mode == "closed_params":
        params = runner.params
        fn, donate, args = (lambda s, b: f(params, s, b)), (0,), (runner.state, buf)
    else:
        raise ValueError(f"mode must be step, stable_out or closed_params, got {mode!r}")
    with jax.default_matmul_precision(runner.config.matmul_precision):
        exe = jax.jit(fn, donate_argnums=donate, compiler_options=opts or None).lower(*args).compile()
    return exe, args


def split_variant(v: str) -> tuple[str, str | None]:
    m = re.fullmatch(r"(\w+)\[(\w+)\]", v)
    if m is None:
        return v, None
    if m.group(2) not in OPTIONS:
        raise ValueError(f"variant {v!r}: option set must be one of {sorted(OPTIONS)}")
    return m.group(1), m.group(2)


def variants(runner: Runner, runner_opt: str, buf_np: np.ndarray, which: list[str]):
    """Yield ``(name, inputs, call, leaves, hlo_params)`` for the selected variants, in order."""
    dev_same = jax.device_put(buf_np)
    pool = [jax.device_put(buf_np.copy()) for _ in range(FRESH_POOL)]
    jax.block_until_ready((dev_same, pool))
    inputs = {"np": lambda i: buf_np, "dev_fresh": lambda i: pool[i % FRESH_POOL], "dev_same": lambda i: dev_same}
    ctr = [0]

    def nxt():
        ctr[0] += 1
        return ctr[0]

    for v in which:
        kind, opt = split_variant(v)
        if kind == "step":
            if opt == runner_opt:
                exe = runner.executables[runner.buckets.buckets[0]][0]
            else:
                exe, _ = compile_step(runner, OPTIONS[opt])
            hp = hlo_param_count(exe)
            for inp, get in inputs.items():
                def call(exe=exe, get=get):
                    runner.state, outs = exe(runner.params, runner.state, get(nxt()))
                    return outs
                yield v, inp, call, 53, hp
        elif kind == "stable_out":
            exe, args = compile_step(runner, OPTIONS[opt], mode="stable_out")
            hp = hlo_param_count(exe)
            held = [args[2]]
            for inp in ("dev_same", "dev_fresh", "np"):
                get = inputs[inp]

                def call(exe=exe, get=get):
                    runner.state, held[0] = exe(runner.params, runner.state, held[0], get(nxt()))
                    return held[0]
                yield v, inp, call, len(jax.tree.leaves(args)), hp
        elif kind == "closed_params":
            exe, args = compile_step(runner, OPTIONS[opt], mode="closed_params")
            hp = hlo_param_count(exe)
            for inp in ("np", "dev_same"):
                get = inputs[inp]

                def call(exe=exe, get=get):
                    runner.state, outs = exe(runner.state, get(nxt()))
                    return outs
                yield v, inp, call, len(jax.tree.leaves(args)), hp
        elif kind in ("packed", "packed_stable", "packed_all"):  # the Runner's packed layout
            pr = Runner(runner.config, compiler_options=OPTIONS[opt], layout="packed",
                        stable_input=kind != "packed", pack_params=kind == "packed_all")
            pr.precompile()
            pr.state = jax.tree.map(jax.numpy.copy, runner.state)
            bucket = pr.buckets.buckets[0]
            exe = pr.executables[bucket][0]
            leaves = len(jax.tree.leaves((pr._param_args, pr._pstate.rows, pr._pstate.caches, dev_same)))
            for inp, get in inputs.items():
                def call(pr=pr, bucket=bucket, get=get):
                    return pr.enqueue(bucket, get(nxt())).packed
                yield v, inp, call, leaves, hlo_param_count(exe)
            del pr, exe
        elif kind == "noop":
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
        else:
            raise ValueError(f"unknown variant {v!r}")


TRACED = {("step[cmdbuf]", "np"), ("packed_stable[cmdbuf]", "np"), ("packed_all[cmdbuf]", "np"),  # device time
          ("step[xla]", "np"), ("step[xla]", "dev_same"), ("stable_out[xla]", "dev_same"),  # env_cmdbuf child
          ("packed_stable[xla]", "np")}


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


def probe(n: int, steps: int, rounds: int, which: list[str], trace: bool, rows: list, traces: dict, errors: list,
          save, mark: bool = False) -> None:
    runner_opt = next((o for k, o in map(split_variant, which) if k == "step"), "cmdbuf")
    runner, buf_np = make_runner(n, OPTIONS[runner_opt])
    host = host_costs(runner, buf_np, 20)
    log(f"n={n} host: " + json.dumps({k: round(v, 1) for k, v in host.items()}))
    traces[f"host_costs n={n}"] = host
    gen = variants(runner, runner_opt, buf_np, which)
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
        if mark:  # delimits XLA's log lines per variant (child processes)
            print(f"@@VARIANT {name} in={inp} n={n}", file=sys.stderr, flush=True)
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
    if mark:
        print("@@END", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- child processes

CMDBUF_FLAGS = " ".join(f"--{k}={v}" for k, v in GPU_COMPILER_OPTIONS.items())
CHILD_VARIANTS = "step[xla],packed_stable[xla]"
VLOG_ENV = {"TF_CPP_MIN_LOG_LEVEL": "0", "TF_CPP_MAX_VLOG_LEVEL": "0",
            "TF_CPP_VMODULE": "command_executor=1,command_buffer_cmd=1,command_buffer_thunk=3"}
# name -> (environment added, variants, extra arguments); XLA_FLAGS are appended to the caller's
CHILDREN = {
    "env_cmdbuf": ({"XLA_FLAGS": CMDBUF_FLAGS + " --xla_enable_command_buffers_during_profiling=true"},
                   CHILD_VARIANTS, ["--trace"]),
    "vlog": ({"XLA_FLAGS": CMDBUF_FLAGS, **VLOG_ENV}, CHILD_VARIANTS, ["--steps", "6", "--rounds", "1"]),
    "vmm_skip_temp": ({"XLA_FLAGS": CMDBUF_FLAGS + " --xla_gpu_command_buffer_update_mode=SKIP_TEMP",
                       "XLA_PYTHON_CLIENT_ALLOCATOR": "vmm"}, CHILD_VARIANTS, []),
    "vmm_skip_temp_vlog": ({"XLA_FLAGS": CMDBUF_FLAGS + " --xla_gpu_command_buffer_update_mode=SKIP_TEMP",
                            "XLA_PYTHON_CLIENT_ALLOCATOR": "vmm", **VLOG_ENV}, CHILD_VARIANTS,
                           ["--steps", "6", "--rounds", "1"]),
    "vmm_skip_profiled": ({"XLA_FLAGS": CMDBUF_FLAGS + " --xla_gpu_command_buffer_update_mode=SKIP_PROFILED",
                           "XLA_PYTHON_CLIENT_ALLOCATOR": "vmm"}, CHILD_VARIANTS, []),
    "vmm": ({"XLA_FLAGS": CMDBUF_FLAGS, "XLA_PYTHON_CLIENT_ALLOCATOR": "vmm"}, "step[xla]", []),
    # SKIP_TEMP as a per-executable compile option (what the Runner could pass), with and without VMM
    "vmm_compile_opt": ({"XLA_PYTHON_CLIENT_ALLOCATOR": "vmm"},
                        "step[cmdbuf_skip_temp],packed_stable[cmdbuf_skip_temp],packed_stable[cmdbuf]", []),
    "skip_temp_no_vmm": ({}, "step[cmdbuf_skip_temp],packed_stable[cmdbuf_skip_temp]", []),
    # stream-ordered frees: a step's temporaries may be reused by the next step at once
    "cuda_async": ({"XLA_FLAGS": CMDBUF_FLAGS, "XLA_PYTHON_CLIENT_ALLOCATOR": "cuda_async"}, CHILD_VARIANTS, []),
    "cuda_async_vlog": ({"XLA_FLAGS": CMDBUF_FLAGS, "XLA_PYTHON_CLIENT_ALLOCATOR": "cuda_async", **VLOG_ENV},
                        CHILD_VARIANTS, ["--steps", "6", "--rounds", "1"]),
    "tfrt_client": ({"XLA_FLAGS": CMDBUF_FLAGS, "XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT": "1"}, "step[xla]", []),
}


def parse_vlog(stderr: str) -> dict:
    """Per variant: XLA's command-buffer update log lines (see ``VLOG_ENV``), summarised per call."""
    out = {}
    for seg in re.split(r"^@@VARIANT ", stderr, flags=re.M)[1:]:
        head, _, body = seg.partition("\n")
        body = body.split("@@END")[0]
        upd = [tuple(map(int, m)) for m in
               re.findall(r"Updated (\d+) commands in (\d+) \S+ \(skipped (\d+)", body)]
        allocs = [int(x) for x in re.findall(r"updated_allocs=(\d+)", body)]
        execs = len(re.findall(r"Execute command buffer", body))
        med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
        out[head.strip()] = {
            "executions": execs, "updates": len(upd), "update_calls_with_allocs": len(allocs),
            "commands_median": med([u[0] for u in upd]), "update_us_median": med([u[1] for u in upd]),
            "skipped_median": med([u[2] for u in upd]), "updated_allocs_median": med(allocs),
            "updated_allocs_counts": dict(collections.Counter(allocs)),
        }
    return out


def run_child(name: str, a, json_path: str) -> dict:
    env_add, which, extra = CHILDREN[name]
    env = dict(os.environ, **env_add)
    if "XLA_FLAGS" in env_add:
        env["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + env_add["XLA_FLAGS"]).strip()
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--json", json_path, "--requests", a.child_requests,
           "--steps", str(a.steps), "--rounds", str(a.rounds), "--variants", which, *extra]
    log(f"child {name}: " + " ".join(f"{k}={v!r}" for k, v in env_add.items()))
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.child_timeout)
        rc, stdout, stderr = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        rc, stdout, stderr = "timeout", (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) \
            else (e.stdout or ""), (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) \
            else (e.stderr or "")
    res = {"env": env_add, "variants": which, "rc": rc, "seconds": time.perf_counter() - t0,
           "stderr_head": "\n".join(l for l in stderr.splitlines()[:30] if not l.startswith("@@"))[:2000],
           "stderr_tail": "\n".join(l for l in stderr.splitlines() if not l.startswith("@@"))[-3000:]}
    log(stdout[-3000:])
    if rc != 0:
        log(f"child {name}: rc={rc}\n{res['stderr_head'][:600]}\n...\n{res['stderr_tail'][-1000:]}")
    if "TF_CPP_VMODULE" in env_add:
        res["vlog"] = parse_vlog(stderr)
        log(f"child {name} vlog: {json.dumps(res['vlog'])}")
    try:
        with open(json_path) as f:
            res["result"] = json.load(f)
    except (OSError, ValueError) as e:
        res["result_error"] = f"{type(e).__name__}: {e}"
    return res


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
    ap.add_argument("--variants", default="step[cmdbuf],packed[cmdbuf],packed_stable[cmdbuf],packed_all[cmdbuf],noop",
                    help="also: step[xla], step[nocmdbuf], stable_out[cmdbuf], closed_params[cmdbuf], ...")
    ap.add_argument("--trace", action="store_true", help="profiler traces of selected variants")
    ap.add_argument("--no-children", action="store_true", help="skip the child processes")
    ap.add_argument("--children", default="vlog,vmm_skip_temp,vmm_skip_temp_vlog,vmm_compile_opt,skip_temp_no_vmm,"
                    "cuda_async,cuda_async_vlog,vmm_skip_profiled,tfrt_client",
                    help=f"which child processes, of {','.join(CHILDREN)}")
    ap.add_argument("--child-requests", default="64", help="request counts of the child processes")
    ap.add_argument("--child-timeout", type=int, default=150)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--force-children", action="store_true", help=argparse.SUPPRESS)  # CPU smoke runs
    a = ap.parse_args(argv)
    which = a.variants.split(",")
    for v in which:
        split_variant(v)
    t_start = time.perf_counter()
    res = {"meta": {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": str(getattr(jax.devices()[0], "device_kind", jax.devices()[0])),
        "platform": jax.default_backend(), "jax": jax.__version__,
        "jaxlib": getattr(__import__("jaxlib"), "__version__", "?"), "python": platform.python_version(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""), "gpu_compiler_options": GPU_COMPILER_OPTIONS,
        "env": {k: v for k, v in os.environ.items() if k.startswith(("XLA_", "TF_CPP"))},
        "argv": sys.argv[1:], "method": __doc__.split("\n\n", 2)[2].strip(),
    }, "rows": [], "traces": {}, "errors": [], "children": {}}

    def save():
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1, default=str)

    log("| " + " | ".join(COLS) + " |")
    for n in (int(x) for x in a.requests.split(",")):
        try:
            probe(n, a.steps, a.rounds, which, a.trace, res["rows"], res["traces"], res["errors"], save,
                  mark=a.child)
        except Exception as e:  # noqa: BLE001
            res["errors"].append(f"n={n}: {type(e).__name__}: {e}"[:2000])
            log(f"ERROR n={n}: {type(e).__name__}: {str(e)[:800]}")
        jax.clear_caches()
        save()
    if not a.child and not a.no_children and (jax.default_backend() == "gpu" or a.force_children):
        for name in a.children.split(","):
            child = run_child(name, a, f"{a.json}.{name}.json")
            res["children"][name] = child
            if "vlog" not in name:
                for r in child.get("result", {}).get("rows", []):
                    res["rows"].append(dict(r, variant=f"{name}:{r['variant']}"))
            save()
    res["meta"]["seconds"] = time.perf_counter() - t_start
    save()
    log("\n| " + " | ".join(COLS) + " |\n|" + "---|" * len(COLS))
    for r in res["rows"]:
        log(fmt_row(r))
    for name, c in res["children"].items():
        if "vlog" in c:
            for k, v in c["vlog"].items():
                log(f"{name} {k}: {json.dumps(v)}")
    if res["errors"]:
        log("errors:\n  " + "\n  ".join(res["errors"]))
    log(f"{res['meta']['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
