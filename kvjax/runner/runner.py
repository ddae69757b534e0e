"""Bucketed, ahead-of-time compiled step functions: kvjax's CUDA-graph replacement.

One executable per bucket (:mod:`kvjax.host.buckets`) runs a whole step on the
device: apply the step's staged writes (cleared rows, new requests, block-table
appends), zero the fresh KV blocks and recurrent slots (one ``zero_blocks``
launch each), build the padded :class:`~kvjax.state.StepBatch`, run the model,
sample greedily, verify drafts, and apply ``post_update``. Runner state and
caches are donated, so they are updated in place. The host sends one packed,
fixed-shape :class:`StepInputs` per step (numpy, made by :meth:`Runner.pack`).

All executables are compiled at start-up (:meth:`Runner.precompile`); at
serving time nothing traces or compiles (:class:`~kvjax.runner.compile_guard.ServingGuard`).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax.host.buckets import Bucket, BucketSpec
from kvjax.runner import sanitizer
from kvjax.runner.compile_guard import ServingGuard
from kvjax.constants import NULL_BLOCK_ID, PAD_ROW_ID
from kvjax.runner.packing import (
    DtypeLayout, PackSpec, flatten_by_dtype, pack, pack_device, spec_of, unflatten_by_dtype, unpack,
)
from kvjax.models import HybridCaches, TinyHybridConfig, dense_forward, forward_step, init_caches, init_params
from kvjax.models.caches import check_kv_layout
from kvjax.host.scheduler import Scheduler, StepPlan
from kvjax.spec import KVGroupSpec, cdiv
from pallas_kernels import zero_blocks
from kvjax.state import (
    BlockTables, NewRequests, RequestState, ScheduledBatch, build_step_batch, expand_to_kernel_blocks,
    gather_index,
)


@dataclasses.dataclass(frozen=True)
class RunnerConfig:
    """Sizes and options of a runner (hashable).

    ``num_blocks`` counts logical KV blocks including the reserved block 0.
    ``matmul_precision`` is the ``jax.default_matmul_precision`` the step (and the
    dense reference) is traced under: "highest" keeps float32 matmuls float32 on GPUs,
    whose default (TF32) moves logits by ~3e-3.
    ``num_state_slots`` (derived) is ``1 + max_num_seqs * (1 + num_speculative_tokens)``.
    """

    model: TinyHybridConfig = TinyHybridConfig()
    block_size: int = 8
    num_blocks: int = 64
    max_model_len: int = 128
    max_num_seqs: int = 4
    max_num_batched_tokens: int = 32
    num_speculative_tokens: int = 0
    kv_cache_dtype: str = "auto"
    kv_layout: str = "flash"
    backend: str = "auto"
    seed: int = 0
    poison: bool = False  # checked mode: NaN poison plus the memory checks of kvjax.runner.sanitizer
    token_sizes: tuple[int, ...] | None = None
    max_new_requests_per_step: int = 4
    matmul_precision: str = "highest"

    def __post_init__(self):
        for name in ("block_size", "num_blocks", "max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {self.num_blocks}")
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens!r}")
        if self.kv_cache_dtype not in ("auto", "fp8", "fp8_e4m3"):
            raise ValueError(f"kv_cache_dtype must be 'auto', 'fp8' or 'fp8_e4m3', got {self.kv_cache_dtype!r}")
        check_kv_layout(self.kv_layout)
        if self.max_num_batched_tokens < 1 + self.num_speculative_tokens:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} cannot hold one decode window "
                f"of 1 + {self.num_speculative_tokens} tokens"
            )

    @property
    def max_new_requests(self) -> int:
        """Rows staged for new requests per step: ``min(max_new_requests_per_step, max_num_seqs)``."""
        return max(1, min(self.max_new_requests_per_step, self.max_num_seqs))

    def make_scheduler(self, drafter=None):
        """A :class:`~kvjax.host.scheduler.Scheduler` sized for this runner (optional custom drafter)."""

        return Scheduler(self.specs, self.bucket_spec, num_blocks=self.num_blocks,
                         max_model_len=self.max_model_len, num_state_slots=self.num_state_slots,
                         max_new_requests=self.max_new_requests, drafter=drafter)

    @property
    def kv_group(self) -> KVGroupSpec:
        return KVGroupSpec.for_model_len(self.block_size, self.max_model_len)

    @property
    def specs(self) -> tuple[KVGroupSpec, ...]:
        return (self.kv_group,)

    @property
    def num_state_slots(self) -> int:
        return 1 + self.max_num_seqs * (1 + self.num_speculative_tokens)

    @property
    def bucket_spec(self) -> BucketSpec:
        if self.token_sizes is not None:
            return BucketSpec(tuple(self.token_sizes), self.max_num_seqs, self.num_speculative_tokens)
        return BucketSpec.default(self.max_num_batched_tokens, self.max_num_seqs, self.num_speculative_tokens)


@struct.dataclass
class DeviceState:
    """Everything the step mutates (donated): request rows, block tables, caches."""

    requests: RequestState
    tables: BlockTables
    caches: HybridCaches


@struct.dataclass
class StepInputs:
    """One step's host-to-device payload, fixed shapes per bucket (``-1`` pads ids/rows).

    Attributes:
      cleared_rows: int32 ``[max_num_seqs]`` rows freed since the last step.
      new: requests installed this step (``R`` entries).
      write_rows, write_ids, write_num, write_overwrite: block-table appends
        (``[R]``, per group ``[R, M]``, ``[G, R]``, ``[R]``).
      zero_blocks: int32 ``[Z]`` fresh logical KV blocks; zero_slots: int32
        ``[Zs]`` fresh recurrent slots.
      poison_blocks / poison_slots: ids freed since the last step, filled with
        NaN when the runner poisons (all -1 otherwise).
      sched: the schedule (``R`` rows); drafts: int32 ``[R, k]``.
      state_indices: int32 ``[R, 1 + k]`` each row's recurrent slots.
      expect_tables, expect_num_blocks, live_rows, live_slots: the host's view
        after the step, for the sanitizer (per group ``[S, W]``, ``[G, S]``, bool
        ``[S]``, bool ``[num_state_slots]``; empty unless the runner poisons).
    """

    cleared_rows: jax.Array
    new: NewRequests
    write_rows: jax.Array
    write_ids: tuple[jax.Array, ...]
    write_num: jax.Array
    write_overwrite: jax.Array
    zero_blocks: jax.Array
    zero_slots: jax.Array
    poison_blocks: jax.Array
    poison_slots: jax.Array
    sched: ScheduledBatch
    drafts: jax.Array
    state_indices: jax.Array
    expect_tables: tuple[jax.Array, ...]
    expect_num_blocks: jax.Array
    live_rows: jax.Array
    live_slots: jax.Array


@dataclasses.dataclass
class StepOutput:
    """One step's outputs on the host: batch row ``b`` sampled ``sampled[b, :num_sampled[b]]``
    (accepted drafts, then the bonus or correction token); ``logits``: one row per logits index."""

    sampled: np.ndarray  # int32 [R, 1 + k]
    num_sampled: np.ndarray  # int32 [R]
    logits: np.ndarray  # float32 [L, vocab]


@dataclasses.dataclass(frozen=True)
class PendingOutput:
    """A dispatched step's outputs, still on the device (JAX dispatch is asynchronous).

    In checked mode ``checks`` holds the sanitizer's results and ``verdict`` raises
    :class:`~kvjax.runner.sanitizer.SanitizerError` on a violation when they are fetched.
    With the packed layout the four outputs come as one int32 buffer ``packed`` laid out
    by ``packed_spec`` (one transfer; the other fields are None).
    """

    sampled: jax.Array | None
    num_sampled: jax.Array | None
    logits: jax.Array | None
    checks: jax.Array | None = None
    verdict: Callable[[jax.Array], None] | None = None
    packed: jax.Array | None = None
    packed_spec: PackSpec | None = None

    def wait(self) -> None:
        """Block until the step has run on the device (no host copy, no verdict)."""
        jax.block_until_ready(self.packed if self.packed is not None else
                              (self.sampled, self.num_sampled, self.logits, self.checks))

    def fetch(self) -> StepOutput:
        """Wait for the step and copy its outputs to the host (checked mode: then judge it)."""
        if self.packed is not None:
            sampled, num_sampled, logits, checks = unpack(np.asarray(self.packed), self.packed_spec)
        else:
            sampled, num_sampled, logits, checks = self.sampled, self.num_sampled, self.logits, self.checks
        out = StepOutput(np.asarray(sampled), np.asarray(num_sampled), np.asarray(logits))
        if self.verdict is not None:
            self.verdict(checks)
        return out


def _zero_fresh_kv(kv, ids, r, backend):
    """Zero the step's fresh KV blocks (logical ids, ``-1`` pads) of every K/V array."""
    return list(zero_blocks(kv, ids, kernel_blocks_per_block=r, backend=backend))


