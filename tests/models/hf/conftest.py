"""Small random Hugging Face checkpoints of the hybrid architectures, made at test time.

``hf_checkpoint(name)`` saves (once per session) the checkpoint :data:`CHECKPOINTS` names:
transformers builds the model from a tiny config (``from_config``, fixed torch seed), the
weights are redrawn so that every term matters (linear weights ``N(0, 1/fan_in)``, norm
weights around 1, ``A_log``, ``D``, ``dt_bias`` and router biases spread out; one Mamba head's
``dt_bias`` low enough that Nemotron-H's ``time_step_min`` clip acts), and
``save_pretrained`` writes ``config.json`` + ``model.safetensors``. Nothing is downloaded.
"""

from __future__ import annotations

import json
import math
import os
import re

import pytest

MAMBA = dict(mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=8, mamba_d_head=32, mamba_expand=2,
             mamba_d_conv=4, mamba_chunk_size=8)
COMMON = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
              rms_norm_eps=1e-5)

# name -> (config class name, kwargs)
CHECKPOINTS = {
    # RoPE, routed experts + shared MLP, untied, every multiplier off 1, 2 Mamba groups
    "granite_rope_moe": ("GraniteMoeHybridConfig", dict(
        COMMON, **MAMBA, num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"],
        position_embedding_type="rope", intermediate_size=32, shared_intermediate_size=48,
        num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=2.0, residual_multiplier=0.5,
        attention_multiplier=0.1, logits_scaling=3.0, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0})),
    # NoPE, no routed experts (shared MLP only), tied embeddings, one Mamba group, attention first,
    # attention and Mamba projection biases, no conv bias
    "granite_nope_dense": ("GraniteMoeHybridConfig", dict(
        COMMON, **dict(MAMBA, mamba_n_groups=1), num_hidden_layers=3,
        layer_types=["attention", "mamba", "mamba"], position_embedding_type=None,
        shared_intermediate_size=48, num_local_experts=0, embedding_multiplier=1.5,
        residual_multiplier=0.7, attention_multiplier=0.2, logits_scaling=2.0, tie_word_embeddings=True,
        attention_bias=True, mamba_proj_bias=True, mamba_conv_bias=False)),
    "bamba": ("BambaConfig", dict(
        COMMON, **MAMBA, num_hidden_layers=3, attn_layer_indices=[1], intermediate_size=96, mlp_bias=True)),
    "nemotron_h": ("NemotronHConfig", dict(
        vocab_size=128, hidden_size=64, layers_block_type=["mamba", "moe", "attention", "mlp"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
        mamba_num_heads=4, mamba_head_dim=16, n_groups=2, ssm_state_size=8, conv_kernel=4, chunk_size=8,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=48, n_group=2, topk_group=1, routed_scaling_factor=1.5,
        layer_norm_epsilon=1e-5)),
    # latent MoE projections, MLP biases, no group limit, un-normalised top-k
    "nemotron_h_latent": ("NemotronHConfig", dict(
        vocab_size=128, hidden_size=64, layers_block_type=["moe", "mamba", "moe"],
        mamba_num_heads=4, mamba_head_dim=16, n_groups=1, ssm_state_size=8, chunk_size=8,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, moe_latent_size=32,
        moe_shared_expert_intermediate_size=48, n_group=1, topk_group=1, norm_topk_prob=False,
        mlp_bias=True, use_bias=True, layer_norm_epsilon=1e-5)),
}


def redraw_weights(model, torch, seed: int = 0) -> None:
    """Every parameter redrawn so that logits are far from uniform and every term matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            shape = p.shape

            def randn(*s):
                return torch.randn(*s, generator=g)

            if name.endswith("A_log"):
                p.copy_(torch.log(torch.rand(shape, generator=g) * 15 + 1))
            elif name.endswith(".D"):
                p.copy_(1 + 0.5 * randn(shape))
            elif name.endswith("dt_bias"):
                dt = torch.exp(torch.rand(shape, generator=g) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
                inv = dt + torch.log(-torch.expm1(-dt))
                inv[0] = -7.5  # softplus(-7.5 + dt) straddles time_step_min = 1e-3
                p.copy_(inv)
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.2 * randn(shape))
            elif name.endswith("bias"):
                p.copy_(0.1 * randn(shape))
            elif "conv1d.weight" in name:
                p.copy_(0.5 * randn(shape))
            elif "embed" in name:
                p.copy_(randn(shape))
            else:  # linear / expert weights [..., out, in]
                p.copy_(randn(shape) / math.sqrt(shape[-1]))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


def hf_greedy(hf, prompt, n, torch) -> list[int]:
    """transformers' greedy ``generate`` of ``n`` tokens after ``prompt`` (no early stop)."""
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(autouse=True)
def _torch_on_one_thread():
    """torch's CPU ops on one thread during each test here (restored after): these models are
    tiny, and on a busy 2-core machine (two xdist workers) torch's second thread spin-waits for
    a core (a 3-layer forward of 10 tokens: ~2 s on 2 threads, ~10 ms on one)."""
    try:
        import torch
    except ImportError:
        yield
        return
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """``hf_checkpoint(name) -> directory`` of the saved checkpoint (made once per session)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    made: dict[str, str] = {}

    def make(name: str) -> str:
        if name not in made:
            cls, kw = CHECKPOINTS[name]
            cfg = getattr(transformers, cls)(**kw)
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(cfg)
            redraw_weights(model, torch)
            path = tmp_path_factory.mktemp(name)
            model.save_pretrained(path)
            made[name] = str(path)
        return made[name]

    return make


@pytest.fixture(scope="session")
def hf_model(hf_checkpoint):
    """``hf_model(name)``: transformers' model of that checkpoint, float32, eval mode (cached)."""
    transformers = pytest.importorskip("transformers")
    models = {}

    def load(name: str):
        if name not in models:
            models[name] = transformers.AutoModelForCausalLM.from_pretrained(
                hf_checkpoint(name), dtype="float32").eval()
        return models[name]

    return load


# ------------------------------------------------------ editing and refusing checkpoints


def edit_config(path, **changes):
    """``config.json`` of the checkpoint directory ``path`` with ``changes`` applied."""
    f = os.path.join(path, "config.json")
    cfg = json.load(open(f))
    cfg.update(changes)
    json.dump(cfg, open(f, "w"))


def refused(match, path, **kw):
    """``load_pretrained(path)`` raises kvjax's own ValueError (raised in kvjax, not chained from
    another error) matching every regex in ``match``; the message."""
    from kvjax.models import load_pretrained

    with pytest.raises(ValueError) as info:
        load_pretrained(path, **kw)
    e = info.value
    assert e.__cause__ is None and (e.__context__ is None or e.__suppress_context__), repr(e.__context__)
    assert "/kvjax/" in info.traceback[-1].path.as_posix(), info.traceback[-1].path
    for m in [match] if isinstance(match, str) else match:
        assert re.search(m, str(e)), (m, str(e))
    return str(e)


@pytest.fixture
def no_weight_read(monkeypatch):
    """Fails the test if any tensor's bytes are read (headers only are allowed)."""
    from kvjax.models.hf import loader

    def reader(tensors):
        def get(name):
            raise AssertionError(f"weight {name!r} read before the checkpoint was refused")
        return get

    monkeypatch.setattr(loader, "_reader", reader)
