"""Per-request rows: token history, progress counters, last sampled and draft tokens.

Device side, :class:`RequestState` is a pytree of ``[max_num_reqs, ...]`` arrays
updated by pure functions. Host side, :class:`RequestRows` maps request ids to
rows with vLLM's LIFO free list, so a just-freed row is the next one reused and
stale-state bugs show up at once.

The rule from vLLM PR 39833 lives in :meth:`RequestState.add_requests`: every
per-row field that is read before the row's own first write is rewritten when
a request is added, so nothing of the previous tenant survives.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from pallas_kernels import contract as validation
from kvjax.constants import PAD_ROW_ID
from kvjax.state.padding import (
    INT32_RANGE, gather_index, is_real_row, narrow_rows, scatter_index, scatter_rows, single_row,
)


@struct.dataclass
class RequestState:
    """Device-side per-row request state (all arrays indexed by request row).

    Attributes:
      prompt_len: int32 ``[R]`` user prompt length.
      prefill_len: int32 ``[R]`` tokens given at add time (prompt, plus earlier
        outputs for a resumed request); ``prefill_len >= prompt_len``.
      total_len: int32 ``[R]`` tokens known so far (prefill + sampled).
      num_computed_tokens: int32 ``[R]`` tokens whose K/V is in the cache.
      all_token_ids: int32 ``[R, max_model_len]``; 0 past ``total_len`` in a live row (a
        cleared row keeps its old tokens until :meth:`add_requests` rewrites the whole row).
      last_sampled_tokens: int32 ``[R]`` the token the next decode step feeds.
      draft_tokens: int32 ``[R, num_speculative_tokens]``.
      num_accepted_tokens: int32 ``[R]`` tokens accepted in the last step (>= 1),
        used by recurrent layers to pick the initial state column.
      temperature, top_p: float32 ``[R]``; top_k: int32 ``[R]`` (0 = off); seed: int32 ``[R]``
        (the sampler's key of the token at position ``p`` is ``fold_in(key(seed), p)``;
        temperature 0 is greedy). Read by :mod:`kvjax.runner.sampling`.
    """

    prompt_len: jax.Array
    prefill_len: jax.Array
    total_len: jax.Array
    num_computed_tokens: jax.Array
    all_token_ids: jax.Array
    last_sampled_tokens: jax.Array
    draft_tokens: jax.Array
    num_accepted_tokens: jax.Array
    temperature: jax.Array
    top_p: jax.Array
    top_k: jax.Array
    seed: jax.Array

    @classmethod
    def create(cls, max_num_reqs: int, max_model_len: int, num_speculative_tokens: int = 0):
        """All rows empty (zeros; ``num_accepted_tokens`` 1, ``top_p`` 1)."""
        if max_num_reqs <= 0 or max_model_len <= 0 or num_speculative_tokens < 0:
            raise ValueError(
                "max_num_reqs and max_model_len must be positive and num_speculative_tokens "
                f"non-negative, got {max_num_reqs}, {max_model_len}, {num_speculative_tokens}"
            )
        def z():  # distinct buffers, so the whole state can be donated
            return jnp.zeros((max_num_reqs,), jnp.int32)

        return cls(
            prompt_len=z(),
            prefill_len=z(),
            total_len=z(),
            num_computed_tokens=z(),
            all_token_ids=jnp.zeros((max_num_reqs, max_model_len), jnp.int32),
            last_sampled_tokens=z(),
            draft_tokens=jnp.zeros((max_num_reqs, num_speculative_tokens), jnp.int32),
            num_accepted_tokens=jnp.ones((max_num_reqs,), jnp.int32),
            temperature=jnp.zeros((max_num_reqs,), jnp.float32),
            top_p=jnp.ones((max_num_reqs,), jnp.float32),
            top_k=z(),
            seed=z(),
        )

    @property
    def max_num_reqs(self) -> int:
        return self.prompt_len.shape[0]

    @property
    def max_model_len(self) -> int:
        return self.all_token_ids.shape[1]

    @property
    def num_speculative_tokens(self) -> int:
        return self.draft_tokens.shape[1]

    def add_requests(self, new: "NewRequests") -> "RequestState":
        """Install requests into rows, rewriting every field read before the row's first write.

        * ``all_token_ids[row]`` = the given tokens, zeros after them (no stale tail);
        * ``prefill_len = total_len = num_tokens``; ``prompt_len``, ``num_computed_tokens``;
        * ``last_sampled_tokens = all_token_ids[num_computed - 1]`` when
          ``0 < num_computed <= prefill_len``, else 0 (PR 39833);
        * ``draft_tokens = 0``; ``num_accepted_tokens = 1``; sampling parameters.

        Entries with ``row == -1`` are ignored. Jit-able. Every entry is checked by
        :meth:`NewRequests.validate`: concrete, a bad value is a ``ValueError``; under ``jit``
        an entry that breaks a rule, or names a row another installed entry names, is not
        installed (its row keeps what it had).
        """
        new = new.validate(self)
        dest = scatter_index(new.rows, self.max_num_reqs)

        L = self.max_model_len
        tokens = new.token_ids  # 0 past num_tokens
        nc = new.num_computed_tokens
        has_last = (nc > 0) & (nc <= new.num_tokens)
        last = jnp.take_along_axis(tokens, jnp.clip(nc - 1, 0, L - 1)[:, None], axis=1)[:, 0]
        last = jnp.where(has_last, last, 0)
        return self.replace(**scatter_rows(dest, {
            "prompt_len": (self.prompt_len, new.prompt_len),
            "prefill_len": (self.prefill_len, new.num_tokens),
            "total_len": (self.total_len, new.num_tokens),
            "num_computed_tokens": (self.num_computed_tokens, nc),
            "all_token_ids": (self.all_token_ids, tokens),
            "last_sampled_tokens": (self.last_sampled_tokens, last),
            "draft_tokens": (self.draft_tokens, 0),
            "num_accepted_tokens": (self.num_accepted_tokens, 1),
            "temperature": (self.temperature, new.temperature),
            "top_p": (self.top_p, new.top_p),
            "top_k": (self.top_k, new.top_k),
            "seed": (self.seed, new.seed),
        }))

    def add_request(
        self,
        row: int,
        token_ids: Sequence[int],
        *,
        prompt_len: int | None = None,
        num_computed_tokens: int = 0,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
    ) -> "RequestState":
        """Install one request into ``row`` (host convenience over :meth:`add_requests`)."""
        single_row("row", row, self.max_num_reqs)
        new = NewRequests.from_lists(
            [row],
            [list(token_ids)],
            max_model_len=self.max_model_len,
            prompt_lens=[len(token_ids) if prompt_len is None else prompt_len],
            num_computed_tokens=[num_computed_tokens],
            temperature=[temperature],
            top_p=[top_p],
            top_k=[top_k],
            seed=[seed],
        )
        return self.add_requests(new)

    def clear_rows(self, rows: jax.Array) -> "RequestState":
        """Reset rows to the empty state (the requests left); ``-1`` entries ignored.

        Every field but ``all_token_ids`` is reset: a cleared row's tokens are never read
        (``total_len`` is 0) and :meth:`add_requests` rewrites the whole row, zeros after the new
        tokens, so nothing of them survives. Zeroing them here would write ``max_model_len``
        words for each of the rows a step may clear (every row) at every step."""
        validation.check_rank("rows", rows, 1)
        rows = narrow_rows("rows", rows, self.max_num_reqs)
        dest = scatter_index(rows, self.max_num_reqs)
        empty = RequestState.create(1, 1, self.num_speculative_tokens)
        return self.replace(**scatter_rows(dest, {
            name: (getattr(self, name), getattr(empty, name)[0]) for name in self.reset_on_clear()
        }))

    @classmethod
    def reset_on_clear(cls) -> tuple[str, ...]:
        """The fields :meth:`clear_rows` resets to :meth:`create`'s values (all but the tokens)."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.name != "all_token_ids")

    def set_draft_tokens(self, idx_mapping: jax.Array, drafts: jax.Array) -> "RequestState":
        """Write proposed drafts, integer ``[R_padded, num_speculative_tokens]``, for the batch rows.

        ``idx_mapping`` entries must be rows or ``PAD_ROW_ID`` and drafts token ids
        (:func:`narrow_token_ids`; ``ValueError`` when concrete; under ``jit`` such rows /
        drafts are dropped / 0).
        """
        validation.check_rank("idx_mapping", idx_mapping, 1)
        idx_mapping = narrow_rows("idx_mapping", idx_mapping, self.max_num_reqs)
        validation.check_shape("drafts", drafts, (idx_mapping.shape[0], self.num_speculative_tokens))
        drafts = narrow_token_ids("drafts", drafts, fill=0)
        dest = scatter_index(idx_mapping, self.max_num_reqs)
        return self.replace(draft_tokens=self.draft_tokens.at[dest].set(drafts, mode="drop"))

    def post_update(
        self,
        idx_mapping: jax.Array,
        query_lens: jax.Array,
        sampled: jax.Array,
        num_sampled: jax.Array,
    ) -> "RequestState":
        """Apply a step's sampled and accepted tokens.

        Args:
          idx_mapping: int32 ``[R_padded]``; padding rows (``PAD_ROW_ID``) are skipped.
          query_lens: int32 ``[R_padded]`` tokens scheduled for each batch row.
          sampled: integer ``[R_padded, S]`` sampled tokens, accepted ones first; the kept ones
            (the first ``kept`` of a row, see below) must be token ids, as drafts must
            (:func:`narrow_token_ids`); the rest are not read.
          num_sampled: int32 ``[R_padded]`` accepted count (``<= S``); forced to 0
            for a mid-prefill chunk (``seq_len < prefill_len``).

        Per real row ``s = idx_mapping[b]``: ``num_computed`` and the kept sample count
        follow :func:`step_progress`; ``num_accepted_tokens = max(kept, 1)``. The kept tokens
        are appended at ``total_len`` while the row has columns: a row holds at most
        ``max_model_len`` tokens, so a sample past that (the one sampled from position
        ``max_model_len - 1``) is dropped, not written, not counted in ``total_len`` (which
        never passes ``max_model_len``) and not ``last_sampled``, which is the last token
        appended (unchanged when none is).

        A real row's ``num_sampled`` must be at most its :func:`sample_window`,
        ``1 + num_drafts`` (``num_drafts = query_lens - 1`` for a decode window, 0 for the
        chunk that finishes prefill): concrete, ``ValueError``. Under ``jit`` a row that
        breaks this, whose query is negative or ends past ``max_model_len``, or whose kept
        samples are not all token ids, is left unchanged (every field as before the step).
        """
        validation.check_rank("idx_mapping", idx_mapping, 1)
        idx = narrow_rows("idx_mapping", idx_mapping, self.max_num_reqs)
        Rp = idx.shape[0]
        validation.check_shape("query_lens", query_lens, (Rp,))
        validation.check_rank("sampled", sampled, 2)
        validation.check_shape("sampled", sampled, (Rp, None))
        validation.check_dtype("sampled", sampled, "integer")
        validation.check_shape("num_sampled", num_sampled, (Rp,))
        R, L, S = self.max_num_reqs, self.max_model_len, sampled.shape[1]
        n_s = validation.narrow_ids("num_sampled", num_sampled, 0, S + 1, fill=-1)
        qlen = validation.narrow_ids("query_lens", query_lens, 0, L + 1, fill=-1)
        s = gather_index(idx, R)
        nc, pl, tl = self.num_computed_tokens[s], self.prefill_len[s], self.total_len[s]
        self._check_query_fits(idx, qlen, nc)
        real = is_real_row(idx, R)
        i, q, c, p = (validation.concrete_values(a) for a in (idx, qlen, nc, pl))
        n_s, new_nc, fits = _step_progress(
            nc, pl, jnp.where(real, qlen, 0), n_s, xp=jnp, describe=lambda b: (
                f" for request row {i[b]} (query_lens[{b}]={q[b]}, {c[b]} of its {p[b]} prefill "
                f"tokens computed)"))
        # Under jit a row breaking a check (above, or the kept tokens' below) is skipped: it is
        # left unchanged.
        valid = real & (qlen >= 0) & (nc + qlen <= L) & fits
        n_s = jnp.where(valid, n_s, 0)
        j = jnp.arange(S, dtype=jnp.int32)[None, :]
        kept = valid[:, None] & (j < n_s[:, None])
        sampled = narrow_token_ids("sampled", sampled, fill=-1, used=kept)
        valid &= ~jnp.any(kept & (sampled < 0), axis=1)
        dest = scatter_index(jnp.where(valid, idx, PAD_ROW_ID), R)
        # Sampled tokens go to all_token_ids[s, total_len + j] for j < n_stored: the kept ones
        # that have a column (a row holds at most max_model_len tokens).
        n_stored = jnp.minimum(n_s, jnp.maximum(L - tl, 0))
        tok_col = tl[:, None] + j
        tok_ok = valid[:, None] & (j < n_stored[:, None])
        all_ids = self.all_token_ids.at[
            jnp.where(tok_ok, s[:, None], R), jnp.where(tok_ok, tok_col, L)
        ].set(sampled, mode="drop")
        last = jnp.take_along_axis(sampled, jnp.clip(n_stored - 1, 0, S - 1)[:, None], axis=1)[:, 0]
        has_sample = valid & (n_stored > 0)
        last = jnp.where(has_sample, last, self.last_sampled_tokens[s])  # none stored: unchanged
        return self.replace(all_token_ids=all_ids, **scatter_rows(dest, {
            "total_len": (self.total_len, tl + n_stored),
            "num_computed_tokens": (self.num_computed_tokens, new_nc),
            "last_sampled_tokens": (self.last_sampled_tokens, last),
            "num_accepted_tokens": (self.num_accepted_tokens, jnp.maximum(n_s, 1)),
        }))

    def _check_query_fits(self, idx, qlen, nc) -> None:
        """Concrete: every real row's query ends within ``max_model_len``."""
        i, q, c = (validation.concrete_values(a) for a in (idx, qlen, nc))
        if i is None or q is None or c is None:
            return
        for b in np.flatnonzero(is_real_row(i, self.max_num_reqs)):
            if c[b] + q[b] > self.max_model_len:
                raise ValueError(
                    f"query_lens[{b}]={q[b]}: request row {i[b]} has {c[b]} tokens computed, so "
                    f"its query would end past max_model_len={self.max_model_len}"
                )


