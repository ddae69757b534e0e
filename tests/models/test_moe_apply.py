"""The routed-expert rule (``kvjax.models.moe.apply_experts`` / ``routed_ffn``) shared by the
generic MoE and DeepSeek-V3: dense (all held experts, batched over the expert axis), sparse
(only the chosen experts' weights) and grouped (pairs sorted by expert into tiles, through
``pallas_kernels.grouped_matmul``: its GPU kernel in interpret mode and its reference) paths
against a per-token numpy loop, expert parallelism
over two host devices, the routing functions unchanged, and no weight-stack-sized transpose or
copy in the compiled program."""

import functools
import json
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.models import moe
from pallas_kernels.moe_route import select_experts
from kvjax.models.hf import deepseek_v3 as ds
from kvjax.testing.fast_compile import DEFAULT_FUSION_OPTIONS, XLA_DEFAULT_COMPILER_OPTIONS

ROOT = pathlib.Path(__file__).resolve().parents[2]

E, D, F, K = 8, 16, 24, 2  # stack E * D * F = 3072 elements; no activation has that size

# float32 bounds (values are O(1)): every path against the float64 loop, and against each other
# (they differ only in the accumulation order of the products: up to 1.9e-6 on an H100, where
# cuBLAS and the grouped kernel order their sums differently)
LOOP_TOL = 2e-5
PATH_TOL = 4e-6


def _weights(seed, E_=E, gated=True):
    r = np.random.default_rng(seed)
    w = {"w_up": r.standard_normal((E_, D, F)).astype(np.float32) / np.sqrt(D),
         "w_down": r.standard_normal((E_, F, D)).astype(np.float32) / np.sqrt(F)}
    if gated:
        w["w_gate"] = r.standard_normal((E_, D, F)).astype(np.float32) / np.sqrt(D)
    return w


def _act(x, name):
    return x / (1 + np.exp(-x)) if name == "silu" else np.square(np.maximum(x, 0))


def loop_reference(h, idx, weight, w, gated, act, first=0):
    """Per token, per choice, in float64: the chosen expert if this holder has it, else 0."""
    h, w = np.asarray(h, np.float64), {k: np.asarray(v, np.float64) for k, v in w.items()}
    El = w["w_up"].shape[0]
    y = np.zeros_like(h)
    for t in range(h.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j]) - first
            if not 0 <= e < El:
                continue
            up = h[t] @ w["w_up"][e]
            up = _act(h[t] @ w["w_gate"][e], act) * up if gated else _act(up, act)
            y[t] += float(weight[t, j]) * (up @ w["w_down"][e])
    return y


def _routing(seed, T, E_=E, k=K, lo=0, hi=None):
    """Distinct experts per token drawn from ``[lo, hi)``, positive weights (not normalised)."""
    r = np.random.default_rng(seed)
    hi = E_ if hi is None else hi
    idx = np.stack([r.choice(np.arange(lo, hi), k, replace=False) for _ in range(T)]).astype(np.int32)
    return idx, r.uniform(0.2, 1.5, (T, k)).astype(np.float32)


VARIANTS = [(True, "silu"), (True, "relu2"), (False, "relu2"), (False, "silu")]


@pytest.mark.parametrize("gated,act", VARIANTS)
@pytest.mark.parametrize("T", [1, 3, 16])
def test_dense_and_sparse_match_the_loop(gated, act, T):
    w = _weights(T, gated=gated)
    h = np.random.default_rng(T + 100).standard_normal((T, D)).astype(np.float32)
    idx, weight = _routing(T + 7, T)
    ref = loop_reference(h, idx, weight, w, gated, act)
    # One program per path, at XLA:CPU's defaults (not the suite's fast settings, tests/conftest.py,
    # whose level-0 dots accumulate differently): PATH_TOL bounds the gap of the program a user gets.
    # "auto" lowers to the program of the path it chooses: a program whose StableHLO text is one
    # already compiled here is not compiled again (its outputs would be the same bits).
    args = (jnp.asarray(h), jnp.asarray(idx), jnp.asarray(weight), w)
    outs, by_text = {}, {}
    for p, b in (("dense", "reference"), ("sparse", "reference"), ("auto", "reference"),
                 ("grouped", "reference"), ("grouped", "pallas_gpu"), ("auto", "pallas_gpu")):
        lowered = jax.jit(functools.partial(moe.apply_experts, gated=gated, activation=act, path=p, backend=b),
                          compiler_options=XLA_DEFAULT_COMPILER_OPTIONS).lower(*args)
        text = lowered.as_text()
        if text not in by_text:
            by_text[text] = np.asarray(lowered.compile()(*args))
        outs[p, b] = by_text[text]
    assert len(by_text) >= 4  # dense, sparse, grouped (reference), grouped (kernel) differ
    for p, y in outs.items():
        np.testing.assert_allclose(y, ref, rtol=0, atol=LOOP_TOL, err_msg=str(p))
        assert np.max(np.abs(outs["dense", "reference"] - y)) <= PATH_TOL, p


