"""Does a CUDA-graph step pay its launch for buffers whose addresses change? (issue 24, item 6)

    PYTHONPATH=. python benchmarks/probe_graph_update.py --out DIR

A synthetic program of ``--kernels`` dependent kernels over a donated state (the shape of the
Runner's step: params, a donated state updated in place, a small input, a small output),
compiled with the Runner's GPU options (command buffers). Four variants: the small input a fresh
``device_put`` per call or the same array; a small fresh output or none (everything the program
returns aliases its donated state). Per variant: host time per call launched back to back, the
time per call, and the host time of one call from an idle device.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def factors(kernels: int, log) -> list[dict]:
    """Which parts of a real step make its CUDA graph's launch cost more host time than a
    synthetic graph's: the same number of kernels with, in turn, a conditional on a device
    value, a while loop, Pallas (Triton) custom calls, matrix products (XLA's Triton GEMMs),
    500 more arguments (read, and returned unchanged without donation), 95 donated arguments.
    Per variant: the host time of one call from an idle device, and per call launched back to
    back (the state carried)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    from kvjax.runner.runner import default_compiler_options

    opts = default_compiler_options()
    n = 1 << 14

    def pk(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 0.5 + 1.0

    def pallas_op(h):
        return pl.pallas_call(pk, out_shape=jax.ShapeDtypeStruct(h.shape, h.dtype))(h)

    def build(variant):
        extra = {"args500": 500, "donated95": 95}.get(variant, 0)

        def fn(state, x, many):
            h = state + x[0]
            w = x.astype(jnp.bfloat16)[:128 * 128].reshape(128, 128)
            for i in range(kernels):  # every fourth kernel the variant's own (pallas, dot)
                if variant == "pallas" and i % 4 == 0:
                    h = pallas_op(h)
                elif variant == "dot" and i % 4 == 0:
                    prod = (h[:2 * 128].reshape(2, 128).astype(jnp.bfloat16) @ w).astype(jnp.float32)
                    h = h + jnp.tile(prod.ravel(), n // 256)
                else:
                    h = jax.lax.optimization_barrier(jnp.sin(h) * 0.999)
            if variant == "cond":
                h = jax.lax.cond(h[0] > 1e9, lambda h: h * 2.0, lambda h: h + 1.0, h)
            if variant == "while":
                h = jax.lax.fori_loop(0, (x[1] > -1).astype(jnp.int32) * 8, lambda i, h: jnp.cos(h), h)
            if variant == "args500":
                h = h + sum(m[0] for m in many[:4])
            if variant == "donated95":
                many = [m + 1.0 for m in many]
            return h, many

        donate = (0, 2) if variant == "donated95" else (0,)
        many = [jnp.full((1024,), i, jnp.float32) for i in range(extra)]
        x = jnp.arange(128 * 128, dtype=jnp.float32) / 1e4
        state = jnp.zeros((n,), jnp.float32)
        exe = jax.jit(fn, donate_argnums=donate, compiler_options=opts).lower(state, x, many).compile()
        return exe, state, x, many

    rows = []
    for variant in ("plain", "cond", "while", "pallas", "dot", "args500", "donated95"):
        try:
            exe, state, x, many = build(variant)
        except Exception as e:  # noqa: BLE001
            log(f"{variant}: {type(e).__name__}: {str(e)[:300]}")
            continue
        for _ in range(3):
            state, many = exe(state, x, many)
        jax.block_until_ready(state)
        idle = []
        for _ in range(9):
            jax.block_until_ready((state, many))
            t0 = time.perf_counter()
            state, many = exe(state, x, many)
            idle.append((time.perf_counter() - t0) * 1e6)
        jax.block_until_ready((state, many))
        t0 = time.perf_counter()
        for _ in range(20):
            state, many = exe(state, x, many)
        t1 = time.perf_counter()
        jax.block_until_ready((state, many))
        t2 = time.perf_counter()
        row = {"variant": variant, "kernels": kernels, "idle_start_call_us": statistics.median(idle),
               "enqueue_us": (t1 - t0) / 20 * 1e6, "per_call_us": (t2 - t0) / 20 * 1e6}
        log(json.dumps(row))
        rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernels", type=int, default=400)
    ap.add_argument("--factors", action="store_true", help="what makes a graph's launch cost more (see factors())")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    if a.factors:
        rows = factors(a.kernels, lambda m: print(m, flush=True))
        with open(os.path.join(a.out, "probe_graph_factors.json"), "w") as f:
            json.dump({"rows": rows}, f, indent=1)
        return 0
    import jax
    import jax.numpy as jnp
    import numpy as np

    from kvjax.runner.runner import default_compiler_options

    opts = default_compiler_options()
    n = 1 << 16

    def body(state, x, fresh_out):
        h = state
        for i in range(a.kernels):
            h = jax.lax.optimization_barrier(jnp.sin(h) * 0.999 + x[i % x.shape[0]])
        return (h, h[:8] * 2) if fresh_out else (h,)

    rows = []
    for fresh_in in (True, False):
        for fresh_out in (True, False):
            fn = jax.jit(lambda s, x, fo=fresh_out: body(s, x, fo), donate_argnums=(0,),
                         compiler_options=opts)
            state = jnp.zeros((n,), jnp.float32)
            host_x = np.arange(16, dtype=np.float32)
            same_x = jax.device_put(host_x)
            exe = fn.lower(state, same_x).compile()

            def call(state):
                x = jax.device_put(host_x) if fresh_in else same_x
                return exe(state, x)

            for _ in range(5):
                state = call(state)[0]
            jax.block_until_ready(state)
            enq, per = [], []
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(20):
                    state = call(state)[0]
                t1 = time.perf_counter()
                jax.block_until_ready(state)
                t2 = time.perf_counter()
                enq.append((t1 - t0) / 20 * 1e6)
                per.append((t2 - t0) / 20 * 1e6)
            idle = []
            for _ in range(5):
                jax.block_until_ready(state)
                t0 = time.perf_counter()
                state = call(state)[0]
                idle.append((time.perf_counter() - t0) * 1e6)
            row = {"fresh_input": fresh_in, "fresh_output": fresh_out, "kernels": a.kernels,
                   "enqueue_us": statistics.median(enq), "per_call_us": statistics.median(per),
                   "idle_start_call_us": statistics.median(idle)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    with open(os.path.join(a.out, "probe_graph_update.json"), "w") as f:
        json.dump({"jax": jax.__version__, "device": str(jax.devices()[0]), "options": opts, "rows": rows}, f,
                  indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
