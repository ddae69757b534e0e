"""Decode-sized products (one or two rows) on a GPU: XLA's kernels beside the Pallas grouped
matmul as a single-group GEMV, at Granite-4.0-H-Micro's shapes (issue 24, batch 1).

    PYTHONPATH=. python benchmarks/probe_gemv.py --out DIR

For each ``[K, N]`` bf16 weight: eight copies (more than L2 holds) multiplied in turn inside one
jitted function, traced with the profiler; per product the summed kernel time and the weight
bytes over it (TB/s). XLA: ``kvjax.models.attention.linear`` of one row (its row pad included) and
of two rows; Pallas: ``grouped_matmul`` with one group and one 16-row tile, in several tilings.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SHAPES = [(2048, 8512), (4096, 2048), (2048, 16384), (8192, 2048)]
CONFIGS = [(16, 128, 4, 3), (32, 128, 4, 3), (64, 128, 4, 3), (32, 256, 4, 3), (16, 256, 4, 4),
           (32, 64, 4, 4), (64, 256, 8, 3), (16, 512, 4, 3), (32, 512, 8, 3)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--copies", type=int, default=8)
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    import jax
    import jax.numpy as jnp

    from _trace import trace_device
    from kvjax.models.attention import linear
    from pallas_kernels.grouped_matmul import GroupedMatmulConfig, grouped_matmul

    rows = []
    for K, N in SHAPES:
        keys = jax.random.split(jax.random.key(K * N), a.copies)
        ws = [jax.random.normal(k, (K, N), jnp.bfloat16) * 0.02 for k in keys]
        x1 = jax.random.normal(jax.random.key(1), (1, K), jnp.float32)
        x2 = jnp.concatenate([x1, jax.random.normal(jax.random.key(2), (1, K), jnp.float32)])  # row 0 is x1
        x16 = jnp.zeros((16, K), jnp.bfloat16).at[0].set(x1[0].astype(jnp.bfloat16))
        ref = jnp.matmul(x1.astype(jnp.float32), ws[0].astype(jnp.float32))
        variants = {"xla_1row": (lambda x, w: linear(x, w, out_dtype=jnp.bfloat16), x1),
                    "xla_2rows": (lambda x, w: linear(x, w, out_dtype=jnp.bfloat16), x2)}
        for bn, bk, warps, stages in CONFIGS:
            cfg = GroupedMatmulConfig(gpu_block_n=bn, gpu_block_k=bk, gpu_num_warps=warps, gpu_num_stages=stages)
            variants[f"pallas_bn{bn}_bk{bk}_w{warps}_s{stages}"] = (
                lambda x, w, cfg=cfg: grouped_matmul(x, w[None], jnp.zeros((1,), jnp.int32), tile_rows=16,
                                                     out_dtype=jnp.bfloat16, config=cfg, backend="pallas_gpu"), x16)
        for name, (f, x) in variants.items():
            fn = jax.jit(lambda x, *ws, f=f: [f(x, w) for w in ws])
            try:
                out = fn(x, *ws)
                err = float(jnp.max(jnp.abs(out[0][:1].astype(jnp.float32) - ref)) / jnp.max(jnp.abs(ref)))
                tr = trace_device(lambda: fn(x, *ws), 3)
            except Exception as e:  # noqa: BLE001
                print(f"{K}x{N} {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            kern = tr.pop("_kernels", [])
            us = sum(k[1] for k in kern) / (3 * a.copies)
            n_k = len(kern) / (3 * a.copies)
            big = statistics.median(sorted(k[1] for k in kern)[-3 * a.copies:])
            row = {"K": K, "N": N, "variant": name, "kernels_per_product": n_k, "us_per_product": us,
                   "largest_kernel_us": big, "TBps": K * N * 2 / us / 1e6, "rel_err": err}
            rows.append(row)
            print(f"{K:5d}x{N:<6d} {name:28s} {us:7.2f} us ({n_k:.1f} kernels, largest {big:6.2f})"
                  f"  {row['TBps']:5.2f} TB/s  err {err:.1e}", flush=True)
    with open(os.path.join(a.out, "probe_gemv.json"), "w") as f:
        json.dump({"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
