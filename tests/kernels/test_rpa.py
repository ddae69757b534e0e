"""``pallas_kernels.ragged_paged_attention``: malformed steps, on every flavour.

Issue 25, item 2: with concrete page indices outside ``[0, num_pages)`` the XLA reference
clamped (too large) or wrapped (negative) and returned another page's attention. Now a
concrete bad page among the columns a real row reads is a ``ValueError`` naming the
argument, the range and the value; under ``jit`` the row attends to nothing (its tokens'
outputs are 0) on every flavour, and no other page is read in its place. Every page that
no real row owns (the null page 0, the last page, the unwritten tails) is NaN, so a
wrong page shows as NaN. The TPU flavour is JAX's kernel in TPU interpret mode, with the
interpreter patch of ``tests/interop/test_rpa_attention.py`` (its gaps 1 and 2).
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import jax
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import rpa

HQ, HKV, D, PS, W, NP = 4, 2, 128, 4, 4, 16
ROWS = [(6, 2), (5, 5), (9, 1), None]  # (kv_len, q_len) per row; None: padded row
SM_SCALE = 0.1
# JAX's TPU kernel in the interpreter: num_queries_per_block = query heads per KV head.
TPU_BLOCKS = dict(num_kv_pages_per_block=2, num_queries_per_block=HQ // HKV)


def make_step(seed=0):
    """A step whose real rows own distinct pages 1..NP-2; every other byte of the cache NaN.

    Columns a row does not read (and the padded row) hold out-of-range garbage: only the
    columns ``c < cdiv(kv_len, PS)`` of real rows are ever checked or read.
    """
    rng = np.random.default_rng(seed)
    pages = np.full((NP, PS, 2 * HKV, D), np.nan, np.float32)
    table = np.array([[NP + 7, -1, NP, 2**31 - 1]] * len(ROWS), np.int32)
    free = list(rng.permutation(np.arange(1, NP - 1)))
    kv_lens, cu = [], [0]
    for i, r in enumerate(ROWS):
        if r is None:
            kv_lens.append(0), cu.append(cu[-1])
            continue
        kv_len, q_len = r
        for c in range(-(-kv_len // PS)):
            table[i, c] = p = free.pop()
            n = min(PS, kv_len - c * PS)
            pages[p, :n] = rng.standard_normal((n, 2 * HKV, D))
        kv_lens.append(kv_len), cu.append(cu[-1] + q_len)
    T = cu[-1] + 2  # two padded tokens
    q = rng.standard_normal((T, HQ, D)).astype(np.float32)
    q[cu[-1]:] = np.nan
    num_seqs = np.array([sum(r is not None for r in ROWS)], np.int32)
    return dict(q=q, pages=pages, kv_lens=np.array(kv_lens, np.int32), table=table,
                cu=np.array(cu, np.int32), num_seqs=num_seqs)


def args(s, **changes):
    s = {**s, **changes}
    return s["q"], s["pages"], s["kv_lens"], s["table"], s["cu"], s["num_seqs"]


def tokens_of(s, row):
    return slice(int(s["cu"][row]), int(s["cu"][row + 1]))


def _load_interop_patch():
    path = pathlib.Path(__file__).resolve().parents[1] / "interop" / "test_rpa_attention.py"
    spec = importlib.util.spec_from_file_location("_rpa_interpreter_patch", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def tpu_interpreter(monkeypatch):
    patch = _load_interop_patch()
    if not patch._interpreter_reads_reshaped_refs():
        monkeypatch.setattr(patch._tpu_interp, "get", patch._get_through_ref_views)
    yield
    patch.jax_rpa.ragged_paged_attention.clear_cache()  # its traces hold the patched reader
    jax.clear_caches()


def run(s, backend, *, jit=True, **changes):
    kw = dict(sm_scale=SM_SCALE, backend=backend, **(TPU_BLOCKS if backend == "pallas_tpu" else {}))
    f = lambda *a: pk.ragged_paged_attention(*a, **kw)  # noqa: E731
    return np.asarray((jax.jit(f) if jit else f)(*args(s, **changes)))


# --------------------------------------------------------------------------
# Concrete steps: ValueError naming the argument, the range and the value
# --------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [NP, NP + 1000, -1, -NP, 2**31 - 1])
def test_concrete_out_of_range_page_is_a_value_error(bad):
    s = make_step()
    table = s["table"].copy()
    table[1, 1] = bad  # row 1 (kv_len 5) reads columns 0 and 1
    with pytest.raises(ValueError, match=rf"page_indices must be in \[0, {NP}\) .* got {bad} "
                                         rf"at \[1, 1\]"):
        pk.ragged_paged_attention(*args(s, table=table), backend="reference")


def test_concrete_int64_page_is_checked_before_narrowing():
    s = make_step()
    table = s["table"].astype(np.int64)
    table[2, 0] = 2**32 + int(table[2, 0])  # would read as the right page once wrapped to int32
    with pytest.raises(ValueError, match=rf"page_indices must be in \[0, {NP}\) .* at \[2, 0\]"):
        pk.ragged_paged_attention(*args(s, table=table), backend="reference")


def test_unread_columns_and_padded_rows_are_not_checked_nor_read():
    s = make_step()
    got = run(s, "reference", jit=False)
    clean = np.where(np.arange(W)[None, :] < -(-s["kv_lens"][:, None] // PS), s["table"], 0)
    clean[3] = 0  # the padded row
    assert got.tobytes() == run(s, "reference", jit=False, table=clean.astype(np.int32)).tobytes()
    assert np.isfinite(got).all()


@pytest.mark.parametrize("change, match", [
    (dict(num_seqs=np.array([5], np.int32)), r"num_seqs must have values in \[0, 5\); got 5"),
    (dict(cu=np.array([1, 3, 8, 9, 9], np.int32)), r"cu_q_lens\[0\] must be 0, got 1"),
    (dict(cu=np.array([0, 3, 2, 9, 9], np.int32)), r"cu_q_lens.* must be non-decreasing; got 3 then 2"),
    (dict(cu=np.array([0, 2, 7, 20, 20], np.int32)), r"cu_q_lens\[num_seqs=3\] must be <= the 10 query"),
    (dict(kv_lens=np.array([6, 4, 9, 0], np.int32)), r"kv_lens\[1\] must be in \[q_len 5, 16\]"),
    (dict(kv_lens=np.array([6, 5, 17, 0], np.int32)), r"kv_lens\[2\] must be in \[q_len 1, 16\]"),
])
def test_concrete_malformed_steps_are_value_errors(change, match):
    with pytest.raises(ValueError, match=match):
        pk.ragged_paged_attention(*args(make_step(), **change), backend="reference")


def test_static_arguments_are_checked():
    s = make_step()
    with pytest.raises(ValueError, match=r"k_scale must be finite and > 0"):
        pk.ragged_paged_attention(*args(s), k_scale=0.0, backend="reference")
    with pytest.raises(ValueError, match="num_queries_per_block must be None or an int >= 1"):
        pk.ragged_paged_attention(*args(s), num_queries_per_block=0, backend="reference")
    with pytest.raises(ValueError, match=r"kv_pages must have head_dim 128 .* got shape"):
        pk.ragged_paged_attention(s["q"], s["pages"][..., :64], *args(s)[2:], backend="reference")
    with pytest.raises(ValueError, match="head_dim must be a multiple of 128 .* got 64"):
        pk.ragged_paged_attention(s["q"][..., :64], s["pages"][..., :64], *args(s)[2:],
                                  backend="pallas_tpu", interpret=True)


# --------------------------------------------------------------------------
# Under jit: masked alike on every flavour, never another page's data
# --------------------------------------------------------------------------


def _break(s, how):
    """The step with row 1 broken as ``how`` says (or unchanged for "none")."""
    table, kv_lens = s["table"].copy(), s["kv_lens"].copy()
    if how.startswith("page="):
        table[1, 1] = int(how[5:])
    elif how == "kv_len_beyond_its_pages":
        kv_lens[1] = W * PS + 3
    return dict(table=table, kv_lens=kv_lens)


def _check_masked(s, got, want_valid, how, exact):
    assert np.isfinite(got).all(), f"{how}: NaN: another (poisoned) page was read"
    n = int(s["cu"][-1])
    assert not got[n:].any(), f"{how}: padded tokens must be 0"
    if how != "none":
        assert not got[tokens_of(s, 1)].any(), f"{how}: the broken row must attend to nothing"
    for row in (0, 2) if how != "none" else (0, 1, 2):
        sl = tokens_of(s, row)
        if exact:
            assert got[sl].tobytes() == want_valid[sl].tobytes(), (how, row)
        else:
            np.testing.assert_allclose(got[sl], want_valid[sl], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("how", ["none", f"page={NP}", "page=-1", f"page={NP + 1000}",
                                 "kv_len_beyond_its_pages"])
def test_reference_masks_a_broken_row_under_jit(how):
    s = make_step()
    want = run(s, "reference")
    _check_masked(s, run(s, "reference", **_break(s, how)), want, how, exact=True)


@pytest.mark.parametrize("how", ["none", f"page={NP}", "page=-1"])
def test_tpu_kernel_masks_a_broken_row_like_the_reference(tpu_interpreter, how):
    s = make_step()
    want = run(s, "reference")
    got = run(s, "pallas_tpu", **_break(s, how))
    _check_masked(s, got, want, how, exact=False)
    ref = run(s, "reference", **_break(s, how))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)  # identical masking


def test_positions_come_from_the_rpa_arrays():
    s = make_step()
    pos = np.asarray(rpa.token_positions(s["kv_lens"], s["cu"], s["num_seqs"], num_tokens=10))
    # row 0: last 2 of 6; row 1: all 5; row 2: last 1 of 9; two padded tokens.
    assert pos.tolist() == [4, 5, 0, 1, 2, 3, 4, 8, 0, 0]
