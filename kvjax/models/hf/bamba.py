"""``BambaForCausalLM``: Mamba2 layers with full attention at ``attn_layer_indices``, each layer
followed by a SwiGLU MLP.

A layer is two blocks of :mod:`kvjax.models.hf.hybrid`: ``input_layernorm`` + mixer, then
``pre_ff_layernorm`` + ``feed_forward``. Attention scores are scaled by ``1/sqrt(head_dim)``;
RoPE rotates the first ``partial_rotary_factor * head_dim`` features (transformers pins the
factor to 0.5 for Bamba). The Mamba2 mixer is Granite-4.0-H's (:mod:`kvjax.models.hf.granite`).

config.json fields: as Granite-4.0-H's for the shared ones (without the multipliers, experts and
``position_embedding_type``), plus ``attn_layer_indices``, ``intermediate_size``, ``mlp_bias`` and
``rope_parameters.partial_rotary_factor`` (an odd rotary width is refused; a top-level
``partial_rotary_factor`` has no effect, as in transformers, which pins it to 0.5);
``z_loss_coefficient`` and ``num_logits_to_keep`` do not change the math.
"""

from __future__ import annotations

from kvjax.models.attention import AttnSpec
from kvjax.models.hf import fields as fl
from kvjax.models.hf import hybrid as hy
from kvjax.models.hf.granite import _common, _flags, _mamba_spec, mixer_entries
from kvjax.models.hf.hybrid import Block, Entry, HybridConfig, HybridModel
from kvjax.models.moe import MLPSpec

ARCH = "BambaForCausalLM"
Model = HybridModel


def config_from_hf(cfg: dict) -> HybridConfig:
    arch = ARCH
    hy.check_common(arch, cfg)
    V, d, L, eps, Hq, Hkv, D = _common(arch, cfg, eps_default=1e-5, kv_heads_default=8)
    idx = fl.field(arch, cfg, "attn_layer_indices", [], null=[])  # null: no attention layer, as transformers
    if not isinstance(idx, list) or any(not isinstance(i, int) or not 0 <= i < L for i in idx):
        raise ValueError(f"{arch}: config.json attn_layer_indices must list layer indices in [0, {L}), got {idx!r}")
    kinds = ["attn" if i in idx else "mamba" for i in range(L)]
    # transformers' BambaConfig passes partial_rotary_factor=0.5 whatever the top-level field says:
    # only rope_parameters.partial_rotary_factor changes it
    theta, partial = fl.check_rope(arch, cfg, default_partial=0.5, top_level_partial=False)
    rotary = int(D * partial)
    if rotary % 2 or not 0 < rotary <= D:
        fl.refuse(arch, "partial_rotary_factor", partial, f"it must rotate an even number of the {D} features")
    blocks = []
    for k in kinds:
        blocks += [Block(k), Block("mlp")]
    return HybridConfig(
        architecture=arch, vocab_size=V, d_model=d, rms_eps=eps, blocks=tuple(blocks),
        attn=AttnSpec(Hq, Hkv, D, rope_theta=theta, rotary_dim=None if rotary == D else rotary)
        if "attn" in kinds else None,
        mamba=_mamba_spec(arch, cfg, d, eps) if "mamba" in kinds else None,
        mlp=MLPSpec(fl.check_int(arch, cfg, "intermediate_size", 14336), True, "silu"),
        mlp_bias=fl.check_bool(arch, cfg, "mlp_bias", False),
        **_flags(arch, cfg),
    )


def _plan(c: HybridConfig) -> list[Entry]:
    d, F = c.d_model, c.mlp.hidden
    plan = hy.head_entries(c, "model.embed_tokens.weight", "model.final_layernorm.weight")
    for i in range(len(c.blocks) // 2):
        pre = f"model.layers.{i}."
        ffn = 2 * i + 1
        plan += mixer_entries(c, i, pre, ("input_layernorm.weight", "pre_ff_layernorm.weight"))
        for n, leaf, shape in (("gate_proj", "w_gate", (F, d)), ("up_proj", "w_up", (F, d)),
                               ("down_proj", "w_down", (d, F))):
            name = f"{pre}feed_forward.{n}."
            plan.append(Entry(("blocks", ffn, leaf), (name + "weight",), (shape,), hy.linear_t))
            if c.mlp_bias:
                plan.append(Entry(("blocks", ffn, "b" + leaf[1:]), (name + "bias",), ((shape[0],),), hy.same))
    return plan


expected_tensors, params_from_tensors = hy.plan_protocol(_plan)
