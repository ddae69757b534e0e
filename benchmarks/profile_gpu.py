"""Where kvjax's GPU time goes: the KV write at decode sizes and the runner's decode step.

Run on the GPU machine from the repository root (XLA_FLAGS apply to the whole process,
so compare flag sets by running it once per set):

    PYTHONPATH=. python3 benchmarks/profile_gpu.py --json OUT.json [--kv] [--step] [--tag NAME]

For each case it reports, from one compiled executable:

* the optimised HLO's shape: fusions, custom calls (the Pallas kernels), while loops (with
  XLA's known trip count, if any); XLA's command buffers are made later, from the thunks,
  and show in the trace instead (kernels named after ``command_buffer_*`` HLO ops);
* a JAX profiler trace of a few executions (CUPTI): device kernels and memcpys per call /
  step, their summed device time, the largest kernels, and for the step the split of
  kernel time between the model (``jax.named_scope("model")`` in ``step_fn``) and the
  runner's state work (everything else: staged writes, zeroing, batch build, combine,
  sampling, post_update);
* wall clock: the KV write as ``bench_kernels.py`` times it (50 calls in one executable);
  the step both synchronised after every step and pipelined (40 steps enqueued back to
  back: the enqueue time shows whether a step blocks the host).

``--chunk-scan sequential`` traces the Mamba prefill's chunk-state recurrence as the former
``lax.scan`` (an XLA while loop) instead of the associative scan.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import re
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pallas_kernels.mamba_scan as mamba_scan_mod  # noqa: E402
import kvjax.models.mamba_layer as mamba_layer_mod  # noqa: E402
from kvjax.host.scheduler import Request  # noqa: E402
from kvjax.runner import Runner, RunnerConfig  # noqa: E402
from pallas_kernels.kv_write import reshape_and_cache_flash  # noqa: E402
from _trace import trace_device  # noqa: E402  (benchmarks/_trace.py)

CALLS = 50
N_SETS = 5
COMPILER_OPTIONS: dict | None = None  # --compiler-options: XLA options for every jit here
BS = 16


def log(*a):
    print(*a, flush=True)


# --------------------------------------------------------------------------
# optimised HLO and profiler traces
# --------------------------------------------------------------------------


def hlo_summary(text: str) -> dict:
    """Counts in the optimised HLO text of one executable."""
    whiles = re.findall(r"^\s*\S+ = [^\n]*? while\([^\n]*", text, re.M)
    trip = [re.search(r'"known_trip_count":\{"n":"(\d+)"\}', w) for w in whiles]
    return {
        "fusions": len(re.findall(r"^\s*\S+ = [^\n]*? fusion\(", text, re.M)),
        "custom_calls": collections.Counter(re.findall(r'custom_call_target="([^"]+)"', text)),
        "whiles": len(whiles),
        "while_known_trip_counts": [int(m.group(1)) if m else None for m in trip],
        "conditionals": len(re.findall(r"^\s*\S+ = [^\n]*? conditional\(", text, re.M)),
    }


def op_names(text: str) -> dict:
    """HLO instruction name (sanitised like XLA's kernel names) -> its op_name metadata."""
    out = {}
    for m in re.finditer(r"%?([\w.\-]+) = [^\n]*?metadata=\{[^}]*op_name=\"([^\"]*)\"", text):
        out[m.group(1)] = m.group(2)
        out[re.sub(r"[.\-]", "_", m.group(1))] = m.group(2)
    return out


# --------------------------------------------------------------------------
# KV write (the rows of bench_kernels.py, bf16 / fp8 caches of 2 GiB)
# --------------------------------------------------------------------------


def profile_kv(T: int, fp8: bool) -> dict:
    H, D = 8, 128
    cdt = jnp.float8_e4m3fn if fp8 else jnp.bfloat16
    nb = 65536 if fp8 else 32768
    rng = np.random.default_rng(T)
    keys = jax.random.split(jax.random.key(T), 2 * N_SETS)
    kc = jnp.zeros((nb, BS, H, D), cdt) + jnp.asarray(1, cdt)
    vc = jnp.zeros((nb, BS, H, D), cdt) + jnp.asarray(2, cdt)
    sets = tuple(
        (jax.random.normal(keys[2 * k], (T, H, D), jnp.bfloat16),
         jax.random.normal(keys[2 * k + 1], (T, H, D), jnp.bfloat16),
         jnp.asarray((rng.choice(nb, size=T, replace=False) * BS + rng.integers(0, BS, size=T))
                     .astype(np.int32)))
        for k in range(N_SETS))
    extra = ("fp8", np.float32(0.37), np.float32(0.61)) if fp8 else ()

    def run(c, sets):
        def body(i, c):
            for k in range(N_SETS):
                c = reshape_and_cache_flash(sets[k][0], sets[k][1], c[0], c[1], sets[k][2], *extra,
                                            backend="pallas_gpu")
            return c
        return jax.lax.fori_loop(0, CALLS // N_SETS, body, c)

    exe = jax.jit(run, donate_argnums=0, compiler_options=COMPILER_OPTIONS).lower((kc, vc), sets).compile()
    text = exe.as_text()
    carry = [(kc, vc)]

    def once():
        carry[0] = exe(carry[0], sets)
        return carry[0]

    for _ in range(3):
        jax.block_until_ready(once())
    samples = []
    for _ in range(15):
        t0 = time.perf_counter()
        for _ in range(10):
            once()
        jax.block_until_ready(carry[0])
        samples.append((time.perf_counter() - t0) / (10 * CALLS))
    tr = trace_device(once, 3)
    kern = tr.pop("_kernels", [])
    for k in ("kernels_per_call", "memcpys_per_call", "device_busy_us_per_call",
              "first_to_last_kernel_us_per_call"):
        if k in tr:
            tr[k] = tr[k] / CALLS  # per op call, not per executable
    tr["top_kernels"] = [dict(t, count_per_call=t["count_per_call"] / CALLS,
                              us_per_call=t["us_per_call"] / CALLS) for t in tr.get("top_kernels", [])]
    durs = [k[1] for k in kern]
    gaps = [b[2] - (a[2] + a[1]) for a, b in zip(kern, kern[1:])]
    return {
        "case": f"reshape_and_cache_flash T={T} {'fp8' if fp8 else 'bf16'}",
        "wall_us_per_call": statistics.median(samples) * 1e6,
        "kernel_us_median": statistics.median(durs) if durs else None,
        "gap_between_kernels_us_median": statistics.median(gaps) if gaps else None,
        "hlo": hlo_summary(text),
        "trace": tr,
        "_hlo_text": text,
    }


# --------------------------------------------------------------------------
# runner decode step
# --------------------------------------------------------------------------


def profile_step(n: int, steps: int = 40) -> dict:
    cfg = RunnerConfig(max_num_seqs=n, max_num_batched_tokens=max(n, 8), num_blocks=4 * n + 8,
                       max_model_len=64, token_sizes=(max(n, 8),))
    runner = Runner(cfg, compiler_options=COMPILER_OPTIONS)
    t0 = time.perf_counter()
    runner.precompile()
    compile_s = time.perf_counter() - t0
    sched = cfg.make_scheduler()
    for i in range(n):
        sched.add_request(Request(f"r{i}", [1 + i % 200], 10_000, 0))
    sync = []
    prepared = plan = None
    rank = runner.local_ranks[0]
    for i in range(steps + 5):
        plan = sched.schedule()
        prepared = runner.prepare(plan)
        t0 = time.perf_counter()
        out = runner.launch(prepared).fetch().outputs[rank]  # the Runner's own call
        sync.append(time.perf_counter() - t0)
        sched.update(plan, out.sampled, out.num_sampled, out.logits)
    exe, _ = runner.executables[plan.bucket]
    text = exe.as_text()
    names = op_names(text)

    def once():  # the last decode step again (its inputs already packed)
        return runner.launch(prepared).packed

    jax.block_until_ready(once())
    enq, total = [], []
    for _ in range(5):
        t0 = time.perf_counter()
        outs = None
        for _ in range(steps):
            outs = once()
        t1 = time.perf_counter()
        jax.block_until_ready(outs)
        t2 = time.perf_counter()
        enq.append((t1 - t0) / steps)
        total.append((t2 - t0) / steps)
    dispatch = dispatch_costs(runner, prepared, steps) if DISPATCH else {}
    tr = trace_device(once, 10)
    kern = tr.pop("_kernels", [])
    split = collections.Counter()
    unmatched = collections.Counter()
    state_ops = collections.Counter()  # runner-state kernel time by the op's scope path
    for name, dur, _, hlo in kern:
        op = names.get(hlo) or names.get(name) or names.get(re.sub(r"[.\-]", "_", name))
        if op is None:
            # kernel names may carry a suffix: try the longest instruction-name prefix
            base = re.sub(r"_\d+$", "", name)
            op = names.get(base)
        if op is None:
            unmatched[name] += 1
            split["unattributed"] += dur
        elif "/model/" in op or op.endswith("/model"):
            split["model"] += dur
        else:
            split["runner_state"] += dur
            state_ops[f"{name} @ {op}"] += dur
    total_k = sum(split.values()) or 1.0
    return {
        "case": f"decode step, {n} requests (bucket {plan.bucket.num_tokens} tokens)",
        "compile_s": compile_s,
        "sync_step_us_median": statistics.median(sync[5:]) * 1e6,
        "pipelined_step_us_median": statistics.median(total) * 1e6,
        "enqueue_us_per_step_median": statistics.median(enq) * 1e6,
        "device_split_us_per_step": {k: v / 10 for k, v in split.items()},
        "dispatch": dispatch,
        "runner_state_share_of_kernel_time": split["runner_state"] / total_k,
        "unattributed_kernel_names": unmatched.most_common(8),
        "runner_state_kernels_us_per_step": [(k, v / 10) for k, v in state_ops.most_common(60)],
        "hlo": hlo_summary(text),
        "trace": tr,
        "_hlo_text": text,
    }


def enqueue_us(call, steps: int) -> float:
    """Median host time to enqueue one call of ``call()`` (``steps`` back to back, 5 rounds)."""
    jax.block_until_ready(call())
    out = []
    for _ in range(5):
        t0 = time.perf_counter()
        r = None
        for _ in range(steps):
            r = call()
        out.append((time.perf_counter() - t0) / steps)
        jax.block_until_ready(r)
    return statistics.median(out) * 1e6


def dispatch_costs(runner, prepared, steps: int) -> dict:
    """Host enqueue time of the step through the Compiled object (as ``Runner.launch`` calls
    it), through ``jax.jit``'s dispatch of the same function (``Runner.jitted_step``), and of
    an executable that takes the same arguments and does almost nothing (the cost of the
    arguments alone). The input buffer is placed on the devices once, outside the timing."""
    fn, _, _ = runner.jitted_step(prepared.bucket)
    buf = runner.put_inputs(prepared)

    def via_compiled():
        return runner._enqueue(prepared.bucket, buf)[0]

    def via_jit():
        runner._rows = runner._stage(runner._rows, buf)
        with jax.default_matmul_precision(runner.config.matmul_precision):
            runner._rows, runner._pools, out = fn(runner.params, runner._rows, runner._pools)
        return out

    touch = jax.jit(lambda p, rows, pools, b: (rows, pools, b[:, :1] + 1), donate_argnums=(1, 2))

    def via_trivial():
        runner._rows, runner._pools, out = touch(runner.params, runner._rows, runner._pools, buf)
        return out

    return {"compiled_call_us": enqueue_us(via_compiled, steps), "jit_call_us": enqueue_us(via_jit, steps),
            "trivial_same_args_us": enqueue_us(via_trivial, steps),
            "argument_leaves": len(jax.tree.leaves((runner.params, runner._rows, runner._pools, buf)))}


DISPATCH = False  # --dispatch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    ap.add_argument("--kv", action="store_true")
    ap.add_argument("--step", action="store_true")
    ap.add_argument("--tag", default="")
    ap.add_argument("--kv-T", default="1,16,256")
    ap.add_argument("--step-n", default="8,64,256")
    ap.add_argument("--chunk-scan", default="associative", choices=("associative", "sequential"))
    ap.add_argument("--dispatch", action="store_true", help="also time the step's host dispatch paths")
    ap.add_argument("--no-adapt-chunk", action="store_true", help="Mamba prefill chunks of chunk_size always")
    ap.add_argument("--hlo-dir", default="", help="write each case's optimised HLO here")
    ap.add_argument("--compiler-options", default="", help='JSON, e.g. {"xla_gpu_graph_min_graph_size": 1}')
    args = ap.parse_args()
    global COMPILER_OPTIONS, DISPATCH
    DISPATCH = args.dispatch
    COMPILER_OPTIONS = json.loads(args.compiler_options) if args.compiler_options else None
    # The model's prefill scan with this run's ScanConfig (a static argument of the op).
    scan_config = mamba_scan_mod.ScanConfig(adapt_chunk=not args.no_adapt_chunk, chunk_states=args.chunk_scan)
    mamba_layer_mod.selective_scan_varlen = functools.partial(mamba_scan_mod.selective_scan_varlen,
                                                              config=scan_config)
    res = {"tag": args.tag, "date": time.strftime("%Y-%m-%d"), "jax": jax.__version__,
           "device": getattr(jax.devices()[0], "device_kind", str(jax.devices()[0])),
           "xla_flags": os.environ.get("XLA_FLAGS", ""), "compiler_options": COMPILER_OPTIONS,
           "chunk_scan": args.chunk_scan,
           "adapt_chunk": not args.no_adapt_chunk,
           "cases": [], "errors": []}

    def save():
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=str)

    def add(r):
        text = r.pop("_hlo_text", "")
        if args.hlo_dir and text:
            os.makedirs(args.hlo_dir, exist_ok=True)
            fn = re.sub(r"[^\w]+", "_", f"{args.tag}_{r['case']}")[:120] + ".hlo.txt"
            with open(os.path.join(args.hlo_dir, fn), "w") as f:
                f.write(text)
        res["cases"].append(r)
        save()
        short = {k: v for k, v in r.items() if k not in ("trace", "hlo")}
        log(json.dumps(short, default=str))
        t = r.get("trace", {})
        log(f"  hlo {json.dumps(r.get('hlo'), default=str)}")
        log(f"  kernels/call {t.get('kernels_per_call')} memcpys/call {t.get('memcpys_per_call')} "
            f"busy us/call {t.get('device_busy_us_per_call')} threads {t.get('device_threads')}")
        for k in t.get("top_kernels", [])[:8]:
            log(f"    {k['us_per_call']:9.3f} us  x{k['count_per_call']:.2f}  {k['name'][:100]}")

    plan = []
    if args.kv:
        plan += [(f"kv T={T}", lambda T=T: profile_kv(T, False)) for T in map(int, args.kv_T.split(","))]
        plan += [("kv fp8 T=16", lambda: profile_kv(16, True))]
    if args.step:
        plan += [(f"step {n}", lambda n=n: profile_step(n)) for n in map(int, args.step_n.split(","))]
    for what, fn in plan:
        try:
            add(fn())
        except Exception as e:  # noqa: BLE001
            res["errors"].append({"what": what, "error": f"{type(e).__name__}: {e}"[:3000]})
            save()
            log(f"ERROR {what}: {type(e).__name__}: {str(e)[:1500]}")
        jax.clear_caches()
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
