"""DeepSeek-V3 (``DeepseekV3ForCausalLM``) from a Hugging Face checkpoint, on kvjax's model interface.

The loader dispatches on four names: :func:`config_from_hf` (``config.json`` -> a frozen,
hashable :class:`DeepseekV3Config`; ``ValueError`` naming any unsupported field before a
weight is read), :func:`expected_tensors` (checkpoint tensor names and shapes),
:func:`params_from_tensors` (tensors -> host params) and :class:`DeepseekV3` (the
:class:`~kvjax.models.interface.Model`).

The math follows transformers' ``modeling_deepseek_v3`` (the oracle of the tests):

* decoder layer: ``x += attn(rms(x)); x += mlp(rms(x))``; the first
  ``first_k_dense_replace`` layers have a SwiGLU MLP, the others a MoE;
* MLA (:mod:`kvjax.models.hf.mla`): ``q = q_b(rms_q(q_a(h)))`` (or ``q_proj(h)`` when
  ``q_lora_rank`` is None), split ``[nope | rope]``; ``kv_a(h) = [c | k_pe]``,
  ``c = rms_kv(c)``; RoPE on ``q_pe`` and ``k_pe`` (interleaved pairs when
  ``rope_interleave``; default or YaRN frequencies); the latent cache holds
  ``concat(c, k_pe)``; ``kv_b`` up-projects ``c`` to per-head ``k_nope`` and ``v``;
  softmax scale ``qk_head_dim ** -0.5`` (times YaRN's ``mscale(factor, mscale_all_dim) ** 2``).
  ``q_a_layernorm`` and ``kv_a_layernorm`` use eps ``1e-6`` whatever ``rms_norm_eps`` is
  (transformers builds them with the default);
* MoE: ``scores = sigmoid(h @ router)`` in float32; experts are chosen on
  ``scores + e_score_correction_bias`` among the ``topk_group`` groups (of ``n_group``)
  whose two best biased scores sum highest; weights are the unbiased scores of the
  chosen experts, divided by their sum when ``norm_topk_prob``, times
  ``routed_scaling_factor``; plus ``n_shared_experts`` shared experts (one SwiGLU of
  width ``moe_intermediate_size * n_shared_experts``) on every token.

Parallelism: ``model_axis`` splits the attention heads (``q``, ``kv_b``, ``o``) and the
dense / shared MLP's intermediate width (partial outputs ``psum``-ed); the latent cache is
per token, not per head, so every model rank holds and writes the whole of it.
``expert_axis`` splits the routed experts: each member gathers every member's tokens,
applies its own experts and ``psum_scatter``-s the partial outputs back; the routed experts
are applied by :func:`kvjax.models.moe.routed_ffn` (the rule every MoE here shares: the
GPU's grouped-matmul kernel, or elsewhere dense batched over the expert axis, or only the
chosen experts' weights for few tokens). On the grouped kernel's path, without a mesh axis and
for steps of at most :data:`SHARED_IN_GROUPED_MAX_TOKENS` tokens, the shared experts run inside
the routed experts' launches, their weights read in place as ``n_shared_experts`` more experts.

Not served (``ValueError`` from :func:`config_from_hf`): RoPE types other than
``default`` / ``yarn``, ``partial_rotary_factor != 1``, ``quantization_config`` (fp8
block-quantised weights), ``topk_method`` other than ``noaux_tc``, ``scoring_func`` other
than ``sigmoid``, ``moe_layer_freq != 1``, ``num_key_value_heads != num_attention_heads``,
``hidden_act != silu``, ``n_shared_experts < 1``. MTP layers (``num_nextn_predict_layers``)
are not part of the causal LM's forward; their tensors are not read.
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

from kvjax.models.attention import dot_operands, pad_rows, padded_stream, row_padded, self_attention_impl
from kvjax.models.hf import fields as fl
from kvjax.models.hf.mla import MLA_FORMS, paged_latent_attention, rope, split_latent_attention, step_form
from kvjax.models.interface import CacheSizes, PoolSpec
from kvjax.models.moe import MoESpec, check_expert_groups, choose_path, route_rule, routed_ffn
from kvjax.models.step_context import StepContext
from pallas_kernels.moe_route import moe_route
from pallas_kernels.kv_write import concat_and_cache_mla

ARCHITECTURE = "DeepseekV3ForCausalLM"
_WHERE = "DeepSeek-V3 config"  # the prefix of DeepseekV3Config's own refusals (a config built in code)
_SUB_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: transformers' DeepseekV3RMSNorm default
_FP8_MAX = 448.0
_DATA, _MODEL = "data", "model"

# transformers' DeepseekV3Config defaults for fields a config.json may leave out.
_DEFAULTS = dict(
    vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    num_hidden_layers=61, num_attention_heads=128, n_shared_experts=1, n_routed_experts=256,
    routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
    v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8,
    first_k_dense_replace=3, norm_topk_prob=True, hidden_act="silu", max_position_embeddings=4096,
    rms_norm_eps=1e-6, tie_word_embeddings=False, rope_interleave=True, attention_bias=False,
)
_ROPE_TYPES = ("default", "yarn")
_YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
              "mscale_all_dim", "attention_factor", "truncate")


@dataclasses.dataclass(frozen=True)
class DeepseekV3Config:
    """The fields of a ``DeepseekV3ForCausalLM`` config that change the math (hashable).

    ``rope_type`` is ``"default"`` or ``"yarn"``; the ``yarn_*`` fields are used only for
    YaRN (``yarn_attention_factor`` None: derived from ``factor``, ``mscale``, ``mscale_all_dim``).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    n_shared_experts: int
    n_routed_experts: int
    routed_scaling_factor: float
    kv_lora_rank: int
    q_lora_rank: int | None
    qk_rope_head_dim: int
    v_head_dim: int
    qk_nope_head_dim: int
    n_group: int
    topk_group: int
    num_experts_per_tok: int
    first_k_dense_replace: int
    norm_topk_prob: bool
    rms_norm_eps: float
    rope_theta: float
    rope_interleave: bool
    attention_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    rope_type: str = "default"
    yarn_factor: float = 1.0
    yarn_original_max_position_embeddings: int = 0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float | None = None
    yarn_mscale_all_dim: float | None = None
    yarn_attention_factor: float | None = None
    yarn_truncate: bool = True
    num_nextn_predict_layers: int = 1  # MTP layers after the causal LM's (not read)

    def __post_init__(self):
        _validate(self)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one latent cache row: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_k_dense_replace

    def rope_inv_freq(self) -> np.ndarray:
        """float32 ``[qk_rope_head_dim / 2]`` inverse frequencies (default or YaRN)."""
        dim, base = self.qk_rope_head_dim, self.rope_theta
        pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
        inv = (1.0 / pos_freqs).astype(np.float32)
        if self.rope_type == "default":
            return inv
        factor = self.yarn_factor
        orig = self.yarn_original_max_position_embeddings

        def corr_dim(rot):
            return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

        low, high = corr_dim(self.yarn_beta_fast), corr_dim(self.yarn_beta_slow)
        if self.yarn_truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
        extrap = (1 - ramp).astype(np.float32)
        interp = (1.0 / (np.float32(factor) * pos_freqs)).astype(np.float32)
        return (interp * (1 - extrap) + inv * extrap).astype(np.float32)

    @property
    def rope_attention_factor(self) -> float:
        """The factor on cos / sin (YaRN; 1 otherwise)."""
        if self.rope_type == "default":
            return 1.0
        if self.yarn_attention_factor is not None:
            return float(self.yarn_attention_factor)
        f = self.yarn_factor
        if self.yarn_mscale and self.yarn_mscale_all_dim:
            return float(_mscale(f, self.yarn_mscale) / _mscale(f, self.yarn_mscale_all_dim))
        return _mscale(f)

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim ** -0.5
        if self.rope_type != "default" and self.yarn_mscale_all_dim:
            m = _mscale(self.yarn_factor, self.yarn_mscale_all_dim)
            scale = scale * m * m
        return scale


