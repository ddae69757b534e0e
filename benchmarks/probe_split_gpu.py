"""Probe: DeepSeek's MLA split form against the absorbed form, compiled on a GPU, row by row.

    JAX_PLATFORMS=cuda JAX_DEFAULT_MATMUL_PRECISION=highest PYTHONPATH=. python benchmarks/probe_split_gpu.py

Runs tests/models/hf/test_deepseek_v3.py's hand-driven paged steps (chunked prefills, mixed and
decode steps, NaN-poisoned pools; its tiny float32 "lora" checkpoint) with
``backend="pallas_gpu"`` in both forms, with a model-dtype and an fp8 latent cache, and prints
each logits row's distance to the dense oracle. On the CPU (the kernels interpreted) both forms
are within 2e-5 of it. Compiled on an H100 (2026-11-27,
``benchmarks/results/2026-11-27-h100-probe-split-gpu.log``) both are within ~0.02-0.05 with a
model-dtype cache (float noise, amplified by the MoE routing); with fp8, the split form's decode
rows of one request miss by 1.7-3.7 logits while the absorbed form stays within 0.05.
"""

import pathlib
import sys
import tempfile

import numpy as np

sys.path.insert(0, ".")
import tests.models.hf.test_deepseek_v3 as t  # noqa: E402


class F:
    def mktemp(self, n):
        return pathlib.Path(tempfile.mkdtemp(prefix=n))


ck = t._build(F(), 0, "lora", t.VARIANTS["lora"])
for kv in ("auto", "fp8"):
    ma, a = t.paged_run(ck, form="absorbed", kv_cache_dtype=kv, poisoned=True, fp8_scale=0.3, backend="pallas_gpu")
    ms, s = t.paged_run(ck, form="split", kv_cache_dtype=kv, poisoned=True, fp8_scale=0.3, backend="pallas_gpu")
    print(kv, "same token streams:", [x for x, _ in a.records] == [x for x, _ in s.records])
    for (seen, ga), (seen2, gs) in zip(a.records, s.records):
        want = t.dense(ma, ck.params, seen, kv)[-1]
        print(f"{kv} len {len(seen):2d} |abs-dense| {np.abs(ga - want).max():.2e} |split-dense| "
              f"{np.abs(gs - want).max():.2e} |split-abs| {np.abs(ga - gs).max():.2e} max|logit| {np.abs(want).max():.1f}")