# A token id is an int in [0, 2**31): the one rule of the ids add_requests, set_draft_tokens
# and post_update store.
TOKEN_ID_RANGE = (0, INT32_RANGE[1])


def check_token_ids(name: str, ids) -> None:
    """Static: ``ids`` has an integer dtype (a float id is refused, never truncated). Concrete:
    every id is in :data:`TOKEN_ID_RANGE`, else ``ValueError`` naming ``name``, the index and
    the value (checked as given, before any narrowing)."""
    validation.check_dtype(name, ids, "integer")
    validation.check_values_in_range(name, ids, *TOKEN_ID_RANGE)


def narrow_token_ids(name: str, ids, *, fill: int, used=None):
    """Token ids as int32, checked by :func:`check_token_ids` before any narrowing.

    With ``used`` (a bool mask of ``ids``'s shape) only the used ids are checked and the
    others read 0 (a traced mask checks every concrete id). Traced ids: an id outside the range
    becomes ``fill``.
    """
    validation.check_dtype(name, ids, "integer")
    v = validation.concrete_values(ids)
    u = None if used is None else validation.concrete_values(used)
    if v is not None and u is not None:
        ids = np.where(u, v, 0)
    return validation.narrow_ids(name, ids, *TOKEN_ID_RANGE, fill=fill)  # check_token_ids' checks, then int32


