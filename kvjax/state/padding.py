"""The padding rules of a step, each in one place.

* Rows: a batch row whose ``idx_mapping`` entry is ``PAD_ROW_ID`` (-1) is
  padding. Under ``jit`` any entry outside ``[0, num_rows)`` is padding too
  (concrete inputs are rejected before, see ``check_values_in_range``). A
  padding row has no tokens, no logits, a NULL block-table row and no state
  slot. -1 is never used as an index: gathers read row 0 and are masked by
  :func:`is_real_row`; scatters send padding to ``num_rows`` with ``mode="drop"``.
* Tokens: token ``t`` belongs to the batch row ``b`` with
  ``query_start_loc[b] <= t < query_start_loc[b + 1]``; tokens from
  ``query_start_loc[R]`` on belong to no row (:func:`token_rows` gives ``R``).
* Slots: a slot is a write only when it is ``>= 0`` (:func:`is_real_slot`);
  ``PAD_SLOT_ID`` and every other negative value write nothing.
* Recurrent state: a padding row's state indices are ``NULL_BLOCK_ID``
  (:func:`pad_state_indices`) and its accepted-token count is 1, as vLLM pads
  (:func:`pad_accepted_counts`).
* Dummy steps: inputs naming no row, block, slot or request (:func:`names_nothing`).

Every function works on numpy arrays and on JAX arrays or tracers alike.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import contract as validation
from kvjax.constants import NULL_BLOCK_ID, PAD_ROW_ID as PAD_ROW_ID

INT32_RANGE = (validation.INT32_MIN, validation.INT32_MAX + 1)


def is_real_row(idx, num_rows: int):
    """bool, same shape as ``idx``: the entry names a request row in ``[0, num_rows)``."""
    return (idx >= 0) & (idx < num_rows)


def narrow_rows(name: str, idx, num_rows: int, *, allow_pad: bool = True):
    """Request rows as int32, range-checked before any narrowing (``2**32 + 1`` is not row 1).

    Concrete: a value outside ``[0, num_rows)`` raises ``ValueError`` naming ``name``
    (``PAD_ROW_ID`` is accepted when ``allow_pad``). Traced: such values become
    ``PAD_ROW_ID``, so the row reads and writes nothing.
    """
    allow = (PAD_ROW_ID,) if allow_pad else ()
    return validation.narrow_ids(name, idx, 0, num_rows, fill=PAD_ROW_ID, allow=allow)


def single_row(name: str, row, num_rows: int) -> np.ndarray:
    """``[row]`` (int64) for the one-row conveniences, which take a row, never padding:
    ``ValueError`` unless ``0 <= row < num_rows`` (``PAD_ROW_ID`` would silently do nothing)."""
    out = np.asarray([row], np.int64)
    validation.check_values_in_range(name, out, 0, num_rows)
    return out


def gather_index(idx, num_rows: int):
    """``idx`` with padding entries replaced by row 0: a gather index whose result is masked."""
    return jnp.where(is_real_row(idx, num_rows), idx, 0)


def scatter_index(idx, num_rows: int):
    """``idx`` with padding entries replaced by ``num_rows``: for ``.at[...].set(mode="drop")``."""
    return jnp.where(is_real_row(idx, num_rows), idx, num_rows)


# Widest row (int32 words) scatter_rows joins with other fields into one scatter. A wider field is
# scattered on its own: joined, every step would rewrite all of it (``R`` rows) into the joined
# table and back, where its own scatter writes only the ``U`` rows named, in place.
JOIN_MAX_WORDS = 16


def scatter_rows(dest: jax.Array, updates: dict) -> dict:
    """``{name: field.at[dest].set(values, mode="drop")}`` for ``updates = {name: (field,
    values)}``. Fields (``[R, ...]``, a 32-bit dtype) of at most :data:`JOIN_MAX_WORDS` words a
    row are viewed as int32 columns, concatenated, scattered once and split back (bit-exact: on
    a GPU each scatter is a kernel launch of its own); a wider field (a token or block table) is
    scattered alone, so only its named rows are written.
    """
    parts, vals, layout, out = [], [], [], {}
    U = dest.shape[0]
    for name, (field, values) in updates.items():
        if np.dtype(field.dtype).itemsize != 4:
            raise TypeError(f"scatter_rows: field {name!r} has dtype {field.dtype}; 32-bit dtypes only")
        R = field.shape[0]
        cols = int(np.prod(field.shape[1:], dtype=np.int64))
        values = jnp.broadcast_to(jnp.asarray(values).astype(field.dtype), (U,) + field.shape[1:])
        if cols > JOIN_MAX_WORDS:
            out[name] = field.at[dest].set(values, mode="drop")
            continue
        parts.append(jax.lax.bitcast_convert_type(field, jnp.int32).reshape(R, cols))
        vals.append(jax.lax.bitcast_convert_type(values, jnp.int32).reshape(U, cols))
        layout.append((name, cols, field.shape, field.dtype))
    if parts:
        table = jnp.concatenate(parts, axis=1).at[dest].set(jnp.concatenate(vals, axis=1), mode="drop")
        start = 0
        for name, cols, shape, dtype in layout:
            out[name] = jax.lax.bitcast_convert_type(table[:, start:start + cols].reshape(shape), dtype)
            start += cols
    return {name: out[name] for name in updates}


def token_rows(query_start_loc, num_tokens_padded: int):
    """int32 ``[T]``: the batch row of each token, ``R`` for tokens past ``query_start_loc[R]``."""
    t = jnp.arange(num_tokens_padded, dtype=jnp.int32)
    qsl = jnp.asarray(query_start_loc)
    return jnp.searchsorted(qsl[1:], t, side="right", method="compare_all").astype(jnp.int32)


def is_real_slot(slots):
    """bool, same shape as ``slots``: the slot is a write (``>= 0``; ``PAD_SLOT_ID`` is not)."""
    return slots >= 0


def pad_state_indices(state_indices, row_valid):
    """int32 state indices (``[R]`` or ``[R, 1 + k]``) with ``NULL_BLOCK_ID`` on padding rows, so a
    padding row can never read or write a state slot."""
    si = jnp.asarray(state_indices).astype(jnp.int32)
    valid = row_valid.reshape(row_valid.shape + (1,) * (si.ndim - 1))
    return jnp.where(valid, si, NULL_BLOCK_ID)


def pad_accepted_counts(num_accepted, row_valid):
    """int32 ``[R]`` accepted-token counts with 1 on padding rows (vLLM's padding value)."""
    return jnp.where(row_valid, jnp.asarray(num_accepted).astype(jnp.int32), 1)


def names_nothing(rows=(), ids=(), num_rows: int = 0):
    """bool scalar: none of ``rows`` (request-row arrays) names a row in ``[0, num_rows)`` and none
    of ``ids`` (block / slot id arrays) holds an id ``>= 0`` — a step that touches nothing."""
    named = [jnp.any(is_real_row(jnp.asarray(a), num_rows)) for a in rows]
    named += [jnp.any(jnp.asarray(a) >= 0) for a in ids]
    return ~jnp.any(jnp.stack(named)) if named else jnp.bool_(True)
