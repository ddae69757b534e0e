"""The runner's checked mode (``RunnerConfig(poison=True)``, ``demo --poison``).

Poison alone only shows when NaN reaches the logits; a model that masks reads by
value hides it, so a write into the null block, a missing zero or a
stale row field would pass unseen. In checked mode the step also verifies
memory on the device, inside the same ahead-of-time compiled executable (no
extra compile, one small extra output per step):

Within the step, after its staged writes and before the model runs:

* ``fresh_block_not_zero`` / ``fresh_slot_not_zero``: every KV block handed out
  this step (listed for zeroing or appended to a table) and every recurrent slot
  listed for zeroing is bitwise zero before its first write;
* ``added_row_holds_poison``: rows installed this step are filled with
  :data:`ROW_POISON_BITS` just before ``add_requests``, which must rewrite every
  field (PR 39833).

After the step:

* ``null_block_changed`` / ``null_slot_changed``: block 0 of every KV array and
  slot 0 of every recurrent-state array still hold the poison bit pattern;
* ``live_block_holds_nan`` / ``live_slot_holds_nan``: no block in a live row's
  device table and no live recurrent slot holds NaN (poison or anything
  computed from it);
* ``free_row_not_reset``: free request rows hold :meth:`RequestState.create`'s
  values, bitwise, in every field :meth:`RequestState.clear_rows` resets;
* ``device_table_differs`` / ``device_count_differs``: the device block tables
  equal the host's (:class:`HostMirror`, built from the plans sent);
* ``idle_rank_changed``: a data rank that ran the dummy step left its whole state
  (request rows, block tables, every pool) bitwise unchanged.

On a mesh every data rank runs these checks on its own memory against its own
host mirror; a violation names the rank.

The poison is a NaN with a payload (float32 ``0x7FE5A5A5``), so a bug that
writes a computed value, finite or a canonical NaN, into the null block differs
from it bitwise. float8_e4m3fn has a single NaN (``0x7F``): there a NaN written
into the null block is indistinguishable from the poison.

A violation raises :class:`SanitizerError` with the step, the invariant, the
array and the first offending index.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.constants import NULL_BLOCK_ID
from kvjax.state import RequestState, expand_to_kernel_blocks, is_real_row, is_real_slot, scatter_index

# Bit patterns of the poison, per dtype (quiet NaNs with a payload where the format has one).
POISON_BITS = {
    jnp.dtype(jnp.float32): 0x7FE5A5A5,
    jnp.dtype(jnp.bfloat16): 0x7FE5,
    jnp.dtype(jnp.float16): 0x7E5A,
    jnp.dtype(jnp.float8_e4m3fn): 0x7F,
}
# Written into request-row fields (int32 / float32) before add_requests; never a valid value.
ROW_POISON_BITS = 0xA5A5A5A5

# Invariants, in the order a step checks them (the first violated one is reported).
INVARIANTS = (
    "fresh_block_not_zero",
    "fresh_slot_not_zero",
    "added_row_holds_poison",
    "null_block_changed",
    "null_slot_changed",
    "device_table_differs",
    "device_count_differs",
    "free_row_not_reset",
    "live_block_holds_nan",
    "live_slot_holds_nan",
    "idle_rank_changed",
)


class SanitizerError(RuntimeError):
    """A memory invariant of the checked mode failed.

    Attributes: ``step`` (the scheduler's step number; ``"dummy"`` for an all-padding
    step, ``"release"`` for :meth:`~kvjax.runner.Runner.release_all`),
    ``invariant`` (one of :data:`INVARIANTS` or a host check), ``array`` (its
    name) and ``index`` (the first offending index into that array).
    """

    def __init__(self, step, invariant: str, array: str, index: tuple[int, ...], rank: int = 0):
        self.step, self.invariant, self.array, self.index = step, invariant, array, tuple(index)
        self.rank = rank
        where = f" (data rank {rank})" if rank else ""
        super().__init__(f"sanitizer: step {step}{where}: {invariant} in {array} at index {self.index}")


# ------------------------------------------------------------------ bit views


def uint_of(dtype):
    """The unsigned int dtype as wide as ``dtype`` (its bit view)."""
    return {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[jnp.dtype(dtype).itemsize]


def bits(a: jax.Array) -> jax.Array:
    """``a`` viewed as unsigned ints of the same width (exact, NaN payloads kept)."""
    return jax.lax.bitcast_convert_type(a, uint_of(a.dtype))


def poison_bits(dtype) -> int:
    """The poison bit pattern of a float ``dtype``."""
    try:
        return POISON_BITS[jnp.dtype(dtype)]
    except KeyError:
        raise ValueError(f"no poison pattern for dtype {jnp.dtype(dtype)}; have {list(POISON_BITS)}") from None


def poison_like(a: jax.Array) -> jax.Array:
    """An array like ``a`` filled with the poison pattern."""
    u = jnp.full(a.shape, poison_bits(a.dtype), uint_of(a.dtype))
    return jax.lax.bitcast_convert_type(u, a.dtype)


def poison_ids(arrays, ids: jax.Array, r: int = 1) -> list[jax.Array]:
    """Poison kernel blocks ``b*r .. b*r+r-1`` of every array for each id ``b >= 0``.

    Scatters through an unsigned view, so the payload survives on every backend.
    """
    ids = ids.astype(jnp.int32)
    rows = expand_to_kernel_blocks(ids, r)
    ok = jnp.repeat(is_real_slot(ids), r)
    out = []
    for a in arrays:
        dest = jnp.where(ok, rows, a.shape[0])
        u = bits(a).at[dest].set(jnp.asarray(poison_bits(a.dtype), uint_of(a.dtype)), mode="drop")
        out.append(jax.lax.bitcast_convert_type(u, a.dtype))
    return out


def _id_mask(n: int, ids: jax.Array, r: int = 1) -> jax.Array:
    """bool ``[n]``: kernel blocks ``b*r .. b*r+r-1`` of the ids ``b >= 0``."""
    ids = ids.reshape(-1).astype(jnp.int32)
    rows = expand_to_kernel_blocks(ids, r)
    dest = jnp.where(jnp.repeat(is_real_slot(ids), r), rows, n)
    return jnp.zeros((n,), jnp.bool_).at[dest].set(True, mode="drop")


def appended_ids(write_rows: jax.Array, write_ids: jax.Array, write_num: jax.Array, num_rows: int) -> jax.Array:
    """int32 ``[U * M]``: the logical ids a step appends to tables (``-1`` elsewhere), from
    ``write_rows [U]`` (request rows of ``num_rows``), one group's ``write_ids [U, M]`` and
    ``write_num [U]``."""
    col = jnp.arange(write_ids.shape[1], dtype=jnp.int32)[None, :]
    used = is_real_row(write_rows, num_rows)[:, None] & (col < write_num[:, None])
    return jnp.where(used, write_ids, -1).reshape(-1)


def _rows(mask: jax.Array, a: jax.Array) -> jax.Array:
    """``mask [a.shape[0]]`` broadcast over the trailing axes of ``a``."""
    return mask.reshape(mask.shape + (1,) * (a.ndim - 1))


def _first(bad: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(any, index of the first True)`` of a bool array, index as int32 ``[ndim]``."""
    flat = bad.reshape(-1)
    if flat.shape[0] == 0:
        return jnp.asarray(False), jnp.zeros((bad.ndim,), jnp.int32)
    i = jnp.argmax(flat)
    return jnp.any(flat), jnp.stack([jnp.asarray(x, jnp.int32) for x in jnp.unravel_index(i, bad.shape)])


