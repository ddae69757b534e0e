"""bf16 MoE models against the dense reference: the differences a routing near-tie explains.

A router chooses each token's experts on float32 scores computed from the token's hidden
state. In a bf16 model the served step and the dense reference round that hidden state
differently (products in another order, another attention kernel), which moves a choice score
by about 1e-3, so two experts whose scores are closer than that can be chosen differently on the
two sides. Such a flip is not small: the token's MoE output changes by a whole expert. On the
demo's tiny DeepSeek-V3 (bf16, on an H200) one position of one request was 0.73 logits off with
its tokens identical; its 2nd and 3rd experts were 0.0012 apart in the reference, and the
reference with the two swapped there gave the served logits (BENCHMARKS.md, H200 note 60). No
fixed logits tolerance tells that apart from a bug.

So a row that misses the reference is compared with references whose routing choice is nudged:
one router's choice bias (the leaf ``e_bias`` or ``bias`` beside a ``router`` leaf: the sigmoid
routers of DeepSeek-V3 and Nemotron-H, whose gate weights come from the unbiased scores) with one
expert's entry moved by ``+-NUDGE``, one variant at a time. A nudge changes which experts are
chosen, and only for tokens where that expert is within ``NUDGE`` of the choice boundary; it
changes no gate weight and no other computation. A row matches when it is within the bf16
tolerance of such a variant, with the same token. A wrong expert chosen away from a tie, or wrong
gate weights, match none of them. Routers without a choice bias (softmax routing, Granite) have
no variants here.

What this can hide: a served-side router error that shows only at near-ties, up to about
``NUDGE`` by design, and in one request sometimes a few times more (on the test's tiny
DeepSeek-V3, a bias off by 0.05 at one expert passed 5 of the 47 requests it changed, by 0.01
8 of 10; off by 0.3, neither of the test's two requests): a run of several requests catches such
a bug, one request may not.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np

#: How far one expert's choice score is moved in a variant: about 4x the near-tie of H200 note 60
#: (0.0012), below the margin of every other generated row of that run (0.0065 and up).
NUDGE = 5e-3

#: The most variants one request tries (two per expert, router by router from the first), so a
#: real-size model that misses its reference does not run thousands of dense forwards. A flip in
#: a router past the cap is not reached: the row stays a miss (never a false match).
MAX_VARIANTS = 256


def router_biases(params) -> list[tuple]:
    """Key paths, in ``params``, of the routers' choice biases: a 1-D leaf keyed ``e_bias`` or
    ``bias`` in a mapping that also holds a ``router`` leaf whose last axis is as long."""
    found = []

    def walk(node, path):
        if isinstance(node, Mapping):
            router = node.get("router")
            for name in ("e_bias", "bias"):
                b = node.get(name)
                if (router is not None and b is not None and np.ndim(router) >= 1 and np.ndim(b) == 1
                        and np.shape(b)[0] == np.shape(router)[-1]):
                    found.append(path + (name,))
            for k, v in node.items():
                walk(v, path + (k,))
        elif isinstance(node, (list, tuple)):
            for i, v in enumerate(node):
                walk(v, path + (i,))

    walk(params, ())
    return found


def _get(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def _replaced(tree, path, value):
    """``tree`` with the leaf at ``path`` replaced (the containers on the way copied)."""
    if not path:
        return value
    k, rest = path[0], path[1:]
    if isinstance(tree, Mapping):
        out = dict(tree)
        out[k] = _replaced(tree[k], rest, value)
        return out
    out = list(tree)
    out[k] = _replaced(tree[k], rest, value)
    return type(tree)(out) if isinstance(tree, tuple) else out


class RoutingVariants:
    """``variants(tokens)``: the dense reference's logits on ``tokens`` with one router's choice
    bias nudged at one expert (``+NUDGE`` then ``-NUDGE``, expert by expert, router by router;
    lazily, at most :data:`MAX_VARIANTS`: stop iterating once every row is explained).

    ``model``, ``params``: the model and its unsharded params (``Runner.dense_device_params``: the
    reference's device copy, which ``jax.device_put`` leaves as it is);
    ``kv_cache_dtype``, ``matmul_precision``: as the runner's reference. One compile per token
    length; the nudges are an argument. ``len(variants)``: how many a call yields (0: the model
    has no router with a choice bias).
    """

    def __init__(self, model, params, kv_cache_dtype: str = "auto", matmul_precision: str = "highest"):
        if params is None:
            raise ValueError("the dense reference needs unsharded params: this runner was given params "
                             "already placed on its mesh (load them with mesh=None to check parity)")
        self.paths = router_biases(params)
        self._sizes = [int(np.shape(_get(params, p))[0]) for p in self.paths]
        # on the device once, not per variant; not at all for a model without variants
        self.params, self.precision = (jax.device_put(params) if self.paths else params), matmul_precision
        paths = self.paths

        def forward(p, deltas, toks):
            for path, d in zip(paths, deltas):  # the bias in float32, as the router adds it
                p = _replaced(p, path, _get(p, path).astype(jnp.float32) + d)
            return model.dense_logits(p, toks, kv_cache_dtype=kv_cache_dtype)

        self._fn = jax.jit(forward)

    def __len__(self) -> int:
        return min(MAX_VARIANTS, 2 * sum(self._sizes))

    def __call__(self, tokens) -> Iterator[np.ndarray]:
        tokens = jnp.asarray(tokens, jnp.int32)
        zeros = [jnp.zeros((n,), jnp.float32) for n in self._sizes]
        nudges = [(i, e, sign * NUDGE) for i, n in enumerate(self._sizes) for e in range(n) for sign in (1, -1)]
        for i, e, delta in nudges[:MAX_VARIANTS]:
            deltas = tuple(z.at[e].set(delta) if j == i else z for j, z in enumerate(zeros))
            with jax.default_matmul_precision(self.precision):
                yield np.asarray(self._fn(self.params, deltas, tokens))
