"""GPU check of the GQA mixer's dense attention for a step of one fresh prefill (cuDNN's flash
attention, :func:`kvjax.models.attention.dense_causal_attention`) against the paged kernel's
path, at Granite-4.0-H-Micro's and Nemotron-H-8B's attention shapes, bf16.

    PYTHONPATH=. python benchmarks/gpu_check_fresh_prefill.py

``attention_mixer`` compiled twice on the same step: as it chooses (``self_attention_impl``:
cuDNN for a bf16 model on a Hopper GPU) and with the choice forced to ``"paged"``. The outputs
agree within bf16 rounding (relative to the largest), pad tokens are finite, the KV caches
written are bitwise equal; the program as chosen holds a cuDNN call and the paged one none
(the conditional's dense branch compiled, not refused); a step with context takes the paged
path either way. Prints both mixers' device time for the 8k prefills.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

import kvjax.models.attention as attention
from kvjax import BlockTables, KVGroupSpec, RequestState, ScheduledBatch, build_step_batch
from kvjax.models.attention import AttnSpec, attention_mixer
from kvjax.models.step_context import make_step_context
from _gpu_check import case, on_gpu_or_allowed, run_cases, summary  # noqa: E402
from _trace import jax_device_us  # noqa: E402

BS = 16
BACKEND = "pallas_gpu"
SHAPES = {  # d_model, query heads, KV heads, head size, RoPE theta
    "granite": (2048, 32, 8, 64, None),
    "nemotron": (4096, 32, 8, 128, None),
}


def inputs(seed, shape, *, T, new, context, rows=1, row=0):
    """One request in ``row`` of ``rows`` (the others empty) scheduling ``new`` tokens after
    ``context`` cached ones, in a ``T``-token step."""
    d, Hq, Hkv, D, theta = SHAPES[shape]
    rng = np.random.default_rng(seed)
    max_len = -(-(new + context) // BS) * BS + BS
    nb = 2 + max_len // BS
    reqs = RequestState.create(rows, max_len).add_request(
        row, list(rng.integers(1, 1000, new + context)), num_computed_tokens=context)
    tables = BlockTables.create([KVGroupSpec.for_model_len(BS, max_len)], rows, num_cache_blocks=nb)
    tables = tables.append_block_ids(row, [list(range(1, 1 + -(-(new + context) // BS)))])
    idx = np.full((rows,), -1, np.int32)
    idx[row] = row
    sched = ScheduledBatch(idx_mapping=idx, num_scheduled_tokens=np.where(idx >= 0, new, 0).astype(np.int32),
                           num_draft_tokens=np.zeros((rows,), np.int32))
    batch = build_step_batch(reqs, tables, sched, num_tokens_padded=T, num_logits_padded=rows)
    ctx = make_step_context(batch, jnp.zeros((rows,), jnp.int32), None, kv_group=0)
    kc = jnp.asarray(rng.standard_normal((nb, BS, Hkv, D)), jnp.bfloat16)
    vc = jnp.asarray(rng.standard_normal((nb, BS, Hkv, D)), jnp.bfloat16)
    w = {n: jnp.asarray(rng.standard_normal(s) / np.sqrt(s[0]), jnp.bfloat16)
         for n, s in (("wq", (d, Hq * D)), ("wk", (d, Hkv * D)), ("wv", (d, Hkv * D)), ("wo", (Hq * D, d)))}
    h = jnp.asarray(rng.standard_normal((T, d)), jnp.float32)
    spec = AttnSpec(Hq, Hkv, D, rope_theta=theta)
    return (h, ctx, kc, vc, w, spec), np.asarray(batch.token_real)


def compiled(args, impl):
    """The mixer jitted for ``args``, the fresh-prefill choice as it is or forced ``"paged"``."""
    h, ctx, kc, vc, w, spec = args
    fn = jax.jit(lambda h, ctx, kc, vc, w: attention_mixer(h, ctx, kc, vc, w, spec, kv_cache_dtype="auto",
                                                           backend=BACKEND))
    real = attention.self_attention_impl
    if impl == "paged":
        attention.self_attention_impl = lambda backend, dtype: "paged"
    try:
        c = fn.lower(h, ctx, kc, vc, w).compile()
    finally:
        attention.self_attention_impl = real
    return (lambda: c(h, ctx, kc, vc, w)), "cudnn" in c.as_text().lower()


def compare(seed, shape, *, T, new, context, rows=1, row=0, timed=False):
    args, real = inputs(seed, shape, T=T, new=new, context=context, rows=rows, row=row)
    (fd, cudnn_d), (fp, cudnn_p) = compiled(args, "auto"), compiled(args, "paged")
    (od, kd, vd), (op, kp, vp) = jax.device_get(fd()), jax.device_get(fp())
    problems = []
    # the program as chosen holds cuDNN's attention (for its conditional's dense branch); the
    # paged one none: a fallback to the paged path (a shape cuDNN refused) would show here
    if not cudnn_d or cudnn_p:
        problems.append(f"cuDNN in the compiled programs: as chosen {cudnn_d}, paged {cudnn_p}")
    if not np.isfinite(od[real]).all():
        problems.append("non-finite output")
    err = float(np.abs(od[real] - op[real]).max() / np.abs(op[real]).max())
    print(f"  {shape} T={T} new={new} context={context}: max |auto - paged| / max |paged| = {err:.2e}",
          flush=True)
    if err > 2e-2:
        problems.append(f"relative difference {err:.2e} > 2e-2")
    if not (np.array_equal(np.asarray(kd, np.float32), np.asarray(kp, np.float32))
            and np.array_equal(np.asarray(vd, np.float32), np.asarray(vp, np.float32))):
        problems.append("the KV caches written differ")
    if timed:
        for name, f in (("cudnn", fd), ("paged", fp)):
            dev = jax_device_us(f, 3, 1)
            print(f"  {name}: {dev.get('device_us_per_call', 0):9.1f} us a call, "
                  f"{dev.get('kernels_per_call', 0):.0f} kernels", flush=True)
    return "; ".join(problems)


@case("self_attention_impl picks cuDNN for a bf16 model, the paged kernel for float32")
def _():
    got = (attention.self_attention_impl("pallas_gpu", jnp.bfloat16),
           attention.self_attention_impl("pallas_gpu", jnp.float32))
    return "" if got == ("cudnn", "paged") else f"got {got}"


@case("granite: one fresh row (row 2 of 4, the others empty), 900 tokens in a 1024-token step")
def _():
    return compare(1, "granite", T=1024, new=900, context=0, rows=4, row=2)


@case("nemotron: one row over 300 cached tokens: the paged path")
def _():
    return compare(2, "nemotron", T=256, new=200, context=300)


@case("granite: one fresh row of 8192 tokens (timed)")
def _():
    return compare(3, "granite", T=8192, new=8192, context=0, timed=True)


@case("nemotron: one fresh row of 8192 tokens in a 4-row step (timed)")
def _():
    return compare(4, "nemotron", T=8192, new=8192, context=0, rows=4, row=0, timed=True)


if __name__ == "__main__":
    if not on_gpu_or_allowed("the GQA mixer's cuDNN attention for a fresh prefill"):
        sys.exit(1)
    run_cases()
    sys.exit(summary())
