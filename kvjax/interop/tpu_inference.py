"""tpu-inference's slice-encoded KV-cache update, on kvjax's slot-mapped writer.

tpu-inference (vLLM's JAX/TPU backend) describes a step's KV write as *slices*:
``slices`` int32 ``[3, S]`` holding, per slice ``i``, ``(kv_cache_start,
new_kv_start, slice_len)``: tokens ``new_kv_start .. new_kv_start + slice_len - 1``
of ``new_kv`` go to cache rows ``kv_cache_start .. kv_cache_start + slice_len - 1``
of a flat cache ``[num_pages * page_size, combined_heads, head_dim]``; only the
first ``num_slices[0]`` slices are real. Its cache update
(``kernels/ragged_paged_attention/v2/ragged_kv_cache_update.py``) rejects, with
its host-side check on, a negative start, a length outside ``(0, page_size]``, a
slice past ``new_kv`` or the cache, a slice crossing a page, gaps between the
``new_kv`` slices and overlapping cache slices.

:func:`slices_to_slot_mapping` converts that description once into kvjax's
per-token slot mapping (``PAD_SLOT_ID`` for every token no real slice covers),
with the same checks as ``ValueError`` when the inputs are concrete; under
``jit`` a malformed slice writes nothing (overlaps are then unspecified, as in
tpu-inference without its check). :func:`kv_cache_update` is the drop-in update:
tpu-inference's arguments and cache layout, written by
:func:`pallas_kernels.write_kv_pages` (any backend).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.constants import PAD_SLOT_ID
from pallas_kernels import contract as validation
from pallas_kernels import write_kv_pages

__all__ = ["kv_cache_update", "slices_to_slot_mapping"]

_FIELDS = ("kv_cache_start", "new_kv_start", "slice_len")


def _positive_int(name: str, value) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _check_slices(slices, num_slices) -> None:
    validation.check_rank("slices", slices, 2)
    validation.check_shape("slices", slices, (3, None))
    validation.check_dtype("slices", slices, "integer")
    validation.check_shape("num_slices", num_slices, (1,))
    validation.check_dtype("num_slices", num_slices, "integer")
    validation.check_values_in_range("num_slices", num_slices, 0, np.shape(slices)[1] + 1)


def _validate_values(s: np.ndarray, n: int, num_tokens: int, num_cache_tokens: int,
                     page_size: int) -> None:
    """tpu-inference's host-side checks of the first ``n`` slices, as ``ValueError``."""
    s = s.astype(np.int64)
    for i in range(n):
        cache_start, new_start, length = (int(v) for v in s[:, i])
        where = f"slices[:, {i}] = (kv_cache_start, new_kv_start, slice_len) = " \
                f"({cache_start}, {new_start}, {length})"
        if new_start < 0:
            raise ValueError(f"{where}: new_kv_start must be >= 0, got {new_start}")
        if cache_start < 0:
            raise ValueError(f"{where}: kv_cache_start must be >= 0, got {cache_start}")
        if not 0 < length <= page_size:
            raise ValueError(f"{where}: slice_len must be in [1, page_size={page_size}], got {length}")
        if new_start + length > num_tokens:
            raise ValueError(
                f"{where}: new_kv_start + slice_len must be <= the {num_tokens} tokens of "
                f"new_kv, got {new_start + length}"
            )
        if cache_start + length > num_cache_tokens:
            raise ValueError(
                f"{where}: kv_cache_start + slice_len must be <= the {num_cache_tokens} rows "
                f"of kv_cache (beyond the cache), got {cache_start + length}"
            )
        if cache_start // page_size != (cache_start + length - 1) // page_size:
            raise ValueError(
                f"{where}: a slice must lie in one page of {page_size} rows, got rows "
                f"{cache_start}..{cache_start + length - 1} (pages {cache_start // page_size} "
                f"and {(cache_start + length - 1) // page_size})"
            )
    new = sorted((int(s[1, i]), int(s[1, i] + s[2, i]), i) for i in range(n))
    for (_, end, i), (start, _, j) in zip(new, new[1:]):
        if end != start:
            raise ValueError(
                f"slices: the new_kv slices must be contiguous (each starts where the previous "
                f"ends); slice {i} ends at token {end}, the next, slice {j}, starts at {start}"
            )
    cache = sorted((int(s[0, i]), int(s[0, i] + s[2, i]), i) for i in range(n))
    for (a, end, i), (start, b, j) in zip(cache, cache[1:]):
        if end > start:
            raise ValueError(
                f"slices: kv_cache slices must not overlap; slice {i} covers rows [{a}, {end}) "
                f"and slice {j} rows [{start}, {b})"
            )


