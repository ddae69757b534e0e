"""Real-size models through the Runner's own compiled step, and transformers beside them (issue 24).

    PYTHONPATH=. python benchmarks/bench_model.py --gpu-run OUTDIR          # the whole H100 matrix
    PYTHONPATH=. python benchmarks/bench_model.py --preset tiny --cpu-smoke  # seconds, on a CPU

Presets have the shapes of real checkpoints (random, seeded weights; nothing is downloaded).
Each is the checkpoint's ``config.json`` written out below and read by kvjax's own loader
(``config_from_hf`` of the architecture module), then served in bfloat16:

* ``granite-4.0-h-micro`` (~3.2 B): ``ibm-granite/granite-4.0-h-micro``'s config.json as
  mirrored on the Hugging Face hub (e.g. the GraniteMoeHybridForCausalLM config of
  ``anuj6316/granite``: hidden 2048, 40 layers = 36 Mamba2 + 4 attention at 5/15/25/35, Mamba2
  64 heads x 64, d_state 128, 1 group, GQA 32/8, dense shared MLP 8192, no experts, NoPE,
  vocabulary 100,352, tied embeddings). The issue brief said hidden 2560: that is
  ``granite-4.0-micro``, the plain-transformer sibling (40 attention layers; config of
  ``NexaAI/Granite-4-Micro-ANE``), not the hybrid, whose real width is 2048.
* ``nemotron-h-8b`` (~8.1 B): ``nvidia/Nemotron-H-8B-Base-8K`` = transformers' / vLLM's
  ``NemotronHConfig`` defaults (docs.vllm.ai ``vllm.transformers_utils.configs.nemotron_h``):
  hidden 4096, 52 layers ``M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-`` (24 Mamba2,
  4 attention, 24 relu2 MLP 21504), Mamba2 128 heads x 64, d_state 128, 8 groups, GQA 32/8 x 128,
  vocabulary 131,072.
* ``deepseek-v2-lite`` (~15.7 B, 2.4 B active): ``deepseek-ai/DeepSeek-V2-Lite``'s shapes as a
  DeepseekV3 config: hidden 2048, 27 layers (first dense, intermediate 10944), 16 heads, MLA
  kv_lora 512, no q_lora, nope 128 / rope 64 / v 128, 64 routed experts (1408) top-6 + 2 shared,
  vocabulary 102,400; group-limited routing off (n_group = topk_group = 1), sigmoid routing
  (the only scoring kvjax's DeepseekV3 has; V2 uses softmax: same shapes and bytes).
* ``tiny`` / ``tiny-mla``: the same architectures at toy size, for the CPU smoke test.

Every measurement goes through the Runner's compiled step of the bucket (``Runner.jitted_step``
lowered and compiled as ``precompile`` does), on a state fabricated directly: request rows
whose ``num_computed`` is the context, block tables filled, pools random. Decode steps are real
``StepPlan``s packed by ``Runner.prepare``; a prefill step installs the request, writes its block
table, zeroes its blocks and slot and runs the whole prompt (as a new request's first step).

Per row: ``device_us`` (the compiled executable called back to back: the steady-state step, the
slope of the wall time over runs of 8 and 24 calls, median of 3; ``device_us_cold`` the mean
per call of the 8-call runs, which also holds a share of the first call's launch on an idle GPU),
``host_us`` (prepare + launch + fetch of one synchronous step, minus ``device_us``), the byte
floor (weights read once — MoE: the experts a uniform router touches at that batch — plus live
KV and recurrent states read and written once, over the device-to-device copy bandwidth
measured in the same process on 1 GiB), the bf16 matmul floor (2 x active params x tokens, plus
attention's products over each query's visible keys, over 989 TFLOP/s, the H100 SXM dense bf16
datasheet figure; the measured 8192^3 bf16 matmul rate is in ``meta``; the weights' products
alone are ``matmul_floor_params_us``), ``floor_ratio`` = device / max(floors), tokens/s, peak device memory, compile time.
The ``transformers`` rows run transformers' own forward (torch, CUDA, bf16) for the same shapes
in the same run: prefill is the whole sequence (``use_cache=False``), decode is one token over a
past of ``context`` tokens (the past made by a batch-1 prefill and repeated over the batch).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import time
import traceback

MODE = None  # "kvjax" / "transformers" / driver

# ----------------------------------------------------------------------------- presets


def _granite_h_micro() -> dict:
    types = ["mamba"] * 40
    for i in (5, 15, 25, 35):
        types[i] = "attention"
    return {
        "architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid",
        "vocab_size": 100352, "hidden_size": 2048, "num_hidden_layers": 40, "layer_types": types,
        "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 8192,
        "shared_intermediate_size": 8192, "num_local_experts": 0, "num_experts_per_tok": 0,
        "mamba_n_heads": 64, "mamba_d_head": 64, "mamba_d_state": 128, "mamba_n_groups": 1,
        "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 256, "mamba_conv_bias": True,
        "mamba_proj_bias": False, "position_embedding_type": None, "attention_multiplier": 0.015625,
        "embedding_multiplier": 12.0, "residual_multiplier": 0.22, "logits_scaling": 8.0,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "hidden_act": "silu",
        "attention_bias": False, "max_position_embeddings": 131072, "normalization_function": "rmsnorm",
    }


def _nemotron_h_8b() -> dict:
    return {
        "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
        "vocab_size": 131072, "hidden_size": 4096, "num_hidden_layers": 52,
        "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "intermediate_size": 21504, "mlp_hidden_act": "relu2", "mamba_num_heads": 128,
        "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8, "conv_kernel": 4,
        "chunk_size": 128, "layer_norm_epsilon": 1e-5, "use_conv_bias": True, "use_bias": False,
        "mlp_bias": False, "attention_bias": False, "tie_word_embeddings": False,
        "mamba_ssm_cache_dtype": "float32", "max_position_embeddings": 8192,
    }


def _deepseek_v2_lite() -> dict:
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944,
        "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16,
        "num_key_value_heads": 16, "n_shared_experts": 2, "n_routed_experts": 64,
        "num_experts_per_tok": 6, "routed_scaling_factor": 1.0, "kv_lora_rank": 512,
        "q_lora_rank": None, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
        "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "norm_topk_prob": False,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_interleave": True,
        "attention_bias": False, "tie_word_embeddings": False, "max_position_embeddings": 163840,
    }


def _tiny() -> dict:
    return {
        "architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid",
        "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 4,
        "layer_types": ["mamba", "attention", "mamba", "mamba"],
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
        "shared_intermediate_size": 128, "num_local_experts": 0, "num_experts_per_tok": 0,
        "mamba_n_heads": 4, "mamba_d_head": 32, "mamba_d_state": 16, "mamba_n_groups": 1,
        "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 256, "position_embedding_type": None,
        "attention_multiplier": 0.25, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
        "hidden_act": "silu", "max_position_embeddings": 4096,
    }


def _tiny_mla() -> dict:
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
        "n_shared_experts": 1, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "routed_scaling_factor": 1.0, "kv_lora_rank": 32, "q_lora_rank": None, "qk_rope_head_dim": 8,
        "v_head_dim": 16, "qk_nope_head_dim": 16, "n_group": 1, "topk_group": 1,
        "first_k_dense_replace": 1, "norm_topk_prob": False, "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "tie_word_embeddings": False, "max_position_embeddings": 4096,
    }


PRESETS = {
    "granite-4.0-h-micro": _granite_h_micro,
    "nemotron-h-8b": _nemotron_h_8b,
    "deepseek-v2-lite": _deepseek_v2_lite,
    "tiny": _tiny,
    "tiny-mla": _tiny_mla,
}

# The GPU matrix (one run call of <= 9 minutes for everything, so cut; see BENCHMARKS.md).
GPU_MATRIX = {
    "granite-4.0-h-micro": {"decode": [(1024, (1, 16, 64, 256)), (4096, (1, 16, 64, 256))],
                            "prefill": (2048, 8192)},
    "nemotron-h-8b": {"decode": [(1024, (1, 16, 64, 256))], "prefill": (2048,)},
    "deepseek-v2-lite": {"decode": [(1024, (1, 16, 64, 256))], "prefill": (2048,)},
}
SMOKE_MATRIX = {"decode": [(24, (1, 4))], "prefill": (48,)}
BLOCK_SIZE = 16
SLACK = 64  # decode tokens a fabricated row can still take (every timed step appends one)
NOMINAL_BF16_TFLOPS = 989.0  # H100 SXM dense bf16 (datasheet)
# serving mode: only token ids come back each step (RunnerConfig.return_logits, where the Runner has it)
RETURN_LOGITS = {"return_logits": False}
CHILD_CAP_S = {"kvjax": 240.0, "transformers": 100.0}  # one preset's process, at most (rows stream out)
PROFILE_BATCH = 64  # decode batch whose kernels are traced (top kernels into the row)


def log(*a):
    print(*a, flush=True)


def hf_config(preset: str) -> dict:
    return PRESETS[preset]()


def build_model(preset: str, dtype: str = "bfloat16"):
    from kvjax.models.hf import loader

    cfg = hf_config(preset)
    module = loader.architecture_module(cfg["architectures"][0])
    config = module.config_from_hf(cfg)
    if dataclasses.is_dataclass(config) and any(f.name == "dtype" for f in dataclasses.fields(config)):
        config = dataclasses.replace(config, dtype=dtype)
    return loader._make_model(module, config, dtype)


# ------------------------------------------------------------------------ param shapes


def param_shapes(model) -> dict:
    """The param tree as ``(shape, dtype name)`` leaves, without building any array."""
    from kvjax.models.hf.deepseek_v3 import DeepseekV3
    from kvjax.models.hf.hybrid import leaf_dtype

    if isinstance(model, DeepseekV3):
        c, dt = model.config, model.dtype
        d, H, qk, nope, v = c.hidden_size, c.num_attention_heads, c.qk_head_dim, c.qk_nope_head_dim, c.v_head_dim
        f32 = "float32"
        tree = {"embed": ((c.vocab_size, d), dt), "final_norm": ((d,), f32), "lm_head": ((d, c.vocab_size), dt),
                "layers": []}
        for i in range(c.num_hidden_layers):
            attn = {}
            if c.q_lora_rank is None:
                attn["q"] = ((d, H, qk), dt)
            else:
                attn["q_a"] = ((d, c.q_lora_rank), dt)
                attn["q_a_norm"] = ((c.q_lora_rank,), f32)
                attn["q_b"] = ((c.q_lora_rank, H, qk), dt)
            attn["kv_a"] = ((d, c.kv_lora_rank + c.qk_rope_head_dim), dt)
            attn["kv_a_norm"] = ((c.kv_lora_rank,), f32)
            attn["w_uk"] = ((H, c.kv_lora_rank, nope), dt)
            attn["w_uv"] = ((H, v, c.kv_lora_rank), dt)
            attn["o"] = ((H, v, d), dt)
            if not c.is_moe_layer(i):
                F = c.intermediate_size
                mlp = {"gate": ((d, F), dt), "up": ((d, F), dt), "down": ((F, d), dt)}
            else:
                E, F, Fs = c.n_routed_experts, c.moe_intermediate_size, c.moe_intermediate_size * c.n_shared_experts
                mlp = {"router": ((d, E), dt), "bias": ((E,), f32), "w_gate": ((E, d, F), dt),
                       "w_up": ((E, d, F), dt), "w_down": ((E, F, d), dt), "shared_gate": ((d, Fs), dt),
                       "shared_up": ((d, Fs), dt), "shared_down": ((Fs, d), dt)}
            tree["layers"].append({"input_norm": ((d,), f32), "post_norm": ((d,), f32), "attn": attn, "mlp": mlp})
        return tree
    shapes = model.param_shapes()
    import jax

    def is_shape(x):
        return isinstance(x, tuple) and all(isinstance(n, int) for n in x)

    return jax.tree.map(lambda s: (s, leaf_dtype(model.config, s).name), shapes, is_leaf=is_shape)


def _is_leaf(x):
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], tuple) and isinstance(x[1], str)


_DRAW = {}


def _draw(key, shape, dtype, std, sharding):
    """``normal(key, shape) * std`` in ``dtype`` on the device (one compile per shape and dtype)."""
    import jax
    import jax.numpy as jnp

    fn = _DRAW.get((shape, dtype, sharding))
    if fn is None:
        fn = jax.jit(lambda k, s: (jax.random.normal(k, shape, jnp.float32) * s).astype(dtype),
                     out_shardings=sharding)
        _DRAW[(shape, dtype, sharding)] = fn
    return fn(key, jnp.float32(std))


def device_params(model, seed: int, sharding):
    """Random params made on the device (seeded; normal with std 1/sqrt(fan_in), norms 1, Mamba's
    A_log = log(1..H), dt_bias = softplus^-1(0.01)), placed with ``sharding``."""
    import jax
    import numpy as np

    tree = param_shapes(model)
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_leaf)
    key = jax.random.PRNGKey(seed)
    out = []
    for i, (path, (shape, dtype)) in enumerate(flat):
        name = str(getattr(path[-1], "key", path[-1]))
        if len(shape) == 1:
            if name.endswith("norm") or name == "D":
                a = np.ones(shape, np.float32)
            elif name == "A_log":
                a = np.log(np.arange(1, shape[0] + 1, dtype=np.float32))
            elif name == "dt_bias":
                a = np.full(shape, math.log(math.expm1(0.01)), np.float32)
            else:
                a = np.zeros(shape, np.float32)
            out.append(jax.device_put(a.astype(dtype), sharding))
            continue
        if name == "embed":
            std = 1.0
        else:
            fan_in = shape[0] if len(shape) == 2 or name == "q" else int(np.prod(shape[:-1]))
            if name in ("w_uk", "w_uv"):  # the latent rank: their up-projection's contraction
                fan_in = shape[1] if name == "w_uk" else shape[2]
            if len(shape) == 3 and name in ("w_gate", "w_up", "w_down"):
                fan_in = shape[1]
            std = 1.0 / math.sqrt(fan_in)
        out.append(_draw(jax.random.fold_in(key, i), tuple(shape), dtype, std, sharding))
    return jax.tree_util.tree_unflatten(treedef, out)


def count_params(model) -> dict:
    """Matrix params by role (for the floors): body (every matrix but the embedding table and
    head), head, routed experts (all of them) and the experts one token uses."""
    import numpy as np
    import jax

    from kvjax.models.hf.deepseek_v3 import DeepseekV3

    tree = param_shapes(model)
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_leaf)
    body = head = routed = embed = vec = 0
    nbytes = 0
    for path, (shape, dtype) in flat:
        name = str(getattr(path[-1], "key", path[-1]))
        n = int(np.prod(shape))
        nbytes += n * np.dtype(np.float32 if dtype == "float32" else np.float16).itemsize
        if len(shape) == 1:
            vec += n
        elif name == "embed":
            embed += n
        elif name == "lm_head":
            head += n
        elif len(shape) == 3 and name in ("w_gate", "w_up", "w_down"):
            routed += n
        else:
            body += n
    tied = "lm_head" not in tree
    if tied:
        head = embed
    E = k = 0
    moe_layers = 0
    if isinstance(model, DeepseekV3):
        c = model.config
        E, k = c.n_routed_experts, c.num_experts_per_tok
        moe_layers = sum(c.is_moe_layer(i) for i in range(c.num_hidden_layers))
    elif getattr(model.config, "moe", None) is not None:
        E, k = model.config.moe.num_experts, model.config.moe.top_k
        moe_layers = model.config.count("moe")
    return {"body": body, "head": head, "embed": embed, "routed": routed, "vectors": vec, "tied": tied,
            "experts": E, "top_k": k, "moe_layers": moe_layers, "param_bytes": nbytes,
            "total": body + routed + embed + (0 if tied else head) + vec,
            "active_per_token": body + (routed * k // E if E else 0)}


def cache_bytes_per_token(model, kv_cache_dtype_bytes: int = 2) -> int:
    """KV (or MLA latent) bytes one token holds over every attention layer."""
    from kvjax.models.hf.deepseek_v3 import DeepseekV3

    if isinstance(model, DeepseekV3):
        return model.config.num_hidden_layers * model.config.latent_dim * kv_cache_dtype_bytes
    c = model.config
    if c.attn is None:
        return 0
    return c.count("attn") * 2 * c.attn.num_kv_heads * c.attn.head_dim * kv_cache_dtype_bytes


def state_bytes_per_row(model) -> int:
    """Recurrent-state bytes one request holds (conv float32 + SSM state)."""
    import numpy as np

    from kvjax.models.hf.deepseek_v3 import DeepseekV3

    if isinstance(model, DeepseekV3) or model.config.mamba is None:
        return 0
    c, m = model.config, model.config.mamba
    ssm = m.num_heads * m.head_dim * m.d_state * np.dtype(c.ssm_state_dtype).itemsize
    conv = m.conv_dim * (m.conv_width - 1) * 4
    return c.count("mamba") * (ssm + conv)


def attention_pair_flops(model) -> int:
    """FLOPs of one (query, visible key) pair over every attention layer: the score and the value
    products, ``2 x heads x (key width + value width)`` a layer. MLA counts its naive form
    (``qk_nope + qk_rope`` and ``v_head_dim``, what the split form's prefill computes); the
    absorbed decode's wider products are a choice, not a floor. Mamba layers count nothing."""
    from kvjax.models.hf.deepseek_v3 import DeepseekV3

    c = model.config
    if isinstance(model, DeepseekV3):
        return 2 * c.num_hidden_layers * c.num_attention_heads * (
            c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim)
    if c.attn is None:
        return 0
    return 2 * c.count("attn") * c.attn.num_heads * 2 * c.attn.head_dim


def floors(p: dict, model, *, phase: str, batch: int, context: int, tokens: int, bw: float,
           tflops: float) -> dict:
    """Byte and matmul floors (us) of one step. The matmul floor counts the weights' products
    (``2 x active params`` a token, the head's for each logits row) and attention's (each query's
    visible keys: a fresh prefill's ``T (T + 1) / 2`` causal pairs, a decode token's ``context + 1``
    keys; :func:`attention_pair_flops`); ``matmul_floor_params_us`` is the weights' alone."""
    wbytes = 2  # bf16 matrices
    E, k = p["experts"], p["top_k"]
    if E:
        per_expert = p["routed"] / E
        touched = E * (1 - (1 - k / E) ** tokens)  # distinct experts a uniform router touches
        routed_read = per_expert * touched
    else:
        routed_read = 0
    weights = (p["body"] + p["head"] + routed_read) * wbytes + p["vectors"] * 4
    per_tok = cache_bytes_per_token(model)
    if phase == "decode":
        kv = batch * (context + 1) * per_tok  # read the past, write the new token
        states = 2 * batch * state_bytes_per_row(model)  # read and write once
        logits_rows = batch
    else:
        kv = tokens * per_tok  # written once
        states = state_bytes_per_row(model)  # written once (fresh)
        logits_rows = 1
    total = weights + kv + states
    param_flops = 2 * (p["active_per_token"] * tokens + p["head"] * logits_rows)
    pairs = batch * (context + 1) if phase == "decode" else tokens * (tokens + 1) // 2
    attn_flops = attention_pair_flops(model) * pairs
    flops = param_flops + attn_flops
    return {"byte_floor_us": total / bw * 1e6, "matmul_floor_us": flops / (tflops * 1e12) * 1e6,
            "matmul_floor_params_us": param_flops / (tflops * 1e12) * 1e6,
            "floor_bytes": total, "floor_flops": flops, "attention_flops": attn_flops,
            "weight_bytes_read": weights, "kv_bytes": kv, "state_bytes": states}


# ------------------------------------------------------------------------------ kvjax side


def floor_ratios(device_us: float, fl: dict) -> dict:
    """A row's ratios to its :func:`floors`: ``floor_ratio`` (device / the larger floor),
    ``byte_ratio`` and ``matmul_fraction`` (the matmul floor over the device time)."""
    return {"floor_ratio": device_us / max(fl["byte_floor_us"], fl["matmul_floor_us"]),
            "byte_ratio": device_us / fl["byte_floor_us"], "matmul_fraction": fl["matmul_floor_us"] / device_us}


def measure_ceilings(jax, jnp):
    """Device-to-device copy bandwidth on 1 GiB (bytes read + written) and a bf16 matmul rate."""
    n = (1 << 30) // 4
    x = jnp.arange(n, dtype=jnp.uint32)
    f = jax.jit(lambda a: a ^ jnp.uint32(1))
    jax.block_until_ready(f(x))
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        y = None
        for _ in range(10):
            y = f(x)
        jax.block_until_ready(y)
        ts.append((time.perf_counter() - t0) / 10)
    bw = 2 * (1 << 30) / min(ts)
    del x, y
    out = {"copy_bytes": 2 * (1 << 30), "copy_us": min(ts) * 1e6, "copy_bw_Bps": bw}
    if jax.default_backend() == "gpu":
        m = 8192
        a = jax.random.normal(jax.random.PRNGKey(1), (m, m), jnp.bfloat16)
        b = jax.random.normal(jax.random.PRNGKey(2), (m, m), jnp.bfloat16)
        g = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
        jax.block_until_ready(g(a, b))
        ts = []
        for _ in range(3):
            t0 = time.perf_counter()
            c = None
            for _ in range(10):
                c = g(a, b)
            jax.block_until_ready(c)
            ts.append((time.perf_counter() - t0) / 10)
        out["matmul_tflops_measured"] = 2 * m ** 3 / min(ts) / 1e12
        del a, b, c
    return out


def steady_step_us(call, *, groups: int = 3, per_group: int = 8) -> dict:
    """``call()`` launched back to back from an idle device, ``groups`` times in runs of
    ``per_group`` and of ``3 * per_group`` calls. ``slopes``: the steady-state step of each
    group, the slope of the two runs' wall times (the first launch and the final wait cancel);
    ``cold_us`` / ``enqueue_us``: each short run's wall time and host enqueue time per call."""
    import jax

    def run(n):  # (wall us, enqueue us) of n calls, from an idle device to the last one's end
        jax.block_until_ready(call())
        t0 = time.perf_counter()
        out = None
        for _ in range(n):
            out = call()
        t1 = time.perf_counter()
        jax.block_until_ready(out)
        return (time.perf_counter() - t0) * 1e6, (t1 - t0) * 1e6

    short, long_ = [], []
    for _ in range(groups):
        short.append(run(per_group))
        long_.append(run(3 * per_group))
    return {"slopes": [(b[0] - a[0]) / (2 * per_group) for a, b in zip(short, long_)],
            "cold_us": [a[0] / per_group for a in short], "enqueue_us": [a[1] / per_group for a in short]}


class Bench:
    """One preset's Runner, its fabricated state and the measurements."""

    def __init__(self, preset: str, matrix: dict, *, seed: int = 0, workers: int = 4, model=None,
                 mesh=None, params=None):
        """``model``: the preset's model (default: built from the preset); ``mesh``: the Runner's
        (default 1x1); ``params``: host (numpy) params, laid out and sharded by the Runner (default:
        random ones drawn replicated on the devices: a 1x1 mesh only)."""
        import jax
        import jax.numpy as jnp
        import numpy as np
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        from kvjax.runner import Runner, RunnerConfig
        from kvjax.runner.mesh import make_mesh

        self.jax, self.jnp, self.np = jax, jnp, np
        self.preset = preset
        self.matrix = matrix
        self.model = build_model(preset) if model is None else model
        ctxs = [c for c, _ in matrix["decode"]]
        batches = sorted({b for _, bs in matrix["decode"] for b in bs})
        prefills = tuple(matrix["prefill"])
        self.max_model_len = max([c + SLACK for c in ctxs] + list(prefills)) + BLOCK_SIZE
        if matrix.get("max_model_len"):  # a longer table than the contexts need (attention reads live blocks only)
            self.max_model_len = max(self.max_model_len, int(matrix["max_model_len"]))
        blocks_decode = max((b * math.ceil((c + SLACK) / BLOCK_SIZE) for c, bs in matrix["decode"] for b in bs),
                            default=0)
        blocks_prefill = max([math.ceil(n / BLOCK_SIZE) for n in prefills] or [0])
        num_blocks = max(1 + max(blocks_decode, blocks_prefill), int(matrix.get("num_blocks", 0)))
        max_seqs = max(batches + [int(matrix.get("max_num_seqs", 0)), 1])
        token_sizes = tuple(sorted(set(batches) | set(prefills)))
        global RETURN_LOGITS
        if "return_logits" not in {f.name for f in dataclasses.fields(RunnerConfig)}:
            RETURN_LOGITS = {}
        self.cfg = RunnerConfig(model=self.model, block_size=BLOCK_SIZE, num_blocks=num_blocks,
                                max_model_len=self.max_model_len, max_num_seqs=max_seqs,
                                max_num_batched_tokens=max(token_sizes), token_sizes=token_sizes,
                                max_new_requests_per_step=1, seed=seed, **RETURN_LOGITS)
        mesh = make_mesh(1, 1) if mesh is None else mesh
        t0 = time.perf_counter()
        if params is None:
            params = device_params(self.model, seed, NamedSharding(mesh, P()))
            jax.block_until_ready(params)
        self.param_init_s = time.perf_counter() - t0
        self.runner = Runner(self.cfg, mesh=mesh, params=params)
        del params
        self._randomize_pools(seed)
        self.params_info = count_params(self.model)
        self.workers = workers
        self.compile_s = {}

    def _randomize_pools(self, seed):
        jax, jnp = self.jax, self.jnp
        r = self.runner
        specs = {n: (a.shape, a.dtype, a.sharding) for n, a in r._pools.items()}
        r._pools = None
        pools = {}
        for i, (n, (shape, dtype, sh)) in enumerate(sorted(specs.items())):
            pools[n] = _draw(jax.random.fold_in(jax.random.PRNGKey(seed + 1), i), tuple(shape),
                             jnp.dtype(dtype).name, 0.1, sh)
        jax.block_until_ready(pools)
        r._pools = pools

    def compile_all(self):
        from concurrent.futures import ThreadPoolExecutor

        r = self.runner
        # the buckets the matrix steps run in: decode-only ones for decode, mixed ones for prefill
        todo = sorted({r.buckets.choose(b, b, decode_only=True) for _, bs in self.matrix["decode"] for b in bs}
                      | {r.buckets.choose(n, 1) for n in self.matrix["prefill"]})

        def build(b):
            t0 = time.perf_counter()
            try:
                lowered, spec = r._lower(b)
                return b, (lowered.compile(), spec), time.perf_counter() - t0
            except Exception as e:  # noqa: BLE001 - the rows in this bucket fail, the others run
                log(f"  bucket T={b.num_tokens} decode_only={b.decode_only} failed to compile: "
                    f"{type(e).__name__}: {str(e)[:300]}")
                return b, None, time.perf_counter() - t0

        t0 = time.perf_counter()
        with ThreadPoolExecutor(max(1, min(self.workers, len(todo)))) as ex:
            for b, built, s in ex.map(build, todo):
                if built is None:
                    continue
                r.executables[b] = built
                self.compile_s[b] = s
                log(f"  compiled bucket T={b.num_tokens} R={b.num_reqs} decode_only={b.decode_only} in {s:.1f} s")
        self.compile_wall_s = time.perf_counter() - t0

    # -- state fabrication
    def _rows(self, rank: int = 0):
        """Rank ``rank``'s ``(RequestState, BlockTables)`` on the host (the pools stay put)."""
        from kvjax.runner.runner import _local_rows

        r = self.runner
        return r._join_rows([_local_rows(a)[rank] for a in r._rows[0]], xp=self.np)

    def _put_rows(self, req, tables, rank: int = 0):
        from kvjax.runner.mesh import global_array

        np, r = self.np, self.runner

        def put(a, value):
            host = np.array(self.jax.device_get(a))
            host[rank] = np.asarray(value)
            return global_array(a.sharding, host.shape, host)

        r._rows = (tuple(map(put, r._rows[0], r._split_rows((req, tables)))), *r._rows[1:])

    def fabricate_decode_ranks(self, batch: int, context: int) -> dict:
        """``batch`` decoding requests split evenly over every data rank (``batch`` a multiple of
        the rank count): ``{rank: plan}`` for :meth:`time_plan` (the Runner's ``prepare`` takes one
        plan per rank)."""
        D = self.runner.num_ranks
        if batch % D:
            raise ValueError(f"batch must be a multiple of the {D} data ranks, got {batch}")
        return {d: self.fabricate_decode(batch // D, context, rank=d) for d in range(D)}

    def fabricate_decode(self, batch: int, context: int, rank: int = 0):
        """Rank ``rank``'s rows 0..batch-1 decoding with ``context`` tokens cached; their blocks and
        slots (each rank has its own pools, so every rank uses the same ids)."""
        np = self.np
        from kvjax.host.scheduler import Request, ScheduledRequest, StepPlan

        req, tables = self._rows(rank)
        req = self.jax.tree.map(np.array, req)
        tabs = [np.array(t) for t in tables.tables]
        nblk = np.array(tables.num_blocks)
        rng = np.random.default_rng(context * 7 + batch)
        V = self.model.vocab_size
        per_row = math.ceil((context + SLACK) / BLOCK_SIZE)
        reqs = []
        for i in range(batch):
            toks = rng.integers(1, V, context + 1).astype(np.int32)
            req.all_token_ids[i, :] = 0
            req.all_token_ids[i, : context + 1] = toks
            req.prompt_len[i] = context
            req.prefill_len[i] = context
            req.total_len[i] = context + 1
            req.num_computed_tokens[i] = context
            req.last_sampled_tokens[i] = toks[context]
            req.num_accepted_tokens[i] = 1
            req.temperature[i] = 0.0
            req.top_p[i] = 1.0
            req.top_k[i] = 0
            ids = 1 + i * per_row + np.arange(per_row, dtype=np.int32)
            tabs[0][i, :] = 0
            tabs[0][i, :per_row] = ids
            nblk[0, i] = per_row
            q = Request(f"r{i}", [int(t) for t in toks[:context]], 10_000)
            q.row, q.num_computed, q.prefill_len = i, context, context
            q.output = [int(toks[context])]
            q.blocks = [list(map(int, ids))]
            q.state_slots = [1 + i] if self.model.uses_state else []
            reqs.append(q)
        tables = tables.replace(tables=tuple(tabs), num_blocks=nblk)
        self._put_rows(req, tables, rank)
        bucket = self.runner.buckets.choose(batch, batch, decode_only=True)
        plan = StepPlan(step=0, bucket=bucket, scheduled=[ScheduledRequest(q, 1, []) for q in reqs], added=[],
                        cleared_rows=[], block_writes=[], blocks_to_zero=[], slots_to_zero=[], freed_blocks=[],
                        freed_slots=[])
        return plan

    def fabricate_prefill(self, n: int):
        """A plan installing one request of ``n`` prompt tokens into row 0 and prefilling all of it
        (block table written, blocks and slot zeroed: a new request's first step). Idempotent."""
        np = self.np
        from kvjax.host.scheduler import Request, ScheduledRequest, StepPlan

        rng = np.random.default_rng(n)
        toks = [int(t) for t in rng.integers(1, self.model.vocab_size, n)]
        nb = math.ceil(n / BLOCK_SIZE)
        ids = list(range(1, nb + 1))
        q = Request("p0", toks, 1)
        q.row, q.num_computed, q.prefill_len = 0, 0, n
        q.blocks = [ids]
        q.state_slots = [1] if self.model.uses_state else []
        bucket = self.runner.buckets.choose(n, 1)
        return StepPlan(step=0, bucket=bucket, scheduled=[ScheduledRequest(q, n, [])], added=[(0, toks, n)],
                        cleared_rows=[], block_writes=[(0, [ids], True)], blocks_to_zero=ids,
                        slots_to_zero=list(q.state_slots), freed_blocks=[], freed_slots=[])

    # -- timing
    def time_plan(self, plan, *, groups: int = 3, per_group: int = 8, profile: bool = False) -> dict:
        """The step's timings: ``device_us`` is the steady-state step, the slope of the wall time
        of ``3 * per_group`` against ``per_group`` calls launched back to back from an idle device
        (median over ``groups``). Each run starts with a launch on an idle GPU and ends with a
        wait: that fixed cost (the first call's whole graph launch, ~2.5 ms for a 600-kernel step)
        cancels in the slope, where a run's mean per call (``device_us_cold``, the figure this
        benchmark reported before) spreads it over ``per_group`` steps."""
        jax, np = self.jax, self.np
        r = self.runner
        t0 = time.perf_counter()
        prepared = r.prepare(plan)
        prep_us = (time.perf_counter() - t0) * 1e6
        # warm-up through the Runner's own path (prepare / launch / fetch)
        r.launch(prepared).fetch()
        buf = r.put_inputs(prepared)

        def call():  # what Runner.launch enqueues (stage, step, fetch), the input already on the device
            return r._enqueue(prepared.bucket, buf)[0]

        steady = steady_step_us(call, groups=groups, per_group=per_group)
        slopes, dev = steady["slopes"], steady["cold_us"]
        device_us = statistics.median(slopes)
        sync, enq, fetch = [], [], []
        for _ in range(3):
            t0 = time.perf_counter()
            p = r.prepare(plan)
            t1 = time.perf_counter()
            pend = r.launch(p)
            t2 = time.perf_counter()
            pend.fetch()
            t3 = time.perf_counter()
            sync.append((t3 - t0) * 1e6)
            enq.append((t2 - t1) * 1e6)
            fetch.append((t1 - t0) * 1e6)
        sync_us = statistics.median(sync)
        out = {"device_us": device_us, "device_us_groups": slopes, "device_us_cold": statistics.median(dev),
               "device_us_cold_groups": dev, "sync_step_us": sync_us,
               "host_us": max(sync_us - device_us, 0.0), "prepare_us": statistics.median(fetch),
               "first_prepare_us": prep_us, "launch_enqueue_us": statistics.median(enq)}
        if profile:
            try:
                sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
                from _trace import trace_device

                tr = trace_device(call, 3)
                kern = tr.pop("_kernels", [])
                out["profile"] = {"kernels_per_step": tr.get("kernels_per_call"),
                                  "kernel_busy_us_per_step": tr.get("device_busy_us_per_call"),
                                  "top_kernels": tr.get("top_kernels", [])[:15]}
                del kern
            except Exception as e:  # noqa: BLE001
                out["profile_error"] = f"{type(e).__name__}: {e}"[:300]
        return out

    def memory_gb(self):
        try:
            st = self.jax.devices()[0].memory_stats() or {}
            return st.get("peak_bytes_in_use", 0) / 1e9
        except Exception:  # noqa: BLE001
            return None


def run_kvjax(preset: str, matrix: dict, emit, *, profile: bool) -> None:
    import jax
    import jax.numpy as jnp

    log(f"[kvjax] {preset}: building (devices {jax.devices()})")
    t0 = time.perf_counter()
    ceil = measure_ceilings(jax, jnp)
    log(f"  copy {ceil['copy_bw_Bps'] / 1e12:.2f} TB/s, matmul {ceil.get('matmul_tflops_measured', 0):.0f} TFLOP/s")
    bench = Bench(preset, matrix)
    log(f"  {bench.model.description}: {bench.params_info['total'] / 1e9:.2f} B params; "
        f"init {bench.param_init_s:.1f} s; max_model_len {bench.max_model_len}, "
        f"{bench.cfg.num_blocks} blocks; memory {bench.memory_gb():.1f} GB")
    bench.compile_all()
    log(f"  compiled {len(bench.compile_s)} buckets in {bench.compile_wall_s:.1f} s wall")
    tflops = NOMINAL_BF16_TFLOPS if jax.default_backend() == "gpu" else max(ceil.get("matmul_tflops_measured", 0.1), 0.1)
    common = {"preset": preset, "impl": "kvjax", "max_model_len": bench.max_model_len,
              "params_b": bench.params_info["total"] / 1e9, "copy_bw_TBps": ceil["copy_bw_Bps"] / 1e12,
              "matmul_tflops_measured": ceil.get("matmul_tflops_measured"), "matmul_tflops_floor": tflops,
              "compile_wall_s": bench.compile_wall_s, "param_init_s": bench.param_init_s,
              "num_blocks": bench.cfg.num_blocks, "block_size": BLOCK_SIZE, "max_num_seqs": bench.cfg.max_num_seqs,
              "return_logits": getattr(bench.cfg, "return_logits", True)}

    def finish(row, t, phase, batch, context, tokens, bucket):
        fl = floors(bench.params_info, bench.model, phase=phase, batch=batch, context=context, tokens=tokens,
                    bw=ceil["copy_bw_Bps"], tflops=tflops)
        row.update(common)
        row.update({"phase": phase, "batch": batch, "context": context, "device_us": t["device_us"],
                    "host_us": t["host_us"], **fl, **floor_ratios(t["device_us"], fl),
                    "tokens_per_s": tokens / t["device_us"] * 1e6, "memory_gb": bench.memory_gb(),
                    "compile_s": bench.compile_s.get(bucket), "bucket_tokens": bucket.num_tokens,
                    "bucket_decode_only": bucket.decode_only,
                    "bucket_rows": bucket.num_reqs,
                    **{k: v for k, v in t.items() if k not in ("device_us", "host_us")}})
        emit(row)
        log(f"  {phase:7s} b={batch:4d} ctx={context:5d}: device {t['device_us']:9.1f} us (cold "
            f"{t['device_us_cold']:9.1f}), host "
            f"{t['host_us']:8.1f} us, byte floor {fl['byte_floor_us']:8.1f}, matmul floor "
            f"{fl['matmul_floor_us']:8.1f} -> {row['floor_ratio']:.2f}x; {row['tokens_per_s']:.0f} tok/s")

    for context, batches in matrix["decode"]:
        for b in batches:
            try:
                plan = bench.fabricate_decode(b, context)
                traced = matrix.get("profile_batches", [PROFILE_BATCH])
                t = bench.time_plan(plan, profile=profile and b in traced and context == matrix["decode"][0][0])
                finish({}, t, "decode", b, context, b, plan.bucket)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                emit({**common, "phase": "decode", "batch": b, "context": context, "device_us": None,
                      "host_us": None, "byte_floor_us": None, "matmul_floor_us": None, "tokens_per_s": None,
                      "memory_gb": bench.memory_gb(), "note": f"failed: {type(e).__name__}: {e}"[:400]})
    for n in matrix["prefill"]:
        try:
            plan = bench.fabricate_prefill(n)
            t = bench.time_plan(plan, groups=3, per_group=3, profile=profile and matrix.get("profile_prefill", False))
            finish({}, t, "prefill", 1, n, n, plan.bucket)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            emit({**common, "phase": "prefill", "batch": 1, "context": n, "device_us": None, "host_us": None,
                  "byte_floor_us": None, "matmul_floor_us": None, "tokens_per_s": None,
                  "memory_gb": bench.memory_gb(), "note": f"failed: {type(e).__name__}: {e}"[:400]})
    log(f"[kvjax] {preset} done in {time.perf_counter() - t0:.1f} s")


# ------------------------------------------------------------------------ transformers side


def _repeat_cache(obj, b, torch, depth=0):
    """Every tensor of a cache with a leading batch of 1, repeated to ``b`` rows (in place)."""
    if depth > 4:
        return obj
    if isinstance(obj, torch.Tensor):
        return obj.repeat_interleave(b, dim=0).contiguous() if obj.dim() >= 1 and obj.shape[0] == 1 else obj
    if isinstance(obj, list):
        return [_repeat_cache(x, b, torch, depth + 1) for x in obj]
    if isinstance(obj, tuple):
        return tuple(_repeat_cache(x, b, torch, depth + 1) for x in obj)
    if isinstance(obj, dict):
        return {k: _repeat_cache(v, b, torch, depth + 1) for k, v in obj.items()}
    if hasattr(obj, "__dict__") and "transformers" in type(obj).__module__ and "cache" in type(obj).__module__.lower():
        for k, v in list(vars(obj).items()):
            if k in ("config",):
                continue
            nv = _repeat_cache(v, b, torch, depth + 1)
            if nv is not v:
                try:
                    setattr(obj, k, nv)
                except Exception:  # noqa: BLE001
                    pass
        return obj
    return obj


def run_transformers(preset: str, matrix: dict, emit) -> None:
    import torch
    import transformers

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = hf_config(preset)
    log(f"[transformers {transformers.__version__}] {preset} on {dev}")
    base = {"preset": preset, "impl": "transformers", "max_model_len": None, "host_us": None,
            "byte_floor_us": None, "matmul_floor_us": None}
    t0 = time.perf_counter()
    try:
        conf = transformers.AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items()
                                                                      if k not in ("model_type",)})
        with torch.device(dev):
            model = transformers.AutoModelForCausalLM.from_config(conf, dtype=torch.bfloat16)
        model.eval()
        build_s = time.perf_counter() - t0
        log(f"  built {type(model).__name__} in {build_s:.1f} s, "
            f"{sum(p.numel() for p in model.parameters()) / 1e9:.2f} B params")
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        for ctx, bs in matrix["decode"]:
            for b in bs:
                emit({**base, "phase": "decode", "batch": b, "context": ctx, "device_us": None, "tokens_per_s": None,
                      "memory_gb": None, "note": f"transformers model not built: {type(e).__name__}: {e}"[:400]})
        return
    V = cfg["vocab_size"]
    g = torch.Generator(device="cpu").manual_seed(0)

    def sync():
        if dev == "cuda":
            torch.cuda.synchronize()

    def timed(fn, reps):
        fn()
        sync()
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            sync()
            ts.append((time.perf_counter() - t) * 1e6)
        return statistics.median(ts)

    def mem():
        return torch.cuda.max_memory_allocated() / 1e9 if dev == "cuda" else None

    kv_per_token_bytes = None
    if cfg["model_type"] == "deepseek_v3":  # transformers caches the up-projected K and V per head
        kv_per_token_bytes = cfg["num_hidden_layers"] * cfg["num_attention_heads"] * (
            cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"] + cfg["v_head_dim"]) * 2
    budget = (torch.cuda.get_device_properties(0).total_memory if dev == "cuda" else 8e9) * 0.85
    with torch.inference_mode():
        for ctx, bs in matrix["decode"]:
            try:
                ids = torch.randint(1, V, (1, ctx), generator=g).to(dev)
                out = model(input_ids=ids, use_cache=True)
                past1 = out.past_key_values
                if past1 is None:
                    raise RuntimeError("the model returned no cache with use_cache=True")
                del out
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                for b in bs:
                    emit({**base, "phase": "decode", "batch": b, "context": ctx, "device_us": None,
                          "tokens_per_s": None, "memory_gb": mem(),
                          "note": f"past not built: {type(e).__name__}: {e}"[:400]})
                continue
            for b in bs:
                row = {**base, "phase": "decode", "batch": b, "context": ctx, "max_model_len": ctx + 1}
                if kv_per_token_bytes is not None and dev == "cuda":
                    need = kv_per_token_bytes * b * ctx + torch.cuda.memory_allocated()
                    if need > budget:
                        emit({**row, "device_us": None, "tokens_per_s": None, "memory_gb": mem(),
                              "note": f"not run: transformers' DeepseekV3 cache holds up-projected K/V per head "
                                      f"({kv_per_token_bytes / 1e3:.0f} KB/token), {need / 1e9:.0f} GB with the "
                                      f"weights > {budget / 1e9:.0f} GB"})
                        continue
                try:
                    import copy

                    past = copy.deepcopy(past1) if b == 1 else _repeat_cache(copy.deepcopy(past1), b, torch)
                    tok = torch.randint(1, V, (b, 1), generator=g).to(dev)

                    def step():
                        model(input_ids=tok, past_key_values=past, use_cache=True)

                    us = timed(step, 5)
                    emit({**row, "device_us": us, "tokens_per_s": b / us * 1e6, "memory_gb": mem(),
                          "note": "eager torch step timed by the host clock after synchronize (device + launch)"})
                    log(f"  decode b={b:4d} ctx={ctx}: {us:9.1f} us")
                    del past
                except Exception as e:  # noqa: BLE001
                    traceback.print_exc()
                    emit({**row, "device_us": None, "tokens_per_s": None, "memory_gb": mem(),
                          "note": f"failed: {type(e).__name__}: {e}"[:400]})
                if dev == "cuda":
                    torch.cuda.empty_cache()
            del past1
        for n in matrix["prefill"]:
            row = {**base, "phase": "prefill", "batch": 1, "context": n, "max_model_len": n}
            try:
                ids = torch.randint(1, V, (1, n), generator=g).to(dev)

                def fwd():
                    try:
                        model(input_ids=ids, use_cache=False, logits_to_keep=1)
                    except TypeError:
                        model(input_ids=ids, use_cache=False)

                us = timed(fwd, 3)
                emit({**row, "device_us": us, "tokens_per_s": n / us * 1e6, "memory_gb": mem(),
                      "note": "whole sequence, use_cache=False, logits of the last token"})
                log(f"  prefill n={n}: {us:9.1f} us")
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                emit({**row, "device_us": None, "tokens_per_s": None, "memory_gb": mem(),
                      "note": f"failed: {type(e).__name__}: {e}"[:400]})
            if dev == "cuda":
                torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------- driver


METHOD = __doc__[__doc__.index("Every measurement goes"):].strip()
METHOD_SHORT = (
    "Each kvjax row is the Runner's own compiled step of its bucket (`Runner.jitted_step`, compiled as "
    "`precompile` does, the Runner's default GPU compiler options), on a state fabricated directly: "
    "request rows whose `num_computed` is the context, block tables filled (block 16), pools and weights "
    "random (seeded, bf16; SSM states float32 as the configs ask), `return_logits=False` (only token ids come "
    "back, sampling on the device). Decode: one token for each of `batch` "
    "requests, a real `StepPlan` packed by `Runner.prepare`; prefill: one new request's first step (installed, "
    "block table written, blocks and slot zeroed, the whole prompt). *device us*: the executable called back "
    "to back, the steady-state step: the slope of the wall time of 24 against 8 calls, each run from an idle "
    "device to its last call's end (median of 3; prefill 9 against 3), so that the first call's launch on an "
    "idle GPU (~2.5 ms of host time for a 600-kernel graph) is not spread over the step (the mean per call of "
    "the 8-call runs is kept as `device_us_cold`). *host us*: one synchronous prepare + launch + fetch "
    "minus the device time. *byte floor*: weights read once (MoE: the experts a uniform router touches at "
    "that many tokens) + live KV read (and the new token's written) + recurrent states read and written, over "
    "the copy bandwidth measured in the same process. *matmul floor*: 2 x active params x tokens (+ the head "
    "for the logits rows) + attention's products (2 x heads x (key + value width) for each query's visible "
    "key: a fresh prefill's T (T + 1) / 2 causal pairs; MLA in its naive form; Mamba's scan not counted) "
    "over 989 TFLOP/s (the weights' products alone: `matmul_floor_params_us`). *floor ratio*: device / max(floors). *memory*: the process's "
    "peak device memory so far (`memory_stats`). *transformers*: its own forward (torch eager, CUDA, bf16, "
    "reference PyTorch Mamba kernels since `mamba_ssm` / `causal_conv1d` are not installed), host clock "
    "after `synchronize`, median of 5 (prefill 3); decode is one token over a past of `context` tokens "
    "(made by one batch-1 prefill, repeated over the batch).")


def _git_head() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or None
    except Exception:  # noqa: BLE001
        return None


def _source_sha() -> str:
    """sha256 (first 12 hex digits) of the library's source as it runs here (every ``.py`` under
    ``kvjax/`` and ``pallas_kernels/``, paths and bytes): names the code measured even where the
    working tree was copied to a machine whose git HEAD is stale (``commit`` then misleads)."""
    import hashlib

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    h = hashlib.sha256()
    for pkg in ("kvjax", "pallas_kernels"):
        for dirpath, dirnames, files in sorted(os.walk(os.path.join(root, pkg))):
            dirnames.sort()
            for f in sorted(files):
                if f.endswith(".py"):
                    path = os.path.join(dirpath, f)
                    h.update(os.path.relpath(path, root).encode() + b"\0")
                    with open(path, "rb") as fh:
                        h.update(fh.read() + b"\0")
    return h.hexdigest()[:12]


def _versions() -> dict:
    out = {"python": sys.version.split()[0]}
    for name in ("jax", "jaxlib", "torch", "transformers", "triton"):
        try:
            mod = __import__(name)
            out[name] = getattr(mod, "__version__", None)
        except Exception:  # noqa: BLE001
            out[name] = None
    return out


def _device_meta() -> dict:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception:  # noqa: BLE001
        out = ""
    return {"nvidia_smi": out}


def child(args) -> int:
    matrix = json.loads(args.matrix_json)
    rows_path = args.rows

    def emit(row):
        row = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        with open(rows_path, "a") as fh:
            fh.write(json.dumps(row, default=str) + "\n")

    if args.impl == "kvjax":
        run_kvjax(args.preset, matrix, emit, profile=args.profile)
    else:
        run_transformers(args.preset, matrix, emit)
    return 0


def assemble(rows_path: str, out_json: str, meta: dict) -> dict:
    rows = []
    if os.path.exists(rows_path):
        with open(rows_path) as fh:
            rows = [json.loads(line) for line in fh if line.strip()]
    doc = {"meta": meta, "rows": rows}
    with open(out_json, "w") as fh:
        json.dump(doc, fh, indent=1)
    return doc


def driver(presets, matrices, outdir, *, peers: bool, profile: bool, budget_s: float, cpu: bool,
           ours: bool = True) -> int:
    os.makedirs(outdir, exist_ok=True)
    rows_path = os.path.join(outdir, "rows.jsonl")
    t_start = time.perf_counter()
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.93")
    if cpu:
        env["JAX_PLATFORMS"] = "cpu"
    # every preset's kvjax rows first (the deliverable), then the transformers peers
    procs = ([(p, "kvjax") for p in presets] if ours else []) + ([(p, "transformers") for p in presets] if peers else [])
    meta = {"date": date, "script": "benchmarks/bench_model.py", "presets": presets,
            "matrix": {p: matrices[p] for p in presets}, "versions": _versions(), **_device_meta(),
            "block_size": BLOCK_SIZE, "nominal_bf16_tflops": NOMINAL_BF16_TFLOPS,
            "method": METHOD, "method_short": METHOD_SHORT,
            "commit": os.environ.get("KVJAX_COMMIT") or _git_head(), "source_sha": _source_sha()}
    status = {}
    for preset, impl in procs:
        left = budget_s - (time.perf_counter() - t_start)
        if left < 20:
            status[f"{preset}/{impl}"] = "skipped: run budget spent"
            log(f"skip {preset}/{impl}: budget spent")
            continue
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--impl", impl, "--preset", preset,
               "--rows", rows_path, "--matrix-json", json.dumps(matrices[preset])]
        if profile:
            cmd.append("--profile")
        t0 = time.perf_counter()
        try:
            cap = CHILD_CAP_S.get(impl, left) if not cpu else left
            rc = subprocess.run(cmd, env=env, timeout=min(left, cap)).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        status[f"{preset}/{impl}"] = {"rc": rc, "wall_s": time.perf_counter() - t0}
        log(f"== {preset}/{impl}: rc {rc} in {time.perf_counter() - t0:.1f} s")
        meta["children"] = status
        assemble(rows_path, os.path.join(outdir, "model.json"), meta)
    meta["children"] = status
    meta["total_wall_s"] = time.perf_counter() - t_start
    doc = assemble(rows_path, os.path.join(outdir, "model.json"), meta)
    print_table(doc["rows"])
    return 0


def print_table(rows):
    log(f"{'preset':20s} {'impl':12s} {'phase':7s} {'b':>4s} {'ctx':>5s} {'device_us':>10s} {'host_us':>9s} "
        f"{'bytefl':>9s} {'mmfl':>9s} {'ratio':>6s} {'tok/s':>9s} {'GB':>5s}")
    for r in rows:
        def f(k, fmt="{:.1f}"):
            v = r.get(k)
            return fmt.format(v) if isinstance(v, (int, float)) else "-"
        log(f"{r['preset']:20s} {r['impl']:12s} {r['phase']:7s} {r['batch']:4d} {r['context']:5d} "
            f"{f('device_us'):>10s} {f('host_us'):>9s} {f('byte_floor_us'):>9s} {f('matmul_floor_us'):>9s} "
            f"{f('floor_ratio', '{:.2f}'):>6s} {f('tokens_per_s', '{:.0f}'):>9s} {f('memory_gb'):>5s}"
            + (f"  [{r['note'][:60]}]" if r.get("note") and r.get("device_us") is None else ""))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", action="append", choices=sorted(PRESETS))
    ap.add_argument("--gpu-run", metavar="OUTDIR", help="the whole GPU matrix (every real preset, peers)")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny matrix on the CPU (seconds)")
    ap.add_argument("--smoke", action="store_true", help="tiny matrix on JAX's default backend")
    ap.add_argument("--out", default=None, help="output folder (default: a temporary one)")
    ap.add_argument("--no-peers", action="store_true", help="skip the transformers rows")
    ap.add_argument("--peers-only", action="store_true", help="only the transformers rows")
    ap.add_argument("--profile", action="store_true", help=f"trace the decode batch-{PROFILE_BATCH} step's kernels")
    ap.add_argument("--budget-s", type=float, default=520.0, help="stop starting new parts after this (s)")
    ap.add_argument("--decode", action="append", metavar="CTX:B1,B2,...",
                    help="--gpu-run: replace each preset's decode rows (repeatable), e.g. 1024:1,16,64")
    ap.add_argument("--prefill", metavar="N1,N2,...", help="--gpu-run: replace the prefill sizes ('' for none)")
    ap.add_argument("--profile-batch", type=int, action="append",
                    help=f"--gpu-run: decode batches traced (default {PROFILE_BATCH}; repeatable)")
    ap.add_argument("--profile-prefill", action="store_true", help="--gpu-run: trace the prefill rows too")
    ap.add_argument("--max-model-len", type=int, help="--gpu-run: at least this max_model_len (block-table width)")
    # internal: one preset and impl in a child process
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--impl", choices=("kvjax", "transformers"), help=argparse.SUPPRESS)
    ap.add_argument("--rows", help=argparse.SUPPRESS)
    ap.add_argument("--matrix-json", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        a.preset = a.preset[0]
        return child(a)
    if a.gpu_run:
        presets = a.preset or list(GPU_MATRIX)
        matrices = {p: dict(GPU_MATRIX[p]) for p in presets}
        for m in matrices.values():
            if a.decode:
                m["decode"] = [(int(c), tuple(int(b) for b in bs.split(",")))
                               for c, bs in (d.split(":") for d in a.decode if d)]  # --decode '': none
            if a.prefill is not None:
                m["prefill"] = tuple(int(n) for n in a.prefill.split(",") if n)
            if a.profile_batch:
                m["profile_batches"] = a.profile_batch
            m["profile_prefill"] = a.profile_prefill
            if a.max_model_len:
                m["max_model_len"] = a.max_model_len
        return driver(presets, matrices, a.gpu_run, peers=not a.no_peers, ours=not a.peers_only,
                      profile=True, budget_s=a.budget_s, cpu=False)
    if a.cpu_smoke or a.smoke:
        import tempfile

        presets = a.preset or ["tiny"]
        out = a.out or tempfile.mkdtemp(prefix="kvjax-bench-model-")
        rc = driver(presets, {p: SMOKE_MATRIX for p in presets}, out, peers=not a.no_peers, profile=False,
                    budget_s=a.budget_s, cpu=a.cpu_smoke)
        doc = json.load(open(os.path.join(out, "model.json")))
        bad = [r for r in doc["rows"] if r["impl"] == "kvjax" and r.get("device_us") is None]
        log(f"smoke: {len(doc['rows'])} rows in {out}/model.json; {len(bad)} kvjax rows failed")
        return 1 if bad or not doc["rows"] else rc
    ap.error("give --gpu-run OUTDIR or --cpu-smoke")
    return 2


if __name__ == "__main__":
    sys.exit(main())
