"""Probe: DeepSeek's MLA attention calls alone, under tile variants.

Run on a machine with an NVIDIA GPU, from the repository root:

    PYTHONPATH=. python benchmarks/probe_mla.py [--tokens 2048,8192] [--decode 1:1024,16:1024] [--json PATH]

One request prefilling ``T`` tokens at DeepSeek-V2-Lite's shapes (16 heads; keys ``nope 128 +
rope 64``, values 128; latent 512 + 64), bf16:

* ``new``: the step's own tokens in the naive form, as ``kvjax.models.hf.mla.split_latent_attention``
  calls ``pallas_kernels.paged_attention`` (one-token blocks, a ``[1, T]`` table, ``return_lse``),
  under each :class:`PagedAttentionConfig` variant;
* ``context-empty``: the absorbed part over a context of 0 keys (a fresh prefill), default config.

* ``decode``: the absorbed form at ``batch`` rows of ``context`` keys each (a table of 2,048
  columns: max_model_len 32k), under tile, warp, stage and split variants, with the rate the
  latent rows were read at (their bytes over the call's kernel time).

Each row: summed kernel time per call from a profiler trace of 3 calls, and the FLOPs of the
causal products (``2 T^2 / 2 * H * (D + Dv)``) over it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _trace import jax_device_us  # noqa: E402
from pallas_kernels.paged_attention import PagedAttentionConfig, paged_attention  # noqa: E402

H, NOPE, ROPE, DV, R_LAT = 16, 128, 64, 128, 512
VARIANTS = dict(default={}, m128=dict(gpu_block_m=128), m128_w8=dict(gpu_block_m=128, gpu_num_warps=8),
                m32=dict(gpu_block_m=32), n32=dict(gpu_block_n=32), n128=dict(gpu_block_n=128),
                w8=dict(gpu_num_warps=8), stages3=dict(gpu_num_stages=3),
                m128_n32_w8=dict(gpu_block_m=128, gpu_block_n=32, gpu_num_warps=8),
                m128_w8_s3=dict(gpu_block_m=128, gpu_num_warps=8, gpu_num_stages=3))
# "default" is the library's own rule at the time of the run (0444241: MLA 16 x 64 on 4 warps,
# 3 stages; GQA 2 stages); the others set the config's knobs.
DECODE_VARIANTS = dict(
    default={}, s1=dict(gpu_num_stages=1), s2=dict(gpu_num_stages=2), s3=dict(gpu_num_stages=3),
    s4=dict(gpu_num_stages=4), w8=dict(gpu_num_warps=8), w8_s3=dict(gpu_num_warps=8, gpu_num_stages=3),
    n32_w8=dict(gpu_block_n=32, gpu_num_warps=8), n16=dict(gpu_block_n=16),
    n16_s4=dict(gpu_block_n=16, gpu_num_stages=4), n128_w8=dict(gpu_block_n=128, gpu_num_warps=8),
    p1024=dict(gpu_min_programs=1024), w8_p512=dict(gpu_num_warps=8, gpu_min_programs=512),
    p128=dict(gpu_min_programs=128), n64=dict(gpu_block_n=64), n64_s3=dict(gpu_block_n=64, gpu_num_stages=3),
    s3_p512=dict(gpu_num_stages=3, gpu_min_programs=512), n128_s3=dict(gpu_block_n=128, gpu_num_stages=3),
    n32_s2=dict(gpu_block_n=32, gpu_num_stages=2),
    x32=dict(gpu_max_kv_splits=32), x128=dict(gpu_max_kv_splits=128),
    x256=dict(gpu_max_kv_splits=256), n32_x128=dict(gpu_block_n=32, gpu_max_kv_splits=128),
    n32_x256=dict(gpu_block_n=32, gpu_max_kv_splits=256),
    n16_x256=dict(gpu_block_n=16, gpu_max_kv_splits=256))


def decode(batch: int, ctx: int, rng, variants=(), gqa: bool = False) -> list:
    """The absorbed MLA decode call at ``batch`` rows of ``ctx`` keys, under DECODE_VARIANTS;
    ``gqa``: Nemotron-H's GQA decode instead (32 query heads over 8 kv heads x 128, keys and
    values in two caches), for comparison."""
    W, bs = 2048, 16
    per = -(-ctx // bs)
    key = jax.random.key(int(rng.integers(1 << 30)))
    kv_heads, width = (8, 128) if gqa else (1, R_LAT + ROPE)
    cache = jax.random.normal(key, (batch * per + 1, bs, kv_heads, width), jnp.bfloat16)
    values = jax.random.normal(jax.random.fold_in(key, 1), cache.shape, jnp.bfloat16) if gqa else None
    table = np.zeros((batch, W), np.int32)
    table[:, :per] = 1 + np.arange(batch * per).reshape(batch, per)
    table = jnp.asarray(table)
    lens = jnp.full((batch,), ctx, jnp.int32)
    pos = jnp.full((batch,), ctx - 1, jnp.int32)
    row = jnp.arange(batch, dtype=jnp.int32)
    q = jnp.asarray(rng.standard_normal((batch, 32, 128) if gqa else (batch, H, R_LAT + ROPE)), jnp.bfloat16)
    out = []
    for name, kw in DECODE_VARIANTS.items():
        if variants and name not in variants:
            continue
        cfg = PagedAttentionConfig(**kw)
        # the cache is an argument, not a constant closed over (which compiled its 1.2 GB into
        # every variant's program: ~50 s each)
        f = jax.jit(lambda q, cache, values, table, lens, pos, row, c=cfg: paged_attention(
            q, cache, values, table, lens, pos, row, v_head_dim=None if gqa else R_LAT, sm_scale=0.1,
            backend="pallas_gpu", config=c))
        args = (q, cache, values, table, lens, pos, row)
        try:
            jax.block_until_ready(f(*args))
            t = jax_device_us(lambda: jax.block_until_ready(f(*args)), 3, 1)
        except Exception as e:  # noqa: BLE001 - a config the compiler rejects
            t = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        us = t.get("device_us_per_call")
        read = batch * ctx * kv_heads * width * 2 * (2 if gqa else 1)  # the cache rows read
        tbps = None if not us else read / us / 1e6
        out.append(dict(part="gqa-decode" if gqa else "decode", batch=batch, context=ctx, variant=name,
                        config=kw, **t, cache_TBps=tbps))
        print(f"{'gqa ' if gqa else ''}decode b={batch:3d} ctx={ctx} {name:16s} {us and round(us, 1)} us "
              f"{tbps and round(tbps, 2)} TB/s ({t.get('kernels_per_call')} kernels) {t.get('error', '')}",
              flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="2048,8192")
    ap.add_argument("--json", default=None)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--decode", default="1:1024,1:4096,16:1024")
    ap.add_argument("--decode-variants", default="",
                    help="comma-separated DECODE_VARIANTS names (default: all)")
    ap.add_argument("--gqa-decode", default="",
                    help="BATCH:CONTEXT,...: Nemotron-H's GQA decode, the same variants")
    a = ap.parse_args()
    rows = []
    rng = np.random.default_rng(0)
    variants = tuple(filter(None, a.decode_variants.split(",")))
    for specs, gqa in ((a.decode, False), (a.gqa_decode, True)):
        for spec in filter(None, specs.split(",")):
            b, c = spec.split(":")
            rows += decode(int(b), int(c), rng, variants, gqa=gqa)
    for T in [int(x) for x in filter(None, a.tokens.split(","))]:
        D = NOPE + ROPE
        q = jnp.asarray(rng.standard_normal((T, H, D)), jnp.bfloat16)
        k = jnp.asarray(rng.standard_normal((T, 1, H, D)), jnp.bfloat16)
        v = jnp.asarray(rng.standard_normal((T, 1, H, DV)), jnp.bfloat16)
        table = jnp.arange(T, dtype=jnp.int32)[None, :]
        lens = jnp.asarray([T], jnp.int32)
        pos = jnp.arange(T, dtype=jnp.int32)
        row = jnp.zeros((T,), jnp.int32)
        flops = 2 * T * T / 2 * H * (D + DV)
        for name in a.variants.split(","):
            cfg = PagedAttentionConfig(**VARIANTS[name])
            f = jax.jit(lambda q, k, v, c=cfg: paged_attention(
                q, k, v, table, lens, pos, row, sm_scale=0.1, return_lse=True, backend="pallas_gpu",
                config=c))
            try:
                jax.block_until_ready(f(q, k, v))
                t = jax_device_us(lambda: jax.block_until_ready(f(q, k, v)), 3, 1)
            except Exception as e:  # noqa: BLE001 - a config the compiler rejects
                t = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            us = t.get("device_us_per_call")
            r = dict(part="new", tokens=T, variant=name, config=VARIANTS[name], **t,
                     tflops=None if not us else flops / us / 1e6)
            rows.append(r)
            print(f"new T={T:5d} {name:14s} {us and round(us)} us  {r['tflops'] and round(r['tflops'])} TFLOP/s "
                  f"{t.get('error', '')}", flush=True)
        cache = jnp.asarray(rng.standard_normal((T // 16 + 1, 16, 1, R_LAT + ROPE)), jnp.bfloat16)
        qa = jnp.asarray(rng.standard_normal((T, H, R_LAT + ROPE)), jnp.bfloat16)
        ctab = jnp.zeros((1, T // 16 + 1), jnp.int32)
        g = jax.jit(lambda qa: paged_attention(qa, cache, None, ctab, jnp.zeros((1,), jnp.int32), pos, row,
                                               v_head_dim=R_LAT, sm_scale=0.1, return_lse=True,
                                               backend="pallas_gpu"))
        jax.block_until_ready(g(qa))
        t = jax_device_us(lambda: jax.block_until_ready(g(qa)), 3, 1)
        rows.append(dict(part="context-empty", tokens=T, **t))
        print(f"context-empty T={T:5d} {t.get('device_us_per_call')} us", flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(dict(device=str(jax.devices()[0]), jax=jax.__version__, rows=rows), fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