@pytest.mark.parametrize("path", ["dense", "sparse", "grouped"])
def test_a_holder_applies_only_its_own_experts(path):
    """``w`` holds experts 4..7 of 8 (``first=4``): choices of 0..3 add 0; tokens 0-2 chose
    only experts another member holds (their rows are exactly 0), token 3 only held ones."""
    gated, act, T = True, "silu", 7
    w_all = _weights(3)
    w = {k: v[4:] for k, v in w_all.items()}
    h = np.random.default_rng(5).standard_normal((T, D)).astype(np.float32)
    idx, weight = _routing(6, T)
    idx[:3] = [[0, 1], [3, 2], [1, 3]]
    idx[3] = [5, 7]
    backend = "pallas_gpu" if path == "grouped" else "reference"
    y = np.asarray(moe.apply_experts(jnp.asarray(h), jnp.asarray(idx), jnp.asarray(weight), w,
                                     gated=gated, activation=act, first=4, path=path, backend=backend))
    np.testing.assert_allclose(y, loop_reference(h, idx, weight, w, gated, act, first=4), atol=LOOP_TOL, rtol=0)
    assert np.all(y[:3] == 0)
    # the two holders' parts add up to the whole
    other = np.asarray(moe.apply_experts(jnp.asarray(h), jnp.asarray(idx), jnp.asarray(weight),
                                         {k: v[:4] for k, v in w_all.items()}, first=0, path=path,
                                         backend=backend))
    whole = loop_reference(h, idx, weight, w_all, gated, act)
    np.testing.assert_allclose(y + other, whole, atol=LOOP_TOL, rtol=0)


@pytest.mark.parametrize("path,backend", [("dense", "reference"), ("sparse", "reference"),
                                          ("grouped", "reference"), ("grouped", "pallas_gpu")])
def test_masked_tokens_add_zero_and_leave_real_ones_bitwise(path, backend):
    """A step's padding (``token_mask`` False) adds exactly 0; every real token's row is bitwise
    what the unmasked call gives it."""
    T = 6
    w = _weights(11)
    h = np.random.default_rng(12).standard_normal((T, D)).astype(np.float32)
    idx, weight = _routing(13, T)
    mask = np.array([True, False, True, True, False, True])
    f = functools.partial(moe.apply_experts, path=path, backend=backend)
    y = np.asarray(f(jnp.asarray(h), jnp.asarray(idx), jnp.asarray(weight), w))
    ym = np.asarray(f(jnp.asarray(h), jnp.asarray(idx), jnp.asarray(weight), w, token_mask=jnp.asarray(mask)))
    assert np.all(ym[~mask] == 0) and np.all(y[~mask] != 0)
    assert np.array_equal(ym[mask].view(np.uint32), y[mask].view(np.uint32))
    with pytest.raises(ValueError, match=r"token_mask must have shape \[6\]"):
        f(jnp.asarray(h), jnp.asarray(idx), jnp.asarray(weight), w, token_mask=jnp.ones((5,), bool))


def test_padding_reads_no_expert_on_the_grouped_path(monkeypatch):
    """Experts 6 and 7, chosen only by a pad token, get no tile of the grouped products (their
    weights are not read); unmasked, they do."""
    tiles = []
    real_gm = moe.grouped_matmul

    def spy(a, w, tile_group, **kw):
        tiles.append(set(np.asarray(tile_group).tolist()))
        return real_gm(a, w, tile_group, **kw)

    monkeypatch.setattr(moe, "grouped_matmul", spy)
    h = np.random.default_rng(14).standard_normal((3, D)).astype(np.float32)
    idx = np.array([[0, 1], [6, 7], [1, 2]], np.int32)
    weight = np.ones((3, K), np.float32)
    for mask, expect in ((None, {6, 7}), (np.array([True, False, True]), set())):
        tiles.clear()
        moe.apply_experts(jnp.asarray(h), jnp.asarray(idx), jnp.asarray(weight), _weights(15), path="grouped",
                          backend="pallas_gpu", token_mask=None if mask is None else jnp.asarray(mask))
        assert tiles and all(t & {6, 7} == expect for t in tiles), (mask, tiles)


