"""Kernel benchmark on one GPU: kvjax's Pallas kernels, plain XLA and torch, side by side.

Run on the GPU machine from the repository root (one command, one process):

    PYTHONPATH=. python3 benchmarks/bench_kernels.py --json results.json [--sweep] [--deadline S]

What it measures (GitHub issue 6):

* ceilings: a large device-to-device copy (bytes read + written) and a large
  fill (bytes written), each through jnp and through torch; the larger of each
  pair is the copy / write ceiling that the ``fraction_of_*`` columns divide by;
* ``reshape_and_cache_flash`` (8 KV heads x 128, bf16 and fp8 caches of 2 GiB
  for K + V, T in {16, 64, 256, 4096, 32768}) and ``concat_and_cache_mla``
  (512 + 64, one cache of 2.15 GB);
* ``zero_blocks`` (1, 64, 1024 blocks across 32 layers of K and V);
* ``selective_state_update`` (batch 1, 64, 256; 128 heads x 64 dim x 128
  dstate, fp32 state, one row in eight null);
* ``combine_sampled_and_draft_tokens`` (256 requests x 4 drafts).

Implementations per op: ``pallas`` (kvjax's GPU kernel, ``backend="pallas_gpu"``),
``xla`` (kvjax's jnp reference: plain XLA, written as a JAX user writes it),
``xla_unique`` (the same scatter with ``unique_indices=True``; invalid rows sent
to distinct out-of-range indices so the promise holds) and ``torch`` (the same
op in torch on the same GPU: ``index_copy_`` / ``index_fill_`` / a vectorised
torch SSM update); for the flash write and ``zero_blocks`` also ``mosaic_gpu`` (the Mosaic
GPU kernels, ``backend="mosaic_gpu"``; only where JAX >= 0.11 runs on an H100-class GPU,
with a device-time column like ``pallas``). The first versions of the kernels were measured the same way
(``pallas_v0`` rows in ``results/2026-11-22-h100-call1.json``).

Method: every JAX figure is one compiled executable that calls the op 50 times
in a ``lax.fori_loop`` (the cache carried through the loop and donated),
rotating between several input sets (different tokens, slots, block ids, state
rows) so that the 50 MB L2 does not serve repeated inputs; the time is that of
``M`` executions queued back to back (host dispatch overlaps device work; one
synchronisation at the end), divided by ``50 M``. torch: the same 50 calls
captured in one CUDA graph, replayed ``M`` times between two CUDA events. Each
row is the median of many such samples after warm-up. Effective bandwidth
counts each input byte read once and each output byte written once (for the
writes: the rows written and the rows read, not the cache).

Checks made on the way (reported per row): the donated cache stays in place
(the executable's output buffer is the donated input buffer and its temporary
memory is far below the cache: ``temp_bytes``); every implementation leaves the
same cache behind (bitwise; the writes are idempotent, so running the same 50
calls again from the previous implementation's result must change nothing),
torch included; for the SSM update, each implementation starts from the same
state and the results agree to float32 rounding.

Rows are written to the JSON file after each measurement, so a run cut short
keeps what it measured. ``--sweep`` also times variants of the kvjax kernels
(tile sizes, warps) into the ``sweep`` list. ``--smoke`` runs tiny sizes on any
backend (CPU: interpret mode, torch without graphs) to check the script itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import importlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
import types
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from kvjax.runner.runner import GPU_COMPILER_OPTIONS  # noqa: E402  (--graph: the step's options)
from pallas_kernels import _backend  # noqa: E402
from pallas_kernels import KVWriteConfig, SSUConfig, ZeroBlocksConfig  # noqa: E402
from pallas_kernels.block_zero import zero_blocks  # noqa: E402
from pallas_kernels.kv_write import (  # noqa: E402
    concat_and_cache_mla,
    quantize_fp8,
    reshape_and_cache_flash,
)
from pallas_kernels.mamba import selective_state_update  # noqa: E402
from pallas_kernels.token_combine import combine_sampled_and_draft_tokens  # noqa: E402
from pallas_kernels.kv_pages import write_kv_pages  # noqa: E402
from _trace import jax_device_us, torch_device_us  # noqa: E402  (benchmarks/_trace.py)

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # pragma: no cover - torch is on the GPU machine
    torch = None

# vLLM 0.33.0's own Triton kernels (``vllm_triton`` rows), loaded by --vllm DIR from the
# importable copy that ../shared/tools/vllm_gpu_oracle.sh builds (never committed).
VLLM: types.SimpleNamespace | None = None


def load_vllm(path: str) -> types.SimpleNamespace:
    """The three vLLM Triton ops from the oracle tree at ``path`` (needs torch + triton)."""
    sys.path.insert(0, os.path.abspath(path))
    flash = importlib.import_module("vllm.v1.attention.ops.triton_reshape_and_cache_flash")
    batch = importlib.import_module("vllm.v1.worker.gpu.input_batch")
    ssm = importlib.import_module("vllm.model_executor.layers.mamba.ops.mamba_ssm")
    return types.SimpleNamespace(
        reshape_and_cache_flash=flash.triton_reshape_and_cache_flash,
        combine=batch.combine_sampled_and_draft_tokens,
        ssm=ssm,
    )


CALLS = 50  # op calls per executable / per CUDA graph
#: ``--graph``: the JAX executables unroll their calls (no while loop) and are compiled with
#: XLA command buffers from one command up, so each executes as one CUDA graph, as torch's
#: rows replay one captured graph.
GRAPH = False
SWEEPS: tuple[str, ...] = ()  # --sweeps: only the sweeps whose names start with one of these
SKIP_IMPLS: set = set()  # --skip-impls (a CPU smoke run skips the slow interpreted kernels)
GPU = jax.default_backend() in ("gpu", "cuda", "rocm")
TORCH_GPU = torch is not None and torch.cuda.is_available()


def _mosaic_gpu_ok() -> bool:
    """True where backend="mosaic_gpu" can run (JAX >= 0.11, an H100-class GPU)."""
    try:
        _backend.check_mosaic_gpu()
    except ValueError:
        return False
    return True


MOSAIC = GPU and _mosaic_gpu_ok()  # mosaic_gpu rows (flash write, zero_blocks) only there
START = time.perf_counter()


def log(*a):
    print(f"[{time.perf_counter() - START:7.1f}s]", *a, flush=True)


# --------------------------------------------------------------------------
# results
# --------------------------------------------------------------------------


class Results:
    def __init__(self, path: str | None):
        self.path = path
        self.meta: dict = {}
        self.rows: list[dict] = []
        self.sweep: list[dict] = []
        self.errors: list[dict] = []
        self.ceilings = {"copy": None, "write": None}

    def save(self):
        if not self.path:
            return
        doc = {"meta": self.meta, "ceilings_TBps": self.ceilings, "rows": self.rows,
               "sweep": self.sweep, "errors": self.errors}
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(tmp, self.path)

    def add(self, row: dict, *, sweep: bool = False):
        (self.sweep if sweep else self.rows).append(row)
        self.save()
        frac = row.get("fraction_of_copy_ceiling")
        log(f"ROW {row['op']:34s} {row['size']:24s} {row['dtype']:9s} {row['implementation']:22s} "
            f"{row['median_us']:10.2f} us  {row['effective_TBps']:6.3f} TB/s"
            + (f"  {100 * frac:5.1f}% of copy" if frac is not None else "")
            + (f"  device {row['device_us_per_call']:.2f} us/call ({row['kernels_per_call']:.2f} kernels)"
               if row.get("device_us_per_call") is not None else "")
            + ("" if row.get("matches_reference", True) else "  MISMATCH")
            + ("" if row.get("in_place", True) else "  NOT-IN-PLACE"))

    def error(self, what: str, exc: BaseException):
        msg = f"{type(exc).__name__}: {exc}"
        self.errors.append({"what": what, "error": msg[:2000]})
        self.save()
        log(f"ERROR {what}: {msg[:500]}")
        traceback.print_exc(limit=4)


RES = Results(None)


def make_row(op, size, dtype, impl, samples_s, nbytes, *, ceiling="copy", **extra):
    med = statistics.median(samples_s) * 1e6
    tbps = nbytes / med / 1e6 if med > 0 else float("nan")
    row = dict(op=op, size=size, dtype=dtype, implementation=impl, median_us=med,
               effective_TBps=tbps, bytes=int(nbytes),
               p10_us=float(np.percentile(samples_s, 10) * 1e6),
               p90_us=float(np.percentile(samples_s, 90) * 1e6), samples=len(samples_s))
    copy = RES.ceilings["copy"]
    row["fraction_of_copy_ceiling"] = tbps / copy if copy else None
    if ceiling == "write":
        write = RES.ceilings["write"]
        row["fraction_of_write_ceiling"] = tbps / write if write else None
    row.update(extra)
    return row


# --------------------------------------------------------------------------
# timing: JAX (50 calls in a fori_loop) and torch (50 calls in a CUDA graph)
# --------------------------------------------------------------------------


def lower_loop(op: Callable, carry, sets, *, graph: bool | None = None):
    """Lower ``CALLS`` calls of ``op(carry, inputs, k, i)`` in a fori_loop, carry donated.

    The loop body calls ``op`` once per input set (``len(sets)`` calls, set
    ``k``; ``i`` is the loop index), so the loop runs ``CALLS / len(sets)``
    iterations. One set gives ``CALLS`` iterations of one call (the ceilings:
    XLA would fuse consecutive elementwise calls into one pass). ``graph`` (default: ``--graph``):
    unroll the calls instead; the ceilings never do, since unrolled they fuse into one pass.
    """
    graph = GRAPH if graph is None else graph
    n_sets = len(sets)
    assert CALLS % n_sets == 0, (CALLS, n_sets)

    def run(carry, sets):
        def body(i, c):
            for k in range(n_sets):
                c = op(c, sets[k], k, i)
            return c

        if graph:  # unrolled: one straight-line program, one CUDA graph on a GPU
            for i in range(CALLS // n_sets):
                carry = body(jnp.int32(i), carry)
            return carry
        return jax.lax.fori_loop(0, CALLS // n_sets, body, carry)

    # --graph on a GPU: the Runner's step options (command buffers from one command up)
    options = dict(GPU_COMPILER_OPTIONS) if graph and GPU else None
    return jax.jit(run, donate_argnums=0, compiler_options=options).lower(carry, sets)


def compile_all(lowered: list) -> list:
    """Compile lowered executables in parallel threads (XLA compiles outside the GIL)."""
    with ThreadPoolExecutor(max_workers=min(8, max(1, len(lowered)))) as pool:
        futures = [pool.submit(lw.compile) if lw is not None else None for lw in lowered]
        out = []
        for f in futures:
            try:
                out.append(f.result() if f is not None else None)
            except Exception as e:  # noqa: BLE001
                out.append(e)
        return out


def sample_plan(exec_s: float, budget_s: float) -> tuple[int, int]:
    """(executions per sample M, samples): samples of >= ~3 ms, within the budget."""
    m = int(min(20, max(1, math.ceil(0.003 / max(exec_s, 1e-6)))))
    reps = int(min(40, max(7, budget_s / max(m * exec_s, 1e-6))))
    return m, reps


def time_jax(exe, carry, sets, budget_s):
    """Median-ready samples (seconds per op call) of a compiled loop; returns (samples, carry)."""
    carry = exe(carry, sets)  # warm-up (the caller ran it once already)
    jax.block_until_ready(carry)
    t0 = time.perf_counter()
    carry = exe(carry, sets)
    jax.block_until_ready(carry)
    exec_s = time.perf_counter() - t0
    m, reps = sample_plan(exec_s, budget_s)
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(m):
            carry = exe(carry, sets)
        jax.block_until_ready(carry)
        samples.append((time.perf_counter() - t0) / (m * CALLS))
    return samples, carry


def time_torch(fn_k: Callable[[int], None], n_sets: int, budget_s: float):
    """Samples (seconds per call) of ``CALLS`` calls of ``fn_k(k)``, k cycling over the sets."""
    if not TORCH_GPU:  # smoke mode on a CPU: eager, host clock
        samples = []
        for _ in range(3):
            t0 = time.perf_counter()
            for i in range(CALLS):
                fn_k(i % n_sets)
            samples.append((time.perf_counter() - t0) / CALLS)
        return samples
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the graph (allocator, kernels)
        for k in range(n_sets):
            fn_k(k)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS):
            fn_k(i % n_sets)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    exec_s = start.elapsed_time(end) / 1e3
    m, reps = sample_plan(exec_s, budget_s)
    samples = []
    for _ in range(reps):
        start.record()
        for _ in range(m):
            graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / (m * CALLS))
    del graph
    return samples


def device_time(measure: Callable[[], dict]) -> dict:
    """``{"device_us_per_call", "kernels_per_call"}`` from a profiler, or the error."""
    try:
        return measure()
    except Exception as e:  # noqa: BLE001
        return {"device_time_error": f"{type(e).__name__}: {e}"[:300]}


# --------------------------------------------------------------------------
# helpers: bit views, JAX <-> torch, comparisons
# --------------------------------------------------------------------------

_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def bitview(a):
    return a if jnp.issubdtype(a.dtype, jnp.integer) else jax.lax.bitcast_convert_type(
        a, _UINT[np.dtype(a.dtype).itemsize])


@jax.jit
def _bits_equal(a, b):
    return jnp.all(bitview(a) == bitview(b))


def bits_equal(xs, ys) -> bool:
    return all(bool(_bits_equal(x, y)) for x, y in zip(xs, ys))


@jax.jit
def _rel_err(a, b):
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(b)), 1e-30)


def jax_view_for_torch(a):
    """``a`` as unsigned ints (dlpack lacks float8), computed before torch reads it.

    The bitcast is dispatched asynchronously; the DLPack export does not make
    torch's stream wait for it, so torch could read the buffer before it is
    written (seen: garbage in the comparisons). Hence the wait.
    """
    b = bitview(a)
    b.block_until_ready()
    return b


def to_torch(a, dtype=None):
    """A torch copy of JAX array ``a``.

    The clone is only enqueued on torch's stream; the JAX buffer it reads is
    released when the DLPack view goes, and JAX may reuse that memory at once.
    So wait for the clone before letting go of the view (without the wait,
    the SSM comparison read garbage in two of three runs).
    """
    b = jax_view_for_torch(a)
    view = torch.from_dlpack(b)
    t = view.clone()
    if t.is_cuda:
        torch.cuda.current_stream().synchronize()
    del view, b
    if dtype is not None:
        t = t.view(dtype)
    return t


def torch_bits(t):
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def torch_equal_to_jax(t, a) -> bool:
    ref = torch.from_dlpack(jax_view_for_torch(a))
    return bool(torch.equal(torch_bits(t).reshape(-1), torch_bits(ref).reshape(-1)))


def random_bits(key, shape, dtype):
    """Random bytes in ``dtype`` (any bit pattern: the benchmark only copies them)."""
    u = _UINT[np.dtype(dtype).itemsize]
    bits = jax.random.bits(key, shape, u)
    return bits if u == dtype else jax.lax.bitcast_convert_type(bits, dtype)


def free():
    gc.collect()
    if TORCH_GPU:
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------
# one case: all implementations of one op at one size
# --------------------------------------------------------------------------


@dataclasses.dataclass
class Impl:
    name: str
    op: Callable  # op(carry, inputs, k, i) -> carry


def run_case(meta: dict, impls: list[Impl], carry, sets, *, mains: Callable,
             inplace: Callable | None = None, fresh: Callable | None = None,
             torch_case: dict | None = None, vllm_case: dict | None = None,
             budget_s: float = 0.5, sweep: bool = False,
             tol: float = 0.0, ceiling: str = "copy"):
    """Time every JAX implementation, then torch; one row each.

    ``mains(carry)``: the arrays compared between implementations;
    ``inplace(carry)`` (default ``mains``): the donated arrays that must stay in place.
    ``fresh``: None when the op is idempotent over the 50 calls (writes): one
    carry goes through every implementation and each must leave the cache
    bitwise as the first did. Otherwise a function giving a fresh copy of the
    initial carry: each implementation starts from it and its result after one
    loop is compared with the first's (relative error <= ``tol``).
    """
    op, size, dtype, nbytes = meta["op"], meta["size"], meta["dtype"], meta["bytes"]
    impls = [im for im in impls if im.name not in SKIP_IMPLS]
    inplace = inplace or mains
    shapes = jax.eval_shape(fresh) if fresh is not None else jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), carry)
    lowered = []
    for im in impls:
        try:
            lowered.append(lower_loop(im.op, shapes, sets))
        except Exception as e:  # noqa: BLE001
            RES.error(f"lower {op} {size} {dtype} {im.name}", e)
            lowered.append(None)
    t0 = time.perf_counter()
    compiled = compile_all(lowered)
    log(f"compiled {len(impls)} executables for {op} {size} {dtype} in {time.perf_counter() - t0:.1f}s")
    ref = None
    ref_name = None
    for im, exe in zip(impls, compiled):
        if exe is None or isinstance(exe, Exception):
            if isinstance(exe, Exception):
                RES.error(f"compile {op} {size} {dtype} {im.name}", exe)
            continue
        try:
            if fresh is not None:
                carry = fresh()
            ptrs = [a.unsafe_buffer_pointer() for a in inplace(carry)]
            main_bytes = sum(a.size * a.dtype.itemsize for a in inplace(carry))
            carry = exe(carry, sets)
            jax.block_until_ready(carry)
            same = [a.unsafe_buffer_pointer() for a in inplace(carry)] == ptrs
            mem = exe.memory_analysis()
            temp = int(mem.temp_size_in_bytes) if mem is not None else -1
            # No whole-buffer copy: the same buffers, and temporaries far below them
            # (for buffers of a few KiB, below 64 KiB).
            in_place = same and 0 <= temp < max(main_bytes // 8, 1 << 16)
            if ref is None:
                ref = [jnp.copy(a) for a in mains(carry)]
                ref_name, match, err = im.name, True, 0.0
            elif fresh is None:
                match, err = bits_equal(mains(carry), ref), 0.0
            else:
                err = max(float(_rel_err(a, b)) for a, b in zip(mains(carry), ref))
                match = err <= tol
            samples, carry = time_jax(exe, carry, sets, budget_s)
            dev = {}
            if GPU and im.name in ("pallas", "mosaic_gpu") and not sweep:  # device kernel time
                box = [carry]

                def once():
                    box[0] = exe(box[0], sets)
                    return box[0]

                dev = device_time(lambda: jax_device_us(once, 2, CALLS))
                carry = box[0]
            RES.add(make_row(op, size, dtype, im.name, samples, nbytes, ceiling=ceiling,
                             in_place=in_place, temp_bytes=temp, same_buffers=same,
                             matches_reference=match, compared_with=ref_name,
                             rel_err=err, **dev, **meta.get("extra", {})), sweep=sweep)
        except Exception as e:  # noqa: BLE001
            RES.error(f"run {op} {size} {dtype} {im.name}", e)
    for impl_name, case in (("torch", torch_case), ("vllm_triton", vllm_case if VLLM else None)):
        if case is None or torch is None or not (TORCH_GPU or (impl_name == "torch" and not GPU)):
            continue
        if impl_name in SKIP_IMPLS:
            continue
        try:
            tc = case["setup"](ref)
            samples = time_torch(tc["fn"], tc["n_sets"], budget_s)
            dev = {}
            if TORCH_GPU and impl_name == "vllm_triton":
                dev = device_time(lambda: torch_device_us(lambda i: tc["fn"](i % tc["n_sets"]), CALLS))
            match, err = tc["check"]() if ref is not None else (None, None)
            RES.add(make_row(op, size, dtype, impl_name, samples, nbytes, ceiling=ceiling,
                             matches_reference=match, compared_with=ref_name, rel_err=err,
                             note=tc.get("note", ""), **dev, **meta.get("extra", {})))
            del tc
        except Exception as e:  # noqa: BLE001
            RES.error(f"{impl_name} {op} {size} {dtype}", e)
    del ref
    return carry


# --------------------------------------------------------------------------
# ceilings
# --------------------------------------------------------------------------


def bench_ceilings(sz: dict):
    n = sz["ceiling_elems"]
    x = jax.random.normal(jax.random.key(0), (n,), jnp.float32)
    nbytes = n * 4
    rows = {}
    for name, op, moved, kind in (
        ("jnp copy (x + 1, in place)", lambda c, s, k, i: c + 1.0, 2 * nbytes, "copy"),
        ("jnp fill (full(i))", lambda c, s, k, i: jnp.full(c.shape, i.astype(c.dtype) + k, c.dtype),
         nbytes, "write"),
    ):
        exe = lower_loop(op, x, ((),), graph=False).compile()
        samples, x = time_jax(exe, x, ((),), 0.6)
        row = make_row("ceiling", f"{nbytes / 2**30:.0f} GiB", "float32", name, samples, moved)
        rows[name] = (row, kind)
    # Out of place: a -> b, then b -> a (a barrier keeps XLA from fusing the two).
    def ping_pong(c, s, k, i):
        a, b = c
        if k == 0:
            b = a + 1.0
        else:
            a = b + 1.0
        return jax.lax.optimization_barrier((a, b))

    pair = (x, jnp.zeros_like(x))
    exe = lower_loop(ping_pong, pair, ((), ()), graph=False).compile()
    samples, pair = time_jax(exe, pair, ((), ()), 0.6)
    rows["jnp copy (b = a + 1, out of place)"] = (
        make_row("ceiling", f"{nbytes / 2**30:.0f} GiB", "float32", "jnp copy (b = a + 1, out of place)",
                 samples, 2 * nbytes), "copy")
    x = pair[0]
    del pair
    if TORCH_GPU or torch is not None:
        dev = "cuda" if TORCH_GPU else "cpu"
        a = torch.randn(n, device=dev)
        b = torch.empty_like(a)

        def copy_k(k):
            (b.copy_(a) if k == 0 else a.copy_(b))

        rows["torch copy_ (device to device)"] = (
            make_row("ceiling", f"{nbytes / 2**30:.0f} GiB", "float32", "torch copy_",
                     time_torch(copy_k, 2, 0.6), 2 * nbytes), "copy")
        rows["torch zero_"] = (
            make_row("ceiling", f"{nbytes / 2**30:.0f} GiB", "float32", "torch zero_",
                     time_torch(lambda k: a.zero_(), 1, 0.6), nbytes), "write")
        del a, b
    for kind in ("copy", "write"):
        RES.ceilings[kind] = max(r["effective_TBps"] for r, k in rows.values() if k == kind)
    for row, kind in rows.values():
        row["fraction_of_copy_ceiling"] = row["effective_TBps"] / RES.ceilings["copy"]
        if kind == "write":
            row["fraction_of_write_ceiling"] = row["effective_TBps"] / RES.ceilings["write"]
        row["ceiling_kind"] = kind
        RES.add(row)
    log(f"ceilings: copy {RES.ceilings['copy']:.3f} TB/s, write {RES.ceilings['write']:.3f} TB/s")
    del x
    free()


# --------------------------------------------------------------------------
# KV writes
# --------------------------------------------------------------------------

N_SETS = 5
BS = 16  # block size (tokens per block)


def slot_sets(rng, n_sets, T, num_blocks):
    """Slot mappings: prefill-like (whole blocks) for T >= 1024, else one token per block."""
    out = []
    for _ in range(n_sets):
        if T >= 1024:
            blocks = rng.choice(num_blocks, size=T // BS, replace=False)
            s = (blocks[:, None] * BS + np.arange(BS)[None, :]).reshape(-1)
        else:
            blocks = rng.choice(num_blocks, size=T, replace=False)
            s = blocks * BS + rng.integers(0, BS, size=T)
        out.append(s.astype(np.int32))
    return out


def xla_unique_rows(slots, num_slots):
    """Row per token; invalid ones to distinct rows past the end (so the rows are unique)."""
    n = slots.shape[0]
    live = (slots >= 0) & (slots < num_slots)
    return jnp.where(live, slots, num_slots + jnp.arange(n, dtype=jnp.int32))


def flash_unique(key, value, kc, vc, slots, fp8, ks, vs):
    nb, bs, H, D = kc.shape
    ns = nb * bs
    rows = xla_unique_rows(slots, ns)
    n = slots.shape[0]

    def put(cache, x, s):
        new = quantize_fp8(x[:n], s) if fp8 else x[:n]
        flat = cache.reshape(ns, H, D).at[rows].set(new.astype(cache.dtype), mode="drop",
                                                   unique_indices=True)
        return flat.reshape(cache.shape)

    return put(kc, key, ks), put(vc, value, vs)


def mla_unique(kv_c, k_pe, cache, slots, fp8, scale):
    nb, bs, W = cache.shape
    ns = nb * bs
    n = slots.shape[0]
    new = jnp.concatenate([kv_c[:n], k_pe[:n]], axis=-1)
    if fp8:
        new = quantize_fp8(new, scale)
    flat = cache.reshape(ns, W).at[xla_unique_rows(slots, ns)].set(
        new.astype(cache.dtype), mode="drop", unique_indices=True)
    return flat.reshape(cache.shape)


def bench_flash(T: int, fp8: bool, sz: dict, *, sweep_variants=None, budget=0.5):
    H, D = 8, 128
    cdt = jnp.float8_e4m3fn if fp8 else jnp.bfloat16
    nb = sz["flash_blocks_fp8" if fp8 else "flash_blocks"]
    rng = np.random.default_rng(T + 7 * fp8)
    keys = jax.random.split(jax.random.key(T), 2 * N_SETS + 2)
    kc = random_bits(keys[-1], (nb, BS, H, D), cdt)
    vc = random_bits(keys[-2], (nb, BS, H, D), cdt)
    slots = slot_sets(rng, N_SETS, T, nb)
    sets = tuple(
        (jax.random.normal(keys[2 * k], (T, H, D), jnp.bfloat16),
         jax.random.normal(keys[2 * k + 1], (T, H, D), jnp.bfloat16),
         jnp.asarray(slots[k]))
        for k in range(N_SETS))
    ks, vs = np.float32(0.37), np.float32(0.61)
    extra = ("fp8", ks, vs) if fp8 else ()
    out_item = 1 if fp8 else 2
    nbytes = 2 * T * H * D * (2 + out_item) + 4 * T
    meta = dict(op="reshape_and_cache_flash", size=f"T={T}", dtype="fp8" if fp8 else "bf16",
                bytes=nbytes, extra=dict(cache_bytes=2 * nb * BS * H * D * out_item, heads=H,
                                         head_size=D, input_dtype="bfloat16"))

    def pallas_with(cfg):
        def op(c, s, k, i):
            return reshape_and_cache_flash(s[0], s[1], c[0], c[1], s[2], *extra,
                                           backend="pallas_gpu", config=cfg)
        return op

    pallas = pallas_with(KVWriteConfig())

    def xla(c, s, k, i):
        return reshape_and_cache_flash(s[0], s[1], c[0], c[1], s[2], *extra, backend="reference")

    def xla_u(c, s, k, i):
        return flash_unique(s[0], s[1], c[0], c[1], s[2], fp8, ks, vs)

    if sweep_variants is not None:
        impls = [Impl(name, pallas_with(cfg)) for name, cfg in sweep_variants]
        run_case(meta, impls, (kc, vc), sets, mains=lambda c: c, sweep=True, budget_s=budget)
        return
    impls = [Impl("pallas", pallas), Impl("xla", xla), Impl("xla_unique", xla_u)]
    if MOSAIC:
        impls.append(Impl("mosaic_gpu", lambda c, s, k, i: reshape_and_cache_flash(
            s[0], s[1], c[0], c[1], s[2], *extra, backend="mosaic_gpu")))

    def torch_setup(ref):
        dev = "cuda" if TORCH_GPU else "cpu"
        tdt = torch.uint8 if fp8 else torch.bfloat16
        kc_t = to_torch(ref[0], tdt).view(nb * BS, H, D)
        vc_t = to_torch(ref[1], tdt).view(nb * BS, H, D)
        kk = [to_torch(s[0], torch.bfloat16) for s in sets]
        vv = [to_torch(s[1], torch.bfloat16) for s in sets]
        ss = [torch.from_numpy(x).to(dev).long() for x in slots]
        ks_t = torch.tensor([ks], device=dev)
        vs_t = torch.tensor([vs], device=dev)

        def q(x, s):  # saturate(x / s) -> float8 bytes, division by a device tensor (IEEE)
            return (x.float() / s).clamp_(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)

        def fn(k):
            if fp8:
                kc_t.index_copy_(0, ss[k], q(kk[k], ks_t))
                vc_t.index_copy_(0, ss[k], q(vv[k], vs_t))
            else:
                kc_t.index_copy_(0, ss[k], kk[k])
                vc_t.index_copy_(0, ss[k], vv[k])

        def check():
            return torch_equal_to_jax(kc_t, ref[0]) and torch_equal_to_jax(vc_t, ref[1]), 0.0

        return dict(fn=fn, n_sets=N_SETS, check=check,
                    note="index_copy_ of K and V" + (" after (x.float() / scale).clamp().to(fp8)" if fp8 else ""))

    def vllm_setup(ref):
        tdt = torch.uint8 if fp8 else torch.bfloat16
        kc_t = to_torch(ref[0], tdt)  # [nb, BS, H, D]; vLLM views a uint8 cache as fp8 itself
        vc_t = to_torch(ref[1], tdt)
        kk = [to_torch(s[0], torch.bfloat16) for s in sets]
        vv = [to_torch(s[1], torch.bfloat16) for s in sets]
        ss = [torch.from_numpy(x).to("cuda").long() for x in slots]  # vLLM's slot dtype
        ks_t = torch.tensor([ks], device="cuda")
        vs_t = torch.tensor([vs], device="cuda")
        mode = "fp8" if fp8 else "auto"

        def fn(k):
            VLLM.reshape_and_cache_flash(kk[k], vv[k], kc_t, vc_t, ss[k], mode, ks_t, vs_t)

        def check():
            # vLLM divides by the scale with Triton's "/" (div.full.f32, not IEEE), so an fp8
            # byte may differ from kvjax's correctly rounded one: count them.
            diff = sum(int((torch_bits(t).reshape(-1) != torch.from_dlpack(
                jax_view_for_torch(a)).reshape(-1).view(torch_bits(t).dtype)).sum())
                for t, a in ((kc_t, ref[0]), (vc_t, ref[1])))
            return diff == 0, float(diff)

        return dict(fn=fn, n_sets=N_SETS, check=check,
                    note="vLLM 0.33.0 triton_reshape_and_cache_flash; rel_err column = bytes that differ")

    run_case(meta, impls, (kc, vc), sets, mains=lambda c: c, torch_case=dict(setup=torch_setup),
             vllm_case=dict(setup=vllm_setup), budget_s=budget)
    del kc, vc, sets
    free()


def bench_pages(T: int, fp8: bool, sz: dict, *, budget=0.5):
    """``write_kv_pages`` (ragged-paged-attention layout, K/V interleaved in one cache per
    layer) with the bytes of the flash rows: the same tokens, slots and cache size."""
    H, D = 8, 128
    cdt = jnp.float8_e4m3fn if fp8 else jnp.bfloat16
    # one cache of K and V: the GPU kernel's int32 element offsets allow at most 2**31 - 1
    # elements (the fp8 cache is 1 block, 64 KiB, short of the flash rows' 2 GiB)
    nb = min(sz["flash_blocks_fp8" if fp8 else "flash_blocks"], (2**31 - 1) // (BS * 2 * H * D))
    rng = np.random.default_rng(T + 7 * fp8)
    keys = jax.random.split(jax.random.key(T), 2 * N_SETS + 2)
    pages = random_bits(keys[-1], (nb, BS, 2 * H, D), cdt)
    slots = slot_sets(rng, N_SETS, T, nb)
    sets = tuple(
        (jax.random.normal(keys[2 * k], (T, H, D), jnp.bfloat16),
         jax.random.normal(keys[2 * k + 1], (T, H, D), jnp.bfloat16),
         jnp.asarray(slots[k]))
        for k in range(N_SETS))
    extra = ("fp8", np.float32(0.37), np.float32(0.61)) if fp8 else ()
    out_item = 1 if fp8 else 2
    nbytes = 2 * T * H * D * (2 + out_item) + 4 * T
    meta = dict(op="write_kv_pages", size=f"T={T}", dtype="fp8" if fp8 else "bf16",
                bytes=nbytes, extra=dict(cache_bytes=nb * BS * 2 * H * D * out_item, heads=H,
                                         head_size=D, input_dtype="bfloat16"))

    def call(backend):
        def op(c, s, k, i):
            return write_kv_pages(s[0], s[1], c, s[2], *extra, backend=backend)
        return op

    run_case(meta, [Impl("pallas", call("pallas_gpu")), Impl("xla", call("reference"))], pages, sets,
             mains=lambda c: (c,), budget_s=budget)
    del pages, sets
    free()


def bench_mla(T: int, fp8: bool, sz: dict, *, sweep_variants=None, budget=0.5):
    L, R = 512, 64
    cdt = jnp.float8_e4m3fn if fp8 else jnp.bfloat16
    nb = sz["mla_blocks_fp8" if fp8 else "mla_blocks"]
    rng = np.random.default_rng(1000 + T + 7 * fp8)
    keys = jax.random.split(jax.random.key(1000 + T), 2 * N_SETS + 1)
    cache = random_bits(keys[-1], (nb, BS, L + R), cdt)
    slots = slot_sets(rng, N_SETS, T, nb)
    sets = tuple(
        (jax.random.normal(keys[2 * k], (T, L), jnp.bfloat16),
         jax.random.normal(keys[2 * k + 1], (T, R), jnp.bfloat16),
         jnp.asarray(slots[k]))
        for k in range(N_SETS))
    scale = np.float32(0.37)
    extra = ("fp8", scale) if fp8 else ()
    out_item = 1 if fp8 else 2
    nbytes = T * (L + R) * (2 + out_item) + 4 * T
    meta = dict(op="concat_and_cache_mla", size=f"T={T}", dtype="fp8" if fp8 else "bf16",
                bytes=nbytes, extra=dict(cache_bytes=nb * BS * (L + R) * out_item,
                                         kv_lora_rank=L, pe_dim=R, input_dtype="bfloat16"))

    def pallas_with(cfg):
        def op(c, s, k, i):
            return concat_and_cache_mla(s[0], s[1], c, s[2], *extra, backend="pallas_gpu",
                                        config=cfg)
        return op

    pallas = pallas_with(KVWriteConfig())

    def xla(c, s, k, i):
        return concat_and_cache_mla(s[0], s[1], c, s[2], *extra, backend="reference")

    def xla_u(c, s, k, i):
        return mla_unique(s[0], s[1], c, s[2], fp8, scale)

    if sweep_variants is not None:
        run_case(meta, [Impl(name, pallas_with(cfg)) for name, cfg in sweep_variants], cache, sets,
                 mains=lambda c: (c,), sweep=True, budget_s=budget)
        return
    impls = [Impl("pallas", pallas), Impl("xla", xla), Impl("xla_unique", xla_u)]

    def torch_setup(ref):
        dev = "cuda" if TORCH_GPU else "cpu"
        c_t = to_torch(ref[0], torch.uint8 if fp8 else torch.bfloat16).view(nb * BS, L + R)
        cc = [to_torch(s[0], torch.bfloat16) for s in sets]
        pp = [to_torch(s[1], torch.bfloat16) for s in sets]
        ss = [torch.from_numpy(x).to(dev).long() for x in slots]
        s_t = torch.tensor([scale], device=dev)

        def fn(k):
            rows = torch.cat([cc[k], pp[k]], dim=-1)
            if fp8:
                rows = (rows.float() / s_t).clamp_(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
            c_t.index_copy_(0, ss[k], rows)

        return dict(fn=fn, n_sets=N_SETS, check=lambda: (torch_equal_to_jax(c_t, ref[0]), 0.0),
                    note="torch.cat + index_copy_" + (" after (x.float() / scale).clamp().to(fp8)" if fp8 else ""))

    run_case(meta, impls, cache, sets, mains=lambda c: (c,), torch_case=dict(setup=torch_setup),
             budget_s=budget)
    del cache, sets
    free()


# --------------------------------------------------------------------------
# zero_blocks
# --------------------------------------------------------------------------


def bench_zero(n_ids: int, sz: dict, *, sweep_variants=None, budget=0.5):
    layers, nb = sz["zero_layers"], sz["zero_blocks"]
    shape = (nb, BS, 8, 128)
    keys = jax.random.split(jax.random.key(2000 + n_ids), 2 * layers)
    arrays = tuple(random_bits(keys[a], shape, jnp.bfloat16) for a in range(2 * layers))
    rng = np.random.default_rng(2000 + n_ids)
    ids = [rng.choice(np.arange(1, nb), size=n_ids, replace=False).astype(np.int32)
           for _ in range(N_SETS)]
    sets = tuple((jnp.asarray(x),) for x in ids)
    block_bytes = BS * 8 * 128 * 2
    nbytes = n_ids * block_bytes * 2 * layers + 4 * n_ids
    meta = dict(op="zero_blocks", size=f"{n_ids} blocks x {2 * layers} arrays", dtype="bf16",
                bytes=nbytes, extra=dict(arrays=2 * layers, block_bytes=block_bytes,
                                         cache_bytes=2 * layers * nb * block_bytes))

    def pallas_with(cfg):
        def op(c, s, k, i):
            return zero_blocks(c, s[0], backend="pallas_gpu", config=cfg)
        return op

    pallas = pallas_with(ZeroBlocksConfig())

    def xla(c, s, k, i):
        return zero_blocks(c, s[0], backend="reference")

    def xla_u(c, s, k, i):
        rows = xla_unique_rows(s[0], nb)
        return tuple(a.at[rows].set(jnp.zeros((), a.dtype), mode="drop", unique_indices=True)
                     for a in c)

    if sweep_variants is not None:
        run_case(meta, [Impl(name, pallas_with(cfg)) for name, cfg in sweep_variants], arrays, sets,
                 mains=lambda c: c, sweep=True, budget_s=budget, ceiling="write")
        return
    impls = [Impl("pallas", pallas), Impl("xla", xla), Impl("xla_unique", xla_u)]
    if MOSAIC:
        impls.append(Impl("mosaic_gpu", lambda c, s, k, i: zero_blocks(
            c, s[0], backend="mosaic_gpu")))

    def torch_setup(ref):
        dev = "cuda" if TORCH_GPU else "cpu"
        arrs = [to_torch(a, torch.bfloat16).view(nb, -1) for a in ref]
        ii = [torch.from_numpy(x).to(dev).long() for x in ids]

        def fn(k):
            for a in arrs:
                a.index_fill_(0, ii[k], 0)

        def check():
            return all(torch_equal_to_jax(t, a) for t, a in zip(arrs, ref)), 0.0

        return dict(fn=fn, n_sets=N_SETS, check=check,
                    note=f"index_fill_ on each of the {2 * layers} arrays")

    run_case(meta, impls, arrays, sets, mains=lambda c: c, torch_case=dict(setup=torch_setup),
             budget_s=budget, ceiling="write")
    del arrays, sets
    free()


# --------------------------------------------------------------------------
# selective_state_update (Mamba2 decode step)
# --------------------------------------------------------------------------


def ssu_xla_unique(state, x, dt, A, B, C, D, dt_bias, z, idx, null=0):
    """Mamba2 decode step in plain XLA, state scatter with unique_indices=True."""
    L, H, P, N = state.shape
    G = B.shape[1]
    f32 = jnp.float32
    valid = (idx != null) & (idx >= 0) & (idx < L)
    h = jnp.take(state, jnp.where(valid, idx, L), axis=0, mode="fill", fill_value=0)
    h = jnp.where(valid[:, None, None, None], h, 0.0)
    d = jax.nn.softplus(dt.astype(f32) + dt_bias.astype(f32))  # [b, H, 1]
    d = jnp.where(dt.astype(f32) + dt_bias.astype(f32) <= 20.0, d, dt.astype(f32) + dt_bias)
    Bh = jnp.repeat(B.astype(f32), H // G, axis=1)  # [b, H, N]
    Ch = jnp.repeat(C.astype(f32), H // G, axis=1)
    dA = jnp.exp(A.astype(f32)[None] * d[..., None])  # [b, H, 1, 1]
    h = h * dA + (d[..., None] * Bh[:, :, None, :]) * x.astype(f32)[..., None]
    y = jnp.sum(h * Ch[:, :, None, :], axis=-1) + x.astype(f32) * D.astype(f32)
    zf = z.astype(f32)
    y = y * (zf * jax.nn.sigmoid(zf))
    rows = jnp.where(valid, idx, L + jnp.arange(idx.shape[0], dtype=jnp.int32))
    state = state.at[rows].set(h.astype(state.dtype), mode="drop", unique_indices=True)
    return y.astype(x.dtype), state


def bench_ssu(batch: int, sz: dict, *, sweep_variants=None, budget=0.5):
    H, P, N, G = 128, 64, 128, 8
    L = sz["ssu_rows"]
    n_sets = min(25, CALLS) if batch == 1 else N_SETS
    f32, bf = jnp.float32, jnp.bfloat16
    keys = iter(jax.random.split(jax.random.key(3000 + batch), 8 * n_sets + 8))
    init_state = jax.random.normal(next(keys), (L, H, P, N), f32)
    A = -jnp.exp(jax.random.normal(next(keys), (H, 1, 1), f32) * 0.5)
    D = jax.random.normal(next(keys), (H, 1), f32)
    dt_bias = jax.random.normal(next(keys), (H, 1), f32) * 0.5
    rng = np.random.default_rng(3000 + batch)
    n_null = batch // 8
    idx_sets = []
    for _ in range(n_sets):
        rows = rng.choice(np.arange(1, L), size=batch, replace=False).astype(np.int32)
        rows[rng.choice(batch, size=n_null, replace=False)] = 0  # null rows
        idx_sets.append(rows)
    sets = tuple(
        (jax.random.normal(next(keys), (batch, H, P), bf),
         (jax.random.normal(next(keys), (batch, H, 1), f32) * 0.5).astype(bf),
         jax.random.normal(next(keys), (batch, G, N), bf),
         jax.random.normal(next(keys), (batch, G, N), bf),
         jax.random.normal(next(keys), (batch, H, P), bf),
         jnp.asarray(idx_sets[k]))
        for k in range(n_sets))
    live = batch - n_null
    row_bytes = H * P * N * 4
    nbytes = (2 * live * row_bytes + 3 * batch * H * P * 2 + batch * H * 2
              + 2 * batch * G * N * 2 + 4 * batch + 3 * H * 4)
    meta = dict(op="selective_state_update", size=f"batch={batch}", dtype="fp32 state",
                bytes=nbytes, extra=dict(heads=H, dim=P, dstate=N, groups=G, null_rows=n_null,
                                         state_rows=L, input_dtype="bfloat16"))

    def call(backend, cfg=SSUConfig()):
        def op(c, s, k, i):
            st, outs = c
            y, st = selective_state_update(st, s[0], s[1], A, s[2], s[3], D, dt_bias, s[4], True,
                                           s[5], backend=backend, config=cfg)
            return st, outs[:k] + (y,) + outs[k + 1:]
        return op

    def xla_u(c, s, k, i):
        st, outs = c
        y, st = ssu_xla_unique(st, s[0], s[1], A, s[2], s[3], D, dt_bias, s[4], s[5])
        return st, outs[:k] + (y,) + outs[k + 1:]

    def fresh():
        return (jnp.copy(init_state), tuple(jnp.zeros((batch, H, P), bf) for _ in range(n_sets)))

    if sweep_variants is not None:
        run_case(meta, [Impl(name, call("pallas_gpu", cfg)) for name, cfg in sweep_variants],
                 None, sets, mains=lambda c: (c[0],), fresh=fresh, sweep=True, budget_s=budget,
                 tol=2e-4)
        return
    impls = [Impl("pallas", call("pallas_gpu")), Impl("xla", call("reference")),
             Impl("xla_unique", xla_u)]

    def torch_setup(ref):
        dev = "cuda" if TORCH_GPU else "cpu"
        # rows L (zeros, read by null rows) and L + 1 (written by null rows) added
        st = torch.cat([to_torch(init_state, torch.float32),
                        torch.zeros((2, H, P, N), device=dev)])
        tA = to_torch(A, torch.float32).view(1, H, 1, 1)
        tD = to_torch(D, torch.float32).view(1, H, 1)
        tb = to_torch(dt_bias, torch.float32).view(1, H, 1)
        ts = [[to_torch(a, torch.bfloat16) for a in s[:5]] for s in sets]
        rd = [torch.from_numpy(np.where(x != 0, x, L)).to(dev).long() for x in idx_sets]
        wr = [torch.from_numpy(np.where(x != 0, x, L + 1)).to(dev).long() for x in idx_sets]
        ys = [None] * n_sets

        def fn(k):
            x, dt, Bm, Cm, z = ts[k]
            d = F.softplus(dt.float() + tb)  # [b, H, 1]
            h = st.index_select(0, rd[k])  # [b, H, P, N]
            h.mul_(torch.exp(tA * d.unsqueeze(-1)))
            Bh = Bm.float().repeat_interleave(H // G, dim=1)  # [b, H, N]
            Ch = Cm.float().repeat_interleave(H // G, dim=1)
            h.addcmul_((d.unsqueeze(-1) * Bh.unsqueeze(2)), x.float().unsqueeze(-1))
            y = torch.matmul(h, Ch.unsqueeze(-1)).squeeze(-1) + x.float() * tD
            ys[k] = (y * F.silu(z.float())).to(torch.bfloat16)
            st.index_copy_(0, wr[k], h)

        # The comparison needs one loop of torch from the initial state: check()
        # runs after timing, so the state has moved on; compare a fresh run instead.
        def check():
            st[:L].copy_(to_torch(init_state, torch.float32))
            st[L:].zero_()
            for i in range(CALLS):
                fn(i % n_sets)
            ref_t = torch.from_dlpack(jax_view_for_torch(ref[0])).view(torch.float32)
            err = float((st[:L] - ref_t).abs().max() / ref_t.abs().max())
            return err <= 2e-4, err

        return dict(fn=fn, n_sets=n_sets, check=check,
                    note="index_select, in-place mul_/addcmul_, matmul, index_copy_ (zero row for null reads, spare row for null writes)")

    def vllm_setup(ref):
        st = to_torch(init_state, torch.float32)  # [L, H, P, N]; row 0 is the null row
        # kvjax's per-head scalars as vLLM's tied-head-dim views (stride 0: TIE_HDIM).
        tA = to_torch(A, torch.float32).view(H, 1, 1).expand(H, P, N)
        tD = to_torch(D, torch.float32).view(H, 1).expand(H, P)
        tb = to_torch(dt_bias, torch.float32).view(H, 1).expand(H, P)
        ts = [[to_torch(a, torch.bfloat16) for a in s[:5]] for s in sets]
        ts = [[x, dt.expand(batch, H, P), Bm, Cm, z] for x, dt, Bm, Cm, z in ts]
        ii = [torch.from_numpy(x).to("cuda") for x in idx_sets]  # int32, 0 = null
        outs = [torch.empty((batch, H, P), dtype=torch.bfloat16, device="cuda") for _ in range(n_sets)]
        cfg = VLLM.ssm._get_default_ssm_launch_config(N, False)  # vLLM's H100 default

        def fn(k):
            x, dt, Bm, Cm, z = ts[k]
            with VLLM.ssm.override_ssm_config(cfg):
                VLLM.ssm.selective_state_update(st, x, dt, tA, Bm, Cm, tD, tb, z=z, dt_softplus=True,
                                                state_batch_indices=ii[k], null_block_id=0,
                                                out=outs[k])

        def check():
            st.copy_(to_torch(init_state, torch.float32))
            for i in range(CALLS):
                fn(i % n_sets)
            ref_t = torch.from_dlpack(jax_view_for_torch(ref[0])).view(torch.float32)
            err = float((st - ref_t).abs().max() / ref_t.abs().max())
            return err <= 2e-4, err

        return dict(fn=fn, n_sets=n_sets, check=check,
                    note=f"vLLM 0.33.0 selective_state_update, launch config {cfg} (BLOCK_SIZE_M, warps)")

    run_case(meta, impls, None, sets, mains=lambda c: (c[0],), fresh=fresh,
             torch_case=dict(setup=torch_setup), vllm_case=dict(setup=vllm_setup), budget_s=budget,
             tol=2e-4)
    del init_state, sets
    free()


# --------------------------------------------------------------------------
# combine_sampled_and_draft_tokens
# --------------------------------------------------------------------------


def bench_combine(sz: dict, budget=0.5):
    R, S, MR = 256, 4, 512
    T = R * (S + 1)
    num_logits = T
    rng = np.random.default_rng(4000)
    sets_np = []
    for _ in range(N_SETS):
        idx = rng.choice(MR, size=R, replace=False).astype(np.int32)
        prefill = rng.integers(1, 100, size=MR).astype(np.int32)
        seq = prefill[idx] + rng.integers(S + 1, 200, size=R).astype(np.int32)
        qsl = np.arange(R + 1, dtype=np.int32) * (S + 1)
        cu = np.arange(R + 1, dtype=np.int32) * (S + 1)
        last = rng.integers(0, 32000, size=MR).astype(np.int32)
        drafts = rng.integers(0, 32000, size=(MR, S)).astype(np.int32)
        sets_np.append((idx, last, qsl, seq, prefill, drafts, cu))
    sets = tuple(tuple(jnp.asarray(a) for a in s) for s in sets_np)
    ids0 = jnp.asarray(rng.integers(0, 32000, size=T).astype(np.int32))
    nbytes = 4 * (R + 2 * (R + 1) + 3 * R + R * S) + 4 * (R * (S + 1)) + 4 * num_logits
    meta = dict(op="combine_sampled_and_draft_tokens", size=f"{R} requests x {S} drafts",
                dtype="int32", bytes=nbytes, extra=dict(num_tokens=T, num_logits=num_logits))

    def call(backend):
        def op(c, s, k, i):
            ids, lis = c
            ids, li = combine_sampled_and_draft_tokens(ids, *s, num_logits, backend=backend)
            return ids, lis[:k] + (li,) + lis[k + 1:]
        return op

    carry = (ids0, tuple(jnp.zeros((num_logits,), jnp.int32) for _ in range(N_SETS)))

    def torch_setup(ref):
        dev = "cuda" if TORCH_GPU else "cpu"
        ids_t = torch.cat([to_torch(ref[0]), torch.zeros(1, dtype=torch.int32, device=dev)])
        ts = [[torch.from_numpy(a).to(dev) for a in s] for s in sets_np]
        lis = [torch.zeros(num_logits + 1, dtype=torch.int32, device=dev) for _ in range(N_SETS)]
        lanes = torch.arange(S + 1, device=dev, dtype=torch.int32)
        dl = torch.arange(S, device=dev, dtype=torch.int32)

        def fn(k):
            idx, last, qsl, seq, prefill, drafts, cu = ts[k]
            live = idx >= 0
            s = idx.clamp(min=0).long()
            nl = cu[1:R + 1] - cu[:R]
            qe = qsl[1:R + 1]
            start = qe - nl
            pre = prefill[s]
            decode = live & (seq[:R] > pre)
            write_last = decode & (seq[:R] - nl >= pre)
            li = lis[k]
            li.zero_()
            dest = torch.where(live[:, None] & (lanes < nl[:, None]), cu[:R, None] + lanes, num_logits)
            li.scatter_(0, dest.reshape(-1).long(), (start[:, None] + lanes).reshape(-1))
            ids_t.scatter_(0, torch.where(write_last, start, T).long(), last[s])
            nd = (nl - 1)[:, None]
            dd = torch.where(decode[:, None] & (dl < nd), qe[:, None] - nd + dl, T)
            ids_t.scatter_(0, dd.reshape(-1).long(), drafts[s].reshape(-1))

        def check():
            ok = torch_equal_to_jax(ids_t[:T], ref[0])
            ok &= all(torch_equal_to_jax(lis[k][:num_logits], ref[1 + k]) for k in range(N_SETS))
            return ok, 0.0

        return dict(fn=fn, n_sets=N_SETS, check=check, note="vectorised torch ops (scatter_)")

    def vllm_setup(ref):
        ids_t = to_torch(ref[0])  # int32 [T]
        ts = [[torch.from_numpy(a).to("cuda") for a in s] for s in sets_np]
        lis = [None] * N_SETS

        def fn(k):
            idx, last, qsl, seq, prefill, drafts, cu = ts[k]
            lis[k] = VLLM.combine(ids_t, idx, last, qsl, seq, prefill, drafts, cu, num_logits)

        def check():
            ok = torch_equal_to_jax(ids_t, ref[0])
            ok &= all(torch_equal_to_jax(lis[k].to(torch.int32), ref[1 + k]) for k in range(N_SETS))
            return ok, 0.0

        return dict(fn=fn, n_sets=N_SETS, check=check,
                    note="vLLM 0.33.0 combine_sampled_and_draft_tokens (int64 logits_indices, allocated per call)")

    impls = [Impl("pallas", call("pallas_gpu")), Impl("xla", call("reference"))]
    run_case(meta, impls, carry, sets, mains=lambda c: (c[0],) + c[1],
             inplace=lambda c: (c[0],), torch_case=dict(setup=torch_setup),
             vllm_case=dict(setup=vllm_setup), budget_s=budget)
    free()


# --------------------------------------------------------------------------
# sweeps: variants of the kvjax kernels (tile sizes, warps)
# --------------------------------------------------------------------------


def run_sweeps(sz, deadline, want=lambda name: True):
    """The variants of each sweep whose first word ``want`` accepts (``--only``)."""
    kw, ev = KVWriteConfig, "evict_first"
    plan = [
        ("flash bf16 T=32768", lambda v: bench_flash(32768, False, sz, sweep_variants=v),
         [("pallas", kw()), ("pallas[evict_first]", kw(gpu_eviction=ev)),
          ("pallas[bt=4,evict_first]", kw(gpu_tokens_per_program=4, gpu_eviction=ev))]
         + [(f"pallas[bt={b}]", kw(gpu_tokens_per_program=b)) for b in (1, 2, 4, 16)]),
        ("flash fp8 T=32768", lambda v: bench_flash(32768, True, sz, sweep_variants=v),
         [(f"pallas[bt={b}]", kw(gpu_tokens_per_program=b)) for b in (1, 2, 4, 8)]
         + [("pallas[bt=1,warps=8]", kw(gpu_tokens_per_program=1, gpu_num_warps=8)),
            ("pallas[bt=1,warps=2]", kw(gpu_tokens_per_program=1, gpu_num_warps=2)),
            ("pallas[bt=1,evict_first]", kw(gpu_tokens_per_program=1, gpu_eviction=ev))]),
        ("flash bf16 T=4096", lambda v: bench_flash(4096, False, sz, sweep_variants=v),
         [("pallas", kw()), ("pallas[evict_first]", kw(gpu_eviction=ev))]
         + [(f"pallas[bt={b}]", kw(gpu_tokens_per_program=b)) for b in (1, 2, 4, 16)]),
        ("flash fp8 T=4096", lambda v: bench_flash(4096, True, sz, sweep_variants=v),
         [(f"pallas[bt={b}]", kw(gpu_tokens_per_program=b)) for b in (1, 2, 4)]),
        ("mla fp8 T=32768", lambda v: bench_mla(32768, True, sz, sweep_variants=v),
         [(f"pallas[bt={b}]", kw(gpu_tokens_per_program=b)) for b in (1, 2, 4)]),
        ("mla bf16 T=32768", lambda v: bench_mla(32768, False, sz, sweep_variants=v),
         [("pallas", kw()), ("pallas[evict_first]", kw(gpu_eviction=ev))]),
        ("ssu 256", lambda v: bench_ssu(256, sz, sweep_variants=v),
         [("pallas", SSUConfig()), ("pallas[evict_first]", SSUConfig(gpu_eviction=ev)),
          ("pallas[bm=64]", SSUConfig(gpu_block_m=64))]),
        # decode batches: smaller tiles give more programs (and loads in flight) per call
        *((f"ssu {n}", lambda v, n=n: bench_ssu(n, sz, sweep_variants=v),
           [("pallas", SSUConfig())]
           + [(f"pallas[bm={m}]", SSUConfig(gpu_block_m=m)) for m in (4, 8, 16)]
           + [(f"pallas[bm={m},warps={w}]", SSUConfig(gpu_block_m=m, gpu_num_warps=w))
              for m, w in ((8, 2), (16, 2), (32, 8))])
          for n in sz["ssu_batch"][:-1]),
        # fp8 at decode sizes: fewer divisions per thread (wider programs, narrower tiles)
        *((f"flash fp8 T={t}", lambda v, t=t: bench_flash(t, True, sz, sweep_variants=v),
           [("pallas", kw())] + [(f"pallas[tile={c},warps={w}]", kw(gpu_max_tile=c, gpu_num_warps=w))
                                 for c, w in ((1024, 8), (512, 4), (512, 8), (256, 2), (256, 4), (128, 4))])
          for t in (1, 16, 256)),
        ("flash bf16 T=16", lambda v: bench_flash(16, False, sz, sweep_variants=v),
         [(f"pallas[bt={b}]", kw(gpu_tokens_per_program=b)) for b in (1, 2, 4)]),
        ("zero 1", lambda v: bench_zero(1, sz, sweep_variants=v),
         [(f"pallas[tile={t}B]", ZeroBlocksConfig(gpu_tile_bytes=t)) for t in (512, 2048, 4096)]),
    ]
    for name, fn, variants in plan:
        if not want(name.split()[0]) or (SWEEPS and not any(name.startswith(p) for p in SWEEPS)):
            continue
        if time.perf_counter() - START > deadline - 25:
            log(f"deadline: sweep {name} and later skipped")
            RES.errors.append({"what": f"sweep {name}", "error": "skipped (deadline)"})
            RES.save()
            continue
        try:
            fn(variants)
        except Exception as e:  # noqa: BLE001
            RES.error(f"sweep {name}", e)


# --------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------


def sizes(smoke: bool) -> dict:
    if smoke:
        return dict(ceiling_elems=1 << 20, flash_blocks=256, flash_blocks_fp8=256, mla_blocks=256,
                    mla_blocks_fp8=256, zero_layers=2, zero_blocks=64, ssu_rows=40,
                    flash_T=(16, 64), ssu_batch=(1, 8), zero_n=(1, 8))
    return dict(
        ceiling_elems=1 << 28,  # 1 GiB of float32
        flash_blocks=32768,  # [32768, 16, 8, 128] bf16: 1 GiB each for K and V
        flash_blocks_fp8=65536,  # 1 GiB each in fp8
        mla_blocks=116509,  # [116509, 16, 576] bf16: 2.147 GB
        # fp8: the largest cache the GPU kernel's int32 element offsets allow
        # (2**31 - 1 elements): 233016 blocks = 2.147 GB, 8 KiB short of 2 GiB.
        mla_blocks_fp8=233016,
        zero_layers=32, zero_blocks=2048,  # 64 arrays of [2048, 16, 8, 128] bf16 (64 MiB each)
        ssu_rows=512,  # [512, 128, 64, 128] fp32: 2 GiB
        flash_T=(1, 16, 64, 256, 1024, 4096, 32768), ssu_batch=(1, 64, 256), zero_n=(1, 64, 1024))


def metadata() -> dict:
    dev = jax.devices()[0]
    meta = {
        "date": datetime.date.today().isoformat(),
        "device": getattr(dev, "device_kind", str(dev)),
        "platform": jax.default_backend(),
        "jax": jax.__version__,
        "jaxlib": getattr(jax.lib, "__version__", None) or __import__("jaxlib").__version__,
        "python": platform.python_version(),
        "torch": getattr(torch, "__version__", None),
        "torch_cuda": getattr(getattr(torch, "version", None), "cuda", None),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "calls_per_executable": CALLS,
        "method": (f"JAX: one executable = {CALLS} op calls "
                   + (f"unrolled (no loop), compiled with command buffers {GPU_COMPILER_OPTIONS} "
                      "so that it runs as one CUDA graph" if GRAPH else "in lax.fori_loop")
                   + f" (cache donated and carried, input sets rotated), M executions queued back to "
                   f"back, host wall clock between two synchronisations / ({CALLS} M); torch: {CALLS} "
                   "calls in one CUDA graph, M replays between CUDA events. Median of the samples "
                   "after warm-up."),
    }
    try:
        import triton
        meta["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        pass
    if TORCH_GPU:
        p = torch.cuda.get_device_properties(0)
        meta["sm_count"] = p.multi_processor_count
        meta["l2_bytes"] = getattr(p, "L2_cache_size", None)
        meta["gpu_memory_bytes"] = p.total_memory
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        meta["nvidia_smi"] = q.stdout.strip()
    except Exception:  # noqa: BLE001
        pass
    return meta


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None, help="where to write the results")
    ap.add_argument("--sweep", action="store_true", help="also time kernel variants")
    ap.add_argument("--no-main", action="store_true", help="skip the main rows (sweeps only)")
    ap.add_argument("--only", default="", help="comma list: ceiling,flash,pages,mla,zero,ssu,combine")
    ap.add_argument("--deadline", type=float, default=1e9, help="seconds; later parts are skipped")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, any backend (script check)")
    ap.add_argument("--budget", type=float, default=0.4, help="seconds of timed samples per row")
    ap.add_argument("--calls", type=int, default=50, help="op calls per executable (and per CUDA graph of the torch and vLLM rows)")
    ap.add_argument("--skip-impls", default="", help="comma list of implementations not to run")
    ap.add_argument("--vllm", default="", help="vLLM oracle dir (vllm_gpu_oracle.sh): vllm_triton rows")
    ap.add_argument("--flash-T", default="", help="comma list of T for the flash rows (default: all)")
    ap.add_argument("--graph", action="store_true",
                    help="unroll the JAX executables' calls, one CUDA graph each (see GRAPH)")
    ap.add_argument("--sweeps", default="", help="comma list of sweep name prefixes, e.g. 'flash fp8 T=16'")
    args = ap.parse_args()
    global CALLS, SKIP_IMPLS, VLLM, GRAPH, SWEEPS
    GRAPH = args.graph
    SWEEPS = tuple(filter(None, args.sweeps.split(",")))
    if args.vllm and TORCH_GPU:
        try:
            VLLM = load_vllm(args.vllm)
        except Exception as e:  # noqa: BLE001
            RES.error("load vLLM oracle", e)
    CALLS = args.calls
    SKIP_IMPLS = set(filter(None, args.skip_impls.split(",")))
    if not GPU and not args.smoke:
        print("no GPU: run with --smoke for a CPU check of the script", flush=True)
        return 2
    RES.path = args.json
    RES.meta = metadata()
    RES.meta["argv"] = sys.argv[1:]
    RES.meta["mosaic_gpu_rows"] = MOSAIC
    if VLLM is not None:
        RES.meta["vllm"] = "0.33.0 (Triton kernels from the wheel, benchmarks: vllm_triton rows)"
    RES.save()
    log("meta", json.dumps(RES.meta))
    sz = sizes(args.smoke)
    if args.flash_T:
        sz["flash_T"] = tuple(int(t) for t in args.flash_T.split(","))
    only = set(filter(None, args.only.split(",")))
    b = args.budget

    def want(name):
        return not only or name in only

    plan = [("ceiling", lambda: bench_ceilings(sz))]
    if not args.no_main:
        plan += [(("flash", T, False), lambda T=T: bench_flash(T, False, sz, budget=b)) for T in sz["flash_T"]]
        plan += [(("zero", sz["zero_n"][-1]), lambda: bench_zero(sz["zero_n"][-1], sz, budget=b)),
                 (("ssu", sz["ssu_batch"][-1]), lambda: bench_ssu(sz["ssu_batch"][-1], sz, budget=b)),
                 (("combine",), lambda: bench_combine(sz, budget=b))]
        plan += [(("flash", T, True), lambda T=T: bench_flash(T, True, sz, budget=b)) for T in sz["flash_T"]]
        plan += [(("pages", T, fp8), lambda T=T, fp8=fp8: bench_pages(T, fp8, sz, budget=b))
                 for fp8 in (False, True) for T in sz["flash_T"]]
        plan += [(("mla", T, fp8), lambda T=T, fp8=fp8: bench_mla(T, fp8, sz, budget=b))
                 for fp8 in (False, True) for T in sz["flash_T"]]
        plan += [(("zero", n), lambda n=n: bench_zero(n, sz, budget=b)) for n in sz["zero_n"][:-1]]
        plan += [(("ssu", n), lambda n=n: bench_ssu(n, sz, budget=b)) for n in sz["ssu_batch"][:-1]]
    for key, fn in plan:
        name = key if isinstance(key, str) else key[0]
        if not want(name) and not (name == "ceiling"):
            continue
        if time.perf_counter() - START > args.deadline - 15:
            log(f"deadline: {key} skipped")
            RES.errors.append({"what": str(key), "error": "skipped (deadline)"})
            RES.save()
            continue
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            RES.error(str(key), e)
    if args.sweep:
        run_sweeps(sz, args.deadline, want)
    RES.meta["seconds"] = time.perf_counter() - START
    RES.save()
    print_table()
    return 0


def print_table():
    print("\nop | size | dtype | impl | median us | TB/s | % copy | in place | same result")
    for r in RES.rows:
        frac = r.get("fraction_of_copy_ceiling")
        print(f"{r['op']} | {r['size']} | {r['dtype']} | {r['implementation']} | {r['median_us']:.2f} | "
              f"{r['effective_TBps']:.3f} | {'' if frac is None else f'{100 * frac:.1f}'} | "
              f"{r.get('in_place', '')} | {r.get('matches_reference', '')}")
    for r in RES.sweep:
        print(f"SWEEP {r['op']} | {r['size']} | {r['dtype']} | {r['implementation']} | "
              f"{r['median_us']:.2f} | {r['effective_TBps']:.3f}")
    for e in RES.errors:
        print("ERROR", e["what"], e["error"][:300])


if __name__ == "__main__":
    sys.exit(main())