# ------------------------------------------------------------- device checks


def poison_rows(req: RequestState, rows: jax.Array) -> RequestState:
    """Fill every field of the rows ``>= 0`` with :data:`ROW_POISON_BITS` (before an add)."""
    dest = scatter_index(rows, req.max_num_reqs)

    def fill(f):
        u = bits(f).at[dest].set(jnp.asarray(ROW_POISON_BITS, uint_of(f.dtype)), mode="drop")
        return jax.lax.bitcast_convert_type(u, f.dtype)

    return jax.tree.map(fill, req)


def pre_forward_checks(req: RequestState, kv: dict, states: dict, *, added_rows, fresh_blocks, fresh_slots,
                       r: int) -> dict:
    """Checks between the step's staged writes and its first model write (see module doc).

    ``kv`` / ``states``: the KV pools and the recurrent-state pools by name;
    ``fresh_blocks``: int32 logical KV block ids handed out this step (``-1`` pads);
    ``fresh_slots``: int32 recurrent slots; ``added_rows``: int32 ``[U]`` rows installed.
    """
    out = {}
    for name, a in kv.items():
        fresh = _id_mask(a.shape[0], fresh_blocks, r)
        out[("fresh_block_not_zero", name)] = _first(_rows(fresh, a) & (bits(a) != 0))
    for name, a in states.items():
        fresh = _id_mask(a.shape[0], fresh_slots)
        out[("fresh_slot_not_zero", name)] = _first(_rows(fresh, a) & (bits(a) != 0))
    added = _id_mask(req.max_num_reqs, added_rows)
    for field in dataclasses.fields(req):
        f = getattr(req, field.name)
        out[("added_row_holds_poison", field.name)] = _first(
            _rows(added, f) & (bits(f) == jnp.asarray(ROW_POISON_BITS, uint_of(f.dtype)))
        )
    return out


