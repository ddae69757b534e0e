"""Bucketed, ahead-of-time compiled step functions over a device mesh: kvjax's CUDA-graph replacement.

One executable per bucket (:mod:`kvjax.host.buckets`) runs a whole step on the
device: apply the step's staged writes (cleared rows, new requests, block-table
appends), zero the fresh KV blocks and recurrent slots (one ``zero_blocks``
launch per pool kind), build the padded :class:`~kvjax.state.StepBatch`, run the
model (any :class:`~kvjax.models.interface.Model`), sample on the device
(:mod:`kvjax.runner.sampling`), verify drafts, and apply ``post_update``. Runner state and pools are donated, so they
are updated in place.

The mesh is a dimension of the runner: a ``("data", "model")`` mesh, 1x1 on one
device. Every runner-state array has a leading axis of size ``D`` (the "data"
axis) sharded over "data", so data rank ``d`` owns row ``d`` of each: its own
block ids, null block 0, null slot 0 and request rows. Pools are split over
"model" where the model's :class:`~kvjax.models.interface.PoolSpec` says so, and
the model runs per shard (:meth:`~kvjax.models.interface.Model.shard`). A step
is one SPMD program (``shard_map``) in which every rank uses the same bucket; a
rank with nothing scheduled runs the dummy step (every slot ``PAD_SLOT_ID``,
block tables and state indices ``NULL_BLOCK_ID``) and must write nothing. A
model may shard params over "data" (its partitioning says so), so a step can
hold collectives every rank joins: that is why an idle rank cannot skip a step.

Arguments cross into the step executable as: the params; one donated int32
buffer per rank of request rows and block tables, then an input area and an
output area; the pools (donated). Each step's inputs (:class:`StepInputs` packed
by :func:`~kvjax.runner.packing.pack`, one int32 buffer per rank) are written
into the input area by a small staging program, and the outputs are copied out
of the output area by another, so the step reads and writes the same buffers at
every launch (on a GPU its CUDA graph runs as recorded). Three entry points:
:meth:`Runner.prepare` (host: pack), :meth:`Runner.launch` (enqueue the three
programs, returns at once), :meth:`PendingStep.fetch` (wait, copy, judge).

All executables are compiled at start-up (:meth:`Runner.precompile`); at
serving time nothing traces or compiles (:class:`~kvjax.runner.compile_guard.ServingGuard`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kvjax.constants import NULL_BLOCK_ID, PAD_ROW_ID
from kvjax.host.buckets import Bucket, BucketSpec, bucket_staging, check_size
from kvjax.host.scheduler import Scheduler, StepPlan
from kvjax.models import as_model, default_model
from kvjax.models.interface import DATA, MODEL, CacheSizes, Model, PoolSpec
from kvjax.models.step_context import make_step_context
from kvjax.runner import sanitizer
from kvjax.runner.compile_guard import ServingGuard
from kvjax.runner.mesh import check_mesh, check_mesh_layout, global_array, make_mesh
from kvjax.runner.packing import PackSpec, pack, pack_device, spec_of, unpack
from kvjax.spec import KVGroupSpec, cdiv
from kvjax.state import BlockTables, NewRequests, RequestState, ScheduledBatch, build_step_batch
from kvjax.runner.sampling import sample_and_verify
from kvjax.state.padding import gather_index, is_real_row, names_nothing, token_rows
from pallas_kernels import tpu_target, zero_blocks


@dataclasses.dataclass(frozen=True)
class RunnerConfig:
    """Sizes and options of a runner (hashable). Sizes are per data rank.

    ``model``: any :class:`~kvjax.models.interface.Model` (default and accepted configs:
    :func:`kvjax.models.default_model`, :func:`kvjax.models.as_model`).
    ``num_blocks`` counts logical KV blocks including the reserved block 0.
    ``matmul_precision`` is the ``jax.default_matmul_precision`` the step (and the
    dense reference) is traced under: "highest" keeps float32 matmuls float32 on GPUs,
    whose default (TF32) moves logits by ~3e-3.
    ``num_state_slots`` (derived) is ``1 + max_num_seqs * (1 + num_speculative_tokens)``.
    """

    model: Model = dataclasses.field(default_factory=default_model)
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
    return_logits: bool = True  # False: the step returns token ids only (StepOutput.logits is [0, vocab])

    def __post_init__(self):
        object.__setattr__(self, "model", as_model(self.model))
        if not isinstance(self.model, Model):
            raise ValueError(f"model must implement kvjax.models.interface.Model, got {type(self.model).__name__}")
        for name, minimum, why in (("block_size", 1, ""), ("num_blocks", 2, "block 0 is reserved"),
                                   ("max_model_len", 1, ""), ("max_num_seqs", 1, ""),
                                   ("max_num_batched_tokens", 1, ""), ("max_new_requests_per_step", 1, ""),
                                   ("num_speculative_tokens", 0, "")):
            object.__setattr__(self, name, check_size(name, getattr(self, name), minimum, why))
        self.cache_sizes  # validates kv_cache_dtype and kv_layout
        if self.max_num_batched_tokens < 1 + self.num_speculative_tokens:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} cannot hold one decode window "
                f"of 1 + {self.num_speculative_tokens} tokens"
            )

    @property
    def max_new_requests(self) -> int:
        """Rows staged for new requests per step: ``min(max_new_requests_per_step, max_num_seqs)``."""
        return max(1, min(self.max_new_requests_per_step, self.max_num_seqs))

    def staging(self, bucket: Bucket):
        """The staging capacity of one step in ``bucket`` under this config
        (:func:`kvjax.host.buckets.bucket_staging`)."""
        return bucket_staging(bucket, block_size=self.block_size,
                              num_speculative_tokens=self.num_speculative_tokens,
                              max_new_requests=self.max_new_requests, max_num_seqs=self.max_num_seqs)

    def make_scheduler(self, drafter=None):
        """A :class:`~kvjax.host.scheduler.Scheduler` sized for one data rank (optional custom drafter)."""

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
    def cache_sizes(self) -> CacheSizes:
        """What the model needs to lay out its pools."""
        g = self.kv_group
        return CacheSizes(
            num_kernel_blocks=self.num_blocks * g.blocks_per_kv_block, kernel_block_size=g.kernel_block_size,
            num_state_slots=self.num_state_slots, num_spec_tokens=self.num_speculative_tokens,
            kv_cache_dtype=self.kv_cache_dtype, kv_layout=self.kv_layout,
        )

    @property
    def bucket_spec(self) -> BucketSpec:
        if self.token_sizes is not None:
            return BucketSpec(tuple(self.token_sizes), self.max_num_seqs, self.num_speculative_tokens)
        return BucketSpec.default(self.max_num_batched_tokens, self.max_num_seqs, self.num_speculative_tokens)


@struct.dataclass
class DeviceState:
    """Everything one data rank's step mutates (donated): request rows, block tables, pools by name."""

    requests: RequestState
    tables: BlockTables
    pools: dict


