"""Probe (issue 24, DeepSeek's 8k prefill): what Hopper kernels would buy, on its two largest parts.

    PYTHONPATH=. python benchmarks/probe_hopper_kernels.py [--tokens 8192] [--json OUT.json]

In one process on one GPU, DeepSeek-V2-Lite's shapes, bf16, timed back to back (``bench_moe.timed``:
the median of 20 calls after one warm-up, each call synchronised; jit-compiled):

* the split form's self-attention of one 8k-token request (16 heads, keys 192, values 128, causal):
  kvjax's ``paged_attention`` over one-token blocks (as ``split_latent_attention`` calls it) against
  JAX's own Hopper flash attention (``jax.experimental.pallas.ops.gpu.attention_mgpu``: wgmma,
  TMA, warp-specialised; one head width, so the values are zero-padded to 192; float16 only; no
  varlen, so it can only stand for a step that prefills one request), checked against each other;
* the routed experts' grouped products at ``tokens * 6`` rows over 64 experts (uniform routing):
  kvjax's ``grouped_matmul`` (gated up and down, as ``kvjax.models.moe`` calls it) against JAX's
  ``ragged_dot_mgpu`` and XLA's ``jax.lax.ragged_dot``, checked against each other.

TFLOP/s count the products' multiply-adds (x2), causal attention half of the square.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_moe  # noqa: E402

from pallas_kernels.grouped_matmul import grouped_matmul  # noqa: E402
from pallas_kernels.paged_attention import paged_attention  # noqa: E402


def timed(f, *args):
    """Median microseconds of ``f(*args)`` (:func:`bench_moe.timed`)."""
    return bench_moe.timed(f, *args) * 1e6


def attention_rows(T, H=16, dqk=192, dv=128):
    from jax.experimental.pallas.ops.gpu import attention_mgpu as am
    rows = []
    key = jax.random.key(0)
    kq, kk, kv = jax.random.split(key, 3)
    bf = jnp.bfloat16
    q = jax.random.normal(kq, (T, H, dqk), jnp.float32).astype(bf)
    k = jax.random.normal(kk, (T, H, dqk), jnp.float32).astype(bf)
    v = jax.random.normal(kv, (T, H, dv), jnp.float32).astype(bf)
    scale = 1.0 / math.sqrt(dqk)
    flops = 2 * H * (T * (T + 1) / 2) * (dqk + dv)

    @jax.jit
    def kv_self(q, k, v):
        table = jnp.arange(T, dtype=jnp.int32)[None, :]
        return paged_attention(q, k[:, None], v[:, None], table, jnp.array([T], jnp.int32),
                               jnp.arange(T, dtype=jnp.int32), jnp.zeros((T,), jnp.int32),
                               sm_scale=scale, return_lse=True, backend="pallas_gpu")

    us = timed(kv_self, q, k, v)
    ref, _ = kv_self(q, k, v)
    rows.append({"part": "self-attention", "impl": "kvjax paged_attention (one-token blocks)", "tokens": T,
                 "us": us, "tflops": flops / us / 1e6})
    # attention_mgpu stages its tiles in float16 (JAX 0.11.2), so it gets float16 operands: the
    # same bytes and products, another rounding (its difference to kvjax's bf16 run is reported)
    h16 = jnp.float16
    qs = (q.astype(jnp.float32) * scale).astype(h16)[None]
    k16 = k.astype(h16)[None]
    vp = jnp.pad(v, ((0, 0), (0, 0), (0, dqk - dv))).astype(h16)[None]
    for bq, bkv, steps in ((64, 64, 2), (64, 128, 2), (64, 64, 4), (128, 64, 2)):
        name = f"attention_mgpu block_q={bq} block_kv={bkv} steps={steps} (values padded to {dqk})"
        try:
            cfg = am.TuningConfig(block_q=bq, block_kv=bkv, max_concurrent_steps=steps, causal=True)
            f = jax.jit(functools.partial(am.attention, config=cfg, save_residuals=True))
            us = timed(f, qs, k16, vp)
            out, (lse,) = f(qs, k16, vp)
            err = float(jnp.max(jnp.abs(out[0, :, :, :dv].astype(jnp.float32) - ref)))
            rows.append({"part": "self-attention", "impl": name, "tokens": T, "us": us,
                         "tflops": flops / us / 1e6, "tflops_padded_work": 2 * H * (T * (T + 1) / 2) * 2 * dqk / us / 1e6,
                         "max_abs_diff_vs_kvjax": err})
        except Exception as e:  # a tiling the kernel refuses (shared memory, shapes)
            rows.append({"part": "self-attention", "impl": name, "tokens": T, "error": f"{type(e).__name__}: {str(e)[:300]}"})
    return rows


def expert_rows(T, E=64, k=6, d=2048, f=1408, tile=128):
    rows = []
    M = T * k
    per = M // E
    assert per % tile == 0, (per, tile)
    bf = jnp.bfloat16
    keys = jax.random.split(jax.random.key(1), 4)
    x = (jax.random.normal(keys[0], (M, d), jnp.float32) * 0.5).astype(bf)
    wg = (jax.random.normal(keys[1], (E, d, f), jnp.float32) / math.sqrt(d)).astype(bf)
    wu = (jax.random.normal(keys[2], (E, d, f), jnp.float32) / math.sqrt(d)).astype(bf)
    wd = (jax.random.normal(keys[3], (E, f, d), jnp.float32) / math.sqrt(f)).astype(bf)
    tile_group = jnp.repeat(jnp.arange(E, dtype=jnp.int32), per // tile)
    sizes = jnp.full((E,), per, jnp.int32)
    flops = 2 * M * d * f * 3

    @jax.jit
    def kv_mlp(x, wg, wu, wd):
        a = grouped_matmul(x, wu, tile_group, tile_rows=tile, gate=wg, activation="silu", out_dtype=bf,
                           backend="pallas_gpu")
        return grouped_matmul(a, wd, tile_group, tile_rows=tile, out_dtype=bf, backend="pallas_gpu")

    us = timed(kv_mlp, x, wg, wu, wd)
    ref = kv_mlp(x, wg, wu, wd).astype(jnp.float32)
    rows.append({"part": "experts", "impl": "kvjax grouped_matmul (gated up, down)", "tokens": T, "us": us,
                 "tflops": flops / us / 1e6})
    wgu = jnp.concatenate([wg, wu], axis=-1)

    @jax.jit
    def xla_mlp(x, wgu, wd):
        gu = jax.lax.ragged_dot(x, wgu, sizes, preferred_element_type=jnp.float32)
        a = (jax.nn.silu(gu[:, :f]) * gu[:, f:]).astype(bf)
        return jax.lax.ragged_dot(a, wd, sizes, preferred_element_type=jnp.float32).astype(bf)

    try:
        us = timed(xla_mlp, x, wgu, wd)
        err = float(jnp.max(jnp.abs(xla_mlp(x, wgu, wd).astype(jnp.float32) - ref)))
        rows.append({"part": "experts", "impl": "jax.lax.ragged_dot (XLA)", "tokens": T, "us": us,
                     "tflops": flops / us / 1e6, "max_abs_diff_vs_kvjax": err})
    except Exception as e:
        rows.append({"part": "experts", "impl": "jax.lax.ragged_dot (XLA)", "error": f"{type(e).__name__}: {str(e)[:300]}"})
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu as rd
    for bm, bn, steps, gbn in ((128, 128, 4, 1), (128, 128, 4, 2), (128, 64, 4, 1), (64, 128, 4, 1)):
        name = f"ragged_dot_mgpu block_m={bm} block_n={bn} block_k=64 steps={steps} grid_block_n={gbn}"
        try:
            kw = dict(block_m=bm, block_n=bn, block_k=64, max_concurrent_steps=steps, grid_block_n=gbn)

            @jax.jit
            def mg_mlp(x, wgu, wd, kw=kw):
                gu = rd.ragged_dot(x, wgu, group_sizes=sizes, **kw)
                a = (jax.nn.silu(gu[:, :f].astype(jnp.float32)) * gu[:, f:].astype(jnp.float32)).astype(bf)
                return rd.ragged_dot(a, wd, group_sizes=sizes, **kw)

            us = timed(mg_mlp, x, wgu, wd)
            err = float(jnp.max(jnp.abs(mg_mlp(x, wgu, wd).astype(jnp.float32) - ref)))
            rows.append({"part": "experts", "impl": name, "tokens": T, "us": us, "tflops": flops / us / 1e6,
                         "max_abs_diff_vs_kvjax": err})
        except Exception as e:
            rows.append({"part": "experts", "impl": name, "error": f"{type(e).__name__}: {str(e)[:300]}"})
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--json")
    a = ap.parse_args()
    rows = []
    for part in (attention_rows, expert_rows):
        n = len(rows)
        try:
            rows += part(a.tokens)
        except Exception as e:
            rows.append({"part": part.__name__, "error": f"{type(e).__name__}: {str(e)[:500]}"})
        for r in rows[n:]:
            print(json.dumps(r), flush=True)
    out = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
           "date": time.strftime("%Y-%m-%d"), "rows": rows}
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
