"""``NemotronHForCausalLM``: one block per layer, each a Mamba2, attention, MLP or MoE mixer.

``layers_block_type`` (or the legacy ``hybrid_override_pattern``: ``M`` Mamba2, ``*``
attention, ``-`` MLP, ``E`` MoE) gives each layer's mixer; every layer is ``x + mixer(norm(x))``
(:mod:`kvjax.models.hf.hybrid`). Attention has no positional encoding and scores scaled by
``1/sqrt(head_dim)``; MLPs are ungated ``down(relu2(up(x)))`` (``mlp_hidden_act``); MoE blocks
route with sigmoid scores plus ``e_score_correction_bias``, limited to the ``topk_group`` best of
``n_group`` groups, weights normalised (``norm_topk_prob``) and scaled
(``routed_scaling_factor``), ungated relu2 experts (optionally between latent projections,
``moe_latent_size``) plus one shared MLP. The Mamba2 gated norm is grouped (``n_groups``); as in
transformers' chunked scan, ``dt`` is clipped below at ``time_step_min`` (kvjax clips on every
path, prefill and decode alike).

config.json fields (absent ones take transformers' defaults; the legacy ``mamba_*`` names too):

* honoured: ``vocab_size``, ``hidden_size``, ``layers_block_type`` / ``hybrid_override_pattern``,
  ``layer_norm_epsilon``, ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``,
  ``intermediate_size``, ``mlp_hidden_act`` (``relu2`` or ``silu``), ``mlp_bias``,
  ``mamba_num_heads``, ``mamba_head_dim``, ``ssm_state_size``, ``n_groups``, ``conv_kernel``,
  ``time_step_min``, ``use_conv_bias``, ``use_bias``, ``mamba_ssm_cache_dtype`` (the SSM pools'
  dtype), ``n_routed_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``,
  ``moe_shared_expert_intermediate_size``, ``moe_latent_size``, ``n_group``, ``topk_group``,
  ``norm_topk_prob``, ``routed_scaling_factor``;
* refused: ``sliding_window`` (transformers ignores it; kvjax does not guess), other
  activations, unknown block types, an SSM cache dtype other than float32 / bfloat16 / float16;
* ignored because transformers' Nemotron-H ignores them: ``time_step_limit`` (it clips at
  ``(time_step_min, inf)``), ``expand``, ``attention_bias``, ``mamba_proj_bias``,
  ``n_shared_experts`` (one shared MLP), ``moe_shared_expert_overlap``, ``residual_in_fp32``
  (kvjax's residual stream is float32 anyway), ``tie_word_embeddings`` (never tied),
  ``num_nextn_predict_layers`` / ``mtp_*`` (MTP weights are not loaded), ``use_mamba_kernels``,
  ``chunk_size``, initialisation and dropout fields.
"""

from __future__ import annotations

import math

import numpy as np

from kvjax.models.attention import AttnSpec
from kvjax.models.hf import fields as fl
from kvjax.models.hf import hybrid as hy
from kvjax.models.hf.granite import attn_entries, mamba_entries
from kvjax.models.hf.hybrid import Block, Entry, HybridConfig, HybridModel
from kvjax.models.mamba_layer import MambaSpec
from kvjax.models.moe import ACTIVATIONS, MLPSpec, MoESpec, check_expert_groups

ARCH = "NemotronHForCausalLM"
Model = HybridModel
_PATTERN = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}
_KIND = {"linear_attention": "mamba", "full_attention": "attn", "mlp": "mlp", "moe": "moe"}
_SSM_DTYPES = ("float32", "bfloat16", "float16")


def _layer_types(arch: str, cfg: dict) -> list[str]:
    types = fl.field(arch, cfg, "layers_block_type", null=None) or fl.field(arch, cfg, "layer_types", null=None)
    if types is None:
        pattern = fl.field(arch, cfg, "hybrid_override_pattern", null=None)
        if not isinstance(pattern, str) or not pattern or any(ch not in _PATTERN for ch in pattern):
            raise ValueError(f"{arch}: config.json needs layers_block_type (a list) or hybrid_override_pattern "
                             f"(a string of {''.join(_PATTERN)}), got {pattern!r}")
        types = [_PATTERN[ch] for ch in pattern]
    if not isinstance(types, list) or not types:
        raise ValueError(f"{arch}: config.json layers_block_type must be a non-empty list, got {types!r}")
    out = []
    for t in types:
        t = hy.remap_layer_type(t)
        if t not in _KIND:
            fl.refuse(arch, "layers_block_type", t, f"expected one of {sorted(_KIND)} (or mamba / attention)")
        out.append(_KIND[t])
    return out


