"""Per-step metadata the layers share, derived once from a :class:`StepBatch`."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels import contract as validation
from kvjax.state.padding import pad_accepted_counts, pad_state_indices
from kvjax.state.step_batch import StepBatch


class StepContext(NamedTuple):
    """What the layers read (``T`` tokens, ``R`` rows, ``W`` block-table columns).

    Attributes:
      input_ids: int32 ``[T]`` (0 for pad tokens).
      logits_indices: int32 ``[L]`` the tokens whose logits the step returns.
      positions: int32 ``[T]``.
      token_row: int32 ``[T]`` batch row of each token, ``R`` for pad tokens.
      token_real: bool ``[T]`` the token belongs to a real (non-padded) row.
      query_start_loc: int32 ``[R + 1]``; query_len: int32 ``[R]``.
      seq_lens: int32 ``[R]``.
      has_initial_state: bool ``[R]`` ``num_computed_tokens > 0``.
      prefill_row, decode_row: bool ``[R]`` real rows with at least one token, split
        by ``is_prefilling``; padded rows are neither.
      block_table: int32 ``[R, W]`` (the attention group's kernel-block ids).
      slot_mapping: int32 ``[T]`` (``PAD_SLOT_ID`` for pad tokens).
      state_slot: int32 ``[R]`` the recurrent-state slot a prefill chunk reads
        (if ``has_initial_state``) and writes; ``NULL_BLOCK_ID`` for padded rows.
      state_indices: int32 ``[R]`` or ``[R, 1 + k]`` (speculative), ``NULL_BLOCK_ID``
        for padded rows.
      num_accepted_tokens: int32 ``[R]`` (1 for padded rows) or None (no speculation).
      max_prefill_rows: static: at most this many rows are prefilling (the bucket's staging,
        which the host checks); None: any number up to ``R``. 0: a decode-only step
        (:attr:`decode_only`).
    """

    input_ids: jax.Array
    logits_indices: jax.Array
    positions: jax.Array
    token_row: jax.Array
    token_real: jax.Array
    query_start_loc: jax.Array
    query_len: jax.Array
    seq_lens: jax.Array
    has_initial_state: jax.Array
    prefill_row: jax.Array
    decode_row: jax.Array
    block_table: jax.Array
    slot_mapping: jax.Array
    state_slot: jax.Array
    state_indices: jax.Array
    num_accepted_tokens: jax.Array | None
    max_prefill_rows: int | None = None

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    @property
    def num_rows(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def decode_only(self) -> bool:
        """Static: no row is prefilling (a decode-only bucket), so ``prefill_row`` is all False and
        a layer may leave its prefill path out of the program."""
        return self.max_prefill_rows == 0

    @property
    def is_speculative(self) -> bool:
        return self.state_indices.ndim == 2


def make_step_context(
    batch: StepBatch,
    state_indices: jax.Array | None = None,
    num_accepted_tokens: jax.Array | None = None,
    kv_group: int = 0,
    max_prefill_rows: int | None = None,
) -> StepContext:
    """The layers' view of ``batch`` (every mask and index comes from :func:`build_step_batch`).

    ``state_indices`` / ``num_accepted_tokens``: override the batch's (callers that build the
    batch without them); padding rows get ``NULL_BLOCK_ID`` / 1 through the same padding rules
    (:mod:`kvjax.state.padding`). One state-index column means no speculation.
    ``max_prefill_rows``: the step's bucket's staging ``prefill_rows``
    (:func:`kvjax.host.buckets.bucket_staging`; 0 for a decode-only bucket).
    """
    R = batch.num_reqs_padded
    if not 0 <= kv_group < len(batch.block_tables):
        raise ValueError(
            f"kv_group={kv_group} is not a KV-cache group of the batch "
            f"({len(batch.block_tables)} groups)"
        )
    row_valid = batch.row_valid
    si = batch.state_indices
    if state_indices is not None:
        si = jnp.asarray(state_indices)
        validation.check_rank("state_indices", si, (1, 2))
        validation.check_dtype("state_indices", si, "integer")
        validation.check_shape("state_indices", si, (R,) if si.ndim == 1 else (R, None))
        si = pad_state_indices(si if si.ndim == 2 else si[:, None], row_valid)
    na = batch.num_accepted_tokens
    if si.shape[1] > 1:
        if state_indices is not None:
            if num_accepted_tokens is None:
                raise ValueError(
                    "state_indices [R, 1 + num_spec] (speculative decoding) requires "
                    "num_accepted_tokens [R]"
                )
            na = jnp.asarray(num_accepted_tokens)
            validation.check_shape("num_accepted_tokens", na, (R,))
            validation.check_dtype("num_accepted_tokens", na, "integer")
            na = pad_accepted_counts(na, row_valid)
        validation.check_values_in_range("num_accepted_tokens", na, 1, si.shape[1] + 1)
    else:
        si, na = si[:, 0], None
    return StepContext(
        input_ids=batch.input_ids,
        logits_indices=batch.logits_indices,
        positions=batch.positions,
        token_row=batch.request_of_token,
        token_real=batch.token_real,
        query_start_loc=batch.query_start_loc,
        query_len=batch.query_len,
        seq_lens=batch.seq_lens,
        has_initial_state=batch.num_computed_tokens > 0,
        prefill_row=batch.prefill_row,
        decode_row=batch.decode_row,
        block_table=batch.block_tables[kv_group],
        slot_mapping=batch.slot_mappings[kv_group],
        state_slot=si if si.ndim == 1 else si[:, 0],
        state_indices=si,
        num_accepted_tokens=na,
        max_prefill_rows=None if max_prefill_rows is None else int(max_prefill_rows),
    )
