"""The routed-expert paths (``kvjax.models.moe.apply_experts``) at DeepSeek-V2-Lite's shapes.

MoE: 64 experts of 2048 x 1408 (SwiGLU), top-6, bf16, random routing (each token's 6 distinct
experts uniform). Per token count T and path (``dense``, ``sparse`` where it is allowed,
``grouped`` = :func:`pallas_kernels.grouped_matmul`): the median device time of the jitted
``apply_experts`` over back-to-back calls, its byte floor (the distinct chosen experts' weights
read once, at the measured copy bandwidth), its matmul floor (``6 * T * k * d * F`` flops at the
nominal bf16 peak), and the largest difference from the dense path.

Times are per call from the host (``jit`` dispatch included): at a few tokens they bound the
device time from above; the model benchmark (``bench_model.py``) has the step's device time.

``python benchmarks/bench_moe.py --out DIR`` writes ``DIR/bench_moe.json`` (rows) and logs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvjax.models import moe  # noqa: E402

E, D, F, K = 64, 2048, 1408, 6
NOMINAL_BF16_TFLOPS = 989.0


def log(*a):
    print(*a, flush=True)


def timed(fn, *args, reps=20):
    """Median seconds of ``fn(*args)`` (compiled, back to back, each blocked on)."""
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def copy_bandwidth():
    """Bytes per second of a 1 GiB device copy (read + write)."""
    x = jnp.ones((256 * 1024 * 1024,), jnp.float32)
    f = jax.jit(lambda a: a + 1)
    s = timed(f, x, reps=10)
    return 2 * x.nbytes / s


def bench_moe(rows, bw, tokens):
    r = np.random.default_rng(0)
    w = {n: jnp.asarray(r.standard_normal(s) / np.sqrt(s[1]), jnp.bfloat16)
         for n, s in (("w_up", (E, D, F)), ("w_gate", (E, D, F)), ("w_down", (E, F, D)))}
    expert_bytes = 3 * D * F * 2
    for T in tokens:
        h = jnp.asarray(r.standard_normal((T, D)), jnp.float32)
        idx = np.stack([r.choice(E, K, replace=False) for _ in range(T)]).astype(np.int32)
        weight = jnp.asarray(r.uniform(0.1, 1.0, (T, K)), jnp.float32)
        distinct = len(np.unique(idx))
        floor_s = distinct * expert_bytes / bw
        mm_floor_s = 6 * T * K * D * F / (NOMINAL_BF16_TFLOPS * 1e12)
        outs = {}
        paths = [("dense", "reference"), ("grouped", "auto")]
        if moe.sparse_pays(T, K, E) or T <= 16:
            paths.insert(1, ("sparse", "reference"))
        for path, backend in paths:
            fn = jax.jit(lambda h, i, wt, w, p=path, b=backend: moe.apply_experts(
                h, i, wt, w, path=p, backend=b))
            try:
                s = timed(fn, h, jnp.asarray(idx), weight, w)
                outs[path] = np.asarray(fn(h, jnp.asarray(idx), weight, w))
            except Exception as e:  # noqa: BLE001 - a failing path is a row, not the end
                log(f"moe T={T} {path}: FAILED {type(e).__name__}: {str(e)[:300]}")
                rows.append({"bench": "moe", "tokens": T, "path": path, "error": str(e)[:500]})
                continue
            row = {"bench": "moe", "tokens": T, "path": path, "device_us": s * 1e6,
                   "byte_floor_us": floor_s * 1e6, "matmul_floor_us": mm_floor_s * 1e6,
                   "distinct_experts": distinct,
                   "floor_ratio": s / max(floor_s, mm_floor_s)}
            if "dense" in outs and path != "dense":
                row["max_abs_diff_vs_dense"] = float(np.max(np.abs(outs[path] - outs["dense"])))
                row["max_abs_dense"] = float(np.max(np.abs(outs["dense"])))
            rows.append(row)
            log(json.dumps(row))


SWEEP = [  # (block_n, block_k, num_warps, num_stages); None: the config's rule
    (None, None, None, None), (128, 32, 4, 4), (64, 64, 4, 3), (128, 64, 4, 3), (256, 64, 8, 3),
    (128, 128, 8, 3), (64, 128, 4, 4), (32, 128, 4, 4), (32, 256, 4, 3),
]
# one-token to few-token steps (a tile per chosen expert, 16 rows): weight streaming, so longer
# product steps (block_k) and narrower or wider column blocks
SWEEP_FEW = [
    (None, None, None, None), (32, 128, 4, 3), (32, 256, 4, 3), (32, 256, 4, 4), (32, 512, 4, 2),
    (16, 256, 4, 3), (16, 512, 4, 3), (64, 128, 4, 3), (64, 256, 4, 3), (32, 256, 2, 3),
    (32, 256, 8, 3),
]


# prefill-sized calls (thousands of tokens, tiles of 128 rows): Hopper GEMM shapes too, wider
# column blocks and deeper pipelines (a config whose stages do not fit shared memory is a row)
SWEEP_MANY = SWEEP + [
    (256, 64, 8, 4), (128, 64, 8, 4), (128, 64, 4, 4), (256, 32, 8, 4), (128, 128, 8, 4),
    (256, 64, 4, 3), (64, 64, 4, 4), (128, 32, 8, 5),
]


def parse_configs(text: str) -> list:
    """``"bn,bk,warps,stages;..."`` (``-`` for a rule's None) -> the sweep's config tuples."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        vals = part.split(",")
        if len(vals) != 4:
            raise SystemExit(f"--sweep-configs: each config is bn,bk,warps,stages, got {part!r}")
        out.append(tuple(None if v.strip() == "-" else int(v) for v in vals))
    return out


def sweep_grouped(rows, bw, tokens, configs=None, products=None):
    """Each kernel config on the two products of an expert MLP at ``tokens`` tokens, laid out as
    the model lays them out (``group_tiles``; one token: a tile per chosen expert): the gated
    first layer (``silu(x @ gate) * (x @ up)``, ``[NT * TM, d] x [E, d, F]``, bf16 out) and
    the down product (``[NT * TM, F] x [E, F, d]``, float32 out; from 4,096 tokens also with
    bf16 out, ``down_bf16``). ``kernel_us`` is the
    profiler's kernel time. Every call reads the same weights: at a few tokens the chosen
    experts' matrices (35-69 MB here) sit partly or wholly in the GPU's L2 (50 MB on an H200),
    so these figures are optimistic against a model step, where each layer reads its own."""
    from pallas_kernels import GroupedMatmulConfig, group_tiles, grouped_matmul
    from pallas_kernels.grouped_matmul import tile_rows_for

    r = np.random.default_rng(2)
    w = {n: jnp.asarray(r.standard_normal(s) / np.sqrt(s[1]), jnp.bfloat16)
         for n, s in (("up", (E, D, F)), ("gate", (E, D, F)), ("down", (E, F, D)))}
    for T in tokens:
        P = T * K
        groups = np.stack([r.choice(E, K, replace=False) for _ in range(T)]).reshape(P)
        TM = tile_rows_for(P, E)
        slot, tg = group_tiles(jnp.asarray(groups, jnp.int32), E, TM, rows_apart=T == 1)
        distinct = len(np.unique(groups))
        for product in products or (("gated", "down", "down_bf16") if T >= 4096 else ("gated", "down")):
            Kd = D if product == "gated" else F
            x = jnp.zeros((tg.shape[0] * TM, Kd), jnp.bfloat16).at[slot].set(
                jnp.asarray(r.standard_normal((P, Kd)), jnp.bfloat16))
            mats = 2 if product == "gated" else 1
            floor_s = max(mats * distinct * D * F * 2 / bw, mats * 2 * P * D * F / (NOMINAL_BF16_TFLOPS * 1e12))
            ref = None
            for bn, bk, warps, stages in configs or (SWEEP_FEW if T <= 16 else SWEEP_MANY if T >= 4096 else SWEEP):
                cfg = GroupedMatmulConfig(gpu_block_n=bn, gpu_block_k=bk, gpu_num_warps=warps,
                                          gpu_num_stages=stages)
                if product == "gated":
                    fn = jax.jit(lambda x, tg, cfg=cfg: grouped_matmul(
                        x, w["up"], tg, tile_rows=TM, gate=w["gate"], activation="silu",
                        out_dtype=jnp.bfloat16, config=cfg))
                else:
                    od = jnp.bfloat16 if product == "down_bf16" else jnp.float32
                    fn = jax.jit(lambda x, tg, cfg=cfg, od=od: grouped_matmul(
                        x, w["down"], tg, tile_rows=TM, out_dtype=od, config=cfg))
                try:
                    s = timed(fn, x, tg)
                    dev = _device_us(fn, x, tg)
                    out = np.asarray(fn(x, tg)).astype(np.float32)
                except Exception as e:  # noqa: BLE001 - a config that fails is a row
                    rows.append({"bench": "grouped_sweep", "tokens": T, "product": product,
                                 "config": [bn, bk, warps, stages], "error": str(e)[:300]})
                    log(f"sweep T={T} {product} {bn, bk, warps, stages}: FAILED {str(e)[:200]}")
                    continue
                ref = out if ref is None else ref
                row = {"bench": "grouped_sweep", "tokens": T, "product": product, "tile_rows": TM,
                       "tiles": int(tg.shape[0]), "config": [bn, bk, warps, stages], "device_us": s * 1e6,
                       "kernel_us": dev, "floor_us": floor_s * 1e6,
                       "floor_ratio": (dev if dev else s * 1e6) / (floor_s * 1e6),
                       "tflops": mats * 2 * P * D * F / ((dev if dev else s * 1e6) * 1e6),
                       "max_abs_diff_vs_first": float(np.max(np.abs(out - ref)))}
                rows.append(row)
                log(json.dumps(row))


def _device_us(fn, *args):
    """The kernels' summed device time per call (the profiler), or None where it is missing."""
    try:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from _trace import jax_device_us

        return jax_device_us(lambda: fn(*args), 5, 1).get("device_us_per_call")
    except Exception:  # noqa: BLE001 - a host-time row is still a row
        return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", default="1,4,16,64,256,2048,8192")
    ap.add_argument("--sweep", default="", help="token counts for the grouped kernel's config sweep")
    ap.add_argument("--sweep-configs", default="", help="the sweep's configs, 'bn,bk,warps,stages;...' "
                    "('-' for the rule's None; default: the lists above)")
    ap.add_argument("--sweep-products", default="", help="comma-separated: gated, down, down_bf16 (default: all)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    rows = []
    bw = copy_bandwidth()
    meta = {"date": time.strftime("%Y-%m-%d"), "device": str(jax.devices()[0]),
            "jax": jax.__version__, "python": platform.python_version(), "copy_bw_TBps": bw / 1e12,
            "shapes": {"experts": E, "d": D, "F": F, "top_k": K, "dtype": "bfloat16"}}
    log(json.dumps(meta))
    try:
        bench_moe(rows, bw, [int(t) for t in a.tokens.split(",") if t])
        sweep_grouped(rows, bw, [int(t) for t in a.sweep.split(",") if t], parse_configs(a.sweep_configs),
                      [p for p in a.sweep_products.split(",") if p])
    finally:
        with open(os.path.join(a.out, "bench_moe.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