# legacy config.json names transformers' NemotronHConfig still reads -> the current ones
_LEGACY = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_expand": "expand",
           "mamba_dt_min": "time_step_min", "mamba_dt_max": "time_step_max", "mamba_dt_limit": "time_step_limit",
           "mamba_dt_init_floor": "time_step_floor", "mamba_conv_bias": "use_conv_bias",
           "mamba_chunk_size": "chunk_size"}


def config_from_hf(cfg: dict) -> HybridConfig:
    arch = ARCH
    hy.check_common(arch, cfg)
    cfg = dict(cfg)
    for old, new in _LEGACY.items():
        if cfg.get(old) is not None:
            cfg[new] = cfg.pop(old)
    kinds = _layer_types(arch, cfg)
    V = fl.check_int(arch, cfg, "vocab_size")
    d = fl.check_int(arch, cfg, "hidden_size")
    eps = fl.number(arch, cfg, "layer_norm_epsilon", 1e-5, positive=True)
    sw = fl.field(arch, cfg, "sliding_window", null=None)
    if sw is not None:
        fl.refuse(arch, "sliding_window", sw, "transformers' Nemotron-H ignores it; kvjax does not guess")
    act = fl.field(arch, cfg, "mlp_hidden_act", "relu2")
    if act not in ACTIVATIONS:
        fl.refuse(arch, "mlp_hidden_act", act, f"implemented: {ACTIVATIONS}")
    attn = mamba = mlp = moe = shared = None
    latent = None
    if "attn" in kinds:
        Hq = fl.check_int(arch, cfg, "num_attention_heads", 32)
        Hkv = fl.check_int(arch, cfg, "num_key_value_heads", 8)
        if Hq % Hkv:
            raise ValueError(f"{arch}: num_attention_heads={Hq} must be a multiple of num_key_value_heads={Hkv}")
        attn = AttnSpec(Hq, Hkv, fl.check_int(arch, cfg, "head_dim", 128), rope_theta=None)
    if "mamba" in kinds:
        mact = fl.field(arch, cfg, "mamba_hidden_act", "silu")
        if mact != "silu":
            fl.refuse(arch, "mamba_hidden_act", mact, "the Mamba conv activation is SiLU only")
        H = fl.check_int(arch, cfg, "mamba_num_heads", 128)
        G = fl.check_int(arch, cfg, "n_groups", 8)
        if H % G:
            raise ValueError(f"{arch}: mamba_num_heads={H} must be a multiple of n_groups={G}")
        fl.check_int(arch, cfg, "chunk_size", 128)  # prefill chunking only
        lo = fl.number(arch, cfg, "time_step_min", 0.001, lo=0.0)
        mamba = MambaSpec(num_heads=H, head_dim=fl.check_int(arch, cfg, "mamba_head_dim", 64),
                          d_state=fl.check_int(arch, cfg, "ssm_state_size", 128), n_groups=G,
                          conv_width=fl.check_int(arch, cfg, "conv_kernel", 4, lo=2), rms_eps=eps,
                          norm_groups=G, norm_spans_shards=G == 1, dt_limit=(lo, math.inf))
    if "mlp" in kinds:
        mlp = MLPSpec(fl.check_int(arch, cfg, "intermediate_size", 21504), False, act)
    if "moe" in kinds:
        E = fl.check_int(arch, cfg, "n_routed_experts", 8)
        ng = fl.check_int(arch, cfg, "n_group", 1)
        tg = fl.check_int(arch, cfg, "topk_group", 1)
        top_k = fl.check_int(arch, cfg, "num_experts_per_tok", 2)
        check_expert_groups(f"{arch}: config.json", E, ng, tg, top_k)  # DeepSeek-V3's rule (same router)
        moe = MoESpec(E, top_k, fl.check_int(arch, cfg, "moe_intermediate_size", 7688), routing="sigmoid_grouped",
                      n_group=ng, topk_group=tg, norm_topk_prob=fl.check_bool(arch, cfg, "norm_topk_prob", True),
                      routed_scaling_factor=fl.number(arch, cfg, "routed_scaling_factor", 1.0, positive=True),
                      gated=False, activation=act)
        shared = MLPSpec(fl.check_int(arch, cfg, "moe_shared_expert_intermediate_size", 7688), False, act)
        latent = fl.field(arch, cfg, "moe_latent_size", null=None)
        if latent is not None:
            latent = fl.check_int(arch, cfg, "moe_latent_size")
    ssm_dtype = fl.field(arch, cfg, "mamba_ssm_cache_dtype", "float32")
    if ssm_dtype not in _SSM_DTYPES:
        fl.refuse(arch, "mamba_ssm_cache_dtype", ssm_dtype, f"expected one of {_SSM_DTYPES}")
    return HybridConfig(
        architecture=arch, vocab_size=V, d_model=d, rms_eps=eps, blocks=tuple(Block(k) for k in kinds),
        attn=attn, mamba=mamba, mlp=mlp, moe=moe, moe_shared=shared, moe_latent=latent,
        mlp_bias=fl.check_bool(arch, cfg, "mlp_bias", False),
        mamba_proj_bias=fl.check_bool(arch, cfg, "use_bias", False),
        mamba_conv_bias=fl.check_bool(arch, cfg, "use_conv_bias", True),
        moe_e_bias=moe is not None, tie_embeddings=False, ssm_state_dtype=ssm_dtype,
    )


