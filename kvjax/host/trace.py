"""A host driver that walks the state functions through a schedule.

:class:`StateTrace` owns the device pytrees (:class:`BlockTables`,
:class:`RequestState`) and the host bookkeeping (:class:`RequestRows`,
:class:`BlockPool`), and offers the operations a scheduler performs: add and
remove requests, schedule prefill chunks and decode windows, apply sampled
tokens. Every step it builds the padded :class:`StepBatch` and checks every
invariant. ``python -m kvjax trace`` prints its log; the property tests drive it randomly.
It has no model: "sampled" tokens come from a caller-supplied function.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from kvjax.host.block_pool import BlockPool
from kvjax.spec import KVGroupSpec
from kvjax.state import (
    BlockTables,
    NewRequests,
    RequestRows,
    RequestState,
    ScheduledBatch,
    StepBatch,
    assert_block_tables,
    assert_step_batch,
    build_step_batch,
    expand_to_kernel_blocks,
    free_rows_are_empty,
    step_progress,
)


@dataclasses.dataclass
class _Req:
    req_id: str
    row: int
    tokens: list[int]  # everything known: prompt + sampled
    num_computed: int
    prefill_len: int
    blocks: list[list[int]]  # logical ids per group


class StateTrace:
    """Host-side driver of the kvjax state functions (no model).

    Args:
      specs: KV-cache groups.
      num_blocks: logical KV blocks in the cache (block 0 reserved), shared by groups.
      max_num_reqs, max_model_len, num_speculative_tokens: state sizes.
    """

    def __init__(
        self,
        specs: tuple[KVGroupSpec, ...],
        *,
        num_blocks: int,
        max_num_reqs: int,
        max_model_len: int,
        num_speculative_tokens: int = 0,
    ):
        self.specs = tuple(specs)
        self.pool = BlockPool(num_blocks)
        self.rows = RequestRows(max_num_reqs)
        self.tables = BlockTables.create(self.specs, max_num_reqs, num_cache_blocks=num_blocks)
        self.state = RequestState.create(max_num_reqs, max_model_len, num_speculative_tokens)
        self.reqs: dict[str, _Req] = {}
        self.log: list[str] = []
        self.steps = 0

    # --------------------------------------------------------------- requests

    def add(self, req_id: str, prompt: list[int], num_computed: int = 0) -> int:
        """Install a request into the most recently freed row; returns the row."""
        row = self.rows.add(req_id)
        self.state = self.state.add_requests(
            NewRequests.from_lists(
                [row], [prompt], max_model_len=self.state.max_model_len,
                num_computed_tokens=[num_computed],
            )
        )
        self.tables = self.tables.append_block_ids(row, [[] for _ in self.specs], overwrite=True)
        self.reqs[req_id] = _Req(req_id, row, list(prompt), num_computed, len(prompt),
                                 [[] for _ in self.specs])
        self.log.append(f"add {req_id!r} -> row {row} ({len(prompt)} prompt tokens)")
        return row

    def remove(self, req_id: str) -> int:
        """Free a request's blocks and row, and null its table row and state row."""
        req = self.reqs.pop(req_id)
        for ids in req.blocks:
            self.pool.free(ids)
        row = self.rows.remove(req_id)
        self.tables = self.tables.clear_row(row)
        self.state = self.state.clear_rows(np.array([row], np.int32))
        self.log.append(f"remove {req_id!r} (row {row} free, {sum(map(len, req.blocks))} blocks freed)")
        return row

    def _ensure_blocks(self, req: _Req, upto_tokens: int) -> None:
        new_ids = []
        for g, spec in enumerate(self.specs):
            ids = self.pool.allocate(spec.blocks_to_add(upto_tokens, len(req.blocks[g])))
            req.blocks[g].extend(ids)
            new_ids.append(ids)
        if any(new_ids):
            self.tables = self.tables.append_block_ids(req.row, new_ids)

    # ------------------------------------------------------------------ steps

    def step(
        self,
        schedule: dict[str, int],
        drafts: dict[str, list[int]] | None = None,
        *,
        num_tokens_padded: int,
        num_reqs_padded: int,
        sample: Callable[[str, int], int] | None = None,
        accept: Callable[[str, int], int] | None = None,
    ) -> StepBatch:
        """Run one step: build the batch, check invariants, apply sampled tokens.

        Args:
          schedule: request id -> tokens to compute this step (a prefill chunk,
            or ``1 + len(drafts[id])`` for a decode window).
          drafts: request id -> draft tokens for decode rows.
          sample: ``(req_id, position) -> token`` (default: a fixed hash).
          accept: ``(req_id, num_drafts) -> accepted drafts`` (default: all).
        """
        drafts = drafts or {}
        sample = sample or (lambda rid, pos: (sum(map(ord, rid)) * 31 + pos * 7) % 251 + 1)
        accept = accept or (lambda rid, n: n)
        order = sorted(schedule, key=lambda r: schedule[r])  # decodes first, as vLLM
        rows, qlens, ndrafts = [], [], []
        for rid in order:
            req = self.reqs[rid]
            d = drafts.get(rid, [])
            self._ensure_blocks(req, req.num_computed + schedule[rid])
            rows.append(req.row)
            qlens.append(schedule[rid])
            ndrafts.append(len(d))
        if any(drafts.values()):
            spec_k = self.state.num_speculative_tokens
            dr = np.zeros((len(rows), spec_k), np.int32)
            for i, rid in enumerate(order):
                d = drafts.get(rid, [])
                dr[i, : len(d)] = d
            self.state = self.state.set_draft_tokens(np.array(rows, np.int32), dr)
        sched = ScheduledBatch.from_lists(rows, qlens, ndrafts, pad_to=num_reqs_padded)
        batch = build_step_batch(self.state, self.tables, sched, num_tokens_padded=num_tokens_padded)
        self.check(batch)

        S = 1 + self.state.num_speculative_tokens
        sampled = np.zeros((num_reqs_padded, S), np.int32)
        num_sampled = np.zeros((num_reqs_padded,), np.int32)
        for i, rid in enumerate(order):
            req = self.reqs[rid]
            n_acc = accept(rid, ndrafts[i]) if ndrafts[i] else 0
            n, new_nc = step_progress(req.num_computed, req.prefill_len, schedule[rid], n_acc + 1)
            base = len(req.tokens)
            toks = [sample(rid, base + j) for j in range(int(n))]
            sampled[i, : len(toks)] = toks
            num_sampled[i] = len(toks)
            req.tokens.extend(toks)
            req.num_computed = int(new_nc)
        self.state = self.state.post_update(sched.idx_mapping, sched.num_scheduled_tokens, sampled, num_sampled)
        self.steps += 1
        self.log.append(
            f"step {self.steps}: {len(rows)} rows, {sum(qlens)} tokens -> bucket "
            f"(T={num_tokens_padded}, R={num_reqs_padded}); zeroed-on-allocate "
            f"{len(self.pool.take_ids_to_zero())} blocks"
        )
        self.check_state()
        return batch

    # ----------------------------------------------------------------- checks

    def check(self, batch: StepBatch) -> None:
        """Every step-batch invariant holds (raises ``AssertionError`` naming the rule)."""
        assert_step_batch(batch, self.specs)

    def check_state(self) -> None:
        """Host mirror == device state; tables, rows and pool invariants hold."""
        assert_block_tables(self.tables)
        self.rows.check()
        self.pool.check()
        if not bool(free_rows_are_empty(self.tables, self.rows.free_rows)):
            raise AssertionError("a free request row still has block-table entries")
        nc = np.asarray(self.state.num_computed_tokens)
        tl = np.asarray(self.state.total_len)
        ids = np.asarray(self.state.all_token_ids)
        for req in self.reqs.values():
            if nc[req.row] != req.num_computed or tl[req.row] != len(req.tokens):
                raise AssertionError(
                    f"{req.req_id!r}: device num_computed/total_len {nc[req.row]}/{tl[req.row]} "
                    f"!= host {req.num_computed}/{len(req.tokens)}"
                )
            if ids[req.row, : len(req.tokens)].tolist() != req.tokens:
                raise AssertionError(f"{req.req_id!r}: all_token_ids differs from the host copy")
            for g, spec in enumerate(self.specs):
                want = np.asarray(
                    expand_to_kernel_blocks(np.asarray(req.blocks[g], np.int32), spec.blocks_per_kv_block)
                ).tolist()
                got = np.asarray(self.tables.tables[g][req.row, : len(want)]).tolist()
                if got != want:
                    raise AssertionError(f"{req.req_id!r}: block table group {g} {got} != {want}")
