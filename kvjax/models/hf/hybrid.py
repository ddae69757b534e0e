"""The hybrid (attention / Mamba2 / MLP / MoE) decoder the Hugging Face architectures share.

Granite-4.0-H (``GraniteMoeHybridForCausalLM``), Bamba and Nemotron-H are all a stack of
pre-norm residual **blocks** over one residual stream::

    x = embed[ids] * embedding_multiplier
    for block in blocks:  x = x + residual_multiplier * mixer(rms_norm(x))
    logits = rms_norm(x) @ lm_head / logits_scaling          (lm_head = embed.T if tied)

A block's mixer is one of ``"attn"`` (GQA over the paged KV cache,
:func:`kvjax.models.attention.attention_mixer`), ``"mamba"`` (Mamba2 over the state pools,
:func:`kvjax.models.mamba_layer.mamba_mixer`), ``"mlp"`` (:func:`kvjax.models.moe.mlp`) or
``"moe"`` (routed experts, :func:`kvjax.models.moe.moe_ffn`, plus an optional shared MLP and
latent projections). Granite and Bamba layers are two blocks (mixer, then feed-forward);
a Nemotron-H layer is one.

:class:`HybridConfig` describes a model (hashable, every field that changes the math);
:class:`HybridModel` implements :class:`kvjax.models.interface.Model` over it: pools, random
params, mesh partitioning, tensor-parallel shards, the paged step (:meth:`HybridModel.apply`)
and the dense oracle (:meth:`HybridModel.dense_logits`, written apart from the paged path:
plain causal attention, the conv as a sum, the SSM as a recurrent ``lax.scan``).

Param tree: ``{"embed" [V, d], "final_norm" [d], "lm_head" [d, V] (untied only), "blocks":
(one dict per block, below)}``; matrices in the model dtype, 1-D params (norms, biases,
``A_log``, ``D``, ``dt_bias``, the router bias) in float32.

* attn: ``norm``, ``wq [d, Hq*D]``, ``wk``, ``wv [d, Hkv*D]``, ``wo [Hq*D, d]`` (+ ``bq``,
  ``bk``, ``bv``, ``bo``);
* mamba: ``norm``, ``in_proj [d, 2*d_inner + 2*G*N + H]`` (``[z | x | B | C | dt]``, +
  ``in_proj_bias``), ``conv_weight [conv_dim, W]`` (+ ``conv_bias``), ``dt_bias``, ``A_log``,
  ``D [H]``, ``gate_norm [d_inner]``, ``out_proj [d_inner, d]`` (+ ``out_proj_bias``);
* mlp: ``norm``, ``w_up [d, F]``, ``w_gate [d, F]`` (gated), ``w_down [F, d]`` (+ ``b_*``);
* moe: ``norm``, ``router [d, E]``, ``e_bias [E]`` (sigmoid routing), ``w_up``/``w_gate``
  ``[E, d', F]``, ``w_down [E, F, d']``, ``shared`` (an mlp dict), ``fc1 [d, d']`` /
  ``fc2 [d', d]`` (latent projections, + ``fc1_b``, ``fc2_b``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import PartitionSpec as P

from kvjax.models.attention import (
    AttnSpec, apply_rope, attention_mixer, attention_query, linear, padded_stream, rms_norm,
)
from kvjax.models.hf.fields import check_number, field, refuse
from kvjax.models.interface import CacheSizes, PoolSpec
from kvjax.models.mamba_layer import MambaSpec, decay_rate, decay_rates, gated_rms_norm, mamba_mixer
from kvjax.models.moe import MLPSpec, MoESpec, mlp, moe_ffn
from kvjax.models.step_context import StepContext

DATA, MODEL = "data", "model"
BLOCK_KINDS = ("attn", "mamba", "mlp", "moe")
PARAM_DTYPES = ("float32", "bfloat16")
_FP8_MAX = 448.0


@dataclasses.dataclass(frozen=True)
class Block:
    """One residual block: ``x + residual_multiplier * mixer(rms_norm(x))``."""

    kind: str
    residual_multiplier: float = 1.0

    def __post_init__(self):
        if self.kind not in BLOCK_KINDS:
            raise ValueError(f"Block.kind must be one of {BLOCK_KINDS}, got {self.kind!r}")


@dataclasses.dataclass(frozen=True)
class HybridConfig:
    """Everything that changes the math of a hybrid model (hashable: a ``jit`` static).

    Attributes:
      architecture: the Hugging Face ``architectures[0]`` it was read from.
      vocab_size, d_model, rms_eps: embedding rows, residual width, every RMS norm's epsilon.
      blocks: the residual blocks in order.
      attn, mamba, mlp, moe: the mixers' specs (None when no block uses them); ``attn`` /
        ``mamba`` give one tensor-parallel shard's heads when ``tp > 1``.
      moe_shared: the shared expert of the ``"moe"`` blocks (None: none).
      moe_latent: width of the latent projections around the routed experts (None: none).
      attn_bias, mlp_bias, mamba_proj_bias, mamba_conv_bias, moe_e_bias: which biases exist.
      embedding_multiplier: scales the embeddings; logits_scaling: divides the logits.
      tie_embeddings: the head is ``embed.T``.
      dtype: the params' dtype (``"float32"`` or ``"bfloat16"``); KV pools with
        ``kv_cache_dtype="auto"`` use it too.
      ssm_state_dtype: the SSM state pools' dtype (conv states are float32).
      tp: tensor-parallel shards this config is one of (1: the whole model).
    """

    architecture: str
    vocab_size: int
    d_model: int
    rms_eps: float
    blocks: tuple[Block, ...]
    attn: AttnSpec | None = None
    mamba: MambaSpec | None = None
    mlp: MLPSpec | None = None
    moe: MoESpec | None = None
    moe_shared: MLPSpec | None = None
    moe_latent: int | None = None
    attn_bias: bool = False
    mlp_bias: bool = False
    mamba_proj_bias: bool = False
    mamba_conv_bias: bool = True
    moe_e_bias: bool = False
    embedding_multiplier: float = 1.0
    logits_scaling: float = 1.0
    tie_embeddings: bool = False
    dtype: str = "float32"
    ssm_state_dtype: str = "float32"
    tp: int = 1

    def __post_init__(self):
        object.__setattr__(self, "blocks", tuple(self.blocks))
        if self.dtype not in PARAM_DTYPES:
            raise ValueError(f"dtype must be one of {PARAM_DTYPES}, got {self.dtype!r}")
        kinds = {b.kind for b in self.blocks}
        for kind, spec in (("attn", self.attn), ("mamba", self.mamba), ("mlp", self.mlp),
                           ("moe", self.moe)):
            if kind in kinds and spec is None:
                raise ValueError(f"HybridConfig: {kind!r} blocks need the {kind} spec")

    def count(self, kind: str) -> int:
        return sum(b.kind == kind for b in self.blocks)


# ----------------------------------------------------------------------------- params


def _shapes(c: HybridConfig) -> dict:
    """The param tree as shape tuples (see the module docstring)."""
    d = c.d_model

    def block(b: Block) -> dict:
        p: dict[str, Any] = {"norm": (d,)}
        if b.kind == "attn":
            a = c.attn
            q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
            p.update(wq=(d, q), wk=(d, kv), wv=(d, kv), wo=(q, d))
            if c.attn_bias:
                p.update(bq=(q,), bk=(kv,), bv=(kv,), bo=(d,))
        elif b.kind == "mamba":
            m = c.mamba
            p.update(in_proj=(d, m.in_proj_dim), conv_weight=(m.conv_dim, m.conv_width),
                     dt_bias=(m.num_heads,), A_log=(m.num_heads,), D=(m.num_heads,),
                     gate_norm=(m.d_inner,), out_proj=(m.d_inner, d))
            if c.mamba_conv_bias:
                p["conv_bias"] = (m.conv_dim,)
            if c.mamba_proj_bias:
                p.update(in_proj_bias=(m.in_proj_dim,), out_proj_bias=(d,))
        elif b.kind == "mlp":
            p.update(_mlp_shapes(d, c.mlp, c.mlp_bias))
        else:
            e = c.moe
            dl = c.moe_latent or d
            p.update(router=(d, e.num_experts), w_up=(e.num_experts, dl, e.hidden),
                     w_down=(e.num_experts, e.hidden, dl))
            if e.gated:
                p["w_gate"] = (e.num_experts, dl, e.hidden)
            if c.moe_e_bias:
                p["e_bias"] = (e.num_experts,)
            if c.moe_shared is not None:
                p["shared"] = _mlp_shapes(d, c.moe_shared, c.mlp_bias)
            if c.moe_latent is not None:
                p.update(fc1=(d, dl), fc2=(dl, d))
                if c.mlp_bias:
                    p.update(fc1_b=(dl,), fc2_b=(d,))
        return p

    tree = {"embed": (c.vocab_size, d), "final_norm": (d,), "blocks": tuple(block(b) for b in c.blocks)}
    if not c.tie_embeddings:
        tree["lm_head"] = (d, c.vocab_size)
    return tree


def _mlp_shapes(d: int, s: MLPSpec, bias: bool) -> dict:
    p = {"w_up": (d, s.hidden), "w_down": (s.hidden, d)}
    if s.gated:
        p["w_gate"] = (d, s.hidden)
    if bias:
        p.update(b_up=(s.hidden,), b_down=(d,))
        if s.gated:
            p["b_gate"] = (s.hidden,)
    return p


def _is_shape(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(n, int) for n in x)


def leaf_dtype(config: HybridConfig, shape: tuple[int, ...]) -> np.dtype:
    """Storage dtype of a param: 1-D params float32, matrices the model dtype."""
    if len(shape) <= 1:
        return np.dtype(np.float32)
    return np.dtype(ml_dtypes.bfloat16) if config.dtype == "bfloat16" else np.dtype(np.float32)


def path_tuple(path) -> tuple:
    """A JAX key path -> a tuple of dict keys / sequence indices."""
    out = []
    for k in path:
        out.append(k.key if hasattr(k, "key") else k.idx if hasattr(k, "idx") else str(k))
    return tuple(out)


def _random_params(c: HybridConfig, seed: int) -> dict:
    rng = np.random.default_rng(seed)

    def init(path, shape):
        name = path[-1]
        if name in ("norm", "final_norm", "gate_norm", "D"):
            a = np.ones(shape, np.float32)
        elif name == "A_log":
            a = np.log(np.arange(1, shape[0] + 1, dtype=np.float32))
        elif name == "dt_bias":
            dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), shape)).astype(np.float32)
            a = dt + np.log(-np.expm1(-dt))
        elif len(shape) == 1:
            a = np.zeros(shape, np.float32)
        else:
            a = (rng.standard_normal(shape) * 0.05).astype(np.float32)
        return jnp.asarray(a.astype(leaf_dtype(c, shape)))

    return jax.tree_util.tree_map_with_path(lambda p, s: init(path_tuple(p), s), _shapes(c),
                                            is_leaf=_is_shape)


# --------------------------------------------------------------- tensor parallel layout


def _mamba_layout(a: np.ndarray, name: str, m: MambaSpec, M: int) -> np.ndarray:
    """A whole model's Mamba param -> ``M`` shards' slices concatenated (each shard's ``[z | x |
    B | C | dt]`` of its heads and groups; B and C repeated in every shard when ``G == 1``)."""
    di, H, G, N = m.d_inner, m.num_heads, m.n_groups, m.d_state
    dl, Hl = di // M, H // M
    per_group = G % M == 0 and G > 1
    Gl = G // M if per_group else G

    def bc(part, s):  # B or C columns of shard s: [.., G*N] slice
        return part[..., s * Gl * N:(s + 1) * Gl * N] if per_group else part

    def xbc_cols(v, s):  # v [..., conv_dim] -> shard s's [x | B | C]
        x, B, C = v[..., :di], v[..., di:di + G * N], v[..., di + G * N:]
        return np.concatenate([x[..., s * dl:(s + 1) * dl], bc(B, s), bc(C, s)], -1)

    if name in ("in_proj", "in_proj_bias"):
        z, xbc, dt = a[..., :di], a[..., di:di + m.conv_dim], a[..., di + m.conv_dim:]
        return np.concatenate([np.concatenate(
            [z[..., s * dl:(s + 1) * dl], xbc_cols(xbc, s), dt[..., s * Hl:(s + 1) * Hl]], -1)
            for s in range(M)], -1)
    if name in ("conv_weight", "conv_bias"):
        t = a.T if a.ndim == 2 else a  # channels last
        out = np.concatenate([xbc_cols(t, s) for s in range(M)], -1)
        return out.T if a.ndim == 2 else out
    return a


_ATTN_SPECS = {"wq": P(None, MODEL), "wk": P(None, MODEL), "wv": P(None, MODEL), "wo": P(MODEL, None),
               "bq": P(MODEL), "bk": P(MODEL), "bv": P(MODEL)}
_MAMBA_SPECS = {"in_proj": P(None, MODEL), "in_proj_bias": P(MODEL), "conv_weight": P(MODEL, None),
                "conv_bias": P(MODEL), "dt_bias": P(MODEL), "A_log": P(MODEL), "D": P(MODEL),
                "gate_norm": P(MODEL), "out_proj": P(MODEL, None)}
_EXPERT_SPECS = {"w_up": P(DATA, None, None), "w_gate": P(DATA, None, None), "w_down": P(DATA, None, None)}


# ----------------------------------------------------------------------------- the model


@dataclasses.dataclass(frozen=True)
class HybridModel:
    """:class:`kvjax.models.interface.Model` of a :class:`HybridConfig` (hashable).

    Pools (in block order): per attention block ``blocks.{i}.k`` / ``blocks.{i}.v``
    (``kv_layout="flash"``, ``[kernel blocks, block size, Hkv, D]``) or ``blocks.{i}.kv``
    (``"rpa"``, ``2 * Hkv`` combined heads), KV group 0; per Mamba block ``blocks.{i}.conv``
    (float32 ``[slots, conv_dim, W - 1 + num_spec_tokens]``) and ``blocks.{i}.ssm``
    (``[slots, H, P, N]``, ``ssm_state_dtype``).

    Tensor parallelism (:meth:`shard`): attention KV heads (with their query heads) and Mamba
    heads split over "model" (``n_groups`` must be 1 or a multiple of the shards; the gated
    norm's groups then stay whole in a shard, or its one group is reduced over the axis);
    dense MLPs, the embedding and the head are replicated; routed experts split over "data".
    The pools of :meth:`shard`'s model are one shard's: the whole pool is ``M`` of them
    along the axis named ``"model"``.
    """

    config: HybridConfig

    # -- interface attributes
    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def kv_groups(self) -> tuple[int, ...]:
        return (0,) if self.config.count("attn") else ()

    @property
    def uses_state(self) -> bool:
        return self.config.count("mamba") > 0

    @property
    def description(self) -> str:
        c = self.config
        kinds = ", ".join(f"{c.count(k)} {k}" for k in BLOCK_KINDS if c.count(k))
        return f"{c.architecture} ({len(c.blocks)} blocks: {kinds}; {c.dtype})"

    # -- pools
    def pool_specs(self, sizes: CacheSizes) -> tuple[PoolSpec, ...]:
        c = self.config
        rpa = sizes.kv_layout == "rpa"
        if sizes.kv_cache_dtype == "auto":
            kv_dtype = np.dtype(ml_dtypes.bfloat16).name if c.dtype == "bfloat16" else "float32"
        else:
            kv_dtype = "float8_e4m3fn"
        specs = []
        for i, b in enumerate(c.blocks):
            if b.kind == "attn":
                a = c.attn
                shape = (sizes.num_kernel_blocks, sizes.kernel_block_size,
                         a.num_kv_heads * (2 if rpa else 1), a.head_dim)
                axes = (None, None, MODEL, None)
                for n in (("kv",) if rpa else ("k", "v")):
                    specs.append(PoolSpec(f"blocks.{i}.{n}", "kv", shape, kv_dtype, axes, 0))
            elif b.kind == "mamba":
                m = c.mamba
                specs.append(PoolSpec(
                    f"blocks.{i}.conv", "state",
                    (sizes.num_state_slots, m.conv_dim, m.conv_width - 1 + sizes.num_spec_tokens),
                    "float32", (None, MODEL, None)))
                specs.append(PoolSpec(
                    f"blocks.{i}.ssm", "state",
                    (sizes.num_state_slots, m.num_heads, m.head_dim, m.d_state),
                    c.ssm_state_dtype, (None, MODEL, None, None)))
        return tuple(specs)

    # -- params
    def param_shapes(self) -> dict:
        """The param tree as shape tuples (this shard's when ``tp > 1``)."""
        return _shapes(self.config)

    def init_params(self, seed: int = 0):
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(f"seed must be an int, got {seed!r}")
        return _random_params(self.config, seed)

    def param_spec(self, path: tuple) -> P:
        """The PartitionSpec of the param at ``path`` (a tuple of keys / indices)."""
        if path[0] != "blocks" or len(path) < 3:
            return P()
        kind = self.config.blocks[path[1]].kind
        name = path[-1]
        if kind == "attn":
            return _ATTN_SPECS.get(name, P())
        if kind == "mamba":
            return _MAMBA_SPECS.get(name, P())
        if kind == "moe" and len(path) == 3:
            return _EXPERT_SPECS.get(name, P())
        return P()

    def param_partitioning(self, params):
        return jax.tree_util.tree_map_with_path(lambda p, _: self.param_spec(path_tuple(p)), params)

    def check_mesh(self, data: int, model: int) -> None:
        """ValueError unless this model splits ``data`` x ``model`` ways."""
        c = self.config
        if c.moe is not None and c.count("moe") and c.moe.num_experts % data:
            raise ValueError(f"{c.architecture}: num_experts={c.moe.num_experts} must be a multiple of "
                             f"the data axis size {data} (experts are sharded over 'data')")
        self.shard(model)

    def shard(self, model_size: int) -> "HybridModel":
        M = model_size
        c = self.config
        if not isinstance(M, int) or M < 1:
            raise ValueError(f"model_size must be a positive int, got {M!r}")
        if M == 1:
            return self
        if c.tp != 1:
            raise ValueError(f"shard() of a model that is already one of {c.tp} shards")
        attn, mamba = c.attn, c.mamba
        if attn is not None and c.count("attn"):
            if attn.num_kv_heads % M:
                raise ValueError(f"{c.architecture}: model={M} must divide num_key_value_heads="
                                 f"{attn.num_kv_heads} (attention heads are sharded over 'model')")
            attn = dataclasses.replace(attn, num_heads=attn.num_heads // M,
                                       num_kv_heads=attn.num_kv_heads // M)
        if mamba is not None and c.count("mamba"):
            G = mamba.n_groups
            if mamba.num_heads % M or not (G == 1 or G % M == 0):
                raise ValueError(f"{c.architecture}: model={M} must divide the Mamba heads "
                                 f"({mamba.num_heads}) and n_groups ({G}) unless n_groups == 1")
            local_groups = G // M if G > 1 else 1
            mamba = dataclasses.replace(
                mamba, num_heads=mamba.num_heads // M, n_groups=local_groups,
                norm_groups=max(mamba.norm_groups // M, 1), norm_spans_shards=mamba.norm_groups == 1)
        return HybridModel(dataclasses.replace(c, attn=attn, mamba=mamba, tp=M))

    def layout_leaf(self, path: tuple, array: np.ndarray, model_size: int) -> np.ndarray:
        """One host param of the whole model, reordered for ``model_size`` shards."""
        if model_size == 1 or path[0] != "blocks" or self.config.blocks[path[1]].kind != "mamba":
            return array
        return _mamba_layout(np.asarray(array), path[-1], self.config.mamba, model_size)

    def layout_for_shards(self, params, model_size: int):
        if model_size == 1:
            return params
        return jax.tree_util.tree_map_with_path(
            lambda p, a: self.layout_leaf(path_tuple(p), np.asarray(a), model_size), params)

    # -- the paged step
    def apply(self, params, ctx: StepContext, pools: dict, *, backend: str, sizes: CacheSizes,
              expert_axis: str | None = None, model_axis: str | None = None):
        c = self.config
        pools = dict(pools)
        emb = params["embed"]
        x = jnp.take(emb, ctx.input_ids, axis=0, mode="clip").astype(jnp.float32)  # ids validated upstream
        if c.embedding_multiplier != 1.0:
            x = x * jnp.float32(c.embedding_multiplier)
        T = x.shape[0]
        x, token_mask = padded_stream(x, ctx.token_real)  # row_count(T) rows
        real = token_mask[:, None]
        mamba = {i: j for j, i in enumerate(i for i, b in enumerate(c.blocks) if b.kind == "mamba")}
        rates = decay_rates([params["blocks"][i]["A_log"] for i in mamba]) if mamba else None
        for i, b in enumerate(c.blocks):
            p = params["blocks"][i]
            h = rms_norm(x, p["norm"], c.rms_eps)
            if b.kind == "attn":
                rpa = sizes.kv_layout == "rpa"
                kname = f"blocks.{i}.kv" if rpa else f"blocks.{i}.k"
                out, kc, vc = attention_mixer(
                    h, ctx, pools[kname], None if rpa else pools[f"blocks.{i}.v"], p, c.attn,
                    kv_cache_dtype=sizes.kv_cache_dtype, backend=backend, kv_layout=sizes.kv_layout,
                    model_axis=model_axis)
                pools[kname] = kc
                if not rpa:
                    pools[f"blocks.{i}.v"] = vc
            elif b.kind == "mamba":
                out, pools[f"blocks.{i}.conv"], pools[f"blocks.{i}.ssm"] = mamba_mixer(
                    h, ctx, pools[f"blocks.{i}.conv"], pools[f"blocks.{i}.ssm"], p, c.mamba,
                    backend=backend, model_axis=model_axis, A=decay_rate(rates, mamba[i]))
            else:
                out = self._ffn(b, p, h, expert_axis, backend, token_mask=token_mask, num_tokens=T)
            if b.residual_multiplier != 1.0:
                out = out * jnp.float32(b.residual_multiplier)
            x = x + jnp.where(real, out, 0.0)
        return self._head(params, x[ctx.logits_indices]), pools

    def _ffn(self, b: Block, p: dict, h, expert_axis, backend: str = "reference", token_mask=None,
             num_tokens=None):
        """Block ``b``'s MLP or MoE; ``token_mask [T]``: the step's real tokens (padding is routed
        to no expert); ``num_tokens``: the step's tokens are ``h``'s first rows
        (:func:`~kvjax.models.moe.routed_ffn`)."""
        c = self.config
        if b.kind == "mlp":
            return mlp(h, p, c.mlp)
        hl = linear(h, p["fc1"], p.get("fc1_b")) if c.moe_latent is not None else h
        out = moe_ffn(hl, p, c.moe, expert_axis, route_input=None if c.moe_latent is None else h,
                      backend=backend, token_mask=token_mask, num_tokens=num_tokens)
        if c.moe_latent is not None:
            out = linear(out, p["fc2"], p.get("fc2_b"))
        if c.moe_shared is not None:
            out = out + mlp(h, p["shared"], c.moe_shared)
        return out

    def _head(self, params, x):
        c = self.config
        h = rms_norm(x, params["final_norm"], c.rms_eps)
        head = params["embed"].T if c.tie_embeddings else params["lm_head"]
        logits = linear(h, head)
        if c.logits_scaling != 1.0:
            logits = logits / jnp.float32(c.logits_scaling)
        return logits

    # -- the dense oracle
    def dense_logits(self, params, tokens, *, kv_cache_dtype: str = "auto"):
        tokens = jnp.asarray(tokens)
        if tokens.ndim != 1 or tokens.shape[0] == 0:
            raise ValueError(f"tokens must have shape [n] with n >= 1, got {list(tokens.shape)}")
        if kv_cache_dtype not in ("auto", "fp8", "fp8_e4m3"):
            raise ValueError(f"kv_cache_dtype must be 'auto', 'fp8' or 'fp8_e4m3', got {kv_cache_dtype!r}")
        return _dense(params, self, tokens.astype(jnp.int32), kv_cache_dtype != "auto")


# --------------------------------------------------------------------------- dense path


def _fp8_round_trip(x, scale):
    q = jnp.clip(x / scale, -_FP8_MAX, _FP8_MAX).astype(jnp.float8_e4m3fn)
    bits = jax.lax.bitcast_convert_type(q, jnp.uint8).astype(jnp.int32)
    table = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return jnp.asarray(table)[bits] * scale


def _dense_attn(p, a: AttnSpec, h, fp8: bool):
    n = h.shape[0]
    q = linear(h, p["wq"], p.get("bq")).reshape(n, a.num_heads, a.head_dim)
    k = linear(h, p["wk"], p.get("bk")).reshape(n, a.num_kv_heads, a.head_dim)
    v = linear(h, p["wv"], p.get("bv")).reshape(n, a.num_kv_heads, a.head_dim)
    if a.rope_theta is not None:
        pos = jnp.arange(n, dtype=jnp.int32)
        q, k = apply_rope(q, pos, a.rope_theta, a.rotary_dim), apply_rope(k, pos, a.rope_theta, a.rotary_dim)
    q = attention_query(q, p["wq"].dtype).astype(jnp.float32)
    if fp8:
        k, v = _fp8_round_trip(k, a.k_scale), _fp8_round_trip(v, a.v_scale)
    elif p["wq"].dtype != jnp.float32:  # an "auto" cache of a bf16 model stores K/V in bf16
        k, v = k.astype(p["wq"].dtype).astype(jnp.float32), v.astype(p["wq"].dtype).astype(jnp.float32)
    rep = a.num_heads // a.num_kv_heads
    k, v = jnp.repeat(k, rep, axis=1), jnp.repeat(v, rep, axis=1)
    scale = a.sm_scale if a.sm_scale is not None else 1.0 / math.sqrt(a.head_dim)
    s = jnp.einsum("qhd,khd->hqk", q, k) * scale
    s = jnp.where(np.tril(np.ones((n, n), bool)), s, -jnp.inf)
    o = jnp.einsum("hqk,khd->qhd", jax.nn.softmax(s, axis=-1), v).reshape(n, -1)
    out = linear(o, p["wo"])
    return out if p.get("bo") is None else out + p["bo"]


def _dense_mamba(p, m: MambaSpec, h):
    n = h.shape[0]
    H, P_, N, G, W, di = m.num_heads, m.head_dim, m.d_state, m.n_groups, m.conv_width, m.d_inner
    proj = linear(h, p["in_proj"], p.get("in_proj_bias"))
    z, xbc, dt = proj[:, :di], proj[:, di:di + m.conv_dim], proj[:, di + m.conv_dim:]
    padded = jnp.concatenate([jnp.zeros((W - 1, m.conv_dim), jnp.float32), xbc], axis=0)
    wconv = p["conv_weight"].astype(jnp.float32)
    conv = sum(wconv[:, j] * padded[j:j + n] for j in range(W))
    if p.get("conv_bias") is not None:
        conv = conv + p["conv_bias"]
    conv = jax.nn.silu(conv)
    xs = conv[:, :di].reshape(n, H, P_)
    Bh = jnp.repeat(conv[:, di:di + G * N].reshape(n, G, N), H // G, axis=1)
    Ch = jnp.repeat(conv[:, di + G * N:].reshape(n, G, N), H // G, axis=1)
    delta = jnp.clip(jax.nn.softplus(dt + p["dt_bias"]), *m.dt_limit)  # [n, H]
    A = -jnp.exp(p["A_log"])

    def step(state, inp):
        xt, dtt, bt, ct = inp
        state = state * jnp.exp(dtt * A)[:, None, None] + (dtt[:, None] * xt)[:, :, None] * bt[:, None, :]
        return state, jnp.einsum("hpn,hn->hp", state, ct)

    _, y = jax.lax.scan(step, jnp.zeros((H, P_, N), jnp.float32), (xs, delta, Bh, Ch))
    y = (y + p["D"][None, :, None] * xs).reshape(n, di) * jax.nn.silu(z)
    y = gated_rms_norm(y, p["gate_norm"], m.rms_eps, m.norm_groups)
    out = linear(y, p["out_proj"])
    return out if p.get("out_proj_bias") is None else out + p["out_proj_bias"]


@functools.partial(jax.jit, static_argnames=("model", "fp8"))
def _dense(params, model: HybridModel, tokens, fp8: bool):
    c = model.config
    if c.tp != 1:
        raise ValueError("dense_logits runs on the whole model, not on one tensor-parallel shard")
    x = params["embed"][tokens].astype(jnp.float32) * jnp.float32(c.embedding_multiplier)
    for i, b in enumerate(c.blocks):
        p = params["blocks"][i]
        h = rms_norm(x, p["norm"], c.rms_eps)
        if b.kind == "attn":
            out = _dense_attn(p, c.attn, h, fp8)
        elif b.kind == "mamba":
            out = _dense_mamba(p, c.mamba, h)
        else:
            out = model._ffn(b, p, h, None)
        x = x + out * jnp.float32(b.residual_multiplier)
    return model._head(params, x)


# ------------------------------------------------------------ checkpoint tensor plans


@dataclasses.dataclass(frozen=True)
class Entry:
    """One param leaf built from checkpoint tensors: ``leaf = fn(*[get(s) for s in sources])``."""

    path: tuple
    sources: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    fn: Callable[..., np.ndarray]


def linear_t(a):
    """A torch ``Linear`` weight ``[out, in]`` -> ``[in, out]``."""
    return np.asarray(a).T


def conv_w(a):
    """A depthwise ``Conv1d`` weight ``[C, 1, W]`` -> ``[C, W]``."""
    return np.asarray(a)[:, 0, :]


def same(a):
    return np.asarray(a)


def head_entries(c: "HybridConfig", embed: str, final_norm: str) -> list[Entry]:
    """The plan's embedding, final norm and (untied) lm head, from their checkpoint names."""
    d, V = c.d_model, c.vocab_size
    plan = [Entry(("embed",), (embed,), ((V, d),), same), Entry(("final_norm",), (final_norm,), ((d,),), same)]
    if not c.tie_embeddings:
        plan.append(Entry(("lm_head",), ("lm_head.weight",), ((V, d),), linear_t))
    return plan


def expected_from_plan(plan: list[Entry]) -> dict[str, tuple[int, ...]]:
    out: dict[str, tuple[int, ...]] = {}
    for e in plan:
        for name, shape in zip(e.sources, e.shapes):
            out[name] = tuple(shape)
    return out


def params_from_plan(config: HybridConfig, plan: list[Entry], get, put=None) -> dict:
    """Build the param tree entry by entry (each leaf converted to its dtype, then ``put``)."""
    shapes = _shapes(config)
    put = put or (lambda path, a: jnp.asarray(a))
    tree = jax.tree.map(lambda s: None, shapes, is_leaf=_is_shape)
    tree = _thaw(tree)
    want = {path_tuple(p): s for p, s in jax.tree_util.tree_flatten_with_path(shapes, is_leaf=_is_shape)[0]}
    for e in plan:
        arr = e.fn(*[get(s) for s in e.sources])
        shape = want.get(e.path)
        if shape is None or tuple(arr.shape) != shape:  # a plan bug, not a checkpoint's
            raise AssertionError(f"tensor plan: {e.path} built {arr.shape}, model expects {shape}")
        leaf = put(e.path, np.ascontiguousarray(arr).astype(leaf_dtype(config, shape)))
        node = tree
        for k in e.path[:-1]:
            node = node[k]
        node[e.path[-1]] = leaf
    missing = [p for p in want if _get(tree, p) is None]
    if missing:
        raise AssertionError(f"tensor plan leaves params unset: {missing[:5]}")
    return _freeze(tree)


def plan_protocol(plan: Callable[[HybridConfig], list[Entry]]):
    """``(expected_tensors, params_from_tensors)`` of the loader protocol from an architecture's
    tensor plan (:mod:`kvjax.models.hf.loader`)."""

    def expected_tensors(config: HybridConfig) -> dict[str, tuple[int, ...]]:
        return expected_from_plan(plan(config))

    def params_from_tensors(config: HybridConfig, get, dtype: str = "float32", put=None):
        if config.dtype != dtype:
            config = dataclasses.replace(config, dtype=dtype)
        return params_from_plan(config, plan(config), get, put)

    return expected_tensors, params_from_tensors


def _thaw(t):
    if isinstance(t, dict):
        return {k: _thaw(v) for k, v in t.items()}
    if isinstance(t, (tuple, list)):
        return [_thaw(v) for v in t]
    return t


def _freeze(t):
    if isinstance(t, dict):
        return {k: _freeze(v) for k, v in t.items()}
    if isinstance(t, list):
        return tuple(_freeze(v) for v in t)
    return t


def _get(t, path):
    for k in path:
        t = t[k]
    return t


# ----------------------------------------------------------- config.json fields of the hybrids


def check_dt_limit(arch: str, cfg: dict, name: str = "time_step_limit") -> tuple[float, float]:
    v = field(arch, cfg, name, [0.0, math.inf])
    if not isinstance(v, (list, tuple)) or len(v) != 2:
        raise ValueError(f"{arch}: config.json field {name} must be [min, max], got {v!r}")
    lo = check_number(arch, name, v[0], lo=0.0)
    hi = check_number(arch, name, v[1], lo=0.0, allow_inf=True)
    if not 0.0 <= lo <= hi:
        raise ValueError(f"{arch}: config.json field {name} must have 0 <= min <= max, got {v!r}")
    return lo, hi


def check_common(arch: str, cfg: dict) -> None:
    """Fields every hybrid architecture refuses: quantised weights."""
    q = field(arch, cfg, "quantization_config", null=None)
    if q is not None:
        method = q.get("quant_method", q) if isinstance(q, dict) else q
        refuse(arch, "quantization_config", method, "quantised checkpoints are not supported; "
               "kvjax loads float32 / bfloat16 / float16 weights")


def remap_layer_type(t: str) -> str:
    """transformers' legacy layer-type names -> the current ones."""
    return {"mamba": "linear_attention", "attention": "full_attention"}.get(t, t)
