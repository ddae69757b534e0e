"""Mixture-of-experts feed-forward block: top-k routing over SwiGLU experts.

``x + sum_j weight[t, j] * expert_{idx[t, j]}(norm(x))`` where ``idx [T, k]`` are the token's
``top_k`` experts and ``weight [T, k]`` their gate weights (for softmax routing the softmax of
the ``top_k`` largest router logits).

Applying the routed experts (:func:`apply_experts`) is one rule with three static paths:
*grouped* (where ``backend`` resolves to the GPU kernel) sorts the ``T * k`` (token, choice)
pairs by expert into row tiles (:func:`pallas_kernels.group_tiles`) and runs each tile against
its expert's weights in place (:func:`pallas_kernels.grouped_matmul`): every chosen expert is
read about once and only chosen experts are computed. Elsewhere the path is picked from the
shapes: *dense* runs every held expert on every token as batched matmuls with the
expert axis as the batch dimension of both operands (the ``[E, d, F]`` / ``[E, F, d]`` stacks
are read in their stored layout: no per-step transposed copy of a stack), then picks each
token's ``k`` outputs; *sparse* (few tokens: ``3 * T * k <= E``) gathers only the chosen
experts' weights and runs ``T * k`` vector-matrix products. All combine ``sum_j weight * out``
in the same order, so they agree to float32 rounding of the products.

Expert parallelism: with ``expert_axis`` set (inside ``shard_map`` over a mesh
whose ``expert_axis`` has ``S`` members), each member holds experts
``[s * E/S, (s + 1) * E/S)``. Every member gathers all members' tokens
(``all_gather``), applies its own experts to them (a choice of another member's expert
contributes 0 here), and the partial outputs are summed back to the tokens' owners
(``psum_scatter``). Both collectives need every member, so a member with no tokens still runs
the block (on its padding). :func:`routed_ffn` owns this rule for every MoE model
(:func:`moe_ffn`, DeepSeek-V3).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from kvjax.models.attention import _dense_init, dot_operands, linear, pad_rows, rms_norm, row_padded
from kvjax.models.config import TinyHybridConfig
from pallas_kernels import backend as kernel_backend
from pallas_kernels import group_tiles, grouped_matmul
from pallas_kernels.grouped_matmul import OP_GROUPED_MATMUL, tile_rows_for
from pallas_kernels.contract import static_int
from pallas_kernels.moe_route import check_rule, moe_route


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
    (gated), ``w_down [F, d]``, optional biases ``b_up``, ``b_gate``, ``b_down``.

    The ``[T, F]`` products come out in the weights' dtype (a bf16 model's are bf16, as in
    transformers and vLLM: the widest activation of the layer at half the bytes); the activation
    and the gating run in float32 on them."""
    f32, dt = jnp.float32, w["w_up"].dtype
    up = linear(h, w["w_up"], w.get("b_up"), out_dtype=dt).astype(f32)
    if spec.gated:
        gate = linear(h, w["w_gate"], w.get("b_gate"), out_dtype=dt).astype(f32)
        up = activation(gate, spec.activation) * up
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

    def __post_init__(self):
        """Refuses a spec the model could not run as written, by field name: an unknown
        ``routing`` (it had been run as ``sigmoid_grouped``) or ``activation``, sizes that are not
        ints >= 1, and a routing rule its owner refuses (:func:`pallas_kernels.moe_route.check_rule`:
        groups, ``top_k``, and for ``softmax_topk`` no ``norm_topk_prob=False`` or scale, which
        it would have ignored)."""
        if self.routing not in ROUTINGS:
            raise ValueError(f"MoESpec.routing must be one of {ROUTINGS}, got {self.routing!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"MoESpec.activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if not isinstance(self.gated, bool):
            raise ValueError(f"MoESpec.gated must be a bool, got {self.gated!r}")
        for name in ("num_experts", "top_k", "hidden", "n_group", "topk_group"):
            object.__setattr__(self, name, static_int(f"MoESpec.{name}", getattr(self, name)))
        check_rule(self.num_experts, where="MoESpec", **route_rule(self),
                   names={"renormalize": "norm_topk_prob", "scale": "routed_scaling_factor"})


def check_expert_groups(where: str, num_experts: int, n_group: int, topk_group: int, top_k: int) -> None:
    """A config's group-limited sigmoid routing (transformers' DeepSeek-V3 and Nemotron-H
    routers), checked by the routing rule's owner (:func:`pallas_kernels.moe_route.check_rule`)
    under the config's field names; ``ValueError`` prefixed by ``where``."""
    check_rule(num_experts, top_k, "sigmoid", n_group, topk_group, where=where,
               names={"num_experts": "n_routed_experts", "top_k": "num_experts_per_tok"})


def route_rule(spec: MoESpec) -> dict:
    """``spec``'s routing as the keyword arguments of :func:`pallas_kernels.moe_route`."""
    return dict(top_k=spec.top_k, scoring="softmax" if spec.routing == "softmax_topk" else "sigmoid",
                n_group=spec.n_group, topk_group=spec.topk_group, renormalize=spec.norm_topk_prob,
                scale=spec.routed_scaling_factor)


PATHS = ("auto", "dense", "sparse", "grouped")

#: The sparse path gathers the chosen experts' weights (read once, written once, read again by
#: the products: about 3 passes over ``T * k`` experts' bytes); the dense path reads the ``E``
#: held experts once. Sparse is taken when ``SPARSE_BYTES_FACTOR * T * k <= E``. On an H200
#: (JAX 0.11.2, bf16, 64 experts of 2048 x 1408, top-6) the sparse step took 95 / 169 / 315 us
#: at 1 / 2 / 4 tokens against the dense step's 266 us (at 2-16 tokens): the crossover this
#: rule puts between 3 and 4 tokens.
SPARSE_BYTES_FACTOR = 3


def sparse_pays(tokens: int, top_k: int, num_experts: int) -> bool:
    """Whether ``path="auto"`` off the GPU kernel takes the sparse path for ``tokens`` tokens
    (static: shapes only)."""
    return SPARSE_BYTES_FACTOR * tokens * top_k <= num_experts


def choose_path(tokens: int, top_k: int, num_experts: int, backend: str = "reference") -> str:
    """The path ``path="auto"`` takes (static): ``"grouped"`` where ``backend`` resolves to the
    GPU grouped-matmul kernel, else ``"sparse"`` if :func:`sparse_pays`, else ``"dense"``."""
    if kernel_backend.choose(OP_GROUPED_MATMUL, backend, None).flavor == "gpu":
        return "grouped"
    return "sparse" if sparse_pays(tokens, top_k, num_experts) else "dense"


def _bmm(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x [B, M, K] @ w [B, K, N] -> float32 [B, M, N]``: a canonical batched matmul, axis 0 the
    batch of both operands (``w`` is read in its stored layout). ``x`` is cast to ``w``'s dtype
    (bf16 weights: a bf16 product into float32; XLA:CPU lacks that dot, so there both operands
    are widened first, the same products), as ``kvjax.models.attention.linear`` does."""
    x, w = dot_operands(x, w)
    return jax.lax.dot_general(x, w, (((2,), (1,)), ((0,), (0,))), preferred_element_type=jnp.float32)


def _expert_mlp(x, up_w, gate_w, down_w, gated: bool, act: str):
    """``x [B, M, d]`` through batch member ``b``'s expert (``up_w [B, d, F]``, ``gate_w``,
    ``down_w [B, F, d]``): float32 ``[B, M, d]``. One row runs as two off the CPU
    (:func:`~kvjax.models.attention.row_padded`; measured 4x faster at 6 gathered experts)."""

    def mlp(a):
        up = _bmm(a, up_w)
        if gated:
            return _bmm(activation(_bmm(a, gate_w), act) * up, down_w)
        return _bmm(activation(up, act), down_w)

    return row_padded(mlp, x, axis=1)


def _grouped_mlp(h, local, valid, up_w, gate_w, down_w, gated: bool, act: str, backend: str,
                 shared=None):
    """``[T, k, d]``: pair ``(t, j)``'s expert ``local[t, j]`` on ``h[t]`` (0 where not
    ``valid``), the pairs sorted by expert into row tiles run by the grouped-matmul kernel.
    ``shared``: ``(gate [d, S * F], up [d, S * F], down [S * F, d])``, a dense MLP read in place
    as experts ``El .. El + S - 1`` of width ``F``."""
    up_w, gate_w, down_w = (None if a is None else jnp.asarray(a) for a in (up_w, gate_w, down_w))
    T, k = local.shape
    El, d, F = up_w.shape
    S = 0 if shared is None else shared[1].shape[1] // F
    P = T * k
    TM = tile_rows_for(P, El + S)
    # one token: its choices are distinct experts, each pair a tile of its own (no counting)
    slot, tile_group = group_tiles(jnp.where(valid, local, El + S).reshape(P), El + S, TM,
                                   rows_apart=T == 1 and P <= El + S)
    rows = tile_group.shape[0] * TM
    # the first product reads each tile row's token from h in place: row slot[t * k + j] is token
    # t, the layout's padding rows (-1) read zeros; no [rows, d] copy of the tokens, nor its zeros
    src = jnp.full((rows,), -1, jnp.int32).at[slot].set(
        jnp.arange(P, dtype=jnp.int32) // k, mode="drop", unique_indices=True)

    def product(a, w, more=None, more_gate=None, **gating):
        extra = {} if not S else dict(more_w=more, more_gate=more_gate, more_groups=S)
        return grouped_matmul(a.astype(w.dtype), w, tile_group, tile_rows=TM, backend=backend,
                              **extra, **gating)

    sg, su, sd = shared if S else (None, None, None)
    if gated:  # act(x @ gate) * (x @ up) in one kernel, rounded once to the weights' dtype
        a = product(h, up_w, su, sg, gate=gate_w, activation=act, out_dtype=up_w.dtype, x_rows=src)
    else:
        a = activation(product(h, up_w, su, x_rows=src), act)
    y = product(a, down_w, None if sd is None else sd.reshape(S, F, d))  # [rows, d]; padding rows 0
    return jnp.take(y, slot, axis=0, mode="fill", fill_value=0).reshape(T, k, d)


def _check_shared(shared: dict, d: int, dtype) -> int:
    """``shared``'s width ``Fs``, its matrices checked: ``w_gate``, ``w_up [d, Fs]``,
    ``w_down [Fs, d]``, all in the experts' ``dtype`` (``ValueError`` naming the one that is not)."""
    if not isinstance(shared, dict) or not {"w_gate", "w_up", "w_down"} <= set(shared):
        raise ValueError(f"shared must be a dict of w_gate, w_up and w_down, got "
                         f"{sorted(shared) if isinstance(shared, dict) else type(shared).__name__}")
    Fs = jnp.shape(shared["w_up"])[-1] if jnp.ndim(shared["w_up"]) else -1
    for name, want in (("w_gate", (d, Fs)), ("w_up", (d, Fs)), ("w_down", (Fs, d))):
        m = shared[name]
        if tuple(jnp.shape(m)) != want:
            raise ValueError(f"shared[{name!r}] must have shape {list(want)} (d={d}, the shared width "
                             f"w_up's {Fs}), got {list(jnp.shape(m))}")
        have, want_dt = (jax.dtypes.canonicalize_dtype(t) for t in (m.dtype, dtype))
        if have != want_dt:
            raise ValueError(f"shared[{name!r}] must have the experts' dtype {want_dt.name}, got {have.name}")
    return int(Fs)