def _greedy_verify(logits, cu_num_logits, drafts, num_draft, k):
    """Greedy sampling with draft verification.

    Row ``b``'s logits are rows ``cu[b] .. cu[b] + nd_b``; draft ``i`` is accepted
    while every earlier draft was and ``argmax(logits[cu[b] + i]) == drafts[b, i]``.
    Returns ``sampled [R, 1 + k]`` (the targets) and ``num_sampled [R]`` =
    accepted + 1 for rows with logits, 0 for padded rows.
    """
    L = logits.shape[0]
    target = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [L]
    R = num_draft.shape[0]
    j = jnp.arange(1 + k, dtype=jnp.int32)[None, :]
    rows = cu_num_logits[:-1, None] + j
    sampled = target[jnp.clip(rows, 0, L - 1)]
    has_logits = (cu_num_logits[1:] - cu_num_logits[:-1]) > 0
    if k:
        match = (j[:, :k] < num_draft[:, None]) & (sampled[:, :k] == drafts[:, :k])
        accepted = jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1)
    else:
        accepted = jnp.zeros((R,), jnp.int32)
    num_sampled = jnp.where(has_logits, accepted + 1, 0).astype(jnp.int32)
    sampled = jnp.where(j < num_sampled[:, None], sampled, 0)
    return sampled, num_sampled


