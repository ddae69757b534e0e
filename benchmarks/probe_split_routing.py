"""Probe: the experts DeepSeek's router picks for each record of tests/models/hf/test_deepseek_v3.py's
hand-driven paged steps (split and absorbed forms, fp8 latent cache) against those the dense oracle
picks for the same token, compiled on the GPU; with the margin between the k-th and (k+1)-th
biased score. A row whose experts differ is a routing flip of a near tie, not an attention error.

    JAX_PLATFORMS=cuda,cpu JAX_DEFAULT_MATMUL_PRECISION=highest PYTHONPATH=. python benchmarks/probe_split_routing.py
"""
import pathlib
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, ".")
import tests.models.hf.test_deepseek_v3 as t  # noqa: E402
from kvjax.models.hf import deepseek_v3 as ds  # noqa: E402

orig = ds.route
LOG = []


def patched(h, mp, c):
    idx, w = orig(h, mp, c)
    k = c.num_experts_per_tok
    biased = jax.nn.sigmoid(jnp.matmul(h.astype(jnp.float32), mp["router"].astype(jnp.float32))) \
        + mp["bias"].astype(jnp.float32)[None, :]
    v = jax.lax.top_k(biased, k + 1)[0]
    jax.debug.callback(lambda i, m: LOG.append((np.sort(np.asarray(i), -1), np.asarray(m))), idx, v[:, -2] - v[:, -1])
    return idx, w


ds.route = patched


class F:
    def mktemp(self, n):
        return pathlib.Path(tempfile.mkdtemp(prefix=n))


ck = t._build(F(), 0, "lora", t.VARIANTS["lora"])
for form in ("split", "absorbed"):
    # which token of which step each record is: replay the driver, logging per step
    model = ds.DeepseekV3(ck.config, attention_form=form, fp8_scale=0.3)
    drv = t.Driver(model, ck.params, "fp8", True, "pallas_gpu")
    per_step = []
    for sched in t.SCHEDULE:
        LOG.clear()
        n0 = len(drv.records)
        drv.step(sched)
        jax.effects_barrier()
        per_step.append((n0, len(drv.records), list(LOG)))
    for n0, n1, log in per_step:
        for rec in range(n0, n1):
            seen, got = drv.records[rec]
            LOG.clear()
            want = t.dense(model, ck.params, seen, "fp8")[-1]
            jax.effects_barrier()
            pos = len(seen) - 1
            dense_idx = [a[pos].tolist() for a, _ in LOG]
            margins = [f"{m[pos]:.1e}" for _, m in LOG]
            # the paged step's token for this record: the one whose experts we compare is found by
            # matching the record's last position among the step's logged tokens is not possible
            # without the batch; print every token's experts of the step for the reader instead
            print(f"{form} len {len(seen):2d} |paged-dense| {np.abs(got - want).max():.2e} dense experts "
                  f"{dense_idx} margins {margins}")
        print(f"{form} step experts per layer (token 0..3): {[a[:4].tolist() for a, _ in log]}")
