"""GPU check of the MLA split form's dense self-attention (cuDNN's flash attention for a step of
one fresh prefill) against the paged kernel's path, at DeepSeek-V2-Lite's head shapes.

    PYTHONPATH=. python benchmarks/gpu_check_mla_split.py

``split_latent_attention(self_attention="cudnn")`` and ``(self_attention="paged")`` (the paged
Pallas kernel, compiled) on bf16 products: the same attention within bf16 rounding (relative
to the largest output), pad tokens exactly 0, nothing non-finite; with context both run the
paged path; ``self_attention_impl`` picks cuDNN for a bf16 model here.
Prints each path's device time at the largest size.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.models.attention import self_attention_impl
from kvjax.models.hf.mla import split_latent_attention
from _gpu_check import case, on_gpu_or_allowed, run_cases, summary  # noqa: E402
from _trace import jax_device_us  # noqa: E402

H, r, pe, nope, v, BS = 16, 512, 64, 128, 128, 16


def inputs(seed, *, T, new, context, rows=1, row=0):
    """A step of ``rows`` rows in which row ``row`` has ``new`` tokens over ``context`` cached
    ones and the others schedule nothing."""
    rng = np.random.default_rng(seed)
    W = (T + context) // BS + 2
    cache = np.full((1 + W, BS, r + pe), np.nan, np.float32)
    table = np.repeat((1 + np.arange(W, dtype=np.int32))[None], rows, axis=0)
    for j in range(context):
        cache[table[0, j // BS], j % BS] = rng.standard_normal(r + pe)
    lat = np.zeros((T, r + pe), np.float32)
    lat[:new] = rng.standard_normal((new, r + pe))
    token_row = np.where(np.arange(T) < new, row, rows).astype(np.int32)
    positions = np.where(np.arange(T) < new, context + np.arange(T), 0).astype(np.int32)
    query_len = np.zeros((rows,), np.int32)
    query_len[row] = new
    qsl = np.concatenate([[0], np.cumsum(query_len)]).astype(np.int32)
    seq_lens = query_len + np.where(np.arange(rows) == row, context, 0).astype(np.int32)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    args = (f(T, H, nope), f(T, H, pe), jnp.asarray(lat), jnp.asarray(cache, jnp.bfloat16),
            (f(H, r, nope) / 8).astype(jnp.bfloat16), (f(H, v, r) / 8).astype(jnp.bfloat16),
            jnp.asarray(table), jnp.asarray(seq_lens), jnp.asarray(qsl), jnp.asarray(query_len),
            jnp.asarray(positions), jnp.asarray(token_row))
    return args, token_row == row


def call(impl):
    return jax.jit(lambda *a: split_latent_attention(*a, softmax_scale=0.07, backend="pallas_gpu",
                                                     self_attention=impl))


def compare(seed, *, T, new, context, timed=False, rows=1, row=0):
    args, real = inputs(seed, T=T, new=new, context=context, rows=rows, row=row)
    fd, fp = call("cudnn"), call("paged")
    dense, paged = np.asarray(fd(*args)), np.asarray(fp(*args))
    problems = []
    # the "cudnn" program holds cuDNN's attention (the switch's dense branch), the paged one
    # none: a fallback to the paged path (a shape cuDNN refused) would show here
    has = [("cudnn" in f.lower(*args).compile().as_text().lower()) for f in (fd, fp)]
    if has != [True, False]:
        problems.append(f"cuDNN in the compiled programs (cudnn, paged): {has}")
    if not np.isfinite(dense).all():
        problems.append("non-finite output")
    if (dense[~real] != 0).any():
        problems.append("a pad token's output is not 0")
    # (with context both take the paged path, the "cudnn" one inside a conditional: equal up to
    # XLA's fusion of that branch; a dense attention that ignored the context would be O(1) off)
    err = float(np.abs(dense - paged).max() / np.abs(paged).max())
    print(f"  T={T} new={new} context={context}: max |cudnn - paged| / max |paged| = {err:.2e}", flush=True)
    if err > 2e-2:
        problems.append(f"relative difference {err:.2e} > 2e-2")
    if timed:
        for name, f in (("cudnn", fd), ("paged", fp)):
            dev = jax_device_us(lambda f=f: f(*args), 3, 1)
            print(f"  {name}: {dev.get('device_us_per_call', 0):9.1f} us a call, "
                  f"{dev.get('kernels_per_call', 0):.0f} kernels", flush=True)
    return "; ".join(problems)


@case("self_attention_impl picks cuDNN for a bf16 model, the paged kernel for float32")
def _():
    got = (self_attention_impl("pallas_gpu", jnp.bfloat16), self_attention_impl("pallas_gpu", jnp.float32))
    return "" if got == ("cudnn", "paged") else f"got {got}"


@case("one fresh row (row 2 of 4, the others empty), 900 tokens in a 1024-token step")
def _():
    return compare(4, T=1024, new=900, context=0, rows=4, row=2)


@case("one fresh row, 1000 tokens in a 1024-token step (pad tokens after)")
def _():
    return compare(1, T=1024, new=1000, context=0)


@case("one row over 300 cached tokens: the paged path")
def _():
    return compare(2, T=256, new=200, context=300)


@case("one fresh row of 8192 tokens (timed)")
def _():
    return compare(3, T=8192, new=8192, context=0, timed=True)


if __name__ == "__main__":
    if not on_gpu_or_allowed("the MLA split form's cuDNN self-attention"):
        sys.exit(1)
    run_cases()
    sys.exit(summary())