def _mscale(scale, mscale=1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _validate(c: DeepseekV3Config) -> None:
    def pos_int(name, lo=1):
        fl.check_int_value(_WHERE, name, getattr(c, name), lo, label="field")

    for name in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                 "num_hidden_layers", "num_attention_heads", "n_shared_experts", "n_routed_experts",
                 "kv_lora_rank", "v_head_dim", "qk_nope_head_dim", "n_group", "topk_group",
                 "num_experts_per_tok", "max_position_embeddings"):
        pos_int(name)
    pos_int("qk_rope_head_dim", 2)
    pos_int("first_k_dense_replace", 0)
    pos_int("num_nextn_predict_layers", 0)
    if c.q_lora_rank is not None:
        pos_int("q_lora_rank")
    if c.qk_rope_head_dim % 2:
        raise ValueError(f"{_WHERE}: qk_rope_head_dim must be even, got {c.qk_rope_head_dim}")
    check_expert_groups(_WHERE, c.n_routed_experts, c.n_group, c.topk_group, c.num_experts_per_tok)
    for name in ("routed_scaling_factor", "rms_norm_eps", "rope_theta"):
        fl.check_number(_WHERE, name, getattr(c, name), positive=True, label="field")
    if c.rope_type not in _ROPE_TYPES:
        raise ValueError(f"{_WHERE}: rope type {c.rope_type!r} is not supported "
                         f"(supported: {_ROPE_TYPES})")
    if c.rope_type == "yarn":
        fl.check_number(_WHERE, "yarn_factor", c.yarn_factor, positive=True, label="field")
        pos_int("yarn_original_max_position_embeddings")


def _field(cfg: dict, name: str, **kw):
    """config.json field ``name`` by :func:`kvjax.models.hf.fields.field`, absent: transformers' default."""
    return fl.field(ARCHITECTURE, cfg, name, _DEFAULTS.get(name), **kw)