# The sampling parameters' rule (its one owner): name -> (what a value must be, its test). A
# test takes numbers or arrays (numpy or jax): integers as given, floats as stored (float32).
# kvjax.host.scheduler.Request checks its parameters through check_sampling_params.
SAMPLING_RULES = {
    "temperature": ("a number >= 0", lambda x: x >= 0),
    "top_p": ("in (0, 1]", lambda x: (x > 0) & (x <= 1)),
    "top_k": ("an int in [0, 2**31) (0: off)", lambda x: (x >= 0) & (x <= validation.INT32_MAX)),
    "seed": ("an int in [0, 2**31)", lambda x: (x >= 0) & (x <= validation.INT32_MAX)),
}
INT_SAMPLING_PARAMS = ("top_k", "seed")  # the others are real numbers, stored as float32


def check_sampling_params(where: str = "", live=None, **params) -> None:
    """``ValueError`` unless every given sampling parameter follows :data:`SAMPLING_RULES`.

    ``params``: numbers, or numpy arrays of one shape with ``live`` (bool) marking the entries
    to check. ``top_k`` and ``seed`` must be integers (as given, before any narrowing),
    ``temperature`` and ``top_p`` integers or floats (checked as float32, the stored width); a
    bool is neither. The message names the parameter (and index), the rule and the value;
    ``where`` prefixes it (e.g. ``"request 'a': "``).
    """
    for name, x in params.items():
        want, test = SAMPLING_RULES[name]
        v = np.asarray(x)
        is_int = name in INT_SAMPLING_PARAMS
        real = v.dtype.kind in "iuf" or jnp.issubdtype(v.dtype, jnp.floating)  # bfloat16 too
        if not (v.dtype.kind in "iu" if is_int else real):
            raise ValueError(f"{where}{name} must be {want}, got {x!r}")
        stored = v if is_int else v.astype(np.float32)
        bad = ~test(stored) if live is None else np.asarray(live) & ~test(stored)
        first = np.argwhere(bad)  # [count, ndim]: (1, 0) for a bad number
        if len(first):
            i = tuple(int(k) for k in first[0])
            at = f"[{', '.join(map(str, i))}]" if i else ""
            got = f"{v[i]}"
            if test(v[i]):  # a float fine as given but not as stored
                got += f" ({stored[i]} as float32)"
            raise ValueError(f"{where}{name}{at} must be {want}, got {got}")


