"""Mixture-of-experts feed-forward block: top-k routing over SwiGLU experts.

``x + sum_e gate[t, e] * expert_e(norm(x))`` where ``gate`` is the softmax of the
``top_k`` largest router logits of the token (zero for the other experts).

Expert parallelism: with ``expert_axis`` set (inside ``shard_map`` over a mesh
whose ``expert_axis`` has ``S`` members), each member holds experts
``[s * E/S, (s + 1) * E/S)``. Every member gathers all members' tokens
(``all_gather``), applies its own experts to them, and the partial outputs are
summed back to the tokens' owners (``psum_scatter``). Both collectives need
every member, so a member with no tokens still runs the block (on its padding).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from kvjax.models.attention import _dense_init, rms_norm
from kvjax.models.config import TinyHybridConfig


def route(h: jax.Array, router: jax.Array, top_k: int) -> jax.Array:
    """Gate weights float32 ``[T, E]``: softmax over each token's ``top_k`` router logits, 0 elsewhere."""
    logits = h @ router  # [T, E]
    vals, idx = jax.lax.top_k(logits, top_k)
    w = jax.nn.softmax(vals, axis=-1)  # [T, k]
    onehot = jax.nn.one_hot(idx, logits.shape[-1], dtype=jnp.float32)  # [T, k, E]
    return jnp.einsum("tk,tke->te", w, onehot)


def _experts(h, gates, w_gate, w_up, w_down):
    """``sum_e gates[:, e] * (silu(h @ w_gate[e]) * (h @ w_up[e])) @ w_down[e]`` over the given experts."""
    a = jnp.einsum("td,edf->tef", h, w_gate)
    b = jnp.einsum("td,edf->tef", h, w_up)
    o = jnp.einsum("tef,efd->ted", jax.nn.silu(a) * b, w_down)
    return jnp.einsum("te,ted->td", gates, o)


def _stacked_init(key, shape, dtype=jnp.float32):
    """``shape[0]`` independent ``_dense_init`` matrices of shape ``shape[1:]``."""
    return jax.vmap(lambda k: _dense_init(k, shape[1:], dtype))(jax.random.split(key, shape[0]))


class MoELayer(nn.Module):
    """Pre-norm MoE block; ``x + moe(norm(x))`` (pad tokens add 0).

    Params: ``norm [d]``, ``router [d, E]``, ``w_gate``, ``w_up [E_local, d, F]``,
    ``w_down [E_local, F, d]`` with ``E_local = E / axis size`` under ``expert_axis``.
    """

    config: TinyHybridConfig
    expert_axis: str | None = None

    def setup(self):
        c = self.config
        d, E, F = c.d_model, c.moe_num_experts, c.moe_ffn_dim
        shards = jax.lax.axis_size(self.expert_axis) if self.expert_axis else 1
        if E % shards:
            raise ValueError(
                f"moe_num_experts={E} must be a multiple of the {self.expert_axis!r} axis size {shards}"
            )
        El = E // shards
        self.norm = self.param("norm", nn.initializers.ones, (d,))
        self.router = self.param("router", _dense_init, (d, E))
        self.w_gate = self.param("w_gate", _stacked_init, (El, d, F))
        self.w_up = self.param("w_up", _stacked_init, (El, d, F))
        self.w_down = self.param("w_down", _stacked_init, (El, F, d))

    def declare(self):
        """Creates the params (used by ``init``)."""

    def __call__(self, x: jax.Array, token_real: jax.Array) -> jax.Array:
        """``x [T, d]`` float32, ``token_real bool [T]`` -> ``[T, d]``."""
        c = self.config
        h = rms_norm(x, self.norm, c.rms_eps)
        if self.expert_axis is None:
            y = _experts(h, route(h, self.router, c.moe_top_k), self.w_gate, self.w_up, self.w_down)
        else:
            ax = self.expert_axis
            El = self.w_gate.shape[0]
            h_all = jax.lax.all_gather(h, ax, tiled=True)  # [S * T, d]: every member's tokens
            gates = route(h_all, self.router, c.moe_top_k)
            first = jax.lax.axis_index(ax) * El
            local = jax.lax.dynamic_slice_in_dim(gates, first, El, axis=1)
            part = _experts(h_all, local, self.w_gate, self.w_up, self.w_down)
            y = jax.lax.psum_scatter(part, ax, scatter_dimension=0, tiled=True)  # [T, d]
        return x + jnp.where(token_real[:, None], y, 0.0)