def test_one_token_pairs_take_a_tile_each_without_counting(monkeypatch):
    """On the grouped path a single token's ``k`` pairs (``k`` distinct experts) take the
    ``rows_apart`` layout (one tile each, nothing counted); more tokens are counted into shared
    tiles. The one-token result is bitwise that of the counted layout."""
    seen = []
    real = moe.group_tiles

    def spy(g, G, TM, rows_apart=False):
        seen.append(rows_apart)
        return real(g, G, TM, rows_apart=rows_apart)

    monkeypatch.setattr(moe, "group_tiles", spy)
    w = _weights(21)
    f = functools.partial(moe.apply_experts, path="grouped", backend="pallas_gpu")
    for T, apart in ((1, True), (3, False)):
        h = np.random.default_rng(T).standard_normal((T, D)).astype(np.float32)
        idx, weight = _routing(T + 30, T)
        seen.clear()
        y = np.asarray(f(jnp.asarray(h), jnp.asarray(idx), jnp.asarray(weight), w))
        assert seen == [apart], (T, seen)
        np.testing.assert_allclose(y, loop_reference(h, idx, weight, w, True, "silu"), atol=LOOP_TOL, rtol=0)
    monkeypatch.setattr(moe, "group_tiles", lambda g, G, TM, rows_apart=False: real(g, G, TM))
    counted = np.asarray(f(jnp.asarray(h[:1]), jnp.asarray(idx[:1]), jnp.asarray(weight[:1]), w))
    monkeypatch.setattr(moe, "group_tiles", real)
    assert np.array_equal(counted.view(np.uint32),
                          np.asarray(f(jnp.asarray(h[:1]), jnp.asarray(idx[:1]), jnp.asarray(weight[:1]),
                                       w)).view(np.uint32))


@pytest.mark.parametrize("path,backend", [("sparse", "reference"), ("grouped", "pallas_gpu")])
def test_num_tokens_routes_only_the_steps_rows(path, backend):
    """``routed_ffn(num_tokens=n)``: rows after the first ``n`` (a one-token step's second row)
    are not routed and come out exactly 0, even when NaN; the first rows are bitwise the call
    on them alone. A bad ``num_tokens`` is refused by name."""
    w = {**_weights(22), "router": np.random.default_rng(23).standard_normal((D, E)).astype(np.float32)}
    spec = moe.MoESpec(E, K, F)
    h = np.random.default_rng(24).standard_normal((3, D)).astype(np.float32)
    h[1:] = np.nan
    f = functools.partial(moe.moe_ffn, w=w, spec=spec, path=path, backend=backend)
    y = np.asarray(f(jnp.asarray(h), token_mask=jnp.array([True, False, False]), num_tokens=1))
    alone = np.asarray(f(jnp.asarray(h[:1]), token_mask=jnp.array([True])))
    assert np.all(y[1:] == 0) and np.all(np.isfinite(alone)) and np.any(alone != 0)
    assert np.array_equal(y[:1].view(np.uint32), alone.view(np.uint32))
    with pytest.raises(ValueError, match=r"num_tokens must be an int in \[1, 3\]"):
        f(jnp.asarray(h), num_tokens=0)


def test_auto_path_is_a_static_choice_from_shapes_and_backend():
    assert moe.sparse_pays(1, 6, 64) and moe.sparse_pays(3, 6, 64) and not moe.sparse_pays(4, 6, 64)
    assert not moe.sparse_pays(1, 2, 4) and moe.sparse_pays(1, 2, 8)
    assert moe.choose_path(1, 6, 64) == "sparse" and moe.choose_path(4, 6, 64) == "dense"
    assert moe.choose_path(1, 6, 64, "pallas_gpu") == "grouped"
    assert moe.choose_path(256, 6, 64, "pallas_tpu") == "dense"  # no TPU kernel: the reference rule
    with pytest.raises(ValueError, match="path must be one of"):
        moe.apply_experts(jnp.zeros((1, D)), jnp.zeros((1, K), jnp.int32), jnp.ones((1, K)), _weights(0),
                          path="ragged")