def config_from_hf(cfg: dict) -> DeepseekV3Config:
    """``config.json`` (a dict) -> :class:`DeepseekV3Config`; ``ValueError`` naming the field for
    anything this implementation does not compute as transformers does."""
    if not isinstance(cfg, dict):
        raise ValueError(f"config must be a dict (config.json), got {type(cfg).__name__}")
    mt = cfg.get("model_type", "deepseek_v3")
    if mt != "deepseek_v3":
        raise ValueError(f"model_type must be 'deepseek_v3' for {ARCHITECTURE}, got {mt!r}")
    archs = cfg.get("architectures")
    if archs is not None and ARCHITECTURE not in archs:
        raise ValueError(f"architectures must include {ARCHITECTURE!r}, got {archs!r}")

    refuse = functools.partial(fl.refuse, ARCHITECTURE)
    if cfg.get("quantization_config") is not None:
        refuse("quantization_config", cfg["quantization_config"],
               "quantised weights (e.g. fp8 block-scaled) are not read; convert the checkpoint to bf16/f32")
    act = _field(cfg, "hidden_act")
    if act != "silu":
        refuse("hidden_act", act, "only silu (SwiGLU) is implemented")
    if cfg.get("topk_method", "noaux_tc") != "noaux_tc":
        refuse("topk_method", cfg["topk_method"], "only 'noaux_tc' (sigmoid scores + correction bias, "
               "group-limited top-k, as transformers' DeepseekV3TopkRouter) is implemented")
    if cfg.get("scoring_func", "sigmoid") != "sigmoid":
        refuse("scoring_func", cfg["scoring_func"], "only 'sigmoid' is implemented")
    if cfg.get("moe_layer_freq", 1) != 1:
        refuse("moe_layer_freq", cfg["moe_layer_freq"], "every layer from first_k_dense_replace on is MoE")
    H = _field(cfg, "num_attention_heads")
    kvh = cfg.get("num_key_value_heads")
    if kvh is not None and kvh != H:
        refuse("num_key_value_heads", kvh, f"MLA up-projects one key/value per head; it must equal "
               f"num_attention_heads={H}")
    if cfg.get("pretraining_tp", 1) not in (1, None):
        refuse("pretraining_tp", cfg["pretraining_tp"], "only 1")

    rp = fl.rope_parameters(ARCHITECTURE, cfg, _ROPE_TYPES)
    rope_type = rp["rope_type"]
    prf = rp.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if prf not in (None, 1, 1.0):
        refuse("partial_rotary_factor", prf, "the whole qk_rope_head_dim is rotated")
    theta = fl.rope_number(ARCHITECTURE, cfg, rp, "rope_theta", 10000.0, positive=True)
    max_pos = _field(cfg, "max_position_embeddings")
    yarn = {}
    if rope_type == "yarn":
        unknown = sorted(set(rp) - set(_YARN_KEYS) - {"rope_type", "type", "rope_theta",
                                                        "partial_rotary_factor"})
        if unknown:
            refuse("rope_parameters", {k: rp[k] for k in unknown}, "unknown YaRN keys")
        if rp.get("factor") is None:
            refuse("rope_parameters.factor", None, "YaRN needs an explicit factor")
        def yarn_number(name, default=None, **kw):  # transformers: beta_fast / beta_slow 'or' their default
            v = rp.get(name) or default if default is not None else rp.get(name)
            return None if v is None else fl.check_number(ARCHITECTURE, f"rope_parameters.{name}", v, **kw)

        omp = "original_max_position_embeddings"  # transformers: the top-level field wins
        omp_src = cfg if cfg.get(omp) is not None else rp if rp.get(omp) is not None else {omp: max_pos}
        yarn = dict(
            yarn_factor=yarn_number("factor", positive=True),
            yarn_original_max_position_embeddings=fl.check_int(ARCHITECTURE, omp_src, omp),
            yarn_beta_fast=yarn_number("beta_fast", 32, positive=True),
            yarn_beta_slow=yarn_number("beta_slow", 1, positive=True),
            yarn_mscale=yarn_number("mscale"),
            yarn_mscale_all_dim=yarn_number("mscale_all_dim"),
            yarn_attention_factor=yarn_number("attention_factor", positive=True),
            yarn_truncate=fl.check_bool(ARCHITECTURE, rp, "truncate", True),
        )
    flags = {name: fl.check_bool(ARCHITECTURE, cfg, name, _DEFAULTS[name])
             for name in ("norm_topk_prob", "rope_interleave", "attention_bias", "tie_word_embeddings")}
    mtp = {k: cfg[k] for k in ("num_nextn_predict_layers", "num_mtp_layers") if k in cfg}
    if len(mtp) == 2 and mtp["num_nextn_predict_layers"] != mtp["num_mtp_layers"]:
        refuse("num_nextn_predict_layers", mtp["num_nextn_predict_layers"],
               f"num_nextn_predict_layers={mtp['num_nextn_predict_layers']!r} and "
               f"num_mtp_layers={mtp['num_mtp_layers']!r} (its alias in transformers) disagree")
    mtp_name = next(iter(mtp), "num_nextn_predict_layers")
    n_mtp = fl.check_int(ARCHITECTURE, cfg, mtp_name, 1, lo=0)
    ns = _field(cfg, "n_shared_experts")
    if not isinstance(ns, int) or ns < 1:
        refuse("n_shared_experts", ns, "at least one shared expert (transformers always builds one)")
    return DeepseekV3Config(
        vocab_size=_field(cfg, "vocab_size"),
        hidden_size=_field(cfg, "hidden_size"),
        intermediate_size=_field(cfg, "intermediate_size"),
        moe_intermediate_size=_field(cfg, "moe_intermediate_size"),
        num_hidden_layers=_field(cfg, "num_hidden_layers"),
        num_attention_heads=H,
        n_shared_experts=ns,
        n_routed_experts=_field(cfg, "n_routed_experts"),
        routed_scaling_factor=fl.number(ARCHITECTURE, cfg, "routed_scaling_factor",
                                        _DEFAULTS["routed_scaling_factor"], positive=True),
        kv_lora_rank=_field(cfg, "kv_lora_rank"),
        q_lora_rank=_field(cfg, "q_lora_rank", null=None),  # null: q_proj, no LoRA
        qk_rope_head_dim=_field(cfg, "qk_rope_head_dim"),
        v_head_dim=_field(cfg, "v_head_dim"),
        qk_nope_head_dim=_field(cfg, "qk_nope_head_dim"),
        n_group=_field(cfg, "n_group"),
        topk_group=_field(cfg, "topk_group"),
        num_experts_per_tok=_field(cfg, "num_experts_per_tok"),
        first_k_dense_replace=_field(cfg, "first_k_dense_replace"),
        norm_topk_prob=flags["norm_topk_prob"],
        rms_norm_eps=fl.number(ARCHITECTURE, cfg, "rms_norm_eps", _DEFAULTS["rms_norm_eps"], positive=True),
        rope_theta=theta,
        rope_interleave=flags["rope_interleave"],
        attention_bias=flags["attention_bias"],
        tie_word_embeddings=flags["tie_word_embeddings"],
        max_position_embeddings=max_pos,
        rope_type=rope_type,
        num_nextn_predict_layers=n_mtp,
        **yarn,
    )


# ----------------------------------------------------------------------------- tensors