_INT_FIELDS = ("num_tokens", "prompt_len", "num_computed_tokens", "top_k", "seed")
_FLOAT_FIELDS = ("temperature", "top_p")
_DEFAULTS = dict(num_tokens=0, prompt_len=0, num_computed_tokens=0, temperature=0.0, top_p=1.0,
                 top_k=0, seed=0)


def _dtype(name: str):
    """The stored dtype of a :class:`NewRequests` field other than rows and token ids."""
    return np.int32 if name in _INT_FIELDS else np.float32


def _length_rules(f, max_model_len: int):
    """A :class:`NewRequests` entry's length rules, in order: ``(field, ok, expected)``, ``ok``
    bool ``[U]`` and ``expected(u)`` the words for entry ``u``. ``f``: the fields, numpy
    (concrete, as given) or jax (int32) arrays."""
    n, p, c = f["num_tokens"], f["prompt_len"], f["num_computed_tokens"]
    return [
        ("num_tokens", (n >= 1) & (n <= max_model_len),
         lambda u: f"in [1, max_model_len={max_model_len}]"),
        ("prompt_len", (p >= 1) & (p <= n), lambda u: f"in [1, num_tokens={n[u]}]"),
        ("num_computed_tokens", (c >= 0) & (c <= n), lambda u: f"in [0, num_tokens={n[u]}]"),
    ]