def test_bf16_weights_run_both_paths_alike():
    """bf16 stacks (the ``mm`` rule: inputs cast to bf16, float32 accumulation): the paths
    agree to the float32 accumulation order, the bf16-rounded intermediate aside."""
    w = {k: jnp.asarray(v, jnp.bfloat16) for k, v in _weights(9).items()}
    h = np.random.default_rng(9).standard_normal((5, D)).astype(np.float32)
    idx, weight = _routing(9, 5)
    ref = loop_reference(np.asarray(jnp.asarray(h, jnp.bfloat16), np.float32), idx, weight,
                         {k: np.asarray(v, np.float32) for k, v in w.items()}, True, "silu")
    ys = {}
    for p, b in (("dense", "reference"), ("sparse", "reference"), ("grouped", "pallas_gpu")):
        ys[p] = np.asarray(moe.apply_experts(jnp.asarray(h), jnp.asarray(idx), jnp.asarray(weight), w,
                                             path=p, backend=b))
        np.testing.assert_allclose(ys[p], ref, atol=0.05, rtol=0.02, err_msg=p)
    # the same bf16 roundings (inputs, intermediate) on every path: only accumulation order differs
    assert np.max(np.abs(ys["grouped"] - ys["dense"])) <= 1e-5


# ----------------------------------------------------------------------------- routing unchanged


def _old_gates_softmax(logits, top_k):
    vals, idx = jax.lax.top_k(logits, top_k)
    w = jax.nn.softmax(vals, axis=-1)
    return jnp.einsum("tk,tke->te", w, jax.nn.one_hot(idx, logits.shape[-1], dtype=jnp.float32))


def _old_gates_sigmoid_grouped(logits, e_bias, spec):
    T, E_ = logits.shape
    scores = jax.nn.sigmoid(logits.astype(jnp.float32))
    choice = scores if e_bias is None else scores + e_bias.astype(jnp.float32)
    if spec.n_group > 1:
        per = E_ // spec.n_group
        group_score = jnp.sum(jax.lax.top_k(choice.reshape(T, spec.n_group, per), min(2, per))[0], axis=-1)
        _, best = jax.lax.top_k(group_score, spec.topk_group)
        keep = jnp.sum(jax.nn.one_hot(best, spec.n_group, dtype=jnp.int32), axis=1) > 0
        choice = jnp.where(jnp.repeat(keep, per, axis=1), choice, -jnp.inf)
    _, idx = jax.lax.top_k(choice, spec.top_k)
    w = jnp.take_along_axis(scores, idx, axis=-1)
    if spec.norm_topk_prob:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    w = w * jnp.float32(spec.routed_scaling_factor)
    return jnp.einsum("tk,tke->te", w, jax.nn.one_hot(idx, E_, dtype=jnp.float32))


def gates_from_topk(idx, weight, num_experts):
    """Dense gate weights float32 ``[T, E]``: ``weight[t, j]`` at ``idx[t, j]``, 0 elsewhere."""
    return jnp.einsum("tk,tke->te", weight, jax.nn.one_hot(idx, num_experts, dtype=jnp.float32))


def test_routing_functions_unchanged_bitwise():
    r = np.random.default_rng(0)
    logits = jnp.asarray(r.standard_normal((32, 16)), jnp.float32)
    bias = jnp.asarray(r.standard_normal(16) * 0.1, jnp.float32)
    softmax = moe.MoESpec(16, 3, 8)
    np.testing.assert_array_equal(gates_from_topk(*select_experts(logits, **moe.route_rule(softmax)), 16),
                                  _old_gates_softmax(logits, 3))
    spec = moe.MoESpec(16, 3, 8, routing="sigmoid_grouped", n_group=4, topk_group=2, routed_scaling_factor=2.5)
    np.testing.assert_array_equal(gates_from_topk(*select_experts(logits, bias, **moe.route_rule(spec)), 16),
                                  _old_gates_sigmoid_grouped(logits, bias, spec))
    # DeepSeek-V3's router: the same choice and weights as the previous dense-gates form
    for norm in (True, False):
        c = ds.config_from_hf(dict(
            vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1,
            n_routed_experts=16, routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=16,
            qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=8, n_group=4, topk_group=2,
            num_experts_per_tok=3, first_k_dense_replace=1, max_position_embeddings=64,
            norm_topk_prob=norm))
        h = jnp.asarray(r.standard_normal((32, 32)), jnp.float32)
        mp = {"router": jnp.asarray(r.standard_normal((32, 16)) / 6, jnp.float32), "bias": bias}
        logits = jnp.matmul(h, mp["router"])
        spec = moe.MoESpec(16, 3, 16, routing="sigmoid_grouped", n_group=4, topk_group=2,
                           norm_topk_prob=norm, routed_scaling_factor=2.5)
        old_gates = _old_gates_sigmoid_grouped(logits, bias, spec)
        np.testing.assert_array_equal(gates_from_topk(*ds.route(h, mp, c), 16), old_gates)


