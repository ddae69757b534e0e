"""Granite-4.0-H, Bamba and Nemotron-H checkpoints against transformers, and served by the Runner.

(a) ``dense_logits`` of the loaded model equals transformers' forward logits (float32, every
checkpoint of ``conftest.CHECKPOINTS``); (b) the Runner (``kvjax.runner``, the model through
:mod:`kvjax.models.interface`) serves requests with chunked prefill, NaN-poisoned pools and the
memory sanitizer, and every logits row it returns matches ``dense_logits`` of the tokens it saw;
(c) its greedy tokens are transformers' greedy ``generate``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from conftest import CHECKPOINTS, hf_greedy  # noqa: E402
from kvjax.cli.demo import serve  # noqa: E402
from kvjax.host.scheduler import Request  # noqa: E402
from kvjax.models import load_pretrained  # noqa: E402
from kvjax.models.interface import CacheSizes, Model  # noqa: E402
from kvjax.runner.runner import Runner, RunnerConfig  # noqa: E402
from kvjax.testing.fast_compile import FAST_COMPILER_OPTIONS  # noqa: E402

RTOL = 1e-4  # of the largest |logit|
BF16_ATOL = 0.05  # paged vs dense logits of a bf16 model (Nemotron-H's logits here are ~4 at most)
FAST = FAST_COMPILER_OPTIONS  # kvjax.testing.fast_compile (also in XLA_FLAGS, tests/conftest.py)


def hf_logits(hf, tokens) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor([list(tokens)]), use_cache=False).logits[0].float().numpy()


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_dense_logits_match_transformers(name, hf_checkpoint, hf_model):
    model, params = load_pretrained(hf_checkpoint(name))
    assert isinstance(model, Model)
    tokens = np.random.default_rng(0).integers(0, model.vocab_size, 21)
    ref = hf_logits(hf_model(name), tokens)
    got = np.asarray(model.dense_logits(params, jnp.asarray(tokens, jnp.int32)))
    err, scale = np.abs(got - ref).max(), np.abs(ref).max()
    assert scale > 1.0, "logits near zero would make the comparison meaningless"
    assert err <= RTOL * scale, f"{name}: max |kvjax - transformers| = {err} (largest logit {scale})"


PROMPTS = [
    [5, 9, 14, 77, 3, 5, 9, 14, 77, 3, 5],  # repeats: the n-gram drafter proposes drafts
    [100, 2, 61, 7, 33],
    [18, 18, 90, 41, 27, 64, 8, 18, 18],
]
# case -> (checkpoint, params dtype, Runner settings); one bucket of 8 tokens, so prompts are
# prefilled in chunks. Float32 cases are also compared with transformers' greedy generate.
# Bamba's float32 flash runner (no other setting) is test_feature_matrix.py's: its preempting
# workload is compared there with transformers' greedy generate (so is every architecture's).
SERVED = {
    # the RPA kernel scales by 1/sqrt(D): Granite's attention_multiplier is folded into q
    "granite_rope_moe": ("granite_rope_moe", "float32", dict(kv_layout="rpa")),
    "nemotron_h": ("nemotron_h", "float32", dict(num_speculative_tokens=2)),
    # bf16 params and KV pools (K/V stored in bf16; the dense oracle rounds them alike)
    "nemotron_h_bf16": ("nemotron_h", "bfloat16", dict()),
}


@pytest.mark.parametrize("case", sorted(SERVED))
def test_runner_serves_token_for_token_with_transformers(case, hf_checkpoint, hf_model):
    name, dtype, settings = SERVED[case]
    model, params = load_pretrained(hf_checkpoint(name), dtype=dtype)
    cfg = RunnerConfig(model=model, block_size=4, num_blocks=32, max_model_len=32, max_num_seqs=3,
                       max_num_batched_tokens=8, token_sizes=(8,), backend="reference", poison=True,
                       **settings)
    runner = Runner(cfg, params=params, compiler_options=FAST)
    n_new = 6
    reqs = [Request(f"r{i}", p, n_new, arrival_step=i) for i, p in enumerate(PROMPTS)]
    report, runner = serve(cfg, reqs, runner=runner, compile_workers=1, progress_stream=None)
    assert report.nan_count == 0 and report.serving_compiles == 0
    for rid, r in report.requests.items():  # every logits row vs dense_logits of what it saw
        if dtype == "float32":
            assert r["matches_reference"], (case, rid, r)
        else:  # bf16 activations into each matmul: a rounding flip moves a logit by ~2^-8 of it
            assert r["max_logit_error"] <= BF16_ATOL, (case, rid, r)
    if cfg.num_speculative_tokens:
        assert report.drafts_proposed > 0
    if dtype == "float32":
        hf = hf_model(name)
        for i, p in enumerate(PROMPTS):
            assert report.requests[f"r{i}"]["output"] == hf_greedy(hf, p, n_new, torch), (case, i)


def test_lone_fresh_prefills_through_the_dense_attention(hf_checkpoint, hf_model, monkeypatch):
    """Requests that arrive one at a time, each prompt one step's worth: each first step is a
    fresh prefill alone in its 3-row bucket, whose attention layers take
    ``dense_causal_attention`` (forced to ``"xla"`` here; cuDNN on a Hopper GPU). Served with
    NaN-poisoned pools, every logits row matches ``dense_logits`` and the greedy tokens are
    transformers'. Granite's checkpoint here has a Mamba layer after its attention layer, so
    every prefill token's attention reaches the logits. (Which branch runs, and that other
    steps stay paged bitwise: ``tests/models/test_fresh_prefill_attention.py``.)"""
    import kvjax.models.attention as attention

    traced = []
    real_fn = attention.dense_causal_attention
    monkeypatch.setattr(attention, "self_attention_impl", lambda backend, dtype: "xla")
    monkeypatch.setattr(attention, "dense_causal_attention",
                        lambda *a, **k: traced.append(k["implementation"]) or real_fn(*a, **k))
    model, params = load_pretrained(hf_checkpoint("granite_rope_moe"))
    cfg = RunnerConfig(model=model, block_size=4, num_blocks=32, max_model_len=32, max_num_seqs=3,
                       max_num_batched_tokens=8, token_sizes=(8,), backend="reference", poison=True)
    runner = Runner(cfg, params=params, compiler_options=FAST)
    prompts, n_new = [PROMPTS[1], PROMPTS[2][:8], [7, 3]], 3
    reqs = [Request(f"r{i}", p, n_new, arrival_step=6 * i) for i, p in enumerate(prompts)]
    report, runner = serve(cfg, reqs, runner=runner, compile_workers=1, progress_stream=None)
    assert traced and set(traced) == {"xla"}
    assert report.nan_count == 0 and report.serving_compiles == 0
    hf = hf_model("granite_rope_moe")
    for i, p in enumerate(prompts):
        r = report.requests[f"r{i}"]
        assert r["matches_reference"], (i, r)
        assert r["output"] == hf_greedy(hf, p, n_new, torch), i


def test_bfloat16_params_and_dense_logits(hf_checkpoint):
    path = hf_checkpoint("granite_rope_moe")
    m32, p32 = load_pretrained(path)
    m16, p16 = load_pretrained(path, dtype="bfloat16")
    assert m16.config.dtype == "bfloat16"
    for (path_, a), b in zip(jax.tree_util.tree_flatten_with_path(p16)[0], jax.tree.leaves(p32)):
        want = np.float32 if a.ndim <= 1 else ml_dtypes.bfloat16
        assert a.dtype == want, path_
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b).astype(want))
    specs = m16.pool_specs(CacheSizes(num_kernel_blocks=4, kernel_block_size=4, num_state_slots=3))
    assert {s.dtype for s in specs if s.kind == "kv"} == {"bfloat16"}
    toks = jnp.arange(12, dtype=jnp.int32)
    a32 = np.asarray(m32.dense_logits(p32, toks))
    a16 = np.asarray(m16.dense_logits(p16, toks))
    assert np.abs(a16 - a32).max() <= 0.05 * np.abs(a32).max()


def test_sharded_checkpoint_loads_the_same_params(hf_checkpoint, hf_model, tmp_path):
    hf_model("nemotron_h").save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    _, whole = load_pretrained(hf_checkpoint("nemotron_h"))
    _, sharded = load_pretrained(tmp_path)
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(sharded), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_mesh_placement_and_interface(hf_checkpoint):
    from jax.sharding import NamedSharding, PartitionSpec

    from kvjax.runner.mesh import make_mesh

    mesh = make_mesh(1, 1)
    model, params = load_pretrained(hf_checkpoint("granite_rope_moe"), mesh=mesh)
    specs = model.param_partitioning(params)
    for a, s in zip(jax.tree.leaves(params), jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))):
        assert isinstance(a.sharding, NamedSharding) and a.sharding.spec == s
    # the experts are split over "data", the attention heads over "model"
    moe = next(i for i, b in enumerate(model.config.blocks) if b.kind == "moe")
    attn = next(i for i, b in enumerate(model.config.blocks) if b.kind == "attn")
    assert params["blocks"][moe]["w_up"].sharding.spec[0] == "data"
    assert params["blocks"][attn]["wq"].sharding.spec[1] == "model"
    # random params have the loaded params' tree and shapes; pools are named uniquely
    rnd = model.init_params(0)
    assert jax.tree.structure(rnd) == jax.tree.structure(params)
    assert all(a.shape == b.shape for a, b in zip(jax.tree.leaves(rnd), jax.tree.leaves(params)))
    sizes = CacheSizes(num_kernel_blocks=8, kernel_block_size=4, num_state_slots=3, num_spec_tokens=1)
    names = [s.name for s in model.pool_specs(sizes)]
    assert len(names) == len(set(names)) == 2 * 3  # 1 attention (k, v) + 2 Mamba (conv, ssm)
    assert model.kv_groups == (0,) and model.uses_state
    # tensor-parallel shards: heads split, groups kept whole per shard
    half = model.shard(2)
    assert half.config.attn.num_kv_heads == 1 and half.config.mamba.num_heads == 2
    assert half.config.mamba.n_groups == 1 and not half.config.mamba.norm_spans_shards
    with pytest.raises(ValueError, match="num_key_value_heads"):
        model.shard(4)


def test_served_over_a_mesh(hf_checkpoint):
    """Nemotron-H over data=2 x model=2 (experts over "data", 2 Mamba groups split over "model")
    with an fp8 KV cache; Granite NoPE over model=2 (one Mamba group: the gated norm's mean square
    summed over the axis, B and C in both shards). Fresh process: 4 fake CPU devices."""
    import json
    import os
    import subprocess
    import sys

    worker = os.path.join(os.path.dirname(__file__), "hf_mesh_worker.py")
    args = [hf_checkpoint("nemotron_h"), "2", "2", "fp8", hf_checkpoint("granite_nope_dense"), "1", "2", "auto"]
    out = subprocess.run([sys.executable, worker, *args], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stderr[-4000:]
    results = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(results) == 2
    for r in results:
        assert r["same_placement"], r["case"]
        assert r["ok"], (r["case"], r["requests"])
