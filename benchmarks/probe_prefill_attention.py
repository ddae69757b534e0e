"""One request's causal prefill attention (no earlier context) on a GPU: kvjax's paged Pallas
Triton kernel beside the dense kernels JAX ships, at DeepSeek-V2-Lite's split-form MLA shape
(16/16 heads, keys 192, values 128) and Nemotron-H's GQA shape (32/8 heads x 128), issue 24's
8k prefill target.

    PYTHONPATH=. python benchmarks/probe_prefill_attention.py --out DIR [--tokens 8192]

Which attention a new prefill path should call, measured, not assumed: the paged kernel's
8k MLA prefill runs at ~114 TFLOP/s on the H200 (notes item 12) whatever its tiles. Rows:

* ``paged``: ``paged_attention(backend="pallas_gpu")`` over a block table (the served path);
* ``xla`` / ``cudnn``: ``jax.nn.dot_product_attention(is_causal=True)`` on dense ``[1, S, H, D]``
  arrays (the values zero-padded to the keys' width where an implementation needs equal
  widths: marked ``v_padded``, its FLOPs still counted at the true width);
* ``cudnn+seqlens``: as ``cudnn`` with both sequence lengths given (cuDNN's padding-causal
  mask), as a step whose bucket holds more tokens than the prefill passes them;
* ``cudnn-direct`` / ``cudnn-direct+seqlens``: JAX's own cuDNN entry point
  (``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention``), which takes values
  narrower than the keys (cuDNN >= 9.10 on Hopper): no padding;
* ``mosaic``: ``jax.experimental.pallas.ops.gpu.attention_mgpu`` (Hopper, warpgroup MMA), the
  same padding, ``q`` pre-scaled (the kernel applies no score scale).

Each row: device time per call from a profiler trace, TFLOP/s over the causal FLOPs
``2 * S * H * (Dk + Dv) * S / 2``, and the largest difference from the paged kernel's output
(bf16: a check that the row computes the same attention, not a bitwise one). A row that fails
to compile or run records its error. Writes ``prefill_attention.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SHAPES = {"mla": dict(Hq=16, Hkv=16, Dk=192, Dv=128), "nemotron": dict(Hq=32, Hkv=8, Dk=128, Dv=128)}
BS = 16


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--shapes", default="mla,nemotron")
    ap.add_argument("--calls", type=int, default=4, help="calls per executable (distinct inputs)")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from _trace import jax_device_us
    from pallas_kernels.paged_attention import paged_attention

    S, n = a.tokens, a.calls
    bf = jnp.bfloat16
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "tokens": S, "rows": []}

    def timed(fn, args):
        exe = jax.jit(fn).lower(*args).compile()
        outs = jax.block_until_ready(exe(*args))
        t0 = time.perf_counter()
        jax.block_until_ready(exe(*args))
        wall = (time.perf_counter() - t0) / n * 1e6
        dev = jax_device_us(lambda: exe(*args), 3, n)
        return outs[0], wall, dev

    for label in a.shapes.split(","):
        sh = SHAPES[label]
        Hq, Hkv, Dk, Dv = sh["Hq"], sh["Hkv"], sh["Dk"], sh["Dv"]
        flops = 2 * S * Hq * (Dk + Dv) * S / 2
        keys = jax.random.split(jax.random.key(7), 3 * n)
        qs = [jax.random.normal(keys[3 * i], (S, Hq, Dk), bf) for i in range(n)]
        ks = [jax.random.normal(keys[3 * i + 1], (S, Hkv, Dk), bf) for i in range(n)]
        vs = [jax.random.normal(keys[3 * i + 2], (S, Hkv, Dv), bf) for i in range(n)]
        # the paged layout: call i's blocks are 1 + i * W ... (block 0 is the null block)
        W = S // BS
        kc = jnp.concatenate([jnp.zeros((1, BS, Hkv, Dk), bf)] + [k.reshape(W, BS, Hkv, Dk) for k in ks])
        vc = jnp.concatenate([jnp.zeros((1, BS, Hkv, Dv), bf)] + [v.reshape(W, BS, Hkv, Dv) for v in vs])
        tables = [jnp.arange(1 + i * W, 1 + (i + 1) * W, dtype=jnp.int32)[None] for i in range(n)]
        seq = jnp.asarray([S], jnp.int32)
        pos = jnp.arange(S, dtype=jnp.int32)
        rows = jnp.zeros((S,), jnp.int32)

        def paged(kc, vc, qs, tables):
            return [paged_attention(q, kc, vc, t, seq, pos, rows, backend="pallas_gpu")
                    for q, t in zip(qs, tables)]

        variants = [("paged", paged, (kc, vc, qs, tables), False)]

        def dense(impl, pad, seqlens=False):
            def fn(qs, ks, vs):
                out = []
                kw = {"query_seq_lengths": seq, "key_value_seq_lengths": seq} if seqlens else {}
                for q, k, v in zip(qs, ks, vs):
                    if pad:
                        v = jnp.pad(v, ((0, 0), (0, 0), (0, Dk - Dv)))
                    o = jax.nn.dot_product_attention(q[None], k[None], v[None], is_causal=True,
                                                     implementation=impl, **kw)[0]
                    out.append(o[..., :Dv])
                return out
            return fn

        def cudnn_direct(seqlens):  # JAX's cuDNN entry point itself: values narrower than keys
            from jax._src.cudnn import fused_attention_stablehlo as fa

            def fn(qs, ks, vs):
                kw = ({"q_seqlen": seq, "kv_seqlen": seq, "mask_type": fa.MaskType.PADDING_CAUSAL}
                      if seqlens else {"mask_type": fa.MaskType.CAUSAL})
                return [fa.dot_product_attention(q[None], k[None], v[None], scale=Dk ** -0.5, **kw)[0]
                        for q, k, v in zip(qs, ks, vs)]
            return fn

        for impl in ("xla", "cudnn"):
            variants.append((impl, dense(impl, False), (qs, ks, vs), False))
            if Dk != Dv:
                variants.append((impl, dense(impl, True), (qs, ks, vs), True))
        pad = Dk != Dv
        variants.append(("cudnn+seqlens", dense("cudnn", pad, seqlens=True), (qs, ks, vs), pad))
        variants.append(("cudnn-direct", cudnn_direct(False), (qs, ks, vs), False))
        variants.append(("cudnn-direct+seqlens", cudnn_direct(True), (qs, ks, vs), False))

        try:
            from jax.experimental.pallas.ops.gpu import attention_mgpu as mg

            def mosaic(qs, ks, vs):
                cfg = mg.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2, causal=True)
                out = []
                for q, k, v in zip(qs, ks, vs):
                    q = (q * (1.0 / Dk ** 0.5)).astype(bf)  # the kernel applies no score scale
                    if Dk != Dv:
                        v = jnp.pad(v, ((0, 0), (0, 0), (0, Dk - Dv)))
                    out.append(mg.attention(q[None], k[None], v[None], cfg)[0][..., :Dv])
                return out
            variants.append(("mosaic", mosaic, (qs, ks, vs), Dk != Dv))
        except Exception as e:  # noqa: BLE001
            result["rows"].append(dict(shape=label, impl="mosaic", error=f"{type(e).__name__}: {e}"[:400]))

        want = None
        for impl, fn, args, padded in variants:
            row = dict(shape=label, impl=impl, v_padded=padded, Hq=Hq, Hkv=Hkv, Dk=Dk, Dv=Dv)
            try:
                got, wall, dev = timed(fn, args)
                us = dev.get("device_us_per_call") or wall
                row.update(wall_us=wall, device_us=dev.get("device_us_per_call"),
                           kernels_per_call=dev.get("kernels_per_call"), tflops=flops / us / 1e6)
                got = np.asarray(got, np.float32)
                if want is None:
                    want = got
                row["max_abs_diff_vs_paged"] = float(np.max(np.abs(got - want)))
            except Exception as e:  # noqa: BLE001 - an implementation that refuses the shape
                row["error"] = f"{type(e).__name__}: {e}"[:400]
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
        del kc, vc, qs, ks, vs
    with open(os.path.join(a.out, "prefill_attention.json"), "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