def step_fn(params, dstate: DeviceState, packed: jax.Array, *, config: RunnerConfig, bucket: Bucket,
            spec: PackSpec, expert_axis: str | None = None, model_axis: str | None = None,
            sanitize: bool | None = None):
    """One whole step on the device (pure; ``dstate`` is donated by the runner).

    ``packed`` is the int32 buffer of :class:`StepInputs` made by :func:`kvjax.runner.packing.pack`.
    ``expert_axis``: run per data rank inside ``shard_map`` with MoE experts sharded over
    that mesh axis, and heads over ``model_axis`` (:mod:`kvjax.runner.mesh`). ``sanitize``
    (default ``config.poison``): compute the checks of :mod:`kvjax.runner.sanitizer`, returned
    as the last output (``int32 [0, 1]`` when off); the inputs must then carry the host's
    expectations.
    """
    sanitize = config.poison if sanitize is None else sanitize
    inp: StepInputs = unpack(packed, spec)
    req, tables, caches = dstate.requests, dstate.tables, dstate.caches
    G = tables.num_groups
    n_clear = inp.cleared_rows.shape[0]
    req = req.clear_rows(inp.cleared_rows)
    tables = tables.write_rows(
        inp.cleared_rows,
        [jnp.zeros((n_clear, 0), jnp.int32)] * G,
        jnp.zeros((G, n_clear), jnp.int32),
        jnp.ones((n_clear,), jnp.bool_),
    )
    if config.poison:  # add_requests must rewrite every field of its rows
        req = sanitizer.poison_rows(req, inp.new.rows)
    req = req.add_requests(inp.new)
    tables = tables.write_rows(inp.write_rows, inp.write_ids, inp.write_num, inp.write_overwrite)

    r = config.kv_group.blocks_per_kv_block
    kv = caches.kv_arrays
    states = caches.state_arrays
    if config.poison:
        kv = sanitizer.poison_ids(kv, inp.poison_blocks, r)
        states = sanitizer.poison_ids(states, inp.poison_slots)
    kv = _zero_fresh_kv(kv, inp.zero_blocks, r, config.backend)
    if states:
        states = list(zero_blocks(states, inp.zero_slots, backend=config.backend))
    caches = caches.replace_kv_arrays(kv).replace(
        conv_state=tuple(states[0::2]), ssm_state=tuple(states[1::2]),
    )
    if sanitize:
        g = config.model.kv_group
        fresh = jnp.concatenate([
            inp.zero_blocks, sanitizer.appended_ids(inp.write_rows, inp.write_ids[g], inp.write_num[g],
                                                     tables.max_num_reqs)
        ])
        pre_checks = sanitizer.pre_forward_checks(req, caches, added_rows=inp.new.rows, fresh_blocks=fresh,
                                                  fresh_slots=inp.zero_slots, r=r)

    sched = inp.sched
    k = config.num_speculative_tokens
    if k:
        req = req.set_draft_tokens(sched.idx_mapping, inp.drafts)
    batch = build_step_batch(
        req, tables, sched,
        num_tokens_padded=bucket.num_tokens, num_logits_padded=bucket.num_logits,
        backend=config.backend,
    )
    valid = batch.row_valid
    safe = gather_index(batch.idx_mapping, req.max_num_reqs)
    if k:
        state_indices = inp.state_indices
        num_accepted = jnp.where(valid, req.num_accepted_tokens[safe], 1)
    else:
        state_indices, num_accepted = inp.state_indices[:, 0], None
    with jax.named_scope("model"):  # the profile (benchmarks/profile_gpu.py) splits on this scope
        logits, caches = forward_step(
            params, config.model, batch, caches, state_indices, num_accepted, backend=config.backend,
            expert_axis=expert_axis, model_axis=model_axis,
        )
    ndraft = jnp.where(valid, sched.num_draft_tokens, 0)
    sampled, num_sampled = _greedy_verify(logits, batch.cu_num_logits, inp.drafts, ndraft, k)
    # The batch's rows: a row the bucket could not hold is padding there, and here.
    req = req.post_update(batch.idx_mapping, jnp.diff(batch.query_start_loc), sampled, num_sampled)
    checks = jnp.zeros((0, 1), jnp.int32)
    if sanitize:
        checks = sanitizer.encode({**pre_checks, **sanitizer.post_step_checks(
            req, tables, caches, expect_tables=inp.expect_tables, expect_num_blocks=inp.expect_num_blocks,
            live_rows=inp.live_rows, live_slots=inp.live_slots, r=r, kv_group=config.model.kv_group,
        )})
    out = (sampled, num_sampled, logits, checks)
    return DeviceState(requests=req, tables=tables, caches=caches), out


