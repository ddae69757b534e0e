"""Sampling on the device, with draft verification: only token ids need to leave the step.

Each logits row predicts the token at one position ``p`` of one request. Its
sampling parameters are the request row's (:class:`~kvjax.state.RequestState`:
``temperature``, ``top_k``, ``top_p``, ``seed``):

* ``temperature == 0``: greedy (``argmax``);
* else the logits are divided by the temperature, restricted to the ``top_k``
  largest (0: all) and to the smallest set of largest whose probability reaches
  ``top_p`` (1: all), and the token is ``argmax(scaled + gumbel)`` with the
  Gumbel noise drawn from ``fold_in(key(seed), p)``.

The noise depends only on the request's seed and the position, never on the
batch, the bucket, the data rank or the step: the same seed gives the same
tokens on any layout, mesh and serving loop.

Drafts (n-gram proposals, a point mass ``q``) are verified by sampling the
target at each draft position and accepting while the sample equals the draft.
That is exact rejection sampling for a point-mass proposal: the draft is kept
with probability ``p(draft)``, and on rejection the sample is distributed as
``p`` without the draft, renormalised — what the residual ``max(0, p - q)``
gives.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _order_keys(x: jax.Array) -> jax.Array:
    """float32 -> uint32 keys in the same order (negative floats below positive ones; -0 is 0)."""
    b = jax.lax.bitcast_convert_type(jnp.where(x == 0, jnp.float32(0), x), jnp.uint32)
    return jnp.where((b >> 31) == 1, ~b, b | jnp.uint32(0x80000000))


def _largest_key(pred, rows: int) -> jax.Array:
    """uint32 ``[rows]``: per row the largest key ``t`` with ``pred(t)`` true, for a ``pred``
    true at 0 and monotone (true below some key, false above), built bit by bit from the top:
    32 reductions in a loop, no sort (XLA:GPU keeps a loop, unlike a sort, inside the step's CUDA
    graph; unrolled, the 32 steps cost seconds of compile time in every step executable, and
    the GPU step's launch was no faster: BENCHMARKS.md, issue 24's fourth pass)."""

    def step(i, res):
        cand = res | (jnp.uint32(1) << (31 - i).astype(jnp.uint32))
        return jnp.where(pred(cand[:, None]), cand, res)

    return jax.lax.fori_loop(0, 32, step, jnp.zeros((rows,), jnp.uint32))


def _filtered(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """``scaled [L, V]`` with everything outside each row's top-k / top-p set at ``-inf``.

    In the descending order ``o``: top-k keeps the values ``>= o[k - 1]``; top-p keeps the values
    ``>= o[n - 1]``, ``n`` the number of leading entries whose larger ones have not yet reached
    ``top_p`` in probability (the first always stays). Both thresholds are found by bisection
    over the values' order keys (``o[k - 1]`` is the largest value with at least ``k`` values at
    or above it; ``o[n - 1]`` the smallest whose strictly larger ones hold less than ``top_p``)."""
    L, V = scaled.shape
    keys = _order_keys(scaled)
    k = jnp.where((top_k > 0) & (top_k < V), top_k, V)
    kth = _largest_key(lambda t: jnp.sum(keys >= t, axis=-1) >= k, L)
    probs = jax.nn.softmax(scaled, axis=-1)

    def mass_above(t):
        return jnp.sum(jnp.where(keys > t, probs, 0.0), axis=-1)

    top = jnp.max(keys, axis=-1)
    # the largest key whose strictly larger ones still hold >= top_p; the threshold is the next
    reach = _largest_key(lambda t: mass_above(t) >= top_p, L)
    cut = (top_p < 1) & (mass_above(jnp.zeros((L, 1), jnp.uint32)) >= top_p)
    pth = jnp.where(cut, jnp.minimum(reach, top - 1) + 1, 0)
    return jnp.where(keys >= jnp.maximum(kth, pth)[:, None], scaled, -jnp.inf)


def sample_rows(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                seed: jax.Array, position: jax.Array) -> jax.Array:
    """int32 ``[L]``: one token per logits row (module docstring). All arguments ``[L]`` but
    ``logits [L, V]``; ``position`` is the position of the token being sampled."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sampled(_):
        scaled = logits.astype(jnp.float32) / jnp.where(temperature > 0, temperature, 1.0)[:, None]
        filtering = jnp.any((temperature > 0) & (((top_k > 0) & (top_k < logits.shape[-1])) | (top_p < 1)))
        scaled = jax.lax.cond(filtering, lambda x: _filtered(x, top_k, top_p), lambda x: x, scaled)

        def noise(s, p):
            return jax.random.gumbel(jax.random.fold_in(jax.random.key(s), p), (logits.shape[-1],))

        g = jax.vmap(noise)(seed.astype(jnp.uint32), position.astype(jnp.uint32))
        return jnp.where(temperature > 0, jnp.argmax(scaled + g, axis=-1).astype(jnp.int32), greedy)

    return jax.lax.cond(jnp.any(temperature > 0), sampled, lambda _: greedy, None)


def sample_and_verify(logits, cu_num_logits, drafts, num_draft, k, params):
    """Sample every logits row and verify drafts.

    Row ``b``'s logits are rows ``cu[b] .. cu[b] + nd_b``; draft ``i`` is accepted while every
    earlier draft was and the sample of ``logits[cu[b] + i]`` equals ``drafts[b, i]``.
    ``params``: ``(temperature, top_k, top_p, seed, position)`` per logits row (``[L]`` each).
    Returns ``sampled [R, 1 + k]`` (accepted drafts, then the bonus or correction token) and
    ``num_sampled [R]`` = accepted + 1 for rows with logits, 0 for padded rows.
    """
    L = logits.shape[0]
    target = sample_rows(logits, *params)  # [L]
    R = num_draft.shape[0]
    j = jnp.arange(1 + k, dtype=jnp.int32)[None, :]
    rows = cu_num_logits[:-1, None] + j
    sampled = target[jnp.clip(rows, 0, L - 1)]
    has_logits = (cu_num_logits[1:] - cu_num_logits[:-1]) > 0
    if k:
        match = (j[:, :k] < num_draft[:, None]) & (sampled[:, :k] == drafts[:, :k])
        accepted = jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1)
    else:
        accepted = jnp.zeros((R,), jnp.int32)
    num_sampled = jnp.where(has_logits, accepted + 1, 0).astype(jnp.int32)
    sampled = jnp.where(j < num_sampled[:, None], sampled, 0)
    return sampled, num_sampled
