"""reshape_and_cache_flash / concat_and_cache_mla: every backend against numpy, bitwise.

Every case runs the jnp reference, the TPU (Mosaic) kernel in TPU interpret mode
(race detector on, uninitialised memory = NaN) and the GPU (Triton) kernel in
generic interpret mode. Caches start as random data with a NaN-filled null
block 0, and whole caches are compared bit for bit against an expectation
built with a plain Python loop in numpy (fp8: ml_dtypes bytes of
saturate(x / scale) in float32). Shapes are shared between tests so that
each backend compiles a handful of times only.
"""

from __future__ import annotations

import re
import zlib

import hypothesis
import hypothesis.strategies as st
import jax
import jax.extend
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kvjax.constants import PAD_SLOT_ID
from pallas_kernels import kv_write
from pallas_kernels.kv_write import (
    concat_and_cache_mla,
    concat_and_cache_mla_reference,
    reshape_and_cache_flash,
    reshape_and_cache_flash_reference,
)
from kvjax.testing.asserts import assert_bitwise, bits, assert_no_races  # noqa: E402
from kvjax.testing.convert import to_numpy, to_torch  # noqa: E402
from kvjax.testing.fast_compile import DEFAULT_FUSION_OPTIONS, XLA_DEFAULT_COMPILER_OPTIONS  # noqa: E402


def torch_bits(t):
    return bits(to_numpy(t))

BACKENDS = ("reference", "pallas_tpu", "pallas_gpu")
FP8 = ml_dtypes.float8_e4m3fn
# Shared geometry: T tokens, H heads of size D, NB blocks of BS slots.
T, H, D, NB, BS = 8, 2, 16, 4, 4
NUM_SLOTS = NB * BS
L, R = 16, 8  # MLA kv_lora_rank, pe_dim


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------




def poisoned_cache(rng, shape, dtype):
    """Random contents, block 0 (the null block) all NaN."""
    if np.dtype(dtype) == np.dtype(FP8):
        raw = rng.integers(0, 256, size=shape, dtype=np.uint8)
        raw[0] = 0x7F  # float8_e4m3fn NaN
        return raw.view(FP8)
    c = rng.standard_normal(shape).astype(dtype)
    c[0] = np.nan
    return c


def np_quantize(x, scale):
    """Expected fp8: saturate(float32(x) / float32(scale)), RNE via ml_dtypes."""
    y = np.asarray(x).astype(np.float32) / np.asarray(scale, np.float32)
    y = np.where(y > 448.0, np.float32(448.0), y)
    y = np.where(y < -448.0, np.float32(-448.0), y)
    return y.astype(FP8)


