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

__all__ = ["MASK_VALUE", "masked_attention"]

# Score of a masked key: finite, so max() and exp() stay NaN-free even for a query that
# sees nothing; exp(MASK_VALUE - max) underflows to 0.
MASK_VALUE = -1e30


def masked_attention(q, k, v, visible, *, sm_scale: float | None = None):
    """Softmax attention of each token over its own gathered keys, masked on values.

    Args:
      q: ``[T, Hq, D]``; k: float32 ``[T, S, Hkv, D]``, v ``[T, S, Hkv, Dv]`` (token ``t``'s keys), ``Hq`` a
        multiple of ``Hkv`` (query head ``h`` reads kv head ``h // (Hq // Hkv)``).
      visible: bool ``[T, S]``.
      sm_scale: the score scale (float32 ``q . k * sm_scale``); None: ``q . k / sqrt(D)``.

    Returns:
      float32 ``[T, Hq, Dv]``.
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
    p = jnp.where(vis, jnp.exp(s - jnp.max(s, axis=-1, keepdims=True)), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("thgs,tshd->thgd", p, v) / jnp.where(denom > 0, denom, 1.0)
    return o.reshape(T, Hq, v.shape[-1])
