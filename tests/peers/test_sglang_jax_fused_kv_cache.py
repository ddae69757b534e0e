"""sglang-jax's fused KV-cache update test, ported onto ``pallas_kernels.write_kv_pages``.

Source: sgl-project/sglang-jax, ``python/sgl_jax/test/mem_cache/test_kv_cache.py`` at
commit cddbf6f1cc33cbdd453bd8f36ff7051cf46ca176 (2026-08-21). The test logic is
re-written here; no peer code is copied.

sglang-jax keeps one fused cache per layer, ``[num_pages, page_size, 2H // packing,
packing, head_dim]`` (K of head h at combined head 2h, V at 2h + 1; bf16 packing 2;
one extra sentinel page), and writes token ``i`` to flat slot ``loc[i]``, ``-1``
writing nothing: kvjax's rank-5 packed ``write_kv_pages`` layout and PAD rule, so the
test runs unchanged in meaning. Kept: 8 kv heads, head_dim 128, bf16 uniform K/V from
``PRNGKey(42)`` / ``PRNGKey(43)``, the slot patterns (contiguous from 10; a quarter
padding interleaved; three segments with padding), page sizes 1 / 4 / 8 (and 1, 2, 4, 8
for the segments case), the all-padding case (page sizes 2 and 4 of the segments case behind the slow switch),
the per-token reference and
``jnp.allclose`` (default tolerances), plus the per-segment spot checks. Added: the
cache is also compared bitwise with the reference (a copy is exact), and every slot
not written keeps its bytes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _flavours import flavours, slow
from pallas_kernels import write_kv_pages

NUM_HEADS, HEAD_DIM = 8, 128


def fused_cache(cache_size, page_size):
    num_pages = (cache_size + page_size - 1) // page_size + 1  # + 1 sentinel page
    return jnp.zeros((num_pages, page_size, NUM_HEADS * 2 // 2, 2, HEAD_DIM), jnp.bfloat16)


def split_fused(cache):
    """[pages, page_size, 2H//p, p, D] -> K, V ``[pages * page_size, H, D]``."""
    flat = np.asarray(cache).reshape(-1, 2 * NUM_HEADS, HEAD_DIM)
    return flat[:, 0::2], flat[:, 1::2]


def kv(total_tokens):
    k = jax.random.uniform(jax.random.PRNGKey(42), (total_tokens, NUM_HEADS, HEAD_DIM), jnp.bfloat16)
    v = jax.random.uniform(jax.random.PRNGKey(43), (total_tokens, NUM_HEADS, HEAD_DIM), jnp.bfloat16)
    return k, v


def locations(total_tokens, add_padding):
    if not add_padding:
        return np.arange(total_tokens, dtype=np.int32) + 10
    num_padding = total_tokens // 4
    every = np.concatenate([np.arange(total_tokens - num_padding, dtype=np.int32) + 10,
                            np.full((num_padding,), -1, np.int32)])
    loc = np.zeros(total_tokens, np.int32)  # the peer's interleave: first half even, rest odd
    loc[::2] = every[: total_tokens // 2]
    loc[1::2] = every[total_tokens // 2:]
    return loc


def expected(k, v, loc, cache_tokens):
    ek = np.zeros((cache_tokens, NUM_HEADS, HEAD_DIM), np.asarray(k).dtype)
    ev = np.zeros_like(ek)
    for i, slot in enumerate(loc):
        if slot != -1:
            ek[slot], ev[slot] = np.asarray(k)[i], np.asarray(v)[i]
    return ek, ev


def run_and_verify(k, v, loc, cache, backend):
    updated = write_kv_pages(k, v, cache, jnp.asarray(loc), backend=backend)
    uk, uv = split_fused(updated)
    ek, ev = expected(k, v, loc, uk.shape[0])
    assert jnp.allclose(uk, ek), f"K mismatch: max diff = {np.abs(uk.astype(np.float32) - ek.astype(np.float32)).max()}"
    assert jnp.allclose(uv, ev), f"V mismatch: max diff = {np.abs(uv.astype(np.float32) - ev.astype(np.float32)).max()}"
    assert np.array_equal(uk.view(np.uint16), ek.view(np.uint16))
    assert np.array_equal(uv.view(np.uint16), ev.view(np.uint16))
    return uk, uv


@pytest.mark.parametrize("backend", flavours("pallas_tpu", "pallas_gpu"))
@pytest.mark.parametrize(
    "total_tokens, page_size, add_padding",
    [(16, 1, False), (12, 1, True), (16, 4, False), (12, 4, True), (16, 8, False)],
    ids=["page_size_1", "page_size_1_with_padding", "page_size_4", "page_size_4_with_padding",
         "page_size_8_contiguous"],
)
def test_kv_cache_update(total_tokens, page_size, add_padding, backend):
    k, v = kv(total_tokens)
    run_and_verify(k, v, locations(total_tokens, add_padding),
                   fused_cache(total_tokens + 100, page_size), backend)


@pytest.mark.parametrize("backend", flavours("pallas_tpu", "pallas_gpu"))
def test_all_padding_tokens(backend):
    k, v = kv(4)
    cache = fused_cache(4 + 100, 8)
    updated = write_kv_pages(k, v, cache, jnp.full((4,), -1, jnp.int32), backend=backend)
    assert jnp.allclose(updated, cache)
    assert np.array_equal(np.asarray(updated).view(np.uint16), np.asarray(cache).view(np.uint16))


@pytest.mark.parametrize("backend", flavours("pallas_tpu", "pallas_gpu"))
@pytest.mark.parametrize("page_size", [1, slow(2), slow(4), 8])
def test_kv_cache_update_multiple_segments_with_padding(page_size, backend):
    total_tokens = 25
    loc = np.full((total_tokens,), -1, np.int32)
    loc[0:7] = np.arange(11, 18)
    loc[7:11] = np.arange(22, 26)
    loc[11:21] = np.arange(30, 40)
    k, v = kv(total_tokens)
    uk, _ = run_and_verify(k, v, loc, fused_cache(total_tokens + 50, page_size), backend)
    k = np.asarray(k)
    for first, slot, n in ((0, 11, 7), (7, 22, 4), (11, 30, 10)):
        for i in range(n):
            assert jnp.allclose(uk[slot + i], k[first + i], rtol=1e-5)