def expected_tensors(config: DeepseekV3Config) -> dict[str, tuple[int, ...]]:
    """Every tensor the model reads: Hugging Face name -> shape (``[out, in]`` for linears)."""
    c = config
    d, H, qk = c.hidden_size, c.num_attention_heads, c.qk_head_dim
    out: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (c.vocab_size, d),
        "model.norm.weight": (d,),
    }
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = (c.vocab_size, d)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (d,)
        out[p + "post_attention_layernorm.weight"] = (d,)
        a = p + "self_attn."
        if c.q_lora_rank is None:
            out[a + "q_proj.weight"] = (H * qk, d)
        else:
            out[a + "q_a_proj.weight"] = (c.q_lora_rank, d)
            if c.attention_bias:
                out[a + "q_a_proj.bias"] = (c.q_lora_rank,)
            out[a + "q_a_layernorm.weight"] = (c.q_lora_rank,)
            out[a + "q_b_proj.weight"] = (H * qk, c.q_lora_rank)
        out[a + "kv_a_proj_with_mqa.weight"] = (c.latent_dim, d)
        if c.attention_bias:
            out[a + "kv_a_proj_with_mqa.bias"] = (c.latent_dim,)
        out[a + "kv_a_layernorm.weight"] = (c.kv_lora_rank,)
        out[a + "kv_b_proj.weight"] = (H * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)
        out[a + "o_proj.weight"] = (d, H * c.v_head_dim)
        if c.attention_bias:
            out[a + "o_proj.bias"] = (d,)
        m = p + "mlp."
        if not c.is_moe_layer(i):
            F = c.intermediate_size
            out[m + "gate_proj.weight"] = (F, d)
            out[m + "up_proj.weight"] = (F, d)
            out[m + "down_proj.weight"] = (d, F)
            continue
        F, Fs = c.moe_intermediate_size, c.moe_intermediate_size * c.n_shared_experts
        out[m + "gate.weight"] = (c.n_routed_experts, d)
        out[m + "gate.e_score_correction_bias"] = (c.n_routed_experts,)
        for e in range(c.n_routed_experts):
            out[m + f"experts.{e}.gate_proj.weight"] = (F, d)
            out[m + f"experts.{e}.up_proj.weight"] = (F, d)
            out[m + f"experts.{e}.down_proj.weight"] = (d, F)
        out[m + "shared_experts.gate_proj.weight"] = (Fs, d)
        out[m + "shared_experts.up_proj.weight"] = (Fs, d)
        out[m + "shared_experts.down_proj.weight"] = (d, Fs)
    return out


def _np_dtype(dtype) -> np.dtype:
    if isinstance(dtype, str) and dtype == "bfloat16":
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(jnp.dtype(dtype))


def ignored_tensor(config: DeepseekV3Config, name: str) -> bool:
    """Checkpoint tensors transformers does not load either: the multi-token-prediction layers
    (``model.layers.{i}`` for ``num_hidden_layers <= i < num_hidden_layers +
    num_nextn_predict_layers``; any other layer is an unexpected tensor) and stored RoPE tables
    (``rotary_emb.inv_freq``). A tied config's stored ``lm_head.weight`` is not ignored: the
    loader takes it only as a copy of the embedding (:func:`kvjax.models.hf.loader.check_tied_head`)."""
    if name.endswith("rotary_emb.inv_freq"):
        return True
    parts = name.split(".")
    if len(parts) > 3 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
        L = config.num_hidden_layers
        return L <= int(parts[2]) < L + config.num_nextn_predict_layers
    return False


def params_from_tensors(config: DeepseekV3Config, get: Callable[[str], np.ndarray], dtype,
                        put: Callable[[tuple, np.ndarray], Any] | None = None) -> dict:
    """Params in ``dtype`` from ``get(hf_name) -> array`` (names of :func:`expected_tensors`).

    Matrices are in ``dtype``; vectors (norm weights, biases, ``e_score_correction_bias``)
    stay float32. ``put(path, host_array) -> leaf`` (default: keep the numpy array) is called
    once per leaf as soon as it is built, ``path`` its tuple of dict keys / list indices, so
    a loader can place each tensor on its devices before the next is read.

    Layout (``d`` hidden, ``H`` heads, ``r`` kv_lora_rank):
    ``embed [V, d]``, ``final_norm [d]``, ``lm_head [d, V]``, ``layers`` a list of dicts:
    ``input_norm``, ``post_norm [d]``; ``attn``: ``q [d, H, qk]`` or ``q_a [d, q_lora]``
    (``q_a_bias``), ``q_a_norm``, ``q_b [q_lora, H, qk]``; ``kv_a [d, r + rope]``
    (``kv_a_bias``), ``kv_a_norm [r]``, ``w_uk [H, r, nope]``, ``w_uv [H, v, r]``,
    ``o [H, v, d]`` (``o_bias [d]``); ``mlp``: ``gate``, ``up [d, F]``, ``down [F, d]``
    (dense), or ``router [d, E]``, ``bias [E]``, ``w_gate``, ``w_up [E, d, F]``,
    ``w_down [E, F, d]``, ``shared_gate``, ``shared_up [d, Fs]``, ``shared_down [Fs, d]``.
    """
    c = config
    dt = _np_dtype(dtype)
    H, qk, nope, v = c.num_attention_heads, c.qk_head_dim, c.qk_nope_head_dim, c.v_head_dim

    def t(name, transpose=False):
        a = np.asarray(get(name))
        if transpose:
            a = a.T
        want = dt if a.ndim > 1 else np.dtype(np.float32)
        return np.ascontiguousarray(a.astype(np.float32).astype(want) if a.dtype != want else a)

    def place(path, a):
        return a if put is None else put(path, a)

    embed = t("model.embed_tokens.weight")
    lm_head = np.ascontiguousarray(embed.T) if c.tie_word_embeddings else t("lm_head.weight", True)
    params: dict[str, Any] = {
        "embed": place(("embed",), embed),
        "final_norm": place(("final_norm",), t("model.norm.weight")),
        "lm_head": place(("lm_head",), lm_head),
        "layers": [],
    }
    del embed, lm_head
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        attn: dict[str, np.ndarray] = {}
        if c.q_lora_rank is None:
            attn["q"] = t(a + "q_proj.weight", True).reshape(c.hidden_size, H, qk)
        else:
            attn["q_a"] = t(a + "q_a_proj.weight", True)
            if c.attention_bias:
                attn["q_a_bias"] = t(a + "q_a_proj.bias")
            attn["q_a_norm"] = t(a + "q_a_layernorm.weight")
            attn["q_b"] = t(a + "q_b_proj.weight", True).reshape(c.q_lora_rank, H, qk)
        attn["kv_a"] = t(a + "kv_a_proj_with_mqa.weight", True)
        if c.attention_bias:
            attn["kv_a_bias"] = t(a + "kv_a_proj_with_mqa.bias")
        attn["kv_a_norm"] = t(a + "kv_a_layernorm.weight")
        kv_b = t(a + "kv_b_proj.weight", True).reshape(c.kv_lora_rank, H, nope + v)
        # heads major, the decode products' contraction minor (q_nope . w_uk over nope, o_lat . w_uv
        # over r): the layouts XLA:GPU's batched products read without a transpose
        attn["w_uk"] = np.ascontiguousarray(kv_b[..., :nope].transpose(1, 0, 2))
        attn["w_uv"] = np.ascontiguousarray(kv_b[..., nope:].transpose(1, 2, 0))
        attn["o"] = t(a + "o_proj.weight", True).reshape(H, v, c.hidden_size)
        if c.attention_bias:
            attn["o_bias"] = t(a + "o_proj.bias")
        m = p + "mlp."
        if not c.is_moe_layer(i):
            mlp = {"gate": t(m + "gate_proj.weight", True), "up": t(m + "up_proj.weight", True),
                   "down": t(m + "down_proj.weight", True)}
        else:
            E = range(c.n_routed_experts)
            mlp = {
                "router": t(m + "gate.weight", True),
                "bias": t(m + "gate.e_score_correction_bias"),
                "w_gate": np.stack([t(m + f"experts.{e}.gate_proj.weight", True) for e in E]),
                "w_up": np.stack([t(m + f"experts.{e}.up_proj.weight", True) for e in E]),
                "w_down": np.stack([t(m + f"experts.{e}.down_proj.weight", True) for e in E]),
                "shared_gate": t(m + "shared_experts.gate_proj.weight", True),
                "shared_up": t(m + "shared_experts.up_proj.weight", True),
                "shared_down": t(m + "shared_experts.down_proj.weight", True),
            }
        layer = {
            "input_norm": t(p + "input_layernorm.weight"),
            "post_norm": t(p + "post_attention_layernorm.weight"),
            "attn": attn,
            "mlp": mlp,
        }
        params["layers"].append(jax.tree_util.tree_map_with_path(
            lambda path, a, i=i: place(("layers", i) + _path_tuple(path), a), layer))
    return params


