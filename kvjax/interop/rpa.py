"""kvjax's step batch <-> the metadata of JAX's ``ragged_paged_attention``.

JAX's ragged paged attention (``jax.experimental.pallas.ops.tpu.
ragged_paged_attention``, and the TPU serving stacks built on the same layout)
describes a step with four int32 arrays, for ``R`` padded sequence rows:

* ``kv_lens [R]``: tokens in each sequence's KV cache, this step's included;
* ``page_indices [R, pages_per_seq]``: the pages holding them, in order;
* ``cu_q_lens [R + 1]``: sequence ``i``'s queries are tokens
  ``cu_q_lens[i] .. cu_q_lens[i + 1] - 1``, the last ``q_len`` of its
  ``kv_len`` positions;
* ``num_seqs [1]``: how many rows are real; only those are read.

:func:`rpa_metadata` builds them from a kvjax step (``StepBatch`` fields);
:func:`rpa_positions` and :func:`rpa_slot_mapping` go back, for callers coming
from those stacks, through kvjax's own slot-mapping rule
(:func:`kvjax.state.block_tables.compute_slot_mapping`).

The rules (one place, here): real rows first, in batch order; padded rows get
``kv_lens = 0`` and an all-``NULL_BLOCK_ID`` page row; page columns past
``cdiv(kv_len, page_size)`` are ``NULL_BLOCK_ID``; ``cu_q_lens`` starts at 0, is
non-decreasing and repeats the real token count after the last real row;
``num_seqs`` is the real row count. Everything is jit-able; with concrete
inputs malformed batches raise ``ValueError``.

The null page. kvjax reserves page ``NULL_BLOCK_ID = 0``: nothing is ever
written there, and a real token whose page is 0 is an error. JAX's
ragged-paged-attention tests and tpu-inference hand page 0 to a real sequence.
Every function here takes ``null_block_id=``: ``NULL_BLOCK_ID`` (the default,
kvjax's rule), another page id (that page is the reserved one), or ``None``
(no null page: every page id ``>= 0`` is ordinary; padding is then filled with
page 0, which the kernel never reads past ``cdiv(kv_len, page_size)``). In
every mode a token past ``cu_q_lens[num_seqs]`` maps to ``PAD_SLOT_ID`` and
writes nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax.constants import NULL_BLOCK_ID, PAD_ROW_ID, PAD_SLOT_ID
from kvjax.state.block_tables import compute_slot_mapping
from kvjax.state.padding import token_rows
from pallas_kernels import contract as validation

__all__ = [
    "RPAMetadata",
    "rpa_batch_view",
    "rpa_metadata",
    "rpa_metadata_from_batch",
    "rpa_positions",
    "rpa_slot_mapping",
]


@struct.dataclass
class RPAMetadata:
    """The step description ``ragged_paged_attention`` takes (all int32).

    Attributes:
      kv_lens: ``[R]``, 0 for padded rows.
      page_indices: ``[R, pages_per_seq]``, ``NULL_BLOCK_ID`` past each row's pages.
      cu_q_lens: ``[R + 1]``, non-decreasing from 0.
      num_seqs: ``[1]``, the real row count.
    """

    kv_lens: jax.Array
    page_indices: jax.Array
    cu_q_lens: jax.Array
    num_seqs: jax.Array

    def as_args(self) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """``(kv_lens, page_indices, cu_q_lens, num_seqs)``, the kernel's argument order."""
        return self.kv_lens, self.page_indices, self.cu_q_lens, self.num_seqs


def _check_page_size(page_size) -> None:
    if not isinstance(page_size, (int, np.integer)) or isinstance(page_size, bool) or page_size <= 0:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")


def _check_null_block_id(null_block_id) -> int | None:
    """``None`` or the reserved page id as an int; ``ValueError`` otherwise."""
    if null_block_id is None:
        return None
    if isinstance(null_block_id, (bool, np.bool_)) or not isinstance(null_block_id, (int, np.integer)):
        raise ValueError(
            f"null_block_id must be an int page id or None (no null page), got {null_block_id!r}"
        )
    return int(null_block_id)


def _fill_page(null_block_id: int | None) -> int:
    """The page id written where no page is live: the null page, or page 0 without one."""
    return 0 if null_block_id is None else null_block_id


