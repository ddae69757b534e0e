"""The serving loop: schedule a step, run it, apply its results — in lockstep or overlapped.

Overlapped, the host plans step N+1 while the device runs step N. That needs only token
*counts* on the host: the device already holds every row's last sampled token (the token
combine reads it there), a greedy step without drafts samples exactly one token per row that
finishes its prompt or decodes, and requests finish by length. The host applies step N with
:data:`PENDING_TOKEN` placeholders and fills in the values when step N's outputs arrive, one
step later. Only a re-admitted (preempted) request needs its generated tokens on the host
before its step is packed; then the loop waits for the pending step first. Outputs are
bitwise those of the lockstep loop.

Two overlapped modes (:data:`OVERLAP_MODES`): ``"plan"`` (``overlap=True``) schedules and
packs step N+1 while N runs, waits for N, enqueues N+1, then reads N's outputs while N+1
runs (a sanitizer violation of step N is raised after N+1 is enqueued); ``"dispatch"``
enqueues N+1 before waiting for N. On a GPU ``"dispatch"`` makes XLA re-record most of the
step's command buffer before every step (step N still holds its temporaries when N+1 is
enqueued); which mode is faster depends on the batch (BENCHMARKS.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from kvjax.host.scheduler import Request, Scheduler, StepPlan
from kvjax.runner.runner import PendingOutput, Runner

#: Placeholder for a sampled token whose value is still on the device (never a token id).
PENDING_TOKEN = -1

#: ``overlap`` values of :func:`run_to_completion` besides False (lockstep); True is "plan".
OVERLAP_MODES = ("plan", "dispatch")


@dataclasses.dataclass
class _InFlight:
    plan: StepPlan
    output: PendingOutput
    # (request, first output index, batch row) for every row that sampled a token
    placeholders: list[tuple[Request, int, int]]


def check_overlap_supported(num_speculative_tokens: int) -> None:
    """Overlap needs one sampled token per row: drafts are proposed from the sampled values."""
    if num_speculative_tokens:
        raise ValueError(
            "overlap=True needs num_speculative_tokens == 0 (drafts are proposed from the "
            f"sampled tokens' values), got {num_speculative_tokens}")


def _apply_counts(sched: Scheduler, plan: StepPlan) -> list[tuple[Request, int, int]]:
    """``sched.update`` with placeholder tokens; returns where the placeholders went."""
    before = [len(s.req.output) for s in plan.scheduled]
    R = plan.bucket.num_reqs
    sched.update(plan, np.full((R, 1), PENDING_TOKEN, np.int32), np.ones((R,), np.int32))
    return [(s.req, n, b) for b, (s, n) in enumerate(zip(plan.scheduled, before))
            if len(s.req.output) > n]


def _resolve(step: _InFlight) -> None:
    """Wait for ``step`` and write its tokens (and logits rows) over the placeholders."""
    out = step.output.fetch()
    rows = [b for _, _, b in step.placeholders]
    counts = out.num_sampled[rows]
    if np.any(counts != 1):
        b = rows[int(np.argmax(counts != 1))]
        raise RuntimeError(
            f"overlapped step {step.plan.step}: batch row {b} sampled "
            f"{int(out.num_sampled[b])} tokens, the host assumed 1")
    for (req, i, b), token in zip(step.placeholders, out.sampled[rows, 0].tolist()):
        req.output[i] = token
        req.logits.append(out.logits[b])  # one logits row per batch row (no drafts)


def _needs_values(plan: StepPlan) -> bool:
    return any(PENDING_TOKEN in tokens for _, tokens, _ in plan.added)


def _refresh_added(plan: StepPlan) -> None:
    by_row = {s.req.row: s.req for s in plan.scheduled}
    plan.added[:] = [(row, by_row[row].tokens[: len(tokens)], plen) for row, tokens, plen in plan.added]


def run_to_completion(sched: Scheduler, runner: Runner, *, overlap: bool | str = False,
                      on_step: Callable[[StepPlan], None] | None = None) -> int:
    """Serve every request of ``sched`` through ``runner``; returns the number of steps run.

    ``overlap``: False (lockstep), True or ``"plan"``, or ``"dispatch"`` (module docstring).
    ``on_step(plan)`` is called after each step is applied (overlapped: after it is
    dispatched and its counts applied; its token values may still be pending).
    """
    mode = "plan" if overlap is True else overlap
    if mode is not False and mode not in OVERLAP_MODES:
        raise ValueError(f"overlap must be False, True or one of {OVERLAP_MODES}, got {overlap!r}")
    if mode:
        check_overlap_supported(runner.config.num_speculative_tokens)
    in_flight: _InFlight | None = None
    steps = 0
    while sched.has_work:
        plan = sched.schedule()
        if plan is None:
            continue
        if not mode:
            out = runner.execute(plan)
            sched.update(plan, out.sampled, out.num_sampled, out.logits)
        else:
            if in_flight is not None and _needs_values(plan):
                _resolve(in_flight)
                in_flight = None
                _refresh_added(plan)
            if mode == "dispatch":
                output = runner.dispatch(plan)  # the device queues it behind the step in flight
                if in_flight is not None:
                    _resolve(in_flight)
            else:
                prepared = runner.prepare(plan)  # packed while the step in flight runs
                if in_flight is not None:
                    in_flight.output.wait()
                output = runner.launch(prepared)
                if in_flight is not None:  # its outputs are read while the new step runs
                    _resolve(in_flight)
            in_flight = _InFlight(plan, output, _apply_counts(sched, plan))
        steps += 1
        if on_step is not None:
            on_step(plan)
    if in_flight is not None:
        _resolve(in_flight)
    return steps
