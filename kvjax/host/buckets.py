"""Shape buckets: the one place that decides how a step is padded.

A step runs in the executable of the smallest bucket that fits it; the
runner's precompile and its serving path both call :meth:`BucketSpec.choose`.
Like vLLM's full CUDA graphs, a bucket ties its request capacity to its token
count (``num_reqs = min(num_tokens, max_num_seqs)``); the logits capacity is
``min(num_tokens, num_reqs * (1 + num_speculative_tokens))``.

Each token size has a *mixed* executable (any mix of prefill chunks and decode
rows). Token sizes a decode-only step can have (at most ``max_num_seqs * (1 + k)``
tokens) also have a *decode-only* one (vLLM's uniform-decode graphs), which the
model compiles without its prefill path: a Mamba layer's chunked scan, for one,
then never runs on a decode step and no step chooses a path at run time. A step
runs decode-only exactly when no scheduled row is prefilling (:meth:`BucketSpec.choose`).
"""

from __future__ import annotations

import dataclasses

from kvjax.spec import cdiv
from pallas_kernels.contract import is_int


def check_size(name: str, value, minimum: int = 1, why: str = "") -> int:
    """``value`` as a plain int, or ValueError naming ``name`` when it is not an int (``bool`` is
    not one) of at least ``minimum``; numpy ints are taken. The host's one rule for a size given by
    name: the message says "a positive int" (``minimum`` 1), "a non-negative int" (0) or "an int >=
    minimum", then ``why`` in parentheses when given."""
    if not is_int(value) or value < minimum:
        kind = {1: "a positive int", 0: "a non-negative int"}.get(minimum, f"an int >= {minimum}")
        raise ValueError(f"{name} must be {kind}{f' ({why})' if why else ''}, got {value!r}")
    return int(value)


class BatchTooLargeError(ValueError):
    """The step does not fit the largest bucket: the scheduler must split it."""


@dataclasses.dataclass(frozen=True, order=True)
class Bucket:
    """Padded sizes of one step executable: ``T`` tokens, ``R`` rows, ``L`` logits; ``decode_only``:
    no row of a step in it is prefilling (the model compiles no prefill path)."""

    num_tokens: int
    num_reqs: int
    num_logits: int
    decode_only: bool = False

    def holds(self, other: "Bucket") -> bool:
        """Whether a step planned for ``other`` can run in this bucket (as big in every size, and
        mixed unless ``other`` is decode-only)."""
        return (self.num_tokens >= other.num_tokens and self.num_reqs >= other.num_reqs
                and self.num_logits >= other.num_logits and (other.decode_only or not self.decode_only))


def default_token_sizes(max_num_batched_tokens: int, num_speculative_tokens: int = 0) -> tuple[int, ...]:
    """vLLM-style capture sizes up to ``max_num_batched_tokens``.

    ``1, 2, 4``, then steps of 8 to 256, then steps of 16, and the maximum
    itself; every size rounded up to a multiple of ``1 + num_speculative_tokens``
    (a decode window) and capped at the maximum.
    """
    m = check_size("max_num_batched_tokens", max_num_batched_tokens, 1)
    dql = 1 + check_size("num_speculative_tokens", num_speculative_tokens, 0)
    sizes = [1, 2, 4] + list(range(8, min(m + 1, 256), 8)) + list(range(256, m + 1, 16)) + [m]
    rounded = {min(cdiv(s, dql) * dql, m) for s in sizes if s <= m}
    return tuple(sorted(rounded))


