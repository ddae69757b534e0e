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

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from kvjax.models.attention import _dense_init, linear, rms_norm
from kvjax.models.config import TinyHybridConfig


def route(h: jax.Array, router: jax.Array, top_k: int) -> jax.Array:
    """Gate weights float32 ``[T, E]``: softmax over each token's ``top_k`` router logits, 0 elsewhere."""
    return route_from_logits(h @ router, top_k)


def route_from_logits(logits: jax.Array, top_k: int) -> jax.Array:
    """:func:`route` from the router logits ``[T, E]``."""
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


ACTIVATIONS = ("silu", "relu2")


def activation(x: jax.Array, name: str) -> jax.Array:
    """``silu`` or ``relu2`` (``relu(x)^2``, Nemotron-H) of ``x``."""
    if name == "silu":
        return jax.nn.silu(x)
    if name == "relu2":
        return jnp.square(jax.nn.relu(x))
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {name!r}")


@dataclasses.dataclass(frozen=True)
class MLPSpec:
    """A dense feed-forward: gated ``act(x @ w_gate) * (x @ w_up) @ w_down`` or, ungated,
    ``act(x @ w_up) @ w_down`` (hashable)."""

    hidden: int
    gated: bool = True
    activation: str = "silu"


def mlp(h: jax.Array, w: dict, spec: MLPSpec) -> jax.Array:
    """Dense feed-forward of ``h [T, d]`` (float32 out). ``w``: ``w_up [d, F]``, ``w_gate [d, F]``
    (gated), ``w_down [F, d]``, optional biases ``b_up``, ``b_gate``, ``b_down``."""
    up = linear(h, w["w_up"], w.get("b_up"))
    if spec.gated:
        up = activation(linear(h, w["w_gate"], w.get("b_gate")), spec.activation) * up
    else:
        up = activation(up, spec.activation)
    return linear(up, w["w_down"], w.get("b_down"))


ROUTINGS = ("softmax_topk", "sigmoid_grouped")


@dataclasses.dataclass(frozen=True)
class MoESpec:
    """Routed experts (hashable).

    Attributes:
      num_experts, top_k, hidden: experts, experts per token, each expert's hidden width.
      routing: ``"softmax_topk"`` (softmax over each token's ``top_k`` router logits: Mixtral,
        Granite) or ``"sigmoid_grouped"`` (sigmoid scores; choice on scores + ``e_bias``
        restricted to the ``topk_group`` best of ``n_group`` expert groups, a group scored by
        its two best; weights the chosen sigmoid scores, normalised to sum 1 if
        ``norm_topk_prob``, times ``routed_scaling_factor``: DeepSeek-V3, Nemotron-H).
      gated, activation: each expert as in :class:`MLPSpec`.
    """

    num_experts: int
    top_k: int
    hidden: int
    routing: str = "softmax_topk"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    gated: bool = True
    activation: str = "silu"


def route_sigmoid_grouped(logits: jax.Array, e_bias: jax.Array | None, spec: MoESpec) -> jax.Array:
    """Gate weights float32 ``[T, E]`` of group-limited sigmoid routing (see :class:`MoESpec`)."""
    T, E = logits.shape
    scores = jax.nn.sigmoid(logits.astype(jnp.float32))
    choice = scores if e_bias is None else scores + e_bias.astype(jnp.float32)
    if spec.n_group > 1:
        per = E // spec.n_group
        grouped = choice.reshape(T, spec.n_group, per)
        group_score = jnp.sum(jax.lax.top_k(grouped, min(2, per))[0], axis=-1)  # [T, n_group]
        _, best = jax.lax.top_k(group_score, spec.topk_group)
        keep = jnp.sum(jax.nn.one_hot(best, spec.n_group, dtype=jnp.int32), axis=1) > 0
        choice = jnp.where(jnp.repeat(keep, per, axis=1), choice, -jnp.inf)
    _, idx = jax.lax.top_k(choice, spec.top_k)
    w = jnp.take_along_axis(scores, idx, axis=-1)  # [T, k]
    if spec.norm_topk_prob:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    w = w * jnp.float32(spec.routed_scaling_factor)
    onehot = jax.nn.one_hot(idx, E, dtype=jnp.float32)
    return jnp.einsum("tk,tke->te", w, onehot)


def experts_ffn(h: jax.Array, gates: jax.Array, w: dict, spec: MoESpec) -> jax.Array:
    """``sum_e gates[:, e] * expert_e(h)`` over the experts in ``w`` (``w_up``, ``w_gate`` if gated,
    ``w_down``, stacked on axis 0), float32 out."""
    if spec.gated and spec.activation == "silu" and all(
            w[n].dtype == jnp.float32 for n in ("w_gate", "w_up", "w_down")):
        return _experts(h, gates, w["w_gate"], w["w_up"], w["w_down"])

    def mm(eq, a, b):
        if jax.default_backend() == "cpu":  # XLA:CPU has no bf16 x bf16 -> f32 dot
            return jnp.einsum(eq, a.astype(b.dtype).astype(jnp.float32), b.astype(jnp.float32))
        return jnp.einsum(eq, a.astype(b.dtype), b, preferred_element_type=jnp.float32)

    up = mm("td,edf->tef", h, w["w_up"])
    if spec.gated:
        up = activation(mm("td,edf->tef", h, w["w_gate"]), spec.activation) * up
    else:
        up = activation(up, spec.activation)
    o = mm("tef,efd->ted", up, w["w_down"])
    return jnp.einsum("te,ted->td", gates, o)


def moe_ffn(h: jax.Array, w: dict, spec: MoESpec, expert_axis: str | None = None,
            route_input: jax.Array | None = None) -> jax.Array:
    """Routed experts of ``h [T, d]`` (float32 ``[T, d]``; see the module docstring for
    ``expert_axis``). ``w``: ``router [d_r, E]``, optional ``e_bias [E]`` (sigmoid routing), the
    expert stacks of :func:`experts_ffn` (``E / axis size`` of them under ``expert_axis``).
    ``route_input [T, d_r]``: what the router reads when it is not ``h`` (Nemotron-H's latent
    experts are routed on the hidden state before the latent projection)."""

    def gates_of(hh):
        router = w["router"]
        logits = hh @ (router if router.dtype == jnp.float32 else router.astype(jnp.float32))
        if spec.routing == "softmax_topk":
            return route_from_logits(logits, spec.top_k)
        return route_sigmoid_grouped(logits, w.get("e_bias"), spec)

    r = h if route_input is None else route_input
    if expert_axis is None:
        return experts_ffn(h, gates_of(r), w, spec)
    El = w["w_up"].shape[0]
    h_all = jax.lax.all_gather(h, expert_axis, tiled=True)  # [S * T, d]: every member's tokens
    r_all = h_all if route_input is None else jax.lax.all_gather(r, expert_axis, tiled=True)
    gates = gates_of(r_all)
    first = jax.lax.axis_index(expert_axis) * El
    local = jax.lax.dynamic_slice_in_dim(gates, first, El, axis=1)
    part = experts_ffn(h_all, local, w, spec)
    return jax.lax.psum_scatter(part, expert_axis, scatter_dimension=0, tiled=True)  # [T, d]


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
        spec = MoESpec(c.moe_num_experts, c.moe_top_k, c.moe_ffn_dim)
        w = {"router": self.router, "w_gate": self.w_gate, "w_up": self.w_up, "w_down": self.w_down}
        y = moe_ffn(h, w, spec, self.expert_axis)
        return x + jnp.where(token_real[:, None], y, 0.0)
