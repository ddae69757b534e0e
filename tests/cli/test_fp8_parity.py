"""Issue 25 item 6: the fp8 parity check passes a rounding flip and fails a genuine bug.

The paged path and the dense reference compute each K/V value with float32 operations in a
different order, so a value within a few float32 ulps of an fp8 rounding boundary can be stored
one fp8 step apart on the two sides. Such a flip moved logits 3.49e-3 in a correct demo run,
against the old fixed fp8 tolerance of 2e-3 (:mod:`kvjax.testing.fp8_rounding`).

Here the "paged" side is the dense reference with its fp8 round trip edited (traced afresh with
``kvjax.models.dense._fp8_round_trip`` replaced), decoding greedily: one K element placed 2^-21
(relative) above a rounding midpoint (through ``k_scale``) and computed 2^-20 lower, as a
different summation order can, for the flip; a wrong block's K/V, a wrong V scale and one
element one fp8 step off far from any boundary for the bugs.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kvjax.cli import demo
from kvjax.host.scheduler import Request
from kvjax.models import TinyHybridConfig, TinyHybridModel
from kvjax.models import dense as dense_mod
from kvjax.runner import RunnerConfig
from tests.fake_runner import FakeRunner

L = 64  # every forward runs on L tokens (causal: the zero tail changes nothing before it)
PROMPT_LEN, NEW = 24, 14
FLIP = (8, 0, 3)  # layer 0 K: position, KV head, dim: the element the float32 noise flips
OFF = (13, 1, 6)  # an element at least a quarter fp8 step from any boundary (asserted)
_ROUND_TRIP = dense_mod._fp8_round_trip
_FP8 = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
_POSITIVE = np.sort(_FP8[np.isfinite(_FP8) & (_FP8 > 0)])


def dense_with(edit, params, config):
    """``tokens -> logits``: the dense fp8 forward with each fp8 round trip replaced by
    ``edit(call, x, scale)`` (calls in order: layer 0 K, layer 0 V, layer 2 K, layer 2 V)."""

    def fwd(p, toks):
        calls = iter(range(100))
        dense_mod._fp8_round_trip = lambda x, s: edit(next(calls), x, s)
        try:
            return dense_mod.dense_forward.__wrapped__(p, config, toks, "fp8")
        finally:
            dense_mod._fp8_round_trip = _ROUND_TRIP

    return jax.jit(lambda toks: fwd(params, toks))


def decode(fwd, prompt, n, req_id):
    """Greedy decoding of ``n`` tokens through ``fwd``, as a finished Request with its logits."""
    toks = np.zeros(L, np.int32)
    toks[: len(prompt)] = prompt
    req = Request(req_id, list(prompt), n, 0)
    for i in range(n):
        with jax.default_matmul_precision("highest"):
            row = np.asarray(fwd(jnp.asarray(toks)))[len(prompt) + i - 1]
        req.output.append(int(row.argmax()))
        req.logits.append(row)
        toks[len(prompt) + i] = req.output[-1]
    return req


def _margin(v: float) -> float:
    """Relative distance of |v| from the nearest fp8 rounding midpoint."""
    i = np.searchsorted(_POSITIVE, abs(v))
    mid = (_POSITIVE[i - 1] + _POSITIVE[i]) / 2
    return abs(abs(v) - mid) / abs(v)


@pytest.fixture(scope="module")
def setup():
    base = TinyHybridConfig()
    params = TinyHybridModel(base).init_params(0)
    prompt = np.random.default_rng(1).integers(0, 256, PROMPT_LEN).tolist()
    seen = {}

    def record(i, x, s):
        jax.debug.callback(lambda v, i=i: seen.__setitem__(i, np.asarray(v)), x)
        return _ROUND_TRIP(x, s)

    toks = np.zeros(L, np.int32)
    toks[:PROMPT_LEN] = prompt
    jax.block_until_ready(dense_with(record, params, base)(jnp.asarray(toks)))
    k0 = np.asarray(seen[0])  # layer 0 K, independent of k_scale (no fp8 rounding before it)
    # k_scale puts FLIP's element 2^-21 (relative) above a rounding midpoint.
    a = abs(float(k0[FLIP]))
    i = np.searchsorted(_POSITIVE, a)
    mid = (_POSITIVE[i - 1] + _POSITIVE[i]) / 2
    config = dataclasses.replace(base, k_scale=float(a / (mid * (1 + 2.0 ** -21))))
    assert _margin(float(k0[OFF]) / config.k_scale) > 0.25 * 2.0 ** -4  # far from any boundary
    runner_config = RunnerConfig(model=config, kv_cache_dtype="fp8", max_model_len=L)
    runner = FakeRunner(runner_config.model, params, runner_config)
    return runner, runner_config, params, config, prompt


def check(setup, edit, req_id):
    runner, runner_config, params, config, prompt = setup
    req = decode(dense_with(edit, params, config), prompt, NEW, req_id)
    results, nan_count = demo.check_against_reference(runner, runner_config, [req])
    assert nan_count == 0
    return results[req_id]


def test_a_rounding_flip_matches_but_moves_logits_past_the_old_fixed_tolerance(setup):
    def flip(i, x, s):  # the element is computed 2^-20 lower, as float32 summation order can
        return _ROUND_TRIP(x.at[FLIP].multiply(1 - 2.0 ** -20) if i == 0 else x, s)

    res = check(setup, flip, "flip")
    assert res["max_logit_error"] > 2e-3, res  # the old LOGITS_ATOL_FP8 failed such a run
    assert res["matches_reference"], res
    assert res["fp8_rounding_rows"] > 0 and res["max_logit_error_vs_match"] <= demo.LOGITS_ATOL, res


def _wrong_block(i, x, s):  # layer 0 K/V of positions 8-15 read from positions 0-7
    return _ROUND_TRIP(x.at[8:16].set(x[0:8]) if i in (0, 1) else x, s)


def _wrong_scale(i, x, s):  # layer 2 V dequantised with a scale 1% off
    return _ROUND_TRIP(x, s) * (1.01 if i == 3 else 1.0)


def _one_step_off(i, x, s):  # one K element stored one fp8 step up, far from any boundary
    y = _ROUND_TRIP(x, s)
    if i != 0:
        return y
    v = y[OFF] / s
    up = jnp.asarray(_POSITIVE)[jnp.searchsorted(jnp.asarray(_POSITIVE), jnp.abs(v), side="right")]
    return y.at[OFF].set(jnp.sign(v) * up * s)


@pytest.mark.parametrize("bug", [_wrong_block, _wrong_scale, _one_step_off], ids=lambda f: f.__name__[1:])
def test_a_genuine_bug_does_not_match(setup, bug):
    res = check(setup, bug, bug.__name__)
    assert not res["matches_reference"], res
    if bug is _one_step_off:  # flip-sized: a fixed tolerance wide enough for flips passes it
        assert res["max_logit_error"] < 0.05, res
