"""Host scheduler: continuous batching over a token budget (plain Python).

Per step it admits arrived requests into free rows (LIFO reuse), gives running
requests their decode windows (``1 + drafts`` tokens, drafts from the n-gram
drafter), fills the rest of the token budget with prefill chunks, allocates
KV blocks and recurrent-state slots (every fresh id is reported to be zeroed
inside the step), and preempts the newest running request by recompute when
blocks run out. It never builds device arrays: :class:`StepPlan` is plain data
that the runner packs into one fixed-shape host-to-device transfer.
"""

from __future__ import annotations

import dataclasses
from collections import deque

import numpy as np

from kvjax.host.block_pool import BlockPool, OutOfBlocksError
from kvjax.host.buckets import Bucket, BucketSpec, Staging, bucket_staging, check_size, max_prefill_rows
from kvjax.host.drafter import propose_ngram
from kvjax.spec import KVGroupSpec
from kvjax.state import RequestRows, step_progress
from kvjax.state.request_state import check_sampling_params, num_sampled_fits, sample_window


@dataclasses.dataclass(eq=False)  # identity semantics: fast membership tests
class Request:
    """One request as the scheduler sees it.

    ``tokens`` is prompt + output; ``prefill_len`` is how many of them were
    given at the latest (re)admission; ``num_computed`` mirrors the device's
    ``num_computed_tokens``.

    Sampling (on the device, :mod:`kvjax.runner.sampling`): ``temperature`` 0 is greedy;
    ``top_k`` 0 and ``top_p`` 1 are off; ``seed`` keys the noise with the token's position.
    Stopping: the request finishes after ``max_tokens`` outputs, or after the first output in
    ``stop_token_ids`` (kept as its last output) unless ``ignore_eos``.
    """

    req_id: str
    prompt: list[int]
    max_tokens: int
    arrival_step: int = 0
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    output: list[int] = dataclasses.field(default_factory=list)
    row: int | None = None
    num_computed: int = 0
    prefill_len: int = 0
    blocks: list[list[int]] = dataclasses.field(default_factory=list)
    state_slots: list[int] = dataclasses.field(default_factory=list)
    logits: list[np.ndarray] = dataclasses.field(default_factory=list)
    num_preemptions: int = 0
    finished: bool = False

    def __post_init__(self):
        # the state's rule (what a request row will hold), one owner for both
        check_sampling_params(where=f"request {self.req_id!r}: ", temperature=self.temperature, top_k=self.top_k,
                              top_p=self.top_p, seed=self.seed)
        self.stop_token_ids = tuple(self.stop_token_ids)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def is_decoding(self) -> bool:
        return self.num_computed >= self.prefill_len


def first_stop(req: Request, tokens) -> int | None:
    """Index of the first of ``tokens`` in ``req.stop_token_ids`` (None: none, or ``ignore_eos``)."""
    if req.ignore_eos or not req.stop_token_ids:
        return None
    for i, t in enumerate(tokens):
        if t in req.stop_token_ids:
            return i
    return None


class RequestTooLargeError(ValueError):
    """A request that could never run even alone: its prompt leaves no room to generate within
    ``max_model_len``, or its KV cache needs more blocks than a block-table row or the cache holds."""


