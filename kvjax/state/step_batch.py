"""The per-step batch: every array a model step reads, padded to a bucket.

:func:`build_step_batch` is the one function that applies the padding rules;
the runner's real steps, its dummy steps and its precompile all go through it.

Padding, for a bucket of ``T`` tokens, ``R`` request rows and ``L`` logits:

* pad tokens (``t >= num_tokens``): ``input_ids = 0``, ``positions = 0``,
  ``slot_mappings = PAD_SLOT_ID`` in every group;
* pad request rows (``idx_mapping = PAD_ROW_ID`` in the batch; under ``jit`` also
  every row the schedule cannot hold, see :func:`_real_rows`): query length 0
  (``query_start_loc`` repeats the token count), ``seq_lens = 0``, block-table
  row all ``NULL_BLOCK_ID``, no logits;
* logits rows past the real count: ``logits_indices = 0`` and
  ``logits_valid = False`` (their samples are never used).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from pallas_kernels import combine_sampled_and_draft_tokens
from pallas_kernels import contract as validation
from kvjax.constants import NULL_BLOCK_ID, PAD_ROW_ID
from kvjax.state.block_tables import BlockTables
from kvjax.state.padding import (
    INT32_RANGE, gather_index, is_real_row, narrow_rows, pad_accepted_counts, pad_state_indices, token_rows,
)
from kvjax.state.request_state import RequestState


@struct.dataclass
class ScheduledBatch:
    """What the host scheduler decided for one step, padded to ``R`` rows.

    Attributes:
      idx_mapping: int32 ``[R]`` request row of each batch row, ``-1`` = padding.
      num_scheduled_tokens: int32 ``[R]`` query length of each row (0 for padding).
      num_draft_tokens: int32 ``[R]`` draft tokens in a decode row's window
        (its query is ``[last_sampled, draft_0, ...]``, length ``1 + drafts``).
    """

    idx_mapping: jax.Array
    num_scheduled_tokens: jax.Array
    num_draft_tokens: jax.Array

    @classmethod
    def from_lists(cls, rows, num_scheduled_tokens, num_draft_tokens=None, *, pad_to: int):
        """Host-side (numpy) construction, padded to ``pad_to`` rows."""
        n = len(rows)
        if n > pad_to:
            raise ValueError(f"{n} scheduled requests do not fit num_reqs_padded={pad_to}")
        given = {"rows": rows, "num_scheduled_tokens": num_scheduled_tokens}
        if num_draft_tokens is not None:
            given["num_draft_tokens"] = num_draft_tokens
        out = {}
        for name, v in given.items():  # int32-sized integers before the copy (never a cast or a
            v = np.asarray(v) if len(v) else np.zeros((0,), np.int64)  # wrap; values: validate_schedule)
            validation.check_shape(name, v, (n,))
            validation.check_dtype(name, v, "integer")
            validation.check_values_in_range(name, v, *INT32_RANGE)
            out[name] = v
        idx = np.full((pad_to,), PAD_ROW_ID, np.int32)
        q = np.zeros((pad_to,), np.int32)
        d = np.zeros((pad_to,), np.int32)
        idx[:n], q[:n] = out["rows"], out["num_scheduled_tokens"]
        if num_draft_tokens is not None:
            d[:n] = out["num_draft_tokens"]
        return cls(idx_mapping=idx, num_scheduled_tokens=q, num_draft_tokens=d)

    @classmethod
    def empty(cls, num_reqs_padded: int) -> "ScheduledBatch":
        """All padding: the schedule of a dummy step."""
        return cls.from_lists([], [], pad_to=num_reqs_padded)


@struct.dataclass
class StepBatch:
    """Fixed-shape inputs of one model step (``T`` tokens, ``R`` rows, ``L`` logits).

    Attributes:
      input_ids: int32 ``[T]``.
      positions: int32 ``[T]`` absolute positions.
      query_start_loc: int32 ``[R + 1]``, non-decreasing, ``[r+1:] = num_tokens``.
      seq_lens: int32 ``[R]`` ``num_computed + query_len``; 0 for padding.
      num_computed_tokens: int32 ``[R]`` K/V already cached before this step.
      is_prefilling: bool ``[R]`` the row still feeds prompt tokens
        (``num_computed < prefill_len``).
      idx_mapping: int32 ``[R]`` request row of each batch row, ``PAD_ROW_ID`` for
        every padding row.
      block_tables: per group, int32 ``[R, width_g]``.
      slot_mappings: int32 ``[num_groups, T]``.
      logits_indices: int32 ``[L]`` token index of each logits row.
      logits_valid: bool ``[L]``.
      cu_num_logits: int32 ``[R + 1]``.
      num_tokens, num_reqs, num_logits: int32 scalars, the real counts.
      token_real: bool ``[T]`` the token belongs to a real row.
      state_indices: int32 ``[R, 1 + k]`` each row's recurrent-state slots (column 0 the one a
        prefill chunk reads and writes; speculative decode rows one per token),
        ``NULL_BLOCK_ID`` on padding rows.
      num_accepted_tokens: int32 ``[R]`` tokens accepted in the row's previous step, 1 on
        padding rows.
      num_tokens_padded, num_reqs_padded, num_logits_padded: the bucket (meta).
      max_num_reqs: request rows of the state the batch was built from (meta).
    """

    input_ids: jax.Array
    positions: jax.Array
    query_start_loc: jax.Array
    seq_lens: jax.Array
    num_computed_tokens: jax.Array
    is_prefilling: jax.Array
    idx_mapping: jax.Array
    block_tables: tuple[jax.Array, ...]
    slot_mappings: jax.Array
    logits_indices: jax.Array
    logits_valid: jax.Array
    cu_num_logits: jax.Array
    num_tokens: jax.Array
    num_reqs: jax.Array
    num_logits: jax.Array
    token_real: jax.Array
    state_indices: jax.Array
    num_accepted_tokens: jax.Array
    num_tokens_padded: int = struct.field(pytree_node=False)
    num_reqs_padded: int = struct.field(pytree_node=False)
    num_logits_padded: int = struct.field(pytree_node=False)
    max_num_reqs: int = struct.field(pytree_node=False)

    @property
    def row_valid(self) -> jax.Array:
        """bool ``[R]``: real (non-padding) batch rows."""
        return is_real_row(self.idx_mapping, self.max_num_reqs)

    @property
    def token_valid(self) -> jax.Array:
        """bool ``[T]``: real (non-pad) tokens."""
        return jnp.arange(self.num_tokens_padded) < self.num_tokens

    @property
    def request_of_token(self) -> jax.Array:
        """int32 ``[T]`` batch row of each token (``R`` for pad tokens)."""
        return token_rows(self.query_start_loc, self.num_tokens_padded)

    @property
    def query_len(self) -> jax.Array:
        """int32 ``[R]`` tokens of each row this step (0 for padding)."""
        return self.query_start_loc[1:] - self.query_start_loc[:-1]

    @property
    def prefill_row(self) -> jax.Array:
        """bool ``[R]`` real rows with tokens that still feed the prompt."""
        return self.row_valid & (self.query_len > 0) & self.is_prefilling

    @property
    def decode_row(self) -> jax.Array:
        """bool ``[R]`` real rows with tokens past the prompt."""
        return self.row_valid & (self.query_len > 0) & ~self.is_prefilling


def build_step_batch(
    requests: RequestState,
    tables: BlockTables,
    sched: ScheduledBatch,
    *,
    num_tokens_padded: int,
    num_logits_padded: int | None = None,
    backend: str = "reference",
    state_indices=None,
) -> StepBatch:
    """Build a step's padded batch from the state and the schedule. Jit-able.

    Prefill tokens read ``all_token_ids``; a decode row's window is
    ``[last_sampled, draft_0, ..]`` (via ``combine_sampled_and_draft_tokens``);
    logits are the last ``1 + num_draft`` tokens of each real row.

    Args:
      requests, tables: current state.
      sched: the step's schedule, ``R`` rows (static shape).
      num_tokens_padded: ``T``, the bucket's token count (static).
      num_logits_padded: ``L`` (static); defaults to ``R * (1 + num_speculative_tokens)``
        capped at ``T``.
      backend: kernel backend for the token combine (see ``pallas_kernels``).
      state_indices: int32 ``[R]`` or ``[R, 1 + k]`` each row's recurrent-state slots (None:
        every row ``NULL_BLOCK_ID``, a model without recurrent state); padding rows get
        ``NULL_BLOCK_ID`` whatever is passed. Slots are ``>= 0`` and fit int32: concrete values
        outside raise ``ValueError``, traced ones read as ``NULL_BLOCK_ID``.

    Raises:
      ValueError: shape errors; with concrete values, a schedule that does not
        fit the bucket or the rows (see :func:`validate_schedule`).
    """
    validation.check_rank("idx_mapping", sched.idx_mapping, 1)
    idx = narrow_rows("idx_mapping", sched.idx_mapping, requests.max_num_reqs)
    R = idx.shape[0]
    T = num_tokens_padded
    if num_logits_padded is None:
        num_logits_padded = min(T, R * (1 + requests.num_speculative_tokens))
    L = num_logits_padded
    validate_schedule(requests, sched, num_tokens_padded=T, num_logits_padded=L)

    valid, qlen, ndraft = _real_rows(requests, sched, T, L)
    idx = jnp.where(valid, idx, PAD_ROW_ID)
    s = gather_index(idx, requests.max_num_reqs)
    zero = jnp.zeros((1,), jnp.int32)
    qsl = jnp.concatenate([zero, jnp.cumsum(qlen, dtype=jnp.int32)])
    num_tokens = qsl[R]
    nc = jnp.where(valid, requests.num_computed_tokens[s], 0)
    prefill_len = jnp.where(valid, requests.prefill_len[s], 0)
    seq_lens = jnp.where(valid, nc + qlen, 0)

    t = jnp.arange(T, dtype=jnp.int32)
    real = t < num_tokens
    b = gather_index(token_rows(qsl, T), R)  # masked by `real`
    positions = jnp.where(real, nc[b] + t - qsl[b], 0)
    from_prompt = real & (positions < prefill_len[b])
    Lmax = requests.max_model_len
    input_ids = jnp.where(
        from_prompt, requests.all_token_ids[s[b], jnp.clip(positions, 0, Lmax - 1)], 0
    )

    nlog = jnp.where(valid, 1 + ndraft, 0)
    cu_num_logits = jnp.concatenate([zero, jnp.cumsum(nlog, dtype=jnp.int32)])
    input_ids, logits_indices = combine_sampled_and_draft_tokens(
        input_ids,
        idx,
        requests.last_sampled_tokens,
        qsl,
        seq_lens,
        requests.prefill_len,
        requests.draft_tokens,
        cu_num_logits,
        L,
        backend=backend,
    )
    num_logits = cu_num_logits[R]
    logits_valid = jnp.arange(L) < num_logits
    logits_indices = jnp.where(logits_valid, logits_indices, 0).astype(jnp.int32)
    k = requests.num_speculative_tokens
    if state_indices is None:
        state_indices = jnp.zeros((R, 1 + k), jnp.int32)
    si = state_indices if hasattr(state_indices, "shape") else np.asarray(state_indices)
    validation.check_rank("state_indices", si, (1, 2))
    validation.check_dtype("state_indices", si, "integer")
    validation.check_shape("state_indices", si, (R,) if si.ndim == 1 else (R, None))
    # range-checked in the caller's width before narrowing: 2**32 + 3 must not become slot 3, and
    # a state slot is >= 0 (NULL_BLOCK_ID: none); under jit such an entry reads as NULL_BLOCK_ID
    si = validation.narrow_ids("state_indices", si, 0, INT32_RANGE[1], fill=NULL_BLOCK_ID)
    if si.ndim == 1:
        si = si[:, None]

    return StepBatch(
        input_ids=input_ids.astype(jnp.int32),
        positions=positions,
        query_start_loc=qsl,
        seq_lens=seq_lens,
        num_computed_tokens=nc,
        is_prefilling=valid & (nc < prefill_len),
        idx_mapping=idx,
        block_tables=tables.gather(idx, first_positions=nc),
        slot_mappings=tables.slot_mappings(idx, qsl, positions, T),
        logits_indices=logits_indices,
        logits_valid=logits_valid,
        cu_num_logits=cu_num_logits,
        num_tokens=num_tokens,
        num_reqs=jnp.sum(valid).astype(jnp.int32),
        num_logits=num_logits,
        token_real=real & valid[b],
        state_indices=pad_state_indices(si, valid),
        num_accepted_tokens=pad_accepted_counts(requests.num_accepted_tokens[s], valid),
        num_tokens_padded=T,
        num_reqs_padded=R,
        num_logits_padded=L,
        max_num_reqs=requests.max_num_reqs,
    )


def _real_rows(requests: RequestState, sched: ScheduledBatch, T: int, L: int):
    """Which batch rows are real, with their query lengths and draft counts (0 elsewhere).

    A row is padding unless its ``idx_mapping`` names a request row, it has at least
    one token and ``0 .. num_speculative_tokens`` drafts, and its tokens and logits fit
    the bucket (a row past ``T`` tokens or ``L`` logits, and every row after it, is
    padding). A scheduled row with 0 tokens is padding: it computes nothing and has no
    logits. So is a row that breaks a rule of :func:`_row_faults` (a repeated request row, a
    query past ``max_model_len`` or past a prefill's tokens, negative drafts, drafts off a
    decode window).
    Concrete schedules that break these rules are rejected before (:func:`validate_schedule`);
    under ``jit`` this is the mask.
    """
    q = jnp.asarray(sched.num_scheduled_tokens, jnp.int32)
    d = jnp.asarray(sched.num_draft_tokens, jnp.int32)
    valid = is_real_row(sched.idx_mapping, requests.max_num_reqs) & (q > 0)
    valid &= ~jnp.any(jnp.stack(list(_row_faults(requests, sched.idx_mapping, q, d).values())), axis=0)
    q = jnp.where(valid, q, 0)
    nlog = jnp.where(valid, 1 + d, 0)
    valid &= (jnp.cumsum(q) <= T) & (jnp.cumsum(nlog) <= L)  # a prefix of the rows fits
    return valid, jnp.where(valid, q, 0), jnp.where(valid, d, 0)


def dummy_step_batch(
    requests: RequestState,
    tables: BlockTables,
    *,
    num_reqs_padded: int,
    num_tokens_padded: int,
    num_logits_padded: int | None = None,
    backend: str = "reference",
) -> StepBatch:
    """An all-padding batch (idle data-parallel ranks, warm-up) through the same rules.

    Every slot is ``PAD_SLOT_ID``, every block-table row ``NULL_BLOCK_ID``,
    every id and position 0 — never the previous step's rows (PRs 39444, 49757).
    """
    return build_step_batch(
        requests,
        tables,
        ScheduledBatch.empty(num_reqs_padded),
        num_tokens_padded=num_tokens_padded,
        num_logits_padded=num_logits_padded,
        backend=backend,
    )


def validate_schedule(
    requests: RequestState, sched: ScheduledBatch, *, num_tokens_padded: int, num_logits_padded: int
) -> None:
    """Shape checks always; with concrete values, check the schedule against state and bucket.

    Rows must be in range (or -1), and no two rows with tokens may name one request row (a
    row with 0 tokens is padding, see :func:`_real_rows`: it reads and writes nothing, so it
    may name any row); query lengths non-negative and summing to at most ``T``; logits at
    most ``L``; positions within ``max_model_len``; a prefill row's query within its remaining
    ``prefill_len`` tokens; drafts non-negative; a row with drafts must be a decode row whose
    query is exactly ``1 + num_draft`` tokens, with ``num_draft <= num_speculative_tokens``.
    """
    idx = sched.idx_mapping
    validation.check_rank("idx_mapping", idx, 1)
    R = idx.shape[0]
    if R == 0:
        raise ValueError("the schedule must have at least one (possibly padded) request row")
    for name in ("num_scheduled_tokens", "num_draft_tokens"):  # counts: integers, never truncated
        v = getattr(sched, name)
        validation.check_shape(name, v, (R,))
        validation.check_dtype(name, v, "integer")
        validation.check_values_in_range(name, v, INT32_RANGE[0], INT32_RANGE[1])
    for n, v in (("num_tokens_padded", num_tokens_padded), ("num_logits_padded", num_logits_padded)):
        if not isinstance(v, int) or v <= 0:
            raise ValueError(f"{n} must be a positive int, got {v!r}")
    validation.check_values_in_range("idx_mapping", idx, 0, requests.max_num_reqs, allow=(-1,))
    i = validation.concrete_values(idx)
    q = validation.concrete_values(sched.num_scheduled_tokens)
    d = validation.concrete_values(sched.num_draft_tokens)
    if i is None or q is None or d is None:
        return
    live = is_real_row(i, requests.max_num_reqs)
    negative = np.flatnonzero(live & (q < 0))
    if negative.size:
        b = int(negative[0])
        raise ValueError(f"num_scheduled_tokens[{b}] must be non-negative, got {int(q[b])}")
    total = int(q[live].sum())
    if total > num_tokens_padded:
        raise ValueError(
            f"the schedule has {total} tokens, more than the bucket's num_tokens_padded="
            f"{num_tokens_padded}"
        )
    nlog = int((1 + d[live & (q > 0)]).sum())  # a row with 0 tokens is padding: no logits row
    if nlog > num_logits_padded:
        raise ValueError(
            f"the schedule needs {nlog} logits rows, more than num_logits_padded={num_logits_padded}"
        )
    nc_all = validation.concrete_values(requests.num_computed_tokens)
    pl_all = validation.concrete_values(requests.prefill_len)
    if nc_all is None or pl_all is None:
        return
    faults = _row_faults(requests, i, q, d, xp=np)
    for b in np.flatnonzero(live):
        kind = next((k for k, v in faults.items() if v[b]), None)
        if kind is None:
            continue
        row, qb, db = int(i[b]), int(q[b]), int(d[b])
        nc, pl = int(nc_all[row]), int(pl_all[row])
        raise ValueError({
            "repeated_row": f"idx_mapping must not repeat a request row among rows with tokens: batch "
                            f"row {b} names request row {row}, as an earlier one does, got {i.tolist()}",
            "past_max_model_len": f"batch row {b} (request row {row}) would reach position {nc + qb - 1}, "
                                  f"past max_model_len={requests.max_model_len}",
            "negative_drafts": f"num_draft_tokens[{b}] must be non-negative, got {db}",
            "too_many_drafts": f"num_draft_tokens[{b}]={db} exceeds num_speculative_tokens="
                               f"{requests.num_speculative_tokens}",
            "drafts_off_a_decode_window": f"batch row {b} has {db} drafts, so it must be a decode row "
                                          f"(num_computed {nc} >= prefill_len {pl}) with query length "
                                          f"{1 + db}, got {qb}",
            "chunk_past_the_prompt": f"batch row {b} (request row {row}) is a prefill row with {pl - nc} of "
                                     f"its {pl} tokens left to compute, but num_scheduled_tokens[{b}]={qb}: a "
                                     f"chunk cannot pass the tokens the request has (the rest would be "
                                     f"made-up zeros)",
            "decode_query_not_its_window": f"batch row {b} is a decode row: its query must be 1 + "
                                           f"num_draft_tokens = {1 + db} tokens, got {qb}",
        }[kind])


def _row_faults(requests: RequestState, idx, q, d, *, xp=jnp) -> dict:
    """The schedule's per-row rules against the state, one owner for both uses: bool ``[R]`` per
    rule, True where a real row (``idx`` names a request row, ``q > 0``) breaks it.
    ``repeated_row``: an earlier real row names the same request row (the first stays).
    :func:`validate_schedule` raises on the first (concrete schedules); :func:`_real_rows` makes
    such rows padding under ``jit`` (they compute, write and sample nothing). ``xp``: ``np`` for
    concrete values (the eager check, also inside a ``jit`` trace), ``jnp`` for traced ones."""
    idx, q, d = (xp.asarray(a).astype(xp.int32) for a in (idx, q, d))
    row_ok = (idx >= 0) & (idx < requests.max_num_reqs)
    real = row_ok & (q > 0)
    s = xp.where(row_ok, idx, 0)
    nc = xp.asarray(requests.num_computed_tokens)[s]
    pl = xp.asarray(requests.prefill_len)[s]
    # an [R, R] compare (one fusion inside the step on a GPU; a scatter into the request rows
    # would be a kernel of its own)
    R = idx.shape[0]
    earlier = xp.arange(R)[None, :] < xp.arange(R)[:, None]  # [b, j]: j before b
    repeated = xp.any(earlier & real[None, :] & (idx[None, :] == idx[:, None]), axis=1)
    decode = nc >= pl
    return {name: real & bad for name, bad in {
        "repeated_row": repeated,
        "past_max_model_len": nc + q > requests.max_model_len,
        "negative_drafts": d < 0,
        "too_many_drafts": d > requests.num_speculative_tokens,
        "drafts_off_a_decode_window": (d > 0) & (~decode | (q != 1 + d)),
        "chunk_past_the_prompt": ~decode & (nc + q > pl),
        "decode_query_not_its_window": decode & (q != 1 + d),
    }.items()}