def expected_flash(key, value, kc, vc, slots, fp8=False, k_scale=None, v_scale=None):
    kc, vc = kc.copy(), vc.copy()
    for t, s in enumerate(np.asarray(slots).tolist()):
        if s < 0:
            continue
        for x, cache, scale in ((key, kc, k_scale), (value, vc, v_scale)):
            row = x[t]
            if fp8:
                row = np_quantize(row, np.reshape(scale, (-1, 1)))
            cache[s // BS, s % BS] = row
    return kc, vc


def expected_mla(kv_c, k_pe, cache, slots, fp8=False, scale=None):
    cache = cache.copy()
    for t, s in enumerate(np.asarray(slots).tolist()):
        if s < 0:
            continue
        row = np.concatenate([kv_c[t], k_pe[t]])
        cache[s // BS, s % BS] = np_quantize(row, scale) if fp8 else row
    return cache


def flash_inputs(rng, dtype=np.float32, fp8=False, scale=1.0):
    key = (rng.standard_normal((T, H, D)) * scale).astype(dtype)
    value = (rng.standard_normal((T, H, D)) * scale).astype(dtype)
    cache_dtype = FP8 if fp8 else dtype
    kc = poisoned_cache(rng, (NB, BS, H, D), cache_dtype)
    vc = poisoned_cache(rng, (NB, BS, H, D), cache_dtype)
    return key, value, kc, vc


def run_flash(backend, key, value, kc, vc, slots, *args):
    out = reshape_and_cache_flash(key, value, kc, vc, slots, *args, backend=backend)
    return tuple(np.asarray(o) for o in out)


def random_slots(rng, n, num_pad):
    """n distinct slots outside block 0, num_pad of them replaced by PAD."""
    slots = rng.choice(np.arange(BS, NUM_SLOTS), size=n, replace=False).astype(np.int32)
    slots[rng.choice(n, size=num_pad, replace=False)] = PAD_SLOT_ID
    return slots


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


# --------------------------------------------------------------------------
# reshape_and_cache_flash: slot semantics
# --------------------------------------------------------------------------

SLOT_CASES = {
    # PAD in the middle and at the tail, slot in the last block (last position).
    "pad_inside_and_tail": [5, PAD_SLOT_ID, 15, 8, PAD_SLOT_ID, 4, PAD_SLOT_ID, PAD_SLOT_ID],
    # Every position of block 1, in reverse: catches an off-by-one in the offset.
    "whole_block_reversed": [7, 6, 5, 4, 12, 13, 14, 15],
    # Slots in block 0 are legal for the op itself (the runner never allocates it).
    "block_zero_written": [0, 3, PAD_SLOT_ID, 9, 10, 11, 1, 2],
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", list(SLOT_CASES))
def test_flash_writes_exactly_the_slots(backend, dtype, case, rng):
    key, value, kc, vc = flash_inputs(rng, dtype)
    slots = np.asarray(SLOT_CASES[case], np.int32)
    got = run_flash(backend, key, value, kc, vc, slots)
    want = expected_flash(key, value, kc, vc, slots)
    assert_bitwise(got[0], want[0], "key_cache")
    assert_bitwise(got[1], want[1], "value_cache")
    assert_no_races(backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_flash_all_pad_leaves_caches_bitwise_unchanged(backend, rng):
    """The dummy-run case of vLLM PR 39444: an all-PAD step writes nothing, block 0 included."""
    key, value, kc, vc = flash_inputs(rng)
    key[:] = 1.0  # what a PAD token carrying garbage would write
    slots = np.full((T,), PAD_SLOT_ID, np.int32)
    got = run_flash(backend, key, value, kc, vc, slots)
    assert_bitwise(got[0], kc, "key_cache")
    assert_bitwise(got[1], vc, "value_cache")
    assert np.isnan(got[0][0]).all() and np.isnan(got[1][0]).all()
    assert_no_races(backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_flash_other_negative_slots_write_nothing(backend, rng):
    key, value, kc, vc = flash_inputs(rng)
    slots = np.asarray([-2, 6, -5, -(2**31), 9, -1, -16, -4], np.int32)
    got = run_flash(backend, key, value, kc, vc, slots)
    want = expected_flash(key, value, kc, vc, slots)
    assert_bitwise(got[0], want[0], "key_cache")
    assert_bitwise(got[1], want[1], "value_cache")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n", [0, 1, 5])
def test_flash_only_first_n_tokens_are_written(backend, n, rng):
    """key/value padded to T while the slot mapping has N entries (vLLM uses N)."""
    key, value, kc, vc = flash_inputs(rng)
    slots = np.asarray([13, 4, PAD_SLOT_ID, 7, 15][:n], np.int32)
    got = run_flash(backend, key, value, kc, vc, slots)
    want = expected_flash(key, value, kc, vc, slots)
    assert_bitwise(got[0], want[0], "key_cache")
    assert_bitwise(got[1], want[1], "value_cache")


@pytest.mark.parametrize("backend", BACKENDS)
def test_flash_int64_slot_mapping(backend, rng):
    key, value, kc, vc = flash_inputs(rng)
    slots = np.asarray([7, -1, 15, 4, -(2**32) + 5, -(2**40), 9, 8], np.int64)
    want = expected_flash(key, value, kc, vc, slots)
    # numpy int64 without x64: narrowed on the host, -2**32 + 5 must not wrap to 5.
    got = run_flash(backend, key, value, kc, vc, slots)
    assert_bitwise(got[0], want[0], "key_cache")
    assert_bitwise(got[1], want[1], "value_cache")
    with jax.enable_x64(True):
        got = run_flash(backend, key, value, kc, vc, jnp.asarray(slots, jnp.int64))
    assert_bitwise(got[0], want[0], "key_cache (x64)")
    assert_bitwise(got[1], want[1], "value_cache (x64)")


@pytest.mark.parametrize("backend", BACKENDS)
def test_flash_out_of_range_slots_under_jit_write_nothing(backend, rng):
    """A traced slot mapping cannot be checked: slots >= num_slots are masked, never clamped."""
    key, value, kc, vc = flash_inputs(rng)
    slots = np.asarray([NUM_SLOTS, 5, NUM_SLOTS + BS, 2**31 - 1, 6, -1, NUM_SLOTS + 1, 10], np.int32)
    fn = jax.jit(lambda *a: reshape_and_cache_flash(*a, backend=backend))
    got = [np.asarray(o) for o in fn(key, value, kc, vc, slots)]
    want = expected_flash(key, value, kc, vc, np.where(slots < NUM_SLOTS, slots, -1))
    assert_bitwise(got[0], want[0], "key_cache")
    assert_bitwise(got[1], want[1], "value_cache")


def test_flash_int64_beyond_int32_under_jit_writes_nothing(rng):
    """2**32 + 5 must not wrap to slot 5 when narrowed inside the kernel wrapper."""
    key, value, kc, vc = flash_inputs(rng)
    slots = np.asarray([2**32 + 5, 2**32 + 9, -1, -1, -1, -1, -1, -1], np.int64)
    with jax.enable_x64(True):
        for backend in BACKENDS:
            fn = jax.jit(lambda *a, b=backend: reshape_and_cache_flash(*a, backend=b))
            got = fn(key, value, kc, vc, jnp.asarray(slots))
            assert_bitwise(got[0], kc, f"key_cache ({backend})")
            assert_bitwise(got[1], vc, f"value_cache ({backend})")


# --------------------------------------------------------------------------
# fp8
# --------------------------------------------------------------------------


def test_quantize_fp8_bytes_by_hand():
    """The fp8 rule pinned to bytes worked out by hand (independent of ml_dtypes)."""
    x = np.asarray(
        [1.0, 0.5, 448.0, 449.0, 464.0, 1e6, np.inf, -448.0, -1e9, -np.inf, np.nan,
         1.0625, 1.1875, 0.0, -0.0, 2.0**-9],
        np.float32,
    )
    want = [0x38, 0x30, 0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0xFE, 0xFE, 0x7F,
            0x38, 0x3A, 0x00, 0x80, 0x01]
    got = bits(jax.jit(kv_write.quantize_fp8)(x, np.float32(1.0)))
    assert got.tolist() == want
    # Halving the scale doubles the value: 300 / 0.5 = 600 saturates.
    assert bits(jax.jit(kv_write.quantize_fp8)(np.float32([300.0]), np.float32(0.5))).tolist() == [0x7E]


def test_ieee_divide_matches_numpy_bitwise():
    """Integer long division == numpy's float32 x / s, incl. subnormal/overflow/inf/NaN/ties."""
    rng = np.random.default_rng(0)
    n = 1 << 16
    x = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)
    s = rng.integers(0x00800000, 0x7F800000, n, dtype=np.uint64).astype(np.uint32).view(np.float32)
    # Exactly representable quotients (x = q * s) and bf16 inputs over "nice" scales.
    q = rng.integers(1, 2**12, n).astype(np.float32)
    s2 = rng.integers(1, 2**12, n).astype(np.float32) * np.float32(2.0**-5)
    bf = (rng.standard_normal(n) * 100).astype(ml_dtypes.bfloat16).astype(np.float32)
    s3 = np.resize(np.asarray([0.5, 0.9, 0.37, 1.5, 0.75, 3.0], np.float32), n)
    specials = np.asarray([np.inf, -np.inf, np.nan, 0.0, -0.0, 1e-45, -3e-39, 3e38, -90.0], np.float32)
    s4 = np.asarray([0.5, 2.0, 1.0, 3.0, 3.0, 0.5, 4.0, 1e-3, 0.9], np.float32)
    x = np.concatenate([x, q * s2, bf, specials])
    s = np.concatenate([s, s2, s3, s4])
    with np.errstate(all="ignore"):
        want = x / s
    # XLA:CPU's defaults: at backend optimisation level 0 the older fusion emitters (the suite's
    # settings, tests/conftest.py) flush some subnormal quotients of this program to zero
    got = np.asarray(jax.jit(kv_write.ieee_divide, compiler_options=XLA_DEFAULT_COMPILER_OPTIONS)(x, s))
    same = (bits(got) == bits(want)) | (np.isnan(got) & np.isnan(want))
    bad = np.flatnonzero(~same)
    assert bad.size == 0, f"{bad.size} differ, e.g. {x[bad[0]]!r} / {s[bad[0]]!r}: {got[bad[0]]!r} vs {want[bad[0]]!r}"


def saturating_inputs(rng, dtype):
    """Random values plus the edges: +-448, just past it, far past it, +-inf, NaN, ties."""
    key = (rng.standard_normal((T, H, D)) * 200).astype(np.float32)
    # +-90 / 0.9 is exactly +-100 in float32, a tie between fp8 96 and 104: a
    # division done as x * (1 / 0.9) lands past the tie and rounds the other way.
    edges = [448.0, -448.0, 449.0, -449.0, 464.0, -480.0, 1e5, -1e5, np.inf, -np.inf, np.nan,
             1.0625, 1.1875, -0.0, 90.0, -90.0, 2.0**-10, 2.0**-9 * 1.5]
    key.reshape(-1)[: len(edges)] = edges  # token 0: heads 0 and 1
    return key.astype(dtype)


SCALES = {
    "python_float": (1.0, 2.0),
    "scalar": (np.float32(0.5), np.float32(1.0)),
    "one": (np.asarray([1.0], np.float32), np.asarray([0.25], np.float32)),
    "per_head": (np.asarray([0.9, 0.5], np.float32), np.asarray([0.3, 3.0], np.float32)),
    "scalar_0.9": (np.float32(0.9), np.asarray([0.9], np.float32)),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("scales", list(SCALES))
def test_flash_fp8_saturates_and_rounds_to_nearest_even(backend, dtype, scales, rng):
    key, value, kc, vc = flash_inputs(rng, dtype, fp8=True, scale=100.0)
    key = saturating_inputs(rng, dtype)
    k_scale, v_scale = SCALES[scales]
    slots = np.asarray([4, 15, PAD_SLOT_ID, 9, 7, PAD_SLOT_ID, 12, 5], np.int32)
    got = run_flash(backend, key, value, kc, vc, slots, "fp8", k_scale, v_scale)
    want = expected_flash(key, value, kc, vc, slots, True, k_scale, v_scale)
    assert_bitwise(got[0], want[0], "key_cache")
    assert_bitwise(got[1], want[1], "value_cache")
    assert_no_races(backend)


@pytest.mark.parametrize("tile, warps", [(8, None), (16, None), (8, 4)])
def test_flash_fp8_gpu_column_tiles_keep_each_heads_scale(tile, warps, rng):
    """fp8 on the GPU kernel with rows split over several column tiles (the fp8 tile rule):
    every column still gets its own head's scale, bitwise as the reference."""
    key, value, kc, vc = flash_inputs(rng, ml_dtypes.bfloat16, fp8=True, scale=100.0)
    k_scale, v_scale = SCALES["per_head"]
    slots = np.asarray([4, 15, PAD_SLOT_ID, 9, 7, PAD_SLOT_ID, 12, 5], np.int32)
    cfg = kv_write.KVWriteConfig(gpu_fp8_max_tile=tile, gpu_num_warps=warps)
    got = tuple(np.asarray(o) for o in reshape_and_cache_flash(
        key, value, kc, vc, slots, "fp8", k_scale, v_scale, backend="pallas_gpu", config=cfg))
    want = expected_flash(key, value, kc, vc, slots, True, k_scale, v_scale)
    assert_bitwise(got[0], want[0], "key_cache")
    assert_bitwise(got[1], want[1], "value_cache")


@pytest.mark.parametrize("backend", BACKENDS)
def test_flash_fp8_e4m3_is_an_alias_of_fp8(backend, rng):
    key, value, kc, vc = flash_inputs(rng, fp8=True, scale=300.0)
    slots = np.asarray([4, 15, PAD_SLOT_ID, 9], np.int32)
    scale = np.asarray([0.9, 1.1], np.float32)
    got = run_flash(backend, key, value, kc, vc, slots, "fp8_e4m3", scale, scale)
    want = expected_flash(key, value, kc, vc, slots, True, scale, scale)
    assert_bitwise(got[0], want[0], "key_cache")
    assert_bitwise(got[1], want[1], "value_cache")


@pytest.mark.parametrize("backend", BACKENDS)
def test_flash_fp8_all_pad_unchanged(backend, rng):
    key, value, kc, vc = flash_inputs(rng, fp8=True)
    slots = np.full((T,), PAD_SLOT_ID, np.int32)
    got = run_flash(backend, key, value, kc, vc, slots, "fp8", 1.0, 1.0)
    assert_bitwise(got[0], kc, "key_cache")
    assert_bitwise(got[1], vc, "value_cache")


# --------------------------------------------------------------------------
# concat_and_cache_mla
# --------------------------------------------------------------------------


def mla_inputs(rng, dtype=np.float32, fp8=False):
    kv_c = (rng.standard_normal((T, L)) * 100).astype(dtype)
    k_pe = (rng.standard_normal((T, R)) * 100).astype(dtype)
    k_pe[0, :4] = [np.inf, -np.inf, np.nan, 1000.0]
    cache = poisoned_cache(rng, (NB, BS, L + R), FP8 if fp8 else dtype)
    return kv_c, k_pe, cache


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("fp8", [False, True], ids=["auto", "fp8"])
def test_mla_writes_exactly_the_slots(backend, dtype, fp8, rng):
    kv_c, k_pe, cache = mla_inputs(rng, dtype, fp8)
    slots = np.asarray([15, PAD_SLOT_ID, 4, 10, PAD_SLOT_ID, 7], np.int32)  # N = 6 < T
    scale = np.asarray([0.7], np.float32)
    args = ("fp8", scale) if fp8 else ()
    got = np.asarray(concat_and_cache_mla(kv_c, k_pe, cache, slots, *args, backend=backend))
    want = expected_mla(kv_c, k_pe, cache, slots, fp8, scale)
    assert_bitwise(got, want, "kv_cache")
    assert_no_races(backend)


def test_reference_functions_are_the_reference_backend(rng):
    key, value, kc, vc = flash_inputs(rng)
    slots = np.asarray([5, -1, 9], np.int32)
    got = reshape_and_cache_flash_reference(key, value, kc, vc, slots)
    want = expected_flash(key, value, kc, vc, slots)
    assert_bitwise(got[0], want[0], "key_cache")
    kv_c, k_pe, cache = mla_inputs(rng)
    got = concat_and_cache_mla_reference(kv_c, k_pe, cache, slots)
    assert_bitwise(got, expected_mla(kv_c, k_pe, cache, slots), "kv_cache")


@pytest.mark.parametrize("backend", BACKENDS)
def test_mla_all_pad_leaves_cache_bitwise_unchanged(backend, rng):
    kv_c, k_pe, cache = mla_inputs(rng)
    slots = np.full((T,), PAD_SLOT_ID, np.int32)
    got = np.asarray(concat_and_cache_mla(kv_c, k_pe, cache, slots, backend=backend))
    assert_bitwise(got, cache, "kv_cache")


# --------------------------------------------------------------------------
# random slot mappings (hypothesis): fixed shapes, so each backend compiles once
# --------------------------------------------------------------------------


@hypothesis.settings(max_examples=6, deadline=None, derandomize=True)
@hypothesis.given(
    perm_seed=st.integers(0, 2**32 - 1),
    pad_mask=st.lists(st.booleans(), min_size=T, max_size=T),
    fp8=st.booleans(),
)
def test_flash_random_slot_mappings(perm_seed, pad_mask, fp8):
    rng = np.random.default_rng(perm_seed)
    key, value, kc, vc = flash_inputs(rng, ml_dtypes.bfloat16, fp8=fp8, scale=50.0)
    slots = rng.permutation(NUM_SLOTS)[:T].astype(np.int32)  # block 0 included
    slots[np.asarray(pad_mask)] = PAD_SLOT_ID
    args = ("fp8", np.float32(0.37), np.asarray([0.5, 2.0], np.float32)) if fp8 else ()
    want = expected_flash(key, value, kc, vc, slots, fp8, *args[1:])
    for backend in BACKENDS:
        got = run_flash(backend, key, value, kc, vc, slots, *args)
        assert_bitwise(got[0], want[0], f"key_cache ({backend})")
        assert_bitwise(got[1], want[1], f"value_cache ({backend})")


# --------------------------------------------------------------------------
# torch differential (kvjax.testing.torch_ref)
# --------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("fp8", [False, True], ids=["auto", "fp8"])
def test_flash_matches_torch(seed, fp8):
    torch_ref = pytest.importorskip("kvjax.testing.torch_ref.kv_write")
    rng = np.random.default_rng(seed)
    key, value, kc, vc = flash_inputs(rng, ml_dtypes.bfloat16, fp8=fp8, scale=100.0)
    slots = random_slots(rng, T, num_pad=seed + 1)
    k_scale = np.asarray([0.5, 0.9], np.float32) if seed % 2 else np.asarray([0.3], np.float32)
    v_scale = np.asarray([1.7], np.float32)
    args = ("fp8", k_scale, v_scale) if fp8 else ()
    tk, tv = to_torch(kc), to_torch(vc)
    torch_ref.reshape_and_cache_flash(
        to_torch(key), to_torch(value), tk, tv, to_torch(slots.astype(np.int64)),
        *(("fp8", to_torch(k_scale), to_torch(v_scale)) if fp8 else ()),
    )
    for backend in BACKENDS:
        got = run_flash(backend, key, value, kc, vc, slots, *args)
        assert_bitwise(got[0], torch_bits(tk), f"key_cache ({backend})")
        assert_bitwise(got[1], torch_bits(tv), f"value_cache ({backend})")


@pytest.mark.parametrize("fp8", [False, True], ids=["auto", "fp8"])
def test_mla_matches_torch(fp8):
    torch_ref = pytest.importorskip("kvjax.testing.torch_ref.kv_write")
    rng = np.random.default_rng(7)
    kv_c, k_pe, cache = mla_inputs(rng, ml_dtypes.bfloat16, fp8)
    slots = random_slots(rng, 6, num_pad=2)
    scale = np.asarray([0.45], np.float32)
    tc = to_torch(cache)
    torch_ref.concat_and_cache_mla(
        to_torch(kv_c), to_torch(k_pe), tc, to_torch(slots), *(("fp8", to_torch(scale)) if fp8 else ())
    )
    for backend in BACKENDS:
        got = concat_and_cache_mla(kv_c, k_pe, cache, slots, *(("fp8", scale) if fp8 else ()), backend=backend)
        assert_bitwise(got, torch_bits(tc), f"kv_cache ({backend})")


# --------------------------------------------------------------------------
# value checks (concrete) and static checks (trace time)
# --------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_of_range_slot_is_rejected_when_concrete(backend, rng):
    key, value, kc, vc = flash_inputs(rng)
    slots = np.asarray([3, NUM_SLOTS, -1], np.int32)
    msg = re.escape("slot_mapping values must be in [0, 16)") + r".*got 16 at index 1"
    with pytest.raises(ValueError, match=msg):
        reshape_and_cache_flash(key, value, kc, vc, slots, backend=backend)
    kv_c, k_pe, cache = mla_inputs(rng)
    with pytest.raises(ValueError, match=r"got 99 at index 0"):
        concat_and_cache_mla(kv_c, k_pe, cache, np.asarray([99], np.int32), backend=backend)


def test_repeated_slot_is_rejected_when_concrete(rng):
    key, value, kc, vc = flash_inputs(rng)
    with pytest.raises(ValueError, match="must not repeat a valid slot.*slot 5 at indices 0 and 2"):
        reshape_and_cache_flash_reference(key, value, kc, vc, np.asarray([5, -1, 5, -1], np.int32))
    # Repeated PAD is fine.
    reshape_and_cache_flash_reference(key, value, kc, vc, np.asarray([-1, -1, 5], np.int32))


def flash_shapes(**override):
    shapes = dict(
        key=((T, H, D), jnp.bfloat16),
        value=((T, H, D), jnp.bfloat16),
        key_cache=((NB, BS, H, D), jnp.bfloat16),
        value_cache=((NB, BS, H, D), jnp.bfloat16),
        slot_mapping=((T,), jnp.int32),
    )
    shapes.update(override)
    return [jax.ShapeDtypeStruct(*shapes[k]) for k in shapes]


STATIC_ERRORS = [
    ({"key": ((T, H * D), jnp.bfloat16)}, r"key must have rank 3, got shape \(8, 32\)"),
    ({"value": ((T, H, D + 1), jnp.bfloat16)}, r"value must have shape \[8, 2, 16\], got \[8, 2, 17\]"),
    ({"value": ((T, H, D), jnp.float32)}, "value must have dtype bfloat16, got float32"),
    ({"key_cache": ((NB, BS, H + 1, D), jnp.bfloat16)}, r"key_cache must have shape \[\*, \*, 2, 16\]"),
    ({"value_cache": ((NB + 1, BS, H, D), jnp.bfloat16)}, r"value_cache must have shape \[4, 4, 2, 16\]"),
    ({"key_cache": ((NB, BS, H, D), jnp.float32)}, "key_cache must have the dtype of key"),
    ({"slot_mapping": ((T + 1,), jnp.int32)}, "slot_mapping must not be longer than the number of tokens"),
    ({"slot_mapping": ((T,), jnp.float32)}, "slot_mapping must have dtype int32 or int64, got float32"),
    ({"slot_mapping": ((T, 1), jnp.int32)}, "slot_mapping must have rank 1"),
]


@pytest.mark.parametrize("override,match", STATIC_ERRORS)
def test_flash_static_errors_at_trace_time(override, match):
    fn = lambda *a: reshape_and_cache_flash(*a, backend="pallas_tpu")  # noqa: E731
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(fn, *flash_shapes(**override))


def test_flash_kv_cache_dtype_and_scale_errors():
    fp8_cache = ((NB, BS, H, D), jnp.float8_e4m3fn)
    args = flash_shapes(key_cache=fp8_cache, value_cache=fp8_cache)
    one = jax.ShapeDtypeStruct((1,), jnp.float32)

    def trace(kv_cache_dtype, k_scale, v_scale, args=args):
        def fn(*a, k_scale=k_scale, v_scale=v_scale):
            return reshape_and_cache_flash(*a, kv_cache_dtype, k_scale, v_scale)

        scales = {k: s for k, s in (("k_scale", k_scale), ("v_scale", v_scale)) if s is not None}
        return jax.eval_shape(lambda a, kw: fn(*a, **kw), args, scales)

    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of .*got 'fp8_e5m2'"):
        trace("fp8_e5m2", one, one)
    with pytest.raises(ValueError, match="k_scale is required"):
        trace("fp8", None, one)
    with pytest.raises(ValueError, match=r"v_scale must have shape \[\] or \[1\] or \[2\], got \[3\]"):
        trace("fp8", one, jax.ShapeDtypeStruct((3,), jnp.float32))
    with pytest.raises(ValueError, match="k_scale must have dtype float32, got bfloat16"):
        trace("fp8", jax.ShapeDtypeStruct((1,), jnp.bfloat16), one)
    with pytest.raises(ValueError, match="key_cache must have dtype float8_e4m3fn"):
        trace("fp8", one, one, args=flash_shapes())
    with pytest.raises(ValueError, match="key_cache must have the dtype of key"):
        trace("auto", None, None)
    key, value, kc, vc, _ = (jnp.zeros(s.shape, s.dtype) for s in args)
    slots = np.full((T,), PAD_SLOT_ID, np.int32)
    with pytest.raises(ValueError, match=r"k_scale must be finite and > 0.*got \[0.0\]"):
        reshape_and_cache_flash(key, value, kc, vc, slots, "fp8", np.zeros(1, np.float32), 1.0)


def test_mla_static_errors():
    kv_c = jax.ShapeDtypeStruct((T, L), jnp.bfloat16)
    k_pe = jax.ShapeDtypeStruct((T, R), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((NB, BS, L + R), jnp.bfloat16)
    slots = jax.ShapeDtypeStruct((T,), jnp.int32)

    def trace(*a, kv_cache_dtype="auto", scale=None):
        return jax.eval_shape(lambda *x: concat_and_cache_mla(*x, kv_cache_dtype, scale), *a)

    with pytest.raises(ValueError, match=r"kv_cache must have shape \[\*, \*, 24\], got \[4, 4, 23\]"):
        trace(kv_c, k_pe, jax.ShapeDtypeStruct((NB, BS, L + R - 1), jnp.bfloat16), slots)
    with pytest.raises(ValueError, match=r"k_pe must have shape \[8, \*\], got \[7, 8\]"):
        trace(kv_c, jax.ShapeDtypeStruct((T - 1, R), jnp.bfloat16), cache, slots)
    fp8_cache = jax.ShapeDtypeStruct((NB, BS, L + R), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"scale must have shape \[\] or \[1\], got \[2\]"):
        trace(kv_c, k_pe, fp8_cache, slots, kv_cache_dtype="fp8", scale=jnp.ones(2, jnp.float32))
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        trace(kv_c, k_pe, cache, slots, kv_cache_dtype="int8")


# --------------------------------------------------------------------------
# in place: one kernel launch, donated caches aliased to the outputs
# --------------------------------------------------------------------------


def count_pallas_calls(jaxpr) -> int:
    n = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            n += 1
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            n += count_pallas_calls(sub)
    return n


@pytest.mark.parametrize("backend", ["pallas_tpu", "pallas_gpu"])
def test_one_pallas_call_for_key_and_value(backend):
    jaxpr = jax.make_jaxpr(lambda *a: reshape_and_cache_flash(*a, backend=backend))(*flash_shapes())
    assert count_pallas_calls(jaxpr.jaxpr) == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_donated_caches_are_updated_in_place(backend, rng):
    key, value, _, _ = flash_inputs(rng)
    # float32 and large enough to see a copy (XLA:CPU upcasts bfloat16/float8
    # caches around the reference's scatter; see _reference_write).
    kc = poisoned_cache(rng, (64, BS, H, D), np.float32)
    vc = poisoned_cache(rng, (64, BS, H, D), np.float32)
    slots = np.asarray([5, -1, 9], np.int32)
    want = expected_flash(key, value, kc, vc, slots)
    fn = jax.jit(lambda *a: reshape_and_cache_flash(*a, backend=backend), donate_argnums=(2, 3))
    kc_dev, vc_dev = jnp.asarray(kc), jnp.asarray(vc)
    # XLA:CPU's default fusion emitters (not the suite's): the copies of the program a user gets
    compiled = fn.lower(key, value, kc_dev, vc_dev, slots).compile(DEFAULT_FUSION_OPTIONS)
    pointers = kc_dev.unsafe_buffer_pointer(), vc_dev.unsafe_buffer_pointer()
    got = fn(key, value, kc_dev, vc_dev, slots)
    assert (got[0].unsafe_buffer_pointer(), got[1].unsafe_buffer_pointer()) == pointers
    assert_bitwise(got[0], want[0], "key_cache")
    if backend != "pallas_gpu":  # generic interpret mode pads refs (a copy) to emulate masks
        assert compiled.memory_analysis().temp_size_in_bytes < kc.nbytes