def peak_tokens(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> int:
    """Most tokens whose K/V a request ever holds: the prompt and every output but the
    last (the last is sampled, never fed back), below ``max_model_len``; drafts stay
    within the same bound."""
    return max(num_prompt_tokens, min(num_prompt_tokens + max_tokens - 1, max_model_len - 1))


def check_request(req_id: str, prompt, max_tokens, *, max_model_len: int) -> None:
    """The admission rule's first part: what a request must be to run with ``max_model_len``,
    whatever the cache (a workload's entries are checked by it before any cache exists).

    Raises:
      ValueError: the prompt is not a non-empty list, or ``max_tokens`` is not a positive int.
      RequestTooLargeError: the prompt has ``max_model_len`` tokens or more (no room to generate).
    """
    if not isinstance(prompt, list) or not prompt:
        raise ValueError(f"request {req_id!r}: prompt must be a non-empty list of token ids, got {prompt!r}")
    check_size(f"request {req_id!r}: max_tokens", max_tokens)
    if len(prompt) >= max_model_len:
        raise RequestTooLargeError(f"request {req_id!r}: prompt has {len(prompt)} tokens; "
                                   f"max_model_len={max_model_len} leaves no room to generate")


def check_request_fits(
    req: "Request", specs: tuple[KVGroupSpec, ...], *, num_blocks: int, max_model_len: int
) -> None:
    """The admission rule: what a request must be to ever run, checked before it is queued.

    Raises:
      ValueError: :func:`check_request` refuses it.
      RequestTooLargeError: :func:`check_request` refuses its prompt's length, or ``req`` alone, at
        its :func:`peak_tokens`, needs more blocks of a KV group than a block-table row holds (its
        ``max_num_blocks``), or more KV blocks than the cache has (``num_blocks - 1``: block 0 is
        reserved).
    """
    check_request(req.req_id, req.prompt, req.max_tokens, max_model_len=max_model_len)
    n = peak_tokens(len(req.prompt), req.max_tokens, max_model_len)
    for g, s in enumerate(specs):
        if s.blocks_to_add(n, 0) > s.max_num_blocks:
            raise RequestTooLargeError(
                f"request {req.req_id!r} needs {n} tokens of KV cache, {s.blocks_to_add(n, 0)} blocks in KV "
                f"group {g}, but a block-table row of that group holds {s.max_num_blocks} blocks "
                f"({s.max_num_blocks * s.block_size} tokens); raise max_num_blocks or lower the prompt or max_tokens"
            )
    need = sum(s.blocks_to_add(n, 0) for s in specs)
    if need > num_blocks - 1:
        cap = f" ({(num_blocks - 1) * specs[0].block_size} tokens)" if len(specs) == 1 else ""
        raise RequestTooLargeError(
            f"request {req.req_id!r} needs {n} tokens of KV cache ({len(req.prompt)} prompt + "
            f"{n - len(req.prompt)} generated), {need} blocks, but the cache holds "
            f"{num_blocks - 1} blocks{cap}; raise num_blocks or lower the prompt or max_tokens"
        )


@dataclasses.dataclass
class ScheduledRequest:
    """One batch row of a step: ``num_tokens`` query tokens of ``req`` (a prefill chunk, or a
    decode window ``1 + len(drafts)``) and the draft tokens proposed for it (empty in prefill)."""

    req: Request
    num_tokens: int
    drafts: list[int]


@dataclasses.dataclass
class StepPlan:
    """Everything the runner needs for one step (host data; the runner packs it).

    Attributes:
      bucket: the padded shape the step runs in.
      scheduled: the step's rows in batch order (decodes first).
      added: requests installed into rows this step (row, tokens, prompt_len).
      cleared_rows: rows freed since the last step (finished or preempted).
      block_writes: (row, new logical ids per group, overwrite).
      blocks_to_zero / slots_to_zero: fresh KV blocks / recurrent slots.
      freed_blocks / freed_slots: ids returned to the pools since the last step.
    """

    step: int
    bucket: Bucket
    scheduled: list[ScheduledRequest]
    added: list[tuple[int, list[int], int]]
    cleared_rows: list[int]
    block_writes: list[tuple[int, list[list[int]], bool]]
    blocks_to_zero: list[int]
    slots_to_zero: list[int]
    freed_blocks: list[int]
    freed_slots: list[int]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    def staging_need(self) -> Staging:
        """How much this plan stages, field by field (compare with :func:`bucket_staging`)."""
        return Staging(
            cleared_rows=len(self.cleared_rows), new_requests=len(self.added),
            block_writes=len(self.block_writes),
            ids_per_write=max((len(g) for _, ids, _ in self.block_writes for g in ids), default=0),
            zero_blocks=len(self.blocks_to_zero), zero_slots=len(self.slots_to_zero),
            prefill_rows=sum(not s.req.is_decoding for s in self.scheduled),
        )


class Scheduler:
    """Continuous batching with chunked prefill, preemption and n-gram speculation.

    Args:
      specs: KV-cache groups (one shared block pool of ``num_blocks``).
      buckets: step shapes; the token budget is ``buckets.max_num_tokens``.
      num_blocks: KV blocks incl. the reserved block 0.
      max_model_len: longest sequence.
      num_state_slots: recurrent-state slots incl. the reserved slot 0 (0: no
        recurrent layers). Each running request owns :attr:`slots_per_request`
        (``1 + num_speculative_tokens``), so at least ``2 + num_speculative_tokens``.
      max_new_requests: requests admitted per step at most, ``1..max_num_seqs`` (the
        runner stages that many new rows per step); default ``max_num_seqs``.
      drafter: ``(tokens, k) -> up to k draft tokens``; default the n-gram
        prompt-lookup drafter.
    """

    def __init__(
        self,
        specs: tuple[KVGroupSpec, ...],
        buckets: BucketSpec,
        *,
        num_blocks: int,
        max_model_len: int,
        num_state_slots: int = 0,
        max_new_requests: int | None = None,
        drafter=None,
    ):
        if (not isinstance(specs, (tuple, list)) or not specs
                or not all(isinstance(s, KVGroupSpec) for s in specs)):
            raise ValueError(f"specs must be a non-empty sequence of KVGroupSpec, got {specs!r}")
        if not isinstance(buckets, BucketSpec):
            raise ValueError(f"buckets must be a BucketSpec, got {buckets!r}")
        max_model_len = check_size("max_model_len", max_model_len, 2, "a prompt token and an output")
        per_request = 1 + buckets.num_speculative_tokens
        num_state_slots = check_size("num_state_slots", num_state_slots, 0)
        if 0 < num_state_slots < 1 + per_request:
            raise ValueError(
                f"num_state_slots must be 0 (no recurrent layers) or an int >= {1 + per_request} (the reserved "
                f"slot 0 and 1 + num_speculative_tokens = {per_request} slots for one request), got {num_state_slots!r}")
        self.specs = tuple(specs)
        self.max_new_requests = (buckets.max_num_seqs if max_new_requests is None
                                 else check_size("max_new_requests", max_new_requests))
        self.drafter = drafter or propose_ngram
        self.buckets = buckets
        self.k = buckets.num_speculative_tokens
        self.max_model_len = max_model_len
        self.pool = BlockPool(num_blocks)
        self.slots = BlockPool(num_state_slots, kind="recurrent slot") if num_state_slots else None
        self.rows = RequestRows(buckets.max_num_seqs)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._live_ids: set[str] = set()  # ids waiting or running (add_request refuses a duplicate)
        self.finished: list[Request] = []
        self.step_count = 0
        self.num_preemptions = 0
        self.num_drafts_proposed = 0
        self.num_drafts_accepted = 0
        self._cleared: list[int] = []
        self._freed_blocks: list[int] = []
        self._freed_slots: list[int] = []
        self.staging(buckets.buckets[-1])  # ValueError on sizes no step could stage

    # -------------------------------------------------------------- requests

    @property
    def slots_per_request(self) -> int:
        """Recurrent-state slots one running request owns: ``1 + k`` (0 without recurrent layers)."""
        return 1 + self.k if self.slots is not None else 0

    def check_fits(self, req: Request) -> None:
        """Raise ``ValueError`` if ``req`` is malformed and :class:`RequestTooLargeError` if it
        could never run in this scheduler (:func:`check_request_fits`)."""
        check_request_fits(req, self.specs, num_blocks=self.pool.num_blocks, max_model_len=self.max_model_len)

    def add_request(self, req: Request) -> None:
        """Queue ``req``.

        Raises:
          ValueError: ``req`` is malformed (:meth:`check_fits`), has finished, or its id is
            already waiting or running.
          RequestTooLargeError: it could never run (it would hang).
        """
        if req.finished:
            raise ValueError(f"request {req.req_id!r} has finished; queue a new Request to run it again")
        if req.req_id in self._live_ids:
            raise ValueError(f"request id {req.req_id!r} is already waiting or running")
        self.check_fits(req)
        self.waiting.append(req)
        self._live_ids.add(req.req_id)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _release(self, req: Request) -> None:
        for ids in req.blocks:
            self.pool.free(ids)
            self._freed_blocks.extend(ids)
        if self.slots is not None and req.state_slots:
            self.slots.free(req.state_slots)
            self._freed_slots.extend(req.state_slots)
        self._cleared.append(self.rows.remove(req.req_id))
        req.blocks, req.state_slots, req.row = [], [], None

    def _preempt(self, req: Request) -> None:
        """Recompute later: drop its blocks, slots and row, keep its output."""
        self.running.remove(req)
        self._release(req)
        req.num_computed = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _admit(self, req: Request, added, block_writes) -> None:
        """Install ``req`` into a free row with fresh state slots (the caller checked they are free)."""
        req.row = self.rows.add(req.req_id)
        req.state_slots = self.slots.allocate(self.slots_per_request) if self.slots is not None else []
        req.num_computed = 0
        req.prefill_len = len(req.tokens)
        req.blocks = [[] for _ in self.specs]
        added.append((req.row, req.tokens, len(req.prompt)))
        block_writes[req.row] = ([[] for _ in self.specs], True)
        self.running.append(req)

    def _grow(self, req: Request, upto_tokens: int, block_writes) -> bool:
        """Give ``req`` blocks for ``upto_tokens`` tokens, preempting the newest running
        requests while blocks are short; ``False`` when ``req`` itself was preempted."""
        need = [s.blocks_to_add(upto_tokens, len(req.blocks[g])) for g, s in enumerate(self.specs)]
        if not any(need):
            return True
        while sum(need) > self.pool.num_free:
            # The newest running request yields, even when it is the one asking: older
            # requests are never preempted by newer ones, so the oldest always advances.
            victim = self.running[-1]
            victim_row = victim.row
            self._preempt(victim)
            block_writes.pop(victim_row, None)
            if victim is req:
                return False
        ids_per_group = []
        for g, n in enumerate(need):
            try:
                ids = self.pool.allocate(n)
            except OutOfBlocksError:  # pragma: no cover - guarded by the loop above
                return False
            req.blocks[g].extend(ids)
            ids_per_group.append(ids)
        if any(ids_per_group):
            prev, overwrite = block_writes.get(req.row, ([[] for _ in self.specs], False))
            block_writes[req.row] = ([p + i for p, i in zip(prev, ids_per_group)], overwrite)
        return True

    # ------------------------------------------------------------------ step

    def staging(self, bucket: Bucket) -> Staging:
        """What one step in ``bucket`` can stage (:func:`~kvjax.host.buckets.bucket_staging`
        with every KV group's block size)."""
        return bucket_staging(bucket, block_size=tuple(s.block_size for s in self.specs),
                              num_speculative_tokens=self.k, max_new_requests=self.max_new_requests,
                              max_num_seqs=self.buckets.max_num_seqs)

    def _admit_and_schedule(self, step: int, budget: int, added, block_writes,
                            prefill_room: int) -> list[ScheduledRequest]:
        """Admit arrived requests, oldest first, each with its first prefill chunk in this step.

        A request is admitted only when it is scheduled at once: its row, its ``1 + k`` state
        slots and the blocks of its chunk are free, the token budget has room, and fewer than
        ``max_new_requests`` were admitted (and fewer than ``prefill_room``: the step's prefilling
        rows stay within :func:`~kvjax.host.buckets.max_prefill_rows`). The first that does not fit stops admission (first
        come, first served); an admission never preempts a running request. So every added row
        is a scheduled row, and the plan's staging fits its bucket (:meth:`staging`).
        """
        out: list[ScheduledRequest] = []
        slots_needed = self.slots_per_request
        while (budget > 0 and self.waiting and self.waiting[0].arrival_step <= step and self.rows.free_rows
               and len(added) < self.max_new_requests and len(out) < prefill_room):
            req = self.waiting[0]
            n = min(len(req.tokens), budget)
            if sum(s.blocks_to_add(n, 0) for s in self.specs) > self.pool.num_free:
                break
            if self.slots is not None and self.slots.num_free < slots_needed:
                break
            self.waiting.popleft()
            self._admit(req, added, block_writes)
            if not self._grow(req, n, block_writes):  # pragma: no cover - blocks checked above
                raise AssertionError(f"admitted request {req.req_id!r} could not get the blocks it was checked for")
            out.append(ScheduledRequest(req, n, []))
            budget -= n
        return out

    def schedule(self) -> StepPlan | None:
        """Decide the next step; ``None`` when nothing can run yet (nothing arrived).

        Running requests first (decode windows, then prefill chunks, oldest first), then
        admissions into the rest of the budget unless a request was preempted in this step; at
        most :func:`~kvjax.host.buckets.max_prefill_rows` rows prefill (older prefills first).
        The plan fits its bucket's :meth:`staging` (checked).
        """
        step = self.step_count
        budget = self.buckets.max_num_tokens
        added: list = []
        block_writes: dict[int, tuple[list[list[int]], bool]] = {}
        scheduled: list[ScheduledRequest] = []
        # Decode windows first, then prefill chunks (oldest first).
        n_preempted = self.num_preemptions
        prefill_room = max_prefill_rows(self.max_new_requests)  # rows this step may prefill
        for req in sorted(self.running, key=lambda r: not r.is_decoding):
            if budget <= 0 or req.row is None:  # out of budget, or preempted in this loop
                continue
            if not req.is_decoding and prefill_room <= 0:  # the oldest prefills go first
                continue
            if req.is_decoding:
                drafts = []
                if self.k:
                    total = len(req.prompt) + len(req.output)
                    room = min(req.max_tokens - len(req.output), self.max_model_len - total) - 1
                    drafts = list(self.drafter(req.tokens, min(self.k, max(room, 0), budget - 1)))
                n = 1 + len(drafts)
            else:
                drafts = []
                n = min(req.prefill_len - req.num_computed, budget)
            if not self._grow(req, req.num_computed + n, block_writes):
                continue
            scheduled.append(ScheduledRequest(req, n, drafts))
            budget -= n
            prefill_room -= not req.is_decoding
        if self.num_preemptions != n_preempted:
            # Preemption may have removed requests scheduled earlier in this step; nothing is
            # admitted in a step that preempts (the preempted would be re-admitted at once).
            live = {id(r) for r in self.running}
            scheduled = [s for s in scheduled if id(s.req) in live]
        else:
            scheduled += self._admit_and_schedule(step, budget, added, block_writes, prefill_room)
        if not scheduled and not added and not self._cleared:
            if self.waiting and self.waiting[0].arrival_step > step:
                self.step_count += 1  # idle: nothing has arrived yet
            return None
        scheduled.sort(key=lambda s: (not s.req.is_decoding, s.num_tokens))
        num_logits = sum(1 + len(s.drafts) for s in scheduled)
        bucket = self.buckets.choose(max(sum(s.num_tokens for s in scheduled), 1), max(len(scheduled), 1),
                                     max(num_logits, 1), decode_only=all(s.req.is_decoding for s in scheduled))
        live_rows = {r.row for r in self.running}
        plan = StepPlan(
            step=step,
            bucket=bucket,
            scheduled=scheduled,
            added=added,
            cleared_rows=list(self._cleared),
            block_writes=[(row, ids, ow) for row, (ids, ow) in block_writes.items() if row in live_rows],
            blocks_to_zero=self.pool.take_ids_to_zero(),
            slots_to_zero=self.slots.take_ids_to_zero() if self.slots is not None else [],
            freed_blocks=list(self._freed_blocks),
            freed_slots=list(self._freed_slots),
        )
        self._cleared, self._freed_blocks, self._freed_slots = [], [], []
        excess = self.staging(bucket).excess(plan.staging_need())
        if excess:  # pragma: no cover - a scheduler bug, caught here before the runner packs it
            raise RuntimeError(f"step {step}'s plan exceeds the staging of {bucket}: {', '.join(excess)}")
        return plan

    def update(self, plan: StepPlan, sampled: np.ndarray, num_sampled: np.ndarray, logits: np.ndarray | None = None) -> list[Request]:
        """Apply the step's results (counters by :func:`~kvjax.state.step_progress`, as on the device); returns finished requests.

        Args:
          sampled: int ``[R, 1 + k]`` accepted tokens per batch row.
          num_sampled: int ``[R]``.
          logits: optional float ``[L, vocab]``; rows of sampled tokens are kept
            on the request for parity checks.

        Raises:
          ValueError: ``sampled`` or ``num_sampled`` misses a scheduled row or a draft column, or
            a row's ``num_sampled`` does not fit its sample window (``[0, 1 + its drafts]``; a
            mid-prefill chunk's count is not read); nothing is applied.
        """
        done = []
        scheduled = plan.scheduled
        B = len(scheduled)
        # Each row's (num_computed, prefill_len, num_tokens) before the step: the inputs of
        # sample_window and of one vectorised step_progress for every row (the per-row Python
        # loop below only moves lists).
        ints = np.array([(s.req.num_computed, s.req.prefill_len, s.num_tokens) for s in scheduled],
                        np.int64).reshape(B, 3)
        sampled, num_sampled = self._check_results(plan, sampled, num_sampled, ints)
        if logits is not None:
            logits = np.asarray(logits)
        kept, new_nc = step_progress(ints[:, 0], ints[:, 1], ints[:, 2], num_sampled)
        kept, new_nc = kept.tolist(), new_nc.tolist()
        rows = np.asarray(sampled[:B]).tolist()
        cu = 0
        for b, s in enumerate(scheduled):
            req = s.req
            nl = 1 + len(s.drafts)
            n = kept[b]
            if req.finished:  # stopped after this step was planned (Scheduler.stop): nothing more
                cu += nl
                continue
            if req.is_decoding:
                self.num_drafts_proposed += len(s.drafts)
                self.num_drafts_accepted += n - 1
            req.num_computed = new_nc[b]
            if n == 0:  # a mid-prefill chunk samples nothing
                cu += nl
                continue
            room = req.max_tokens - len(req.output)
            toks = rows[b][:min(n, room)]
            stop = first_stop(req, toks)
            if stop is not None:
                toks = toks[: stop + 1]
            req.output.extend(toks)
            if logits is not None:
                req.logits.extend(logits[cu:cu + len(toks)])
            cu += nl
            if (stop is not None or len(req.output) >= req.max_tokens
                    or len(req.prompt) + len(req.output) >= self.max_model_len):
                self._finish(req)
                done.append(req)
        self.step_count += 1
        return done

    @staticmethod
    def _check_results(plan: StepPlan, sampled, num_sampled, ints) -> tuple[np.ndarray, np.ndarray]:
        """``sampled`` and ``num_sampled`` (its first ``B`` entries, int64) checked against ``plan``'s
        ``B`` rows before :meth:`update` applies anything: ``ValueError`` for a shape that misses a
        row or a draft column, or a count that breaks :func:`~kvjax.state.request_state.num_sampled_fits`
        for the row's :func:`~kvjax.state.request_state.sample_window` (``[0, 1 + its drafts]``; a
        mid-prefill chunk samples nothing and its count is not read). ``ints``: int64 ``[B, 3]``,
        each row's ``(num_computed, prefill_len, num_tokens)`` before the step."""
        B = len(plan.scheduled)
        width = 1 + max((len(s.drafts) for s in plan.scheduled), default=0)
        sampled, num_sampled = np.asarray(sampled), np.asarray(num_sampled)
        if (sampled.ndim != 2 or not np.issubdtype(sampled.dtype, np.integer)
                or sampled.shape[0] < B or sampled.shape[1] < width):
            raise ValueError(f"sampled must be an int array of shape [>= {B}, >= {width}] (a row per scheduled "
                             f"request, a column per token it may accept: 1 + its drafts), got {sampled.dtype} "
                             f"of shape {sampled.shape}")
        if num_sampled.ndim != 1 or not np.issubdtype(num_sampled.dtype, np.integer) or num_sampled.shape[0] < B:
            raise ValueError(f"num_sampled must be an int array of shape [>= {B}] (a count per scheduled "
                             f"request), got {num_sampled.dtype} of shape {num_sampled.shape}")
        num_sampled = num_sampled[:B].astype(np.int64)
        window = sample_window(ints[:, 0], ints[:, 1], ints[:, 2])
        bad = np.flatnonzero(~num_sampled_fits(num_sampled, window))
        if bad.size:
            b = int(bad[0])
            s = plan.scheduled[b]
            raise ValueError(f"num_sampled[{b}] = {num_sampled[b]} for request {s.req.req_id!r}, "
                             f"whose row has {len(s.drafts)} drafts: it must be in [0, {window[b]}]")
        return sampled, num_sampled

    def _finish(self, req: Request) -> None:
        req.finished = True
        self.running.remove(req)
        self._release(req)
        self.finished.append(req)
        self._live_ids.discard(req.req_id)

    def stop(self, req: Request, num_outputs: int) -> None:
        """Finish a running request at ``num_outputs`` outputs (a stop token found after the
        fact, by a loop that applied the step with placeholder tokens): later outputs and their
        logits are dropped, its row, blocks and slots freed for the next plan."""
        if not 0 < num_outputs <= len(req.output):
            raise ValueError(f"num_outputs must be in [1, {len(req.output)}], got {num_outputs}")
        del req.output[num_outputs:]
        del req.logits[num_outputs:]
        if not req.finished:
            self._finish(req)