def _check_entries(f, live, max_model_len: int) -> None:
    """Concrete: ``ValueError`` naming the first live entry that breaks a length rule, then a
    sampling rule (``f``: numpy fields as given)."""
    for name, ok, expected in _length_rules(f, max_model_len):
        bad = np.flatnonzero(live & ~ok)
        if bad.size:
            u = int(bad[0])
            raise ValueError(f"{name}[{u}] must be {expected(u)}, got {f[name][u]}")
    check_sampling_params(live=live, **{name: f[name] for name in SAMPLING_RULES})


def _entries_ok(f, max_model_len: int):
    """bool ``[U]``: the entry follows every length and sampling rule (``f`` as in
    :func:`_length_rules`, floats float32)."""
    ok = [rule_ok for _, rule_ok, _ in _length_rules(f, max_model_len)]
    ok += [test(f[name]) for name, (_, test) in SAMPLING_RULES.items()]
    out = ok[0]
    for o in ok[1:]:
        out = out & o
    return out


def sample_window(num_computed, prefill_len, query_len, *, xp=np):
    """How many tokens a row may sample this step: the one bound of ``num_sampled``.

    With ``seq_len = num_computed + query_len``: 0 for a row with no tokens (``query_len <= 0``)
    and for a mid-prefill chunk (``seq_len < prefill_len``), which sample nothing; else
    ``1 + num_drafts``, with ``num_drafts = query_len - 1`` for a decode window
    (``num_computed >= prefill_len``) and 0 for the chunk that finishes prefill. ``xp`` as in
    :func:`step_progress`.
    """
    idle = query_len <= 0
    mid_prefill = num_computed + query_len < prefill_len
    num_drafts = xp.where(num_computed >= prefill_len, xp.maximum(query_len - 1, 0), 0)
    return xp.where(idle | mid_prefill, 0, 1 + num_drafts)


def num_sampled_fits(num_sampled, window):
    """bool: ``num_sampled`` is in ``[0, window]``, or the row samples nothing (``window`` 0,
    when ``num_sampled`` is ignored). ``window`` from :func:`sample_window`."""
    return (window == 0) | ((num_sampled >= 0) & (num_sampled <= window))