# ----------------------------------------------------------------------------- compiled HLO

_INSTR = re.compile(r"%\S+ = (\w+)\[([\d,]*)\]\S* ([\w-]+)\(")


def stack_sized_copies(hlo: str, stack: int) -> list[str]:
    """Instructions of the compiled HLO (fused computations included) that transpose or copy
    ``stack`` elements: an op ``transpose`` / ``copy`` or a fusion named after one."""
    out = []
    for line in hlo.splitlines():
        m = _INSTR.search(line)
        if not m:
            continue
        n = int(np.prod([int(x) for x in m.group(2).split(",") if x] or [1]))
        name = line.strip().removeprefix("ROOT ").split(" ")[0]
        if n == stack and (m.group(3) in ("transpose", "copy") or "transpose" in name or "copy" in name):
            out.append(line.strip()[:200])
    return out


def _old_einsum_experts(h, idx, weight, w, **_):
    """The previous rule (``td,edf->tef``): a transposed copy of two stacks every call."""
    g = gates_from_topk(idx, weight, E)
    a = jnp.einsum("td,edf->tef", h, w["w_gate"])
    b = jnp.einsum("td,edf->tef", h, w["w_up"])
    o = jnp.einsum("tef,efd->ted", jax.nn.silu(a) * b, w["w_down"])
    return jnp.einsum("te,ted->td", g, o)


def _compiled(fn, T=16):
    w = {k: jnp.asarray(v) for k, v in _weights(1).items()}
    idx, weight = _routing(1, T)
    # XLA:CPU's default fusion emitters (not the suite's, tests/conftest.py): the program a user gets
    lowered = jax.jit(fn, compiler_options=DEFAULT_FUSION_OPTIONS).lower(jnp.ones((T, D)), jnp.asarray(idx),
                                                                      jnp.asarray(weight), w)
    return lowered.as_text(), lowered.compile().as_text()


@pytest.mark.parametrize("path", ["dense", "sparse"])
def test_no_weight_stack_copy_in_the_compiled_program(path):
    """Every expert product is a batched dot with the expert (or (token, choice)) axis the batch
    of both operands and the stack's contraction axis where a gemm reads it (``[B, M, K] x
    [B, K, N]``); the compiled CPU program holds no transpose or copy of a stack's size."""
    text, compiled = _compiled(lambda *a: moe.apply_experts(*a, path=path))
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    assert len(dots) == 3, dots
    assert all("batching_dims = [0] x [0], contracting_dims = [2] x [1]" in line for line in dots), dots
    assert stack_sized_copies(compiled, E * D * F) == []


def test_the_copy_detector_sees_the_old_einsum():
    """The planted previous rule is caught: its compiled program copies the stacks."""
    _, compiled = _compiled(_old_einsum_experts)
    assert stack_sized_copies(compiled, E * D * F), "the old td,edf->tef einsum should copy a stack"


# ----------------------------------------------------------------------------- expert parallelism