def apply_experts(h: jax.Array, idx: jax.Array, weight: jax.Array, w: dict, *, gated: bool = True,
                  activation: str = "silu", first: jax.Array | int = 0,
                  path: str = "auto", backend: str = "reference",
                  token_mask: jax.Array | None = None, shared: dict | None = None) -> jax.Array:
    """``y[t] = sum_j weight[t, j] * expert_{idx[t, j]}(h[t])`` over the experts held in ``w``
    (float32 ``[T, d]``), the one rule every MoE here applies its routed experts by.

    Args:
      h: ``[T, d]`` token inputs.
      idx: ``int [T, k]`` the tokens' chosen experts (global ids); weight: ``float32 [T, k]``.
      w: ``w_up [El, d, F]``, ``w_gate [El, d, F]`` (gated), ``w_down [El, F, d]``: experts
        ``first .. first + El - 1``; a choice outside that range contributes 0.
      gated, activation: each expert as in :class:`MLPSpec`.
      first: global id of ``w``'s expert 0 (``axis_index * El`` under expert parallelism).
      path: ``"dense"`` (every held expert on every token: ``[El, T, d] @ [El, d, F]``, batched
        over the expert axis), ``"sparse"`` (only the chosen experts' weights are read: they are
        gathered to ``[T * k, d, F]`` and each (token, choice) pair is one batch member),
        ``"grouped"`` (the pairs sorted by expert into tiles, each tile's products read its
        expert's weights in place: :func:`pallas_kernels.grouped_matmul` with ``backend``) or
        ``"auto"`` (:func:`choose_path`). All sum ``weight * out`` over ``j`` in the same
        order; they differ only in the float32 accumulation order of the products.
      backend: the grouped-matmul kernel's backend (:mod:`pallas_kernels.backend`); it also
        decides ``"auto"``.
      token_mask: ``bool [T]``; a token not in it (a step's padding) adds 0 and its choices
        name no expert: the grouped path gives them no tile, so an expert only padding chose is
        not read (its row of the result is 0).
      shared: grouped path only: ``w_gate``, ``w_up [d, S * F]``, ``w_down [S * F, d]`` (``F``
        the routed experts' width), a gated dense MLP every token in ``token_mask`` adds with
        weight 1 (DeepSeek's shared experts), run as ``S`` more experts in the routed experts'
        launches, its weights read in place; ``sum_j`` then runs over the ``k`` choices, then
        the ``S`` parts.
    """
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    T, k = idx.shape
    if token_mask is not None and tuple(token_mask.shape) != (T,):
        raise ValueError(f"token_mask must have shape [{T}] (one per token of idx), got {list(token_mask.shape)}")
    El = w["w_up"].shape[0]
    local = idx.astype(jnp.int32) - first
    valid = (local >= 0) & (local < El)
    if token_mask is not None:
        valid = valid & token_mask.astype(bool)[:, None]
    local = jnp.where(valid, local, 0)
    gate_w = w["w_gate"] if gated else None
    if path == "auto":
        path = choose_path(T, k, El, backend)
    sh = None
    if shared is not None:  # S more pairs per token: experts El .. El + S - 1, weight 1
        F, Fs = w["w_up"].shape[-1], _check_shared(shared, h.shape[-1], w["w_up"].dtype)
        if path != "grouped" or not gated or Fs % F:
            raise ValueError(f"shared experts run on the grouped path of gated experts, as a whole number "
                             f"of experts of width {F}: got path {path!r}, gated={gated}, width {Fs}")
        S = Fs // F
        local = jnp.concatenate([local, jnp.broadcast_to(El + jnp.arange(S, dtype=jnp.int32), (T, S))], 1)
        tok = jnp.ones((T,), bool) if token_mask is None else token_mask.astype(bool)
        valid = jnp.concatenate([valid, jnp.broadcast_to(tok[:, None], (T, S))], 1)
        weight = jnp.concatenate([weight.astype(jnp.float32), jnp.ones((T, S), jnp.float32)], 1)
        sh = (shared["w_gate"], shared["w_up"], shared["w_down"])
    if path == "grouped":
        o = _grouped_mlp(h, local, valid, w["w_up"], gate_w, w["w_down"], gated, activation, backend,
                         shared=sh)
    elif path == "sparse":
        sel = local.reshape(T * k)

        def take(a):
            return None if a is None else jnp.take(a, sel, axis=0, mode="clip")

        x = jnp.repeat(h, k, axis=0)[:, None, :]  # [T * k, 1, d]: member t * k + j is h[t]
        o = _expert_mlp(x, take(w["w_up"]), take(gate_w), take(w["w_down"]), gated, activation)
        o = o.reshape(T, k, o.shape[-1])  # (not -1: T * k may be 0)
    else:
        x = jnp.broadcast_to(h.astype(w["w_up"].dtype)[None], (El,) + h.shape)  # [El, T, d]
        o_all = _expert_mlp(x, w["w_up"], gate_w, w["w_down"], gated, activation)  # [El, T, d]
        o = o_all[local, jnp.arange(T)[:, None]]  # [T, k, d]: expert idx[t, j]'s out on token t
    contrib = jnp.where(valid[..., None], weight.astype(jnp.float32)[..., None] * o, 0.0)
    return jnp.sum(contrib, axis=1)


