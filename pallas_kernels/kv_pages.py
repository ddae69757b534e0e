"""``write_kv_pages``: the KV write for JAX's ragged-paged-attention cache layout.

JAX's ``ragged_paged_attention`` (and the serving stacks built on it) read one
cache per layer, ``kv_pages [num_pages, page_size, 2 * H, D]``, with K and V
interleaved on the combined-heads axis: K of kv head ``h`` at ``2h``, V at
``2h + 1``. Sub-32-bit caches may also be kept packed,
``[num_pages, page_size, 2 * H // packing, packing, D]`` with
``packing = 4 // itemsize``; combined head ``c`` lives at ``[c // packing,
c % packing]``, so both ranks hold the same elements in the same row-major
order and the op picks the layout from the cache's rank.

Token ``t < N = slot_mapping.shape[0]`` with slot ``s = slot_mapping[t]`` writes
the row ``kv_pages[s // page_size, s % page_size]``. The slot, fp8 and bounds
rules are those of :func:`pallas_kernels.kv_write.reshape_and_cache_flash`
(the same check functions run): a negative slot writes nothing, a slot beyond
the cache is a ``ValueError`` when concrete and writes nothing under ``jit``,
valid slots must be distinct, every other byte of the cache is unchanged.

Implementations (``backend=`` as for every op): the combined row of a token
(``[2H, D]``, K and V interleaved, fp8-quantised with per-combined-head scales)
is one contiguous row of the cache, so the write is the single-destination
case of the paged KV write: the jnp reference scatters rows, the TPU (Mosaic)
kernel issues one DMA per token into the HBM cache aliased to its output, the
GPU (Triton) kernel stores rows with masked stores. All alias the cache to the
output: donate it at the enclosing ``jit`` to write in place.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import _backend
from pallas_kernels import contract as validation
from pallas_kernels import kv_write

__all__ = ["interleave_kv", "kv_packing", "write_kv_pages", "write_kv_pages_reference"]

_ONE_ROW = (kv_write._Segment(0, 0),)


def kv_packing(dtype) -> int:
    """Elements of ``dtype`` per 32-bit word (1 for 32-bit, 2 for bf16, 4 for fp8)."""
    return max(1, 4 // np.dtype(dtype).itemsize)


def _check_pages(key, value, kv_pages, slot_mapping, kv_cache_dtype, k_scale, v_scale):
    """Static checks, value checks where concrete; returns ``(slot_mapping, scale_row)``.

    ``scale_row``: float32 ``[2H, D]`` (interleaved K/V scales) for fp8, else None.
    """
    mode = kv_write._storage_mode(kv_cache_dtype)
    validation.check_rank("key", key, 3)
    num_tokens, num_heads, head_size = np.shape(key)
    validation.check_shape("value", value, (num_tokens, num_heads, head_size))
    validation.check_dtype("key", key, "floating")
    validation.check_dtype("value", value, np.dtype(key.dtype))
    validation.check_rank("kv_pages", kv_pages, (4, 5))
    kv_write._check_cache_dtype("kv_pages", kv_pages, mode, "key", key.dtype)
    combined = 2 * num_heads
    if np.ndim(kv_pages) == 4:
        validation.check_shape("kv_pages", kv_pages, (None, None, combined, head_size))
    else:
        packing = kv_packing(kv_pages.dtype)
        if packing == 1 or combined % packing:
            raise ValueError(
                f"kv_pages of rank 5 (packed layout) needs a sub-32-bit dtype whose packing "
                f"divides 2 * num_kv_heads = {combined}; got dtype "
                f"{np.dtype(kv_pages.dtype)} (packing {packing})"
            )
        validation.check_shape(
            "kv_pages", kv_pages, (None, None, combined // packing, packing, head_size)
        )
    num_pages, page_size = np.shape(kv_pages)[:2]
    slot_mapping = kv_write._check_slot_mapping(slot_mapping, num_tokens, num_pages, page_size)
    if mode == "auto":
        return slot_mapping, None
    k, v = (
        kv_write._scale_array(name, s, (1, num_heads))
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale))
    )
    per_head = jnp.stack(
        [jnp.broadcast_to(k, (num_heads,)), jnp.broadcast_to(v, (num_heads,))], axis=1
    ).reshape(combined)
    return slot_mapping, jnp.broadcast_to(per_head[:, None], (combined, head_size))


def interleave_kv(key, value):
    """``[T, H, D]`` K and V -> ``[T, 2H, D]`` with K of head h at ``2h``, V at ``2h + 1``."""
    t, h, d = key.shape
    return jnp.stack([key, value], axis=2).reshape(t, 2 * h, d)


@functools.partial(jax.jit, static_argnames=("choice",))
def _write_pages(slot_mapping, key, value, kv_pages, scale_row, *, choice):
    row_shape = kv_pages.shape[2:]
    rows = interleave_kv(key, value).reshape((key.shape[0],) + row_shape)
    scales = None if scale_row is None else (scale_row.reshape(row_shape),)
    (out,) = kv_write._write(
        choice,
        slot_mapping,
        (rows,),
        (kv_pages,),
        scales,
        segments=_ONE_ROW,
        config=kv_write.KVWriteConfig(),
    )
    return out


def write_kv_pages(
    key,  # [T, H, D]
    value,  # [T, H, D]
    kv_pages,  # [num_pages, page_size, 2H, D] or [num_pages, page_size, 2H // p, p, D]
    slot_mapping,  # int32 | int64 [N], N <= T
    kv_cache_dtype: str = "auto",
    k_scale=None,  # float32 [], [1] or [H] (fp8 only)
    v_scale=None,  # float32 [], [1] or [H] (fp8 only)
    *,
    backend: str = "auto",
    interpret: bool | None = None,
):
    """Write K/V of the first ``N`` tokens into a ragged-paged-attention cache.

    ``kv_pages[s // page_size, s % page_size, 2h] = key[t, h]`` and
    ``[..., 2h + 1] = value[t, h]`` for ``t < N`` and ``s = slot_mapping[t]`` in
    ``[0, num_pages * page_size)`` (rank-5 packed caches: the same elements,
    combined head ``c`` at ``[c // packing, c % packing]``). A negative slot
    (``PAD_SLOT_ID``) writes nothing; an out-of-range one is a ``ValueError``
    when concrete and writes nothing under ``jit``.

    Args:
      key, value: ``[T, H, D]``, one float dtype.
      kv_pages: ``[num_pages, page_size, 2H, D]``, or for a sub-32-bit dtype the
        packed ``[num_pages, page_size, 2H // packing, packing, D]``
        (``packing = 4 // itemsize``); dtype of ``key`` for ``"auto"``,
        ``float8_e4m3fn`` for ``"fp8"``/``"fp8_e4m3"``.
      slot_mapping: int32 or int64 ``[N]`` with ``N <= T``; valid slots unique.
      kv_cache_dtype: ``"auto"``, ``"fp8"`` or ``"fp8_e4m3"``.
      k_scale, v_scale: fp8 only: float32 scalar, ``[1]`` or per-head ``[H]``;
        the stored value is ``saturate(x / scale)``.
      backend, interpret: see :mod:`pallas_kernels._backend`.

    Returns:
      ``kv_pages``, updated. Donate it to update in place.

    Raises:
      ValueError: bad shape/dtype/``kv_cache_dtype`` (at trace time), or a
        concrete ``slot_mapping`` with a slot beyond the cache or a repeated
        slot, or a concrete scale that is not finite and positive.
    """
    choice = _backend.choose(kv_write.OP_WRITE, backend, interpret)
    slot_mapping, scale_row = _check_pages(
        key, value, kv_pages, slot_mapping, kv_cache_dtype, k_scale, v_scale
    )
    return _write_pages(
        slot_mapping,
        key,
        value,
        kv_pages,
        scale_row,
        choice=choice,
    )


def write_kv_pages_reference(
    key, value, kv_pages, slot_mapping, kv_cache_dtype="auto", k_scale=None, v_scale=None
):
    """Plain-XLA :func:`write_kv_pages` (same contract and checks)."""
    return write_kv_pages(
        key, value, kv_pages, slot_mapping, kv_cache_dtype, k_scale, v_scale, backend="reference"
    )