def rpa_metadata(
    query_start_loc: jax.Array,
    seq_lens: jax.Array,
    block_table: jax.Array,
    row_valid: jax.Array,
    *,
    page_size: int,
    null_block_id: int | None = NULL_BLOCK_ID,
) -> RPAMetadata:
    """RPA metadata of one step of one KV-cache group. Jit-able.

    Args:
      query_start_loc: int ``[R + 1]``, non-decreasing from 0 (batch row ``b``'s
        tokens are ``query_start_loc[b] .. query_start_loc[b + 1] - 1``).
      seq_lens: int ``[R]``, cached tokens of each row after this step.
      block_table: int ``[R, W]``, the step's block table of the group (pages,
        i.e. kernel-block ids), one row per batch row.
      row_valid: bool ``[R]``, False for a padded row (``StepBatch.row_valid``);
        a padded row's query length must be 0.
      page_size: tokens per page (the group's kernel block size).
      null_block_id: the reserved page written into padded rows and page
        columns past each row's pages (default ``NULL_BLOCK_ID``); ``None``: the
        engine has no null page, and page 0 (never read there) is written.

    Returns:
      :class:`RPAMetadata` with ``R`` rows, real rows first.

    Raises:
      ValueError: shapes/dtypes; with concrete values, ``query_start_loc`` not
        starting at 0 or decreasing, a padded row with queries, or a real row
        with more queries than ``seq_lens`` (positions before 0), or more pages
        than ``W`` columns.
    """
    _check_page_size(page_size)
    null_block_id = _check_null_block_id(null_block_id)
    validation.check_rank("row_valid", row_valid, 1)
    validation.check_dtype("row_valid", row_valid, np.bool_)
    r = np.shape(row_valid)[0]
    validation.check_shape("query_start_loc", query_start_loc, (r + 1,))
    validation.check_dtype("query_start_loc", query_start_loc, "integer")
    validation.check_shape("seq_lens", seq_lens, (r,))
    validation.check_dtype("seq_lens", seq_lens, "integer")
    validation.check_rank("block_table", block_table, 2)
    validation.check_shape("block_table", block_table, (r, None))
    validation.check_dtype("block_table", block_table, "integer")
    width = np.shape(block_table)[1]
    _check_batch_values(query_start_loc, seq_lens, row_valid, page_size, width)

    qsl = jnp.asarray(query_start_loc, jnp.int32)
    valid = jnp.asarray(row_valid)
    q_lens = jnp.where(valid, qsl[1:] - qsl[:-1], 0)
    kv_lens = jnp.where(valid, jnp.asarray(seq_lens, jnp.int32), 0)
    # Real rows first, each group in batch order (a stable partition).
    order = jnp.argsort(~valid, stable=True)
    kv_lens, q_lens = kv_lens[order], q_lens[order]
    pages = jnp.asarray(block_table, jnp.int32)[order]
    col = jnp.arange(width, dtype=jnp.int32)[None, :]
    live = col < ((kv_lens + page_size - 1) // page_size)[:, None]
    page_indices = jnp.where(live, pages, _fill_page(null_block_id))
    cu_q_lens = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(q_lens, dtype=jnp.int32)])
    num_seqs = jnp.sum(valid, dtype=jnp.int32).reshape(1)
    return RPAMetadata(kv_lens, page_indices, cu_q_lens, num_seqs)


def _check_batch_values(query_start_loc, seq_lens, row_valid, page_size, width) -> None:
    q = validation.concrete_values(query_start_loc)
    if q is None:
        return
    if q[0] != 0:
        raise ValueError(f"query_start_loc[0] must be 0, got {q[0]}")
    validation.check_non_decreasing("query_start_loc", q)
    valid, s = validation.concrete_values(row_valid), validation.concrete_values(seq_lens)
    if valid is None or s is None:
        return
    q_len = np.diff(q.astype(np.int64))
    for b in range(valid.shape[0]):
        if not valid[b] and q_len[b]:
            raise ValueError(
                f"query_start_loc must give padded rows (row_valid False) no tokens; "
                f"row {b} has {q_len[b]}"
            )
        if valid[b] and not q_len[b] <= s[b] <= width * page_size:
            raise ValueError(
                f"seq_lens[{b}] must be in [query length {q_len[b]}, {width * page_size}] "
                f"(block_table width {width} * page_size {page_size}), got {s[b]}"
            )


def rpa_metadata_from_batch(
    batch, *, group: int = 0, page_size: int, null_block_id: int | None = NULL_BLOCK_ID
) -> RPAMetadata:
    """:func:`rpa_metadata` of a ``kvjax.state.step_batch.StepBatch`` for KV group ``group``."""
    return rpa_metadata(
        batch.query_start_loc,
        batch.seq_lens,
        batch.block_tables[group],
        batch.row_valid,
        page_size=page_size,
        null_block_id=null_block_id,
    )


def _check_metadata(m: RPAMetadata) -> None:
    validation.check_rank("page_indices", m.page_indices, 2)
    r = np.shape(m.page_indices)[0]
    validation.check_shape("kv_lens", m.kv_lens, (r,))
    validation.check_shape("cu_q_lens", m.cu_q_lens, (r + 1,))
    validation.check_shape("num_seqs", m.num_seqs, (1,))
    for name in ("kv_lens", "page_indices", "cu_q_lens", "num_seqs"):
        validation.check_dtype(name, getattr(m, name), "integer")
    validation.check_values_in_range("num_seqs", m.num_seqs, 0, r + 1)