def random_tensors(config: DeepseekV3Config, seed: int) -> dict[str, np.ndarray]:
    """float32 random tensors of :func:`expected_tensors` (norm weights near 1, linears with
    std ``1 / sqrt(fan_in)``, correction biases ~0.1): deterministic in ``seed``."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in expected_tensors(config).items():
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            a = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name.endswith("e_score_correction_bias") or name.endswith(".bias"):
            a = 0.1 * rng.standard_normal(shape)
        elif name == "model.embed_tokens.weight":
            a = rng.standard_normal(shape)
        else:
            a = rng.standard_normal(shape) / np.sqrt(shape[-1])
        out[name] = a.astype(np.float32)
    return out


def _path_tuple(path) -> tuple:
    return tuple(k.key if hasattr(k, "key") else k.idx if hasattr(k, "idx") else str(k) for k in path)


# ----------------------------------------------------------------------------- math


def _mm(x, w, spec: str | None = None):
    """``x @ w`` (or the einsum ``spec``) with float32 accumulation: ``x`` is cast to ``w``'s dtype
    (bf16 weights: a bf16 product into float32; XLA:CPU lacks that dot, so there both operands
    are widened first, the same products), as ``kvjax.models.attention.linear`` does."""
    x, w = dot_operands(x, w)
    if spec is None:
        return row_padded(lambda a: jnp.matmul(a, w, preferred_element_type=jnp.float32), x)
    return row_padded(lambda a: jnp.einsum(spec, a, w, preferred_element_type=jnp.float32), x)


def _rms(x, w, eps):
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w.astype(jnp.float32)


def _swiglu(h, gate, up, down):
    return _mm(jax.nn.silu(_mm(h, gate)) * _mm(h, up), down)


def route(h: jax.Array, mp: dict, c: DeepseekV3Config,
          backend: str = "reference") -> tuple[jax.Array, jax.Array]:
    """``(idx int32 [T, k], weight float32 [T, k])``: each token's routed experts and their gate
    weights (see the module docstring): :func:`pallas_kernels.moe_route.moe_route` (the float32
    router product and the choice in one op; ``backend`` picks its kernel)."""
    return moe_route(h, mp["router"], mp["bias"], backend=backend, **route_rule(_moe_spec(c)))


@functools.cache
def _moe_spec(c: DeepseekV3Config) -> MoESpec:
    """The routing of ``c`` as a :class:`~kvjax.models.moe.MoESpec` (``hidden``: the experts')."""
    return MoESpec(c.n_routed_experts, c.num_experts_per_tok, c.moe_intermediate_size,
                   routing="sigmoid_grouped", n_group=c.n_group, topk_group=c.topk_group,
                   norm_topk_prob=c.norm_topk_prob, routed_scaling_factor=c.routed_scaling_factor)


#: The most tokens of a step whose shared experts run inside the routed experts' grouped-matmul
#: launches (:func:`kvjax.models.moe.apply_experts`' ``shared``), on the GPU kernel's path only.
#: Measured on an H200 at decode batches 1-256 (1.7-9.7% faster steps, BENCHMARKS.md's H200
#: notes, item 48); larger steps (prefill) keep the separate shared MLP, not measured fused.
SHARED_IN_GROUPED_MAX_TOKENS = 256


def _moe(mp, c, h, expert_axis, model_axis, backend, token_mask=None, num_tokens=None):
    T = h.shape[0] if num_tokens is None else num_tokens
    fused = (expert_axis is None and model_axis is None and T <= SHARED_IN_GROUPED_MAX_TOKENS
             and choose_path(T, c.num_experts_per_tok, c.n_routed_experts, backend) == "grouped")
    names = {"w_gate": "shared_gate", "w_up": "shared_up", "w_down": "shared_down"}
    routed = routed_ffn(h, lambda r: route(r, mp, c, backend), mp, expert_axis=expert_axis, backend=backend,
                        token_mask=token_mask, num_tokens=num_tokens,
                        shared={k: mp[v] for k, v in names.items()} if fused else None)
    if fused:  # the shared experts ran inside the routed experts' launches
        return routed
    shared = _swiglu(h, mp["shared_gate"], mp["shared_up"], mp["shared_down"])
    if model_axis is not None:
        shared = jax.lax.psum(shared, model_axis)
    return routed + shared


def _mlp(lp, c, i, h, expert_axis, model_axis, backend="reference", token_mask=None, num_tokens=None):
    """Layer ``i``'s feed-forward block; ``token_mask [T]``: the step's real tokens (padding is
    routed to no expert); ``num_tokens``: the step's tokens are ``h``'s first rows
    (:func:`~kvjax.models.moe.routed_ffn`)."""
    mp = lp["mlp"]
    # The block's input as its products read it, rounded once here (the norm then writes it): a
    # bf16 model's experts, shared experts and router read bf16. transformers' router too widens
    # a bf16 input (its norm's output, rounded twice there: the normalised row, then its product
    # with the bf16 weight; here the float32 product is rounded once)
    h = h.astype(mp["up" if "up" in mp else "w_up"].dtype)
    if c.is_moe_layer(i):
        return _moe(mp, c, h, expert_axis, model_axis, backend, token_mask, num_tokens)
    y = _swiglu(h, mp["gate"], mp["up"], mp["down"])
    return y if model_axis is None else jax.lax.psum(y, model_axis)


def _project(ap, c: DeepseekV3Config, h, positions):
    """``h [n, d]`` (``n >= T``, the step's ``T = len(positions)`` tokens first) -> ``q_nope [T,
    H, nope]``, ``q_pe [T, H, rope]`` (rotated), ``c [T, r]`` (normed), ``k_pe [T, rope]``
    (rotated), all float32: the products run over the ``n`` rows, the rest over the tokens'."""
    T = positions.shape[0]
    if "q" in ap:
        q = _mm(h, ap["q"], "td,dhk->thk")
    else:
        qa = _mm(h, ap["q_a"])
        if "q_a_bias" in ap:
            qa = qa + ap["q_a_bias"].astype(jnp.float32)
        q = _mm(_rms(qa, ap["q_a_norm"], _SUB_NORM_EPS), ap["q_b"], "tq,qhk->thk")
    kv = _mm(h, ap["kv_a"])
    q, kv = q[:T], kv[:T]
    if "kv_a_bias" in ap:
        kv = kv + ap["kv_a_bias"].astype(jnp.float32)
    r, nope = c.kv_lora_rank, c.qk_nope_head_dim
    inv, af, il = c.rope_inv_freq(), c.rope_attention_factor, c.rope_interleave
    q_pe = rope(q[..., nope:], positions, inv, af, il)
    k_pe = rope(kv[:, None, r:], positions, inv, af, il)[:, 0]
    return q[..., :nope], q_pe, _rms(kv[:, :r], ap["kv_a_norm"], _SUB_NORM_EPS), k_pe


def _out(ap, o, model_axis):
    y = _mm(o, ap["o"], "thv,hvd->td")
    if model_axis is not None:
        y = jax.lax.psum(y, model_axis)
    if "o_bias" in ap:
        y = y + ap["o_bias"].astype(jnp.float32)
    return y


# float32 value of every float8_e4m3fn bit pattern: the dense reference reads fp8 back through
# a table, since XLA:GPU may drop an f32 -> fp8 -> f32 convert pair.
_FP8_VALUES = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)


