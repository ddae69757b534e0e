"""``GraniteMoeHybridForCausalLM`` (Granite-4.0-H): Mamba2 / attention layers, each followed by
a shared SwiGLU MLP with or without routed experts.

A layer is two blocks of :mod:`kvjax.models.hf.hybrid`: ``input_layernorm`` + mixer
(Mamba2 for ``layer_types`` ``"mamba"`` / ``"linear_attention"``, attention for ``"attention"`` /
``"full_attention"``), then ``post_attention_layernorm`` + feed-forward (the shared MLP, plus
softmax-top-k routed experts when ``num_local_experts > 0``); both residuals are scaled by
``residual_multiplier``. Embeddings are scaled by ``embedding_multiplier``, attention scores by
``attention_multiplier`` (instead of ``1/sqrt(head_dim)``), logits divided by ``logits_scaling``.
RoPE when ``position_embedding_type == "rope"``, none (NoPE) when it is null / ``"nope"``.
The Mamba gated norm normalises each of ``mamba_n_groups`` groups on its own.

config.json fields (absent ones take transformers' defaults; a null is refused unless transformers
gives it a meaning: ``num_key_value_heads`` null is ``num_attention_heads``, ``attention_multiplier``
null is ``1/sqrt(head_dim)``, ``layer_types`` null all Mamba, ``position_embedding_type`` null NoPE,
``sliding_window`` / ``quantization_config`` null none):

* honoured: ``vocab_size``, ``hidden_size``, ``num_hidden_layers``, ``layer_types`` /
  ``layers_block_type``, ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``,
  ``rms_norm_eps``, ``position_embedding_type``, ``rope_parameters.rope_theta``,
  ``attention_bias``, ``attention_multiplier``, ``embedding_multiplier``,
  ``residual_multiplier``, ``logits_scaling``, ``tie_word_embeddings``, ``num_local_experts``,
  ``num_experts_per_tok``, ``intermediate_size``, ``shared_intermediate_size``, ``mamba_n_heads``,
  ``mamba_n_groups``, ``mamba_d_state``, ``mamba_d_head``, ``mamba_d_conv``, ``mamba_expand``,
  ``mamba_conv_bias``, ``mamba_proj_bias``, ``time_step_limit`` (``dt`` clipped on every path;
  transformers clips in its chunked prefill scan only);
* refused (``ValueError``): ``hidden_act`` other than ``silu``, a ``rope_type`` other than
  ``default``, ``sliding_window``, ``position_embedding_type`` other than ``rope`` / null,
  layer types other than Mamba / attention;
* no effect on the math: ``mamba_chunk_size``, ``max_position_embeddings``, dropouts,
  initialisation and router-loss fields, token ids; ``partial_rotary_factor`` (transformers'
  Granite rotates the whole head whatever it says).
"""

from __future__ import annotations

import numpy as np

from kvjax.models.attention import AttnSpec
from kvjax.models.hf import fields as fl
from kvjax.models.hf import hybrid as hy
from kvjax.models.hf.hybrid import Block, Entry, HybridConfig, HybridModel
from kvjax.models.mamba_layer import MambaSpec
from kvjax.models.moe import MLPSpec, MoESpec

ARCH = "GraniteMoeHybridForCausalLM"
Model = HybridModel


def _mamba_spec(arch: str, cfg: dict, d: int, eps: float) -> MambaSpec:
    """The Mamba2 fields Granite-4.0-H and Bamba share (``mamba_*``)."""
    H = fl.check_int(arch, cfg, "mamba_n_heads", 128)
    G = fl.check_int(arch, cfg, "mamba_n_groups", 1)
    N = fl.check_int(arch, cfg, "mamba_d_state", 256)
    W = fl.check_int(arch, cfg, "mamba_d_conv", 4, lo=2)
    expand = fl.check_int(arch, cfg, "mamba_expand", 2)
    fl.check_int(arch, cfg, "mamba_chunk_size", 256)  # prefill chunking only: no effect on the math
    inner = expand * d
    P = fl.field(arch, cfg, "mamba_d_head", "auto")
    if P == "auto":
        P = inner // H
    if not isinstance(P, int) or P < 1 or P * H != inner:
        raise ValueError(f"{arch}: config.json mamba_d_head={P!r} times mamba_n_heads={H} must equal "
                         f"mamba_expand * hidden_size = {inner}")
    if H % G:
        raise ValueError(f"{arch}: mamba_n_heads={H} must be a multiple of mamba_n_groups={G}")
    return MambaSpec(num_heads=H, head_dim=P, d_state=N, n_groups=G, conv_width=W, rms_eps=eps,
                     norm_groups=G, norm_spans_shards=G == 1, dt_limit=hy.check_dt_limit(arch, cfg))


