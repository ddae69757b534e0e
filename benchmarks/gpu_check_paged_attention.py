"""GPU check and benchmark of ``paged_attention`` (the compiled Pallas Triton kernel).

Run on a machine with an NVIDIA GPU, from the repository root:

    PYTHONPATH=. python benchmarks/gpu_check_paged_attention.py [--out DIR] [--budget-s S]

**Check.** Ragged batches (decode rows, chunked-prefill rows, speculative windows,
empty rows, pad tokens), bf16 / float32 / fp8 caches, GQA 16/4 and 8/8, head size
128, block size 16. The null block, every free block and every row's unwritten tail
hold NaN. The kernel (``backend="pallas_gpu"``, compiled) and the jnp reference (on
the GPU) are each compared with a float64 numpy oracle (one token at a time):
relative error ``|out - oracle| / |oracle|`` below the dtype's bound, no NaN, pad
tokens and tokens that see nothing exactly 0. Whether kernel and reference agree
bitwise is reported too (they sum in different orders, so it is not required).

**Benchmark.** Decode (one token per row, every row at the same context) at batch
1 / 16 / 64 / 256, context 256 / 1k / 4k, ``max_model_len`` 2k / 8k / 32k (block
tables of 128 / 512 / 2048 columns), bf16, Hq 16 / Hkv 4, head size 128; plus
two chunked-prefill steps. Each timing compiles one executable that calls the op
``CALLS`` times on distinct query arrays and block tables (the tables point at
disjoint blocks where the pool allows, so the reads are not L2 hits), and takes
the median wall time of ``REPEATS`` runs divided by ``CALLS``. Reported with the
byte floor (live K/V bytes + q + out over 3.0 TB/s, the measured H100 copy rate
of BENCHMARKS.md). The reference gathers the whole table, so it is timed only
where its temporaries fit. A short sweep of kernel configs follows.

Writes ``paged_attention.json`` under ``--out`` (default ``$OUT`` or ``.``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.paged_attention import PagedAttentionConfig, paged_attention
from _gpu_check import CASES, RESULTS, case, on_gpu_or_allowed, run_cases, summary  # noqa: E402
from _trace import jax_device_us  # noqa: E402

GPU = "pallas_gpu"
INTERPRET = False  # --smoke: the kernel body in interpret mode, tiny sizes (checks the script)
FP8 = jnp.float8_e4m3fn
BS = 16
COPY_BW = 3.0e12  # bytes/s
CALLS, REPEATS = 8, 5
# ||out - oracle|| / ||oracle|| bounds by (q dtype, cache dtype).
TOL = {"float32": 2e-5, "bfloat16": 1e-2, "fp8": 1e-2}


# --------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------


def make_step(rng, rows, *, Hq, Hkv, D, W, qdt, cdt, num_blocks=None, pad_tokens=3,
              extra_rows=2):
    """A ragged step. ``rows``: list of (context, query_len); query_len 0 = an idle row
    with a table. Returns (args dict, meta). Free blocks, the null block and each row's
    unwritten tail are NaN."""
    need = sum(-(-c // BS) for c, _ in rows)
    N = num_blocks or need + 8
    perm = rng.permutation(np.arange(1, N))
    R = len(rows) + extra_rows
    table = np.zeros((R, W), np.int32)
    seq = np.zeros((R,), np.int32)
    used = 0
    token_row, positions = [], []
    for b, (ctx, ql) in enumerate(rows):
        nb = -(-ctx // BS)
        table[b, :nb] = perm[used:used + nb]
        used += nb
        seq[b] = ctx
        token_row += [b] * ql
        positions += list(range(ctx - ql, ctx))
    token_row += [R] * pad_tokens
    positions += [0] * pad_tokens
    T = len(token_row)
    q = rng.standard_normal((T, Hq, D)).astype(np.float32)
    k = rng.standard_normal((N, BS, Hkv, D)).astype(np.float32)
    v = rng.standard_normal((N, BS, Hkv, D)).astype(np.float32)
    live = np.zeros((N, BS), bool)
    for b in range(R):
        for j in range(seq[b]):
            live[table[b, j // BS], j % BS] = True
    k[~live] = np.nan
    v[~live] = np.nan
    scales = {}
    if cdt == "fp8":
        scales = dict(k_scale=np.float32(0.05), v_scale=np.float32(0.04))
        kc = jnp.asarray(np.where(live[..., None, None], k / 0.05, np.nan)).astype(FP8)
        vc = jnp.asarray(np.where(live[..., None, None], v / 0.04, np.nan)).astype(FP8)
    else:
        kc, vc = jnp.asarray(k, cdt), jnp.asarray(v, cdt)
    args = dict(q=jnp.asarray(q, qdt), key_cache=kc, value_cache=vc,
                block_table=jnp.asarray(table), seq_lens=jnp.asarray(seq),
                positions=jnp.asarray(np.array(positions, np.int32)),
                token_row=jnp.asarray(np.array(token_row, np.int32)))
    return args, scales


def oracle(args, scales, with_lse=False):
    """float64 numpy, one token at a time, from the stored values. ``with_lse``: also each
    head's log-sum-exp of its scaled visible scores ``[T, Hq]`` (-inf: none)."""
    q = np.asarray(args["q"].astype(jnp.float32), np.float64)
    k = np.asarray(args["key_cache"].astype(jnp.float32), np.float64)
    v = np.asarray(args["value_cache"].astype(jnp.float32), np.float64)
    if scales:
        k, v = k * float(scales["k_scale"]), v * float(scales["v_scale"])
    table, seq = np.asarray(args["block_table"]), np.asarray(args["seq_lens"])
    pos, rows = np.asarray(args["positions"]), np.asarray(args["token_row"])
    T, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    out = np.zeros((T, Hq, v.shape[-1]))
    lse = np.full((T, Hq), -np.inf)
    for t in range(T):
        b = rows[t]
        if b >= table.shape[0]:
            continue
        n = min(seq[b], pos[t] + 1)
        if n <= 0:
            continue
        j = np.arange(n)
        kk, vv = k[table[b, j // BS], j % BS], v[table[b, j // BS], j % BS]  # [n, Hkv, D]
        for h in range(Hq):
            s = kk[:, h // G] @ q[t, h] / np.sqrt(D)
            p = np.exp(s - s.max())
            out[t, h] = p @ vv[:, h // G] / p.sum()
            lse[t, h] = s.max() + np.log(p.sum())
    return (out, lse) if with_lse else out


def rel_err(got, want):
    got = np.asarray(jnp.asarray(got).astype(jnp.float32), np.float64)
    if np.isnan(got).any():
        return float("nan")
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def call(args, scales, backend, config=PagedAttentionConfig()):
    fn = jax.jit(lambda a: paged_attention(**a, **scales, backend=backend,
                                           interpret=INTERPRET and backend == GPU,
                                           config=config))
    return fn(args)


# --------------------------------------------------------------------------
# Check
# --------------------------------------------------------------------------

CHECKS = []


def add_check(name, rows, *, qdt, cdt, Hq=16, Hkv=4, W=128, config=PagedAttentionConfig()):
    @case(name)
    def run():
        rng = np.random.default_rng(len(CHECKS))
        args, scales = make_step(rng, rows, Hq=Hq, Hkv=Hkv, D=128, W=W, qdt=qdt, cdt=cdt)
        want = oracle(args, scales)
        got = call(args, scales, GPU, config)
        ref = call(args, scales, "reference")
        tol = TOL["fp8" if cdt == "fp8" else qdt]
        e_k, e_r = rel_err(got, want), rel_err(ref, want)
        g = np.asarray(got.astype(jnp.float32))
        dead = np.asarray(args["token_row"]) >= args["block_table"].shape[0]
        bitwise = bool(np.array_equal(np.asarray(got).view(np.uint8),
                                      np.asarray(ref).view(np.uint8)))
        CHECKS.append(dict(name=name, kernel_rel_err=e_k, reference_rel_err=e_r, tol=tol,
                           bitwise_equal_to_reference=bitwise))
        msgs = []
        if not e_k <= tol:
            msgs.append(f"kernel rel err {e_k:.3g} > {tol}")
        if (g[dead] != 0).any():
            msgs.append("pad token output not 0")
        if (g[np.all(want == 0, axis=(1, 2))] != 0).any():
            msgs.append("a token that sees nothing is not 0")
        print(f"    {name}: kernel {e_k:.3g}, reference {e_r:.3g}, bitwise {bitwise}")
        return "; ".join(msgs)


def add_oracle_check(name, rows, *, qdt="bfloat16", cdt="bfloat16", Hq=16, Hkv=4, W=128, mla=False,
                  lse=True):
    """The kernel's output against the oracle and, with ``lse`` (``return_lse=True``, a float32
    output), each head's log-sum-exp against the float64 one (absolute error; -inf exactly where
    the token sees nothing). ``mla``: MLA's absorbed decode as the model calls it, ``Hq`` heads
    over one latent kv head of 512 + 64 features, the values its first 512
    (``value_cache=None``), no pad token: at batch 1 a 2,048-column table (32k) takes the split
    rule's most splits (128), most of them past a short context's keys."""
    @case(name)
    def run():
        rng = np.random.default_rng((200 if mla else 100) + len(CHECKS))
        if mla:
            args, scales = make_step(rng, rows, Hq=Hq, Hkv=1, D=576, W=W, qdt=qdt, cdt=cdt,
                                     pad_tokens=0, extra_rows=0)
            want_args = dict(args, value_cache=args["key_cache"][..., :512])
            latent = dict(value_cache=None, v_head_dim=512)
        else:
            args, scales = make_step(rng, rows, Hq=Hq, Hkv=Hkv, D=128, W=W, qdt=qdt, cdt=cdt)
            want_args, latent = args, {}
        fn = jax.jit(lambda a: paged_attention(**dict(a, **latent), **scales, return_lse=lse,
                                               backend=GPU, interpret=INTERPRET))
        out, got_lse = fn(args) if lse else (fn(args), None)
        want, want_lse = oracle(want_args, scales, with_lse=True)
        tol = TOL["fp8" if cdt == "fp8" else qdt]
        e_k = rel_err(out, want)
        msgs = [] if e_k <= tol else [f"kernel rel err {e_k:.3g} > {tol}"]
        e_lse = None
        if lse:
            got_lse = np.asarray(got_lse, np.float64)
            seen = np.isfinite(want_lse)
            e_lse = float(np.abs(got_lse[seen] - want_lse[seen]).max()) if seen.any() else 0.0
            if out.dtype != jnp.float32:
                msgs.append(f"output dtype {out.dtype}, not float32")
            if not e_lse <= 20 * tol:
                msgs.append(f"lse abs err {e_lse:.3g} > {20 * tol}")
            if not np.array_equal(np.isneginf(got_lse), ~seen):
                msgs.append("lse is not -inf exactly where the token sees nothing")
        CHECKS.append(dict(name=name, kernel_rel_err=e_k, lse_abs_err=e_lse, tol=tol))
        print(f"    {name}: kernel {e_k:.3g}" + (f", lse {e_lse:.3g}" if lse else ""))
        return "; ".join(msgs)


MIXED = [(1000, 1), (37, 1), (0, 0), (200, 64), (513, 200), (16, 16), (5, 4), (999, 3),
         (50, 0)]
for qdt, cdt in (("bfloat16", "bfloat16"), ("float32", "float32"), ("bfloat16", "fp8")):
    add_check(f"mixed-{qdt}-{cdt}", MIXED, qdt=qdt, cdt=cdt)
add_check("decode-b1-splits", [(1500, 1)], qdt="bfloat16", cdt="bfloat16", W=512)
add_check("decode-b16-splits", [(100 + 90 * i, 1) for i in range(16)], qdt="bfloat16",
          cdt="bfloat16")
add_check("decode-b64-no-splits", [(1 + 31 * i, 1) for i in range(64)], qdt="bfloat16",
          cdt="bfloat16")
add_check("mha-8-8-prefill", [(300, 300), (64, 33)], qdt="bfloat16", cdt="bfloat16",
          Hq=8, Hkv=8)
add_check("gqa-16-1-decode", [(700, 1), (33, 2)], qdt="bfloat16", cdt="bfloat16", Hq=16,
          Hkv=1)
# a group of 3 heads, padded to 4 lanes through the kernel and the split combine
add_check("gqa-12-4-decode-b1-splits", [(1200, 1)], qdt="bfloat16", cdt="bfloat16", Hq=12, Hkv=4, W=512)
# a 384-key table: the split rule's count rounded down to a power of two (the combine's blocks)
add_check("decode-b1-short-table-splits", [(300, 1)], qdt="bfloat16", cdt="bfloat16", W=24)
add_oracle_check("lse-mixed-bf16", MIXED, qdt="bfloat16", cdt="bfloat16")
add_oracle_check("lse-mixed-f32", MIXED, qdt="float32", cdt="float32")
add_oracle_check("lse-decode-b1-splits", [(1500, 1)], qdt="bfloat16", cdt="bfloat16", W=512)
add_oracle_check("lse-mixed-fp8", MIXED, qdt="bfloat16", cdt="fp8")
add_oracle_check("lse-mixed-f32-q-fp8", MIXED, qdt="float32", cdt="fp8")
add_oracle_check("lse-decode-b8-fp8-splits", [(11 + i, 1) for i in range(8)], qdt="float32", cdt="fp8", Hq=16, Hkv=1)
add_oracle_check("lse-gqa-12-4-decode-b1-splits", [(1200, 1)], qdt="float32", cdt="float32", Hq=12, Hkv=4, W=512)
add_oracle_check("mla-decode-b1-1k-128-splits", [(1000, 1)], W=2048, mla=True, lse=False)
add_oracle_check("mla-decode-b1-16k-128-splits", [(16000, 1)], W=2048, mla=True, lse=False)
add_oracle_check("lse-mla-decode-b1-1k-128-splits", [(1000, 1)], W=2048, mla=True)


# --------------------------------------------------------------------------
# Benchmark
# --------------------------------------------------------------------------

ROWS = []


def decode_sets(rng, batch, ctx, W, n_sets, Hq=16, Hkv=4, D=128, dt=jnp.bfloat16):
    """``n_sets`` (q, table) pairs over one pool; blocks disjoint across sets where the
    pool (at most ~1.5 GiB per cache) allows."""
    per = batch * (-(-ctx // BS))
    bytes_per_block = BS * Hkv * D * 2
    N = int(min(per * n_sets, max(per, (3 << 29) // bytes_per_block))) + 1
    kc = jax.random.normal(jax.random.key(1), (N, BS, Hkv, D), dt)
    vc = jax.random.normal(jax.random.key(2), (N, BS, Hkv, D), dt)
    sets = []
    for s in range(n_sets):
        ids = (np.arange(per) + s * per) % (N - 1) + 1
        table = np.zeros((batch, W), np.int32)
        table[:, : -(-ctx // BS)] = ids.reshape(batch, -1)
        q = jax.random.normal(jax.random.key(10 + s), (batch, Hq, D), dt)
        sets.append((q, jnp.asarray(table)))
    seq = jnp.full((batch,), ctx, jnp.int32)
    pos = jnp.full((batch,), ctx - 1, jnp.int32)
    rows = jnp.arange(batch, dtype=jnp.int32)
    return kc, vc, sets, seq, pos, rows


def time_exe(exe, args, calls):
    """(wall us per call, device dict): wall = median of REPEATS samples of 3 executions
    queued back to back; device = kernel time per call from a profiler trace (CUPTI)."""
    jax.block_until_ready(exe(*args))
    ts = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        outs = [exe(*args) for _ in range(3)]
        jax.block_until_ready(outs)
        ts.append((time.perf_counter() - t0) / 3)
    dev = jax_device_us(lambda: exe(*args), 3, calls)
    return float(np.median(ts)) / calls * 1e6, dev


def time_calls(backend, kc, vc, sets, seq, pos, rows, config=PagedAttentionConfig()):
    def many(kc, vc, sets, seq, pos, rows):
        return [paged_attention(q, kc, vc, tb, seq, pos, rows, backend=backend,
                                interpret=INTERPRET and backend == GPU, config=config)
                for q, tb in sets]

    args = (kc, vc, sets, seq, pos, rows)
    exe = jax.jit(many).lower(*args).compile()
    return time_exe(exe, args, len(sets))


def bench_decode(batch, ctx, mml, *, deadline, with_reference=True):
    if time.time() > deadline:
        print(f"skip decode b={batch} ctx={ctx} mml={mml}: past the time budget")
        return
    rng = np.random.default_rng(0)
    W = mml // BS
    kc, vc, sets, seq, pos, rows = decode_sets(rng, batch, ctx, W, CALLS)
    live_bytes = batch * ctx * 4 * 128 * 2 * 2 + 2 * batch * 16 * 128 * 2
    row = dict(phase="decode", batch=batch, context=ctx, max_model_len=mml,
               byte_floor_us=live_bytes / COPY_BW * 1e6)
    wall, dev = time_calls(GPU, kc, vc, sets, seq, pos, rows)
    row["kernel_wall_us"] = wall
    row["kernel_device_us"] = dev.get("device_us_per_call")
    row["kernel_launches_per_call"] = dev.get("kernels_per_call")
    if "device_time_error" in dev:
        row["kernel_device_error"] = dev["device_time_error"]
    ref_bytes = batch * mml * 4 * 128 * 4 * 2  # the reference's float32 K and V gathers
    if with_reference and ref_bytes <= (3 << 30):
        wall, dev = time_calls("reference", kc, vc, sets[:3], seq, pos, rows)
        row["reference_wall_us"] = wall
        row["reference_device_us"] = dev.get("device_us_per_call")
    ROWS.append(row)
    print(f"decode  b={batch:4d} ctx={ctx:5d} mml={mml:6d}  device {_f(row['kernel_device_us'])}"
          f" wall {_f(row['kernel_wall_us'])} us  floor "
          f"{_f(row['byte_floor_us'])}  reference device {_f(row.get('reference_device_us'))}",
          flush=True)
    del kc, vc, sets


def _f(x):
    return f"{x:9.1f}" if isinstance(x, (int, float)) else f"{'-':>9}"


def bench_prefill(name, rows_spec, mml, *, deadline, Hq=16, Hkv=4, D=128, Dv=None, config=PagedAttentionConfig(),
                  n_sets=4, record=True):
    if time.time() > deadline:
        return
    rng = np.random.default_rng(1)
    sets = []
    for s in range(n_sets):
        args, _ = make_step(rng, rows_spec, Hq=Hq, Hkv=Hkv, D=D, W=mml // BS, qdt="bfloat16",
                            cdt="bfloat16", pad_tokens=0, extra_rows=0)
        if Dv is not None:  # values narrower than keys (MLA's split form: 192-wide keys, 128-wide values)
            args["value_cache"] = args["value_cache"][..., :Dv]
        sets.append(args)

    def many(sets):
        return [paged_attention(**a, backend=GPU, interpret=INTERPRET, config=config) for a in sets]

    exe = jax.jit(many).lower(sets).compile()
    wall, dev = time_exe(exe, (sets,), len(sets))
    us = dev.get("device_us_per_call") or wall
    T = sets[0]["q"].shape[0]
    flops = sum(2 * ql * Hq * (D + (Dv or D)) * (c - ql / 2) for c, ql in rows_spec)
    row = dict(phase="prefill", name=name, tokens=T, max_model_len=mml, kernel_wall_us=wall,
               kernel_device_us=dev.get("device_us_per_call"), tflops=flops / us / 1e6)
    if record:
        ROWS.append(row)
    print(f"prefill {name}: T={T} device {_f(dev.get('device_us_per_call'))} us wall {_f(wall)}"
          f"  {flops / us / 1e6:6.1f} TFLOP/s", flush=True)
    return row


def prefill_sweep(deadline):
    """One request's 8k prefill at Granite-4.0-H-Micro's (32/8 heads x 64), Nemotron-H's
    (32/8 x 128) and DeepSeek-V2-Lite's split-form MLA (16/16 heads, keys 192, values 128)
    attention shapes, under tile variants."""
    out = []
    variants = dict(default={}, m128=dict(gpu_block_m=128), m128_w8=dict(gpu_block_m=128, gpu_num_warps=8),
                    n128=dict(gpu_block_n=128), m128_n128_w8=dict(gpu_block_m=128, gpu_block_n=128, gpu_num_warps=8),
                    w8=dict(gpu_num_warps=8), stages3=dict(gpu_num_stages=3),
                    m256_w8=dict(gpu_block_m=256, gpu_num_warps=8), m128_w8_s3=dict(gpu_block_m=128, gpu_num_warps=8,
                                                                                 gpu_num_stages=3),
                    m128_n32_w8=dict(gpu_block_m=128, gpu_block_n=32, gpu_num_warps=8))
    shapes = {"granite": dict(Hq=32, Hkv=8, D=64), "nemotron": dict(Hq=32, Hkv=8, D=128),
              "mla": dict(Hq=16, Hkv=16, D=192, Dv=128)}
    for label in (os.environ.get("PREFILL_SWEEP_SHAPES") or ",".join(shapes)).split(","):
        for name, kw in variants.items():
            if time.time() > deadline:
                return out
            try:
                row = bench_prefill(f"sweep-{label}-8k-{name}", [(8192, 8192)], 8192, deadline=deadline,
                                    **shapes[label], config=PagedAttentionConfig(**kw), n_sets=1,
                                    record=False)
            except Exception as e:  # noqa: BLE001 - a config the compiler rejects
                row = None
                print(f"prefill sweep {label} {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            out.append(dict(shape=label, variant=name, config=kw, row=row))
    return out


def sweep(deadline):
    out = []
    variants = dict(
        default={}, v0=dict(gpu_block_n=64, gpu_min_programs=256),
        min_programs_512=dict(gpu_min_programs=512), min_programs_1024=dict(gpu_min_programs=1024),
        block_n_64=dict(gpu_block_n=64), stages_1=dict(gpu_num_stages=1),
        stages_3=dict(gpu_num_stages=3),
        warps_8=dict(gpu_num_warps=8), block_m_32=dict(gpu_block_m=32))
    for batch, ctx in ((16, 4096), (64, 4096), (1, 4096), (256, 1024)):
        if time.time() > deadline:
            break
        kc, vc, sets, seq, pos, rows = decode_sets(np.random.default_rng(0), batch, ctx,
                                                   32768 // BS, CALLS)
        for name, kw in variants.items():
            if time.time() > deadline:
                break
            try:
                wall, dev = time_calls(GPU, kc, vc, sets, seq, pos, rows,
                                       PagedAttentionConfig(**kw))
                us = dev.get("device_us_per_call")
            except Exception as e:  # noqa: BLE001 - a config the compiler rejects
                wall = us = None
                print(f"sweep {name}: {type(e).__name__}: {str(e)[:200]}")
            out.append(dict(batch=batch, context=ctx, max_model_len=32768, variant=name,
                            config=kw, device_us=us, wall_us=wall))
            print(f"sweep b={batch:4d} ctx={ctx} {name:18s} device {_f(us)} wall {_f(wall)}",
                  flush=True)
        del kc, vc, sets
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--budget-s", type=float, default=130.0)
    p.add_argument("--allow-cpu", action="store_true")
    p.add_argument("--prefill-sweep", action="store_true",
                   help="only the prefill tile sweep at the real presets' shapes (after the checks)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes, kernel interpreted (any backend): checks the script")
    a = p.parse_args()
    global INTERPRET, CALLS, REPEATS
    grid = ((1024, (2048, 32768)), (4096, (8192, 32768)), (256, (2048, 32768)))
    batches = (1, 16, 64, 256)
    if a.smoke:
        INTERPRET, CALLS, REPEATS = True, 2, 2
        grid, batches = ((64, (128, 512)),), (1, 4)
        CASES[2:] = []
    start = time.time()
    deadline = start + a.budget_s
    if not a.smoke and not on_gpu_or_allowed("the paged attention kernel"):
        return 1
    run_cases()
    status = summary()
    meta = dict(jax=jax.__version__, device=str(jax.devices()[0]), block_size=BS,
                Hq=16, Hkv=4, head_dim=128, dtype="bfloat16", calls_per_executable=CALLS,
                repeats=REPEATS, copy_bw_bytes_per_s=COPY_BW,
                method="one executable makes CALLS calls on distinct queries and block tables; "
                       "device_us: summed kernel time per call from a profiler trace "
                       "(CUPTI) of 3 executions; wall_us: median of REPEATS samples of 3 "
                       "executions queued back to back, per call (host dispatch included "
                       "where the device work is shorter)")
    result = dict(meta=meta, checks=CHECKS, check_results=[list(r) for r in RESULTS],
                  rows=ROWS, sweep=[])

    def save():
        with open(os.path.join(a.out, "paged_attention.json"), "w") as f:
            json.dump(result, f, indent=1)

    save()
    if a.prefill_sweep:
        try:
            result["prefill_sweep"] = prefill_sweep(deadline)
        finally:
            save()
        return status
    try:
        for ctx, mmls in grid:
            for mml in mmls:
                for batch in batches:
                    bench_decode(batch, ctx, mml, deadline=deadline)
                    save()
        if not a.smoke:
            bench_prefill("one-row-2k-chunk", [(2048, 2048)], 2048, deadline=deadline)
            bench_prefill("mixed-512-prefill+63-decode", [(1024, 512)] + [(1024, 1)] * 63,
                          2048, deadline=deadline)
            save()
            result["sweep"] = sweep(deadline + 50)
    finally:
        result["meta"]["wall_s"] = time.time() - start
        save()
    print("\nbatch context mml     device_us   wall_us  ref_device_us  floor_us")
    for r in ROWS:
        if r["phase"] == "decode":
            print(f"{r['batch']:5d} {r['context']:7d} {r['max_model_len']:6d} "
                  f"{_f(r['kernel_device_us'])} "
                  f"{_f(r['kernel_wall_us'])} {_f(r.get('reference_device_us'))} "
                  f"{_f(r['byte_floor_us'])}")
    print("\nmax_model_len 32k over the smallest, same batch and context (device time):")
    for r in ROWS:
        if r["phase"] == "decode" and r["max_model_len"] == 32768:
            base = [x for x in ROWS if x["phase"] == "decode" and x["batch"] == r["batch"]
                    and x["context"] == r["context"] and x["max_model_len"] < 32768]
            if base and base[0]["kernel_device_us"] and r["kernel_device_us"]:
                ratio = r["kernel_device_us"] / base[0]["kernel_device_us"]
                r["ratio_to_smaller_max_model_len"] = ratio
                print(f"  b={r['batch']:4d} ctx={r['context']:5d}: {ratio:.3f}x")
    save()
    return status


if __name__ == "__main__":
    sys.exit(main())