def rpa_batch_view(m: RPAMetadata):
    """The metadata as a kvjax batch: ``(idx_mapping, query_start_loc)``.

    Row ``i < num_seqs`` is request row ``i``; rows past ``num_seqs`` are
    ``PAD_ROW_ID`` with no tokens (``query_start_loc`` repeats ``cu_q_lens[num_seqs]``).
    """
    r = m.kv_lens.shape[0]
    rows = jnp.arange(r, dtype=jnp.int32)
    n = jnp.asarray(m.num_seqs, jnp.int32)[0]
    real = rows < n
    cu = jnp.asarray(m.cu_q_lens, jnp.int32)
    qsl = jnp.where(jnp.arange(r + 1) <= n, cu, cu[jnp.clip(n, 0, r)])
    return jnp.where(real, rows, PAD_ROW_ID), qsl


def rpa_positions(metadata: RPAMetadata, *, num_tokens: int) -> jax.Array:
    """int32 ``[num_tokens]``: the absolute position of each query token, 0 for padding.

    Token ``cu_q_lens[i] + k`` of real sequence ``i`` is at
    ``kv_lens[i] - q_len_i + k`` (the queries are the last ``q_len_i`` tokens).
    """
    _check_metadata(metadata)
    idx, qsl = rpa_batch_view(metadata)
    r = idx.shape[0]
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.minimum(token_rows(qsl, num_tokens), max(r - 1, 0))  # gather index, masked
    real = t < qsl[r]
    q_len = qsl[seq + 1] - qsl[seq]
    pos = jnp.asarray(metadata.kv_lens, jnp.int32)[seq] - q_len + (t - qsl[seq])
    return jnp.where(real, pos, 0)


def rpa_slot_mapping(
    metadata: RPAMetadata,
    *,
    page_size: int,
    num_tokens: int,
    null_block_id: int | None = NULL_BLOCK_ID,
) -> jax.Array:
    """int32 ``[num_tokens]``: where each query token's K/V goes (``write_kv_pages``'s input).

    ``slot = page_indices[i, pos // page_size] * page_size + pos % page_size``
    with ``pos`` from :func:`rpa_positions`; ``PAD_SLOT_ID`` for tokens past
    ``cu_q_lens[num_seqs]`` and, under ``jit``, for a position whose page is
    the null page (``null_block_id``), negative, or past the table (concrete:
    ``ValueError``). The rule is kvjax's
    :func:`~kvjax.state.block_tables.compute_slot_mapping`.

    ``null_block_id``: ``NULL_BLOCK_ID`` (default, kvjax's rule), another
    reserved page id, or ``None`` (no null page: page 0 is an ordinary page, as
    in JAX's ragged-paged-attention tests and tpu-inference). Other modes reach
    the same rule by renumbering pages once (``p -> p + 1``, the null page and
    negative ids -> ``NULL_BLOCK_ID``) and shifting the slots back.
    """
    _check_page_size(page_size)
    null_block_id = _check_null_block_id(null_block_id)
    positions = rpa_positions(metadata, num_tokens=num_tokens)
    idx, qsl = rpa_batch_view(metadata)
    pages = jnp.asarray(metadata.page_indices, jnp.int32)
    shifted = null_block_id != NULL_BLOCK_ID
    if shifted:
        _check_no_negative_pages(metadata.page_indices, null_block_id)
        reserved = pages < 0 if null_block_id is None else (pages < 0) | (pages == null_block_id)
        pages = jnp.where(reserved, NULL_BLOCK_ID, pages + 1)
    try:
        slots = compute_slot_mapping(
            pages,
            idx,
            qsl,
            positions,
            block_size=int(page_size),
            num_tokens_padded=num_tokens,
        )
    except ValueError as e:
        if not shifted:
            raise
        raise ValueError(
            f"{e} (null_block_id={null_block_id!r}: the null page here is page "
            f"{null_block_id}, not NULL_BLOCK_ID)"
        ) from None
    if shifted:
        slots = jnp.where(slots >= 0, slots - int(page_size), PAD_SLOT_ID)
    return slots


def _check_no_negative_pages(page_indices, null_block_id: int | None) -> None:
    """Concrete ``page_indices`` hold no negative id other than ``null_block_id``."""
    p = validation.concrete_values(page_indices)
    if p is None:
        return
    bad = (p < 0) & (p != null_block_id) if null_block_id is not None else p < 0
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"page_indices must hold page ids >= 0 (null_block_id={null_block_id!r}); "
            f"got page_indices[{', '.join(map(str, where))}]={int(p[where])}"
        )