def _packed_step(params, rows, caches, buf, *, step, params_layout: DtypeLayout | None, rows_spec: PackSpec,
                 stable_input: bool):
    """``step`` (a ``step_fn`` partial) with the packed layout's arguments and results (see
    :class:`Runner`): returns ``(rows, caches, packed outputs)``; ``rows`` and ``caches`` donated.
    ``params``: the params tree, or (``params_layout`` given) their :func:`flatten_by_dtype` groups."""
    n = rows_spec.size
    if stable_input:  # the one reader of ``buf``; everything else reads the donated rows buffer
        rows = jax.lax.optimization_barrier(jax.lax.dynamic_update_slice(rows, buf, (n,)))
        buf = rows[n: n + buf.shape[0]]
    req, tables = unpack(rows[:n], rows_spec)
    if params_layout is not None:
        params = unflatten_by_dtype(params, params_layout)
    new, out = step(params, DeviceState(requests=req, tables=tables, caches=caches), buf)
    rows = jax.lax.dynamic_update_slice(rows, pack_device((new.requests, new.tables)), (0,))
    return rows, new.caches, pack_device(out)


# XLA options of the step executables on a GPU: command buffers (CUDA graphs) also around
# custom calls (the Pallas kernels), while loops and conditionals, from a single command up,
# so that a step runs as one graph rather than ~150 separate kernel launches (figures in
# BENCHMARKS.md). Pass ``compiler_options={}`` to the Runner for XLA's defaults.
GPU_COMPILER_OPTIONS = {
    "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL",
    "xla_gpu_graph_min_graph_size": 1,
}


def default_compiler_options() -> dict | None:
    """:data:`GPU_COMPILER_OPTIONS` when JAX's default backend is a GPU, else None."""
    return dict(GPU_COMPILER_OPTIONS) if jax.default_backend() == "gpu" else None


def default_layout() -> str:
    """The Runner's argument layout when none is given: ``"packed"`` on a GPU, where the host's
    cost per argument, per output and per transfer sets the step rate (figures in
    BENCHMARKS.md), ``"tree"`` elsewhere."""
    return "packed" if jax.default_backend() == "gpu" else "tree"