_EP_WORKER = r"""
import json, os, sys
from kvjax.testing.fast_compile import with_fast_xla_flags
os.environ["XLA_FLAGS"] = with_fast_xla_flags("--xla_force_host_platform_device_count=2")
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, PartitionSpec as P
from kvjax.models import moe

E, D, F, K, T = 8, 16, 24, 2, 6  # 6 tokens a member, 12 gathered
r = np.random.default_rng(0)
w = {"w_up": r.standard_normal((E, D, F)) / 4, "w_gate": r.standard_normal((E, D, F)) / 4,
     "w_down": r.standard_normal((E, F, D)) / 5}
w = {k: jnp.asarray(v, jnp.float32) for k, v in w.items()}
h = jnp.asarray(r.standard_normal((2 * T, D)), jnp.float32)
idx = np.stack([r.choice(E, K, replace=False) for _ in range(2 * T)]).astype(np.int32)
idx[0] = [0, 3]; idx[1] = [5, 6]; idx[T] = [1, 2]; idx[T + 1] = [4, 7]  # all on one member
weight = jnp.asarray(r.uniform(0.2, 1.5, (2 * T, K)), jnp.float32)
table = {"idx": jnp.asarray(idx), "weight": weight}

def route_fn(hh):  # a fixed routing of the gathered tokens, looked up by the token's first feature
    pos = jnp.argmin(jnp.abs(hh[:, :1] - h[None, :, 0]), axis=1)
    return table["idx"][pos], table["weight"][pos]

mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
out = {}
for path in ("dense", "sparse"):
    ref = moe.routed_ffn(h, route_fn, w, path=path)
    f = jax.shard_map(lambda hh, ww: moe.routed_ffn(hh, route_fn, ww, expert_axis="data", path=path),
                      mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P("data"), check_vma=False)
    got = jax.jit(f)(h, w)
    out[path] = {"max_err": float(jnp.max(jnp.abs(got - ref))), "ref": np.asarray(ref).tolist()}
# padding on both members (token_mask gathered with the tokens): exactly 0 there, the rest as unmasked
mask = jnp.asarray(np.arange(2 * T) % 4 != 1)
f = jax.shard_map(lambda hh, ww, mm: moe.routed_ffn(hh, route_fn, ww, expert_axis="data", token_mask=mm),
                  mesh=mesh, in_specs=(P("data"), P("data"), P("data")), out_specs=P("data"), check_vma=False)
got = np.asarray(jax.jit(f)(h, w, mask))
ref = np.asarray(moe.routed_ffn(h, route_fn, w))
m = np.asarray(mask)
out["masked"] = {"pad_rows_zero": bool(np.all(got[~m] == 0)), "pads": int((~m).sum()),
                 "max_err": float(np.max(np.abs(got[m] - ref[m])))}
# a one-token step as two rows on each member (the second NaN): num_tokens=1 routes the token only
nan = jnp.full((D,), jnp.nan, jnp.float32)
h2 = jnp.stack([h[0], nan, h[T], nan])
f = jax.shard_map(lambda hh, ww: moe.routed_ffn(hh, route_fn, ww, expert_axis="data", num_tokens=1),
                  mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P("data"), check_vma=False)
got = np.asarray(jax.jit(f)(h2, w))
ref = np.asarray(moe.routed_ffn(h[jnp.array([0, T])], route_fn, w))
out["num_tokens"] = {"pad_rows_zero": bool(np.all(got[[1, 3]] == 0)),
                     "max_err": float(np.max(np.abs(got[[0, 2]] - ref))), "ref_max": float(np.max(np.abs(ref)))}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def ep_results():
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", _EP_WORKER], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("path", ["dense", "sparse"])
def test_expert_parallel_over_two_members_matches_one_device(ep_results, path):
    """Two members each holding 4 of 8 experts (local columns, ``first = axis_index * 4``),
    tokens whose choices all sit on one member included: the psum_scatter-ed sum equals the
    single-device result to float32 rounding."""
    assert ep_results[path]["max_err"] <= PATH_TOL, ep_results[path]["max_err"]
    assert np.max(np.abs(ep_results[path]["ref"])) > 0.1


def test_expert_parallel_padding_is_masked_on_every_member(ep_results):
    """``token_mask`` is gathered with the tokens: each member's pad tokens add exactly 0, the
    real ones match the unmasked single-device result."""
    r = ep_results["masked"]
    assert r["pads"] == 3 and r["pad_rows_zero"], r
    assert r["max_err"] <= PATH_TOL, r


def test_expert_parallel_routes_only_the_steps_tokens(ep_results):
    """``num_tokens`` under expert parallelism: each member's one-token step as two rows (the
    second NaN) gathers and routes only the tokens; the padding rows come out exactly 0, the
    tokens as the single-device call on them alone."""
    r = ep_results["num_tokens"]
    assert r["pad_rows_zero"] and r["ref_max"] > 0.1, r
    assert r["max_err"] <= PATH_TOL, r


@pytest.mark.parametrize("axis", [0, 1])
def test_row_padded_runs_one_row_as_two_off_the_cpu(monkeypatch, axis):
    """``row_padded`` (the sparse experts' and ``linear``'s one-row products): off the CPU a
    single row along ``axis`` runs as two (a zero row added) and the first comes back, equal to
    the unpadded product; more rows, or the CPU, run as they are. Planted: the slice taken on
    the wrong axis, or the zero row dropped, fails here."""
    from kvjax.models import attention

    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.standard_normal((4, 5)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((1, 1, 4)), jnp.float32)
    seen = []

    def f(a):
        seen.append(a.shape)
        return a @ w

    want = np.asarray(x @ w)
    assert np.array_equal(np.asarray(attention.row_padded(f, x, axis=axis)), want) and seen == [(1, 1, 4)]
    monkeypatch.setattr(attention.jax, "default_backend", lambda: "gpu")
    seen.clear()
    got = attention.row_padded(f, x, axis=axis)
    assert seen == [(2, 1, 4) if axis == 0 else (1, 2, 4)]
    assert got.shape == want.shape  # a two-row product may round its last bit differently
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)
    seen.clear()
    x3 = jnp.concatenate([x] * 3, axis=axis)
    assert attention.row_padded(f, x3, axis=axis).shape == np.asarray(x3 @ w).shape and len(seen[0]) == 3


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("backend", ["reference", "pallas_gpu"])
def test_shared_experts_in_the_grouped_launches(T, backend):
    """``shared`` (a gated dense MLP of width ``S * F``) adds, for every real token, what the MLP
    gives alone, read as ``S`` more experts of the routed experts' launches; padding adds 0.
    DeepSeek-V3's layer takes it on the kernel's path and matches its two-part form."""
    w = _weights(T, gated=True)
    r = np.random.default_rng(T + 5)
    S = 2
    shared = {"w_gate": jnp.asarray(r.standard_normal((D, S * F)) / 4, jnp.float32),
              "w_up": jnp.asarray(r.standard_normal((D, S * F)) / 4, jnp.float32),
              "w_down": jnp.asarray(r.standard_normal((S * F, D)) / 4, jnp.float32)}
    h = r.standard_normal((T, D)).astype(np.float32)
    idx, weight = _routing(T + 9, T)
    mask = np.arange(T) != 1  # the second token (where there is one) is padding
    got = moe.apply_experts(jnp.asarray(h), jnp.asarray(idx), jnp.asarray(weight), w, path="grouped",
                            backend=backend, token_mask=jnp.asarray(mask), shared=shared)
    alone = moe.apply_experts(jnp.asarray(h), jnp.asarray(idx), jnp.asarray(weight), w, path="grouped",
                              backend=backend, token_mask=jnp.asarray(mask))
    g, u, dn = (np.asarray(shared[n], np.float64) for n in ("w_gate", "w_up", "w_down"))
    v = h @ g
    mlp = (v / (1 + np.exp(-v)) * (h @ u)) @ dn
    want = np.asarray(alone) + np.where(mask[:, None], mlp, 0.0)
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=LOOP_TOL)
    with pytest.raises(ValueError, match="shared experts run on the grouped path"):
        moe.apply_experts(jnp.asarray(h), jnp.asarray(idx), jnp.asarray(weight), w, path="dense",
                          shared=shared)
    with pytest.raises(ValueError, match=r"shared\['w_down'\] must have shape \[48, 16\] .*got \[16, 48\]"):
        moe.apply_experts(jnp.asarray(h), jnp.asarray(idx), jnp.asarray(weight), w, path="grouped",
                          backend=backend, shared=dict(shared, w_down=shared["w_down"].T))


def test_deepseek_runs_its_shared_experts_in_the_grouped_launches(monkeypatch):
    """On the kernel's path (``pallas_gpu``, interpreted) DeepSeek-V3's MoE layer gives the shared
    experts to the routed experts' grouped launches; the result matches the reference backend's
    separate shared MLP, and without the kernel's path no ``shared`` reaches ``routed_ffn``."""
    c = ds.config_from_hf(dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, n_shared_experts=2,
        n_routed_experts=16, routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=16,
        qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=8, n_group=4, topk_group=2,
        num_experts_per_tok=3, first_k_dense_replace=1, max_position_embeddings=64))
    r = np.random.default_rng(3)
    f = lambda *s: jnp.asarray(r.standard_normal(s) / np.sqrt(s[-2] if len(s) > 1 else 1), jnp.float32)  # noqa: E731
    mp = {"router": f(32, 16), "bias": jnp.asarray(r.standard_normal(16) * 0.1, jnp.float32),
          "w_gate": f(16, 32, 16), "w_up": f(16, 32, 16), "w_down": f(16, 16, 32),
          "shared_gate": f(32, 32), "shared_up": f(32, 32), "shared_down": f(32, 32)}
    h = jnp.asarray(r.standard_normal((2, 32)), jnp.float32)
    seen = []
    real = moe.routed_ffn
    monkeypatch.setattr(ds, "routed_ffn", lambda *a, **k: seen.append(k.get("shared") is not None) or real(*a, **k))
    ref = ds._moe(mp, c, h, None, None, "reference")
    got = ds._moe(mp, c, h, None, None, "pallas_gpu")
    assert seen == [False, True]
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=0, atol=LOOP_TOL)


