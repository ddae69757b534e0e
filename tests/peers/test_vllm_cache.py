"""vLLM's KV-cache write tests, ported onto kvjax's ``reshape_and_cache_flash`` and
``concat_and_cache_mla``.

Source: vllm-project/vllm, ``tests/kernels/test_cache.py`` at commit
f057ecb1f68707107131c3acef1e50ae343853e3 (``test_reshape_and_cache_flash``,
``test_concat_and_cache_mla``). The test logic is re-written here; no peer code is
copied. vLLM's other tests in that file (copy / swap / gather blocks, fp8 conversion,
the non-flash layout) test ops kvjax does not have.

Kept: 42 tokens at distinct random slots (``random.sample`` over every slot: block 0
included, an ordinary block for these slot-level ops), 8 heads, head sizes 64 / 80 /
120 / 256, block sizes 8 / 16 / 32, dtypes half / bf16 / float, ``kv_cache_dtype``
``"auto"`` / ``"fp8"`` (float8_e4m3fn, per-tensor scales ``amax / 64``), caches filled
with random values first, the per-token reference and the assertions: exact
(``torch.testing.assert_close`` defaults) for ``"auto"``, dequantised caches within
``atol=0.001, rtol=0.1`` for fp8. MLA: kv_lora_rank 512, rope dim 64, 42 tokens, block
size 16, 8 blocks, scale 0.1, the same assertions. kvjax returns the caches instead of
writing them in place.

Sized for CI: vLLM's ``NUM_BLOCKS = [1024, 10000]`` becomes 64 blocks in CI, with 6
cases of the product covering every head size, block size and (dtype,
kv_cache_dtype) pair, and MLA runs half / fp8, bf16 / auto and float / fp8; the whole
product at 64 and 1024 blocks runs with ``KVJAX_PEER_SLOW=1`` (10000 blocks, 2.6 GB
per float cache, is left out), as do the interpreted Pallas flavours.
"""

from __future__ import annotations

import itertools
import random

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

from _flavours import flavours, slow
from pallas_kernels import concat_and_cache_mla, reshape_and_cache_flash

FP8 = ml_dtypes.float8_e4m3fn
DTYPES = {"half": np.float16, "bfloat16": ml_dtypes.bfloat16, "float": np.float32}
NUM_TOKENS, NUM_HEADS = 42, 8
HEAD_SIZES, BLOCK_SIZES = [64, 80, 120, 256], [8, 16, 32]
KV_CACHE_DTYPES = ["auto", "fp8"]