def step_progress(num_computed, prefill_len, query_len, num_sampled, *, xp=np):
    """How one step moves a request: the rule :meth:`RequestState.post_update` applies on
    the device and the host schedulers apply to their own copies (one owner).

    ``xp`` is the array module (``numpy`` on the host, ``jax.numpy`` on the device);
    arguments are ints or int arrays of one shape. With ``window`` =
    :func:`sample_window` (``1 + num_drafts``, or 0 when the row samples nothing):

    * a row with no tokens (``query_len <= 0``) does not move;
    * mid-prefill chunk (``seq_len < prefill_len``): nothing is sampled, whatever
      ``num_sampled`` says, and the chunk is computed;
    * otherwise ``num_sampled`` must be in ``[0, window]``, and the
      ``window - num_sampled`` rejected positions are not computed. More samples than the
      window would be a negative rejection count: ``num_computed`` would pass the tokens
      whose K/V was written. Concrete arguments: ``ValueError``. Traced: such a row does not
      move (``(0, num_computed)``).

    Returns ``(num_sampled_kept, new_num_computed)``; the kept sampled tokens are
    appended to the request.
    """
    kept, new_num_computed, _ = _step_progress(num_computed, prefill_len, query_len, num_sampled, xp=xp)
    return kept, new_num_computed


def _step_progress(num_computed, prefill_len, query_len, num_sampled, *, xp, describe=None):
    """:func:`step_progress`'s rule, spelled once: ``(num_sampled_kept, new_num_computed,
    fits)``, ``fits`` from :func:`num_sampled_fits` (False: the row does not move). Concrete
    arguments are checked by :func:`_check_num_sampled` (``describe`` as there)."""
    window = sample_window(num_computed, prefill_len, query_len, xp=xp)
    _check_num_sampled(num_sampled, window, describe)
    fits = num_sampled_fits(num_sampled, window)  # traced: a row that does not, does not move
    kept = xp.where(fits & (window > 0), num_sampled, 0)
    num_rejected = xp.where(window > 0, window - kept, 0)
    moves = (query_len > 0) & fits
    return kept, xp.where(moves, num_computed + query_len - num_rejected, num_computed), fits


def _check_num_sampled(num_sampled, window, describe=None) -> None:
    """Concrete: :func:`num_sampled_fits` everywhere, else ``ValueError`` naming the first entry
    that does not (``describe(index)`` adds the caller's words for it)."""
    n, w = validation.concrete_values(num_sampled), validation.concrete_values(window)
    if n is None or w is None:
        return
    n, w = np.broadcast_arrays(n, w)
    bad = np.argwhere(~num_sampled_fits(n, w))  # [count, ndim]: (1, 0) for a bad scalar
    if len(bad):
        i = tuple(int(v) for v in bad[0])
        at = f"[{', '.join(map(str, i))}]" if i else ""
        which = describe(*i) if describe else ""
        raise ValueError(
            f"num_sampled{at}={n[i]} must be in [0, {w[i]}] (1 + num_drafts){which}: "
            f"more samples than the window would be a negative rejection count, moving "
            f"num_computed_tokens past the tokens whose K/V was written"
        )


