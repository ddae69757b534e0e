"""Probe: every paged_attention call of DeepSeek's split form on the GPU kernel against the jnp
reference on the same inputs (tests/models/hf/test_deepseek_v3.py's hand-driven steps, fp8).

    JAX_PLATFORMS=cuda JAX_DEFAULT_MATMUL_PRECISION=highest PYTHONPATH=. python benchmarks/probe_split_kernel.py
"""
import pathlib
import sys
import tempfile

import jax
import numpy as np

sys.path.insert(0, ".")
import tests.models.hf.test_deepseek_v3 as t  # noqa: E402
from kvjax.models.hf import mla  # noqa: E402

orig = mla.paged_attention_op
calls = {"n": 0}


def report(tag, got, ref, token_row, positions, seq_lens):
    out_g, lse_g = (got if isinstance(got, tuple) else (got, None))
    out_r, lse_r = (ref if isinstance(ref, tuple) else (ref, None))
    d = np.abs(np.asarray(out_g, np.float64) - np.asarray(out_r, np.float64)).reshape(out_g.shape[0], -1).max(-1)
    line = f"{tag} seq_lens {np.asarray(seq_lens).tolist()} out max|d| per token {np.round(d, 4).tolist()}"
    if lse_g is not None:
        dl = np.abs(np.nan_to_num(np.asarray(lse_g) - np.asarray(lse_r), nan=0.0, posinf=99, neginf=-99)).max(-1)
        line += f" lse max|d| {np.round(dl, 4).tolist()}"
    print(line, "rows", np.asarray(token_row).tolist(), "pos", np.asarray(positions).tolist(), flush=True)


def wrapped(*args, backend="reference", **kw):
    got = orig(*args, backend=backend, **kw)
    if backend != "reference":
        ref = orig(*args, backend="reference", **kw)
        calls["n"] += 1
        tag = "ctx " if args[2] is None else "self"
        jax.debug.callback(lambda g, r, tr, p, s, tag=tag: report(tag, g, r, tr, p, s), got, ref,
                           args[6], args[5], args[4])
    return got


mla.paged_attention_op = wrapped


class F:
    def mktemp(self, n):
        return pathlib.Path(tempfile.mkdtemp(prefix=n))


ck = t._build(F(), 0, "lora", t.VARIANTS["lora"])
for kv in ("fp8", "auto"):
    print("====", kv)
    ms, s = t.paged_run(ck, form="split", kv_cache_dtype=kv, poisoned=True, fp8_scale=0.3, backend="pallas_gpu")
    jax.effects_barrier()
    for seen, got in s.records:
        want = t.dense(ms, ck.params, seen, kv)[-1]
        print(f"{kv} len {len(seen):2d} |split-dense| {np.abs(got - want).max():.2e}")