def post_step_checks(req: RequestState, tables, kv: dict, states: dict, *, expect_tables, expect_num_blocks,
                     live_rows, live_slots, r: int, kv_group: int) -> dict:
    """Checks of the state a step leaves (see module doc).

    ``expect_tables``: per group int32 ``[S, W]`` (the host's, kernel-block ids);
    ``expect_num_blocks``: int32 ``[G, S]``; ``live_rows``: bool ``[S]``;
    ``live_slots``: bool ``[num_state_slots]``.
    """
    out = {}
    for name, a in kv.items():
        null = _id_mask(a.shape[0], jnp.asarray([NULL_BLOCK_ID], jnp.int32), r)
        out[("null_block_changed", name)] = _first(
            _rows(null, a) & (bits(a) != jnp.asarray(poison_bits(a.dtype), uint_of(a.dtype)))
        )
    for name, a in states.items():
        null = _id_mask(a.shape[0], jnp.asarray([NULL_BLOCK_ID], jnp.int32))
        out[("null_slot_changed", name)] = _first(
            _rows(null, a) & (bits(a) != jnp.asarray(poison_bits(a.dtype), uint_of(a.dtype)))
        )
    for g in range(tables.num_groups):
        out[("device_table_differs", f"block_tables[{g}]")] = _first(tables.tables[g] != expect_tables[g])
    out[("device_count_differs", "num_blocks")] = _first(tables.num_blocks != expect_num_blocks)
    empty = RequestState.create(1, 1, req.num_speculative_tokens)  # the tokens are not reset
    free = ~live_rows
    for name in req.reset_on_clear():
        f, e = getattr(req, name), getattr(empty, name)
        out[("free_row_not_reset", name)] = _first(_rows(free, f) & (bits(f) != bits(e)))
    tbl, cnt = tables.tables[kv_group], tables.num_blocks[kv_group]
    col = jnp.arange(tbl.shape[1], dtype=jnp.int32)[None, :]
    owned_ids = jnp.where(live_rows[:, None] & (col < cnt[:, None]), tbl, -1)
    for name, a in kv.items():
        owned = _id_mask(a.shape[0], owned_ids)
        out[("live_block_holds_nan", name)] = _first(_rows(owned, a) & jnp.isnan(a))
    for name, a in states.items():
        out[("live_slot_holds_nan", name)] = _first(_rows(live_slots, a) & jnp.isnan(a))
    return out


def idle_rank_checks(idle: jax.Array, before: dict, after: dict) -> dict:
    """``idle_rank_changed``: a rank that ran the dummy step (``idle``) left every array of its
    state (``before`` / ``after``: name -> array) bitwise as it was."""
    return {("idle_rank_changed", name): _first(idle & (bits(after[name]) != bits(a)))
            for name, a in before.items()}


def result_keys(results: dict) -> list[tuple[str, str]]:
    """The ``(invariant, array)`` keys in report order: by :data:`INVARIANTS`, then by array name
    (independent of dict order, which pytree flattening does not keep)."""
    order = {name: i for i, name in enumerate(INVARIANTS)}
    return sorted(results, key=lambda k: (order[k[0]], k[1]))


def encode(results: dict) -> jax.Array:
    """Check results as one int32 ``[n, 1 + max_ndim]`` array: per :func:`result_keys`
    entry the flag, then the first offending index (zero-padded)."""
    keys = result_keys(results)
    width = 1 + max(results[k][1].shape[0] for k in keys)
    rows = []
    for k in keys:
        flag, idx = results[k]
        pad = jnp.zeros((width - 1 - idx.shape[0],), jnp.int32)
        rows.append(jnp.concatenate([flag.astype(jnp.int32)[None], idx, pad]))
    return jnp.stack(rows)


