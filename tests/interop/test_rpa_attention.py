"""write_kv_pages + rpa_metadata checked against JAX's own ragged paged attention.

A random step (prefill, prefill chunk over cached history, decodes, padded rows,
padded tokens) is written with ``write_kv_pages`` into a cache whose null page
and unallocated pages are NaN (allocated pages zeroed with ``zero_blocks``, as
kvjax does for fresh blocks), described with ``rpa_metadata``, and attended by
JAX's ``ref_ragged_paged_attention`` and by its TPU kernel in TPU interpret
mode. Both are compared with a dense float64 attention computed here from the
K/V arrays themselves (never read back from the cache). The cache is compared
bit for bit with the NaN cache plus exactly the written rows.
"""

from __future__ import annotations

import functools

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu import ragged_paged_attention as jax_rpa
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as _tpu_interp
from jax._src.pallas.mosaic.interpret import utils as _interp_utils
from jax._src.state import indexing as _state_indexing
from jax._src.state import types as _state_types

from kvjax.interop import rpa_metadata, rpa_slot_mapping
from kvjax.models.attention import ragged_paged_attention_xla
from kvjax.testing.asserts import assert_bitwise
from kvjax.constants import PAD_SLOT_ID
from pallas_kernels import write_kv_pages, zero_blocks

FP8 = ml_dtypes.float8_e4m3fn
HQ, HKV, PS, NP = 4, 2, 4, 16
SM_SCALE = 0.3


def np_fp8(x, scale):
    y = np.clip(x.astype(np.float32) / np.float32(scale), -448.0, 448.0)
    return y.astype(FP8)