@pytest.mark.parametrize("bad, match", [
    # the [S * F, d] down matrix given as [d, S * F] (the same size: a reshape would take it)
    (lambda s: dict(s, w_down=s["w_down"].T), r"shared\['w_down'\] must have shape \[48, 16\]"),
    (lambda s: dict(s, w_gate=s["w_gate"][:-1]), r"shared\['w_gate'\] must have shape \[16, 48\]"),
    (lambda s: dict(s, w_up=s["w_up"].astype(jnp.bfloat16)), r"shared\['w_up'\] must have the experts' dtype float32"),
    (lambda s: {k: v for k, v in s.items() if k != "w_gate"}, "shared must be a dict of w_gate, w_up and w_down"),
])
@pytest.mark.parametrize("backend", ["reference", "pallas_gpu"])
def test_shared_experts_refuse_bad_matrices_by_name(bad, match, backend):
    r = np.random.default_rng(40)
    S = 2
    shared = {"w_gate": jnp.asarray(r.standard_normal((D, S * F)), jnp.float32),
              "w_up": jnp.asarray(r.standard_normal((D, S * F)), jnp.float32),
              "w_down": jnp.asarray(r.standard_normal((S * F, D)), jnp.float32)}
    h = r.standard_normal((2, D)).astype(np.float32)
    idx, weight = _routing(41, 2)
    with pytest.raises(ValueError, match=match):
        moe.apply_experts(jnp.asarray(h), jnp.asarray(idx), jnp.asarray(weight), _weights(42), path="grouped",
                          backend=backend, shared=bad(shared))


