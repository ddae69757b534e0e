"""The bf16 parity check passes a routing near-tie flip and fails a genuine bug.

In a bf16 MoE model the served step and the dense reference round the router's input apart by
~1e-3, so a token whose two candidate experts (or expert groups) are that close can be routed
differently: its logits then move by a whole expert's output (BENCHMARKS.md, H200 note 60:
0.73 on the demo's tiny DeepSeek-V3 on an H200). The check compares such a row with the
reference's routing variants (:mod:`kvjax.testing.routing_variants`).

Here the "served" side is the dense reference of a tiny bf16 DeepSeek-V3 (its one MoE layer its
last) with the router's choice bias moved by 2.5e-3 at one expert, decoding greedily: a flip at
one row (prompt A) or at the first generated token, which changes every later token (prompt B).
The bugs: the bias moved by 0.3 (choices far from any tie), and one expert's down projection
scaled by 1.5.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.cli import demo
from kvjax.host.scheduler import Request
from kvjax.models.hf import deepseek_v3 as ds
from kvjax.runner import RunnerConfig
from kvjax.testing import routing_variants as rv
from tests.fake_runner import FakeRunner

L, NEW = 32, 16
TINY = ds.DeepseekV3Config(
    vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=4, n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=2.5,
    kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, n_group=2,
    topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, norm_topk_prob=True, rms_norm_eps=1e-6,
    rope_theta=10000.0, rope_interleave=True, attention_bias=False, tie_word_embeddings=False,
    max_position_embeddings=64)
PROMPT_A = [22, 104, 83, 116, 64, 77, 124, 93]  # bias[0] - 2.5e-3: row 12 flips, same tokens
PROMPT_B = [11, 110, 2, 69, 10, 38, 61, 54]  # bias[1] + 2.5e-3: row 0 flips, the tokens after differ
BIAS = ("layers", 1, "mlp", "bias")


@pytest.fixture(scope="module")
def setup():
    model = ds.DeepseekV3(TINY, dtype="bfloat16")
    params = model.init_params(0)
    config = RunnerConfig(model=model, max_model_len=L)
    return FakeRunner(model, params, config), config, jax.jit(model.dense_logits)


def decode(fwd, params, prompt, n=NEW):
    """Greedy decoding of ``n`` tokens through ``fwd(params, tokens)``, as a finished Request
    with its logits."""
    toks = np.zeros(L, np.int32)
    toks[: len(prompt)] = prompt
    req = Request("r", list(prompt), n, 0)
    for i in range(n):
        with jax.default_matmul_precision("highest"):
            row = np.asarray(fwd(params, jnp.asarray(toks)))[len(prompt) + i - 1]
        req.output.append(int(row.argmax()))
        req.logits.append(row)
        toks[len(prompt) + i] = req.output[-1]
    return req


def served(params, expert, shift):
    """``params`` with the router's choice bias moved by ``shift`` at ``expert``."""
    b = np.asarray(rv._get(params, BIAS), np.float32).copy()
    b[expert] += shift
    return rv._replaced(params, BIAS, jnp.asarray(b))


def check(setup, params, prompt):
    runner, config, fwd = setup
    results, nan_count = demo.check_against_reference(runner, config, [decode(fwd, params, prompt)])
    assert nan_count == 0
    return results["r"]


def test_the_routers_choice_bias_is_found(setup):
    runner = setup[0]
    assert rv.router_biases(runner.dense_params) == [BIAS]
    assert len(rv.RoutingVariants(runner.model, runner.dense_params)) == 2 * TINY.n_routed_experts


@pytest.mark.parametrize("prompt,expert,shift,same_tokens", [(PROMPT_A, 0, -2.5e-3, True),
                                                             (PROMPT_B, 1, 2.5e-3, False)])
def test_a_routing_flip_matches_a_variant(setup, monkeypatch, prompt, expert, shift, same_tokens):
    runner, config, fwd = setup
    p = served(runner.dense_params, expert, shift)
    assert (decode(fwd, p, prompt).output == decode(fwd, runner.dense_params, prompt).output) is same_tokens
    with monkeypatch.context() as m:  # the premise: without the variants the flip is a miss
        m.setattr(demo, "uses_routing_variants", lambda dtype: False)
        miss = check(setup, p, prompt)
    assert not miss["matches_reference"] and miss["max_logit_error"] > 1.0, miss
    res = check(setup, p, prompt)
    assert res["matches_reference"], res
    assert res["routing_tie_rows"] >= 1 and res["max_logit_error_vs_match"] <= demo.LOGITS_ATOL_BF16, res
    assert res["max_logit_error"] == miss["max_logit_error"]


def _far_from_ties(params):
    return served(params, 0, -0.3)


def _wrong_expert_output(params):
    out = dict(params)
    layers = list(params["layers"])
    layers[1] = dict(layers[1], mlp=dict(layers[1]["mlp"], w_down=jnp.asarray(layers[1]["mlp"]["w_down"]).at[0].multiply(1.5)))
    out["layers"] = layers
    return out


@pytest.mark.parametrize("bug", [_far_from_ties, _wrong_expert_output], ids=lambda f: f.__name__[1:])
def test_a_genuine_bug_does_not_match(setup, bug):
    runner = setup[0]
    for p in (PROMPT_A, PROMPT_B):
        res = check(setup, bug(runner.dense_params), p)
        assert not res["matches_reference"], res


def test_a_float32_model_tries_no_routing_variants():
    assert demo.uses_routing_variants("bfloat16") and not demo.uses_routing_variants("float32")


def test_router_biases_are_found_by_their_router_only():
    """A 1-D ``e_bias`` / ``bias`` beside a ``router`` as long as its experts (in dicts, lists and
    tuples, as the hybrid models' ``blocks`` tuple); no other bias."""
    r, b = np.zeros((4, 3)), np.zeros(3)
    tree = {"blocks": ({"router": r, "e_bias": b}, {"w": r, "bias": b}, {"router": r, "bias": np.zeros(4)}),
            "layers": [{"mlp": {"router": r, "bias": b, "b_up": b}}, {"mlp": {"router": {"w": r}, "bias": b}}]}
    assert rv.router_biases(tree) == [("blocks", 0, "e_bias"), ("layers", 0, "mlp", "bias")]
    new = rv._replaced(tree, ("blocks", 0, "e_bias"), b + 1)
    assert isinstance(new["blocks"], tuple) and (new["blocks"][0]["e_bias"] == 1).all()
    assert (tree["blocks"][0]["e_bias"] == 0).all() and new["layers"] is tree["layers"]


@pytest.mark.parametrize("kind", ["routing", "fp8"])
def test_variants_read_the_references_device_params(setup, kind):
    """The parity check's variants read the runner's one device copy of the params (no second
    copy of the model beside the reference's; no host-to-device transfer of it per call)."""
    runner, config = setup[0], setup[1]
    variants = demo._variants(runner, config, kind)
    got, want = jax.tree.leaves(variants.params), jax.tree.leaves(runner.dense_device_params)
    assert len(got) == len(want) and all(a is b for a, b in zip(got, want))