def _common(arch: str, cfg: dict, *, eps_default: float, kv_heads_default: int | None):
    """vocab, hidden, eps, layer count, attention heads / head_dim (fields both archs read);
    absent fields take transformers' defaults of the architecture."""
    V = fl.check_int(arch, cfg, "vocab_size")
    d = fl.check_int(arch, cfg, "hidden_size")
    L = fl.check_int(arch, cfg, "num_hidden_layers")
    eps = fl.number(arch, cfg, "rms_norm_eps", eps_default, positive=True)
    Hq = fl.check_int(arch, cfg, "num_attention_heads", 32)
    Hkv = fl.check_int(arch, cfg, "num_key_value_heads", kv_heads_default or Hq, null=Hq)  # null: MHA
    D = fl.check_int(arch, cfg, "head_dim", d // Hq)
    if Hq % Hkv:
        raise ValueError(f"{arch}: num_attention_heads={Hq} must be a multiple of num_key_value_heads={Hkv}")
    sw = fl.field(arch, cfg, "sliding_window", null=None)
    if sw is not None:
        fl.refuse(arch, "sliding_window", sw, "sliding-window attention is not implemented")
    act = fl.field(arch, cfg, "hidden_act", "silu")
    if act != "silu":
        fl.refuse(arch, "hidden_act", act, "the Mamba conv, the MLPs and the experts use SiLU only")
    return V, d, L, eps, Hq, Hkv, D


#: The bool fields Granite-4.0-H and Bamba share: (HybridConfig field, config.json field, transformers' default).
_FLAGS = (("attn_bias", "attention_bias", False), ("mamba_proj_bias", "mamba_proj_bias", False),
          ("mamba_conv_bias", "mamba_conv_bias", True), ("tie_embeddings", "tie_word_embeddings", False))


def _flags(arch: str, cfg: dict) -> dict:
    """:data:`_FLAGS` read by :func:`~kvjax.models.hf.fields.check_bool`, as HybridConfig keywords."""
    return {ours: fl.check_bool(arch, cfg, name, default) for ours, name, default in _FLAGS}


def config_from_hf(cfg: dict) -> HybridConfig:
    arch = ARCH
    hy.check_common(arch, cfg)
    V, d, L, eps, Hq, Hkv, D = _common(arch, cfg, eps_default=1e-6, kv_heads_default=None)
    types = fl.field(arch, cfg, "layer_types", null=None) or fl.field(arch, cfg, "layers_block_type", null=None)
    if types is None:
        types = ["linear_attention"] * L
    if not isinstance(types, list) or len(types) != L:
        raise ValueError(f"{arch}: config.json layer_types must list num_hidden_layers={L} entries, got {types!r}")
    kinds = []
    for t in types:
        t = hy.remap_layer_type(t)
        if t not in ("linear_attention", "full_attention"):
            fl.refuse(arch, "layer_types", t, "expected 'mamba' / 'linear_attention' or 'attention' / 'full_attention'")
        kinds.append("mamba" if t == "linear_attention" else "attn")
    pe = fl.field(arch, cfg, "position_embedding_type", null=None)
    if pe not in (None, "rope", "nope"):
        fl.refuse(arch, "position_embedding_type", pe, "expected 'rope' or null (NoPE)")
    theta = None
    if pe == "rope":
        # transformers' Granite default RoPE rotates the whole head (it ignores partial_rotary_factor)
        theta, _ = fl.check_rope(arch, cfg)
    rm = fl.number(arch, cfg, "residual_multiplier", 1.0)
    # attention_multiplier null: transformers passes scaling=None to its attention, i.e. 1/sqrt(head_dim)
    attn = AttnSpec(Hq, Hkv, D, rope_theta=theta,
                    sm_scale=fl.number(arch, cfg, "attention_multiplier", 1.0, null=None))
    E = fl.check_int(arch, cfg, "num_local_experts", 8, lo=0)
    shared = MLPSpec(fl.check_int(arch, cfg, "shared_intermediate_size", 1024), True, "silu")
    moe = None
    if E:
        top_k = fl.check_int(arch, cfg, "num_experts_per_tok", 2)
        if top_k > E:
            raise ValueError(f"{arch}: num_experts_per_tok={top_k} > num_local_experts={E}")
        moe = MoESpec(E, top_k, fl.check_int(arch, cfg, "intermediate_size", 11008))
    blocks = []
    for k in kinds:
        blocks += [Block(k, rm), Block("moe" if E else "mlp", rm)]
    return HybridConfig(
        architecture=arch, vocab_size=V, d_model=d, rms_eps=eps, blocks=tuple(blocks),
        attn=attn if "attn" in kinds else None,
        mamba=_mamba_spec(arch, cfg, d, eps) if "mamba" in kinds else None,
        mlp=None if E else shared, moe=moe, moe_shared=shared if E else None,
        embedding_multiplier=fl.number(arch, cfg, "embedding_multiplier", 1.0),
        logits_scaling=fl.number(arch, cfg, "logits_scaling", 1.0, positive=True),
        **_flags(arch, cfg),
    )


# ------------------------------------------------------------------ checkpoint tensors


def attn_entries(c: HybridConfig, bi: int, pre: str, names=("q_proj", "k_proj", "v_proj", "o_proj")):
    a = c.attn
    q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    d = c.d_model
    out = []
    for n, leaf, shape in zip(names, ("wq", "wk", "wv", "wo"), ((q, d), (kv, d), (kv, d), (d, q))):
        out.append(Entry(("blocks", bi, leaf), (f"{pre}{n}.weight",), (shape,), hy.linear_t))
        if c.attn_bias:
            out.append(Entry(("blocks", bi, "b" + leaf[1]), (f"{pre}{n}.bias",), ((shape[0],),), hy.same))
    return out


def mamba_entries(c: HybridConfig, bi: int, pre: str):
    m, d = c.mamba, c.d_model
    out = [
        Entry(("blocks", bi, "in_proj"), (f"{pre}in_proj.weight",), ((m.in_proj_dim, d),), hy.linear_t),
        Entry(("blocks", bi, "conv_weight"), (f"{pre}conv1d.weight",), ((m.conv_dim, 1, m.conv_width),), hy.conv_w),
        Entry(("blocks", bi, "dt_bias"), (f"{pre}dt_bias",), ((m.num_heads,),), hy.same),
        Entry(("blocks", bi, "A_log"), (f"{pre}A_log",), ((m.num_heads,),), hy.same),
        Entry(("blocks", bi, "D"), (f"{pre}D",), ((m.num_heads,),), hy.same),
        Entry(("blocks", bi, "gate_norm"), (f"{pre}norm.weight",), ((m.d_inner,),), hy.same),
        Entry(("blocks", bi, "out_proj"), (f"{pre}out_proj.weight",), ((d, m.d_inner),), hy.linear_t),
    ]
    if c.mamba_conv_bias:
        out.append(Entry(("blocks", bi, "conv_bias"), (f"{pre}conv1d.bias",), ((m.conv_dim,),), hy.same))
    if c.mamba_proj_bias:
        out.append(Entry(("blocks", bi, "in_proj_bias"), (f"{pre}in_proj.bias",), ((m.in_proj_dim,),), hy.same))
        out.append(Entry(("blocks", bi, "out_proj_bias"), (f"{pre}out_proj.bias",), ((d,),), hy.same))
    return out


def _fused_gate_up(F: int, which: int):
    """Granite's fused ``[.., 2F, d]`` input_linear -> gate (0) or up (1) as ``[.., d, F]``."""
    def fn(a):
        a = np.asarray(a)[..., which * F:(which + 1) * F, :]
        return np.swapaxes(a, -1, -2)
    return fn


def _swap_last(a):
    return np.swapaxes(np.asarray(a), -1, -2)


def mixer_entries(c: HybridConfig, i: int, pre: str, norm_names: tuple[str, str]) -> list[Entry]:
    """Layer ``i``'s two norms (``blocks[2i]`` mixer, ``blocks[2i+1]`` feed-forward; their checkpoint
    names after ``pre``) and its attention or Mamba mixer's entries (Granite and Bamba lay them out
    alike)."""
    d, mix, ffn = c.d_model, 2 * i, 2 * i + 1
    plan = [Entry(("blocks", mix, "norm"), (pre + norm_names[0],), ((d,),), hy.same),
            Entry(("blocks", ffn, "norm"), (pre + norm_names[1],), ((d,),), hy.same)]
    if c.blocks[mix].kind == "attn":
        return plan + attn_entries(c, mix, pre + "self_attn.")
    return plan + mamba_entries(c, mix, pre + "mamba.")


def _plan(c: HybridConfig) -> list[Entry]:
    d = c.d_model
    plan = hy.head_entries(c, "model.embed_tokens.weight", "model.norm.weight")
    for i in range(len(c.blocks) // 2):
        pre = f"model.layers.{i}."
        ffn = 2 * i + 1
        plan += mixer_entries(c, i, pre, ("input_layernorm.weight", "post_attention_layernorm.weight"))
        shared = c.moe_shared if c.moe is not None else c.mlp
        sp = ("blocks", ffn, "shared") if c.moe is not None else ("blocks", ffn)
        Fs = shared.hidden
        name = pre + "shared_mlp.input_linear.weight"
        plan.append(Entry(sp + ("w_gate",), (name,), ((2 * Fs, d),), _fused_gate_up(Fs, 0)))
        plan.append(Entry(sp + ("w_up",), (name,), ((2 * Fs, d),), _fused_gate_up(Fs, 1)))
        plan.append(Entry(sp + ("w_down",), (pre + "shared_mlp.output_linear.weight",), ((d, Fs),), hy.linear_t))
        if c.moe is not None:
            E, F = c.moe.num_experts, c.moe.hidden
            mp = pre + "block_sparse_moe."
            plan.append(Entry(("blocks", ffn, "router"), (mp + "router.layer.weight",), ((E, d),), hy.linear_t))
            plan.append(Entry(("blocks", ffn, "w_gate"), (mp + "input_linear.weight",), ((E, 2 * F, d),),
                              _fused_gate_up(F, 0)))
            plan.append(Entry(("blocks", ffn, "w_up"), (mp + "input_linear.weight",), ((E, 2 * F, d),),
                              _fused_gate_up(F, 1)))
            plan.append(Entry(("blocks", ffn, "w_down"), (mp + "output_linear.weight",), ((E, d, F),), _swap_last))
    return plan


expected_tensors, params_from_tensors = hy.plan_protocol(_plan)
