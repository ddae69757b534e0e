"""DeepSeek-V3 (MLA + group-routed MoE) against transformers, and its paged step against its dense oracle.

Checkpoints are made here, at test time, by transformers (``from_config`` with a fixed torch
seed, weights rescaled so that logits are far from uniform, ``save_pretrained``); nothing is
downloaded. Two variants: ``lora`` (q_lora_rank set, interleaved RoPE, default frequencies,
normalised top-k) and ``plain`` (no q LoRA, rotate-half RoPE with YaRN and mscale, top-k
not normalised, attention biases, tied embeddings, two shared experts). Both have 3 layers
with ``first_k_dense_replace=1``, 8 routed experts in 2 groups, ``topk_group=1``, 2 experts
per token.

The paged steps run through the real state code (``RequestState``, ``BlockTables``,
``build_step_batch``, ``make_step_context``): chunked prefill of two requests next to
a padded row and a padded token tail, then greedy decode. Every logits row is checked
against ``dense_logits`` of the tokens it saw, and the generated tokens against
transformers' greedy ``generate``.

DeepSeek-V3 through the Runner on one device is test_feature_matrix.py's (a q-LoRA checkpoint,
chunked prefill, NaN-poisoned pools and the sanitizer, preemption; its greedy tokens against
transformers' ``generate`` token for token; speculative decoding with drafts accepted in full, in
part and not at all, fp8 latent cache; bf16; overlapped); over a mesh, here.
"""

from __future__ import annotations

import contextlib
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

from kvjax import BlockTables, KVGroupSpec, RequestState, ScheduledBatch, build_step_batch, cdiv  # noqa: E402
from kvjax.models import load_pretrained  # noqa: E402
from kvjax.models.hf import deepseek_v3 as ds  # noqa: E402
from kvjax.models.hf.mla import latent_attention  # noqa: E402
from kvjax.models.interface import CacheSizes, Model  # noqa: E402
from kvjax.models.step_context import make_step_context  # noqa: E402

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
    n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=32,
    qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, n_group=2, topk_group=1,
    num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=256,
)
VARIANTS = {
    "lora": {},
    "plain": dict(
        q_lora_rank=None, rope_interleave=False, norm_topk_prob=False, attention_bias=True,
        tie_word_embeddings=True, n_shared_experts=2,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                             original_max_position_embeddings=64, mscale=0.707, mscale_all_dim=1.0,
                             beta_fast=32, beta_slow=1),
    ),
}

BLOCK_SIZE = 4
NUM_BLOCKS = 16
MAX_NUM_REQS = 4
MAX_MODEL_LEN = 32
T, R = 8, 3  # the one bucket of every paged step here
DENSE_LEN = 24  # the oracle runs on one padded length (causal: the zero tail changes no earlier row)
PROMPTS = {"a": [17, 200, 3, 99, 45, 250, 8, 61, 130, 77, 5], "b": [42, 7, 190, 33, 128, 64]}
# per step, per batch row: (request, tokens) or None (a padded row); a samples from step 3, b from 2
SCHEDULE = [
    [("a", 5), None, ("b", 3)],
    [("b", 3), ("a", 4)],
    [("a", 2), None, ("b", 1)],
    [("b", 1), ("a", 1)],
    [None, ("a", 1), ("b", 1)],
    [("a", 1), ("b", 1)],
    [None, None, ("b", 1)],
]
FAST = {"xla_backend_optimization_level": 0}
SPEC = KVGroupSpec.for_model_len(BLOCK_SIZE, MAX_MODEL_LEN)
BUILD = jax.jit(build_step_batch, static_argnames=("num_tokens_padded", "num_logits_padded", "backend"),
                compiler_options=FAST)


def _apply(model, params, batch, pools, sizes, backend="reference"):
    ctx = make_step_context(batch, jnp.zeros((R,), jnp.int32), None, kv_group=0)
    return model.apply(params, ctx, pools, backend=backend, sizes=sizes)


STEP = jax.jit(_apply, static_argnames=("model", "sizes", "backend"), donate_argnames=("pools",),
               compiler_options=FAST)


