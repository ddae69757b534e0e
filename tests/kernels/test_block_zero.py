"""zero_blocks: every backend against numpy, whole arrays, bitwise.

Runs the jnp reference, the TPU kernel in TPU interpret mode (race detector
on) and the GPU kernel in generic interpret mode. Arrays start as random data
with NaN in the null block 0; the expectation zeroes kernel blocks
``b*r .. b*r + r - 1`` with a plain Python loop.
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

from pallas_kernels.block_zero import zero_blocks, zero_blocks_reference
from kvjax.testing.asserts import assert_bitwise, assert_no_races, bits  # noqa: E402
from kvjax.testing.convert import to_numpy, to_torch  # noqa: E402
from kvjax.testing.fast_compile import DEFAULT_FUSION_OPTIONS  # noqa: E402


def torch_bits(t):
    return bits(to_numpy(t))

BACKENDS = ("reference", "pallas_tpu", "pallas_gpu")
FP8 = ml_dtypes.float8_e4m3fn
NKB = 8  # kernel blocks per array


# K/V-like arrays of one pool: different dtypes and trailing shapes, same axis 0.
ARRAY_SPECS = (
    ((NKB, 4, 2, 8), np.float32),
    ((NKB, 4, 2, 8), ml_dtypes.bfloat16),
    ((NKB, 4, 16), FP8),
    ((NKB, 3), np.int32),
    ((NKB,), np.float32),
)


def poisoned_arrays(rng, specs=ARRAY_SPECS):
    out = []
    for shape, dtype in specs:
        if np.dtype(dtype) == np.dtype(FP8):
            a = rng.integers(1, 256, size=shape, dtype=np.uint8)
            a[0] = 0x7F
            a = a.view(FP8)
        elif np.issubdtype(np.dtype(dtype), np.integer):
            a = rng.integers(1, 1000, size=shape).astype(dtype)
            a[0] = -1
        else:
            a = (rng.standard_normal(shape) + 3.0).astype(dtype)  # never 0
            a[0] = np.nan
        out.append(a)
    return out


def expected(arrays, block_ids, r):
    out = [a.copy() for a in arrays]
    for b in np.asarray(block_ids).tolist():
        if b < 0:
            continue
        for a in out:
            a[b * r : b * r + r] = 0
    return out


def check(got, want):
    assert len(got) == len(want)
    for k, (g, w) in enumerate(zip(got, want)):
        assert_bitwise(g, w, f"caches[{k}]")


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "r,ids",
    [
        (1, [3, -1, 7, 5, -1]),  # padding inside and at the tail, last block
        (2, [1, -1, 3, -1, -1]),  # logical 3 is kernel blocks 6, 7 (the last)
        (4, [-1, 1, 1, -1, -1]),  # a repeated id is harmless
    ],
)
def test_zeroes_exactly_the_kernel_blocks(backend, r, ids, rng):
    arrays = poisoned_arrays(rng)
    block_ids = np.asarray(ids, np.int32)
    got = zero_blocks(arrays, block_ids, kernel_blocks_per_block=r, backend=backend)
    check(got, expected(arrays, block_ids, r))
    assert_no_races(backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_padding_leaves_arrays_bitwise_unchanged(backend, rng):
    arrays = poisoned_arrays(rng)
    got = zero_blocks(arrays, np.full((5,), -1, np.int32), kernel_blocks_per_block=2, backend=backend)
    check(got, arrays)
    assert np.isnan(np.asarray(got[0])[0]).all()  # the null block keeps its poison


@pytest.mark.parametrize("backend", BACKENDS)
def test_null_block_is_never_zeroed(backend, rng):
    """Block 0 (NULL_BLOCK_ID): ValueError when concrete, zeroes nothing under jit."""
    arrays = poisoned_arrays(rng)
    with pytest.raises(ValueError, match="block_ids must not contain the null block 0.*index 1"):
        zero_blocks(arrays, np.asarray([1, 0, -1], np.int32), backend=backend)
    fn = jax.jit(lambda a, ids: zero_blocks(a, ids, backend=backend))
    got = fn(arrays, np.asarray([0, 2, -1, 0, -1], np.int32))
    check(got, expected(arrays, np.asarray([-1, 2, -1, -1, -1]), 1))
    assert np.isnan(np.asarray(got[0])[0]).all()  # the null block keeps its poison


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_of_range_ids_under_jit_zero_nothing(backend, rng):
    arrays = poisoned_arrays(rng)
    block_ids = np.asarray([4, 1, 2**31 - 1, 5, -1], np.int32)  # r = 2: ids 4, 5 and 2**31-1 are out
    fn = jax.jit(lambda a, ids: zero_blocks(a, ids, kernel_blocks_per_block=2, backend=backend))
    got = fn(arrays, block_ids)
    check(got, expected(arrays, np.asarray([-1, 1, -1, -1, -1]), 2))


@pytest.mark.parametrize("backend", BACKENDS)
def test_int64_ids(backend, rng):
    arrays = poisoned_arrays(rng)
    ids = np.asarray([2, -(2**32) + 1, -(2**40), 3, -1], np.int64)
    want = expected(arrays, ids, 2)
    check(zero_blocks(arrays, ids, kernel_blocks_per_block=2, backend=backend), want)
    with jax.enable_x64(True):
        got = zero_blocks(arrays, jnp.asarray(ids), kernel_blocks_per_block=2, backend=backend)
        check(got, want)
        # Traced: 2**32 + 1 must not wrap to block 1.
        fn = jax.jit(lambda a, i: zero_blocks(a, i, kernel_blocks_per_block=2, backend=backend))
        got = fn(arrays, jnp.asarray([2**32 + 1, -1, -1, -1, -1], jnp.int64))
        check(got, arrays)


@pytest.mark.parametrize("backend", BACKENDS)
def test_container_type_is_kept(backend, rng):
    arrays = poisoned_arrays(rng, ARRAY_SPECS[:2])
    ids = np.asarray([1, -1, -1, -1, -1], np.int32)
    assert isinstance(zero_blocks(arrays, ids, backend=backend), list)
    assert type(zero_blocks(tuple(arrays), ids, backend=backend)) is tuple
    assert zero_blocks([], ids, backend=backend) == []
    got = zero_blocks(arrays, np.zeros((0,), np.int32), backend=backend)
    check(got, arrays)


def test_reference_function_is_the_reference_backend(rng):
    arrays = poisoned_arrays(rng)
    ids = np.asarray([2, -1, 1], np.int32)
    check(zero_blocks_reference(arrays, ids, kernel_blocks_per_block=2), expected(arrays, ids, 2))


@hypothesis.settings(max_examples=6, deadline=None, derandomize=True)
@hypothesis.given(
    ids=st.lists(st.integers(-3, NKB // 2 - 1).filter(bool), min_size=5, max_size=5),  # 0: null
    seed=st.integers(0, 2**32 - 1),
)
def test_random_ids(ids, seed):
    arrays = poisoned_arrays(np.random.default_rng(seed))
    block_ids = np.asarray(ids, np.int32)
    want = expected(arrays, block_ids, 2)
    for backend in BACKENDS:
        got = zero_blocks(arrays, block_ids, kernel_blocks_per_block=2, backend=backend)
        check(got, want)


# --------------------------------------------------------------------------
# torch differential
# --------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(3))
def test_matches_torch(seed):
    torch_ref = pytest.importorskip("kvjax.testing.torch_ref.block_zero")
    rng = np.random.default_rng(seed)
    arrays = poisoned_arrays(rng)
    r = (1, 2, 4)[seed]
    ids = rng.integers(-2, NKB // r, size=5).astype(np.int32)
    ids[ids == 0] = -1  # the null block is not an id to zero
    tarrays = torch_ref.zero_blocks([to_torch(a) for a in arrays], to_torch(ids), r)
    for backend in BACKENDS:
        got = zero_blocks(arrays, ids, kernel_blocks_per_block=r, backend=backend)
        for k, (g, t) in enumerate(zip(got, tarrays)):
            assert_bitwise(g, torch_bits(t), f"caches[{k}] ({backend})")


# --------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------


def test_out_of_range_id_is_rejected_when_concrete(rng):
    arrays = poisoned_arrays(rng)
    msg = re.escape("block_ids values must be in [0, 4)") + r".*got 4 at index 2"
    for backend in BACKENDS:
        with pytest.raises(ValueError, match=msg):
            zero_blocks(arrays, np.asarray([1, -1, 4], np.int32), kernel_blocks_per_block=2, backend=backend)


def test_static_errors():
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
    ids = jax.ShapeDtypeStruct((3,), jnp.int32)

    def trace(caches, block_ids=ids, r=1):
        return jax.eval_shape(lambda c, i: zero_blocks(c, i, kernel_blocks_per_block=r), caches, block_ids)

    with pytest.raises(ValueError, match=r"same axis-0 size.*caches\[0\] has 8, caches\[1\] has 6"):
        trace([f32(8, 4), f32(6, 4)])
    with pytest.raises(ValueError, match="multiple of kernel_blocks_per_block; got num_kernel_blocks=6"):
        trace([f32(6, 4)], r=4)
    with pytest.raises(ValueError, match="kernel_blocks_per_block must be an int >= 1, got 0"):
        trace([f32(8, 4)], r=0)
    with pytest.raises(ValueError, match="block_ids must have dtype int32 or int64, got float32"):
        trace([f32(8, 4)], block_ids=f32(3))
    with pytest.raises(ValueError, match=r"block_ids must have rank 1, got shape \(3, 1\)"):
        trace([f32(8, 4)], block_ids=jax.ShapeDtypeStruct((3, 1), jnp.int32))
    with pytest.raises(ValueError, match=r"caches\[1\] must have a float or integer dtype, got bool"):
        trace([f32(8, 4), jax.ShapeDtypeStruct((8,), jnp.bool_)])
    with pytest.raises(ValueError, match="caches must be a list or tuple of arrays, got dict"):
        zero_blocks({"k": jnp.zeros((8, 4))}, jnp.zeros((1,), jnp.int32))


# --------------------------------------------------------------------------
# one launch, in place
# --------------------------------------------------------------------------


def count_pallas_calls(jaxpr) -> int:
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name == "pallas_call"
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            n += count_pallas_calls(sub)
    return n


@pytest.mark.parametrize("backend", ["pallas_tpu", "pallas_gpu"])
def test_one_pallas_call_for_all_arrays(backend):
    shapes = [jax.ShapeDtypeStruct(s, d) for s, d in ARRAY_SPECS]
    ids = jax.ShapeDtypeStruct((5,), jnp.int32)
    jaxpr = jax.make_jaxpr(lambda c, i: zero_blocks(c, i, kernel_blocks_per_block=2, backend=backend))(shapes, ids)
    assert count_pallas_calls(jaxpr.jaxpr) == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_donated_arrays_are_updated_in_place(backend, rng):
    # float32/int32: XLA:CPU upcasts bfloat16/float8 arrays around the reference's
    # scatter (its copy, not ours), so those dtypes would fail the size check there.
    arrays = poisoned_arrays(rng, [((512, 4, 2, 8), np.float32), ((512, 4, 16), np.int32)])
    ids = np.asarray([3, -1, 7], np.int32)
    want = expected(arrays, ids, 2)
    fn = jax.jit(lambda c, i: zero_blocks(c, i, kernel_blocks_per_block=2, backend=backend), donate_argnums=0)
    dev = [jnp.asarray(a) for a in arrays]
    # XLA:CPU's default fusion emitters (not the suite's): the copies of the program a user gets
    compiled = fn.lower(dev, ids).compile(DEFAULT_FUSION_OPTIONS)
    pointers = [a.unsafe_buffer_pointer() for a in dev]
    got = fn(dev, ids)
    assert [g.unsafe_buffer_pointer() for g in got] == pointers
    check(got, want)
    if backend != "pallas_gpu":  # generic interpret mode pads refs (a copy) to emulate masks
        assert compiled.memory_analysis().temp_size_in_bytes < arrays[1].nbytes


@pytest.mark.parametrize("max_programs", [1, 3, 10])
def test_gpu_programs_loop_over_column_tiles(max_programs, rng):
    """With fewer programs than column tiles (``gpu_max_programs``), each GPU program zeroes
    every ``P``-th tile of its id's row: the widest row's tiles all zeroed, narrower arrays'
    too, padding and the null block untouched (bitwise against numpy). 256-byte tiles on rows
    of 512-2048 bytes make 2-8 tiles a row. Planted: one tile per program -> fails."""
    from pallas_kernels.block_zero import ZeroBlocksConfig

    specs = (((NKB, 16, 32), np.float32), ((NKB, 4, 2, 8), ml_dtypes.bfloat16), ((NKB, 3), np.int32))
    arrays = poisoned_arrays(rng, specs)
    ids = np.asarray([3, -1, 7, 5], np.int32)
    cfg = ZeroBlocksConfig(gpu_tile_bytes=256, gpu_max_programs=max_programs)
    got = zero_blocks([jnp.asarray(a) for a in arrays], ids, backend="pallas_gpu", config=cfg)
    check(got, expected(arrays, ids, 1))


def test_zero_blocks_config_refuses_no_programs():
    from pallas_kernels.block_zero import ZeroBlocksConfig

    with pytest.raises(ValueError, match="gpu_max_programs must be an int >= 1, got 0"):
        ZeroBlocksConfig(gpu_max_programs=0)


def test_gpu_kernel_lowers_for_cuda(verified_triton_modules):
    """The GPU kernel (its early exit and column loop) lowers for CUDA from this CPU and its
    Triton module passes the MLIR verifier, for a loop of several tiles and for one."""
    from pallas_kernels.block_zero import ZeroBlocksConfig
    from tests.cuda_lowering import lower_for_cuda

    shapes = [jax.ShapeDtypeStruct(s, d) for s, d in ARRAY_SPECS]
    ids = jax.ShapeDtypeStruct((5,), jnp.int32)
    for cfg in (ZeroBlocksConfig(gpu_tile_bytes=256, gpu_max_programs=5), ZeroBlocksConfig()):
        text = lower_for_cuda(lambda c, i, cfg=cfg: zero_blocks(c, i, backend="pallas_gpu", interpret=False,
                                                                config=cfg), shapes, ids)
        assert text.count("custom_call") == 1
    assert len(verified_triton_modules) == 2
