"""Block tables and slot mappings: which physical KV blocks a request row owns,
and where each token's K/V goes.

Rules enforced here (vLLM's semantics, with the vLLM PRs that fixed each):

* Tables hold kernel-block ids; a logical block ``b`` of a group with
  ``r = block_size // kernel_block_size`` expands to ``b*r .. b*r+r-1``.
* Every entry of a row past its live length is ``NULL_BLOCK_ID``, also after a
  row is reused: adding a request rewrites the whole row (vLLM leaves stale
  ids; kvjax does not).
* Gathered tables are ``NULL_BLOCK_ID`` for padded request rows and past each
  row's live length (PR 35431: never -1 in a block table).
* Slot mappings are ``PAD_SLOT_ID`` for every token from the real token count
  to the end of the bucket, for tokens of padded rows, and for anything that
  cannot be a valid write (PRs 36580, 39444). A slot never lands in
  the null block: a real token whose block is not allocated gets PAD (and the
  concrete/``checkify`` checks report it), so block 0 is never written.
* No -1 is ever used as a JAX index: masks and ``mode="drop"`` only.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from pallas_kernels import contract as validation
from kvjax.constants import NULL_BLOCK_ID, PAD_ROW_ID, PAD_SLOT_ID
from kvjax.spec import KVGroupSpec
from kvjax.state.padding import (
    INT32_RANGE, gather_index, is_real_row, narrow_rows, scatter_index, scatter_rows, single_row, token_rows,
)


def block_id_limit(block_size: int) -> int:
    """Block ids a cache of ``block_size``-token blocks can address: ``[0, limit)``, so that every
    slot ``id * block_size + offset`` fits int32 (a larger id would wrap onto another block's
    slots, or onto a negative slot that writes nothing)."""
    return (INT32_RANGE[1]) // block_size


@struct.dataclass
class BlockTables:
    """Per-request-row block tables for one or more KV-cache groups.

    Attributes:
      tables: one int32 ``[max_num_reqs, spec.table_width]`` array per group,
        indexed by request row; kernel-block ids, ``NULL_BLOCK_ID`` past the live
        length.
      num_blocks: int32 ``[num_groups, max_num_reqs]``, live entries (in kernel
        blocks) of each row.
      specs: the groups' static specs (meta field).
      num_cache_blocks: logical blocks in the KV cache, when known (meta
        field); appended ids are checked against it.
    """

    tables: tuple[jax.Array, ...]
    num_blocks: jax.Array
    specs: tuple[KVGroupSpec, ...] = struct.field(pytree_node=False)
    num_cache_blocks: int | None = struct.field(pytree_node=False, default=None)

    @classmethod
    def create(
        cls,
        specs: Sequence[KVGroupSpec],
        max_num_reqs: int,
        num_cache_blocks: int | None = None,
    ) -> "BlockTables":
        """Empty tables: every entry ``NULL_BLOCK_ID``, every count 0."""
        specs = tuple(specs)
        if not specs:
            raise ValueError("specs must name at least one KV-cache group, got none")
        if max_num_reqs <= 0:
            raise ValueError(f"max_num_reqs must be positive, got {max_num_reqs}")
        tables = tuple(
            jnp.full((max_num_reqs, s.table_width), NULL_BLOCK_ID, jnp.int32) for s in specs
        )
        return cls(
            tables=tables,
            num_blocks=jnp.zeros((len(specs), max_num_reqs), jnp.int32),
            specs=specs,
            num_cache_blocks=num_cache_blocks,
        )

    @property
    def num_groups(self) -> int:
        return len(self.specs)

    @property
    def max_num_reqs(self) -> int:
        return self.tables[0].shape[0]

    # ------------------------------------------------------------------ writes

    def write_rows(
        self,
        rows: jax.Array,
        block_ids: Sequence[jax.Array],
        num_new: jax.Array,
        overwrite: jax.Array,
    ) -> "BlockTables":
        """Append (or, where ``overwrite``, replace) logical block ids of several rows.

        The batched form that a step applies once (vLLM's staged writes); jit-able.

        Args:
          rows: int32 ``[U]`` request rows; ``-1`` marks an unused entry. Rows
            must be distinct.
          block_ids: per group, int32 ``[U, M_g]`` logical block ids (first
            ``num_new[g, u]`` of row ``u`` are used). ``NULL_BLOCK_ID`` is allowed
            for skipped blocks (sliding window); negative ids are not.
          num_new: int32 ``[num_groups, U]``.
          overwrite: bool ``[U]``: start the row from column 0 and null its tail
            (new or re-added request); otherwise append after the live length.
        """
        def raw(a):  # keep the caller's integer width until every range check has run
            return a if hasattr(a, "shape") else np.asarray(a)

        rows, num_new = raw(rows), raw(num_new)
        block_ids = tuple(raw(b) for b in block_ids)
        overwrite = jnp.asarray(overwrite, jnp.bool_)
        self._validate_write(rows, block_ids, num_new, overwrite)
        rows, num_new, block_ids = self._narrow_write(rows, num_new, block_ids)
        dest = scatter_index(rows, self.max_num_reqs)
        safe = gather_index(rows, self.max_num_reqs)
        new_tables, new_counts = [], []
        for g, spec in enumerate(self.specs):
            table, r = self.tables[g], spec.blocks_per_kv_block
            start = jnp.where(overwrite, 0, self.num_blocks[g, safe])  # [U]
            expanded = expand_to_kernel_blocks(block_ids[g], r)  # [U, M*r]
            n_k = num_new[g] * r
            col = jnp.arange(spec.table_width, dtype=jnp.int32)[None, :]
            rel = col - start[:, None]
            in_new = (rel >= 0) & (rel < n_k[:, None])
            if expanded.shape[1]:
                idx = jnp.clip(rel, 0, expanded.shape[1] - 1)  # masked by in_new
                new_val = jnp.take_along_axis(expanded, idx, axis=1)
            else:
                new_val = jnp.full(in_new.shape, NULL_BLOCK_ID, jnp.int32)
            row_val = jnp.where(
                col < start[:, None],
                table[safe],
                jnp.where(in_new, new_val, NULL_BLOCK_ID),
            )
            upd = scatter_rows(dest, {"table": (table, row_val), "count": (self.num_blocks[g], start + n_k)})
            new_tables.append(upd["table"])
            new_counts.append(upd["count"])
        return self.replace(tables=tuple(new_tables), num_blocks=jnp.stack(new_counts))

    def id_limit(self, g: int) -> int:
        """Group ``g``'s logical ids lie in ``[0, limit)``: ``num_cache_blocks`` when known, and
        never more than :func:`block_id_limit` of its block size (its slots fit int32)."""
        limit = block_id_limit(self.specs[g].block_size)
        return limit if self.num_cache_blocks is None else min(limit, self.num_cache_blocks)

    def _narrow_write(self, rows, num_new, block_ids):
        """int32 rows, counts and ids; under ``jit`` a row with an id outside
        ``[0, num_cache_blocks)`` or past :func:`block_id_limit` (compared before narrowing)
        writes nothing."""
        rows = narrow_rows("rows", rows, self.max_num_reqs)
        width = max([b.shape[1] for b in block_ids], default=0)
        num_new = validation.narrow_ids("num_new", num_new, 0, width + 1, fill=0)
        bad_row = jnp.zeros(rows.shape, bool)
        narrowed = []
        for g, b in enumerate(block_ids):
            hi = self.id_limit(g)
            b = b if validation.is_concrete(b) else jnp.asarray(b)
            used = jnp.arange(b.shape[1])[None, :] < num_new[g][:, None]
            ok = (b >= 0) & (b < hi) if b.size else jnp.ones(b.shape, bool)
            bad_row |= jnp.any(used & ~ok, axis=1)
            narrowed.append(jnp.where(ok, b, NULL_BLOCK_ID).astype(jnp.int32))
        return jnp.where(bad_row, PAD_ROW_ID, rows), num_new, tuple(narrowed)

    def _validate_write(self, rows, block_ids, num_new, overwrite) -> None:
        U = rows.shape[0] if rows.ndim == 1 else None
        validation.check_rank("rows", rows, 1)
        validation.check_shape("overwrite", overwrite, (U,))
        validation.check_shape("num_new", num_new, (self.num_groups, U))
        if len(block_ids) != self.num_groups:
            raise ValueError(
                f"block_ids must hold one array per KV-cache group ({self.num_groups}), "
                f"got {len(block_ids)}"
            )
        for g, b in enumerate(block_ids):
            validation.check_rank(f"block_ids[{g}]", b, 2)
            validation.check_shape(f"block_ids[{g}]", b, (U, None))
        validation.check_values_in_range("rows", rows, 0, self.max_num_reqs, allow=(-1,))
        r = validation.concrete_values(rows)
        if r is not None:
            live = r[is_real_row(r, self.max_num_reqs)]
            if len(np.unique(live)) != len(live):
                raise ValueError(f"rows must be distinct in one write, got {r.tolist()}")
        nn = validation.concrete_values(num_new)
        for g, spec in enumerate(self.specs):
            b = validation.concrete_values(block_ids[g])
            if nn is not None:
                validation.check_values_in_range(
                    f"num_new[{g}]", nn[g], 0, block_ids[g].shape[1] + 1
                )
            if b is None or nn is None:
                continue
            used = np.concatenate([b[u, : nn[g, u]] for u in range(b.shape[0])] or [b[:0, 0]])
            if (used < 0).any():
                raise ValueError(
                    f"block_ids[{g}] must not contain negative ids, got {int(used[used < 0][0])}: "
                    f"PAD_SLOT_ID (-1) belongs in slot mappings; a skipped block is "
                    f"NULL_BLOCK_ID ({NULL_BLOCK_ID})"
                )
            validation.check_values_in_range(f"block_ids[{g}]", used, 0, self.id_limit(g))
            counts = validation.concrete_values(self.num_blocks[g])
            ov = validation.concrete_values(overwrite)
            if counts is None or ov is None:
                continue
            for u in range(len(r if r is not None else [])):
                if not is_real_row(r[u], self.max_num_reqs):
                    continue
                start = 0 if ov[u] else int(counts[r[u]])
                end = start + int(nn[g, u]) * spec.blocks_per_kv_block
                if end > spec.table_width:
                    raise ValueError(
                        f"row {int(r[u])} of group {g} would hold {end} kernel blocks, more than "
                        f"the table width {spec.table_width} (max_num_blocks="
                        f"{spec.max_num_blocks} x {spec.blocks_per_kv_block})"
                    )

    def append_block_ids(
        self, row: int, block_ids: Sequence[Sequence[int]], *, overwrite: bool = False
    ) -> "BlockTables":
        """Append logical block ids (one list per group) to one row.

        ``overwrite=True`` (a new or re-added request) rewrites the whole row:
        the new ids from column 0 and ``NULL_BLOCK_ID`` after them.
        """
        if len(block_ids) != self.num_groups:
            raise ValueError(
                f"block_ids must hold one list per KV-cache group ({self.num_groups}), "
                f"got {len(block_ids)}"
            )
        width = max(1, max(len(b) for b in block_ids))
        ids = [np.zeros((1, width), np.int64) for _ in block_ids]  # wide: checked, then narrowed
        for g, b in enumerate(block_ids):
            ids[g][0, : len(b)] = np.asarray(b, np.int64)
        num_new = np.array([[len(b)] for b in block_ids], np.int32)
        return self.write_rows(single_row("row", row, self.max_num_reqs), ids, num_new, np.array([overwrite]))

    def clear_row(self, row: int) -> "BlockTables":
        """Null a whole row and reset its counts (the request left the row)."""
        empty = [np.zeros((1, 0), np.int32) for _ in self.specs]
        return self.write_rows(
            single_row("row", row, self.max_num_reqs), empty, np.zeros((self.num_groups, 1), np.int32), np.array([True])
        )

    # ------------------------------------------------------------------- reads

    def gather(
        self, idx_mapping: jax.Array, first_positions: jax.Array | None = None
    ) -> tuple[jax.Array, ...]:
        """Block tables of a step's batch, one ``[R_padded, width_g]`` array per group.

        Args:
          idx_mapping: int32 ``[R_padded]``, the request row of each batch row;
            ``-1`` for padded rows.
          first_positions: optional int32 ``[R_padded]``, the first query
            position of each batch row; with it, groups with a sliding window
            null the leading blocks that no query of the step can see. Integers in
            ``[0, 2**31)``: concrete values outside raise ``ValueError``; under ``jit`` such a
            row's sliding-window groups read no block.

        Returns rows that are ``NULL_BLOCK_ID`` for padded batch rows and past each
        row's live length.
        """
        validation.check_rank("idx_mapping", idx_mapping, 1)
        idx = narrow_rows("idx_mapping", idx_mapping, self.max_num_reqs)
        if first_positions is not None:
            first_positions = first_positions if hasattr(first_positions, "shape") else np.asarray(first_positions)
            validation.check_shape("first_positions", first_positions, idx.shape)
            # positions are >= 0 and int32, checked before narrowing (2**32 + 12 is not 12);
            # traced, a bad one hides every block of its row (the row reads nothing)
            first_positions = validation.narrow_ids("first_positions", first_positions, 0, INT32_RANGE[1],
                                                    fill=INT32_RANGE[1] - 1)
        valid = is_real_row(idx, self.max_num_reqs)
        safe = gather_index(idx, self.max_num_reqs)
        out = []
        for g, spec in enumerate(self.specs):
            rows = self.tables[g][safe]
            col = jnp.arange(spec.table_width, dtype=jnp.int32)[None, :]
            keep = valid[:, None] & (col < self.num_blocks[g, safe][:, None])
            if spec.sliding_window is not None and first_positions is not None:
                first_visible = first_positions - spec.sliding_window + 1
                last_pos_of_block = (col + 1) * spec.kernel_block_size - 1
                keep &= last_pos_of_block >= first_visible[:, None]
            out.append(jnp.where(keep, rows, NULL_BLOCK_ID))
        return tuple(out)

    def slot_mappings(
        self,
        idx_mapping: jax.Array,
        query_start_loc: jax.Array,
        positions: jax.Array,
        num_tokens_padded: int,
    ) -> jax.Array:
        """Slot mappings of every group, int32 ``[num_groups, num_tokens_padded]``."""
        return jnp.stack(
            [
                compute_slot_mapping(
                    self.tables[g],
                    idx_mapping,
                    query_start_loc,
                    positions,
                    block_size=spec.kernel_block_size,
                    num_tokens_padded=num_tokens_padded,
                )
                for g, spec in enumerate(self.specs)
            ]
        )


def expand_to_kernel_blocks(block_ids: jax.Array, blocks_per_kv_block: int) -> jax.Array:
    """``[..., M]`` logical ids -> ``[..., M*r]`` kernel ids ``b*r + k``, ``k < r``. Concrete ids
    must be below ``2**31 // r`` (their kernel ids fit int32): ``ValueError`` otherwise."""
    r = blocks_per_kv_block
    validation.check_values_in_range("block_ids", block_ids, INT32_RANGE[0], INT32_RANGE[1] // r)
    block_ids = jnp.asarray(block_ids)
    if r == 1:
        return block_ids
    k = jnp.arange(r, dtype=block_ids.dtype)
    return (block_ids[..., :, None] * r + k).reshape(*block_ids.shape[:-1], -1)


def compute_slot_mapping(
    block_table: jax.Array,
    idx_mapping: jax.Array,
    query_start_loc: jax.Array,
    positions: jax.Array,
    *,
    block_size: int,
    num_tokens_padded: int,
) -> jax.Array:
    """Flat KV slot of every token of a step, for one KV-cache group.

    ``slot = block_table[row, pos // block_size] * block_size + pos % block_size``
    for each real token, where ``row = idx_mapping[b]`` for the request ``b``
    whose range ``[query_start_loc[b], query_start_loc[b+1])`` holds the token.

    Args:
      block_table: int32 ``[max_num_reqs, width]`` source table indexed by
        request row (kernel-block ids).
      idx_mapping: int32 ``[R]`` request row of each batch row; ``-1`` = padded.
      query_start_loc: int32 ``[R + 1]``, non-decreasing, from 0.
      positions: int ``[P]`` absolute position of each token (``P >= query_start_loc[R]``).
      block_size: the kernel block size of the group (static).
      num_tokens_padded: the bucket's token count ``T`` (static).

    Returns:
      int32 ``[T]``. ``PAD_SLOT_ID`` from ``query_start_loc[R]`` to the end, for
      every token of a row whose ``idx_mapping`` is -1, and for a real token whose
      position is past the table or whose block is ``NULL_BLOCK_ID`` (never a
      write into the null block) or negative. With concrete inputs the last two raise
      ``ValueError``; under ``jit`` use :func:`kvjax.checkify_slot_mapping_inputs`.
      A table id at or past :func:`block_id_limit` (its slots would pass int32) raises
      with concrete inputs and reads as ``NULL_BLOCK_ID`` (``PAD_SLOT_ID``) under ``jit``.
    """
    block_table, idx_mapping, query_start_loc, positions = _validate_slot_mapping_inputs(
        block_table, idx_mapping, query_start_loc, positions, block_size, num_tokens_padded
    )
    slot, _ = _slot_mapping_and_faults(
        block_table, idx_mapping, query_start_loc, positions, block_size, num_tokens_padded
    )
    return slot


def _slot_mapping_and_faults(block_table, idx_mapping, qsl, positions, block_size, T):
    """The slot mapping and a bool ``[T]`` of real tokens that could not be mapped."""
    max_reqs, width = block_table.shape
    R = idx_mapping.shape[0]
    P = positions.shape[0]
    t = jnp.arange(T, dtype=jnp.int32)
    qsl = qsl.astype(jnp.int32)
    num_real = qsl[R]
    b = token_rows(qsl, T)
    real = (t < num_real) & (t < P) & (b < R)
    row = idx_mapping.astype(jnp.int32)[gather_index(b, R)] if R else jnp.full((T,), PAD_ROW_ID, jnp.int32)
    row_ok = is_real_row(row, max_reqs)
    pos = positions[jnp.minimum(t, max(P - 1, 0))].astype(jnp.int32) if P else jnp.zeros((T,), jnp.int32)
    col = pos // block_size
    col_ok = (pos >= 0) & (col < width)
    blk = block_table[jnp.where(row_ok, row, 0), jnp.where(col_ok, col, 0)].astype(jnp.int32)
    blk_ok = blk > NULL_BLOCK_ID
    limit = block_id_limit(block_size)
    if limit < INT32_RANGE[1]:  # block size 1: every int32 id is in reach
        blk_ok &= blk < limit
    ok = real & row_ok & col_ok & blk_ok
    slot = jnp.where(ok, blk * block_size + pos % block_size, PAD_SLOT_ID).astype(jnp.int32)
    faults = real & row_ok & ~(col_ok & blk_ok)
    return slot, faults


def _validate_slot_mapping_inputs(block_table, idx_mapping, qsl, positions, block_size, T):
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if not isinstance(num_tokens_padded := T, int) or num_tokens_padded < 0:
        raise ValueError(f"num_tokens_padded must be a non-negative int, got {T!r}")
    block_table, idx_mapping, qsl, positions = (
        a if hasattr(a, "shape") else np.asarray(a) for a in (block_table, idx_mapping, qsl, positions)
    )
    validation.check_rank("block_table", block_table, 2)
    validation.check_dtype("block_table", block_table, "integer")
    validation.check_rank("idx_mapping", idx_mapping, 1)
    validation.check_dtype("idx_mapping", idx_mapping, "integer")
    validation.check_shape("query_start_loc", qsl, (idx_mapping.shape[0] + 1,))
    validation.check_dtype("query_start_loc", qsl, "integer")
    validation.check_rank("positions", positions, 1)
    validation.check_dtype("positions", positions, "integer")
    # Range checks before narrowing to int32: a wide id must not wrap onto a valid one.
    idx_mapping = narrow_rows("idx_mapping", idx_mapping, block_table.shape[0])
    # an id whose slots would pass int32 is refused when concrete; traced, the faults below mask
    # only the entries a token reads (no pass over the whole table in every step)
    validation.check_values_in_range("block_table", block_table, INT32_RANGE[0], block_id_limit(block_size))
    block_table = validation.narrow_ids("block_table", block_table, *INT32_RANGE, fill=NULL_BLOCK_ID)
    qsl = validation.narrow_ids("query_start_loc", qsl, *INT32_RANGE, fill=0)
    positions = validation.narrow_ids("positions", positions, *INT32_RANGE, fill=-1)
    q = validation.concrete_values(qsl)
    if q is not None:
        if q[0] != 0:
            raise ValueError(f"query_start_loc[0] must be 0, got {q[0]}")
        validation.check_non_decreasing("query_start_loc", q)
        n = int(q[-1])
        if n > T:
            raise ValueError(
                f"query_start_loc[-1] (real tokens) must be <= num_tokens_padded={T}, got {n}"
            )
        if n > positions.shape[0]:
            raise ValueError(
                f"positions must cover the {n} real tokens, got shape {list(positions.shape)}"
            )
    concrete = all(
        validation.is_concrete(a) for a in (block_table, idx_mapping, qsl, positions)
    )
    if concrete and q is not None:
        _, faults = _slot_mapping_and_faults(
            block_table, idx_mapping, qsl, positions, block_size, T
        )
        f = np.asarray(faults)
        if f.any():
            t = int(np.argmax(f))
            b = int(token_rows(q, t + 1)[t])
            row = int(np.asarray(idx_mapping)[b])
            pos = int(np.asarray(positions)[t])
            width = block_table.shape[1]
            if pos < 0 or pos // block_size >= width:
                raise ValueError(
                    f"positions[{t}]={pos} (batch row {b}, request row {row}) is outside the "
                    f"block table: it holds positions [0, {width * block_size})"
                )
            blk = int(np.asarray(block_table)[row, pos // block_size])
            if blk < NULL_BLOCK_ID:
                raise ValueError(
                    f"positions[{t}]={pos} (batch row {b}, request row {row}) falls in block-table "
                    f"column {pos // block_size}, which holds {blk}: block ids are >= 0 "
                    f"(PAD_SLOT_ID belongs in slot mappings, an unallocated column holds NULL_BLOCK_ID)"
                )
            raise ValueError(
                f"positions[{t}]={pos} (batch row {b}, request row {row}) falls in block-table "
                f"column {pos // block_size}, which is NULL_BLOCK_ID: the block was never "
                f"allocated, and writing it would corrupt the null block"
            )
    return block_table, idx_mapping, qsl, positions


def dummy_slot_mappings(num_groups: int, num_tokens_padded: int) -> jax.Array:
    """All-``PAD_SLOT_ID`` slot mappings ``[num_groups, T]`` for a dummy step."""
    return jnp.full((num_groups, num_tokens_padded), PAD_SLOT_ID, jnp.int32)


def dummy_block_tables(specs: Sequence[KVGroupSpec], num_reqs_padded: int) -> tuple[jax.Array, ...]:
    """All-``NULL_BLOCK_ID`` block tables for a dummy step (never the last step's rows)."""
    return tuple(jnp.full((num_reqs_padded, s.table_width), NULL_BLOCK_ID, jnp.int32) for s in specs)
