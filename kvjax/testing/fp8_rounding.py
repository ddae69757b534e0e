"""fp8 KV caches against the dense reference: the differences an fp8 rounding flip explains.

Both sides round K/V the same way (``float8(saturate(x / scale)) * scale``), but they compute
the ``x`` being rounded with float32 operations in a different order (batched and paged vs one
unpaged sequence), so ``x`` differs by a few float32 ulps. An element within those ulps of an
fp8 rounding boundary is then stored one fp8 step apart on the two sides: 1/16 to 1/8 of its
value, far more than float32 noise. Measured on the demo's tiny model (one element's fp8 step
times the logits' Jacobian with respect to it): such a flip moves logits by 3e-3 (median) and up
to 0.1 (one K or V element of 5,120, 40 tokens). No fixed logits tolerance tells that apart from
a bug, and a flip moves the logit gap of a near tie, so a flipped greedy token is possible too.

So the check compares with references that round K/V identically to the cache up to those
float32 ulps: the dense reference run with every float weight scaled by ``1 + e`` for
``e`` in :data:`NUDGES` (``±2^-23 .. ±2^-19``, i.e. 1 to 16 float32 ulps). Scaling the weights
scales each K/V value before its rounding by about ``(1 + e)^2``, so every element within
``~2|e|`` of a rounding boundary rounds the other way, exactly as a few ulps of summation
order do, while everything else moves by only ``O(e)`` (logits by <= ~2e-5 at ``2^-19``, five
times inside the float32 tolerance). A paged logits row matches when it is within the
float32 tolerance of the reference or of one of these variants, with the same token: the
remaining differences are float32 summation order only. A wrong block's K/V, a wrong scale or
an element one fp8 step off away from a rounding boundary match none of them.

Measured on 200 seeded demo workloads (``--kv-cache-dtype fp8``, 1,600 requests): 17 requests
were more than 1e-4 from the reference (two more than the old fixed 2e-3: 4.8e-3 and 3.2e-3);
each one was within 7e-6 of one variant.
"""

from __future__ import annotations

from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np

#: Relative weight scalings of the variants, in the order they are tried (smallest first).
NUDGES: tuple[float, ...] = tuple(s * 2.0 ** -k for k in (23, 22, 21, 20, 19) for s in (1, -1))


def scale_float_leaves(params, factor):
    """``params`` with every floating-point leaf multiplied by ``factor`` (in its own dtype)."""
    return jax.tree.map(
        lambda a: a * jnp.asarray(factor, a.dtype) if jnp.issubdtype(jnp.asarray(a).dtype, jnp.floating) else a,
        params)


class RoundingVariants:
    """``variants(tokens)``: the dense reference's logits on ``tokens``, then the same with every
    weight scaled by ``1 + e`` for each ``e`` in :data:`NUDGES`, one array at a time (lazily: stop
    iterating once every row is explained).

    ``model``, ``params``: the model and its unsharded params (``Runner.dense_device_params``: the
    reference's device copy, read as it is);
    ``kv_cache_dtype``: the fp8 cache dtype; ``matmul_precision``: as the runner's reference.
    One compile per token length; the factor is an argument.
    """

    def __init__(self, model, params, kv_cache_dtype: str, matmul_precision: str = "highest"):
        if params is None:
            raise ValueError("the dense reference needs unsharded params: this runner was given params "
                             "already placed on its mesh (load them with mesh=None to check parity)")
        self.params, self.precision = params, matmul_precision
        self._fn = jax.jit(lambda p, f, toks: model.dense_logits(
            scale_float_leaves(p, f), toks, kv_cache_dtype=kv_cache_dtype))

    def __call__(self, tokens) -> Iterator[np.ndarray]:
        tokens = jnp.asarray(tokens, jnp.int32)
        for e in (0.0,) + NUDGES:
            with jax.default_matmul_precision(self.precision):
                yield np.asarray(self._fn(self.params, jnp.float32(1.0 + e), tokens))