@contextlib.contextmanager
def _torch_one_thread():
    """torch's CPU ops on one thread: on a shared 2-core machine its worker threads spin-wait
    (a 3-layer forward of 10 tokens: ~2 s on 2 threads, ~10 ms on one). Restored after."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            yield
    finally:
        torch.set_num_threads(n)


def _randomise(m):
    """Weights with std 1/sqrt(fan_in) (embeddings 1, norms ~1, biases ~0.1): logits far from flat."""
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif "embed" in name:
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
        for name, b in m.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(0.1 * torch.randn_like(b))


class Checkpoint:
    """A saved checkpoint, loaded by ``kvjax.models.load_pretrained`` (float32)."""

    def __init__(self, path, torch_model):
        self.path, self.torch_model = path, torch_model
        self.hf_config = json.loads((path / "config.json").read_text())
        self.model, self.params = load_pretrained(path)
        self.config = self.model.config
        self.tensors = safetensors_numpy.load_file(str(path / "model.safetensors"))

    def torch_logits(self, tokens):
        with _torch_one_thread():
            return self.torch_model(torch.tensor([list(tokens)])).logits[0].numpy()


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    out = {}
    with _torch_one_thread():
        for i, (name, extra) in enumerate(VARIANTS.items()):
            out[name] = _build(tmp_path_factory, i, name, extra)
    return out


def _build(tmp_path_factory, i, name, extra):
    torch.manual_seed(i)
    cfg = transformers.DeepseekV3Config(**{**TINY, **extra})
    m = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    _randomise(m)
    path = tmp_path_factory.mktemp(f"dsv3_{name}")
    m.save_pretrained(path)
    return Checkpoint(path, m)


def dense(model, params, tokens, kv_cache_dtype="auto"):
    padded = np.zeros(DENSE_LEN, np.int32)
    padded[: len(tokens)] = tokens
    return np.asarray(model.dense_logits(params, padded, kv_cache_dtype=kv_cache_dtype))[: len(tokens)]


# ------------------------------------------------------------------------------------- config


def test_config_fields_and_protocol(checkpoints):
    c = checkpoints["plain"].config
    assert c.q_lora_rank is None and c.rope_type == "yarn" and c.yarn_factor == 4.0
    assert not c.rope_interleave and not c.norm_topk_prob and c.attention_bias and c.tie_word_embeddings
    m = ds.DeepseekV3(c)
    assert isinstance(m, Model) and hash(m) == hash(ds.DeepseekV3(c)) and m.kv_groups == (0,)
    sizes = CacheSizes(num_kernel_blocks=NUM_BLOCKS, kernel_block_size=BLOCK_SIZE, num_state_slots=1,
                       kv_cache_dtype="fp8")
    specs = m.pool_specs(sizes)
    assert [s.name for s in specs] == ["layer_0.latent", "layer_1.latent", "layer_2.latent"]
    assert specs[0].shape == (NUM_BLOCKS, BLOCK_SIZE, 32 + 8) and specs[0].dtype == "float8_e4m3fn"
    with pytest.raises(ValueError, match="kv_layout"):
        m.pool_specs(CacheSizes(NUM_BLOCKS, BLOCK_SIZE, 1, kv_layout="rpa"))
    with pytest.raises(ValueError, match="num_attention_heads=4"):
        m.shard(3)
    assert m.shard(2).model_shards == 2


BAD_FIELDS = [
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}, "rope_type"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}, "rope_type"),
    ({"rope_parameters": None, "rope_scaling": {"type": "longrope"}}, "rope_type"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "factor"),
    ({"topk_method": "greedy"}, "topk_method"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ({"num_key_value_heads": 2}, "num_key_value_heads"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"moe_layer_freq": 2}, "moe_layer_freq"),
    ({"n_group": 3}, "n_group"),
    ({"n_group": None}, "n_group"),
    ({"topk_group": 3}, "topk_group"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"n_shared_experts": 0}, "n_shared_experts"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"model_type": "deepseek_v2"}, "model_type"),
]


@pytest.mark.parametrize("change,field", BAD_FIELDS, ids=[f for _, f in BAD_FIELDS])
def test_unsupported_fields_refused_by_name(checkpoints, change, field):
    """config_from_hf sees only config.json: the refusal comes before any weight is read."""
    with pytest.raises(ValueError, match=field):
        ds.config_from_hf({**checkpoints["lora"].hf_config, **change})


def test_legacy_rope_scaling_keys_read_as_rope_parameters(checkpoints):
    cfg = dict(checkpoints["plain"].hf_config)
    rp = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = rp.pop("rope_theta")
    rp["type"] = rp.pop("rope_type")
    cfg["rope_scaling"] = rp
    assert ds.config_from_hf(cfg) == checkpoints["plain"].config


def test_expected_tensors_are_the_checkpoints(checkpoints):
    for ck in checkpoints.values():
        want = ds.expected_tensors(ck.config)
        assert set(want) == set(ck.tensors)
        assert {k: tuple(v.shape) for k, v in ck.tensors.items()} == want


# ---------------------------------------------------------------------------- dense vs torch


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_dense_logits_match_transformers(checkpoints, variant):
    ck = checkpoints[variant]
    tokens = np.random.default_rng(3).integers(0, 256, DENSE_LEN)
    want = ck.torch_logits(tokens)
    got = np.asarray(ds.DeepseekV3(ck.config).dense_logits(ck.params, tokens))
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, atol=2e-6 * scale, rtol=0)


def test_absorbed_equals_naive_and_nan_never_reaches_visible_rows():
    rng = np.random.default_rng(0)
    Tq, S, H, r, pe, nope, v = 5, 12, 3, 16, 4, 8, 6
    q_nope = jnp.asarray(rng.standard_normal((Tq, H, nope)), jnp.float32)
    q_pe = jnp.asarray(rng.standard_normal((Tq, H, pe)), jnp.float32)
    lat = rng.standard_normal((Tq, S, r + pe)).astype(np.float32)
    vis = rng.random((Tq, S)) < 0.6
    vis[0] = False  # a token that sees nothing
    lat[~vis] = np.nan
    w_uk = jnp.asarray(rng.standard_normal((H, r, nope)), jnp.float32)
    w_uv = jnp.asarray(rng.standard_normal((H, v, r)), jnp.float32)
    kw = dict(softmax_scale=0.3)
    naive = np.asarray(latent_attention(q_nope, q_pe, jnp.asarray(lat), jnp.asarray(vis), w_uk, w_uv,
                                        form="naive", **kw))
    absorbed = np.asarray(latent_attention(q_nope, q_pe, jnp.asarray(lat), jnp.asarray(vis), w_uk, w_uv,
                                           form="absorbed", **kw))
    assert np.isfinite(naive).all() and np.isfinite(absorbed).all()
    assert (naive[0] == 0).all()
    np.testing.assert_allclose(absorbed, naive, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------- paged driver


class Driver:
    """Hand-driven rows and blocks for the requests of PROMPTS, one bucket (T, R)."""

    def __init__(self, model, params, kv_cache_dtype="auto", poisoned=False, backend="reference"):
        self.model, self.params, self.backend = model, params, backend
        self.sizes = CacheSizes(num_kernel_blocks=NUM_BLOCKS, kernel_block_size=BLOCK_SIZE,
                                num_state_slots=1, kv_cache_dtype=kv_cache_dtype)
        fill = np.nan if poisoned else 0.0
        self.pools = {s.name: jnp.full(s.shape, fill, s.dtype) for s in model.pool_specs(self.sizes)}
        self.requests = RequestState.create(MAX_NUM_REQS, MAX_MODEL_LEN)
        self.tables = BlockTables.create([SPEC], MAX_NUM_REQS, num_cache_blocks=NUM_BLOCKS)
        self.row = {"a": 2, "b": 0}
        self.free_blocks = [7, 3, 12, 9, 1, 14, 5, 10, 2, 13]  # never the null block 0
        self.used_blocks: set[int] = set()
        self.records = []  # (tokens seen, logits row)
        for req, row in self.row.items():
            self.requests = self.requests.add_request(row, PROMPTS[req])

    def tokens(self, req):
        row = self.row[req]
        return np.asarray(self.requests.all_token_ids[row, : int(self.requests.total_len[row])]).tolist()

    def step(self, schedule):
        known = {req: self.tokens(req) for req in self.row}
        schedule = list(schedule) + [None] * (R - len(schedule))
        idx = np.full((R,), -1, np.int32)
        nsched = np.zeros((R,), np.int32)
        for b, entry in enumerate(schedule):
            if entry is None:
                continue
            req, n = entry
            row = self.row[req]
            have = int(self.tables.num_blocks[0, row])
            need = cdiv(int(self.requests.num_computed_tokens[row]) + n, BLOCK_SIZE) - have
            if need > 0:
                new = [self.free_blocks.pop(0) for _ in range(need)]
                self.used_blocks.update(new)
                self.tables = self.tables.append_block_ids(row, [new])
            idx[b], nsched[b] = row, n
        sched = ScheduledBatch(idx_mapping=idx, num_scheduled_tokens=nsched,
                               num_draft_tokens=np.zeros((R,), np.int32))
        batch = BUILD(self.requests, self.tables, sched, num_tokens_padded=T, num_logits_padded=R)
        logits, self.pools = STEP(self.model, self.params, batch, self.pools, self.sizes, self.backend)
        logits = np.asarray(logits)
        cu, li = np.asarray(batch.cu_num_logits), np.asarray(batch.logits_indices)
        ids, qsl = np.asarray(batch.input_ids), np.asarray(batch.query_start_loc)
        nc = np.asarray(batch.num_computed_tokens)
        sampled = np.zeros((R, 1), np.int32)
        num_sampled = np.zeros((R,), np.int32)
        for b, entry in enumerate(schedule):
            if entry is None:
                continue
            for i in range(cu[b], cu[b + 1]):
                seen = known[entry[0]][: nc[b]] + ids[qsl[b]: li[i] + 1].tolist()
                assert np.isfinite(logits[i]).all()
                self.records.append((seen, logits[i]))
                sampled[b, 0], num_sampled[b] = int(np.argmax(logits[i])), 1
        self.requests = self.requests.post_update(idx, nsched, sampled, num_sampled)

    def run(self):
        for sched in SCHEDULE:
            self.step(sched)
        return self


def paged_run(ck, form="absorbed", kv_cache_dtype="auto", poisoned=False, fp8_scale=1.0,
              backend="reference"):
    model = ds.DeepseekV3(ck.config, attention_form=form, fp8_scale=fp8_scale)
    return model, Driver(model, ck.params, kv_cache_dtype, poisoned, backend).run()


def check_records(model, params, drv, atol, kv_cache_dtype="auto"):
    assert len(drv.records) == 2 + 5 + 6  # a, b mid-prefill rows + sampling rows
    worst = 0.0
    for seen, got in drv.records:
        want = dense(model, params, seen, kv_cache_dtype)[-1]
        worst = max(worst, float(np.abs(got - want).max()))
    assert worst <= atol, worst
    return worst


@pytest.fixture(scope="module")
def lora_poisoned(checkpoints):
    return paged_run(checkpoints["lora"], poisoned=True)


def test_paged_steps_match_dense_with_nan_poisoned_pools(checkpoints, lora_poisoned):
    """Every pool byte NaN at the start (null block 0, unused blocks, block tails): the paged
    logits equal the dense oracle, bitwise equal a run on zeroed pools, and never-used blocks
    stay NaN (a PAD slot writes nothing)."""
    ck = checkpoints["lora"]
    model, drv = lora_poisoned
    check_records(model, ck.params, drv, atol=2e-5)
    _, clean = paged_run(ck)
    assert [s for s, _ in clean.records] == [s for s, _ in drv.records]
    for (_, got), (_, want) in zip(drv.records, clean.records):
        np.testing.assert_array_equal(got, want)
    unused = sorted(set(range(NUM_BLOCKS)) - drv.used_blocks)
    assert 0 in unused
    for pool in drv.pools.values():
        assert np.isnan(np.asarray(pool)[unused]).all()


@pytest.fixture(scope="module")
def plain_naive(checkpoints):
    return paged_run(checkpoints["plain"], form="naive", poisoned=True)


def test_paged_plain_variant_naive_form_matches_dense(checkpoints, plain_naive):
    """The other variant (no q LoRA, YaRN, rotate-half, biases, tied) through the naive form."""
    model, drv = plain_naive
    check_records(model, checkpoints["plain"].params, drv, atol=2e-5 * 10)  # logits up to ~35 here


def test_fp8_latent_cache(checkpoints):
    """The fp8 paged step equals the fp8 dense oracle (which rounds the latent as the cache
    stores it) tightly, and the unquantised model within a stated tolerance. The scale (0.3,
    not a power of two) is applied on the write and on the read."""
    ck = checkpoints["lora"]
    model, drv = paged_run(ck, kv_cache_dtype="fp8", poisoned=True, fp8_scale=0.3)
    check_records(model, ck.params, drv, atol=2e-5, kv_cache_dtype="fp8")
    errs = []
    for seen, got in drv.records:
        want = dense(model, ck.params, seen)[-1]
        errs.append(float(np.abs(got - want).max() / np.abs(want).max()))
    # fp8 rounding is visible and, per row, typically a few % of the largest logit (e4m3: 3
    # mantissa bits). Not a max: a perturbed hidden state can flip a near-tied expert choice
    # (top-k is discontinuous), and such a row differs by O(1) from the unquantised model.
    assert 1e-4 < float(np.median(errs)) < 0.1, errs


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_absorbed_form_through_the_paged_attention_kernel(checkpoints, kv_cache_dtype):
    """The absorbed form on the GPU kernel's path (``pallas_kernels.paged_attention`` as MQA over
    the latent rows, live blocks only; Pallas' interpreter on the CPU), NaN-poisoned pools:
    every row within 2e-5 of the dense oracle, as the jnp form."""
    ck = checkpoints["lora"]
    model, drv = paged_run(ck, kv_cache_dtype=kv_cache_dtype, poisoned=True, fp8_scale=0.3,
                           backend="pallas_gpu")
    check_records(model, ck.params, drv, atol=2e-5, kv_cache_dtype=kv_cache_dtype)


@pytest.mark.parametrize("backend,kv_cache_dtype", [("reference", "auto"), ("reference", "fp8"),
                                                    ("pallas_gpu", "auto"), ("pallas_gpu", "fp8")])
def test_split_form_matches_dense_with_nan_poisoned_pools(checkpoints, lora_poisoned, backend,
                                                          kv_cache_dtype):
    """The split form (the step's own tokens naive, the cached context absorbed, merged by
    log-sum-exp): fresh prefills, chunks over a cached context, decode rows beside them, pad
    rows and pad tokens, NaN-poisoned pools: every row within 2e-5 of the dense oracle (fp8:
    the fp8 oracle, the new rows rounded as the cache stores them), through the jnp reference
    and the GPU kernel's path (Pallas' interpreter on the CPU). ``auto`` on the reference:
    within 2e-6 of the absorbed run's logits (the same cached values, another summation)."""
    ck = checkpoints["lora"]
    model, drv = paged_run(ck, form="split", kv_cache_dtype=kv_cache_dtype, poisoned=True,
                           fp8_scale=0.3, backend=backend)
    check_records(model, ck.params, drv, atol=2e-5, kv_cache_dtype=kv_cache_dtype)
    if backend == "reference" and kv_cache_dtype == "auto":
        absorbed = lora_poisoned[1]
        assert [s for s, _ in absorbed.records] == [s for s, _ in drv.records]
        for (_, got), (_, want) in zip(drv.records, absorbed.records):
            np.testing.assert_allclose(got, want, atol=2e-6 * np.abs(want).max(), rtol=0)


