"""Every serving feature with every Hugging Face architecture (issue 23, item 5).

The four architectures kvjax loads from a Hugging Face directory, each as a tiny random
checkpoint made by transformers at test time (Granite-4.0-H, Bamba and Nemotron-H from
``conftest.CHECKPOINTS``; a 2-layer DeepSeek-V3 here), served by :class:`~kvjax.runner.Runner`
through :func:`~kvjax.runner.serving.run_to_completion`. Every runner here poisons its pools
with NaN and runs the memory sanitizer (``poison=True``) and prefills in chunks (one bucket of 8
tokens, prompts of 9 and 10). Its 4 staggered requests need more KV blocks than it has, so
requests are preempted and resumed by recompute. The oracle is the model's ``dense_logits``
(float32, or rounding K/V / the MLA latent to fp8 or bf16 as the cache stores them): every
request's tokens are its argmax and every logits row is within the tolerance of the demo's
parity check (``kvjax.cli.demo.check_against_reference``; with an fp8 cache, of the oracle or
of one that rounds K/V near an fp8 boundary the other way).

* preemption, lockstep (every architecture), and the same run's greedy tokens are
  transformers' greedy ``generate`` token for token (every architecture; Bamba's float32 runner
  is only here, test_hybrid_hf.py serves the other hybrid cases against transformers);
* ``overlap=True``: bitwise the lockstep tokens and logits, and the dense oracle (every
  architecture; the same preemptions, so re-admissions happen with the loop overlapped);
* speculative decoding (2 drafts) with an fp8 KV cache, preempting too: drafts accepted in
  full, in part and not at all (Granite, Bamba, DeepSeek-V3; Nemotron-H's spec decoding is in
  test_hybrid_hf.py and its fp8 cache in its mesh case, through the same hybrid.py code as
  Granite's and Bamba's);
* bfloat16 params and KV cache, preempting, lockstep and overlapped (Granite, Bamba,
  DeepSeek-V3; Nemotron-H's in test_hybrid_hf.py): the bf16 oracle (logits within BF16_ATOL,
  tighter than the demo's), and float32's logits and greedy tokens up to near ties;
* ``kv_layout="rpa"`` (Nemotron-H: no RoPE, the default softmax scale; Granite's, RoPE and its
  attention multiplier folded into q, in test_hybrid_hf.py; the hybrids' attention is one
  ``attention_mixer`` whatever the architecture, RoPE applied before the KV write in either
  layout), lockstep and overlapped: the dense oracle, as the flash layout;
* sampled requests (temperature, top-k, top-p, per-request seeds) beside a greedy one, on
  Nemotron-H: the reference sampler's tokens from the dense oracle's rows, and the same tokens
  lockstep and overlapped, flash and rpa;
* DeepSeek-V3 with ``kv_layout="rpa"``: a ValueError naming the latent cache, from the Runner
  and from ``python -m kvjax demo --kv-layout rpa``, before anything compiles.

Each (architecture, variant) compiles one runner, shared by the module, which serves every
check of it (the rpa runner shares the flash runner's compiled oracle; the bf16 checks use the
float32 runner's as float32's): 11 runners of ~8 to 15 s of CPU each are the bulk of this
file's cost. Elsewhere: transformers parity of ``dense_logits`` (test_hybrid_hf.py,
test_deepseek_v3.py), Granite with the RPA layout, meshes.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import hf_greedy, redraw_weights  # noqa: E402
from kvjax.cli.demo import check_against_reference, model_dtype, reference_tokens  # noqa: E402
from kvjax.host.scheduler import Request  # noqa: E402
from kvjax.models import load_pretrained  # noqa: E402
from kvjax.runner.runner import Runner, RunnerConfig  # noqa: E402
from kvjax.runner.serving import PENDING_TOKEN, run_to_completion  # noqa: E402
from kvjax.testing.fast_compile import FAST_COMPILER_OPTIONS  # noqa: E402

FAST = FAST_COMPILER_OPTIONS  # kvjax.testing.fast_compile (also in XLA_FLAGS, tests/conftest.py)

# A tiny DeepSeek-V3: q LoRA, one dense layer then one MoE layer (8 experts in 2 groups, top-2).
DEEPSEEK = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
    routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16,
    qk_nope_head_dim=16, n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1,
    max_position_embeddings=64)

# architecture -> checkpoint of conftest.CHECKPOINTS (None: DEEPSEEK, made here)
ARCHS = {"granite": "granite_rope_moe", "bamba": "bamba", "nemotron_h": "nemotron_h", "deepseek_v3": None}
SPEC_FP8_ARCHS = ["granite", "bamba", "deepseek_v3"]  # Nemotron-H: see the module docstring
RPA_ARCHS = ["nemotron_h"]  # Granite's: test_hybrid_hf.py; DeepSeek-V3's is refused (docstring)
BF16_ARCHS = ["granite", "bamba", "deepseek_v3"]  # Nemotron-H's bf16: test_hybrid_hf.py
SAMPLED_ARCH = "nemotron_h"  # sampled requests: flash and rpa layouts, lockstep and overlapped

# variant -> (params dtype, Runner settings)
VARIANTS = {
    "base": ("float32", dict()),
    "spec_fp8": ("float32", dict(num_speculative_tokens=2, kv_cache_dtype="fp8")),
    "bf16": ("bfloat16", dict()),
    "rpa": ("float32", dict(kv_layout="rpa")),
}

# 9 allocatable blocks of 4 tokens; three requests of up to 20 tokens need 15: preemption, of
# requests in prefill and in decode (the scheduler alone decides, whatever the model).
SIZES = dict(block_size=4, num_blocks=10, max_model_len=24, max_num_seqs=3, max_num_batched_tokens=8,
             token_sizes=(8,), backend="reference", poison=True)
PROMPT_LENS = (9, 9, 10, 9)  # each request reaches 19+ tokens: one dense-oracle length (24)
MAX_TOKENS = 10
# bf16 (Granite, Bamba, DeepSeek-V3; one tolerance for all three): paged vs its bf16 dense oracle
# (the CPU's reference kernels do the oracle's ops: 0 seen but for one Granite row, 0.001, an
# accumulation-order flip of one bf16 rounding; as test_hybrid_hf's bf16 bound), and vs float32,
# whose gap is bf16 rounding (~2^-9 relative) of every activation and weight, so it grows with the
# logits: DeepSeek-V3 and Bamba (largest |logit| ~4 here) up to 0.037 and 0.038 seen, Granite
# (logits_scaling 3: |logit| <= 1.4) 0.005
BF16_ATOL = 0.05
BF16_VS_F32 = 0.06


# The sampled workload (same prompts and arrivals, so it preempts too): r0 greedy beside sampled
# rows; r1 plain sampling; r2 with top-k and top-p, each of which decides one of its tokens (its
# draw without that filter is another token: seed 13 makes it so with SAMPLED_ARCH's logits, checked
# by check_sampled); r3 is r1 again (its prompt, parameters and seed)
# arriving later, in another row and other batches.
SAMPLING = (
    dict(),
    dict(temperature=1.0, seed=7),
    dict(temperature=0.5, top_k=3, top_p=0.5, seed=13),
    dict(temperature=1.0, seed=7),
)


def workload(vocab: int, sampled: bool = False) -> list[Request]:
    """Fresh requests (run_to_completion mutates them)."""
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(0, vocab, n)] for n in PROMPT_LENS]
    if not sampled:
        return [Request(f"r{i}", p, MAX_TOKENS, arrival_step=i) for i, p in enumerate(prompts)]
    prompts[3] = list(prompts[1])
    return [Request(f"r{i}", p, MAX_TOKENS, arrival_step=i, **SAMPLING[i]) for i, p in enumerate(prompts)]


@pytest.fixture(scope="module")
def checkpoint(hf_checkpoint, tmp_path_factory):
    """``checkpoint(arch) -> directory``."""
    made = {}

    def get(arch: str) -> str:
        if ARCHS[arch] is not None:
            return hf_checkpoint(ARCHS[arch])
        if arch not in made:
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                torch.manual_seed(0)
                m = transformers.AutoModelForCausalLM.from_config(transformers.DeepseekV3Config(**DEEPSEEK))
                redraw_weights(m, torch)
                path = tmp_path_factory.mktemp(arch)
                m.save_pretrained(path)
            finally:
                torch.set_num_threads(threads)
            made[arch] = str(path)
        return made[arch]

    return get


class Served:
    """One compiled runner of an (architecture, variant) and its served runs, cached."""

    def __init__(self, path: str, variant: str):
        dtype, settings = VARIANTS[variant]
        self.model, self.params = load_pretrained(path, dtype=dtype)
        self.config = RunnerConfig(model=self.model, **SIZES, **settings)
        self.runner = Runner(self.config, params=self.params, compiler_options=FAST)
        self.runner.precompile()
        self.runs: dict[tuple[bool, bool], dict] = {}

    def drafter(self, tokens, k: int) -> list[int]:
        """Drafts from the dense oracle (the greedy continuation), one of them made wrong on
        two of every three calls: drafts are accepted in full, in part and not at all."""
        drafts, seq = [], list(tokens)
        for _ in range(k):
            padded = np.zeros(self.config.max_model_len, np.int32)
            padded[: len(seq)] = seq
            nxt = int(np.argmax(np.asarray(self.runner.dense_reference(padded))[len(seq) - 1]))
            drafts.append(nxt)
            seq.append(nxt)
        miss = len(tokens) % 3
        if 0 < miss <= len(drafts):
            drafts[-miss] = (drafts[-miss] + 1) % self.model.vocab_size
        return drafts

    def serve(self, overlap: bool, sampled: bool = False) -> dict:
        """``{"done": {id: Request}, "preemptions", "steps", "results", "nan_count",
        "preempted_with", "chunks", "drafts"}`` of the workload (greedy or sampled) served once
        (lockstep or overlapped)."""
        if (overlap, sampled) not in self.runs:
            self.runner.reset()
            sched = self.config.make_scheduler(self.drafter if self.config.num_speculative_tokens else None)
            reqs = workload(self.model.vocab_size, sampled)
            seen = {r.req_id: 0 for r in reqs}
            preempted_with = []  # per preemption: the outputs its request had generated
            chunks = [0]  # prefill chunks that left their request mid-prefill

            def on_step(step, plans):
                chunks[0] += sum(not x.req.is_decoding for p in plans.values() if p for x in p.scheduled)
                for r in reqs:
                    if r.num_preemptions > seen[r.req_id]:
                        seen[r.req_id] = r.num_preemptions
                        preempted_with.append(len(r.output))

            stats = run_to_completion(sched, self.runner, arrivals=reqs, overlap=overlap, on_step=on_step)
            results, nan_count = check_against_reference(self.runner, self.config, sched.finished)
            self.runs[overlap, sampled] = dict(
                done={r.req_id: r for r in sched.finished}, preemptions=sched.num_preemptions, steps=stats.steps,
                results=results, nan_count=nan_count, preempted_with=preempted_with, chunks=chunks[0],
                drafts=(sched.num_drafts_proposed, sched.num_drafts_accepted))
        return self.runs[overlap, sampled]


@pytest.fixture(scope="module")
def served(checkpoint):
    """``served(arch, variant) -> Served`` (one compiled runner each, for the whole module)."""
    cache: dict = {}

    def get(arch: str, variant: str = "base") -> Served:
        if (arch, variant) not in cache:
            s = cache[arch, variant] = Served(checkpoint(arch), variant)
            base = cache.get((arch, "base"))
            if variant == "rpa" and base is not None:
                # The oracle does not depend on the layout: share base's, compiled already
                # (``Runner.dense_reference``: the model's dense_logits, these params, dtype and
                # matmul precision).
                assert base.config == dataclasses.replace(s.config, kv_layout="flash", model=base.model)
                s.runner.__dict__["dense_reference"] = base.runner.dense_reference
        return cache[arch, variant]

    return get


def check_matches_dense(s: Served, run: dict) -> None:
    """Prompts were prefilled in chunks; every request finished with all its tokens; each token
    is the oracle's and each logits row within the demo's tolerance (float32, fp8 or bfloat16);
    nothing compiled at serving time."""
    assert run["chunks"] > 0, "prompts must be prefilled in chunks"
    assert sorted(run["done"]) == [f"r{i}" for i in range(len(PROMPT_LENS))]
    assert run["nan_count"] == 0
    for rid, r in run["results"].items():
        assert len(r["output"]) == MAX_TOKENS, rid
        assert r["matches_reference"], (rid, r)
    assert s.runner.guard.serving_compiles + s.runner.guard.serving_traces == 0


def check_preempted_and_resumed(run: dict) -> None:
    """Requests were preempted, one after it had generated tokens (it resumes with them as its
    prompt), and every preempted request finished."""
    assert run["preemptions"] > 0, "the workload must preempt"
    assert len(run["preempted_with"]) == run["preemptions"] and max(run["preempted_with"]) > 0, run["preempted_with"]
    resumed = [r for r in run["done"].values() if r.num_preemptions]
    assert resumed and all(len(r.output) == MAX_TOKENS for r in resumed)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_preempted_requests_resume_and_match_dense(served, arch):
    s = served(arch)
    run = s.serve(overlap=False)
    check_preempted_and_resumed(run)
    check_matches_dense(s, run)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_tokens_are_transformers_generate(served, checkpoint, arch):
    """The lockstep run's greedy tokens (chunked prefill, poisoned pools, requests preempted and
    resumed by recompute) are transformers' greedy ``generate`` of each prompt, token for token
    (no near-tie allowance here). The float32 runner of the module, no compile of its own."""
    s = served(arch)
    run = s.serve(overlap=False)
    assert run["preemptions"] > 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint(arch), dtype="float32").eval()
    for req in workload(s.model.vocab_size):  # the prompts as submitted
        assert run["done"][req.req_id].output == hf_greedy(hf, req.prompt, MAX_TOKENS, torch), (arch, req.req_id)


def check_overlap_is_lockstep(s: Served) -> None:
    a, b = s.serve(overlap=False), s.serve(overlap=True)
    check_preempted_and_resumed(b)
    assert (a["steps"], a["preemptions"]) == (b["steps"], b["preemptions"])
    for rid, ra in a["done"].items():
        rb = b["done"][rid]
        assert PENDING_TOKEN not in rb.output
        assert ra.output == rb.output, rid
        la, lb = np.stack(ra.logits), np.stack(rb.logits)
        assert la.shape == lb.shape and la.dtype == lb.dtype, rid
        assert np.array_equal(la.view(f"u{la.itemsize}"), lb.view(f"u{lb.itemsize}")), rid
    check_matches_dense(s, b)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_overlap_is_bitwise_lockstep_and_matches_dense(served, arch):
    check_overlap_is_lockstep(served(arch))


@pytest.mark.parametrize("arch", SPEC_FP8_ARCHS)
def test_speculative_decoding_with_fp8_kv_cache(served, arch):
    s = served(arch, "spec_fp8")
    run = s.serve(overlap=False)
    proposed, accepted = run["drafts"]
    assert proposed > accepted > 0, run["drafts"]
    check_preempted_and_resumed(run)
    check_matches_dense(s, run)


@pytest.mark.parametrize("arch", BF16_ARCHS)
def test_bfloat16_through_the_runner(served, arch):
    """bf16 params and KV cache (DeepSeek-V3: the latent cache; the hybrids' Mamba state stays
    in its own dtype), preempting, lockstep and overlapped: every row matches the bf16 dense
    oracle (which rounds K/V / the latent to bf16 as the cache does), within BF16_ATOL.
    Against float32 (the float32 runner's oracle), teacher-forced on the bf16 run's tokens:
    within BF16_VS_F32 of every logits row, and each token is float32's argmax or within
    2 * BF16_VS_F32 of it (a near tie may go either way: 0.014 apart was seen with another
    workload; here every token is float32's argmax)."""
    s = served(arch, "bf16")
    assert model_dtype(s.model) == "bfloat16"
    kv_dtypes = {p.dtype for p in s.runner.pool_specs if p.kind == "kv"}
    assert kv_dtypes == {"bfloat16"}, kv_dtypes
    run = s.serve(overlap=False)
    check_preempted_and_resumed(run)
    check_matches_dense(s, run)
    assert max(r["max_logit_error"] for r in run["results"].values()) <= BF16_ATOL, run["results"]
    check_overlap_is_lockstep(s)
    f32 = served(arch)  # its oracle: float32 params, this checkpoint; compiled for this length
    assert model_dtype(f32.model) == "float32"
    for rid, r in run["done"].items():
        seq = r.prompt + r.output
        padded = np.zeros(s.config.max_model_len, np.int32)
        padded[: len(seq)] = seq
        ref = np.asarray(f32.runner.dense_reference(padded))[len(r.prompt) - 1: len(seq) - 1]
        got = np.stack(r.logits).astype(np.float32)
        assert np.abs(got - ref).max() <= BF16_VS_F32, (rid, np.abs(got - ref).max())
        gap = ref.max(-1) - ref[np.arange(len(r.output)), r.output]
        assert gap.max() <= 2 * BF16_VS_F32, (rid, gap)


@pytest.mark.parametrize("arch", RPA_ARCHS)
def test_rpa_layout_matches_dense(served, arch):
    """``kv_layout="rpa"`` (one combined K/V page pool per attention layer, written by
    write_kv_pages and read by ragged paged attention), poisoned, chunked, preempting, lockstep
    and overlapped: every row matches the dense oracle, as the flash layout's runs do."""
    s = served(arch, "rpa")
    kv = [p for p in s.runner.pool_specs if p.kind == "kv"]
    assert kv and all(p.name.endswith(".kv") for p in kv), [p.name for p in kv]
    run = s.serve(overlap=False)
    check_preempted_and_resumed(run)
    check_matches_dense(s, run)
    check_overlap_is_lockstep(s)


def check_sampled(run: dict) -> None:
    """The sampled workload's rows: each token the reference sampler's draw from the dense
    oracle's row (``check_matches_dense``); here, independently of that sampler, each token lies
    in its row's top-k / top-p set, the greedy row is the argmax, some sampled token is not
    (sampling happened), and r3 (r1's prompt, parameters and seed) drew r1's tokens."""
    done = run["done"]
    for rid, params in zip(sorted(done), SAMPLING):
        r = done[rid]
        logits = np.stack(r.logits).astype(np.float64)
        out = np.array(r.output)
        if not params:
            assert (logits.argmax(-1) == out).all(), rid
            continue
        scaled = logits / params["temperature"]
        order = np.argsort(-scaled, axis=-1, kind="stable")
        rank = np.argmax(order == out[:, None], axis=-1)  # 0: the largest
        if params.get("top_k", 0):
            assert (rank < params["top_k"]).all(), (rid, rank)
        if params.get("top_p", 1.0) < 1.0:
            probs = np.exp(scaled - scaled.max(-1, keepdims=True))
            probs = np.take_along_axis(probs / probs.sum(-1, keepdims=True), order, axis=-1)
            before = np.cumsum(probs, axis=-1) - probs
            assert (np.take_along_axis(before, rank[:, None], axis=-1)[:, 0] < params["top_p"] + 1e-6).all(), rid
            if params.get("top_k", 0):  # each filter decides a token: dropped, it would be another
                for off in (dict(top_k=0), dict(top_p=1.0)):
                    other = reference_tokens(dataclasses.replace(r, **off), np.stack(r.logits))
                    assert (other != out).any(), (rid, off)
    sampled = [rid for rid, p in zip(sorted(done), SAMPLING) if p]
    assert any((np.stack(done[rid].logits).argmax(-1) != done[rid].output).any() for rid in sampled)
    assert done["r3"].output == done["r1"].output


def test_sampled_requests_same_seed_same_tokens_across_loops_and_layouts(served):
    """Sampled requests (temperature, top-k, top-p, per-request seeds) beside a greedy one,
    preempted and resumed: lockstep and overlapped, flash and rpa layouts, every row matches the
    dense oracle (the reference sampler with the request's seed and positions: the same tokens)
    and all four runs give each request the same tokens."""
    runs = {}
    for variant in ("base", "rpa"):
        s = served(SAMPLED_ARCH, variant)
        for overlap in (False, True):
            run = runs[variant, overlap] = s.serve(overlap=overlap, sampled=True)
            check_preempted_and_resumed(run)
            check_matches_dense(s, run)
            check_sampled(run)
    outputs = {k: {rid: r.output for rid, r in run["done"].items()} for k, run in runs.items()}
    first = outputs["base", False]
    for k, out in outputs.items():
        assert out == first, (k, out, first)


def test_deepseek_v3_rpa_layout_is_refused(checkpoint, monkeypatch, capsys):
    """The MLA latent cache has one layout: kv_layout="rpa" is a ValueError naming it, from the
    Runner and from the CLI (exit 2, no traceback), before any compile."""
    from kvjax.cli import main as cli

    path = checkpoint("deepseek_v3")
    model, params = load_pretrained(path, dtype="float32")
    config = RunnerConfig(model=model, **{**SIZES, "kv_layout": "rpa"})

    def boom(*a, **k):
        raise AssertionError("compiled before refusing the layout")

    monkeypatch.setattr(Runner, "precompile", boom)
    with pytest.raises(ValueError, match=r"kv_layout='rpa': the MLA latent cache has one layout"):
        Runner(config, params=params)
    capsys.readouterr()
    assert cli.main(["demo", "--model", path, "--kv-layout", "rpa", "--dtype", "float32", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "Traceback" not in err
    assert "kv_layout='rpa'" in err and "MLA latent cache" in err, err