@struct.dataclass
class StepInputs:
    """One rank's step payload from the host, fixed shapes per bucket (``-1`` pads ids/rows).

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

    def is_dummy(self, num_rows: int) -> jax.Array:
        """True iff these inputs name no row, block, slot or request (a dummy step)."""
        return names_nothing(
            rows=(self.cleared_rows, self.new.rows, self.write_rows, self.sched.idx_mapping),
            ids=(self.zero_blocks, self.zero_slots, self.poison_blocks, self.poison_slots), num_rows=num_rows)


@dataclasses.dataclass
class StepOutput:
    """One rank's step outputs on the host: batch row ``b`` sampled ``sampled[b, :num_sampled[b]]``
    (accepted drafts, then the bonus or correction token); ``logits``: one row per logits index."""

    sampled: np.ndarray  # int32 [R, 1 + k]
    num_sampled: np.ndarray  # int32 [R]
    logits: np.ndarray  # float32 [L, vocab]
    dummy: bool = False  # the device found the step's inputs all padding (StepInputs.is_dummy)


@dataclasses.dataclass
class StepResult:
    """One step on the host: its bucket and each local rank's outputs."""

    bucket: Bucket
    outputs: dict[int, StepOutput]


@dataclasses.dataclass(frozen=True)
class PreparedStep:
    """A step packed on the host, not yet enqueued (:meth:`Runner.prepare`, :meth:`Runner.launch`):
    ``buf`` is int32 ``[local ranks, n]``: ``bucket``'s layout, zero-padded to the runner's input
    area; ``labels[d]`` names rank ``d``'s step
    (the scheduler's step number, ``"dummy"`` or ``"release"``) for the sanitizer's errors."""

    bucket: Bucket
    buf: np.ndarray
    labels: Mapping[int, object]


@dataclasses.dataclass(frozen=True)
class PendingStep:
    """An enqueued step whose outputs are still on the device (JAX dispatch is asynchronous).

    ``packed``: int32 ``[D, n]`` laid out by ``spec`` per rank (:func:`step_output_spec`);
    ``checks``: int32 ``[D, c, w]``, the encoded memory checks (``c`` = 0 unless checked mode). In
    checked mode ``verdicts[d]`` raises :class:`~kvjax.runner.sanitizer.SanitizerError` on a
    violation when fetched.
    """

    bucket: Bucket
    packed: jax.Array
    spec: PackSpec
    local_ranks: tuple[int, ...]
    verdicts: Mapping[int, Callable[[np.ndarray], None]] | None = None
    checks: jax.Array | None = None

    def wait(self) -> None:
        """Block until the step has run on the device (no host copy, no verdict)."""
        jax.block_until_ready(self.packed)

    def fetch(self) -> StepResult:
        """Wait for the step and copy its outputs to the host (checked mode: then judge each rank)."""
        rows = _local_rows(self.packed)
        checks = _local_rows(self.checks) if self.verdicts is not None else None
        outputs = {}
        for d in self.local_ranks:
            sampled, num_sampled, logits, dummy = unpack(rows[d], self.spec)
            outputs[d] = StepOutput(np.asarray(sampled), np.asarray(num_sampled), np.asarray(logits), bool(dummy))
            if self.verdicts is not None:
                self.verdicts[d](checks[d])
        return StepResult(self.bucket, outputs)


def _local_rows(arr: jax.Array) -> dict[int, np.ndarray]:
    """This process's rows of a ``[D, ...]`` array sharded over "data" (one host copy per rank)."""
    if arr.is_fully_addressable:
        host = np.asarray(arr)
        return dict(enumerate(host))
    out = {}
    for shard in arr.addressable_shards:
        d = shard.index[0].start or 0
        out.setdefault(d, np.asarray(shard.data)[0])
    return out


def _sampling_params(req: RequestState, batch) -> tuple[jax.Array, ...]:
    """Per logits row: its request's ``(temperature, top_k, top_p, seed)`` and the position of the
    token it predicts (padding rows: temperature 0)."""
    L = batch.num_logits_padded
    row = token_rows(batch.cu_num_logits, L)  # batch row of each logits row, R past the real ones
    valid = batch.logits_valid & is_real_row(row, batch.num_reqs_padded)
    b = gather_index(row, batch.num_reqs_padded)
    s = gather_index(batch.idx_mapping[b], req.max_num_reqs)
    position = batch.positions[batch.logits_indices] + 1
    return (jnp.where(valid, req.temperature[s], 0.0), req.top_k[s], req.top_p[s], req.seed[s], position)


