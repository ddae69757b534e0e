"""Decode-sized products on a GPU by weight layout: XLA's GEMM over ``[K, N]`` weights (the
models' layout) against the same product over ``[N, K]`` weights (each output's weights
contiguous), and a Pallas Triton GEMV over ``[N, K]`` (issue 24, batch 1).

    PYTHONPATH=. python benchmarks/probe_skinny.py --out DIR

For each shape and row count: eight weight copies (more than L2 holds) multiplied in turn inside
one jitted function, traced with the profiler; per product the summed kernel time and the weight
bytes over it (TB/s).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# Granite (in_proj, out_proj, gate/up, down), Nemotron-H (in_proj, out_proj, up, down),
# DeepSeek (q, kv_a, o, shared gate/up, shared down)
SHAPES = [(2048, 8512), (4096, 2048), (2048, 16384), (8192, 2048),
          (4096, 18560), (8192, 4096), (4096, 21504), (21504, 4096),
          (2048, 3072), (2048, 576), (2048, 2048), (2048, 5632), (2816, 2048)]
# (block_n, block_k, warps, stages, split) of the Pallas [N, K] GEMV
CONFIGS = [(16, 256, 4, 3, 1), (32, 256, 4, 3, 1), (16, 512, 4, 3, 1), (32, 128, 4, 4, 1),
           (64, 128, 4, 3, 1), (16, 256, 4, 3, 2), (32, 256, 8, 3, 1)]


def nk_gemv(x, wt, *, bn, bk, warps, stages, split):
    """``x [16, K] @ wt[N, K].T`` -> float32 ``[split, 16, N]`` partial sums (Pallas Triton)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    M, K = x.shape
    N = wt.shape[0]
    ks = K // split
    nsteps = ks // bk

    def kernel(x_ref, w_ref, o_ref):
        j, s = pl.program_id(0), pl.program_id(1)
        n = j * bn + jnp.arange(bn, dtype=jnp.int32)
        rows = jnp.arange(M, dtype=jnp.int32)

        def step(i, acc):
            k = s * ks + i * bk + jnp.arange(bk, dtype=jnp.int32)
            a = plgpu.load(x_ref.at[rows[:, None] * K + k[None, :]])
            b = plgpu.load(w_ref.at[n[:, None] * K + k[None, :]])
            return acc + jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                                             preferred_element_type=jnp.float32)

        acc = jax.lax.fori_loop(0, nsteps, step, jnp.zeros((M, bn), jnp.float32))
        plgpu.store(o_ref.at[(s * M + rows[:, None]) * N + n[None, :]], acc)

    out = pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((split * M * N,), jnp.float32), grid=(N // bn, split),
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages), name="nk_gemv",
    )(x.reshape(-1), wt.reshape(-1))
    return out.reshape(split, M, N)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--copies", type=int, default=8)
    ap.add_argument("--rows", default="2,16,64,256")
    ap.add_argument("--no-pallas", action="store_true")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    import jax
    import jax.numpy as jnp

    from probe_gemv import time_products, weight_copies

    rows_out = []
    for K, N in SHAPES:
        ws = weight_copies(K, N, a.copies)
        wts = [jnp.asarray(w.T) for w in ws]
        for M in [int(v) for v in a.rows.split(",")]:
            x = jax.random.normal(jax.random.key(M), (M, K), jnp.float32).astype(jnp.bfloat16)
            ref = jnp.matmul(x.astype(jnp.float32), ws[0].astype(jnp.float32))
            f32 = jnp.float32
            variants = {
                "xla_kn": (lambda x, w: jnp.matmul(x, w, preferred_element_type=f32), ws),
                "xla_nk": (lambda x, w: jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())),
                                                             preferred_element_type=f32), wts),
            }
            if M <= 16 and not a.no_pallas:
                x16 = jnp.zeros((16, K), jnp.bfloat16).at[:M].set(x)
                for bn, bk, warps, stages, split in CONFIGS:
                    if N % bn or K % (bk * split):
                        continue
                    variants[f"pallas_nk_bn{bn}_bk{bk}_w{warps}_s{stages}_x{split}"] = (
                        lambda x, w, c=(bn, bk, warps, stages, split), M=M, x16=x16: nk_gemv(
                            x16, w, bn=c[0], bk=c[1], warps=c[2], stages=c[3], split=c[4]).sum(0)[:M], wts)
            for name, (f, mats) in variants.items():
                t = time_products(f, x, mats, ref, rows_checked=M)
                if "error" in t:
                    print(f"{K}x{N} M{M} {name}: {t['error']}", flush=True)
                    continue
                row = {"K": K, "N": N, "M": M, "variant": name, **t,
                       "TBps": K * N * 2 / max(t["us_per_product"], 1e-9) / 1e6}
                rows_out.append(row)
                print(f"{K:5d}x{N:<6d} M{M:<4d} {name:34s} {row['us_per_product']:8.2f} us "
                      f"({row['kernels_per_product']:.1f} kernels)  {row['TBps']:5.2f} TB/s  "
                      f"err {row['rel_err']:.1e}", flush=True)
        _write(a.out, jax, rows_out)
    return 0


def _write(out, jax, rows_out):
    with open(os.path.join(out, "probe_skinny.json"), "w") as f:
        json.dump({"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "rows": rows_out}, f,
                  indent=1)


if __name__ == "__main__":
    sys.exit(main())
