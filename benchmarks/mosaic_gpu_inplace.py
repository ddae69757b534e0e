"""Smallest reproduction: can a Mosaic GPU Pallas kernel update a donated buffer in place?

    PYTHONPATH=. python3 benchmarks/mosaic_gpu_inplace.py [--json OUT]

The op is the KV write reduced to its core: copy an ``[8, 128]`` bf16 tile into rows
``8 .. 15`` of a ``[64, 128]`` cache, leaving every other row as it was. Three routes:

* ``pallas_call``: ``pl.pallas_call`` with Mosaic GPU compiler params and
  ``input_output_aliases`` (the route the Triton kernels use);
* ``plgpu.kernel``: the Mosaic GPU entry point; it has no ``input_output_aliases``, so the
  cache is passed as an input and a new output is returned (donated: is it the same
  buffer?);
* ``ref``: the cache as a mutable ``jax.new_ref`` passed to ``plgpu.kernel`` (the kernel
  writes the Ref; the jitted function returns its value, cache donated).

Each route reports ok / the exact exception, whether the result is right, and whether the
output buffer is the donated input buffer.
"""

from __future__ import annotations

import argparse
import json
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

ROWS, W, TILE, AT = 64, 128, 8, 8


def inputs():
    cache = jnp.asarray(np.arange(ROWS * W, dtype=np.float32).reshape(ROWS, W), jnp.bfloat16)
    x = jnp.full((TILE, W), -1.0, jnp.bfloat16)
    want = np.asarray(cache).copy()
    want[AT:AT + TILE] = -1.0
    return cache, x, want


def copy_body(x_gmem, cache_gmem, smem, barrier):
    # GMEM tile -> SMEM (TMA, completes on the barrier) -> GMEM rows AT .. AT + TILE - 1.
    plgpu.copy_gmem_to_smem(x_gmem, smem, barrier)
    plgpu.barrier_wait(barrier)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(smem, cache_gmem.at[pl.ds(AT, TILE)])
    plgpu.wait_smem_to_gmem(0)


def route_pallas_call(cache, x):
    def kernel(x_ref, cache_in, cache_out, smem, barrier):
        del cache_in
        copy_body(x_ref, cache_out, smem, barrier)

    any_spec = pl.BlockSpec(memory_space=plgpu.GMEM)
    f = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(cache.shape, cache.dtype),
        in_specs=[any_spec, any_spec],
        out_specs=any_spec,
        scratch_shapes=[plgpu.SMEM((TILE, W), jnp.bfloat16), plgpu.Barrier(num_arrivals=1)],
        input_output_aliases={1: 0},
        compiler_params=plgpu.CompilerParams(),
    )
    return jax.jit(lambda c, x: f(x, c), donate_argnums=0)


def route_kernel(cache, x):
    def body(x_ref, cache_in, cache_out, smem, barrier):
        # without aliasing the output starts uninitialised: copy the whole cache first
        plgpu.copy_gmem_to_smem(x_ref, smem, barrier)
        plgpu.barrier_wait(barrier)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(smem, cache_out.at[pl.ds(AT, TILE)])
        plgpu.wait_smem_to_gmem(0)
        del cache_in

    f = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct(cache.shape, cache.dtype),
        scratch_types=[plgpu.SMEM((TILE, W), jnp.bfloat16), plgpu.Barrier(num_arrivals=1)])
    return jax.jit(lambda c, x: f(x, c), donate_argnums=0)


def route_ref(cache, x):
    def body(x_ref, cache_ref, smem, barrier):
        copy_body(x_ref, cache_ref, smem, barrier)

    f = plgpu.kernel(
        body, out_type=(),
        scratch_types=[plgpu.SMEM((TILE, W), jnp.bfloat16), plgpu.Barrier(num_arrivals=1)])

    def step(c, x):
        r = jax.new_ref(c)
        f(x, r)
        return r[...]

    return jax.jit(step, donate_argnums=0)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    out = {"jax": jax.__version__, "device": str(jax.devices()[0]), "routes": {}}
    for name, make in (("pallas_call", route_pallas_call), ("plgpu.kernel", route_kernel),
                       ("ref", route_ref)):
        cache, x, want = inputs()
        res = {}
        try:
            ptr = cache.unsafe_buffer_pointer()
            got = make(cache, x)(cache, x)
            got.block_until_ready()
            g = np.asarray(got.astype(jnp.float32))
            res["ok"] = True
            res["written_right"] = bool((g[AT:AT + TILE] == -1.0).all())
            res["rest_untouched"] = bool((g[:AT] == want[:AT].astype(np.float32)).all()
                                         and (g[AT + TILE:] == want[AT + TILE:].astype(np.float32)).all())
            res["same_buffer_as_donated_input"] = got.unsafe_buffer_pointer() == ptr
        except Exception as e:  # noqa: BLE001
            res["ok"] = False
            res["error"] = f"{type(e).__name__}: {e}"[:3000]
            res["traceback_tail"] = traceback.format_exc()[-2500:]
        out["routes"][name] = res
        print(name, json.dumps({k: v for k, v in res.items() if k != "traceback_tail"})[:1500], flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
