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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernels", type=int, default=400)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
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
