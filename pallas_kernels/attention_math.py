"""The attention arithmetic the jnp references share: softmax over gathered keys, masked on values.

Each reference gathers, per query token, the keys it may see (``k``, ``v``: ``[T, S, Hkv,
D]``) and a ``visible`` mask; :func:`masked_attention` does the rest. Masking is on
*values*: an invisible key's K and V are replaced by 0 before any product and its score
by :data:`MASK_VALUE` (finite), its probability by 0, so NaN in an unwritten page tail,
an unlisted page or the null block never reaches an output (``0 * NaN`` would), and a
token that sees nothing gets 0.
"""

from __future__ import annotations

import jax.numpy as jnp

__all__ = ["MASK_VALUE", "lse_of", "masked_attention", "merge_attention"]

# Score of a masked key: finite, so max() and exp() stay NaN-free even for a query that
# sees nothing; exp(MASK_VALUE - max) underflows to 0.
MASK_VALUE = -1e30


def masked_attention(q, k, v, visible, *, sm_scale: float | None = None, return_lse: bool = False):
    """Softmax attention of each token over its own gathered keys, masked on values.

    Args:
      q: ``[T, Hq, D]``; k: float32 ``[T, S, Hkv, D]``, v ``[T, S, Hkv, Dv]`` (token ``t``'s keys), ``Hq`` a
        multiple of ``Hkv`` (query head ``h`` reads kv head ``h // (Hq // Hkv)``).
      visible: bool ``[T, S]``.
      sm_scale: the score scale (float32 ``q . k * sm_scale``); None: ``q . k / sqrt(D)``.

      return_lse: also return each head's log-sum-exp of its scaled visible scores.

    Returns:
      float32 ``[T, Hq, Dv]``; with ``return_lse`` the pair ``(out, lse float32 [T, Hq])``,
      ``lse = -inf`` where the token sees no key.
    """
    T, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    k = jnp.where(visible[:, :, None, None], k, 0.0)
    v = jnp.where(visible[:, :, None, None], v, 0.0)
    qg = q.astype(jnp.float32).reshape(T, Hkv, G, D)
    s = jnp.einsum("thgd,tshd->thgs", qg, k)
    s = s / jnp.sqrt(jnp.float32(D)) if sm_scale is None else s * jnp.float32(sm_scale)
    vis = visible[:, None, None, :]
    s = jnp.where(vis, s, MASK_VALUE)
    top = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(vis, jnp.exp(s - top), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("thgs,tshd->thgd", p, v) / jnp.where(denom > 0, denom, 1.0)
    o = o.reshape(T, Hq, v.shape[-1])
    if not return_lse:
        return o
    return o, lse_of(top[..., 0], denom[..., 0]).reshape(T, Hq)


def lse_of(m, l):
    """``log(sum(exp(s)))`` from a softmax's running max ``m`` and its sum ``l`` of
    ``exp(s - m)``: ``m + log(l)``, ``-inf`` where ``l`` is 0 (no visible score)."""
    return jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)


def merge_attention(o_a, lse_a, o_b, lse_b):
    """One softmax attention from two over disjoint key sets: outputs ``o [T, H, D]`` (each
    normalised by its own sum) and their log-sum-exps ``lse [T, H]`` (``-inf``: no key) ->
    float32 ``(o, lse)`` of the union, ``o = 0`` where neither part saw a key."""
    top = jnp.maximum(lse_a, lse_b)
    seen = top > -jnp.inf
    top = jnp.where(seen, top, 0.0)
    w_a = jnp.where(lse_a > -jnp.inf, jnp.exp(lse_a - top), 0.0)
    w_b = jnp.where(lse_b > -jnp.inf, jnp.exp(lse_b - top), 0.0)
    den = w_a + w_b
    inv = jnp.where(seen, 1.0 / jnp.where(seen, den, 1.0), 0.0)
    o = (jnp.where(w_a[..., None] > 0, w_a[..., None] * o_a.astype(jnp.float32), 0.0)
         + jnp.where(w_b[..., None] > 0, w_b[..., None] * o_b.astype(jnp.float32), 0.0)) * inv[..., None]
    return o, jnp.where(seen, top + jnp.log(jnp.where(seen, den, 1.0)), -jnp.inf)