def routed_ffn(h: jax.Array, route_fn: Callable[[jax.Array], tuple[jax.Array, jax.Array]],
               w: dict, *, gated: bool = True, activation: str = "silu",
               expert_axis: str | None = None, route_input: jax.Array | None = None,
               path: str = "auto", backend: str = "reference",
               token_mask: jax.Array | None = None, num_tokens: int | None = None,
               shared: dict | None = None) -> jax.Array:
    """Routed experts of ``h [T, d]`` (float32 ``[T, d]``): ``route_fn(r) -> (idx [T, k],
    weight [T, k])`` chooses on ``r = route_input`` (default ``h``), :func:`apply_experts`
    applies them. With ``expert_axis`` (see the module docstring) ``w`` holds this member's
    ``E / S`` experts and every member's tokens are routed and applied here. ``path``,
    ``backend`` and ``token_mask [T]`` (a step's real tokens: padding reads no expert): as
    :func:`apply_experts`. ``num_tokens`` (static, default ``T``): the step's tokens are the
    first ``num_tokens`` rows; the rows after them (a one-token step's second row,
    :func:`~kvjax.models.attention.row_count`) are not routed, read nothing and come out 0.
    ``shared``: as :func:`apply_experts` (not under ``expert_axis``)."""
    T = h.shape[0]
    if num_tokens is not None and num_tokens != T:
        if not (isinstance(num_tokens, int) and 0 < num_tokens < T):
            raise ValueError(f"num_tokens must be an int in [1, {T}] (h's rows), got {num_tokens!r}")
        out = routed_ffn(h[:num_tokens], route_fn, w, gated=gated, activation=activation,
                         expert_axis=expert_axis,
                         route_input=None if route_input is None else route_input[:num_tokens],
                         path=path, backend=backend,
                         token_mask=None if token_mask is None else token_mask[:num_tokens],
                         shared=shared)
        return pad_rows(out, T)
    r = h if route_input is None else route_input
    if expert_axis is None:
        idx, weight = route_fn(r)
        return apply_experts(h, idx, weight, w, gated=gated, activation=activation, path=path,
                             backend=backend, token_mask=token_mask, shared=shared)
    if shared is not None:
        raise ValueError("shared experts are not taken under expert_axis (each member would run them on "
                         "every member's tokens)")
    El = w["w_up"].shape[0]
    h_all = jax.lax.all_gather(h, expert_axis, tiled=True)  # [S * T, d]: every member's tokens
    r_all = h_all if route_input is None else jax.lax.all_gather(r, expert_axis, tiled=True)
    mask_all = None if token_mask is None else jax.lax.all_gather(token_mask, expert_axis, tiled=True)
    idx, weight = route_fn(r_all)
    first = jax.lax.axis_index(expert_axis) * El
    part = apply_experts(h_all, idx, weight, w, gated=gated, activation=activation, first=first,
                         path=path, backend=backend, token_mask=mask_all)
    return jax.lax.psum_scatter(part, expert_axis, scatter_dimension=0, tiled=True)  # [T, d]