@dataclasses.dataclass(frozen=True)
class PreparedStep:
    """A step packed on the host, not yet enqueued (:meth:`Runner.prepare`, :meth:`Runner.launch`):
    ``buf`` is its int32 input buffer in ``bucket``'s layout."""

    bucket: Bucket
    buf: np.ndarray
    step: object


@dataclasses.dataclass(frozen=True)
class PackedState:
    """The device state as the packed layout passes it: the request rows and block tables
    as one int32 buffer ``rows`` (:func:`~kvjax.runner.packing.pack` layout; with a stable
    input, followed by the step-input area), and the caches as they are."""

    rows: jax.Array
    caches: HybridCaches


LAYOUTS = ("tree", "packed")


class Runner:
    """Owns the params, the donated device state and one compiled step per bucket.

    Args:
      config: sizes and options.
      strict: a trace or compile at serving time raises (else a counted warning).
      compiler_options: XLA options of the step executables (None: :func:`default_compiler_options`).
      layout: how a step's arguments cross into the executable (None: :func:`default_layout`).
        ``"tree"``: params, state and outputs leaf by leaf (~53 arguments, 25 outputs).
        ``"packed"``: request rows and block tables as one donated int32 buffer, the caches
        as they are, and the four outputs as one int32 buffer (~41 arguments of which 9
        donated, 10 outputs: less host work per call). Results are bitwise the same.
      pack_params: (packed layout) also pass the params as one array per dtype (11 arguments);
        the step then slices them, which may cost copies on the device.
      stable_input: (packed layout; None: on with it) the step first copies its packed input
        into an area of the donated rows buffer and reads it from there, so only that copy
        refers to the per-step input buffer (an XLA command buffer then updates one node for
        it, not every reader).
    """

    def __init__(self, config: RunnerConfig, *, strict: bool = True, compiler_options: dict | None = None,
                 layout: str | None = None, stable_input: bool | None = None, pack_params: bool = False):
        layout = default_layout() if layout is None else layout
        stable_input = layout == "packed" if stable_input is None else stable_input
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if (stable_input or pack_params) and layout != "packed":
            what = "stable_input=True" if stable_input else "pack_params=True"
            raise ValueError(f"{what} needs layout='packed', got layout={layout!r}")
        self.config = config
        self.layout = layout
        self.stable_input = stable_input
        self.pack_params = pack_params
        self.compiler_options = default_compiler_options() if compiler_options is None else compiler_options
        self.buckets = config.bucket_spec
        self.params = init_params(config.model, config.seed)
        self.guard = ServingGuard(strict=strict)
        self.executables: dict[Bucket, tuple[jax.stages.Compiled, PackSpec]] = {}
        self.compile_seconds = 0.0
        self.sanitizer = None
        if config.poison:
            self.sanitizer = sanitizer.Sanitizer(config.specs, config.max_num_seqs, config.num_state_slots)
        if layout == "packed":
            self._param_args, self._param_layout = (flatten_by_dtype(self.params) if pack_params
                                                    else (self.params, None))
            self._input_words = max(pack(self.pack(None, b))[1].size for b in self.buckets.buckets)
            self._out_specs: dict[Bucket, PackSpec] = {}
        self.state = self._initial_state()
        if self.sanitizer is not None:
            s = self.state
            self.sanitizer.set_layout(s.requests, s.tables, s.caches, r=config.kv_group.blocks_per_kv_block,
                                      kv_group=config.model.kv_group)

    # ------------------------------------------------------------ state

    @property
    def state(self) -> DeviceState:
        """The device state (packed layout: rebuilt from the packed buffers, a copy of the rows)."""
        if self.layout == "tree":
            return self._state
        rows, spec = self._pstate.rows, self._rows_spec
        req, tables = jax.device_put(unpack(np.asarray(rows)[: spec.size], spec))
        return DeviceState(requests=req, tables=tables, caches=self._pstate.caches)

    @state.setter
    def state(self, value: DeviceState) -> None:
        if self.layout == "tree":
            self._state = value
            return
        buf, spec = pack(jax.device_get((value.requests, value.tables)))
        if getattr(self, "_rows_spec", spec) != spec:
            raise ValueError("state's request rows / block tables do not match this runner's layout")
        self._rows_spec = spec
        extra = self._input_words + 1 if self.stable_input else 0  # + 1: never a whole-buffer update
        rows = np.concatenate([buf, np.zeros((extra,), np.int32)])
        self._pstate = PackedState(rows=jax.device_put(rows), caches=value.caches)

    def _initial_state(self) -> DeviceState:
        c = self.config
        g = c.kv_group
        caches = init_caches(
            c.model, c.num_blocks * g.blocks_per_kv_block, g.kernel_block_size,
            c.num_state_slots, c.kv_cache_dtype, num_spec_tokens=c.num_speculative_tokens,
            kv_layout=c.kv_layout,
        )
        if c.poison:  # every block and slot starts as garbage: only zeroed memory may be read
            caches = jax.tree.map(sanitizer.poison_like, caches)
        return DeviceState(
            requests=RequestState.create(c.max_num_seqs, c.max_model_len, c.num_speculative_tokens),
            tables=BlockTables.create(c.specs, c.max_num_seqs, num_cache_blocks=c.num_blocks),
            caches=caches,
        )

    # ------------------------------------------------------------ packing

    def _sizes(self, bucket: Bucket):
        c = self.config
        M = cdiv(bucket.num_tokens, c.block_size) + 1
        Z = 2 * bucket.num_reqs * M
        return M, Z

    def pack(self, plan: StepPlan | None, bucket: Bucket | None = None) -> StepInputs:
        """The step's fixed-shape numpy payload (``plan=None``: an all-padding dummy step)."""
        c = self.config
        bucket = plan.bucket if plan is not None else bucket
        R, k = bucket.num_reqs, c.num_speculative_tokens
        M, Z = self._sizes(bucket)
        S = c.max_num_seqs
        cleared = np.full((S,), PAD_ROW_ID, np.int32)
        w_rows = np.full((R,), PAD_ROW_ID, np.int32)
        w_ids = np.zeros((R, M), np.int32)
        w_num = np.zeros((1, R), np.int32)
        w_ow = np.zeros((R,), np.bool_)
        zb = np.full((Z,), -1, np.int32)
        zs = np.full((R * (1 + k),), -1, np.int32)
        pb = np.full((c.num_blocks if c.poison else 0,), -1, np.int32)
        ps = np.full((c.num_state_slots if c.poison else 0,), -1, np.int32)
        drafts = np.zeros((R, k), np.int32)
        sidx = np.full((R, 1 + k), NULL_BLOCK_ID, np.int32)
        U = c.max_new_requests
        new = self._no_new_requests  # unless the plan installs requests
        if plan is None:
            sched = ScheduledBatch.empty(R)
        else:
            sc = plan.scheduled
            if len(plan.block_writes) > R or len(plan.blocks_to_zero) > Z or len(plan.added) > U:
                raise RuntimeError(f"step plan exceeds the bucket's staging sizes: {bucket}")
            cleared[: len(plan.cleared_rows)] = plan.cleared_rows
            for u, (row, ids, ow) in enumerate(plan.block_writes):
                w_rows[u], w_ow[u] = row, ow
                w_ids[u, : len(ids[0])] = ids[0]
                w_num[0, u] = len(ids[0])
            zb[: len(plan.blocks_to_zero)] = plan.blocks_to_zero
            zs[: len(plan.slots_to_zero)] = plan.slots_to_zero
            if c.poison:
                pb[: len(plan.freed_blocks)] = plan.freed_blocks
                ps[: len(plan.freed_slots)] = plan.freed_slots
            if plan.added:
                new = NewRequests.from_lists(
                    [a[0] for a in plan.added], [a[1] for a in plan.added],
                    prompt_lens=[a[2] for a in plan.added], max_model_len=c.max_model_len, pad_to=U,
                )
            n = len(sc)
            idx = np.full((R,), PAD_ROW_ID, np.int32)
            q = np.zeros((R,), np.int32)
            nd = np.zeros((R,), np.int32)
            idx[:n] = [s.req.row for s in sc]
            q[:n] = [s.num_tokens for s in sc]
            if k:
                for b, s in enumerate(sc):
                    if s.drafts:
                        nd[b] = len(s.drafts)
                        drafts[b, : len(s.drafts)] = s.drafts
            if n and sc[0].req.state_slots:
                sidx[:n] = [s.req.state_slots for s in sc]
            sched = ScheduledBatch(idx_mapping=idx, num_scheduled_tokens=q, num_draft_tokens=nd)
        if self.sanitizer is not None:
            expect = self.sanitizer.expectations(self.sanitizer.mirror.after(plan))
        else:
            expect = {"tables": tuple(np.zeros((0, s.table_width), np.int32) for s in c.specs),
                      "num_blocks": np.zeros((len(c.specs), 0), np.int32),
                      "live_rows": np.zeros((0,), np.bool_), "live_slots": np.zeros((0,), np.bool_)}
        return StepInputs(
            cleared_rows=cleared, new=new, write_rows=w_rows, write_ids=(w_ids,), write_num=w_num,
            write_overwrite=w_ow, zero_blocks=zb, zero_slots=zs, poison_blocks=pb, poison_slots=ps,
            sched=sched, drafts=drafts, state_indices=sidx, expect_tables=expect["tables"],
            expect_num_blocks=expect["num_blocks"], live_rows=expect["live_rows"],
            live_slots=expect["live_slots"],
        )

    @functools.cached_property
    def _no_new_requests(self) -> NewRequests:
        """The all-padding :class:`NewRequests` of a step, built once (read-only: packing copies it)."""
        c = self.config
        return NewRequests.from_lists([], [], max_model_len=c.max_model_len, pad_to=c.max_new_requests)

    # --------------------------------------------------------- compiling

    def jitted_step(self, bucket: Bucket):
        """``(fn, args, spec)``: ``bucket``'s jitted step (state donated), example args, layout.

        ``fn.lower(*args)`` under ``jax.default_matmul_precision(config.matmul_precision)``
        is what :meth:`precompile` compiles; ``jax.export`` lowers the same ``fn`` for
        another platform (``args`` are concrete: map them to ``jax.ShapeDtypeStruct``).
        """
        buf, spec = pack(self.pack(None, bucket))
        step = functools.partial(step_fn, config=self.config, bucket=bucket, spec=spec)
        if self.layout == "packed":
            fn = functools.partial(_packed_step, step=step, params_layout=self._param_layout,
                                   rows_spec=self._rows_spec, stable_input=self.stable_input)
            args = (self._param_args, self._pstate.rows, self._pstate.caches, buf)
            self._out_specs[bucket] = spec_of(jax.eval_shape(step, self.params, self.state, buf)[1])
            fn = jax.jit(fn, donate_argnums=(1, 2), compiler_options=self.compiler_options)
            return fn, args, spec
        fn = jax.jit(step, donate_argnums=(1,), compiler_options=self.compiler_options)
        return fn, (self.params, self.state, buf), spec

    def _lower(self, bucket: Bucket):
        fn, args, spec = self.jitted_step(bucket)
        with jax.default_matmul_precision(self.config.matmul_precision):
            return fn.lower(*args), spec

    def precompile(self, *, workers: int = 1) -> tuple[int, float]:
        """Compile the step of every bucket; returns ``(executables built, seconds)``."""
        t0 = time.perf_counter()
        todo = [b for b in self.buckets.buckets if b not in self.executables]

        def build(b):
            lowered, spec = self._lower(b)
            return b, (lowered.compile(), spec)

        if workers > 1:
            with ThreadPoolExecutor(workers) as ex:
                built = list(ex.map(build, todo))
        else:
            built = [build(b) for b in todo]
        self.executables.update(built)
        self.compile_seconds += time.perf_counter() - t0
        return len(built), time.perf_counter() - t0

    # ------------------------------------------------------------ running

    def _input_buffer(self, bucket: Bucket, inputs: StepInputs) -> np.ndarray:
        """``inputs`` as ``bucket``'s executable takes them: one int32 buffer."""
        try:
            _, spec = self.executables[bucket]
        except KeyError:
            raise RuntimeError(f"bucket {bucket} was not precompiled; call precompile() first") from None
        buf, got = pack(inputs)
        if got != spec:
            raise RuntimeError(f"step inputs do not match bucket {bucket}'s layout")
        return buf

    def _dispatch(self, bucket: Bucket, inputs: StepInputs, step="dummy") -> "PendingOutput":
        return self.enqueue(bucket, self._input_buffer(bucket, inputs), step)

    def enqueue(self, bucket: Bucket, buf, step="dummy") -> "PendingOutput":
        """Call ``bucket``'s executable on a packed input (numpy or device int32 buffer, the
        layout of :meth:`pack` then :func:`~kvjax.runner.packing.pack`); returns at once.
        The outputs' device-to-host copies are queued right behind the step, so that
        :meth:`PendingOutput.fetch` finds them on the host.
        """
        exe, _ = self.executables[bucket]
        verdict = None if self.sanitizer is None else functools.partial(self.sanitizer.verdict, step)
        with self.guard.serving():
            if self.layout == "packed":
                p = self._pstate
                rows, caches, out = exe(self._param_args, p.rows, p.caches, buf)
                self._pstate = PackedState(rows=rows, caches=caches)
                out.copy_to_host_async()
                return PendingOutput(None, None, None, verdict=verdict, packed=out,
                                     packed_spec=self._out_specs[bucket])
            self.state, (sampled, num_sampled, logits, checks) = exe(self.params, self.state, buf)
        for a in (sampled, num_sampled, logits) + ((checks,) if verdict is not None else ()):
            a.copy_to_host_async()
        return PendingOutput(sampled, num_sampled, logits, checks, verdict)

    def _run(self, bucket: Bucket, inputs: StepInputs) -> StepOutput:
        return self._dispatch(bucket, inputs).fetch()

    def dispatch(self, plan: StepPlan) -> "PendingOutput":
        """Enqueue one scheduled step and return at once; ``.fetch()`` waits for its outputs.

        Checked mode (``poison``): ``.fetch()`` raises :class:`~kvjax.runner.sanitizer.SanitizerError`
        when a memory invariant failed in the step (its state update has happened).
        """
        return self.launch(self.prepare(plan))

    def prepare(self, plan: StepPlan) -> "PreparedStep":
        """The host's half of :meth:`dispatch`: pack the step (checked mode: check the plan
        against the host mirror and advance it). :meth:`launch` enqueues it."""
        inputs = self.pack(plan)
        if self.sanitizer is not None:
            mirror = self.sanitizer.mirror.after(plan)
            self.sanitizer.check_host(plan, mirror)
            self.sanitizer.mirror = mirror
        return PreparedStep(plan.bucket, self._input_buffer(plan.bucket, inputs), plan.step)

    def launch(self, prepared: "PreparedStep") -> "PendingOutput":
        """Enqueue a :meth:`prepare`-d step (the steps must be launched in the order prepared)."""
        return self.enqueue(prepared.bucket, prepared.buf, step=prepared.step)

    def execute(self, plan: StepPlan) -> StepOutput:
        """Run one scheduled step through its bucket's executable (see :meth:`dispatch`)."""
        return self.dispatch(plan).fetch()

    def dummy_step(self, bucket: Bucket | None = None) -> StepOutput:
        """An all-padding step through a real executable (idle DP rank, warm-up)."""
        bucket = bucket or self.buckets.buckets[0]
        return self._run(bucket, self.pack(None, bucket))

    @functools.cached_property
    def dense_reference(self):
        """Jitted ``tokens int32[n] -> logits [n, vocab]`` of the dense oracle (same params, fp8 rule).

        Compiles once per length ``n``: callers pad with :func:`kvjax.runner.memory.dense_reference_length`.
        """

        c = self.config
        fn = jax.jit(lambda toks: dense_forward(self.params, c.model, toks, c.kv_cache_dtype))

        def reference(tokens):
            with jax.default_matmul_precision(c.matmul_precision):
                return fn(tokens)

        return reference

    def reset(self) -> None:
        """Device state back to the initial one (checked mode: caches poisoned again and the
        sanitizer's host mirror emptied, so both sides agree that every row is free)."""
        self.state = self._initial_state()
        if self.sanitizer is not None:
            self.sanitizer.mirror = sanitizer.HostMirror(len(self.config.specs))

    def release_all(self) -> None:
        """Free every request row on the device, as a new scheduler (every row free) expects;
        in checked mode every block and slot but the null ones is poisoned."""
        c = self.config
        plan = StepPlan(step="release", bucket=self.buckets.buckets[0], scheduled=[], added=[],
                        cleared_rows=list(range(c.max_num_seqs)), block_writes=[], blocks_to_zero=[],
                        slots_to_zero=[], freed_blocks=list(range(1, c.num_blocks)),
                        freed_slots=list(range(1, c.num_state_slots)))
        self.execute(plan)

    def warm_up(self) -> None:
        """Start afresh (:meth:`release_all`), then one dummy step through every executable."""
        self.release_all()
        for b in self.buckets.buckets:
            self.dummy_step(b)
