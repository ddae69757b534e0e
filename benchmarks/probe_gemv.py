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


def weight_copies(K: int, N: int, copies: int) -> list:
    """``copies`` random bf16 ``[K, N]`` weights (seeded by the shape): together more than L2
    holds, so each product reads its weights from memory."""
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(K * N), copies)
    return [jax.random.normal(k, (K, N), jnp.bfloat16) * 0.02 for k in keys]


def time_products(f, x, mats, ref, rows_checked: int) -> dict:
    """``f(x, w)`` for each weight copy in ``mats``, in turn inside one jitted function, traced
    three times: per product the summed kernel time, the kernel count and the median of the
    largest kernels, and the first copy's relative error over its first ``rows_checked`` rows
    against ``ref`` (or ``{"error": ...}``)."""
    import jax
    import jax.numpy as jnp

    from _trace import trace_device

    fn = jax.jit(lambda x, *ws: [f(x, w) for w in ws])
    try:
        out = fn(x, *mats)
        got = out[0][:rows_checked].astype(jnp.float32)
        err = float(jnp.max(jnp.abs(got - ref)) / jnp.max(jnp.abs(ref)))
        tr = trace_device(lambda: fn(x, *mats), 3)
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    n = 3 * len(mats)
    kern = tr.pop("_kernels", [])
    return {"kernels_per_product": len(kern) / n, "us_per_product": sum(k[1] for k in kern) / n,
            "largest_kernel_us": statistics.median(sorted(k[1] for k in kern)[-n:]) if kern else 0.0,
            "rel_err": err}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--copies", type=int, default=8)
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    import jax
    import jax.numpy as jnp

    from kvjax.models.attention import linear
    from pallas_kernels.grouped_matmul import GroupedMatmulConfig, grouped_matmul

    rows = []
    for K, N in SHAPES:
        ws = weight_copies(K, N, a.copies)
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
            t = time_products(f, x, ws, ref, rows_checked=1)
            if "error" in t:
                print(f"{K}x{N} {name}: {t['error']}", flush=True)
                continue
            row = {"K": K, "N": N, "variant": name, **t,
                   "TBps": K * N * 2 / max(t["us_per_product"], 1e-9) / 1e6}
            rows.append(row)
            print(f"{K:5d}x{N:<6d} {name:28s} {row['us_per_product']:7.2f} us ({row['kernels_per_product']:.1f} "
                  f"kernels, largest {row['largest_kernel_us']:6.2f})  {row['TBps']:5.2f} TB/s  "
                  f"err {row['rel_err']:.1e}", flush=True)
    with open(os.path.join(a.out, "probe_gemv.json"), "w") as f:
        json.dump({"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