@struct.dataclass
class NewRequests:
    """A fixed-shape batch of requests to install (``U`` entries; ``row=-1`` unused).

    Attributes:
      rows: int32 ``[U]``.
      token_ids: int32 ``[U, max_model_len]``, the first ``num_tokens`` used.
      num_tokens: int32 ``[U]`` (becomes ``prefill_len`` and ``total_len``).
      prompt_len, num_computed_tokens, top_k: int32 ``[U]``.
      temperature, top_p: float32 ``[U]``; seed: int32 ``[U]``.
    """

    rows: jax.Array
    token_ids: jax.Array
    num_tokens: jax.Array
    prompt_len: jax.Array
    num_computed_tokens: jax.Array
    temperature: jax.Array
    top_p: jax.Array
    top_k: jax.Array
    seed: jax.Array

    @classmethod
    def from_lists(
        cls,
        rows: Sequence[int],
        token_ids: Sequence[Sequence[int]],
        *,
        max_model_len: int,
        prompt_lens: Sequence[int] | None = None,
        num_computed_tokens: Sequence[int] | None = None,
        temperature: Sequence[float] | None = None,
        top_p: Sequence[float] | None = None,
        top_k: Sequence[int] | None = None,
        seed: Sequence[int] | None = None,
        pad_to: int | None = None,
    ) -> "NewRequests":
        """Build from Python lists on the host (numpy), padded to ``pad_to`` entries.

        Every value is checked as given, before it is narrowed to int32 / float32, by the
        rules of :meth:`validate` that need no state (all but the rows' upper bound and
        distinctness): a float length or id is refused, never truncated, and ``2**40`` never
        wraps. ``prompt_lens`` defaults to the token counts.
        """
        n = len(rows)
        U = n if pad_to is None else pad_to
        if len(token_ids) != n:
            raise ValueError(f"token_ids must have one list per row ({n}), got {len(token_ids)}")
        if U < n:
            raise ValueError(f"pad_to={pad_to} is smaller than the {n} requests given")
        ids = np.zeros((U, max_model_len), np.int32)
        for u, t in enumerate(token_ids):
            if len(t) == 0:
                raise ValueError(f"token_ids[{u}] is empty: a request needs at least one token")
            if len(t) > max_model_len:
                raise ValueError(
                    f"token_ids[{u}] has {len(t)} tokens, more than max_model_len={max_model_len}"
                )
            t = np.asarray(t)
            check_token_ids(f"token_ids[{u}]", t)
            ids[u, : len(t)] = t

        def col(name, values, default, kinds):
            """``values`` (``n``, as given) padded with ``default`` to ``U`` entries."""
            pad = np.full((U - n,), default)
            if values is None:
                return np.concatenate([np.full((n,), default), pad])
            if len(values) != n:
                raise ValueError(f"{name} must have one value per row ({n}), got {len(values)}")
            v = np.asarray(values)
            if n:
                validation.check_dtype(name, v, kinds)
            return np.concatenate([v, pad])

        r = col("rows", rows, PAD_ROW_ID, "integer")
        validation.check_values_in_range("rows", r, *INT32_RANGE)
        lens = [len(t) for t in token_ids]
        given = dict(
            num_tokens=lens, prompt_len=lens if prompt_lens is None else prompt_lens,
            num_computed_tokens=num_computed_tokens, temperature=temperature, top_p=top_p,
            top_k=top_k, seed=seed,
        )
        arg = dict(prompt_len="prompt_lens")  # from_lists's names, where they differ
        wide = {
            name: col(arg.get(name, name), given[name], _DEFAULTS[name],
                      "integer" if name in _INT_FIELDS else ("integer", "floating"))
            for name in _INT_FIELDS + _FLOAT_FIELDS
        }
        _check_entries(wide, np.arange(U) < n, max_model_len)  # padding holds the defaults
        return cls(
            rows=r.astype(np.int32),
            token_ids=ids,
            **{name: v.astype(_dtype(name)) for name, v in wide.items()},
        )

    def validate(self, state: RequestState) -> "NewRequests":
        """The entries to install into ``state``: int32 / float32, token ids 0 past
        ``num_tokens``, and ``rows`` ``PAD_ROW_ID`` where an entry is not installed.

        Static (always): shapes; an integer dtype for ``rows``, ``token_ids`` and the integer
        fields, a floating dtype for ``temperature`` and ``top_p``. Values, for every entry
        whose row is not -1: ``rows`` in ``[0, max_num_reqs)`` and distinct; ``num_tokens`` in
        ``[1, max_model_len]``; ``prompt_len`` in ``[1, num_tokens]``; ``num_computed_tokens``
        in ``[0, num_tokens]``; the first ``num_tokens`` token ids in :data:`TOKEN_ID_RANGE`;
        the sampling parameters by :data:`SAMPLING_RULES`. Concrete: checked as given (before
        any narrowing to int32; floats as stored, float32), a bad value is a ``ValueError``
        naming the field, the entry, the rule and the value. Traced: an entry that breaks one
        is not installed, and neither is an entry whose row another installed entry names.
        """
        validation.check_rank("rows", self.rows, 1)
        U, R, L = self.rows.shape[0], state.max_num_reqs, state.max_model_len
        validation.check_shape("token_ids", self.token_ids, (U, L))
        validation.check_dtype("token_ids", self.token_ids, "integer")
        for name in _INT_FIELDS + _FLOAT_FIELDS:
            validation.check_shape(name, getattr(self, name), (U,))
            kind = "integer" if name in _INT_FIELDS else "floating"
            validation.check_dtype(name, getattr(self, name), kind)
        rows = narrow_rows("rows", self.rows, R)
        given = {name: validation.concrete_values(getattr(self, name))
                 for name in _INT_FIELDS + _FLOAT_FIELDS}
        r = validation.concrete_values(rows)
        concrete = r is not None and all(v is not None for v in given.values())
        if concrete:  # every live entry is checked here (ValueError) and installed: no mask
            install = np.asarray(is_real_row(r, R))
            _check_entries(given, install, L)
            if len(np.unique(r[install])) != install.sum():
                raise ValueError(f"rows must be distinct in one add, got {r.tolist()}")
            # every live value is in range now: int32 / float32 hold it
            f = {name: np.where(install, v, _DEFAULTS[name]).astype(_dtype(name))
                 for name, v in given.items()}
            col = np.arange(L, dtype=np.int32)[None, :]
        else:  # traced: a value past int32 becomes -1, which breaks every rule of its field
            f = {name: validation.as_int32(name, getattr(self, name), fill=-1)
                 for name in _INT_FIELDS}
            f.update({n: jnp.asarray(getattr(self, n), jnp.float32) for n in _FLOAT_FIELDS})
            install = is_real_row(rows, R) & _entries_ok(f, L)
            col = jnp.arange(L, dtype=jnp.int32)[None, :]
        used = install[:, None] & (col < f["num_tokens"][:, None])
        # concrete ids are checked (ValueError); a traced used id outside the range reads -1
        tokens = narrow_token_ids("token_ids", self.token_ids, fill=-1, used=used)
        if not validation.is_concrete(self.token_ids):
            install = install & ~jnp.any(used & (tokens < 0), axis=1)
        if not concrete:  # rows checked distinct above when concrete
            same_row = (rows[:, None] == rows[None, :]) & install[:, None] & install[None, :]
            install &= jnp.sum(same_row, axis=1) == 1
        return NewRequests(
            rows=jnp.where(install, rows, PAD_ROW_ID),
            token_ids=jnp.where(used, tokens, 0),
            **f,
        )


