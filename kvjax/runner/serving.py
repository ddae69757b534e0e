"""The serving loop, on one device or a mesh: schedule, run, apply — in lockstep or overlapped.

Every data rank has its own :class:`~kvjax.host.scheduler.Scheduler`; this process
drives its local ranks. Each step the ranks agree (:meth:`Runner.agree`) on whether
anyone has work and on the bucket (the largest any rank needs); requests are placed
on arrival on the least loaded rank (:func:`kvjax.host.placement.least_loaded`);
ranks with nothing scheduled run the dummy step in the same SPMD program. One device
is the case ``D = 1``.

Overlapped (``overlap=True``), the host schedules, packs and enqueues step N+1 while the
device runs step N, then reads N's outputs while N+1 runs: the device goes from N to N+1
without waiting for the host, as long as the host's work per step is shorter than the step. That
needs only token *counts* on the host: the device already holds every row's last
sampled token (the token combine reads it there), a greedy step without drafts samples
exactly one token per row that finishes its prompt or decodes, and requests finish by
length. The host applies step N with :data:`PENDING_TOKEN` placeholders and fills in
the values when N's outputs arrive, one step later. Only a re-admitted (preempted)
request needs its generated tokens on the host before its step is packed; then the
loop waits for the pending step first. Outputs are bitwise those of the lockstep loop.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import deque
from collections.abc import Callable, Iterable, Mapping

import numpy as np

from kvjax.host.placement import least_loaded
from kvjax.host.scheduler import Request, Scheduler, StepPlan, first_stop
from kvjax.runner.runner import PendingStep, Runner, StepResult
from kvjax.runner.sanitizer import SanitizerError

#: Placeholder for a sampled token whose value is still on the device (never a token id).
PENDING_TOKEN = -1


@dataclasses.dataclass
class ServeStats:
    """What :func:`run_to_completion` did: ``steps`` executed, and per local rank its
    ``real_steps`` (it had work), ``dummy_steps`` (it ran the dummy step because another rank
    had work) and ``placed`` (ids of the requests placed on it on arrival)."""

    steps: int = 0
    real_steps: dict = dataclasses.field(default_factory=dict)
    dummy_steps: dict = dataclasses.field(default_factory=dict)
    placed: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class _InFlight:
    step: int
    plans: dict[int, StepPlan | None]
    output: PendingStep
    # per rank: (request, first output index, batch row) for every row that sampled a token
    placeholders: dict[int, list[tuple[Request, int, int]]]
    scheds: Mapping[int, Scheduler] | None = None


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
    """Wait for ``step`` and write every rank's tokens (and logits rows) over the placeholders.

    Each placeholder names the batch row it came from; the value written is that row's,
    whatever order the rows were scheduled in."""
    result = step.output.fetch()
    check_idle_ranks(result, step.plans, step.step)
    for d, placeholders in step.placeholders.items():  # every row checked before any is written
        out = result.outputs[d]
        for _, _, b in placeholders:
            if out.num_sampled[b] != 1:
                raise RuntimeError(
                    f"overlapped step {step.plans[d].step} (rank {d}): batch row {b} sampled "
                    f"{int(out.num_sampled[b])} tokens, the host assumed 1")
    for d, placeholders in step.placeholders.items():
        out = result.outputs[d]
        for req, i, b in placeholders:
            if i >= len(req.output):  # stopped at an earlier token (stop_token_ids)
                continue
            req.output[i] = int(out.sampled[b, 0])
            if len(out.logits):  # one logits row per batch row (no drafts); none without logits
                req.logits.append(out.logits[b])
            if first_stop(req, req.output[i:i + 1]) is not None:
                # A stop token seen one step late: the request ends here; the step in flight
                # computed one more token for it, which is dropped when it resolves.
                step.scheds[d].stop(req, i + 1)


def check_idle_ranks(result: StepResult, plans: Mapping[int, StepPlan | None], step) -> None:
    """A rank the loop left idle (no plan) must have run the dummy step: the device found its
    inputs all padding. Otherwise :class:`~kvjax.runner.sanitizer.SanitizerError`
    (``idle_rank_not_dummy``), whatever the checked mode: the device ran a step the host never
    scheduled."""
    for d, plan in plans.items():
        if plan is None and d in result.outputs and not result.outputs[d].dummy:
            raise SanitizerError(step, "idle_rank_not_dummy", "inputs", (), d)


def _fingerprint(runner: Runner, arrivals) -> int:
    """31 bits of a hash of the runner's configuration and the arrivals (ids, prompts, lengths,
    arrival steps, sampling and stop settings): what every process of a run must share."""
    text = repr((runner.config, [(r.req_id, r.prompt, r.max_tokens, r.arrival_step, r.temperature, r.top_k,
                                  r.top_p, r.seed, r.stop_token_ids, r.ignore_eos) for r in arrivals]))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little") & 0x7FFFFFFF


def check_same_everywhere(runner: Runner, arrivals) -> None:
    """``ValueError`` unless every process serves the same arrivals with the same configuration
    (processes given different workloads would place requests differently and serve wrongly)."""
    if len(runner.local_ranks) == runner.num_ranks:  # one process: nobody to disagree with
        return
    prints = runner.agree({d: (_fingerprint(runner, arrivals),) for d in runner.local_ranks})[:, 0]
    if len(set(prints.tolist())) > 1:
        raise ValueError(f"the processes of this run were given different workloads or settings "
                         f"(fingerprints by data rank: {prints.tolist()}); every process must get the same")


def _needs_values(plans: Mapping[int, StepPlan | None]) -> bool:
    return any(p is not None and any(PENDING_TOKEN in tokens for _, tokens, _ in p.added)
               for p in plans.values())


def _refresh_added(plans: Mapping[int, StepPlan | None]) -> None:
    for plan in plans.values():
        if plan is None:
            continue
        by_row = {s.req.row: s.req for s in plan.scheduled}
        plan.added[:] = [(row, by_row[row].tokens[: len(tokens)], plen) for row, tokens, plen in plan.added]


def run_to_completion(scheds: Scheduler | Mapping[int, Scheduler], runner: Runner, *,
                      arrivals: Iterable[Request] = (), overlap: bool = False,
                      on_step: Callable[[int, Mapping[int, StepPlan | None]], None] | None = None) -> ServeStats:
    """Serve every request through ``runner`` until no rank has work; returns the counts.

    Args:
      scheds: this process's ranks' schedulers (a single Scheduler: rank 0's); requests
        already added to them are served where they are.
      arrivals: requests placed on arrival (``arrival_step``) on the least loaded rank;
        every process passes the same list.
      overlap: plan and pack each step while the previous one runs (module docstring;
        needs ``num_speculative_tokens == 0``).
      on_step: called as ``on_step(step, plans)`` after each executed step is applied
        (overlapped: its counts; its token values may still be pending).
    """
    if isinstance(scheds, Scheduler):
        scheds = {runner.local_ranks[0]: scheds}
    if set(scheds) != set(runner.local_ranks):
        raise ValueError(f"scheds must have one scheduler per local rank {list(runner.local_ranks)}, "
                         f"got ranks {sorted(scheds)}")
    if overlap not in (False, True):
        raise ValueError(f"overlap must be True or False, got {overlap!r}")
    if overlap:
        check_overlap_supported(runner.config.num_speculative_tokens)
    buckets = list(runner.buckets.buckets)
    pending = deque(sorted(arrivals, key=lambda r: r.arrival_step))
    check_same_everywhere(runner, pending)
    stats = ServeStats(real_steps={d: 0 for d in scheds}, dummy_steps={d: 0 for d in scheds},
                       placed={d: [] for d in scheds})
    in_flight: _InFlight | None = None
    step = 0
    while True:
        g = runner.agree({d: (len(s.waiting) + len(s.running), int(s.has_work)) for d, s in scheds.items()})
        if not pending and not g[:, 1].any():
            break
        loads = [int(x) for x in g[:, 0]]
        while pending and pending[0].arrival_step <= step:
            req = pending.popleft()
            d = least_loaded(loads)
            loads[d] += 1
            if d in scheds:
                scheds[d].add_request(req)
                stats.placed[d].append(req.req_id)
        plans = {}
        for d, s in scheds.items():
            s.step_count = step  # the loop drives every rank's clock
            plans[d] = s.schedule()
        need = runner.agree({d: (-1 if p is None else buckets.index(p.bucket),) for d, p in plans.items()})
        step += 1
        if int(need[:, 0].max()) < 0:  # nobody has anything to run yet
            continue
        bucket = runner.buckets.join(buckets[i] for i in need[:, 0] if i >= 0)
        if in_flight is not None and _needs_values(plans):
            _resolve(in_flight)
            in_flight = None
            _refresh_added(plans)
        prepared = runner.prepare(plans, bucket)  # overlapped: packed while the step in flight runs
        if not overlap:
            result = runner.launch(prepared).fetch()
            check_idle_ranks(result, plans, step - 1)
            for d, plan in plans.items():
                if plan is not None:
                    out = result.outputs[d]
                    scheds[d].update(plan, out.sampled, out.num_sampled, out.logits)
        else:
            output = runner.launch(prepared)  # queued behind the step in flight
            if in_flight is not None:  # its outputs are read while the new step runs
                _resolve(in_flight)
            in_flight = _InFlight(step - 1, plans, output, {d: _apply_counts(scheds[d], p)
                                                            for d, p in plans.items() if p is not None},
                                  scheds)
        stats.steps += 1
        for d, plan in plans.items():
            if plan is None:
                stats.dummy_steps[d] += 1
            else:
                stats.real_steps[d] += 1
        if on_step is not None:
            on_step(step - 1, plans)
    if in_flight is not None:
        _resolve(in_flight)
    return stats