def moe_ffn(h: jax.Array, w: dict, spec: MoESpec, expert_axis: str | None = None,
            route_input: jax.Array | None = None, path: str = "auto",
            backend: str = "reference", token_mask: jax.Array | None = None,
            num_tokens: int | None = None) -> jax.Array:
    """Routed experts of ``h [T, d]`` (float32 ``[T, d]``; see the module docstring for
    ``expert_axis``). ``w``: ``router [d_r, E]``, optional ``e_bias [E]`` (sigmoid routing), the
    expert stacks of :func:`apply_experts` (``E / axis size`` of them under ``expert_axis``).
    ``route_input [T, d_r]``: what the router reads when it is not ``h`` (Nemotron-H's latent
    experts are routed on the hidden state before the latent projection). ``path``, ``backend``,
    ``token_mask``, ``num_tokens``: as :func:`routed_ffn`."""

    def route_fn(hh):
        return moe_route(hh, w["router"], w.get("e_bias"), backend=backend, **route_rule(spec))

    return routed_ffn(h, route_fn, w, gated=spec.gated, activation=spec.activation,
                      expert_axis=expert_axis, route_input=route_input, path=path,
                      backend=backend, token_mask=token_mask, num_tokens=num_tokens)


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

    def __call__(self, x: jax.Array, token_real: jax.Array, backend: str = "reference") -> jax.Array:
        """``x [T, d]`` float32, ``token_real bool [T]`` -> ``[T, d]``; ``backend``: the expert
        products' (:func:`apply_experts`)."""
        c = self.config
        h = rms_norm(x, self.norm, c.rms_eps)
        spec = MoESpec(c.moe_num_experts, c.moe_top_k, c.moe_ffn_dim)
        w = {"router": self.router, "w_gate": self.w_gate, "w_up": self.w_up, "w_down": self.w_down}
        y = moe_ffn(h, w, spec, self.expert_axis, backend=backend, token_mask=token_real)
        return x + jnp.where(token_real[:, None], y, 0.0)