class RequestRows:
    """Host bookkeeping: request id <-> row, with vLLM's LIFO free list.

    ``free_rows`` starts as ``[0, 1, ..., max_num_reqs-1]`` and is used as a
    stack: :meth:`add` pops the last, :meth:`remove` pushes the row back, so a
    just-freed row is the next one handed out.
    """

    def __init__(self, max_num_reqs: int):
        if max_num_reqs <= 0:
            raise ValueError(f"max_num_reqs must be positive, got {max_num_reqs}")
        self.max_num_reqs = max_num_reqs
        self.free_rows: list[int] = list(range(max_num_reqs))
        self.req_id_to_row: dict[str, int] = {}
        self.row_to_req_id: dict[int, str] = {}

    def __len__(self) -> int:
        return len(self.req_id_to_row)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.req_id_to_row

    def row(self, req_id: str) -> int:
        try:
            return self.req_id_to_row[req_id]
        except KeyError:
            raise KeyError(f"unknown request id {req_id!r}") from None

    def add(self, req_id: str) -> int:
        """Give ``req_id`` a row (the most recently freed one)."""
        if req_id in self.req_id_to_row:
            raise ValueError(f"request id {req_id!r} already has row {self.req_id_to_row[req_id]}")
        if not self.free_rows:
            raise ValueError(f"no free request row: all {self.max_num_reqs} rows are in use")
        row = self.free_rows.pop()
        self.req_id_to_row[req_id] = row
        self.row_to_req_id[row] = req_id
        return row

    def remove(self, req_id: str) -> int:
        """Free ``req_id``'s row and return it."""
        row = self.row(req_id)
        del self.req_id_to_row[req_id]
        del self.row_to_req_id[row]
        self.free_rows.append(row)
        return row

    def check(self) -> None:
        """Free and active rows are disjoint and together cover every row exactly once."""
        active = set(self.row_to_req_id)
        free = self.free_rows
        if len(set(free)) != len(free):
            raise AssertionError(f"free rows repeat: {free}")
        if active & set(free):
            raise AssertionError(f"rows both free and active: {sorted(active & set(free))}")
        if active | set(free) != set(range(self.max_num_reqs)):
            raise AssertionError("free and active rows do not cover every row")
        if {r: q for q, r in self.req_id_to_row.items()} != self.row_to_req_id:
            raise AssertionError("req_id_to_row and row_to_req_id disagree")