def step_fn(params, dstate: DeviceState, inp: StepInputs, *, model: Model, config: RunnerConfig,
            bucket: Bucket, pool_specs: tuple[PoolSpec, ...], expert_axis: str | None = None,
            model_axis: str | None = None, sanitize: bool | None = None,
            record_checks: Callable[[dict], None] | None = None):
    """One data rank's whole step on the device (pure; the runner donates ``dstate``).

    ``model`` is the one this shard runs (:meth:`~kvjax.models.interface.Model.shard`),
    ``pool_specs`` its pools. ``sanitize`` (default ``config.poison``): compute the checks of
    :mod:`kvjax.runner.sanitizer`, returned as the last output (``int32 [0, 1]`` when off);
    the inputs must then carry the host's expectations. ``record_checks(checks)`` is called at
    trace time with the checks before they are encoded (the sanitizer learns their layout).

    Returns ``(new DeviceState, (sampled, num_sampled, logits, dummy, checks))``; ``dummy``: the
    inputs were all padding (:meth:`StepInputs.is_dummy`).
    """
    sanitize = config.poison if sanitize is None else sanitize
    req, tables, pools = dstate.requests, dstate.tables, dict(dstate.pools)
    before = dict(_state_arrays(dstate)) if sanitize else None
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
    kv_names = [s.name for s in pool_specs if s.kind == "kv"]
    st_names = [s.name for s in pool_specs if s.kind == "state"]
    kv, states = [pools[n] for n in kv_names], [pools[n] for n in st_names]
    if config.poison:
        kv = sanitizer.poison_ids(kv, inp.poison_blocks, r)
        states = sanitizer.poison_ids(states, inp.poison_slots)
    if kv:
        kv = zero_blocks(kv, inp.zero_blocks, kernel_blocks_per_block=r, backend=config.backend)
    if states:
        states = zero_blocks(states, inp.zero_slots, backend=config.backend)
    pools.update(zip(kv_names, kv))
    pools.update(zip(st_names, states))
    if sanitize:
        g = 0  # the runner's one KV-cache group
        fresh = jnp.concatenate([
            inp.zero_blocks, sanitizer.appended_ids(inp.write_rows, inp.write_ids[g], inp.write_num[g],
                                                     tables.max_num_reqs)
        ])
        pre_checks = sanitizer.pre_forward_checks(
            req, dict(zip(kv_names, kv)), dict(zip(st_names, states)), added_rows=inp.new.rows,
            fresh_blocks=fresh, fresh_slots=inp.zero_slots, r=r)

    sched = inp.sched
    k = config.num_speculative_tokens
    if k:
        req = req.set_draft_tokens(sched.idx_mapping, inp.drafts)
    batch = build_step_batch(
        req, tables, sched,
        num_tokens_padded=bucket.num_tokens, num_logits_padded=bucket.num_logits,
        backend=config.backend, state_indices=inp.state_indices,
    )
    valid = batch.row_valid
    ctx = make_step_context(batch, max_prefill_rows=config.staging(bucket).prefill_rows)
    with jax.named_scope("model"):  # the profile (benchmarks/profile_gpu.py) splits on this scope
        logits, pools = model.apply(params, ctx, pools, backend=config.backend, sizes=config.cache_sizes,
                                    expert_axis=expert_axis, model_axis=model_axis)
    ndraft = jnp.where(valid, sched.num_draft_tokens, 0)
    sampled, num_sampled = sample_and_verify(logits, batch.cu_num_logits, inp.drafts, ndraft, k,
                                             _sampling_params(req, batch))
    # The batch's rows: a row the bucket could not hold is padding there, and here.
    req = req.post_update(batch.idx_mapping, jnp.diff(batch.query_start_loc), sampled, num_sampled)
    new = DeviceState(requests=req, tables=tables, pools=pools)
    checks = jnp.zeros((0, 1), jnp.int32)
    if sanitize:
        post = sanitizer.post_step_checks(
            req, tables, {n: pools[n] for n in kv_names}, {n: pools[n] for n in st_names},
            expect_tables=inp.expect_tables, expect_num_blocks=inp.expect_num_blocks,
            live_rows=inp.live_rows, live_slots=inp.live_slots, r=r, kv_group=0,
        )
    dummy = inp.is_dummy(req.max_num_reqs)
    if sanitize:
        idle = sanitizer.idle_rank_checks(dummy, before, dict(_state_arrays(new)))
        results = {**pre_checks, **post, **idle}
        if record_checks is not None:
            record_checks(results)
        checks = sanitizer.encode(results)
    if not config.return_logits:  # token ids only: no [L, vocab] float32 copy to the host
        logits = jnp.zeros((0, logits.shape[-1]), jnp.float32)
    return new, (sampled, num_sampled, logits.astype(jnp.float32), dummy, checks)


def step_output_spec(config: RunnerConfig, bucket: Bucket, vocab_size: int) -> PackSpec:
    """The packed layout of a step's outputs but the checks: ``(sampled int32 [R, 1 + k],
    num_sampled int32 [R], logits float32 [L, vocab_size] (0 rows without
    ``config.return_logits``), dummy bool)`` for ``bucket``'s ``R`` rows and ``L`` logits rows
    (:func:`step_fn`'s; the Runner sizes its output area by it before tracing)."""
    R, k = bucket.num_reqs, config.num_speculative_tokens
    L = bucket.num_logits if config.return_logits else 0
    S = jax.ShapeDtypeStruct
    return spec_of((S((R, 1 + k), jnp.int32), S((R,), jnp.int32), S((L, vocab_size), jnp.float32),
                    S((), jnp.bool_)))