def _stack_t(*arrays):
    """Per-expert torch Linear weights ``[out, in]`` -> one ``[E, in, out]`` stack."""
    return np.stack([np.asarray(a).T for a in arrays])


def _mlp_entries(c: HybridConfig, path: tuple, pre: str, spec: MLPSpec):
    d = c.d_model
    out = [Entry(path + ("w_up",), (pre + "up_proj.weight",), ((spec.hidden, d),), hy.linear_t),
           Entry(path + ("w_down",), (pre + "down_proj.weight",), ((d, spec.hidden),), hy.linear_t)]
    if c.mlp_bias:
        out += [Entry(path + ("b_up",), (pre + "up_proj.bias",), ((spec.hidden,),), hy.same),
                Entry(path + ("b_down",), (pre + "down_proj.bias",), ((d,),), hy.same)]
    return out


def _plan(c: HybridConfig) -> list[Entry]:
    d, V = c.d_model, c.vocab_size
    plan = [Entry(("embed",), ("backbone.embeddings.weight",), ((V, d),), hy.same),
            Entry(("final_norm",), ("backbone.norm_f.weight",), ((d,),), hy.same),
            Entry(("lm_head",), ("lm_head.weight",), ((V, d),), hy.linear_t)]
    for i, b in enumerate(c.blocks):
        pre = f"backbone.layers.{i}."
        mx = pre + "mixer."
        plan.append(Entry(("blocks", i, "norm"), (pre + "norm.weight",), ((d,),), hy.same))
        if b.kind == "attn":
            plan += attn_entries(c, i, mx)
        elif b.kind == "mamba":
            plan += mamba_entries(c, i, mx)
        elif b.kind == "mlp":
            plan += _mlp_entries(c, ("blocks", i), mx, c.mlp)
        else:
            e = c.moe
            dl = c.moe_latent or d
            E, F = e.num_experts, e.hidden
            plan.append(Entry(("blocks", i, "router"), (mx + "gate.weight",), ((E, d),), hy.linear_t))
            plan.append(Entry(("blocks", i, "e_bias"), (mx + "gate.e_score_correction_bias",), ((E,),), hy.same))
            plan.append(Entry(("blocks", i, "w_up"), tuple(f"{mx}experts.{j}.up_proj.weight" for j in range(E)),
                              ((F, dl),) * E, _stack_t))
            plan.append(Entry(("blocks", i, "w_down"),
                              tuple(f"{mx}experts.{j}.down_proj.weight" for j in range(E)), ((dl, F),) * E, _stack_t))
            plan += _mlp_entries(c, ("blocks", i, "shared"), mx + "shared_experts.", c.moe_shared)
            if c.moe_latent is not None:
                plan.append(Entry(("blocks", i, "fc1"), (mx + "fc1_latent_proj.weight",), ((dl, d),), hy.linear_t))
                plan.append(Entry(("blocks", i, "fc2"), (mx + "fc2_latent_proj.weight",), ((d, dl),), hy.linear_t))
                if c.mlp_bias:
                    plan.append(Entry(("blocks", i, "fc1_b"), (mx + "fc1_latent_proj.bias",), ((dl,),), hy.same))
                    plan.append(Entry(("blocks", i, "fc2_b"), (mx + "fc2_latent_proj.bias",), ((d,),), hy.same))
    return plan


expected_tensors, params_from_tensors = hy.plan_protocol(_plan)


def ignored_tensor(config: HybridConfig, name: str) -> bool:
    """Multi-token-prediction layers (``mtp.*``), which transformers does not load either."""
    return name.startswith("mtp.")
