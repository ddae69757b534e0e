"""``moe_route``: the routing rule (``select_experts``), the GPU kernel in interpret mode against
the reference, its CUDA lowering, and argument errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.moe_route import MoERouteConfig, moe_route, select_experts
from tests.cuda_lowering import lower_for_cuda
from tests.kernels.test_gpu_launches import outside_ops


def _inputs(seed, T, d, E, xdt, rdt, bias):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((T, d)), xdt)
    r = jnp.asarray(rng.standard_normal((d, E)) / np.sqrt(d), rdt)
    b = jnp.asarray(rng.standard_normal(E) * 0.1, jnp.float32) if bias else None
    return x, r, b


f32, bf16 = jnp.float32, jnp.bfloat16

# (T, d, E, x dtype, router dtype, bias, rule, split)
CASES = [
    (1, 256, 64, f32, bf16, True, dict(top_k=6, scoring="sigmoid"), None),  # DeepSeek-V2-Lite-like
    (3, 200, 64, f32, bf16, True, dict(top_k=6, scoring="sigmoid", n_group=8, topk_group=3,
                                       scale=2.5), 4),
    (20, 128, 16, bf16, bf16, False, dict(top_k=4, scoring="sigmoid", n_group=4, topk_group=2,
                                          renormalize=False), 1),
    (5, 96, 24, bf16, f32, False, dict(top_k=3, scoring="softmax"), None),
    (17, 64, 256, f32, f32, True, dict(top_k=8, scoring="sigmoid", n_group=8, topk_group=4), 2),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_kernel_matches_the_reference(case):
    T, d, E, xdt, rdt, bias, rule, split = CASES[case]
    x, r, b = _inputs(case, T, d, E, xdt, rdt, bias)
    i0, w0 = moe_route(x, r, b, backend="reference", **rule)
    cfg = MoERouteConfig(gpu_split=split, gpu_max_tokens=64)
    i1, w1 = moe_route(x, r, b, backend="pallas_gpu", interpret=True, config=cfg, **rule)
    assert i1.dtype == jnp.int32 and w1.dtype == jnp.float32 and i1.shape == w1.shape == (T, rule["top_k"])
    np.testing.assert_array_equal(np.asarray(i1), np.asarray(i0))
    np.testing.assert_allclose(np.asarray(w1), np.asarray(w0), rtol=2e-6, atol=1e-7)


def test_reference_product_is_float32_of_the_widened_operands():
    x, r, b = _inputs(0, 4, 64, 16, f32, bf16, True)
    rule = dict(top_k=3, scoring="sigmoid", n_group=4, topk_group=2, scale=2.0)
    logits = np.asarray(x, np.float64) @ np.asarray(r.astype(f32), np.float64)
    i0, w0 = select_experts(jnp.asarray(logits, f32), b, **rule)
    i1, w1 = moe_route(x, r, b, backend="reference", **rule)
    np.testing.assert_array_equal(np.asarray(i1), np.asarray(i0))
    np.testing.assert_allclose(np.asarray(w1), np.asarray(w0), rtol=1e-6)


def _numpy_rule(logits, bias, *, top_k, scoring, n_group=1, topk_group=1, renormalize=True, scale=1.0):
    """The module docstring's rule, one token at a time in float64 (ties to the lower index)."""
    idx, wts = [], []
    for row in np.asarray(logits, np.float64):
        if scoring == "softmax":
            order = sorted(range(len(row)), key=lambda e: (-row[e], e))[:top_k]
            v = np.exp(row[order] - row[order[0]])
            idx.append(order)
            wts.append(v / v.sum())
            continue
        scores = 1 / (1 + np.exp(-row))
        choice = scores + (0 if bias is None else np.asarray(bias, np.float64))
        per = len(row) // n_group
        gs = [sum(sorted(choice[g * per:(g + 1) * per], reverse=True)[:2]) for g in range(n_group)]
        groups = sorted(range(n_group), key=lambda g: (-gs[g], g))[:topk_group]
        cand = [e for e in range(len(row)) if e // per in groups]
        order = sorted(cand, key=lambda e: (-choice[e], e))[:top_k]
        w = scores[order]
        if renormalize:
            w = w / (w.sum() + 1e-20)
        idx.append(order)
        wts.append(w * scale)
    return np.array(idx), np.array(wts)


@pytest.mark.parametrize("rule", [
    dict(top_k=2, scoring="softmax"),
    dict(top_k=3, scoring="sigmoid"),
    dict(top_k=3, scoring="sigmoid", n_group=4, topk_group=2, scale=2.5),
    dict(top_k=4, scoring="sigmoid", n_group=2, topk_group=1, renormalize=False),
    dict(top_k=2, scoring="sigmoid", n_group=4, topk_group=2, bias=False),  # groups tie in row 1
])
def test_select_experts_is_the_documented_rule(rule):
    rule = dict(rule)
    with_bias = rule.pop("bias", True) and rule["scoring"] == "sigmoid"
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((6, 16)).astype(np.float32)
    logits[0, [3, 9]] = 2.0  # a tie between two experts: the lower wins
    logits[1, :] = 0.5  # every expert tied (and every group)
    bias = (rng.standard_normal(16) * 0.1).astype(np.float32) if with_bias else None
    i_ref, w_ref = _numpy_rule(logits, bias, **rule)
    b = None if bias is None else jnp.asarray(bias)
    got = {"select_experts": select_experts(jnp.asarray(logits), b, **rule),
           # the kernel, its logits through an identity router (exact)
           "kernel": moe_route(jnp.asarray(logits), jnp.eye(16, dtype=f32), b, backend="pallas_gpu",
                               interpret=True, config=MoERouteConfig(gpu_max_tokens=8), **rule)}
    for name, (i, w) in got.items():
        np.testing.assert_array_equal(np.asarray(i), i_ref, err_msg=name)
        np.testing.assert_allclose(np.asarray(w), w_ref, rtol=1e-6, err_msg=name)


def test_large_calls_run_the_reference_on_the_gpu_flavour():
    x, r, b = _inputs(2, 8, 512, 16, f32, bf16, True)  # d over 4 splits: two kernels
    rule = dict(top_k=2, scoring="sigmoid")

    def call(cfg):
        return lambda x, r, b: moe_route(x, r, b, backend="pallas_gpu", interpret=False, config=cfg, **rule)

    assert outside_ops(jax.make_jaxpr(call(MoERouteConfig(gpu_max_tokens=8)))(x, r, b))["pallas_call"] == 2
    assert outside_ops(jax.make_jaxpr(call(MoERouteConfig(gpu_max_tokens=4)))(x, r, b))["pallas_call"] == 0


@pytest.mark.parametrize("T, split, kernels", [(1, None, 2), (3, 1, 1), (40, 4, 2)])
def test_lowers_for_cuda(T, split, kernels, verified_triton_modules):
    x, r, b = _inputs(3, T, 512, 64, f32, bf16, True)
    cfg = MoERouteConfig(gpu_split=split, gpu_max_tokens=64)
    fn = lambda x, r, b: moe_route(x, r, b, top_k=6, scoring="sigmoid", n_group=8, topk_group=4,  # noqa: E731
                                   backend="pallas_gpu", interpret=False, config=cfg)
    lower_for_cuda(fn, x, r, b)
    assert len(verified_triton_modules) == kernels


@pytest.mark.parametrize("kw, match", [
    (dict(scoring="top"), r"scoring must be one of \('softmax', 'sigmoid'\), got 'top'"),
    (dict(top_k=0), "top_k must be an int >= 1, got 0"),
    (dict(top_k=17), "top_k=17 must be <= num_experts=16"),
    (dict(n_group=3), "num_experts=16 must split into n_group=3 groups of at least 2 experts"),
    (dict(n_group=16, topk_group=8), "num_experts=16 must split into n_group=16 groups of at least 2"),
    (dict(n_group=4, topk_group=5), "topk_group=5 must be <= n_group=4"),
    (dict(n_group=4, topk_group=1, top_k=5), "top_k=5 exceeds the 4 experts of topk_group=1 groups"),
    (dict(scoring="softmax", bias=True), "bias is for scoring='sigmoid', got it with scoring='softmax'"),
    (dict(scoring="softmax", n_group=2), "softmax scoring has no expert groups: n_group and topk_group"),
    (dict(renormalize=1), "renormalize must be a bool, got 1"),
    (dict(scale=float("nan")), "scale must be a finite number > 0, got nan"),
    (dict(scale="2"), "scale must be a finite number > 0, got '2'"),
    (dict(scale=0.0), "scale must be a finite number > 0, got 0.0"),
    (dict(scale=-2.5), "scale must be a finite number > 0, got -2.5"),
    (dict(router_shape=(32, 16)), r"router must have shape \[16, 16\], got \[32, 16\]"),
    (dict(bias_shape=(15,)), r"bias must have shape \[16\], got \[15\]"),
    (dict(x_dtype=jnp.int32), "x must have dtype"),
])
def test_bad_arguments_name_themselves(kw, match):
    T, d, E = 2, 16, 16
    args = dict(top_k=2, scoring="sigmoid")
    args.update({k: v for k, v in kw.items() if k not in ("bias", "router_shape", "bias_shape", "x_dtype")})
    x = jnp.zeros((T, d), kw.get("x_dtype", f32))
    r = jnp.zeros(kw.get("router_shape", (d, E)), f32)
    b = jnp.zeros(kw.get("bias_shape", (E,)), f32) if kw.get("bias", True) and args["scoring"] != "softmax" \
        or kw.get("bias") else None
    with pytest.raises(ValueError, match=match):
        moe_route(x, r, b, **args)
    if "x_dtype" not in kw and "router_shape" not in kw:  # the rule's owner refuses the same
        with pytest.raises(ValueError, match=match):
            select_experts(jnp.zeros((T, E), f32), b, **args)


@pytest.mark.parametrize("kw, match", [
    (dict(gpu_split=3), "gpu_split must be a power of two or None, got 3"),
    (dict(gpu_split=0), "gpu_split must be a power of two or None, got 0"),
    (dict(gpu_max_tokens=0), "gpu_max_tokens must be an int >= 1, got 0"),
    (dict(gpu_max_tokens=True), "gpu_max_tokens must be an int >= 1, got True"),
])
def test_bad_config_names_itself(kw, match):
    with pytest.raises(ValueError, match=match):
        MoERouteConfig(**kw)


def test_split_product_is_exact_to_float32_sums():
    """A float32 ``x`` meets a bfloat16 router as three bfloat16 parts: every product exact, so
    the result is the float64 product to float32 accumulation (two parts would be 16 bits)."""
    from pallas_kernels.moe_route import _product_terms

    rng = np.random.default_rng(4)
    a = jnp.asarray(rng.standard_normal((16, 128)), f32)
    b = jnp.asarray(rng.standard_normal((128, 64)), bf16)
    want = np.asarray(a, np.float64) @ np.asarray(b.astype(f32), np.float64)
    got = np.asarray(_product_terms(a, b, interpret=True), np.float64)
    assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max()


def _route_row(row, bias, backend, **rule):
    """``moe_route`` of one token whose logits are ``row`` exactly (``d`` 1: ``1 * row``, no
    ``0 * inf`` terms), ``bias`` optional."""
    x, r = jnp.ones((1, 1), f32), jnp.asarray([row], f32)
    b = None if bias is None else jnp.asarray(bias, f32)
    i, w = moe_route(x, r, b, backend=backend, interpret=True if backend == "pallas_gpu" else None,
                     config=MoERouteConfig(gpu_max_tokens=8), **rule)
    return np.asarray(i)[0], np.asarray(w)[0]


inf, nan = np.inf, np.nan


@pytest.mark.parametrize("row, bias, rule, same", [
    # -inf candidates rank below the finite ones, ties to the lower expert: as the reference
    ([0, -inf, -inf, 2, -inf], None, dict(top_k=3, scoring="softmax"), True),
    ([-inf] * 5, None, dict(top_k=2, scoring="softmax"), True),
    ([0.0] * 8, [0, -inf, -inf, -inf, -inf, -inf, -inf, -inf], dict(top_k=3, scoring="sigmoid"), True),
    ([0.0] * 8, [0, -inf, -inf, -inf, -inf, -inf, -inf, 1], dict(top_k=3, scoring="sigmoid", n_group=4,
                                                                topk_group=2), True),
    # NaN: the choice is unspecified, but still k distinct experts in [0, E)
    ([nan, 0, 1, 2, 3], None, dict(top_k=2, scoring="softmax"), False),
    ([0, 1, nan, 2, 3, 4], None, dict(top_k=2, scoring="sigmoid", n_group=3, topk_group=2), False),
    ([nan] * 16, None, dict(top_k=4, scoring="sigmoid"), False),
    ([0.0] * 5, [0, nan, 0, 0, 0], dict(top_k=3, scoring="sigmoid"), False),
])
def test_kernel_names_distinct_experts_on_non_finite_values(row, bias, rule, same):
    """The module docstring's non-finite rule: the kernel names neither a padding lane
    (``>= E``) for a NaN row nor one lane twice once the finite candidates run out."""
    E = len(row)
    i1, _ = _route_row(row, bias, "pallas_gpu", **rule)
    assert len(set(i1.tolist())) == rule["top_k"] and all(0 <= e < E for e in i1), i1
    if same:
        i0, w0 = _route_row(row, bias, "reference", **rule)
        np.testing.assert_array_equal(i1, i0)


def test_kernel_flavour_takes_a_zero_width_input():
    """``d`` 0 (every logit 0): the GPU flavour gives the reference's answer."""
    x, r = jnp.zeros((2, 0), f32), jnp.zeros((0, 6), bf16)
    rule = dict(top_k=2, scoring="sigmoid", n_group=3, topk_group=2)
    i0, w0 = moe_route(x, r, backend="reference", **rule)
    i1, w1 = moe_route(x, r, backend="pallas_gpu", interpret=True, config=MoERouteConfig(gpu_max_tokens=8), **rule)
    np.testing.assert_array_equal(np.asarray(i1), np.asarray(i0))
    np.testing.assert_array_equal(np.asarray(w1), np.asarray(w0))


@pytest.mark.parametrize("kw, match", [
    (dict(scale="2"), "scale must be a finite number"),
    (dict(scale=True), "scale must be a finite number"),
    (dict(scale=None), "scale must be a finite number"),
    (dict(scoring="softmax", renormalize=False), "renormalize must be True and scale 1"),
    (dict(scoring="softmax", scale=2.5), "renormalize must be True and scale 1"),
])
def test_rule_arguments_are_not_silently_taken(kw, match):
    """``scale`` is a number (not a string, a bool or None); softmax scoring has no
    ``renormalize`` / ``scale``, refused by name rather than ignored."""
    args = dict(dict(top_k=2, scoring="sigmoid"), **kw)
    for fn in (lambda: moe_route(jnp.zeros((2, 4), f32), jnp.zeros((4, 8), f32), **args),
               lambda: select_experts(jnp.zeros((2, 8), f32), **args)):
        with pytest.raises(ValueError, match=match):
            fn()


@pytest.mark.parametrize("scoring, bias, match", [
    ("softmax", np.arange(8.0), "bias is for scoring='sigmoid'"),
    ("sigmoid", np.ones(1), r"bias must have shape \[8\]"),
    ("sigmoid", np.arange(8.0)[None], "bias must have rank 1"),
])
def test_select_experts_checks_its_bias(scoring, bias, match):
    """``select_experts``' ``bias`` is checked as ``moe_route``'s: refused under softmax and in
    any shape but ``[E]``."""
    with pytest.raises(ValueError, match=match):
        select_experts(jnp.zeros((2, 8), f32), jnp.asarray(bias, f32), top_k=2, scoring=scoring)