def output_area_words(config: RunnerConfig, vocab_size: int) -> int:
    """int32 words of the output area: the largest of the buckets'
    :func:`step_output_spec` (the Runner allocates it; the memory estimate counts it)."""
    return max(step_output_spec(config, b, vocab_size).size for b in config.bucket_spec.buckets)


def _placed_on(params, mesh: Mesh) -> bool:
    """Every leaf of ``params`` is a ``jax.Array`` with a ``NamedSharding`` over ``mesh``."""
    leaves = jax.tree.leaves(params)
    return bool(leaves) and all(isinstance(a, jax.Array) and isinstance(a.sharding, NamedSharding)
                                and a.sharding.mesh == mesh for a in leaves)


def _trace_mesh(mesh: Mesh):
    """The mesh a ``shard_map`` traced now takes: inside :func:`pallas_kernels.tpu_target.lowering`
    or under an abstract mesh naming another device (lowering for a GPU from this host), the
    abstract mesh with that device, so the kernels inside pick their compiled flavour; else
    ``mesh``. Call it while tracing."""
    target = tpu_target.shard_map_mesh(mesh)
    if target is not mesh:
        return target
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    return mesh if device is None else mesh.abstract_mesh.update(abstract_device=device)


def _state_arrays(state: DeviceState):
    """``(name, array)`` of every array of a rank's state (request fields, tables, pools)."""
    for path, a in jax.tree_util.tree_leaves_with_path((state.requests, state.tables)):
        yield jax.tree_util.keystr(path), a
    for name, a in state.pools.items():
        yield name, a


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


