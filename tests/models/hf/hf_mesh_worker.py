"""Mesh cases of the hybrid HF models, run in a fresh process (XLA_FLAGS before JAX starts).

Usage: ``python hf_mesh_worker.py CKPT_DIR D M KV_CACHE_DTYPE [...]`` (groups of four). Per case:
the checkpoint is loaded onto the ``D x M`` mesh (each tensor placed as read) and must equal,
leaf by leaf and sharding by sharding, the Runner's own placement of the unsharded params;
then the Runner serves four requests with NaN-poisoned pools and the sanitizer, and every
logits row is checked against ``dense_logits``. Prints one JSON line per case.
"""

from __future__ import annotations

import json
import os
import sys

from kvjax.testing.fast_compile import FAST_COMPILER_OPTIONS, with_fast_xla_flags

# 4 host devices, and every compile (the dense oracle's too, not only the Runner's) at
# kvjax.testing.fast_compile's settings. Read when JAX creates its CPU client, after this.
os.environ["XLA_FLAGS"] = with_fast_xla_flags("--xla_force_host_platform_device_count=4")
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402

from kvjax.cli.demo import serve  # noqa: E402
from kvjax.host.scheduler import Request  # noqa: E402
from kvjax.models import load_pretrained  # noqa: E402
from kvjax.runner.mesh import make_mesh  # noqa: E402
from kvjax.runner.runner import Runner, RunnerConfig  # noqa: E402


def case(path: str, D: int, M: int, kv_cache_dtype: str) -> dict:
    mesh = make_mesh(D, M)
    model, placed = load_pretrained(path, mesh=mesh)
    _, dense = load_pretrained(path)
    cfg = RunnerConfig(model=model, block_size=4, num_blocks=32, max_model_len=32, max_num_seqs=3,
                       max_num_batched_tokens=8, token_sizes=(8,), backend="reference", poison=True,
                       kv_cache_dtype=kv_cache_dtype)
    runner = Runner(cfg, mesh=mesh, params=dense, compiler_options=FAST_COMPILER_OPTIONS)
    same_placement = all(
        a.sharding == b.sharding and np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(jax.tree.leaves(placed), jax.tree.leaves(runner.params), strict=True))
    rng = np.random.default_rng(1)
    reqs = [Request(f"r{i}", [int(t) for t in rng.integers(0, model.vocab_size, n)], 5, arrival_step=i)
            for i, n in enumerate((11, 5, 7, 9))]
    report, _ = serve(cfg, reqs, runner=runner, compile_workers=1, progress_stream=None)
    return {"case": f"{os.path.basename(path)} {D}x{M} {kv_cache_dtype}", "ok": report.ok,
            "same_placement": same_placement, "requests": report.requests}


if __name__ == "__main__":
    args = sys.argv[1:]
    for i in range(0, len(args), 4):
        p, d, m, kv = args[i:i + 4]
        print(json.dumps(case(p, int(d), int(m), kv)), flush=True)
