"""Invariant checks of the runner state, as pure functions.

:func:`step_batch_violations` returns a dict of named bool scalars (True =
violated); it runs eagerly, under ``jit``, and under
``jax.experimental.checkify`` through :func:`checkify_step_batch`.
:func:`assert_step_batch` raises ``AssertionError`` naming every violated rule.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from pallas_kernels import contract as validation
from kvjax.constants import NULL_BLOCK_ID, PAD_ROW_ID, PAD_SLOT_ID
from kvjax.spec import KVGroupSpec
from kvjax.state.block_tables import BlockTables, _slot_mapping_and_faults, _validate_slot_mapping_inputs
from kvjax.state.padding import INT32_RANGE, gather_index, is_real_slot, narrow_rows, token_rows
from kvjax.state.step_batch import StepBatch


def _duplicate_real_slots(slots: jax.Array) -> jax.Array:
    """True if two non-PAD entries of ``slots`` ``[T]`` are equal."""
    big = jnp.iinfo(jnp.int32).max
    s = jnp.sort(jnp.where(is_real_slot(slots), slots, big))
    return jnp.any((s[1:] == s[:-1]) & (s[1:] != big))


def step_batch_violations(batch: StepBatch, specs: tuple[KVGroupSpec, ...]) -> dict[str, jax.Array]:
    """Named bool scalars, True where a padding/sentinel rule of ``batch`` is broken.

    Rules: padded token tails are PAD (slots) and 0 (ids, positions); padded
    request rows are NULL (tables), 0 (seq_lens) and empty (query_start_loc
    repeats); query_start_loc is non-decreasing from 0; no two real tokens
    share a slot; no real slot lands in block 0; no real slot is beyond the table's
    reach: each is the slot its row's block table (``batch.block_tables``) gives its
    position, by :func:`~kvjax.state.block_tables.compute_slot_mapping`'s rule; table
    entries are never negative; logits rows point at real tokens of their own row; a row
    without tokens has no logits; ``idx_mapping`` holds request rows or ``PAD_ROW_ID``; the
    tokens fit the bucket.
    """
    pad_tok = ~batch.token_valid
    pad_req = ~batch.row_valid
    qsl, cu = batch.query_start_loc, batch.cu_num_logits
    R, L = batch.num_reqs_padded, batch.num_logits_padded
    # Logits row l belongs to batch row token_rows(cu)[l] and must point into that row's query.
    lrow = token_rows(cu, L)
    lrow_safe = gather_index(lrow, R)
    inside = (lrow < R) & (qsl[lrow_safe] <= batch.logits_indices) & (
        batch.logits_indices < qsl[lrow_safe + 1]
    )
    out = {
        "pad_token_slot_not_PAD": jnp.any(pad_tok[None, :] & (batch.slot_mappings != PAD_SLOT_ID)),
        "pad_token_id_or_position_nonzero": jnp.any(
            pad_tok & ((batch.input_ids != 0) | (batch.positions != 0))
        ),
        "query_start_loc_decreasing": jnp.any(jnp.diff(batch.query_start_loc) < 0)
        | (batch.query_start_loc[0] != 0),
        "pad_row_has_tokens": jnp.any(pad_req & (jnp.diff(batch.query_start_loc) != 0)),
        "pad_row_seq_len_nonzero": jnp.any(pad_req & (batch.seq_lens != 0)),
        "logits_index_not_real_token": jnp.any(
            batch.logits_valid & (batch.logits_indices >= batch.num_tokens)
        ),
        "logits_index_outside_its_row": jnp.any(batch.logits_valid & ~inside),
        "row_without_tokens_has_logits": jnp.any((jnp.diff(qsl) == 0) & (jnp.diff(cu) != 0)),
        "idx_mapping_neither_row_nor_PAD": jnp.any(pad_req & (batch.idx_mapping != PAD_ROW_ID)),
        "tokens_exceed_bucket": (qsl[R] > batch.num_tokens_padded) | (batch.num_tokens != qsl[R]),
    }
    # the batch's tables are indexed by batch row: row b reads table row b
    own_row = jnp.where(batch.row_valid, jnp.arange(R, dtype=jnp.int32), PAD_ROW_ID)
    pad_row_table, neg_table, dup, null_slot, beyond = [], [], [], [], []
    for g, spec in enumerate(specs):
        tbl = batch.block_tables[g]
        pad_row_table.append(jnp.any(pad_req[:, None] & (tbl != NULL_BLOCK_ID)))
        neg_table.append(jnp.any(tbl < 0))
        slots = batch.slot_mappings[g]
        dup.append(_duplicate_real_slots(slots))
        null_slot.append(jnp.any(is_real_slot(slots) & (slots // spec.kernel_block_size == NULL_BLOCK_ID)))
        want, _ = _slot_mapping_and_faults(tbl, own_row, qsl, batch.positions, spec.kernel_block_size,
                                           batch.num_tokens_padded)
        beyond.append(jnp.any(is_real_slot(slots) & (slots != want)))
    out["pad_row_table_not_NULL"] = jnp.any(jnp.stack(pad_row_table))
    out["negative_block_table_entry"] = jnp.any(jnp.stack(neg_table))
    out["two_tokens_share_a_slot"] = jnp.any(jnp.stack(dup))
    out["real_slot_in_null_block"] = jnp.any(jnp.stack(null_slot))
    out["real_slot_beyond_its_table"] = jnp.any(jnp.stack(beyond))
    return out


def block_table_violations(tables: BlockTables) -> dict[str, jax.Array]:
    """Rows hold ``NULL_BLOCK_ID`` past their live length; no negative ids; counts fit the
    width; a live entry names a block the cache has: its logical block (kernel id //
    ``blocks_per_kv_block``) is below ``num_cache_blocks`` when known and below
    :func:`~kvjax.state.block_tables.block_id_limit` (the limit :meth:`BlockTables.write_rows`
    checks appended ids against)."""
    past, neg, over, beyond = [], [], [], []
    for g, spec in enumerate(tables.specs):
        col = jnp.arange(spec.table_width)[None, :]
        cnt = tables.num_blocks[g][:, None]
        tbl = tables.tables[g]
        past.append(jnp.any((col >= cnt) & (tbl != NULL_BLOCK_ID)))
        neg.append(jnp.any(tbl < 0))
        over.append(jnp.any(tables.num_blocks[g] > spec.table_width))
        limit = tables.id_limit(g)
        if limit < INT32_RANGE[1]:  # else every int32 id is below it
            beyond.append(jnp.any((col < cnt) & (tbl // spec.blocks_per_kv_block >= limit)))
    return {
        "entry_past_live_length_not_NULL": jnp.any(jnp.stack(past)),
        "negative_block_table_entry": jnp.any(jnp.stack(neg)),
        "live_length_exceeds_width": jnp.any(jnp.stack(over)),
        "live_entry_past_the_cache": jnp.any(jnp.stack(beyond)) if beyond else jnp.bool_(False),
    }


def free_rows_are_empty(tables: BlockTables, free_rows) -> jax.Array:
    """True (OK) when every free request row has a fully NULL table and count 0. ``free_rows``:
    request rows in ``[0, max_num_reqs)`` (integers; a row outside raises ``ValueError``, it is
    never clamped or wrapped onto another row)."""
    rows = free_rows if hasattr(free_rows, "shape") else np.asarray(list(free_rows))
    if rows.size == 0:
        return jnp.asarray(True)
    if not validation.is_concrete(rows):
        raise ValueError("free_rows must be concrete (a host-side check of which rows are free)")
    validation.check_rank("free_rows", rows, 1)
    rows = narrow_rows("free_rows", rows, tables.max_num_reqs, allow_pad=False)
    ok = [jnp.all(tables.tables[g][rows] == NULL_BLOCK_ID) for g in range(tables.num_groups)]
    ok.append(jnp.all(tables.num_blocks[:, rows] == 0))
    return jnp.all(jnp.stack(ok))


def checkify_step_batch(batch: StepBatch, specs: tuple[KVGroupSpec, ...]) -> None:
    """``checkify.check`` every rule; use inside a function wrapped by ``checkify.checkify``."""
    for name, bad in step_batch_violations(batch, specs).items():
        checkify.check(~bad, f"step batch invariant violated: {name}")


def _raise_named(kind: str, violations: dict[str, jax.Array]) -> None:
    bad = [name for name, v in violations.items() if bool(np.asarray(v))]
    if bad:
        raise AssertionError(f"{kind} invariants violated: {', '.join(bad)}")


def assert_step_batch(batch: StepBatch, specs: tuple[KVGroupSpec, ...]) -> None:
    """Raise ``AssertionError`` naming every violated step-batch rule."""
    _raise_named("step batch", step_batch_violations(batch, specs))


def assert_block_tables(tables: BlockTables) -> None:
    """Raise ``AssertionError`` naming every violated block-table rule."""
    _raise_named("block table", block_table_violations(tables))


def checkify_slot_mapping_inputs(
    block_table: jax.Array,
    idx_mapping: jax.Array,
    query_start_loc: jax.Array,
    positions: jax.Array,
    *,
    block_size: int,
    num_tokens_padded: int,
) -> None:
    """Under ``checkify``: ``idx_mapping`` holds rows of the table or -1; ``query_start_loc``
    starts at 0, is non-decreasing, and its real tokens fit the bucket and ``positions``; every
    real token maps to an allocated block inside the table.

    These are the value checks :func:`kvjax.compute_slot_mapping` makes eagerly when its inputs
    are concrete. Its static checks (ranks, shapes, dtypes, ``block_size``) run here too, and
    raise ``ValueError`` as there; so do its value checks for inputs concrete here.
    """
    raw_idx = idx_mapping if hasattr(idx_mapping, "shape") else np.asarray(idx_mapping)
    block_table, idx, qsl, positions = _validate_slot_mapping_inputs(
        block_table, idx_mapping, query_start_loc, positions, block_size, num_tokens_padded
    )
    num_rows, num_positions = block_table.shape[0], positions.shape[0]
    if raw_idx.size:  # narrow_rows (the rule's owner) made an entry outside the table a padding row
        raw_idx = jnp.asarray(raw_idx)
        bad_row = (idx == PAD_ROW_ID) & (raw_idx != PAD_ROW_ID)
        first = jnp.argmax(bad_row)
        checkify.check(
            ~jnp.any(bad_row),
            f"idx_mapping must have values in [0, {num_rows}) (or -1); got {{}} at index {{}}",
            raw_idx[first], first,
        )
    checkify.check(qsl[0] == 0, "query_start_loc[0] must be 0, got {}", qsl[0])
    checkify.check(jnp.all(jnp.diff(qsl) >= 0), "query_start_loc must be non-decreasing")
    checkify.check(
        qsl[-1] <= num_tokens_padded,
        "query_start_loc[-1]={} exceeds num_tokens_padded",
        qsl[-1],
    )
    checkify.check(
        qsl[-1] <= num_positions,
        f"positions must cover the {{}} real tokens (query_start_loc[-1]), got shape [{num_positions}]",
        qsl[-1],
    )
    _, faults = _slot_mapping_and_faults(block_table, idx, qsl, positions, block_size, num_tokens_padded)
    checkify.check(
        ~jnp.any(faults),
        "token {} maps outside the block table or to NULL_BLOCK_ID (an unallocated block)",
        jnp.argmax(faults),
    )