# ---------------------------------------------------------------- host side


@dataclasses.dataclass
class HostMirror:
    """What the host has told the device: live rows with their logical block ids per
    group, and the KV blocks / recurrent slots in use (zeroed and not since freed)."""

    num_groups: int
    rows: dict[int, list[list[int]]] = dataclasses.field(default_factory=dict)
    live_slots: set[int] = dataclasses.field(default_factory=set)

    def after(self, plan) -> "HostMirror":
        """The mirror once ``plan`` (a :class:`~kvjax.host.scheduler.StepPlan`) is applied."""
        m = HostMirror(self.num_groups, {row: [list(g) for g in ids] for row, ids in self.rows.items()},
                       set(self.live_slots))
        if plan is None:
            return m
        for row in plan.cleared_rows:
            m.rows.pop(row, None)
        for row, _, _ in plan.added:
            m.rows[row] = [[] for _ in range(self.num_groups)]
        for row, ids, overwrite in plan.block_writes:
            cur = m.rows.setdefault(row, [[] for _ in range(self.num_groups)])
            m.rows[row] = [list(i) if overwrite else c + list(i) for c, i in zip(cur, ids)]
        m.live_slots -= set(plan.freed_slots)
        m.live_slots |= set(plan.slots_to_zero)
        return m


class Sanitizer:
    """Host half of the checked mode: the mirror, the step inputs it adds, the verdict.

    Args:
      specs: the runner's KV-cache groups; max_num_seqs, num_state_slots: sizes.
    """

    def __init__(self, specs, max_num_seqs: int, num_state_slots: int):
        self.specs = tuple(specs)
        self.max_num_seqs = max_num_seqs
        self.num_state_slots = num_state_slots
        self.mirror = HostMirror(len(self.specs))
        self.layout: list[tuple[str, str, int]] = []  # (invariant, array, ndim) per encoded row

    def set_layout(self, checks) -> None:
        """Record the rows :func:`encode` emits for ``checks`` (the step's, while it is traced:
        shapes are all that is read)."""
        self.layout = [(inv, arr, checks[(inv, arr)][1].shape[0]) for inv, arr in result_keys(checks)]

    def expectations(self, mirror: HostMirror) -> dict[str, np.ndarray]:
        """numpy inputs of :func:`post_step_checks` for the state ``mirror`` describes."""
        S, G = self.max_num_seqs, len(self.specs)
        tables = [np.full((S, s.table_width), NULL_BLOCK_ID, np.int32) for s in self.specs]
        counts = np.zeros((G, S), np.int32)
        live = np.zeros((S,), np.bool_)
        for row, ids in mirror.rows.items():
            live[row] = True
            for g, spec in enumerate(self.specs):
                k = np.asarray(ids[g], np.int32)
                if spec.blocks_per_kv_block > 1:
                    k = np.asarray(expand_to_kernel_blocks(k, spec.blocks_per_kv_block))
                tables[g][row, : len(k)] = k
                counts[g, row] = len(k)
        slots = np.zeros((self.num_state_slots,), np.bool_)
        slots[sorted(mirror.live_slots)] = True
        return {"tables": tuple(tables), "num_blocks": counts, "live_rows": live, "live_slots": slots}

    def check_host(self, plan, mirror: HostMirror) -> None:
        """The scheduler's own view of each scheduled request equals what it sent."""
        for s in plan.scheduled:
            sent = mirror.rows.get(s.req.row)
            if sent != [list(b) for b in s.req.blocks]:
                raise SanitizerError(plan.step, "host_tables_disagree", f"row {s.req.row}", (s.req.row,))

    def verdict(self, step, encoded, rank: int = 0) -> None:
        """Raise :class:`SanitizerError` for the first violated check of a step's :func:`encode` output."""
        encoded = np.asarray(encoded)
        if len(encoded) != len(self.layout):
            raise RuntimeError(f"sanitizer layout has {len(self.layout)} rows, the step returned {len(encoded)}")
        for (invariant, array, ndim), row in zip(self.layout, encoded):
            if row[0]:
                raise SanitizerError(step, invariant, array, tuple(int(x) for x in row[1: 1 + ndim]), rank)
