"""GPU check of ``moe_route``'s Pallas Triton kernel against its reference (same GPU).

    PYTHONPATH=. python benchmarks/gpu_check_moe_route.py [--timings]

At DeepSeek-V2-Lite's router (2048 x 64, top-6; float32 hidden states and, as DeepSeek-V3's
block hands them, bf16 ones; a bf16 router, as in the model), DeepSeek-V3's (7168 x 256, 8 groups, top-4 groups, top-8), Nemotron-H's and a
softmax router, for 1 to 256 tokens through the kernel (``gpu_max_tokens`` 256 here) and
several splits, and 8,192 tokens (the GPU flavour's fallback to the reference): the chosen
experts equal the reference's, or (a tie to float32 rounding) have the same choice values
(from float64 sums of the exact products) within ``TIE``; the weights of the tokens that chose alike within 2e-6 of the reference's
(times the scale); nothing non-finite. ``--timings``: then each path's device time at 1 to 256
tokens (informational, ~2 minutes of profiler traces; ``run_gpu.sh`` leaves them out: its
checks share the GPU).
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.moe_route import MoERouteConfig, moe_route
from _gpu_check import case, on_gpu_or_allowed, run_cases, summary  # noqa: E402
from _trace import jax_device_us  # noqa: E402

#: Relative gap between two candidates under which the order may differ (float32 sums in
#: another order, Triton's exponential).
TIE = 1e-5

ROUTERS = {
    "v2-lite": dict(d=2048, E=64, rule=dict(top_k=6, scoring="sigmoid", scale=1.0), bias=True),
    "v3": dict(d=7168, E=256, rule=dict(top_k=8, scoring="sigmoid", n_group=8, topk_group=4,
                                        scale=2.5), bias=True),
    "nemotron": dict(d=2688, E=128, rule=dict(top_k=6, scoring="sigmoid", renormalize=True, scale=2.5),
                     bias=True),
    "softmax": dict(d=1536, E=40, rule=dict(top_k=8, scoring="softmax"), bias=False),
}


def inputs(name, T, seed=0, x_dtype=jnp.float32):
    r = ROUTERS[name]
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((T, r["d"])), x_dtype)
    w = jnp.asarray(rng.standard_normal((r["d"], r["E"])) / np.sqrt(r["d"]), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal(r["E"]) * 0.05, jnp.float32) if r["bias"] else None
    return x, w, b


def compare(name, T, split=None, x_dtype=jnp.float32):
    r = ROUTERS[name]
    x, w, b = inputs(name, T, x_dtype=x_dtype)
    ref = jax.jit(lambda x, w, b: moe_route(x, w, b, backend="reference", **r["rule"]))
    gpu = jax.jit(lambda x, w, b: moe_route(x, w, b, backend="pallas_gpu",
                                            config=MoERouteConfig(gpu_split=split, gpu_max_tokens=256),
                                            **r["rule"]))
    i0, w0 = (np.asarray(a) for a in ref(x, w, b))
    i1, w1 = (np.asarray(a) for a in gpu(x, w, b))
    problems = []
    if not np.isfinite(w1).all():
        problems.append("non-finite weight")
    # a token may choose otherwise only where the two choices are equally good to float32
    # rounding: the chosen experts' choice values (the scores plus the bias, or the logits)
    logits = (np.asarray(x.astype(jnp.float32), np.float64)
              @ np.asarray(w.astype(jnp.float32), np.float64))  # exact products, float64 sums
    value = logits
    if r["rule"]["scoring"] == "sigmoid":
        value = 1 / (1 + np.exp(-logits)) + (0 if b is None else np.asarray(b))[None, :]
    v0 = np.take_along_axis(value, i0, axis=1)
    v1 = np.take_along_axis(value, i1, axis=1)
    differ = (i0 != i1).any(axis=1)
    tie = np.abs(v0 - v1).max(axis=1) <= TIE * np.abs(value).max(axis=1)
    if (differ & ~tie).any():
        t = int(np.argmax(differ & ~tie))
        problems.append(f"{int((differ & ~tie).sum())} tokens chose other experts, e.g. token {t}: "
                        f"{i0[t].tolist()} against {i1[t].tolist()}")
    same = ~differ
    err = float(np.abs(w0[same] - w1[same]).max()) if same.any() else 0.0
    if err > 2e-6 * max(1.0, float(r["rule"].get("scale", 1.0))):
        problems.append(f"weights off by {err:.2e}")
    print(f"  {name} T={T} split={split} x {jnp.dtype(x_dtype).name}: {int(differ.sum())} tokens chose otherwise (ties: "
          f"{int((differ & tie).sum())}), max weight error {err:.2e}", flush=True)
    return "; ".join(problems)


for _name in ROUTERS:
    for _T in (1, 16, 64):
        case(f"{_name} T={_T}")(lambda n=_name, T=_T: compare(n, T))
for _T, _split in ((1, 1), (1, 4), (2, 16), (16, 1), (256, None), (8192, None)):
    case(f"v2-lite T={_T} split={_split}")(lambda T=_T, s=_split: compare("v2-lite", T, s))
case("v3 T=1 split=1")(lambda: compare("v3", 1, 1))
# a bf16 model's router reads the MLP input rounded to bf16 (DeepSeek-V3's block): the kernel,
# and past gpu_max_tokens the reference's tensor-core product of two bf16 operands
for _name, _T in (("v2-lite", 1), ("v2-lite", 256), ("v2-lite", 8192), ("v3", 8192)):
    case(f"{_name} T={_T} x bfloat16")(lambda n=_name, T=_T: compare(n, T, x_dtype=jnp.bfloat16))


def timings():
    for name in ("v2-lite",):
        for T in (1, 2, 4, 8, 16, 64, 256):
            x, w, b = inputs(name, T)
            r = ROUTERS[name]["rule"]
            for label, kw in (("reference", dict(backend="reference")),
                              ("pallas_gpu", dict(backend="pallas_gpu",
                                                  config=MoERouteConfig(gpu_max_tokens=256)))):
                f = jax.jit(lambda x, w, b, kw=kw: moe_route(x, w, b, **kw, **r))
                got = jax_device_us(lambda: f(x, w, b), 20, 1)
                print(f"  time {name} T={T} {label}: {got}", flush=True)


if __name__ == "__main__":
    if not on_gpu_or_allowed("moe_route's Pallas Triton kernel"):
        sys.exit(1)
    run_cases()
    status = summary()
    if "--timings" in sys.argv[1:]:
        try:
            timings()
        except Exception as e:  # noqa: BLE001 - timings are informational
            print(f"timings failed: {e!r}")
    sys.exit(status)