def _fp8_round_trip(x, scale):
    q = jnp.clip(x / jnp.float32(scale), -_FP8_MAX, _FP8_MAX).astype(jnp.float8_e4m3fn)
    bits = jax.lax.bitcast_convert_type(q, jnp.uint8).astype(jnp.int32)
    return jnp.asarray(_FP8_VALUES)[bits] * jnp.float32(scale)


# ----------------------------------------------------------------------------- the model

_COL3 = P(None, _MODEL, None)  # [in, H, out]: heads split
_HEADS_FIRST = P(_MODEL, None, None)  # [H, ...]: heads split
_PARAM_SPECS = {
    ("attn", "q"): _COL3, ("attn", "q_b"): _COL3, ("attn", "w_uk"): _HEADS_FIRST, ("attn", "w_uv"): _HEADS_FIRST,
    ("attn", "o"): P(_MODEL, None, None),
    ("mlp", "gate"): P(None, _MODEL), ("mlp", "up"): P(None, _MODEL), ("mlp", "down"): P(_MODEL, None),
    ("mlp", "shared_gate"): P(None, _MODEL), ("mlp", "shared_up"): P(None, _MODEL),
    ("mlp", "shared_down"): P(_MODEL, None),
    ("mlp", "w_gate"): P(_DATA), ("mlp", "w_up"): P(_DATA), ("mlp", "w_down"): P(_DATA),
}