def slices_to_slot_mapping(
    slices,  # int [3, S]: (kv_cache_start, new_kv_start, slice_len) per slice
    num_slices,  # int [1]
    *,
    num_tokens: int,
    page_size: int,
    num_cache_tokens: int,
) -> jax.Array:
    """int32 ``[num_tokens]``: the slot of each ``new_kv`` token, ``PAD_SLOT_ID`` if none.

    Token ``new_kv_start[i] + j`` (``j < slice_len[i]``, ``i < num_slices[0]``) goes to
    slot ``kv_cache_start[i] + j``, i.e. row ``j`` of the flat cache. Jit-able.

    Args:
      slices: integer ``[3, S]``, rows ``kv_cache_start``, ``new_kv_start``, ``slice_len``.
      num_slices: integer ``[1]`` in ``[0, S]``; slices past it are padding (ignored).
      num_tokens: tokens of ``new_kv`` (static).
      page_size: rows per page; a slice lies in one page (static).
      num_cache_tokens: rows of the flat cache, ``num_pages * page_size`` (static).

    Raises:
      ValueError: bad shapes or dtypes; with concrete ``slices`` and ``num_slices``, a
        real slice with a negative start, a length outside ``[1, page_size]``, past
        ``new_kv`` or the cache, or crossing a page, gaps between the ``new_kv``
        slices, or overlapping cache slices (tpu-inference's checks). Under ``jit``
        a slice failing a per-slice check writes nothing.
    """
    page_size = _positive_int("page_size", page_size)
    num_cache_tokens = _positive_int("num_cache_tokens", num_cache_tokens)
    if isinstance(num_tokens, (bool, np.bool_)) or not isinstance(num_tokens, (int, np.integer)) or num_tokens < 0:
        raise ValueError(f"num_tokens must be a non-negative int, got {num_tokens!r}")
    num_tokens = int(num_tokens)
    _check_slices(slices, num_slices)
    s_np, n_np = validation.concrete_values(slices), validation.concrete_values(num_slices)
    if s_np is not None and n_np is not None:
        _validate_values(s_np, int(n_np[0]), num_tokens, num_cache_tokens, page_size)
    # Range checks happened above when concrete; traced values beyond int32 become -1 (masked).
    sl = jnp.asarray(validation.as_int32("slices", slices, fill=-1))
    cache_start, new_start, length = sl[0], sl[1], sl[2]
    n = jnp.asarray(num_slices, jnp.int32)[0]
    real = jnp.arange(sl.shape[1], dtype=jnp.int32) < n
    # Per-slice checks without overflow: every bound is compared, never summed past int32.
    ok = (
        real
        & (new_start >= 0)
        & (cache_start >= 0)
        & (length > 0)
        & (length <= page_size)
        & (new_start <= num_tokens - length)
        & (cache_start <= num_cache_tokens - length)
        & (cache_start % page_size <= page_size - length)
    )
    j = jnp.arange(page_size, dtype=jnp.int32)[None, :]
    live = ok[:, None] & (j < length[:, None])  # [S, page_size]
    token = jnp.where(live, new_start[:, None] + j, num_tokens)  # num_tokens: dropped
    slot = cache_start[:, None] + j
    out = jnp.full((num_tokens,), PAD_SLOT_ID, jnp.int32)
    return out.at[token.reshape(-1)].set(slot.reshape(-1).astype(jnp.int32), mode="drop")


def kv_cache_update(
    new_kv,  # [T, C, D], C = 2 * num_kv_heads (K of head h at 2h, V at 2h + 1)
    slices,  # int [3, S]
    kv_cache,  # [num_pages * page_size, C, D]
    num_slices,  # int [1]
    *,
    page_size: int,
    backend: str = "auto",
    interpret: bool | None = None,
):
    """tpu-inference's ``kv_cache_update`` on kvjax's writer: returns the updated ``kv_cache``.

    Same arguments, layout and checks as tpu-inference's (with its host-side
    validation always on for concrete inputs); the slices become a slot mapping once
    (:func:`slices_to_slot_mapping`) and :func:`pallas_kernels.write_kv_pages` writes
    the combined rows. Rows no real slice names are unchanged, bitwise. Donate
    ``kv_cache`` at the enclosing ``jit`` to update it in place.

    Raises:
      ValueError: as :func:`slices_to_slot_mapping`; ``new_kv`` / ``kv_cache`` not
        rank 3 with the same combined-head and head dims, an odd combined-head count,
        or a cache whose rows are not a whole number of pages.
    """
    page_size = _positive_int("page_size", page_size)
    validation.check_rank("new_kv", new_kv, 3)
    validation.check_dtype("new_kv", new_kv, "floating")
    t, c, d = np.shape(new_kv)
    if c % 2:
        raise ValueError(
            f"new_kv must have an even combined-head count (K and V interleaved), got shape "
            f"{list(np.shape(new_kv))}"
        )
    validation.check_rank("kv_cache", kv_cache, 3)
    validation.check_shape("kv_cache", kv_cache, (None, c, d))
    rows = np.shape(kv_cache)[0]
    if rows % page_size:
        raise ValueError(
            f"kv_cache must hold a whole number of pages of page_size={page_size} rows, got "
            f"shape {list(np.shape(kv_cache))}"
        )
    slots = slices_to_slot_mapping(
        slices, num_slices, num_tokens=t, page_size=page_size, num_cache_tokens=rows
    )
    new_kv = jnp.asarray(new_kv)
    pages = jnp.asarray(kv_cache).reshape(rows // page_size, page_size, c, d)
    pages = write_kv_pages(
        new_kv[:, 0::2], new_kv[:, 1::2], pages, slots, backend=backend, interpret=interpret
    )
    return pages.reshape(rows, c, d)