@pytest.mark.parametrize("path", ["dense", "sparse", "grouped"])
def test_no_tokens_on_every_path(path):
    """``T`` 0 gives ``[0, d]`` on every path (DeepSeek's reference-backend layer on an empty
    step takes the sparse path)."""
    y = moe.apply_experts(jnp.zeros((0, D), jnp.float32), jnp.zeros((0, K), jnp.int32), jnp.zeros((0, K), jnp.float32),
                          _weights(43), path=path, backend="pallas_gpu" if path == "grouped" else "reference")
    assert y.shape == (0, D)


@pytest.mark.parametrize("args, kw, match", [
    ((16, 3, 8), dict(routing="sigmoid"), r"MoESpec.routing must be one of \('softmax_topk', 'sigmoid_grouped'\)"),
    ((16, 3, 8), dict(activation="gelu"), r"MoESpec.activation must be one of \('silu', 'relu2'\), got 'gelu'"),
    ((16, 3, 8), dict(gated=1), "MoESpec.gated must be a bool, got 1"),
    ((16, 3, 0), {}, "MoESpec.hidden must be an int >= 1, got 0"),
    ((16, True, 8), {}, "MoESpec.top_k must be an int >= 1, got True"),
    ((16, 17, 8), {}, "MoESpec: top_k=17 must be <= num_experts=16"),
    ((16, 3, 8), dict(routed_scaling_factor=2.5), "norm_topk_prob must be True and routed_scaling_factor 1"),
    ((16, 3, 8), dict(norm_topk_prob=False), "norm_topk_prob must be True and routed_scaling_factor 1"),
    ((16, 3, 8), dict(routing="sigmoid_grouped", n_group=3), "num_experts=16 must split into n_group=3 groups"),
    ((16, 3, 8), dict(routing="sigmoid_grouped", n_group=4, topk_group=2, routed_scaling_factor=0.0),
     "MoESpec: routed_scaling_factor must be a finite number > 0, got 0.0"),
    ((16, 3, 8), dict(routing="sigmoid_grouped", norm_topk_prob=None), "MoESpec: norm_topk_prob must be a bool"),
])
def test_a_spec_the_model_could_not_run_as_written_is_refused(args, kw, match):
    """A routing name that is not one (it had run as sigmoid_grouped), and a softmax spec with a
    scale or without renormalising (ignored before), among others: refused by field name."""
    with pytest.raises(ValueError, match=match):
        moe.MoESpec(*args, **kw)
    assert moe.MoESpec(16, 3, 8, routing="sigmoid_grouped", n_group=4, topk_group=2, routed_scaling_factor=2.5,
                       norm_topk_prob=False, gated=False, activation="relu2").num_experts == 16