@dataclasses.dataclass(frozen=True)
class BucketSpec:
    """The set of step shapes a runner compiles.

    Attributes:
      token_sizes: ascending token counts (each one executable).
      max_num_seqs: request rows a step may hold.
      num_speculative_tokens: drafts per decode window.
    """

    token_sizes: tuple[int, ...]
    max_num_seqs: int
    num_speculative_tokens: int = 0

    def __post_init__(self):
        try:
            sizes = () if isinstance(self.token_sizes, (str, bytes)) else tuple(self.token_sizes)
        except TypeError:  # not iterable: an int, a 0-d array
            sizes = ()
        if not sizes:
            raise ValueError(f"token_sizes must be a non-empty sequence of distinct ascending positive "
                             f"ints, got {self.token_sizes!r}")
        ts = tuple(check_size(f"token_sizes[{i}]", t, 1) for i, t in enumerate(sizes))
        if list(ts) != sorted(set(ts)):
            raise ValueError(f"token_sizes must be distinct ascending positive ints, got {self.token_sizes!r}")
        object.__setattr__(self, "token_sizes", ts)
        object.__setattr__(self, "max_num_seqs", check_size("max_num_seqs", self.max_num_seqs, 1))
        object.__setattr__(self, "num_speculative_tokens",
                           check_size("num_speculative_tokens", self.num_speculative_tokens, 0))

    @classmethod
    def default(cls, max_num_batched_tokens: int, max_num_seqs: int, num_speculative_tokens: int = 0):
        return cls(default_token_sizes(max_num_batched_tokens, num_speculative_tokens), max_num_seqs,
                   num_speculative_tokens)

    def bucket_for(self, num_tokens_padded: int, decode_only: bool = False) -> Bucket:
        """The bucket of one token size (mixed, or decode-only); ValueError for a size that is not
        one of :attr:`token_sizes` (no executable has it)."""
        num_tokens_padded = check_size("num_tokens_padded", num_tokens_padded, 1)
        if num_tokens_padded not in self.token_sizes:
            raise ValueError(f"num_tokens_padded must be one of token_sizes {self.token_sizes}, "
                             f"got {num_tokens_padded!r}")
        R = min(num_tokens_padded, self.max_num_seqs)
        L = min(num_tokens_padded, R * (1 + self.num_speculative_tokens))
        return Bucket(num_tokens_padded, R, L, bool(decode_only))

    @property
    def max_decode_tokens(self) -> int:
        """The most tokens a decode-only step has: every row a full decode window."""
        return self.max_num_seqs * (1 + self.num_speculative_tokens)

    @property
    def buckets(self) -> tuple[Bucket, ...]:
        """Every bucket, ascending by size, a size's decode-only bucket before its mixed one: what
        precompile builds. Decode-only buckets: each token size up to the first one holding
        :attr:`max_decode_tokens`."""
        cap = next((t for t in self.token_sizes if t >= self.max_decode_tokens), self.token_sizes[-1])
        out = [self.bucket_for(t, True) for t in self.token_sizes if t <= cap]
        out += [self.bucket_for(t) for t in self.token_sizes]
        return tuple(sorted(out, key=lambda b: (b.num_tokens, not b.decode_only)))

    @property
    def max_num_tokens(self) -> int:
        return self.token_sizes[-1]

    def choose(self, num_tokens: int, num_reqs: int, num_logits: int | None = None, *,
               decode_only: bool = False) -> Bucket:
        """The smallest bucket holding ``num_tokens`` tokens, ``num_reqs`` rows and the logits;
        ``decode_only`` (no scheduled row is prefilling): a decode-only bucket, or the mixed one
        where none fits; otherwise a mixed bucket.

        Raises:
          ValueError: a size is not a positive int.
          BatchTooLargeError: nothing fits; the scheduler must split the batch.
        """
        num_tokens = check_size("num_tokens", num_tokens, 1)
        num_reqs = check_size("num_reqs", num_reqs, 1)
        num_logits = num_reqs if num_logits is None else check_size("num_logits", num_logits, 1)
        need = Bucket(num_tokens, num_reqs, num_logits, bool(decode_only))
        for b in self.buckets:
            if b.holds(need):
                return b
        raise BatchTooLargeError(
            f"a step of {num_tokens} tokens, {num_reqs} requests and {num_logits} logits fits no "
            f"bucket (largest: {self.buckets[-1]}); the scheduler must split it"
        )

    def join(self, buckets) -> Bucket:
        """The smallest bucket holding every one of ``buckets`` (ranks that run one step
        together: decode-only only if all of theirs are). ``buckets`` must not be empty."""
        buckets = list(buckets)
        if not buckets:
            raise ValueError("join needs at least one bucket")
        return self.choose(max(b.num_tokens for b in buckets), max(b.num_reqs for b in buckets),
                           max(b.num_logits for b in buckets),
                           decode_only=all(b.decode_only for b in buckets))