@dataclasses.dataclass(frozen=True)
class DeepseekV3:
    """``DeepseekV3ForCausalLM`` on kvjax's :class:`~kvjax.models.interface.Model` protocol (hashable).

    Attributes:
      config: from :func:`config_from_hf`.
      dtype: parameter and activation-cache dtype (``"float32"`` or ``"bfloat16"``); the
        residual stream, norms, softmax and routing are float32.
      fp8_scale: the one scale of an fp8 latent cache (``stored = fp8(x / scale)``).
      attention_form: ``"auto"`` (default: ``"split"`` where the paged-attention kernel runs,
        ``"absorbed"`` elsewhere; :func:`kvjax.models.hf.mla.step_form`), ``"split"`` (a
        decode-only step absorbed, otherwise the step's
        own tokens naive and the cached context absorbed, as vLLM; a step of one fresh prefill
        attends over its own tokens in cuDNN's flash attention where
        :func:`kvjax.models.attention.self_attention_impl` says so), ``"absorbed"`` or ``"naive"``
        (the jnp gather over the whole block table: a reference); see :mod:`kvjax.models.hf.mla`.
      model_shards: tensor-parallel shards (:meth:`shard`); heads and MLP widths split over "model".
    """

    config: DeepseekV3Config
    dtype: str = "float32"
    fp8_scale: float = 1.0
    attention_form: str = "auto"
    model_shards: int = 1

    def __post_init__(self):
        if not isinstance(self.config, DeepseekV3Config):
            raise ValueError(f"config must be a DeepseekV3Config, got {type(self.config).__name__}")
        if self.attention_form not in MLA_FORMS:
            raise ValueError(f"attention_form must be one of {MLA_FORMS}, got {self.attention_form!r}")
        object.__setattr__(self, "dtype", _np_dtype(self.dtype).name)
        if not (isinstance(self.fp8_scale, (int, float)) and math.isfinite(self.fp8_scale)
                and self.fp8_scale >= np.finfo(np.float32).tiny):
            raise ValueError(f"fp8_scale must be a positive normal float32, got {self.fp8_scale!r}")

    # --- protocol attributes
    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def kv_groups(self) -> tuple[int, ...]:
        return (0,)

    @property
    def uses_state(self) -> bool:
        return False

    def _cache_dtype(self, kv_cache_dtype: str) -> str:
        return self.dtype if kv_cache_dtype == "auto" else "float8_e4m3fn"

    def pool_specs(self, sizes: CacheSizes) -> tuple[PoolSpec, ...]:
        """One latent pool per layer, ``[num_kernel_blocks, kernel_block_size, r + rope]``,
        replicated over "model" (a latent row serves every head)."""
        if sizes.kv_layout != "flash":
            raise ValueError(
                f"kv_layout={sizes.kv_layout!r}: the MLA latent cache has one layout "
                f"(concat_and_cache_mla's [blocks, block_size, kv_lora_rank + rope]); use 'flash'")
        shape = (sizes.num_kernel_blocks, sizes.kernel_block_size, self.config.latent_dim)
        dt = self._cache_dtype(sizes.kv_cache_dtype)
        return tuple(PoolSpec(f"layer_{i}.latent", "kv", shape, dt, group=0)
                     for i in range(self.config.num_hidden_layers))

    def init_params(self, seed: int) -> Any:
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(f"seed must be an int, got {seed!r}")
        tensors = random_tensors(self.config, seed)
        return params_from_tensors(self.config, tensors.__getitem__, self.dtype)

    def param_spec(self, path: tuple) -> P:
        """The PartitionSpec of the param at ``path`` (dict keys / list indices): query heads,
        ``w_uk``, ``w_uv`` and ``o`` split over "model" on their heads axis, dense and shared
        MLP widths over "model", routed experts over "data"; the rest replicated."""
        if path[0] != "layers" or len(path) < 4:
            return P()
        return _PARAM_SPECS.get((path[2], path[3]), P())

    def param_partitioning(self, params) -> Any:
        return jax.tree_util.tree_map_with_path(lambda p, _: self.param_spec(_path_tuple(p)), params)

    def check_mesh(self, data: int, model: int) -> None:
        """ValueError unless the routed experts split ``data`` ways and the heads ``model`` ways."""
        c = self.config
        if c.num_hidden_layers > c.first_k_dense_replace and c.n_routed_experts % data:
            raise ValueError(f"DeepSeek-V3: n_routed_experts={c.n_routed_experts} must be a multiple of "
                             f"the data axis size {data} (experts are sharded over 'data')")
        self.shard(model)

    @property
    def description(self) -> str:
        c = self.config
        moe = c.num_hidden_layers - min(c.first_k_dense_replace, c.num_hidden_layers)
        return (f"DeepseekV3ForCausalLM ({c.num_hidden_layers} layers: {c.num_hidden_layers - moe} dense, "
                f"{moe} MoE of {c.n_routed_experts} experts; MLA kv_lora_rank {c.kv_lora_rank}; "
                f"{self.dtype})")

    def shard(self, model_size: int) -> "DeepseekV3":
        if not isinstance(model_size, int) or model_size < 1:
            raise ValueError(f"model_size must be an int >= 1, got {model_size!r}")
        if model_size == 1:
            return self
        c = self.config
        for name, n in (("num_attention_heads", c.num_attention_heads),
                        ("intermediate_size", c.intermediate_size),
                        ("moe_intermediate_size * n_shared_experts",
                         c.moe_intermediate_size * c.n_shared_experts)):
            if n % model_size:
                raise ValueError(f"model={model_size} must divide {name}={n} (split over 'model')")
        return dataclasses.replace(self, model_shards=model_size)

    def layout_leaf(self, path: tuple, array: np.ndarray, model_size: int) -> np.ndarray:
        """Identity: along every "model" axis (heads, MLP widths) a contiguous slice is one shard's."""
        return array

    def layout_for_shards(self, params, model_size: int):
        self.shard(model_size)  # the divisibility checks
        return params

    # --- the step
    def apply(self, params, ctx: StepContext, pools: dict[str, jax.Array], *, backend: str,
              sizes: CacheSizes, expert_axis: str | None = None,
              model_axis: str | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
        c = self.config
        specs = self.pool_specs(sizes)
        fp8 = sizes.kv_cache_dtype != "auto"
        pools = dict(pools)
        for s in specs:
            a = pools.get(s.name)
            if a is None or tuple(a.shape) != s.shape or jnp.dtype(a.dtype) != jnp.dtype(s.dtype):
                got = None if a is None else (tuple(a.shape), jnp.dtype(a.dtype).name)
                raise ValueError(f"pool {s.name!r} must be {s.shape} {s.dtype}, got {got}")
        cache_dt = jnp.dtype(specs[0].dtype)
        scale = jnp.float32(self.fp8_scale) if fp8 else None
        form = step_form(self.attention_form, backend, ctx.decode_only)
        self_attn = (self_attention_impl(backend, params["layers"][0]["attn"]["w_uk"].dtype)
                     if form == "split" else "paged")
        x = jnp.take(params["embed"], ctx.input_ids, axis=0, mode="clip").astype(jnp.float32)
        T = x.shape[0]
        x, token_mask = padded_stream(x, ctx.token_real)  # row_count(T) rows; attention reads T
        rows = x.shape[0]
        real = token_mask[:, None]
        for i, lp in enumerate(params["layers"]):
            ap = lp["attn"]
            h = _rms(x, lp["input_norm"], c.rms_norm_eps)
            q_nope, q_pe, lat_c, k_pe = _project(ap, c, h, ctx.positions)
            name = specs[i].name
            if fp8:
                kc, kp = lat_c, k_pe
            else:
                kc, kp = lat_c.astype(cache_dt), k_pe.astype(cache_dt)
            pools[name] = concat_and_cache_mla(kc, kp, pools[name], ctx.slot_mapping,
                                               sizes.kv_cache_dtype, scale, backend=backend)
            if form == "split":  # this step's latent rows read back from the cache just written:
                # the write owns their rounding (model dtype or fp8 with its scale)
                flat = pools[name].reshape(-1, c.latent_dim)
                slot = ctx.slot_mapping
                new = flat[jnp.clip(slot, 0, flat.shape[0] - 1)].astype(jnp.float32)
                if fp8:
                    new = new * scale
                new = jnp.where((slot >= 0)[:, None], new, 0.0)  # PAD slots: no row reads them
                o = split_latent_attention(
                    q_nope, q_pe, new, pools[name], ap["w_uk"], ap["w_uv"], ctx.block_table,
                    ctx.seq_lens, ctx.query_start_loc, ctx.query_len, ctx.positions, ctx.token_row,
                    softmax_scale=c.softmax_scale, fp8_scale=self.fp8_scale if fp8 else None,
                    backend=backend, self_attention=self_attn)
            else:
                o = paged_latent_attention(
                    q_nope, q_pe, pools[name], ap["w_uk"], ap["w_uv"], ctx.block_table, ctx.seq_lens,
                    ctx.positions, ctx.token_row, softmax_scale=c.softmax_scale, form=form,
                    fp8_scale=self.fp8_scale if fp8 else None, backend=backend)
            x = x + jnp.where(real, _out(ap, pad_rows(o, rows), model_axis), 0.0)
            h = _rms(x, lp["post_norm"], c.rms_norm_eps)
            x = x + jnp.where(real, _mlp(lp, c, i, h, expert_axis, model_axis, backend, token_mask, T), 0.0)
        hl = _rms(x[ctx.logits_indices], params["final_norm"], c.rms_norm_eps)
        return _mm(hl, params["lm_head"]), pools

    # --- the oracle
    def dense_logits(self, params, tokens: jax.Array, *, kv_cache_dtype: str = "auto") -> jax.Array:
        if kv_cache_dtype not in ("auto", "fp8", "fp8_e4m3"):
            raise ValueError(f"kv_cache_dtype must be 'auto', 'fp8' or 'fp8_e4m3', got {kv_cache_dtype!r}")
        if self.model_shards != 1:
            raise ValueError("dense_logits runs the whole (unsharded) model")
        fp8_scale = self.fp8_scale if kv_cache_dtype != "auto" else None
        return _dense_fn(self.config, self.dtype, fp8_scale)(params, jnp.asarray(tokens, jnp.int32))


@functools.cache
def _dense_fn(config: DeepseekV3Config, dtype: str, fp8_scale: float | None):
    return jax.jit(functools.partial(_dense_forward, config, dtype, fp8_scale))


def _dense_forward(c: DeepseekV3Config, dtype: str, fp8_scale: float | None, params, tokens):
    """One sequence, no cache, no padding: causal softmax over up-projected keys and values
    (the cache's rounding applied to the latent: fp8 with ``fp8_scale``, else ``dtype``)."""
    n = tokens.shape[0]
    pos = jnp.arange(n, dtype=jnp.int32)
    causal = jnp.tril(jnp.ones((n, n), bool))
    x = params["embed"][tokens].astype(jnp.float32)
    for i, lp in enumerate(params["layers"]):
        ap = lp["attn"]
        h = _rms(x, lp["input_norm"], c.rms_norm_eps)
        q_nope, q_pe, lat_c, k_pe = _project(ap, c, h, pos)
        if fp8_scale is not None:
            lat_c, k_pe = _fp8_round_trip(lat_c, fp8_scale), _fp8_round_trip(k_pe, fp8_scale)
        else:  # the cache holds the model dtype
            dt = jnp.dtype(dtype)
            lat_c, k_pe = lat_c.astype(dt).astype(jnp.float32), k_pe.astype(dt).astype(jnp.float32)
        k_nope = _mm(lat_c, ap["w_uk"], "sr,hrn->shn")
        v = _mm(lat_c, ap["w_uv"], "sr,hvr->shv")
        s = jnp.einsum("thn,shn->hts", q_nope, k_nope) + jnp.einsum("thp,sp->hts", q_pe, k_pe)
        s = jnp.where(causal[None], s * jnp.float32(c.softmax_scale), -jnp.inf)
        o = jnp.einsum("hts,shv->thv", jax.nn.softmax(s, axis=-1), v)
        x = x + _out(ap, o, None)
        x = x + _mlp(lp, c, i, _rms(x, lp["post_norm"], c.rms_norm_eps), None, None)
    return _mm(_rms(x, params["final_norm"], c.rms_norm_eps), params["lm_head"])


__all__ = ["ARCHITECTURE", "DeepseekV3", "DeepseekV3Config", "config_from_hf", "expected_tensors",
           "ignored_tensor", "params_from_tensors", "random_tensors", "route"]
