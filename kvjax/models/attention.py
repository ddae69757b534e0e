"""GQA attention over the paged KV cache: RoPE, the cache write, a jnp paged attention.

The paged attention reads every key through the step's block tables and masks
by position (causal) and by ``seq_len``. Masking is done on *values* with
``jnp.where`` — scores of masked keys become a large negative finite number,
their probabilities exactly 0, and their K/V entries 0 before any product — so
a NaN in the null block, in an unused block or in a block's unwritten tail
cannot reach a real token (``0 * NaN`` would).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from kvjax.models.config import TinyHybridConfig
from kvjax.models.step_context import StepContext
from pallas_kernels.kv_write import reshape_and_cache_flash

# Score of a masked key: finite, so max() and exp() stay NaN-free even for a
# query with no visible key (a pad token); exp(MASK_VALUE - max) underflows to 0.
MASK_VALUE = -1e30


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last axis, float32."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def apply_rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotate-half RoPE. ``x [T, H, D]``, ``positions int [T]`` -> ``[T, H, D]``."""
    D = x.shape[-1]
    inv_freq = theta ** (-jnp.arange(0, D, 2, dtype=jnp.float32) / D)  # [D/2]
    ang = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    cos, sin = jnp.cos(ang)[:, None, :], jnp.sin(ang)[:, None, :]
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def paged_attention(
    q: jax.Array,  # [T, Hq, D] float32
    key_cache: jax.Array,  # [num_blocks, block_size, Hkv, D]
    value_cache: jax.Array,  # [num_blocks, block_size, Hkv, D]
    block_table: jax.Array,  # int32 [R, W] kernel-block ids
    seq_lens: jax.Array,  # int32 [R]
    positions: jax.Array,  # int32 [T]
    token_row: jax.Array,  # int32 [T], R for pad tokens
    *,
    k_scale: float | None = None,
    v_scale: float | None = None,
) -> jax.Array:
    """Causal attention of each token over its row's cached keys (pure jnp).

    Token ``t`` of row ``b`` sees key position ``j`` (column ``j // block_size``
    of ``block_table[b]``) iff ``j <= positions[t]`` and ``j < seq_lens[b]``. Pad
    tokens (``token_row == R``) see nothing and get 0. fp8 caches are dequantised
    as ``stored * scale`` in float32.

    Returns:
      float32 ``[T, Hq, D]``.
    """
    T, Hq, D = q.shape
    R, W = block_table.shape
    _, bs, Hkv, _ = key_cache.shape
    G = Hq // Hkv
    S = W * bs
    real = token_row < R
    row = jnp.where(real, token_row, 0)  # gather index only, masked by `real`
    blocks = block_table[row]  # [T, W]
    j = jnp.arange(S, dtype=jnp.int32)
    visible = (
        real[:, None]
        & (j[None, :] <= positions[:, None])
        & (j[None, :] < seq_lens[row][:, None])
    )  # [T, S]

    def read(cache, scale):
        kv = cache[blocks].reshape(T, S, Hkv, D).astype(jnp.float32)
        if scale is not None:
            kv = kv * jnp.float32(scale)
        return jnp.where(visible[:, :, None, None], kv, 0.0)

    k = read(key_cache, k_scale)
    v = read(value_cache, v_scale)
    qg = q.astype(jnp.float32).reshape(T, Hkv, G, D)
    s = jnp.einsum("thgd,tshd->thgs", qg, k) / jnp.sqrt(jnp.float32(D))
    vis = visible[:, None, None, :]
    s = jnp.where(vis, s, MASK_VALUE)
    p = jnp.where(vis, jnp.exp(s - jnp.max(s, axis=-1, keepdims=True)), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("thgs,tshd->thgd", p, v) / jnp.where(denom > 0, denom, 1.0)
    return o.reshape(T, Hq, D)


def _dense_init(key, shape, dtype=jnp.float32):
    """Normal with std ``1/sqrt(fan_in)`` for a ``[fan_in, fan_out]`` matrix."""
    return jax.random.normal(key, shape, dtype) / jnp.sqrt(jnp.asarray(shape[0], dtype))


class AttentionLayer(nn.Module):
    """Pre-norm GQA attention block with RoPE; ``x + attn(norm(x))``.

    Params: ``norm [d]``, ``wq [d, Hq*D]``, ``wk``, ``wv [d, Hkv*D]``, ``wo [Hq*D, d]``.
    """

    config: TinyHybridConfig

    def setup(self):
        c = self.config
        d, Hq, Hkv, D = c.d_model, c.num_heads, c.num_kv_heads, c.head_dim
        self.norm = self.param("norm", nn.initializers.ones, (d,))
        self.wq = self.param("wq", _dense_init, (d, Hq * D))
        self.wk = self.param("wk", _dense_init, (d, Hkv * D))
        self.wv = self.param("wv", _dense_init, (d, Hkv * D))
        self.wo = self.param("wo", _dense_init, (Hq * D, d))

    def declare(self):
        """Creates the params (used by ``init``)."""

    def __call__(
        self,
        x: jax.Array,  # [T, d] float32
        ctx: StepContext,
        key_cache: jax.Array,
        value_cache: jax.Array,
        kv_cache_dtype: str,
        backend: str,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Write this step's K/V (pad slots write nothing), then attend. Returns ``(x, K, V)``."""
        c = self.config
        T = x.shape[0]
        h = rms_norm(x, self.norm, c.rms_eps)
        q = (h @ self.wq).reshape(T, c.num_heads, c.head_dim)
        k = (h @ self.wk).reshape(T, c.num_kv_heads, c.head_dim)
        v = (h @ self.wv).reshape(T, c.num_kv_heads, c.head_dim)
        q = apply_rope(q, ctx.positions, c.rope_theta)
        k = apply_rope(k, ctx.positions, c.rope_theta)
        fp8 = kv_cache_dtype != "auto"
        k_scale = c.k_scale if fp8 else None
        v_scale = c.v_scale if fp8 else None
        key_cache, value_cache = reshape_and_cache_flash(
            k,
            v,
            key_cache,
            value_cache,
            ctx.slot_mapping,
            kv_cache_dtype,
            None if k_scale is None else jnp.float32(k_scale),
            None if v_scale is None else jnp.float32(v_scale),
            backend=backend,
        )
        o = paged_attention(
            q,
            key_cache,
            value_cache,
            ctx.block_table,
            ctx.seq_lens,
            ctx.positions,
            ctx.token_row,
            k_scale=k_scale,
            v_scale=v_scale,
        )
        out = o.reshape(T, -1) @ self.wo
        return x + jnp.where(ctx.token_real[:, None], out, 0.0), key_cache, value_cache