@dataclasses.dataclass(frozen=True)
class Staging:
    """How much one step in a bucket can stage: the lengths of the fixed-shape arrays the
    runner packs, or (from :meth:`~kvjax.host.scheduler.StepPlan.staging_need`) how much
    one plan stages.

    Attributes:
      cleared_rows: rows freed since the last step (finished or preempted).
      new_requests: requests installed into rows this step.
      block_writes: rows whose block tables change this step.
      ids_per_write: new logical block ids one row's write carries (per KV group).
      zero_blocks: fresh KV blocks zeroed before the step reads them.
      zero_slots: fresh recurrent-state slots zeroed before the step reads them.
      prefill_rows: scheduled rows still prefilling (the model's prefill path is compiled for
        at most this many sequences, e.g. the Mamba scan's chunk table).
    """

    cleared_rows: int
    new_requests: int
    block_writes: int
    ids_per_write: int
    zero_blocks: int
    zero_slots: int
    prefill_rows: int = 0

    def __post_init__(self):
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, check_size(f"Staging.{f.name}", getattr(self, f.name), 0))

    def excess(self, need: "Staging") -> list[str]:
        """The fields where ``need`` exceeds this capacity, as ``"name: need > capacity"``."""
        return [f"{f.name}: {getattr(need, f.name)} > {getattr(self, f.name)}"
                for f in dataclasses.fields(self) if getattr(need, f.name) > getattr(self, f.name)]

    def holds(self, need: "Staging") -> bool:
        """Whether every field of ``need`` is within this capacity."""
        return not self.excess(need)


def max_prefill_rows(max_new_requests: int) -> int:
    """Rows one step may prefill: its admissions plus one request left mid-prefill by an earlier
    step. The scheduler keeps to it (:meth:`kvjax.host.scheduler.Scheduler.schedule`); a step's
    model may size its prefill path by it (:func:`bucket_staging`'s ``prefill_rows``)."""
    return max_new_requests + 1


def bucket_staging(bucket: Bucket, *, block_size: int | tuple[int, ...], num_speculative_tokens: int,
                   max_new_requests: int, max_num_seqs: int) -> Staging:
    """The staging capacity of one step in ``bucket``: the one rule for the sizes of the
    runner's staged arrays, which the scheduler's plans never exceed.

    ``block_size``: the KV groups' block sizes, one per group (an int: one group). With
    ``T, R = bucket.num_tokens, bucket.num_reqs``, ``k = num_speculative_tokens`` and
    ``M(b) = cdiv(T, b) + 1`` (a row scheduled ``n <= T`` tokens adds at most ``cdiv(n, b)`` blocks
    of size ``b``): ``M(smallest block size)`` ids per block write (per group), ``R`` block writes
    (only scheduled rows write), ``Z = R * sum(M(b) for each group)`` zeroed blocks (every fresh
    block is in its row's write of the step, in one group), ``R * (1 + k)`` zeroed slots (a request
    is admitted only when scheduled, with ``1 + k`` slots), ``max_new_requests`` new requests and
    ``max_num_seqs`` cleared rows (each row once), and ``min(R, max_prefill_rows(max_new_requests))``
    prefilling rows, none in a decode-only bucket (compiled without the prefill path).

    Raises:
      ValueError: a size is not a positive int, ``max_new_requests > max_num_seqs``, or the
        bucket holds more rows than ``max_num_seqs``.
    """
    if is_int(block_size):
        block_sizes = (check_size("block_size", block_size, 1),)
    elif isinstance(block_size, (tuple, list)) and block_size:
        block_sizes = tuple(check_size(f"block_size[{g}]", b, 1) for g, b in enumerate(block_size))
    else:
        raise ValueError(f"block_size must be a positive int or a non-empty sequence of them (one per KV "
                         f"group), got {block_size!r}")
    max_new_requests = check_size("max_new_requests", max_new_requests, 1)
    max_num_seqs = check_size("max_num_seqs", max_num_seqs, 1)
    k = check_size("num_speculative_tokens", num_speculative_tokens, 0)
    if max_new_requests > max_num_seqs:
        raise ValueError(f"max_new_requests must be <= max_num_seqs={max_num_seqs} (a new request "
                         f"takes a row), got {max_new_requests}")
    if not isinstance(bucket, Bucket) or not 0 < bucket.num_reqs <= min(bucket.num_tokens, max_num_seqs):
        raise ValueError(f"bucket must be a Bucket of 1..min(num_tokens, max_num_seqs={max_num_seqs}) "
                         f"rows, got {bucket!r}")
    T, R = bucket.num_tokens, bucket.num_reqs
    ids_per_write = [cdiv(T, b) + 1 for b in block_sizes]
    return Staging(cleared_rows=max_num_seqs, new_requests=max_new_requests, block_writes=R,
                   ids_per_write=max(ids_per_write), zero_blocks=R * sum(ids_per_write), zero_slots=R * (1 + k),
                   prefill_rows=0 if bucket.decode_only else min(R, max_prefill_rows(max_new_requests)))
