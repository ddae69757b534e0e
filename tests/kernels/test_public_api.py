"""Every public name imports from the package top level, and every op runs once (reference)."""

from __future__ import annotations

import dataclasses
import importlib

import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels

OPS = (
    "causal_conv1d_update",
    "causal_conv1d_varlen",
    "combine_sampled_and_draft_tokens",
    "concat_and_cache_mla",
    "grouped_matmul",
    "moe_route",
    "paged_attention",
    "ragged_paged_attention",
    "reshape_and_cache_flash",
    "selective_scan_varlen",
    "selective_state_update",
    "write_kv_pages",
    "zero_blocks",
)
CONFIGS = ("ConvConfig", "GroupedMatmulConfig", "KVWriteConfig", "MoERouteConfig", "PagedAttentionConfig",
           "SSUConfig", "ZeroBlocksConfig")
HELPERS = ("group_tiles",)  # public functions that are not ops


def _calls():
    """One tiny call per op, with the reference backend; each returns arrays."""
    f32 = np.float32
    one = np.ones
    idx = np.array([1], np.int32)
    return {
        "reshape_and_cache_flash": lambda f: f(
            one((1, 1, 2), f32), one((1, 1, 2), f32), np.zeros((2, 2, 1, 2), f32),
            np.zeros((2, 2, 1, 2), f32), np.array([2], np.int32), backend="reference"),
        "concat_and_cache_mla": lambda f: f(
            one((1, 2), f32), one((1, 1), f32), np.zeros((2, 2, 3), f32),
            np.array([2], np.int32), backend="reference"),
        "write_kv_pages": lambda f: f(
            one((1, 1, 2), f32), one((1, 1, 2), f32), np.zeros((2, 2, 2, 2), f32),
            np.array([2], np.int32), backend="reference"),
        "zero_blocks": lambda f: f([one((2, 2), f32)], idx, backend="reference"),
        "ragged_paged_attention": lambda f: f(
            one((1, 1, 2), f32), one((2, 2, 2, 2), f32), np.array([1], np.int32),
            np.array([[1]], np.int32), np.array([0, 1], np.int32), np.array([1], np.int32),
            backend="reference"),
        "grouped_matmul": lambda f: f(one((2, 2), f32), one((1, 2, 3), f32), np.array([0], np.int32),
                                      tile_rows=2, backend="reference"),
        "moe_route": lambda f: f(one((1, 2), f32), one((2, 4), f32), top_k=2, scoring="softmax",
                                 backend="reference"),
        "paged_attention": lambda f: f(
            one((1, 1, 2), f32), one((2, 2, 1, 2), f32), one((2, 2, 1, 2), f32), np.array([[1]], np.int32),
            np.array([1], np.int32), np.array([0], np.int32), np.array([0], np.int32), backend="reference"),
        "selective_state_update": lambda f: f(
            np.zeros((2, 1, 1, 2), f32), one((1, 1, 1), f32), one((1, 1, 1), f32),
            -one((1, 1, 1), f32), one((1, 1, 2), f32), one((1, 1, 2), f32),
            state_batch_indices=idx, backend="reference"),
        "causal_conv1d_update": lambda f: f(
            one((1, 2), f32), np.zeros((2, 2, 3), f32), one((2, 4), f32),
            conv_state_indices=idx, backend="reference"),
        "selective_scan_varlen": lambda f: f(
            one((2, 1, 1), f32), one((2, 1), f32), -one((1,), f32), one((2, 1, 2), f32),
            one((2, 1, 2), f32), np.zeros((2, 1, 1, 2), f32), np.array([0, 2], np.int32), idx,
            np.array([False]), backend="reference"),
        "causal_conv1d_varlen": lambda f: f(
            one((2, 2), f32), one((2, 4), f32), None, np.zeros((2, 2, 3), f32),
            np.array([0, 2], np.int32), idx, np.array([False]), backend="reference"),
        "combine_sampled_and_draft_tokens": lambda f: f(
            np.zeros((2,), np.int32), np.array([0], np.int32), np.array([7], np.int32),
            np.array([0, 2], np.int32), np.array([5], np.int32), np.array([3], np.int32),
            np.zeros((1, 0), np.int32), np.array([0, 1], np.int32), 1, backend="reference"),
    }


def test_all_lists_every_public_name():
    assert set(pallas_kernels.__all__) == (set(OPS) | set(CONFIGS) | set(HELPERS)
                                           | {"NULL_BLOCK_ID", "PAD_SLOT_ID"})
    mod = importlib.import_module("pallas_kernels")
    for name in pallas_kernels.__all__:
        assert getattr(mod, name) is not None, name


@pytest.mark.parametrize("name", OPS)
def test_every_op_runs_from_the_top_level(name):
    fn = getattr(importlib.import_module("pallas_kernels"), name)
    out = _calls()[name](fn)
    leaves = out if isinstance(out, (tuple, list)) else (out,)
    assert leaves and all(isinstance(jnp.asarray(x), jnp.ndarray) for x in leaves)


def test_known_values_of_the_calls():
    from pallas_kernels import combine_sampled_and_draft_tokens, reshape_and_cache_flash

    calls = _calls()
    k, _ = calls["reshape_and_cache_flash"](reshape_and_cache_flash)
    assert np.asarray(k)[1, 0].tolist() == [[1.0, 1.0]] and not np.asarray(k)[0].any()
    ids, li = calls["combine_sampled_and_draft_tokens"](combine_sampled_and_draft_tokens)
    assert np.asarray(ids).tolist() == [0, 7] and np.asarray(li).tolist() == [1]


@pytest.mark.parametrize("name", CONFIGS)
def test_configs_are_frozen_and_hashable(name):
    cls = getattr(pallas_kernels, name)
    cfg = cls()
    assert hash(cfg) == hash(cls())
    field = dataclasses.fields(cls)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(cfg, field, 1)


def test_sentinels():
    assert pallas_kernels.PAD_SLOT_ID == -1 and pallas_kernels.NULL_BLOCK_ID == 0
