"""Workloads for the serving demo: the JSON format, validation and a seeded generator.

Format::

    {"requests": [{"id": "a", "prompt": [72, 101, 108], "max_tokens": 16, "arrival_step": 0}]}

``arrival_step`` is optional (default 0). Validation happens before anything
is compiled and names the request and field at fault.
"""

from __future__ import annotations

import json
import random

from kvjax.host.scheduler import Request, check_request


class WorkloadError(ValueError):
    """A workload file or entry is malformed."""


#: Optional per-request fields of a workload (see :class:`~kvjax.host.scheduler.Request`).
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "seed", "stop_token_ids", "ignore_eos")


def validate_workload(data, *, vocab_size: int, max_model_len: int, check_fits=None) -> list[Request]:
    """Requests from a parsed workload, or :class:`WorkloadError` naming the problem.

    Each request: ``id``, ``prompt`` (token ids), ``max_tokens``, optional ``arrival_step`` and
    the optional :data:`SAMPLING_FIELDS` (greedy, no stop tokens by default). Its prompt and
    ``max_tokens`` are checked by the scheduler's :func:`~kvjax.host.scheduler.check_request`.

    ``check_fits``: optional ``Request -> None`` raising ``ValueError`` for a request the
    cache can never hold (the scheduler's capacity rule, ``Scheduler.check_fits``).
    """
    if not isinstance(data, dict) or not isinstance(data.get("requests"), list):
        raise WorkloadError('a workload must be a JSON object with a "requests" list')
    if not data["requests"]:
        raise WorkloadError("the workload has no requests")
    out, seen = [], set()
    for i, r in enumerate(data["requests"]):
        where = f"requests[{i}]"
        if not isinstance(r, dict):
            raise WorkloadError(f"{where} must be an object, got {type(r).__name__}")
        rid = r.get("id")
        if not isinstance(rid, str) or not rid:
            raise WorkloadError(f"{where}.id must be a non-empty string, got {rid!r}")
        where = f"request {rid!r}"
        if rid in seen:
            raise WorkloadError(f"duplicate request id {rid!r}")
        seen.add(rid)
        prompt, mt = r.get("prompt"), r.get("max_tokens")
        try:  # the scheduler's admission rule (its messages name the request as ``where`` does)
            check_request(rid, prompt, mt, max_model_len=max_model_len)
        except ValueError as e:
            raise WorkloadError(str(e)) from None
        for j, t in enumerate(prompt):
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
                raise WorkloadError(
                    f"{where}: prompt[{j}]={t!r} is not a token id in [0, {vocab_size})"
                )
        arrival = r.get("arrival_step", 0)
        if not isinstance(arrival, int) or isinstance(arrival, bool) or arrival < 0:
            raise WorkloadError(f"{where}: arrival_step must be a non-negative int, got {arrival!r}")
        unknown = set(r) - {"id", "prompt", "max_tokens", "arrival_step", *SAMPLING_FIELDS}
        if unknown:
            raise WorkloadError(f"{where}: unknown field(s) {sorted(unknown)}")
        stops = r.get("stop_token_ids", [])
        if not isinstance(stops, list) or any(
                not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size for t in stops):
            raise WorkloadError(f"{where}: stop_token_ids must be a list of token ids in [0, {vocab_size}), "
                                f"got {stops!r}")
        sampling = {k: r[k] for k in SAMPLING_FIELDS if k in r and k != "stop_token_ids"}
        if "ignore_eos" in sampling and not isinstance(sampling["ignore_eos"], bool):
            raise WorkloadError(f"{where}: ignore_eos must be true or false, got {sampling['ignore_eos']!r}")
        try:
            req = Request(rid, list(prompt), mt, arrival, stop_token_ids=tuple(stops), **sampling)
        except ValueError as e:  # the sampling parameters' own checks
            raise WorkloadError(str(e)) from None
        if check_fits is not None:
            try:
                check_fits(req)
            except ValueError as e:
                raise WorkloadError(str(e)) from None
        out.append(req)
    return out


def load_workload(path: str, *, vocab_size: int, max_model_len: int, check_fits=None) -> list[Request]:
    """Read and validate a workload file (``check_fits`` as in :func:`validate_workload`)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise WorkloadError(f"cannot read workload {path!r}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise WorkloadError(f"workload {path!r} is not valid JSON: {e}") from None
    return validate_workload(data, vocab_size=vocab_size, max_model_len=max_model_len, check_fits=check_fits)


def generate_workload(num_requests: int, seed: int, *, max_model_len: int, vocab_size: int = 256) -> dict:
    """A seeded workload: varied prompt lengths, some repetition (so n-gram drafts hit), staggered arrivals."""
    rng = random.Random(seed)
    reqs = []
    for i in range(num_requests):
        n = rng.randint(3, max(3, min(24, max_model_len // 3)))
        base = [rng.randrange(32, min(127, vocab_size)) for _ in range(rng.randint(2, 5))]
        prompt = [base[j % len(base)] if rng.random() < 0.5 else rng.randrange(vocab_size) for j in range(n)]
        reqs.append({
            "id": f"req{i}",
            "prompt": prompt,
            "max_tokens": rng.randint(4, max(4, min(24, max_model_len - n - 1))),
            "arrival_step": rng.randint(0, 2 * num_requests),
        })
    return {"requests": reqs}