@pytest.mark.parametrize("rows", [1, 3])
def test_one_fresh_prefill_through_the_dense_self_attention(checkpoints, monkeypatch, rows):
    """The model hands the split form its self-attention choice: a prefill step of one request
    (in a one-row bucket, and alone in a three-row one) with the choice forced to ``"xla"``
    (``"cudnn"`` on a Hopper GPU) runs ``dense_causal_attention`` in every layer and gives the
    dense oracle's logits (within 2e-5), NaN-poisoned pool and all."""
    import kvjax.models.hf.mla as mla

    ck = checkpoints["lora"]
    model = ds.DeepseekV3(ck.config, attention_form="split")
    sizes = CacheSizes(num_kernel_blocks=NUM_BLOCKS, kernel_block_size=BLOCK_SIZE, num_state_slots=1,
                       kv_cache_dtype="auto")
    pools = {s.name: jnp.full(s.shape, np.nan, s.dtype) for s in model.pool_specs(sizes)}
    prompt = PROMPTS["a"][:7]
    requests = RequestState.create(MAX_NUM_REQS, MAX_MODEL_LEN).add_request(1, prompt)
    tables = BlockTables.create([SPEC], MAX_NUM_REQS, num_cache_blocks=NUM_BLOCKS)
    tables = tables.append_block_ids(1, [[5, 2]])
    idx = np.full((rows,), -1, np.int32)
    idx[rows // 2] = 1  # one scheduled row (the bucket's others empty)
    sched = ScheduledBatch(idx_mapping=idx, num_scheduled_tokens=np.where(idx >= 0, 7, 0).astype(np.int32),
                           num_draft_tokens=np.zeros((rows,), np.int32))
    batch = BUILD(requests, tables, sched, num_tokens_padded=T, num_logits_padded=rows)
    ctx = make_step_context(batch, jnp.zeros((rows,), jnp.int32), None, kv_group=0)
    calls = []
    real_dense = mla.dense_causal_attention
    monkeypatch.setattr(mla, "dense_causal_attention", lambda *a, **k: calls.append(k) or real_dense(*a, **k))
    monkeypatch.setattr(ds, "self_attention_impl", lambda backend, dtype: "xla")
    logits, _ = model.apply(ck.params, ctx, pools, backend="reference", sizes=sizes)
    assert calls == [{"implementation": "xla"}] * ck.config.num_hidden_layers
    want = dense(model, ck.params, prompt)[-1]
    at = int(np.asarray(batch.cu_num_logits)[rows // 2])
    np.testing.assert_allclose(np.asarray(logits)[at], want, atol=2e-5, rtol=0)


@pytest.mark.parametrize("form,backend,kv,want", [
    ("auto", "pallas_gpu", "auto", ("absorbed", "split", "split")),
    ("auto", "pallas_gpu", "fp8", ("absorbed", "split", "split")),
    ("auto", "reference", "auto", ("absorbed", "absorbed", "absorbed")),
    ("split", "reference", "auto", ("absorbed", "split", "split")),
    ("absorbed", "pallas_gpu", "auto", ("absorbed", "absorbed", "absorbed"))])
def test_each_step_runs_the_form_its_backend_and_bucket_call_for(checkpoints, monkeypatch, form, backend,
                                                                   kv, want):
    """``attention_form="auto"`` (the default) is the split form where the paged-attention
    kernel runs (the GPU flavour; interpreted here) and the absorbed form on the jnp reference
    (whose gather of every token's keys the split form's one-token blocks would make T x T);
    an fp8 cache alike;
    ``"split"`` runs absorbed in a decode-only step (``max_prefill_rows=0``), split otherwise
    (None: any number of prefill rows; 1), in every layer."""
    ck = checkpoints["lora"]
    assert ds.DeepseekV3(ck.config).attention_form == "auto"
    model = ds.DeepseekV3(ck.config, attention_form=form)
    drv = Driver(model, ck.params, kv_cache_dtype=kv)
    calls = []
    for name, tag in (("split_latent_attention", "split"), ("paged_latent_attention", None)):
        real = getattr(ds, name)
        monkeypatch.setattr(ds, name, lambda *a, _t=tag, _f=real, **k: calls.append(
            _t or k.get("form")) or _f(*a, **k))
    sched = ScheduledBatch(idx_mapping=np.array([2, 0, -1], np.int32),
                           num_scheduled_tokens=np.array([1, 1, 0], np.int32),
                           num_draft_tokens=np.zeros((R,), np.int32))
    batch = BUILD(drv.requests, drv.tables, sched, num_tokens_padded=T, num_logits_padded=R)
    layers = ck.config.num_hidden_layers
    for mpr, w in zip((0, None, 1), want):
        calls.clear()
        ctx = make_step_context(batch, jnp.zeros((R,), jnp.int32), None, kv_group=0, max_prefill_rows=mpr)
        jax.eval_shape(lambda p, pools, c=ctx: model.apply(p, c, pools, backend=backend, sizes=drv.sizes),
                       ck.params, drv.pools)
        assert calls == [w] * layers, (mpr, calls)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_tokens_match_transformers_generate(checkpoints, lora_poisoned, plain_naive, variant):
    ck = checkpoints[variant]
    drv = (lora_poisoned if variant == "lora" else plain_naive)[1]
    for req, prompt in PROMPTS.items():
        toks = drv.tokens(req)
        n_new = len(toks) - len(prompt)
        assert n_new >= 4
        assert prompt + _hf_greedy(ck, prompt, n_new) == toks, req


def _hf_greedy(ck, prompt, n):
    with _torch_one_thread():
        out = ck.torch_model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                                      do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_loader_places_params_and_ignores_mtp_layers(checkpoints, tmp_path):
    """load_pretrained through this module: a 1x1 mesh places each leaf with param_spec; an MTP
    layer's tensors (layer num_hidden_layers) are ignored as transformers ignores them; bf16
    keeps vectors float32."""
    from jax.sharding import NamedSharding  # noqa: PLC0415
    from safetensors.numpy import save_file  # noqa: PLC0415

    from kvjax.runner.mesh import make_mesh  # noqa: PLC0415

    ck = checkpoints["lora"]
    model, params = load_pretrained(ck.path, mesh=make_mesh(1, 1))
    assert params["layers"][1]["mlp"]["w_up"].sharding.spec[0] == "data"
    assert params["layers"][0]["attn"]["q_b"].sharding.spec == jax.sharding.PartitionSpec(None, "model", None)
    assert all(isinstance(a.sharding, NamedSharding) for a in jax.tree.leaves(params))
    tensors = dict(ck.tensors)
    tensors["model.layers.3.eh_proj.weight"] = np.zeros((64, 128), np.float32)  # an MTP layer
    (tmp_path / "config.json").write_text(json.dumps(ck.hf_config))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    m2, p2 = load_pretrained(tmp_path, dtype="bfloat16")
    assert m2.dtype == "bfloat16" and m2.config == ck.config
    assert p2["layers"][0]["attn"]["kv_a"].dtype == jnp.bfloat16
    assert p2["layers"][0]["input_norm"].dtype == jnp.float32
    specs = m2.pool_specs(CacheSizes(num_kernel_blocks=4, kernel_block_size=4, num_state_slots=1))
    assert {s.dtype for s in specs} == {"bfloat16"}
    toks = jnp.arange(12, dtype=jnp.int32)
    a32 = np.asarray(ck.model.dense_logits(ck.params, toks))
    a16 = np.asarray(m2.dense_logits(p2, toks))
    assert np.abs(a16 - a32).max() <= 0.05 * np.abs(a32).max()


_MESH_WORKER = r"""
import dataclasses, json, os, sys
from kvjax.testing.fast_compile import FAST_COMPILER_OPTIONS, with_fast_xla_flags
# the suite's fast XLA:CPU settings for every compile (the dense oracle's too)
os.environ["XLA_FLAGS"] = with_fast_xla_flags("--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax.numpy as jnp
from kvjax.cli.demo import serve
from kvjax.host.scheduler import Request
from kvjax.models import load_pretrained
from kvjax.runner.mesh import make_mesh
from kvjax.runner.runner import Runner, RunnerConfig
from kvjax.runner.sanitizer import SanitizerError
from kvjax.state.block_tables import BlockTables

path, prompts, n_new = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
model, params = load_pretrained(path)  # unsharded: the Runner places them, the oracle reads them
cfg = RunnerConfig(model=model, block_size=4, num_blocks=32, max_model_len=32, max_num_seqs=3,
                   max_num_batched_tokens=8, token_sizes=(8,), backend="reference", poison=True)


def run(D, M, form=None):
    mesh = make_mesh(D, M)
    c = cfg if form is None else dataclasses.replace(cfg, model=dataclasses.replace(model, attention_form=form))
    runner = Runner(c, mesh=mesh, params=params, compiler_options=FAST_COMPILER_OPTIONS)
    reqs = [Request(f"r{i}", p, n_new, arrival_step=3 * i) for i, p in enumerate(prompts)]
    try:
        report, _ = serve(c, reqs, runner=runner, compile_workers=1, progress_stream=None)
    except SanitizerError as e:
        return {"caught": {"invariant": e.invariant, "array": e.array, "rank": e.rank}}
    return {"nan": report.nan_count, "compiles": report.serving_compiles,
            "dummy_steps": sum(r["dummy_steps"] for r in report.ranks.values()),
            "match": {k: bool(r["matches_reference"]) for k, r in report.requests.items()},
            "out": {k: r["output"] for k, r in report.requests.items()}}


print(json.dumps(run(2, 2)), flush=True)
# the split form (the GPU's default; here on the reference backend) with its heads over model=2
print(json.dumps(run(1, 2, form="split")), flush=True)
# vLLM PR 39444: a step with no real row (an idle data rank's dummy step) maps its tokens to
# slot 0 instead of PAD, writing the null block of every latent pool.
original = BlockTables.slot_mappings
def planted(self, idx_mapping, query_start_loc, positions, num_tokens_padded):
    slots = original(self, idx_mapping, query_start_loc, positions, num_tokens_padded)
    return jnp.where(jnp.all(idx_mapping < 0), 0, slots)
BlockTables.slot_mappings = planted
print(json.dumps(run(2, 1)), flush=True)
"""


def test_mesh_data2_model2_serves_token_for_token(checkpoints):
    """PR 39444's setting: experts over data=2 (idle-rank dummy steps: arrivals staggered), heads
    and MLP widths over model=2, latent cache replicated per model rank; in a fresh process with
    4 host CPU devices. Every logits row matches the unsharded dense oracle and the tokens are
    transformers' greedy ones; the same for the split form (``attention_form="split"``, the GPU's
    "auto") over model=2. Then on data=2 with PR 39444's bug planted (a dummy step's slot
    mapping all 0): the sanitizer catches it."""
    import os  # noqa: PLC0415
    import pathlib  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    ck = checkpoints["lora"]
    prompts, n_new = [PROMPTS["a"], PROMPTS["b"], [9, 9, 250, 31]], 4
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    root = pathlib.Path(__file__).resolve().parents[3]
    proc = subprocess.run([sys.executable, "-c", _MESH_WORKER, str(ck.path), json.dumps(prompts), str(n_new)],
                          capture_output=True, text=True, env=env, cwd=root, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res, split, planted = map(json.loads, proc.stdout.strip().splitlines()[-3:])
    assert res["nan"] == 0 and res["compiles"] == 0 and res["dummy_steps"] > 0
    assert split["nan"] == 0 and split["compiles"] == 0
    for r in (res, split):
        assert all(r["match"].values()), r["match"]
        for i, p in enumerate(prompts):
            assert r["out"][f"r{i}"] == _hf_greedy(ck, p, n_new), i
    assert "caught" in planted, planted  # the sanitizer stops the run with the planted bug


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_router_reads_the_mlp_input_in_the_matrices_dtype(checkpoints, monkeypatch, dtype):
    """A MoE layer's router reads the block's input as its products do, rounded once to the
    matrices' dtype (transformers' router too widens a model-dtype input): a bf16 model's router
    gets the float32 norm output rounded to bf16, a float32 model's gets it as it is; the routed
    and shared experts read the same array."""
    c = checkpoints["lora"].config
    model = ds.DeepseekV3(c, dtype=dtype)
    params = model.init_params(0)
    i = c.first_k_dense_replace  # the first MoE layer
    h = jnp.asarray(np.random.default_rng(3).standard_normal((5, c.hidden_size)) * (1 + 2.0 ** -12),
                    jnp.float32)
    seen = []
    real = ds.moe_route
    monkeypatch.setattr(ds, "moe_route", lambda x, *a, **k: seen.append(x) or real(x, *a, **k))
    ds._mlp(params["layers"][i], c, i, h, None, None)
    want = h.astype(jnp.dtype(dtype))
    assert len(seen) == 1 and seen[0].dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(seen[0], np.float32), np.asarray(want, np.float32))
    if dtype == "bfloat16":  # the test can tell: h is not bf16-representable
        assert not np.array_equal(np.asarray(want, np.float32), np.asarray(h))
