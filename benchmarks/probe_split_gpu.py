"""Probe: DeepSeek's MLA split form against the absorbed form, compiled on a GPU, row by row.

    JAX_PLATFORMS=cuda JAX_DEFAULT_MATMUL_PRECISION=highest PYTHONPATH=. python benchmarks/probe_split_gpu.py

Runs tests/models/hf/test_deepseek_v3.py's hand-driven paged steps (chunked prefills, mixed and
decode steps, NaN-poisoned pools; its tiny float32 "lora" checkpoint) with
``backend="pallas_gpu"`` in both forms, with a model-dtype and an fp8 latent cache, and prints
each logits row's distance to the dense oracle on the tokens that run saw. On the CPU (the
kernels interpreted) both forms are within 2e-5 of it. Compiled on an H100 both are within
~0.02-0.08 (float noise, amplified by the MoE routing) but for one fp8 row of the split form, a
routing flip of a near tie (``probe_split_routing.py``;
``benchmarks/results/2026-11-28-h100-probe-split-*.log``).
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
    # Each run against the dense oracle on the tokens it saw itself (greedy feedback: a near-tie
    # can send the two runs down different streams, after which only this comparison is fair).
    for (seen, ga), (seen2, gs) in zip(a.records, s.records):
        want = t.dense(ma, ck.params, seen, kv)[-1]
        want2 = want if list(seen2) == list(seen) else t.dense(ms, ck.params, seen2, kv)[-1]
        top2 = np.sort(want)[-2:]
        print(f"{kv} len {len(seen):2d} same {list(seen2) == list(seen)!s:5} |abs-dense| "
              f"{np.abs(ga - want).max():.2e} |split-dense(own tokens)| {np.abs(gs - want2).max():.2e} "
              f"top-2 gap {top2[1] - top2[0]:.3f} max|logit| {np.abs(want).max():.1f}")