class Runner:
    """Owns the params, the donated device state and one compiled SPMD step per bucket.

    Args:
      config: sizes (per data rank) and options; ``config.model`` is the model.
      mesh: a ``("data", "model")`` mesh (:func:`kvjax.runner.mesh.make_mesh`); None: 1x1 on
        the first device. This process drives the data ranks whose devices it can address
        (:attr:`local_ranks`: all of them in a single process).
      params: the model's params: unsharded in the model's own layout (host or device arrays;
        the runner lays them out for the "model" shards and places them), or already placed on
        ``mesh`` (every leaf a ``jax.Array`` with a ``NamedSharding`` over it, e.g.
        :func:`kvjax.models.load_pretrained` with ``mesh=``; then there is no dense reference).
        None: the model's :meth:`~kvjax.models.interface.Model.init_params` of ``config.seed``.
      strict: a trace or compile at serving time raises (else a counted warning).
      compiler_options: XLA options of the step executables (None: :func:`default_compiler_options`).
    """

    def __init__(self, config: RunnerConfig, *, mesh: Mesh | None = None, params=None, strict: bool = True,
                 compiler_options: dict | None = None):
        mesh = make_mesh(1, 1) if mesh is None else mesh
        check_mesh(mesh)
        D, M = mesh.shape[DATA], mesh.shape[MODEL]
        model = config.model
        check = getattr(model, "check_mesh", None)
        if check is not None:
            check(D, M)
        check_mesh_layout(config.kv_layout, M)
        self.config = config
        self.model = model
        self.mesh = mesh
        self.num_ranks = D
        self.model_size = M
        self.shard_model = model.shard(M)
        me = jax.process_index()
        self.local_ranks = tuple(d for d in range(D) if mesh.devices[d, 0].process_index == me)
        self.compiler_options = default_compiler_options() if compiler_options is None else compiler_options
        self.buckets = config.bucket_spec
        self.guard = ServingGuard(strict=strict)
        self.executables: dict[Bucket, tuple[jax.stages.Compiled, PackSpec]] = {}
        self._fetches: dict[int, jax.stages.Compiled] = {}
        self._output_specs: dict[Bucket, PackSpec] = {}
        self.compile_seconds = 0.0
        self.pool_specs = self.shard_model.pool_specs(config.cache_sizes)
        self._pool_pspecs = {s.name: P(DATA, *s.axes) for s in self.pool_specs}

        params = model.init_params(config.seed) if params is None else params
        if _placed_on(params, mesh):  # e.g. load_pretrained(mesh=...): laid out and sharded already
            self.dense_params = None
            self.params = params
            self.param_specs = jax.tree.map(lambda a: a.sharding.spec, params)
        else:
            self.dense_params = params
            host = model.layout_for_shards(params, M) if M > 1 else params
            self.param_specs = model.param_partitioning(host)
            self.params = jax.tree.map(lambda a, s: self._place(a, s), host, self.param_specs)

        self.sanitizers = None
        if config.poison:
            self.sanitizers = {d: sanitizer.Sanitizer(config.specs, config.max_num_seqs, config.num_state_slots)
                               for d in self.local_ranks}
        self._rows_spec = spec_of(self._initial_rows())  # one rank's (RequestState, BlockTables)
        self._input_words = max(pack(self.pack(None, b))[1].size for b in self.buckets.buckets)
        self._output_words = output_area_words(config, self.model.vocab_size)
        self._rows, self._pools = self._initial_state()

    # ------------------------------------------------------------ state

    def _place(self, a, spec: P) -> jax.Array:
        sharding = NamedSharding(self.mesh, spec)
        if jax.process_count() == 1:
            return jax.device_put(a, sharding)
        a = np.asarray(a)
        return global_array(sharding, a.shape, a)

    def _split_rows(self, tree) -> tuple:
        """The non-empty arrays of a ``(RequestState, BlockTables)`` tree (``rows[0]``). A
        zero-size field (``draft_tokens [R, 0]`` without speculation) is no program parameter: a
        zero-size donated, data-sharded parameter crashed XLA's GPU compiler on 2 GPUs."""
        return tuple(a for a, s in zip(jax.tree.leaves(tree), self._rows_spec.shapes) if math.prod(s))

    def _join_rows(self, arrays, xp=jnp):
        """``(RequestState, BlockTables)`` of one rank from :meth:`_split_rows`'s arrays (the
        zero-size leaves made anew with ``xp.zeros``)."""
        it = iter(arrays)
        spec = self._rows_spec
        leaves = [next(it) if math.prod(s) else xp.zeros(s, d) for s, d in zip(spec.shapes, spec.dtypes)]
        return jax.tree.unflatten(spec.treedef, leaves)

    def _initial_rows(self):
        c = self.config
        return jax.device_get((RequestState.create(c.max_num_seqs, c.max_model_len, c.num_speculative_tokens),
                               BlockTables.create(c.specs, c.max_num_seqs, num_cache_blocks=c.num_blocks)))

    def _global_pool_shape(self, spec: PoolSpec) -> tuple[int, ...]:
        return (self.num_ranks,) + tuple(n * self.model_size if ax == MODEL else n
                                         for n, ax in zip(spec.shape, spec.axes))

    def output_spec(self, bucket: Bucket) -> PackSpec:
        """:func:`step_output_spec` of ``bucket`` for this runner."""
        if bucket not in self._output_specs:
            self._output_specs[bucket] = step_output_spec(self.config, bucket, self.model.vocab_size)
        return self._output_specs[bucket]

    def _initial_state(self):
        """``(rows, pools)``: ``rows = (arrays, inputs, outputs)``, every rank's request rows and
        block tables (:meth:`_split_rows`: each non-empty field an array ``[D, ...]`` of its own,
        so that a step updates the rows it names in place), its int32 step-input area ``[D, I]``
        and step-output area ``[D, O + 1]`` (+ 1: the largest output is still an update of the
        buffer, in place); the pools, zeroed (checked mode: poisoned). All sharded on the devices
        over "data"."""
        data = NamedSharding(self.mesh, P(DATA))

        def per_rank(a):
            a = np.asarray(a)
            a = np.broadcast_to(a[None], (self.num_ranks,) + a.shape)
            return global_array(data, a.shape, a)

        arrays = tuple(per_rank(a) for a in self._split_rows(self._initial_rows()))
        inputs = per_rank(np.zeros((self._input_words,), np.int32))
        outputs = per_rank(np.zeros((self._output_words + 1,), np.int32))
        rows = (arrays, inputs, outputs)
        shapes = {s.name: (self._global_pool_shape(s), jnp.dtype(s.dtype)) for s in self.pool_specs}
        poison = self.config.poison

        def make_bits():  # every block and slot starts as garbage in checked mode: only zeroed memory may be read
            return {name: jnp.full(shape, sanitizer.poison_bits(dtype) if poison else 0, sanitizer.uint_of(dtype))
                    for name, (shape, dtype) in shapes.items()}

        def as_floats(bits):
            return {name: jax.lax.bitcast_convert_type(b, shapes[name][1]) for name, b in bits.items()}

        # Made as unsigned ints, then bitcast in a second program whose input is not a constant:
        # folded into one, XLA:CPU turns the bf16 poison into the canonical NaN (other bits).
        out = {name: NamedSharding(self.mesh, p) for name, p in self._pool_pspecs.items()}
        bits = jax.jit(make_bits, out_shardings=out)()
        return rows, jax.jit(as_floats, out_shardings=out, donate_argnums=0)(bits)

    def read_state(self, rank: int = 0) -> DeviceState:
        """A host (numpy) copy of data rank ``rank``'s state (every head shard's pools joined)."""
        self._check_rank(rank)
        req, tables = self._join_rows([_local_rows(a)[rank] for a in self._rows[0]], xp=np)
        pools = {name: _local_rows(a)[rank] for name, a in self._pools.items()}
        return DeviceState(requests=req, tables=tables, pools=pools)

    def write_state(self, state: DeviceState, rank: int | None = None) -> None:
        """Replace data rank ``rank``'s state (None: every rank's) with ``state`` (host or device
        arrays, shaped as :meth:`read_state` returns them). For tests and notebooks."""
        ranks = range(self.num_ranks) if rank is None else [self._check_rank(rank)]
        host = jax.device_get((state.requests, state.tables))
        if spec_of(host) != self._rows_spec:
            raise ValueError("state's request rows / block tables do not match this runner's layout")
        if set(state.pools) != set(self._pools):
            raise ValueError(f"state's pools {sorted(state.pools)} are not this runner's {sorted(self._pools)}")

        def put(a, value):
            a_host = np.array(jax.device_get(a))
            for d in ranks:
                a_host[d] = np.asarray(value)
            return global_array(a.sharding, a_host.shape, a_host)

        self._rows = (tuple(map(put, self._rows[0], self._split_rows(host))), *self._rows[1:])
        self._pools = {n: put(a, state.pools[n]) for n, a in self._pools.items()}

    def _check_rank(self, rank: int) -> int:
        if rank not in self.local_ranks:
            raise ValueError(f"rank must be one of this process's data ranks {list(self.local_ranks)}, got {rank!r}")
        return rank

    @property
    def sanitizer(self) -> sanitizer.Sanitizer | None:
        """Rank 0's sanitizer (checked mode), the one a single-device runner has."""
        return None if self.sanitizers is None else self.sanitizers[self.local_ranks[0]]

    # ------------------------------------------------------------ packing

    def pack(self, plan: StepPlan | None, bucket: Bucket | None = None, rank: int | None = None) -> StepInputs:
        """One rank's fixed-shape numpy payload (``plan=None``: an all-padding dummy step) in
        ``bucket`` (default: the plan's). Checked mode: advances nothing; the expectations come
        from rank ``rank``'s sanitizer mirror after ``plan``."""
        c = self.config
        bucket = plan.bucket if bucket is None else bucket
        R, k = bucket.num_reqs, c.num_speculative_tokens
        st = c.staging(bucket)
        M, Z, U = st.ids_per_write, st.zero_blocks, st.new_requests
        cleared = np.full((st.cleared_rows,), PAD_ROW_ID, np.int32)
        w_rows = np.full((st.block_writes,), PAD_ROW_ID, np.int32)
        w_ids = np.zeros((st.block_writes, M), np.int32)
        w_num = np.zeros((1, st.block_writes), np.int32)
        w_ow = np.zeros((st.block_writes,), np.bool_)
        zb = np.full((Z,), -1, np.int32)
        zs = np.full((st.zero_slots,), -1, np.int32)
        pb = np.full((c.num_blocks if c.poison else 0,), -1, np.int32)
        ps = np.full((c.num_state_slots if c.poison else 0,), -1, np.int32)
        drafts = np.zeros((R, k), np.int32)
        sidx = np.full((R, 1 + k), NULL_BLOCK_ID, np.int32)
        new = self._no_new_requests  # unless the plan installs requests
        if plan is None:
            sched = ScheduledBatch.empty(R)
        else:
            if not bucket.holds(plan.bucket):
                raise ValueError(f"the plan needs bucket {plan.bucket}, which the step's {bucket} does not hold")
            sc = plan.scheduled
            need = plan.staging_need()
            if need.prefill_rows > st.prefill_rows:  # the model's prefill path is compiled for st's
                prefilling = [s.req.req_id for s in sc if not s.req.is_decoding]
                kind = "decode-only (compiled without the prefill path)" if bucket.decode_only else "mixed"
                raise ValueError(f"step {plan.step}: bucket {bucket} is {kind}, for {st.prefill_rows} "
                                 f"prefilling rows, but request(s) {prefilling} are prefilling")
            excess = st.excess(need)
            if excess:  # the scheduler never plans this (tests/host): a bug upstream, said plainly
                raise RuntimeError(f"step {plan.step}'s plan exceeds bucket {bucket}'s staging: {excess}")
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
                by_row = {s.req.row: s.req for s in sc}
                reqs = [by_row[a[0]] for a in plan.added]
                new = NewRequests.from_lists(
                    [a[0] for a in plan.added], [a[1] for a in plan.added],
                    prompt_lens=[a[2] for a in plan.added], max_model_len=c.max_model_len, pad_to=U,
                    temperature=[r.temperature for r in reqs], top_k=[r.top_k for r in reqs],
                    top_p=[r.top_p for r in reqs], seed=[r.seed for r in reqs],
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
        if self.sanitizers is not None:
            san = self.sanitizers[self.local_ranks[0] if rank is None else rank]
            expect = san.expectations(san.mirror.after(plan))
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

    def _record_check_layout(self, checks: dict) -> None:
        """The sanitizers learn the rows a step's encoded checks hold (at trace time)."""
        for s in (self.sanitizers or {}).values():
            s.set_layout(checks)

    def jitted_step(self, bucket: Bucket):
        """``(fn, args, spec)``: ``bucket``'s jitted SPMD step (rows and pools donated), its
        arguments, and one rank's input layout.

        ``fn(params, rows, pools) -> (rows, pools, checks)``: each rank's :class:`StepInputs` are
        read from its input area (``rows[1]``, written there by :meth:`_stage`), its outputs but
        the checks are written to its output area (``rows[2]``) (laid out by :meth:`output_spec`,
        read back by :meth:`_fetch`); ``checks`` int32 ``[D, c, w]``. Every buffer the step
        reads or writes is then a donated one or the params: the same addresses at every step,
        so on a GPU its CUDA graph need not be updated between launches (a new input or output
        address made XLA update the whole graph at each launch: ``benchmarks/probe_launch.py``).
        ``fn.lower(*args)`` under ``jax.default_matmul_precision(config.matmul_precision)`` is
        what :meth:`precompile` compiles; ``jax.export`` lowers the same ``fn`` for another
        platform.
        """
        _, in_spec = pack(self.pack(None, bucket))
        m = in_spec.size
        out_spec = self.output_spec(bucket)
        D, M = self.num_ranks, self.model_size
        step = functools.partial(
            step_fn, model=self.shard_model, config=self.config, bucket=bucket, pool_specs=self.pool_specs,
            expert_axis=DATA if D > 1 else None, model_axis=MODEL if M > 1 else None,
            record_checks=self._record_check_layout)

        def per_rank(params, rows, pools):
            arrays, inputs, outputs = jax.tree.map(lambda a: a[0], rows)
            req, tables = self._join_rows(arrays)
            inp = unpack(inputs[:m], in_spec)
            new, out = step(params, DeviceState(req, tables, {k: v[0] for k, v in pools.items()}), inp)
            *main, checks = out
            if spec_of(tuple(main)) != out_spec:
                raise AssertionError(f"bucket {bucket}: the step's outputs {spec_of(tuple(main))} differ from "
                                     f"step_output_spec's {out_spec}, which sized the output area")
            outputs = jax.lax.dynamic_update_slice(outputs, pack_device(tuple(main)), (0,))
            rows = jax.tree.map(lambda a: a[None], (self._split_rows((new.requests, new.tables)), inputs, outputs))
            return rows, {k: v[None] for k, v in new.pools.items()}, checks[None]

        def sm(params, rows, pools):
            # check_vma=False: the kernels' scans start from unsharded (invariant) carries; the
            # replication of outputs over "model" is proved by the parity tests instead. The mesh
            # is picked at trace time: inside tpu_target.lowering, one whose device is the target.
            return jax.shard_map(per_rank, mesh=_trace_mesh(self.mesh),
                                 in_specs=(self.param_specs, P(DATA), self._pool_pspecs),
                                 out_specs=(P(DATA), self._pool_pspecs, P(DATA)),
                                 check_vma=False)(params, rows, pools)

        named = lambda p: NamedSharding(self.mesh, p)  # noqa: E731
        fn = jax.jit(sm, donate_argnums=(1, 2), compiler_options=self.compiler_options,
                     out_shardings=(named(P(DATA)), {k: named(p) for k, p in self._pool_pspecs.items()},
                                    named(P(DATA))))
        return fn, (self.params, self._rows, self._pools), in_spec

    @functools.cached_property
    def _transfer_sharding(self) -> NamedSharding:
        """Where each step's inputs are staged from and its outputs fetched to: pinned host
        memory on a GPU, else the devices' own. In device memory these small per-step buffers are
        allocated between two steps, beside the step's temporaries, which then move, and XLA
        updates the step's whole CUDA graph at a launch whose buffers moved (BENCHMARKS.md, issue
        24); in host memory they take no device allocation."""
        device = NamedSharding(self.mesh, P(DATA))
        if jax.default_backend() != "gpu":
            return device
        kinds = {m.kind for d in self.mesh.devices.flat for m in d.addressable_memories()}
        return device.with_memory_kind("pinned_host") if "pinned_host" in kinds else device

    @functools.cached_property
    def _stage(self) -> jax.stages.Compiled:
        """``(rows, inputs) -> rows`` (rows donated): each rank's step inputs, int32 ``[D, I]``
        (in :attr:`_transfer_sharding`'s memory), written into its input area (the only program
        that reads a fresh buffer; the other buffers pass through, aliased)."""
        named = NamedSharding(self.mesh, P(DATA))

        def stage(rows, buf):
            arrays, inputs, outputs = rows
            return arrays, jax.lax.dynamic_update_slice(inputs, jax.device_put(buf, named), (0, 0)), outputs

        fn = jax.jit(stage, donate_argnums=0, out_shardings=named)
        arg = jax.ShapeDtypeStruct((self.num_ranks, self._input_words), jnp.int32,
                                   sharding=self._transfer_sharding)
        return fn.lower(self._rows, arg).compile()

    def _fetch(self, words: int) -> jax.stages.Compiled:
        """``rows -> int32 [D, words]``: a copy of the first ``words`` of each rank's output area,
        in :attr:`_transfer_sharding`'s memory (compiled once per size)."""
        if words not in self._fetches:
            fn = jax.jit(lambda rows: rows[2][:, :words], out_shardings=self._transfer_sharding)
            self._fetches[words] = fn.lower(self._rows).compile()
        return self._fetches[words]

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
            self._fetch(self.output_spec(b).size)
            return b, (lowered.compile(), spec)

        self._stage  # noqa: B018 - compiled here, not at the first launch
        if workers > 1:
            with ThreadPoolExecutor(workers) as ex:
                built = list(ex.map(build, todo))
        else:
            built = [build(b) for b in todo]
        self.executables.update(built)
        self.compile_seconds += time.perf_counter() - t0
        return len(built), time.perf_counter() - t0

    # ------------------------------------------------------------ running

    def agree(self, values: Mapping[int, tuple[int, ...]]) -> np.ndarray:
        """Every rank's small ints (this process's ranks given): int32 ``[D, n]``, the same in
        every process. In one process this is a host operation; over several processes a
        tiny SPMD all-gather (as vLLM all-reduces the DP token counts)."""
        missing = set(self.local_ranks) - set(values)
        if missing:
            raise ValueError(f"no value given for local rank(s) {sorted(missing)}")
        local = np.stack([np.asarray(values[d], np.int32) for d in self.local_ranks])
        if len(self.local_ranks) == self.num_ranks:
            return local
        exe = self._agree_exe(local.shape[1:])
        arr = jax.make_array_from_process_local_data(NamedSharding(self.mesh, P(DATA)), local,
                                                     (self.num_ranks,) + local.shape[1:])
        with self.guard.serving():
            return np.asarray(exe(arr).addressable_data(0))

    @functools.cache
    def _agree_exe(self, shape):
        arg = jax.ShapeDtypeStruct((self.num_ranks,) + tuple(shape), jnp.int32,
                                   sharding=NamedSharding(self.mesh, P(DATA)))
        return jax.jit(lambda x: x, out_shardings=NamedSharding(self.mesh, P())).lower(arg).compile()

    def prepare(self, plans: StepPlan | Mapping[int, StepPlan | None] | None,
                bucket: Bucket | None = None) -> PreparedStep:
        """Pack one step on the host. ``plans``: one plan per local rank (``None``: that rank runs
        the dummy step; a rank left out runs it too), or a single plan for the first local rank.
        ``bucket``: the step's (default: the largest any plan needs). Checked mode: each plan is
        checked against its rank's host mirror, which then advances."""
        if plans is None or isinstance(plans, StepPlan):
            plans = {self.local_ranks[0]: plans}
        unknown = set(plans) - set(self.local_ranks)
        if unknown:
            raise ValueError(f"plans name rank(s) {sorted(unknown)}, not among this process's {list(self.local_ranks)}")
        if bucket is None:
            needed = [p.bucket for p in plans.values() if p is not None]
            bucket = self.buckets.join(needed) if needed else self.buckets.buckets[0]
        if bucket not in self.executables:
            raise RuntimeError(f"bucket {bucket} was not precompiled; call precompile() first")
        bufs, labels = [], {}
        for d in self.local_ranks:
            plan = plans.get(d)
            inputs = self.pack(plan, bucket, rank=d)
            if self.sanitizers is not None and plan is not None:
                san = self.sanitizers[d]
                mirror = san.mirror.after(plan)
                san.check_host(plan, mirror)
                san.mirror = mirror
            bufs.append(pack(inputs)[0])
            labels[d] = "dummy" if plan is None else plan.step
        buf = np.zeros((len(bufs), self._input_words), np.int32)
        for i, b in enumerate(bufs):
            buf[i, : b.size] = b
        return PreparedStep(bucket, buf, labels)

    def launch(self, prepared: PreparedStep) -> PendingStep:
        """Enqueue a :meth:`prepare`-d step and return at once (steps must be launched in the
        order prepared). The outputs' device-to-host copies are queued right behind the step."""
        if prepared.buf.shape[1] != self._input_words:
            raise RuntimeError(f"step inputs of {prepared.buf.shape[1]} words; this runner's input area holds "
                               f"{self._input_words}")
        out, checks = self._enqueue(prepared.bucket, self.put_inputs(prepared))
        out.copy_to_host_async()
        verdicts = None
        if self.sanitizers is not None:
            checks.copy_to_host_async()
            verdicts = {d: functools.partial(self.sanitizers[d].verdict, prepared.labels[d], rank=d)
                        for d in self.local_ranks}
        return PendingStep(prepared.bucket, out, self.output_spec(prepared.bucket), self.local_ranks, verdicts,
                           checks)

    def put_inputs(self, prepared: PreparedStep) -> jax.Array:
        """A :meth:`prepare`-d step's packed inputs as the int32 ``[D, I]`` array the staging
        program reads (pinned host memory on a GPU: :attr:`_transfer_sharding`)."""
        sharding = self._transfer_sharding
        if len(self.local_ranks) == self.num_ranks:
            return jax.device_put(prepared.buf, sharding)
        return jax.make_array_from_process_local_data(sharding, prepared.buf,
                                                      (self.num_ranks, prepared.buf.shape[1]))

    def _enqueue(self, bucket: Bucket, buf: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Stage ``buf`` (:meth:`put_inputs`'s array), run ``bucket``'s step and copy its outputs
        out of the output area: ``(packed outputs [D, n], checks [D, c, w])``, both possibly not
        yet computed; the outputs in :attr:`_transfer_sharding`'s memory, the checks on the
        devices."""
        exe, _ = self.executables[bucket]
        stage, fetch = self._stage, self._fetch(self.output_spec(bucket).size)
        with self.guard.serving():
            self._rows = stage(self._rows, buf)
            self._rows, self._pools, checks = exe(self.params, self._rows, self._pools)
            return fetch(self._rows), checks

    def step(self, plans: StepPlan | Mapping[int, StepPlan | None] | None, bucket: Bucket | None = None) -> StepResult:
        """:meth:`prepare`, :meth:`launch` and fetch one step."""
        return self.launch(self.prepare(plans, bucket)).fetch()

    def execute(self, plan: StepPlan) -> StepOutput:
        """Run one scheduled step on the first local rank (every other rank runs the dummy step);
        returns that rank's outputs. Checked mode: raises
        :class:`~kvjax.runner.sanitizer.SanitizerError` when a memory invariant failed in the step
        (its state update has happened)."""
        return self.step(plan).outputs[self.local_ranks[0]]

    def dummy_step(self, bucket: Bucket | None = None) -> StepResult:
        """An all-padding step on every rank through a real executable (idle ranks, warm-up)."""
        return self.step(None, bucket or self.buckets.buckets[0])

    @functools.cached_property
    def dense_device_params(self):
        """The unsharded params (:attr:`dense_params`) on the default device, placed once: the dense
        reference and the parity check's variants (``kvjax.testing``) all read this one copy. None
        where the runner was given params already placed on its mesh."""
        return None if self.dense_params is None else jax.device_put(self.dense_params)

    @functools.cached_property
    def dense_reference(self):
        """Jitted ``tokens int32[n] -> logits [n, vocab]``: the model's dense oracle on the unsharded
        params (same fp8 rule). Compiles once per length ``n``: callers pad with
        :func:`kvjax.runner.memory.dense_reference_length`."""
        c = self.config
        params = self.dense_device_params
        if params is None:
            raise ValueError("the dense reference needs unsharded params: this runner was given params "
                             "already placed on its mesh (load them with mesh=None to check parity)")
        # params are an argument, not closed over: closed-over host arrays would be embedded in
        # every compiled length's program as constants (the whole model, at real size)
        fn = jax.jit(lambda p, toks: self.model.dense_logits(p, toks, kv_cache_dtype=c.kv_cache_dtype))

        def reference(tokens):
            with jax.default_matmul_precision(c.matmul_precision):
                return fn(params, tokens)

        return reference

    def reset(self) -> None:
        """Device state back to the initial one (checked mode: pools poisoned again and the
        sanitizers' host mirrors emptied, so both sides agree that every row is free)."""
        self._rows, self._pools = self._initial_state()
        if self.sanitizers is not None:
            for s in self.sanitizers.values():
                s.mirror = sanitizer.HostMirror(len(self.config.specs))

    def release_all(self) -> None:
        """Free every request row of every rank, as new schedulers (every row free) expect;
        in checked mode every block and slot but the null ones is poisoned."""
        c = self.config
        plan = StepPlan(step="release", bucket=self.buckets.buckets[0], scheduled=[], added=[],
                        cleared_rows=list(range(c.max_num_seqs)), block_writes=[], blocks_to_zero=[],
                        slots_to_zero=[], freed_blocks=list(range(1, c.num_blocks)),
                        freed_slots=list(range(1, c.num_state_slots)))
        self.step({d: plan for d in self.local_ranks})

    def warm_up(self) -> None:
        """Start afresh (:meth:`release_all`), then one dummy step through every executable."""
        self.release_all()
        for b in self.buckets.buckets:
            self.dummy_step(b)