def make_step(seed, *, head_dim, fp8, holes=False):
    """A random step: per batch row (kv_len, q_len) or None for a padded row."""
    rng = np.random.default_rng(seed)
    # A full prefill, a chunk of 3 over 7 cached tokens, two decodes. The lengths are fixed
    # (JAX's reference runs op by op: equal shapes compile once); pages and values are random.
    rows = [(7, 7), (10, 3), (5, 1), (9, 1)]
    rows = [rows[0], None, rows[1], rows[2], None, rows[3]] if holes else rows + [None, None]
    width = 4
    free = list(rng.permutation(np.arange(1, NP)))
    table = np.zeros((len(rows), width), np.int32)
    seq_lens, idx, qsl = [], [], [0]
    for b, r in enumerate(rows):
        if r is None:
            seq_lens.append(0), idx.append(-1), qsl.append(qsl[-1])
            table[b] = rng.integers(0, NP, width)  # stale ids in a padded row
            continue
        kv_len, q_len = r
        n_pages = -(-kv_len // PS)
        table[b, :n_pages] = [free.pop() for _ in range(n_pages)]
        seq_lens.append(kv_len), idx.append(b), qsl.append(qsl[-1] + q_len)
    num_tokens = qsl[-1] + 3  # 3 padded tokens
    k_all = [rng.standard_normal((r[0], HKV, head_dim)).astype(np.float32) if r else None for r in rows]
    v_all = [rng.standard_normal((r[0], HKV, head_dim)).astype(np.float32) if r else None for r in rows]
    q = rng.standard_normal((num_tokens, HQ, head_dim)).astype(np.float32)
    q[qsl[-1]:] = np.nan  # padded query tokens carry garbage
    return dict(
        rows=rows, table=table, seq_lens=np.asarray(seq_lens, np.int32),
        idx=np.asarray(idx, np.int32), qsl=np.asarray(qsl, np.int32),
        k_all=k_all, v_all=v_all, q=q, num_tokens=num_tokens, head_dim=head_dim,
        scales=(0.05, 0.04) if fp8 else None,
    )


def fill_cache(step, zero_fresh=True):
    """NaN cache, allocated pages zeroed, history then this step written with write_kv_pages.

    Returns ``(kv_pages, expected_pages, metadata)``.
    """
    d, scales = step["head_dim"], step["scales"]
    dtype = FP8 if scales else np.float32
    pages = np.full((NP, PS, 2 * HKV, d), np.nan, np.float32).astype(dtype)
    allocated = np.unique(step["table"][step["idx"] >= 0])
    allocated = allocated[allocated > 0]
    want = pages.copy()
    pages_dev = pages
    if zero_fresh:  # kvjax zeroes fresh blocks; without it, page tails stay NaN
        (pages_dev,) = zero_blocks([pages], allocated.astype(np.int32))
        want[allocated] = 0
    fp8_args = ("fp8", scales[0], scales[1]) if scales else ()

    # History (tokens cached before this step): one write, slots by hand.
    hist = [(b, p) for b, r in enumerate(step["rows"]) if r is not None for p in range(r[0] - r[1])]
    slots = np.asarray([step["table"][b, p // PS] * PS + p % PS for b, p in hist], np.int32)
    k_hist = np.stack([step["k_all"][b][p] for b, p in hist])
    v_hist = np.stack([step["v_all"][b][p] for b, p in hist])
    pages_dev = write_kv_pages(k_hist, v_hist, pages_dev, slots, *fp8_args, backend="reference")

    m = rpa_metadata(step["qsl"], step["seq_lens"], step["table"], step["idx"] >= 0, page_size=PS)
    T = step["num_tokens"]
    slot_mapping = rpa_slot_mapping(m, page_size=PS, num_tokens=T)
    key = np.full((T, HKV, d), np.nan, np.float32)  # padded tokens: NaN garbage
    value = np.full((T, HKV, d), np.nan, np.float32)
    for b, r in enumerate(step["rows"]):
        if r is None:
            continue
        t0, t1 = step["qsl"][b], step["qsl"][b + 1]
        key[t0:t1] = step["k_all"][b][r[0] - r[1]:]
        value[t0:t1] = step["v_all"][b][r[0] - r[1]:]
    pages_dev = write_kv_pages(key, value, pages_dev, slot_mapping, *fp8_args, backend="reference")

    # Expected cache: every token of every sequence at its slot, nothing else.
    for b, r in enumerate(step["rows"]):
        if r is None:
            continue
        for p in range(r[0]):
            for h in range(HKV):
                k, v = step["k_all"][b][p, h], step["v_all"][b][p, h]
                if scales:
                    k, v = np_fp8(k, scales[0]), np_fp8(v, scales[1])
                page, off = step["table"][b, p // PS], p % PS
                want[page, off, 2 * h], want[page, off, 2 * h + 1] = k, v
    sm = np.asarray(slot_mapping)
    assert (sm[step["qsl"][-1]:] == PAD_SLOT_ID).all()
    return np.asarray(pages_dev), want, m


def dense_attention(step):
    """float64 causal GQA attention per sequence, from the K/V arrays (fp8: dequantised)."""
    out = []
    g = HQ // HKV
    for b, r in enumerate(step["rows"]):
        if r is None:
            continue
        kv_len, q_len = r
        k, v = step["k_all"][b].astype(np.float64), step["v_all"][b].astype(np.float64)
        if step["scales"]:
            k = np_fp8(step["k_all"][b], step["scales"][0]).astype(np.float64) * step["scales"][0]
            v = np_fp8(step["v_all"][b], step["scales"][1]).astype(np.float64) * step["scales"][1]
        q = step["q"][step["qsl"][b]:step["qsl"][b + 1]].astype(np.float64)
        kh, vh = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)  # q head h -> kv head h // g
        s = np.einsum("qhd,khd->hqk", q, kh) * SM_SCALE
        qpos = kv_len - q_len + np.arange(q_len)
        s = np.where(np.arange(kv_len)[None, None, :] <= qpos[None, :, None], s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out.append(np.einsum("hqk,khd->qhd", p, vh))
    return np.concatenate(out)


def run_ref(step, pages, m):
    kw = dict(sm_scale=SM_SCALE)
    if step["scales"]:
        kw.update(k_scale=float(step["scales"][0]), v_scale=float(step["scales"][1]))
    return np.asarray(jax_rpa.ref_ragged_paged_attention(step["q"], pages, *m.as_args(), **kw))


@pytest.mark.parametrize("seed, fp8", [(0, False), (1, True), (2, False)], ids=["f32", "fp8", "f32-holes"])
def test_reference_rpa_matches_dense(seed, fp8):
    step = make_step(seed, head_dim=8, fp8=fp8, holes=seed == 2)
    pages, want, m = fill_cache(step)
    assert_bitwise(pages, want, "kv_pages")
    got = run_ref(step, pages, m)
    dense = dense_attention(step)
    assert got.shape == dense.shape
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, dense, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("seed, fp8", [(0, True), (2, False)], ids=["fp8", "f32-holes"])
def test_xla_rpa_matches_jax_reference_with_nan_page_tails(seed, fp8):
    """kvjax's jit-able ragged_paged_attention_xla == JAX's reference; padded rows 0.

    Pages are not zeroed here, so the unwritten tail of every page is NaN: the
    masking on values keeps it out (JAX's reference slices it away).
    """
    step = make_step(seed, head_dim=8, fp8=fp8, holes=seed == 2)
    pages, want, m = fill_cache(step, zero_fresh=False)
    assert_bitwise(pages, want, "kv_pages")
    kw = dict(sm_scale=SM_SCALE)
    if fp8:
        kw.update(k_scale=step["scales"][0], v_scale=step["scales"][1])
    got = np.asarray(jax.jit(functools.partial(ragged_paged_attention_xla, **kw))(step["q"], pages, m))
    n = int(step["qsl"][-1])
    assert np.isfinite(got).all()
    assert not got[n:].any()
    np.testing.assert_allclose(got[:n], run_ref(step, pages, m), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[:n], dense_attention(step), rtol=2e-5, atol=2e-5)


# JAX's TPU kernel in TPU interpret mode (pltpu.force_tpu_interpret_mode, on CPU).
#
# Two gaps of JAX's TPU interpreter (jax._src.pallas.mosaic.interpret; the same in
# jax 0.10.2, 0.11.2 and 0.12.0) stand between it and this kernel:
#
# 1. The kernel reads its K/V VMEM buffer through a reshaped ref, always
#    (ragged_paged_attention/kernel.py: ``kv_ref = cur_async_copy_kv.wait().reshape(
#    ...)`` then ``kv_ref[start::step, :]``; bf16/fp8 pages add ``ref.bitcast(
#    jnp.uint32)``). The interpreter's ``get`` turns a ref's transforms into one index
#    range with ``interpret/utils.py: to_range``, which assumes every transform is an
#    NDIndexer (``transform.indices``): "'ReshapeTransform' object has no attribute
#    'indices'". No block size, dtype or head layout avoids the reshape, and the
#    generic ``interpret=True`` (HLO interpreter) fails too (its swap discharge rule on
#    a literal index: "'TypedInt' object has no attribute 'shape'"). So this test
#    (only) swaps the interpreter's ``get`` for one that reads the range before the
#    first reshape/bitcast with the interpreter's own ``get`` and applies the rest with
#    numpy (a bitcast packs the second-minor axis, as on TPU). It is applied only
#    while ``to_range`` cannot take a ReshapeTransform.
# 2. ``interpret/shared_memory.py: swap_buffer_content`` builds the in-bounds mask of a
#    masked store with ``in_bounds_mask[in_bounds_shape[i]:] = False`` for every axis
#    ``i``, always slicing axis 0, so the kernel's masked store into
#    ``acc_ref.at[:, h:h + G, :]`` (shape ``(num_queries_per_block, G, head_dim)``,
#    G = query heads per KV head) is reported out of bounds whenever
#    ``num_queries_per_block > G``. Avoided by configuration:
#    ``num_queries_per_block = G``.


def _interpreter_reads_reshaped_refs() -> bool:
    try:
        _interp_utils.to_range([_state_types.ReshapeTransform((1,))])
    except AttributeError:
        return False
    return True


def _np_ref_bitcast(x: np.ndarray, dtype) -> np.ndarray:
    """TPU ref bitcast to a wider dtype: ``r`` consecutive rows (second-minor) per element."""
    dtype = np.dtype(dtype)
    r = dtype.itemsize // x.dtype.itemsize
    if r < 1 or dtype.itemsize % x.dtype.itemsize:
        raise NotImplementedError(f"test interpreter patch: bitcast {x.dtype} -> {dtype}")
    y = x.reshape(*x.shape[:-2], x.shape[-2] // r, r, x.shape[-1]).swapaxes(-1, -2)
    return np.ascontiguousarray(y).view(dtype)[..., 0]


_interpreter_get = _tpu_interp.get


def _get_through_ref_views(token, device_id, local_core_id, memory_space, buffer_id, transforms,
                           *args, **kwargs):
    """The interpreter's ``get``, plus reshape/bitcast ref transforms (gap 1 above)."""
    views = (_state_types.ReshapeTransform, _state_types.BitcastTransform)
    first = next((i for i, t in enumerate(transforms) if isinstance(t, views)), len(transforms))
    token, x = _interpreter_get(
        token, device_id, local_core_id, memory_space, buffer_id, transforms[:first], *args, **kwargs
    )
    x = np.asarray(x)
    for t in transforms[first:]:
        if isinstance(t, _state_types.ReshapeTransform):
            x = x.reshape(t.shape)
        elif isinstance(t, _state_types.BitcastTransform):
            x = _np_ref_bitcast(x, t.dtype)
        elif isinstance(t, _state_indexing.NDIndexer):
            x = x[_interp_utils.to_range([jax.tree.map(int, t)])]
        else:
            raise NotImplementedError(f"test interpreter patch: ref transform {type(t).__name__}")
    return token, x


# DMAs call ``get.__wrapped__`` (the read without the failure bookkeeping); theirs are plain indexers.
_get_through_ref_views.__wrapped__ = _interpreter_get.__wrapped__


@pytest.fixture
def tpu_interpreter(monkeypatch):
    if not _interpreter_reads_reshaped_refs():
        monkeypatch.setattr(_tpu_interp, "get", _get_through_ref_views)
    yield
    jax_rpa.ragged_paged_attention.clear_cache()  # its traces hold the patched reader


@pytest.mark.parametrize(
    "seed, fp8, holes, zero_fresh",
    [(3, False, False, True), (4, True, False, True), (5, False, True, False)],
    ids=["f32", "fp8", "f32-holes-nan-page-tails"],
)
def test_tpu_kernel_in_interpret_mode_matches_reference(tpu_interpreter, seed, fp8, holes, zero_fresh):
    """JAX's TPU kernel == its reference == dense, with the null page (and page tails) NaN."""
    step = make_step(seed, head_dim=128, fp8=fp8, holes=holes)
    pages, want, m = fill_cache(step, zero_fresh=zero_fresh)
    assert_bitwise(pages, want, "kv_pages")
    kw = dict(sm_scale=SM_SCALE)
    if fp8:
        kw.update(k_scale=float(step["scales"][0]), v_scale=float(step["scales"][1]))
    n = int(step["qsl"][-1])
    with pltpu.force_tpu_interpret_mode():
        out = jax_rpa.ragged_paged_attention(
            step["q"], pages, *m.as_args(), **kw,
            num_kv_pages_per_block=2, num_queries_per_block=HQ // HKV,  # gap 2 above
        )
        out = np.asarray(out)
    assert out.shape == step["q"].shape
    assert np.isfinite(out[:n]).all()
    np.testing.assert_allclose(out[:n], run_ref(step, pages, m), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out[:n], dense_attention(step), rtol=2e-5, atol=2e-5)
