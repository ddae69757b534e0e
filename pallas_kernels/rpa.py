"""``ragged_paged_attention``: attention over JAX's ragged-paged-attention cache layout.

The op behind JAX's ``jax.experimental.pallas.ops.tpu.ragged_paged_attention``, registered
here (op ``"ragged_paged_attention"``) so that no model code picks an implementation:

* ``"reference"`` (every platform but a TPU, or ``backend="reference"``): plain XLA with
  static shapes, jit-able, masking on values, so NaN in page tails, unlisted pages or the
  null page never reaches an output;
* ``"tpu"``: JAX's Mosaic kernel (compiled on a TPU, or lowered for one off-chip with
  :mod:`pallas_kernels.tpu_target`'s block sizes; in TPU interpret mode, through
  ``pltpu.force_tpu_interpret_mode``, elsewhere). ``head_dim`` must be a multiple of 128.

The step (``R`` padded sequence rows, ``T`` query tokens; int32 or int64 arrays):

* ``kv_lens [R]``: tokens in sequence ``i``'s cache, this step's included;
* ``page_indices [R, W]``: the pages holding them, in order (page ``c`` holds positions
  ``c * page_size .. (c + 1) * page_size - 1``);
* ``cu_q_lens [R + 1]``: sequence ``i``'s queries are tokens ``cu_q_lens[i] ..
  cu_q_lens[i + 1] - 1``, the last ``q_len_i`` of its ``kv_lens[i]`` positions;
* ``num_seqs [1]``: rows ``i < num_seqs`` are real; the others are not read.

Query token ``cu_q_lens[i] + k`` sees positions ``0 .. kv_lens[i] - q_len_i + k``
(causal). The positions and the row of each token are derived here from these arrays.

Malformed steps. Concrete arrays are checked (``ValueError`` naming the argument, the
expected range and the value): ``num_seqs`` in ``[0, R]``, ``cu_q_lens`` from 0,
non-decreasing, at most ``T``; ``kv_lens[i]`` in ``[q_len_i, W * page_size]``; and every
page a real row reads (columns ``c < cdiv(kv_lens[i], page_size)``) in ``[0, num_pages)``.
Under ``jit`` the same conditions are masked alike by every flavour: a real row that
breaks one of them (an out-of-range page among the columns it reads, a ``kv_len`` beyond
its pages or below its query count) attends to nothing — its tokens' outputs are 0, and no
other page's data is read in its place; ``num_seqs`` is clipped to ``[0, R]`` and
``cu_q_lens`` to non-decreasing values in ``[0, T]``. Tokens past ``cu_q_lens[num_seqs]``
(padding) are 0 on every flavour.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu import ragged_paged_attention as jax_rpa

from pallas_kernels import backend as _backend
from pallas_kernels import contract as validation
from pallas_kernels import tpu_target
from pallas_kernels.attention_math import masked_attention

__all__ = [
    "OP_RPA",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
    "token_positions",
]

OP_RPA = "ragged_paged_attention"


# --------------------------------------------------------------------------
# The step, read from the RPA arrays (shared by both flavours)
# --------------------------------------------------------------------------


def _step(kv_lens, page_indices, cu_q_lens, num_seqs, *, num_tokens: int, num_pages: int,
          page_size: int):
    """What every flavour needs to know about the step, masked as the module docstring says.

    Returns a dict of int32/bool arrays: ``num_seqs`` (clipped, ``[1]``), ``cu`` (``[R + 1]``,
    clipped, and repeating ``cu[num_seqs]`` past the real rows), ``real`` (``[T]``, a token
    of a real row), ``row`` (``[T]``, its row; 0 for padding), ``positions`` (``[T]``),
    ``row_ok`` (``[R]``: a real row that reads only valid pages), ``kv_lens`` (``[R]``,
    clipped to ``[0, W * page_size]``) and ``pages`` (``[R, W]``, out-of-range ids -> 0).
    """
    r, w = page_indices.shape
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    n = jnp.clip(jnp.asarray(num_seqs).reshape(-1)[0], 0, r).astype(jnp.int32)
    cu = jnp.clip(jnp.asarray(cu_q_lens), 0, num_tokens).astype(jnp.int32)
    cu = jax.lax.cummax(cu)
    rows1 = jnp.arange(r + 1, dtype=jnp.int32)
    cu = jnp.where(rows1 <= n, cu, cu[n])  # rows past num_seqs: no tokens
    # The row of each token: how many rows end at or before it.
    row_of = jnp.searchsorted(cu[1:], t, side="right", method="compare_all").astype(jnp.int32)
    real = t < cu[r]
    row = jnp.where(real, jnp.minimum(row_of, r - 1), 0)
    q_lens = cu[1:] - cu[:-1]
    raw_kv = jnp.asarray(kv_lens)
    kv = raw_kv.astype(jnp.int32)
    positions = jnp.where(real, kv[row] - q_lens[row] + (t - cu[row]), 0)
    # Rows that may be attended: real, kv_len in [q_len, W * page_size] (compared before
    # any narrowing), every page they read in [0, num_pages).
    is_real = jnp.arange(r, dtype=jnp.int32) < n
    kv_ok = (raw_kv >= q_lens.astype(raw_kv.dtype)) & (raw_kv <= w * page_size)
    pi = jnp.asarray(page_indices)
    page_ok = (pi >= 0) & (pi < num_pages)
    kv_safe = jnp.clip(raw_kv, 0, w * page_size).astype(jnp.int32)
    read = jnp.arange(w, dtype=jnp.int32)[None, :] < ((kv_safe + page_size - 1) // page_size)[:, None]
    row_ok = is_real & kv_ok & jnp.all(page_ok | ~read, axis=1)
    pages = jnp.where(page_ok, pi, 0).astype(jnp.int32)
    return dict(num_seqs=n.reshape(1), cu=cu, real=real, row=row, positions=positions,
                row_ok=row_ok, kv_lens=kv_safe, pages=pages)


def token_positions(kv_lens, cu_q_lens, num_seqs, *, num_tokens: int):
    """int32 ``[num_tokens]``: each query token's absolute position (0 for padding).

    Token ``cu_q_lens[i] + k`` of real sequence ``i`` is at ``kv_lens[i] - q_len_i + k``.
    """
    r = np.shape(kv_lens)[0]
    s = _step(kv_lens, jnp.zeros((r, 1), jnp.int32), cu_q_lens, num_seqs,
              num_tokens=num_tokens, num_pages=1, page_size=1)
    return s["positions"]


# --------------------------------------------------------------------------
# Argument checks
# --------------------------------------------------------------------------


def _check(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs):
    """Static checks, and value checks where the step's arrays are concrete."""
    validation.check_rank("q", q, 3)
    validation.check_dtype("q", q, "floating")
    num_tokens, num_q_heads, head_dim = np.shape(q)
    validation.check_rank("kv_pages", kv_pages, (4, 5))
    num_pages, page_size = np.shape(kv_pages)[:2]
    if np.shape(kv_pages)[-1] != head_dim:
        raise ValueError(f"kv_pages must have head_dim {head_dim} (q's) on its last axis, got "
                         f"shape {list(np.shape(kv_pages))}")
    combined = int(np.prod(np.shape(kv_pages)[2:-1]))
    if combined % 2 or num_q_heads % (combined // 2):
        raise ValueError(
            f"kv_pages must hold 2 * num_kv_heads combined heads with num_kv_heads dividing q's "
            f"{num_q_heads} heads; got {combined} combined heads (shape "
            f"{list(np.shape(kv_pages))})")
    validation.check_rank("page_indices", page_indices, 2)
    r, width = np.shape(page_indices)
    validation.check_shape("kv_lens", kv_lens, (r,))
    validation.check_shape("cu_q_lens", cu_q_lens, (r + 1,))
    validation.check_shape("num_seqs", num_seqs, (1,))
    for name, x in (("kv_lens", kv_lens), ("page_indices", page_indices),
                    ("cu_q_lens", cu_q_lens), ("num_seqs", num_seqs)):
        validation.check_dtype(name, x, (np.int32, np.int64))
    if r == 0:
        raise ValueError("page_indices must have at least one row, got shape [0, W]")
    n = validation.concrete_values(num_seqs)
    if n is None:
        return
    validation.check_values_in_range("num_seqs", n, 0, r + 1)
    n = int(n[0])
    cu = validation.concrete_values(cu_q_lens)
    if cu is None:
        return
    cu = cu[: n + 1].astype(np.int64)
    if cu[0] != 0:
        raise ValueError(f"cu_q_lens[0] must be 0, got {cu[0]}")
    validation.check_non_decreasing("cu_q_lens[:num_seqs + 1]", cu)
    if cu[-1] > num_tokens:
        raise ValueError(f"cu_q_lens[num_seqs={n}] must be <= the {num_tokens} query tokens "
                         f"of q, got {cu[-1]}")
    kv = validation.concrete_values(kv_lens)
    if kv is None:
        return
    kv = kv.astype(np.int64)
    for i in range(n):
        q_len = cu[i + 1] - cu[i]
        if not q_len <= kv[i] <= width * page_size:
            raise ValueError(
                f"kv_lens[{i}] must be in [q_len {q_len}, {width * page_size}] (its query "
                f"tokens, page_indices width {width} * page_size {page_size}), got {kv[i]}")
    pi = validation.concrete_values(page_indices)
    if pi is None:
        return
    for i in range(n):
        cols = -(-int(kv[i]) // page_size)
        bad = np.flatnonzero((pi[i, :cols] < 0) | (pi[i, :cols] >= num_pages))
        if bad.size:
            c = int(bad[0])
            raise ValueError(
                f"page_indices must be in [0, {num_pages}) (the pages of kv_pages) in the "
                f"columns a real row reads (c < cdiv(kv_lens[i], page_size={page_size})); got "
                f"{int(pi[i, c])} at [{i}, {c}]")


def _static_scale(name: str, scale) -> float | None:
    """A scale as a Python float (JAX's kernel takes it static), checked; None stays None."""
    if scale is None:
        return None
    v = validation.concrete_values(scale)
    if v is None:
        raise ValueError(f"{name} must be a Python float or a concrete scalar (a static value "
                         f"of the kernel), got a traced {type(scale).__name__}")
    if np.size(v) != 1 or not np.issubdtype(np.asarray(v).dtype, np.number):
        raise ValueError(f"{name} must be one number, got {v!r}")
    validation.check_fp8_scale(name, np.float32(np.asarray(v).reshape(())))
    return float(np.asarray(v).reshape(()))


# --------------------------------------------------------------------------
# Reference (plain XLA)
# --------------------------------------------------------------------------


@_backend.register(OP_RPA, "reference")
def _reference(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale, k_scale,
               v_scale, num_kv_pages_per_block, num_queries_per_block, interpret):
    """Each token gathers its row's pages and attends over them, masked on values
    (:func:`pallas_kernels.attention_math.masked_attention`)."""
    del num_kv_pages_per_block, num_queries_per_block, interpret
    T, _, D = q.shape
    num_pages, page_size = kv_pages.shape[:2]
    kv_pages = kv_pages.reshape(num_pages, page_size, -1, D)
    combined = kv_pages.shape[2]
    W = page_indices.shape[1]
    S = W * page_size
    s = _step(kv_lens, page_indices, cu_q_lens, num_seqs, num_tokens=T, num_pages=num_pages,
              page_size=page_size)
    row = s["row"]
    seen = s["real"] & s["row_ok"][row]
    j = jnp.arange(S, dtype=jnp.int32)
    visible = (seen[:, None] & (j[None, :] <= s["positions"][:, None])
               & (j[None, :] < s["kv_lens"][row][:, None]))
    kv = kv_pages[s["pages"][row]].reshape(T, S, combined, D)

    def split(x, scale):
        x = x.astype(jnp.float32)
        if scale is not None:
            x = (x * jnp.float32(scale)).astype(q.dtype)
        return x.astype(jnp.float32)

    k, v = split(kv[:, :, 0::2], k_scale), split(kv[:, :, 1::2], v_scale)
    return masked_attention(q, k, v, visible, sm_scale=sm_scale).astype(q.dtype)


# --------------------------------------------------------------------------
# TPU: JAX's Mosaic kernel
# --------------------------------------------------------------------------


@_backend.register(OP_RPA, "tpu")
def _tpu(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale, k_scale,
         v_scale, num_kv_pages_per_block, num_queries_per_block, interpret):
    """JAX's kernel on the masked step: every page id in range, ``kv_lens`` within the row's
    pages, ``cu_q_lens`` within ``q``; rows the step masks and padding tokens come out 0."""
    T = q.shape[0]
    num_pages, page_size = kv_pages.shape[:2]
    s = _step(kv_lens, page_indices, cu_q_lens, num_seqs, num_tokens=T, num_pages=num_pages,
              page_size=page_size)
    kw = dict(sm_scale=sm_scale, k_scale=k_scale, v_scale=v_scale)
    blocks = {k: v for k, v in (("num_kv_pages_per_block", num_kv_pages_per_block),
                                ("num_queries_per_block", num_queries_per_block))
              if v is not None}
    args = (q, kv_pages, s["kv_lens"], s["pages"], s["cu"], s["num_seqs"])
    if interpret:
        with pltpu.force_tpu_interpret_mode():
            out = jax_rpa.ragged_paged_attention(*args, **kw, **blocks)
    else:
        # Block sizes from the TPU target, not the local device (JAX's table asks it).
        kw.update(tpu_target.rpa_block_sizes(page_indices.shape[1], T))
        out = jax_rpa.ragged_paged_attention(*args, **(kw | blocks))
    keep = s["real"] & s["row_ok"][s["row"]]
    return jnp.where(keep[:, None, None], out, jnp.zeros((), out.dtype))


# --------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------


def ragged_paged_attention(
    q,  # [T, Hq, D]
    kv_pages,  # [num_pages, page_size, 2 * Hkv, D] or packed [.., 2 * Hkv // p, p, D]
    kv_lens,  # int32 | int64 [R]
    page_indices,  # int32 | int64 [R, W]
    cu_q_lens,  # int32 | int64 [R + 1]
    num_seqs,  # int32 | int64 [1]
    *,
    sm_scale: float = 1.0,
    k_scale: float | None = None,
    v_scale: float | None = None,
    backend: str = "auto",
    interpret: bool | None = None,
    num_kv_pages_per_block: int | None = None,
    num_queries_per_block: int | None = None,
):
    """Attention of each query token over its sequence's pages (see the module docstring).

    Args:
      q: ``[T, Hq, D]`` float queries.
      kv_pages: JAX's layout (:func:`pallas_kernels.write_kv_pages` writes it): K of kv
        head ``h`` at combined head ``2h``, V at ``2h + 1``; fp8 pages are read as
        ``float32(stored) * scale`` cast to ``q.dtype``.
      kv_lens, page_indices, cu_q_lens, num_seqs: the step (module docstring).
      sm_scale: score scale. k_scale, v_scale: fp8 dequantisation scales (Python floats,
        or concrete scalars: the kernel takes them static) or None.
      backend, interpret: see :mod:`pallas_kernels.backend` (a GPU runs the reference).
      num_kv_pages_per_block, num_queries_per_block: the TPU kernel's block sizes (None:
        the TPU target's when compiled, JAX's own choice in interpret mode).

    Returns:
      ``[T, Hq, D]`` in ``q.dtype``; tokens past ``cu_q_lens[num_seqs]`` and of masked rows 0.

    Raises:
      ValueError: bad shapes/dtypes, a scale that is not a finite positive number, a
        ``head_dim`` that is not a multiple of 128 for the TPU kernel, or (concrete) a
        malformed step: ``num_seqs``, ``cu_q_lens``, ``kv_lens`` or a page a real row
        reads out of range.
    """
    choice = _backend.choose(OP_RPA, backend, interpret)
    _check(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float, np.floating,
                                                               np.integer)):
        raise ValueError(f"sm_scale must be a Python float (a static value of the kernel), "
                         f"got {type(sm_scale).__name__}")
    static = dict(
        sm_scale=float(sm_scale),
        k_scale=_static_scale("k_scale", k_scale),
        v_scale=_static_scale("v_scale", v_scale),
        num_kv_pages_per_block=num_kv_pages_per_block,
        num_queries_per_block=num_queries_per_block,
    )
    for name in ("num_kv_pages_per_block", "num_queries_per_block"):
        v = static[name]
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer))
                              or v < 1):
            raise ValueError(f"{name} must be None or an int >= 1, got {v!r}")
    if choice.flavor == "tpu" and np.shape(q)[-1] % 128:
        # JAX's kernel asserts it deep inside; say so before lowering.
        raise ValueError(
            f"head_dim must be a multiple of 128 for JAX's ragged_paged_attention TPU kernel "
            f"(backend={backend!r}), got {np.shape(q)[-1]}")
    return _backend.run(OP_RPA, choice, q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                        **static)


def ragged_paged_attention_reference(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                                     sm_scale: float = 1.0, k_scale=None, v_scale=None):
    """Plain-XLA :func:`ragged_paged_attention` (same contract and checks)."""
    return ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                                  sm_scale=sm_scale, k_scale=k_scale, v_scale=v_scale,
                                  backend="reference")