def flash_cases():
    """CI: 6 cases, every head size, block size and (dtype, kv_cache_dtype) pair at least
    once; the rest of the product (and 1024 blocks) behind the slow switch."""
    dtypes = list(DTYPES)
    ci = {
        (HEAD_SIZES[i % 4], BLOCK_SIZES[i % 3], dtypes[i % 3], KV_CACHE_DTYPES[(i // 3) % 2])
        for i in range(6)
    }
    for head, block, num_blocks, dtype, kvd in itertools.product(
        HEAD_SIZES, BLOCK_SIZES, (64, 1024), dtypes, KV_CACHE_DTYPES
    ):
        args = (head, block, num_blocks, dtype, kvd)
        yield pytest.param(*args) if num_blocks == 64 and (head, block, dtype, kvd) in ci else slow(*args)


def to_torch(a):
    a = np.asarray(a)
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16)
    return torch.from_numpy(np.array(a))


def dequant_half(fp8_cache, scale):
    """vLLM's ``convert_fp8`` to float16: the stored value times the scale."""
    return to_torch((np.asarray(fp8_cache).astype(np.float32) * np.float32(scale)).astype(np.float16))


def quant_fp8(x, scale):
    """saturate(x / scale), rounded to nearest even: vLLM's documented fp8 rule."""
    return np.clip(np.asarray(x, np.float32) / np.float32(scale), -448.0, 448.0).astype(FP8)


def random_cache(rng, shape, dtype, kv_cache_dtype, head_size):
    scale = head_size ** -0.5  # vLLM's cache factories fill with uniform(-scale, scale)
    values = rng.uniform(-scale, scale, shape).astype(np.float32)
    return values.astype(FP8) if kv_cache_dtype == "fp8" else values.astype(dtype)


@pytest.mark.parametrize("backend", flavours("pallas_tpu", "pallas_gpu"))
@pytest.mark.parametrize("head_size, block_size, num_blocks, dtype, kv_cache_dtype", flash_cases())
def test_reshape_and_cache_flash(head_size, block_size, num_blocks, dtype, kv_cache_dtype, backend):
    seed = 0
    random.seed(seed)
    rng = np.random.default_rng(seed)
    dt = DTYPES[dtype]
    slot_mapping = np.asarray(random.sample(range(block_size * num_blocks), NUM_TOKENS), np.int64)
    qkv = rng.standard_normal((NUM_TOKENS, 3, NUM_HEADS, head_size)).astype(dt)
    key, value = qkv[:, 1], qkv[:, 2]
    shape = (num_blocks, block_size, NUM_HEADS, head_size)
    key_cache = random_cache(rng, shape, dt, kv_cache_dtype, head_size)
    value_cache = random_cache(rng, shape, dt, kv_cache_dtype, head_size)
    k_scale = np.float32(np.max(key.astype(np.float32)) / 64.0)
    v_scale = np.float32(np.max(value.astype(np.float32)) / 64.0)

    if kv_cache_dtype == "fp8":
        cloned_key, cloned_value = dequant_half(key_cache, k_scale), dequant_half(value_cache, v_scale)
    else:
        cloned_key, cloned_value = to_torch(key_cache).clone(), to_torch(value_cache).clone()

    kc, vc = reshape_and_cache_flash(
        jnp.asarray(key), jnp.asarray(value), jnp.asarray(key_cache), jnp.asarray(value_cache),
        slot_mapping, kv_cache_dtype, jnp.asarray(k_scale), jnp.asarray(v_scale), backend=backend,
    )

    for i, slot in enumerate(slot_mapping.tolist()):
        block_idx, block_offset = slot // block_size, slot % block_size
        cloned_key[block_idx, block_offset] = to_torch(key[i])
        cloned_value[block_idx, block_offset] = to_torch(value[i])

    if kv_cache_dtype == "fp8":
        torch.testing.assert_close(dequant_half(kc, k_scale), cloned_key, atol=0.001, rtol=0.1)
        torch.testing.assert_close(dequant_half(vc, v_scale), cloned_value, atol=0.001, rtol=0.1)
    else:
        torch.testing.assert_close(to_torch(kc), cloned_key)
        torch.testing.assert_close(to_torch(vc), cloned_value)


def mla_cases():
    for i, (dtype, kvd) in enumerate(itertools.product(DTYPES, KV_CACHE_DTYPES)):
        yield pytest.param(dtype, kvd) if i in (1, 2, 5) else slow(dtype, kvd)


@pytest.mark.parametrize("backend", flavours("pallas_tpu", "pallas_gpu"))
@pytest.mark.parametrize("dtype, kv_cache_dtype", mla_cases())
def test_concat_and_cache_mla(dtype, kv_cache_dtype, backend):
    kv_lora_rank, rope_dim, num_tokens, block_size, num_blocks = 512, 64, 42, 16, 8
    seed = 0
    random.seed(seed)
    rng = np.random.default_rng(seed)
    dt = DTYPES[dtype]
    slot_mapping = np.asarray(random.sample(range(num_blocks * block_size), num_tokens), np.int64)
    kv_c = rng.standard_normal((num_tokens, kv_lora_rank)).astype(dt)
    k_pe = rng.standard_normal((num_tokens, rope_dim)).astype(dt)
    entry = kv_lora_rank + rope_dim
    scale = np.float32(0.1)
    kv_cache = np.zeros((num_blocks, block_size, entry), FP8 if kv_cache_dtype == "fp8" else dt)

    ref_temp = np.zeros((num_blocks, block_size, entry), dt)
    for i, slot in enumerate(slot_mapping.tolist()):
        ref_temp[slot // block_size, slot % block_size, :kv_lora_rank] = kv_c[i]
        ref_temp[slot // block_size, slot % block_size, kv_lora_rank:] = k_pe[i]
    ref_cache = quant_fp8(ref_temp, scale) if kv_cache_dtype == "fp8" else ref_temp

    got = concat_and_cache_mla(jnp.asarray(kv_c), jnp.asarray(k_pe), jnp.asarray(kv_cache),
                               slot_mapping, kv_cache_dtype, jnp.asarray(scale), backend=backend)
    if kv_cache_dtype == "fp8":
        torch.testing.assert_close(dequant_half(got, scale), dequant_half(ref_cache, scale),
                                   atol=0.001, rtol=0.1)
    else:
        torch.testing.assert_close(to_torch(got), to_torch(ref_cache))
