"""write_kv_pages (ragged-paged-attention cache layout): every backend against numpy, bitwise.

Each case runs the jnp reference, the TPU (Mosaic) kernel in TPU interpret mode
(race detector on) and the GPU (Triton) kernel in generic interpret mode, and
compares the whole cache bit for bit with an expectation built by a Python loop
that places K of head h at combined head 2h and V at 2h + 1 (packed rank-5
caches: at ``[c // packing, c % packing]``). Caches start as random data with a
NaN-poisoned null page 0; payloads are finite, so poison and payload differ.
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kvjax.testing.asserts import assert_bitwise, assert_no_races
from pallas_kernels import PAD_SLOT_ID, reshape_and_cache_flash, write_kv_pages
from pallas_kernels import KVWriteConfig
from pallas_kernels.kv_pages import kv_packing, token_runs, write_kv_pages_reference

BACKENDS = ("reference", "pallas_tpu", "pallas_gpu")
FP8 = ml_dtypes.float8_e4m3fn
BF16 = ml_dtypes.bfloat16
# T tokens, H kv heads of size D, NP pages of PS slots.
T, H, D, NP, PS = 8, 2, 16, 4, 4
NUM_SLOTS = NP * PS




@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


def cache_shape(dtype, packed):
    if not packed:
        return (NP, PS, 2 * H, D)
    p = kv_packing(dtype)
    return (NP, PS, 2 * H // p, p, D)


def poisoned_pages(rng, dtype, packed=False):
    """Random contents, page 0 (the null page) all NaN."""
    shape = cache_shape(dtype, packed)
    if np.dtype(dtype) == np.dtype(FP8):
        raw = rng.integers(0, 256, size=shape, dtype=np.uint8)
        raw[0] = 0x7F  # float8_e4m3fn NaN
        return raw.view(FP8)
    c = rng.standard_normal(shape).astype(dtype)
    c[0] = np.nan
    return c


def np_quantize(x, scale):
    y = np.asarray(x).astype(np.float32) / np.float32(scale)
    y = np.where(y > 448.0, np.float32(448.0), y)
    y = np.where(y < -448.0, np.float32(-448.0), y)
    return y.astype(FP8)


def expected(key, value, pages, slots, k_scale=None, v_scale=None):
    """Python loop: K of head h -> combined head 2h, V -> 2h + 1."""
    pages = pages.copy()
    packed = pages.ndim == 5
    p = pages.shape[3] if packed else 1
    for t, s in enumerate(np.asarray(slots).tolist()):
        if s < 0:
            continue
        for h in range(H):
            for c, x, scale in ((2 * h, key, k_scale), (2 * h + 1, value, v_scale)):
                row = x[t, h]
                if scale is not None:
                    row = np_quantize(row, np.broadcast_to(scale, (H,))[h])
                if packed:
                    pages[s // PS, s % PS, c // p, c % p] = row
                else:
                    pages[s // PS, s % PS, c] = row
    return pages


def inputs(rng, dtype=np.float32):
    key = rng.standard_normal((T, H, D)).astype(dtype)
    value = rng.standard_normal((T, H, D)).astype(dtype)
    return key, value


def run(backend, key, value, pages, slots, *args):
    return np.asarray(write_kv_pages(key, value, pages, slots, *args, backend=backend))


SLOT_CASES = {
    # PAD inside and at the tail, the last slot of the cache.
    "pad_inside_and_tail": [5, PAD_SLOT_ID, 15, 8, PAD_SLOT_ID, 4, PAD_SLOT_ID, PAD_SLOT_ID],
    # A prefill chunk: one run of consecutive slots across a page boundary.
    "prefill_run": [6, 7, 8, 9, 10, 11, 12, 13],
    # Every slot of page 1 in reverse, then the start of page 3.
    "page_reversed": [7, 6, 5, 4, 12, 13, 14, 15],
    # Other negative values are PAD too.
    "other_negatives": [-2, 6, -5, -(2**31), 9, -1, -16, 4],
}

LAYOUTS = {
    "f32": (np.float32, False),
    "bf16": (BF16, False),
    "bf16_packed": (BF16, True),
}


# Every slot case on float32; the bf16 layouts (flat and packed) on two of them.
WRITE_CASES = [("f32", c) for c in SLOT_CASES] + [
    (layout, c) for layout in ("bf16", "bf16_packed") for c in ("pad_inside_and_tail", "prefill_run")
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout, case", WRITE_CASES, ids=[f"{l}-{c}" for l, c in WRITE_CASES])
def test_writes_exactly_the_slots(backend, layout, case, rng):
    dtype, packed = LAYOUTS[layout]
    key, value = inputs(rng, dtype)
    pages = poisoned_pages(rng, dtype, packed)
    slots = np.asarray(SLOT_CASES[case], np.int32)
    got = run(backend, key, value, pages, slots)
    assert_bitwise(got, expected(key, value, pages, slots), "kv_pages")
    assert_no_races(backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("packed", [False, True], ids=["flat", "packed"])
def test_fp8_per_head_scales(backend, packed, rng):
    """fp8 with different K and V scales per head: each combined head gets its own scale."""
    key, value = inputs(rng)
    key[0, 0, :3] = [1e6, -1e6, np.nan]  # saturation and NaN pass-through
    pages = poisoned_pages(rng, FP8, packed)
    k_scale = np.asarray([0.5, 2.0], np.float32)
    v_scale = np.asarray([0.25, 3.0], np.float32)
    slots = np.asarray([5, PAD_SLOT_ID, 15, 8, 9, 4, PAD_SLOT_ID, 10], np.int32)
    got = run(backend, key, value, pages, slots, "fp8", k_scale, v_scale)
    assert_bitwise(got, expected(key, value, pages, slots, k_scale, v_scale), "kv_pages")
    assert_no_races(backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_pad_leaves_cache_bitwise_unchanged(backend, rng):
    key, value = inputs(rng)
    key[:] = 1.0
    pages = poisoned_pages(rng, np.float32)
    slots = np.full((T,), PAD_SLOT_ID, np.int32)
    got = run(backend, key, value, pages, slots)
    assert_bitwise(got, pages, "kv_pages")
    assert np.isnan(got[0]).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n", [0, 3])
def test_only_first_n_tokens_are_written(backend, n, rng):
    key, value = inputs(rng)
    pages = poisoned_pages(rng, np.float32)
    slots = np.asarray([13, PAD_SLOT_ID, 7][:n], np.int32)
    got = run(backend, key, value, pages, slots)
    assert_bitwise(got, expected(key, value, pages, slots), "kv_pages")


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_of_range_slots_under_jit_write_nothing(backend, rng):
    key, value = inputs(rng)
    pages = poisoned_pages(rng, np.float32)
    slots = np.asarray([NUM_SLOTS, 5, NUM_SLOTS + PS, 2**31 - 1, 6, -1, NUM_SLOTS + 1, 10], np.int32)
    fn = jax.jit(lambda *a: write_kv_pages(*a, backend=backend))
    got = np.asarray(fn(key, value, pages, slots))
    assert_bitwise(got, expected(key, value, pages, np.where(slots < NUM_SLOTS, slots, -1)))


def test_token_runs_by_hand():
    """Runs: consecutive slots inside one page (PS = 4); a PAD or a page start breaks them."""
    slots = jnp.asarray([6, 7, 8, 9, 10, 11, 12, 13, -1, 3, 4, 5, 1, 2, 3, -1], jnp.int32)
    want = [2, 0, 4, 0, 0, 0, 2, 0, 0, 1, 2, 0, 3, 0, 0, 0]
    np.testing.assert_array_equal(token_runs(slots, PS), want)
    np.testing.assert_array_equal(token_runs(jnp.asarray([5, 4, 3], jnp.int32), PS), [1, 1, 1])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("packed", [False, True], ids=["flat", "packed"])
def test_runs_across_grid_steps(backend, packed, rng):
    """Two tokens per TPU grid step: runs of 3 (pieces 1 + 2) and 4 start in one step and end
    in the next; a run of 4 fills a page; a lone token follows."""
    key, value = inputs(rng, BF16)
    pages = poisoned_pages(rng, BF16, packed)
    slots = np.asarray([5, 6, 7, 12, 13, 14, 15, 4], np.int32)
    got = np.asarray(write_kv_pages(key, value, pages, slots, backend=backend,
                                    config=KVWriteConfig(tpu_tokens_per_step=2)))
    assert_bitwise(got, expected(key, value, pages, slots), "kv_pages")
    assert_no_races(backend)


def test_reference_function_is_the_reference_backend(rng):
    key, value = inputs(rng)
    pages = poisoned_pages(rng, np.float32)
    slots = np.asarray([3, 4, -1, 9], np.int32)
    got = np.asarray(write_kv_pages_reference(key, value, pages, slots))
    assert_bitwise(got, expected(key, value, pages, slots))


def test_matches_reshape_and_cache_flash_on_the_same_bytes(rng):
    """The RPA cache de-interleaved is exactly what the flash layout write produces."""
    key, value = inputs(rng)
    pages = poisoned_pages(rng, np.float32)
    slots = np.asarray([5, -1, 15, 8, 9, 4, -1, 10], np.int32)
    got = np.asarray(write_kv_pages(key, value, pages, slots, backend="reference"))
    kc, vc = reshape_and_cache_flash(
        key, value, pages[:, :, 0::2], pages[:, :, 1::2], slots, backend="reference"
    )
    assert_bitwise(got[:, :, 0::2], kc, "K")
    assert_bitwise(got[:, :, 1::2], vc, "V")


# --------------------------------------------------------------------------
# errors: the contract of reshape_and_cache_flash, same checks
# --------------------------------------------------------------------------


def test_concrete_bad_slots_are_rejected(rng):
    key, value = inputs(rng)
    pages = poisoned_pages(rng, np.float32)
    with pytest.raises(ValueError, match=r"slot_mapping values must be in \[0, 16\)"):
        write_kv_pages(key, value, pages, np.asarray([3, NUM_SLOTS], np.int32))
    with pytest.raises(ValueError, match="slot_mapping must not repeat a valid slot"):
        write_kv_pages(key, value, pages, np.asarray([3, 4, 3], np.int32))
    with pytest.raises(ValueError, match="slot_mapping must not be longer"):
        write_kv_pages(key, value, pages, np.zeros((T + 1,), np.int32))


STATIC_ERRORS = {
    # name: (key dtype, kv_pages shape, kv_pages dtype, kv_cache_dtype, message)
    "heads_not_combined": (np.float32, (NP, PS, H, D), np.float32, "auto",
                           r"kv_pages must have shape \[\*, \*, 4, 16\], got \[4, 4, 2, 16\]"),
    "head_dim": (np.float32, (NP, PS, 2 * H, 8), np.float32, "auto", r"kv_pages must have shape"),
    "packed_f32": (np.float32, (NP, PS, 2, 2, D), np.float32, "auto", "packed layout"),
    "packed_wrong_packing": (BF16, (NP, PS, 1, 4, D), BF16, "auto",
                             r"kv_pages must have shape \[\*, \*, 2, 2, 16\]"),
    "dtype_mismatch": (np.float32, (NP, PS, 2 * H, D), BF16, "auto", "kv_pages must have the dtype of key"),
    "rank": (np.float32, (NP, PS * 2 * H * D), np.float32, "auto", "kv_pages must have rank 4 or 5"),
    "fp8_cache_dtype": (np.float32, (NP, PS, 2 * H, D), np.float32, "fp8",
                        "kv_pages must have dtype float8_e4m3fn"),
    "kv_cache_dtype": (np.float32, (NP, PS, 2 * H, D), np.float32, "int8", "kv_cache_dtype must be one of"),
}


@pytest.mark.parametrize("case", list(STATIC_ERRORS))
def test_static_errors(case, rng):
    key_dtype, shape, dtype, kv_cache_dtype, match = STATIC_ERRORS[case]
    key, value = inputs(rng, key_dtype)
    with pytest.raises(ValueError, match=match):
        write_kv_pages(key, value, np.zeros(shape, dtype), np.asarray([4], np.int32), kv_cache_dtype)


def test_fp8_scale_errors(rng):
    key, value = inputs(rng)
    pages = poisoned_pages(rng, FP8)
    slots = np.asarray([4], np.int32)
    with pytest.raises(ValueError, match="k_scale is required"):
        write_kv_pages(key, value, pages, slots, "fp8", None, 1.0)
    with pytest.raises(ValueError, match=r"v_scale must have shape \[\] or \[1\] or \[2\]"):
        write_kv_pages(key, value, pages, slots, "fp8", 1.0, np.ones((3,), np.float32))
    with pytest.raises(ValueError, match="k_scale must be finite and > 0"):
        write_kv_pages(key, value, pages, slots, "fp8", np.float32(0.0), 1.0)


# --------------------------------------------------------------------------
# in place
# --------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_donated_cache_is_updated_in_place(backend, rng):
    key, value = inputs(rng)
    pages = np.asarray(rng.standard_normal((64, PS, 2 * H, D)), np.float32)
    slots = np.asarray([5, -1, 9], np.int32)
    want = expected(key, value, pages, slots)
    fn = jax.jit(lambda *a: write_kv_pages(*a, backend=backend), donate_argnums=(2,))
    dev = jnp.asarray(pages)
    pointer = dev.unsafe_buffer_pointer()
    got = fn(key, value, dev, slots)
    assert got.unsafe_buffer_pointer() == pointer
    assert_bitwise(got, want, "kv_pages")
