"""Serving over a ``jax.sharding.Mesh`` with axes ``("data", "model")``.

Data parallelism: every runner-state array (request rows, block tables, KV
caches, recurrent-state pools) gets a leading axis of size ``D`` (the "data"
axis size) sharded over "data", so rank ``d`` owns row ``d`` of each: its own
block ids, null block 0, null slot 0 and request rows, with the same shapes and
rules as a single-device runner. Each rank has its own host scheduler and block
pool; the host packs one :class:`~kvjax.runner.runner.StepInputs` per rank.

One step is one SPMD program: :func:`~kvjax.runner.runner.step_fn` runs per
rank under ``shard_map`` and every rank uses the same bucket, the largest any
rank needs (:meth:`MeshRunner.agree` is the host-side agreement, a tiny SPMD
all-gather, as vLLM all-reduces the DP token counts). A rank with nothing
scheduled runs the dummy step in the same program (every slot ``PAD_SLOT_ID``,
block tables and state indices ``NULL_BLOCK_ID``) and must write nothing. The
model's MoE experts are sharded over "data", so every step holds collectives
that every rank has to join: that is why an idle rank cannot skip a step.

Tensor parallelism: attention KV heads (with their query heads) and Mamba heads
are split over "model". Inside ``shard_map`` each shard runs the model with
:func:`tp_shard_config` (its heads) on its column shards of ``wq/wk/wv`` and of
the Mamba ``in_proj`` (``[z | x | B | C | dt]`` of its heads, see
:func:`tp_param_layout`), and row shards of ``wo`` / ``out_proj`` whose outputs
are summed over "model" (as is the gated norm's mean square). KV caches and SSM
states are split on their heads axis, conv states on their channels (laid out
per shard: ``[x | B | C]``). The kernels run per shard unchanged.

With ``check`` on (the default when the config poisons), each step also
returns per rank, computed on the device: the null block of every KV cache and
the null slot of every state pool are bitwise unchanged, and an idle rank's
whole state is bitwise unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kvjax.constants import NULL_BLOCK_ID
from kvjax.host.buckets import Bucket
from kvjax.host.scheduler import StepPlan
from kvjax.models import TinyHybridConfig, dense_forward
from kvjax.runner.packing import PackSpec, pack, unpack
from kvjax.runner.runner import DeviceState, Runner, RunnerConfig, StepInputs, StepOutput, step_fn
from pallas_kernels import tpu_target

DATA, MODEL = "data", "model"
MESH_AXES = (DATA, MODEL)
_EXPERT_PARAMS = ("w_gate", "w_up", "w_down")
# Per-rank check flags returned by a checked step, in this order.
CHECK_FLAGS = ("null_unchanged", "idle", "idle_untouched")


def parse_mesh_shape(text: str) -> tuple[int, int]:
    """``"data=D,model=M"`` (either part optional, default 1) -> ``(D, M)``."""
    sizes = {DATA: 1, MODEL: 1}
    for part in filter(None, (p.strip() for p in str(text).split(","))):
        name, sep, value = part.partition("=")
        if not sep or name.strip() not in sizes:
            raise ValueError(f"mesh must look like 'data=D,model=M', got {text!r}")
        try:
            n = int(value)
        except ValueError:
            raise ValueError(f"mesh axis {name.strip()!r} needs a positive int, got {value!r}") from None
        if n <= 0:
            raise ValueError(f"mesh axis {name.strip()!r} needs a positive int, got {n}")
        sizes[name.strip()] = n
    return sizes[DATA], sizes[MODEL]


def force_host_device_count(n: int) -> bool:
    """Ask XLA:CPU for ``n`` host devices (``--xla_force_host_platform_device_count``).

    Only effective before JAX initialises its backends; returns whether it changed
    ``XLA_FLAGS``. An existing device-count flag is replaced.
    """
    flag = "--xla_force_host_platform_device_count"
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(flag)]
    new = " ".join(kept + [f"{flag}={n}"])
    changed = os.environ.get("XLA_FLAGS") != new
    os.environ["XLA_FLAGS"] = new
    return changed


def make_mesh(data: int, model: int = 1, devices=None) -> Mesh:
    """A ``(data, model)`` mesh over the first ``data * model`` devices (all processes')."""
    devices = list(jax.devices() if devices is None else devices)
    n = data * model
    if n > len(devices):
        raise ValueError(f"mesh data={data},model={model} needs {n} devices, {len(devices)} exist")
    return Mesh(np.array(devices[:n], dtype=object).reshape(data, model), MESH_AXES)


def _check_mesh(mesh: Mesh) -> None:
    if not isinstance(mesh, Mesh) or tuple(mesh.axis_names) != MESH_AXES:
        got = getattr(mesh, "axis_names", type(mesh).__name__)
        raise ValueError(f"mesh must be a jax.sharding.Mesh with axes {MESH_AXES}, got {got}")


# PartitionSpecs of each layer kind's params (absent: replicated).
_LAYER_PARAM_SPECS = {
    "attn": {"wq": P(None, MODEL), "wk": P(None, MODEL), "wv": P(None, MODEL), "wo": P(MODEL, None)},
    "mamba": {"in_proj": P(None, MODEL), "conv_weight": P(MODEL, None), "conv_bias": P(MODEL),
              "dt_bias": P(MODEL), "A_log": P(MODEL), "D": P(MODEL), "gate_norm": P(MODEL),
              "out_proj": P(MODEL, None)},
    "moe": {name: P(DATA) for name in _EXPERT_PARAMS},
}


def tp_shard_config(model: TinyHybridConfig, M: int) -> TinyHybridConfig:
    """One "model" shard's view of ``model``: ``1/M`` of the query, KV and Mamba heads."""
    if M == 1:
        return model
    if model.num_kv_heads % M or model.mamba_num_heads % M:
        raise ValueError(
            f"model={M} must divide num_kv_heads={model.num_kv_heads} and "
            f"mamba_num_heads={model.mamba_num_heads} (heads are sharded over 'model')"
        )
    if model.num_mamba_layers and model.mamba_n_groups != 1:
        raise ValueError(f"tensor parallelism needs mamba_n_groups == 1, got {model.mamba_n_groups}")
    return dataclasses.replace(model, num_heads=model.num_heads // M, num_kv_heads=model.num_kv_heads // M,
                               mamba_num_heads=model.mamba_num_heads // M)


def tp_param_layout(params, model: TinyHybridConfig, M: int):
    """Host (numpy) params with each Mamba ``in_proj`` / ``conv_weight`` / ``conv_bias`` reordered
    so that a contiguous ``1/M`` slice is one "model" shard's (B and C repeated in every shard)."""
    if M == 1:
        return params
    di, H, bc = model.d_inner, model.mamba_num_heads, 2 * model.mamba_n_groups * model.mamba_d_state
    dl, Hl = di // M, H // M
    out = jax.tree.map(lambda a: a, params)  # new containers, same leaves
    for i, kind in enumerate(model.layer_types):
        if kind != "mamba":
            continue
        lp = dict(out["params"][f"layer_{i}"])
        ip = lp["in_proj"]
        z, x, b_c, dt = ip[:, :di], ip[:, di:2 * di], ip[:, 2 * di:2 * di + bc], ip[:, 2 * di + bc:]
        lp["in_proj"] = np.concatenate([np.concatenate(
            [z[:, m * dl:(m + 1) * dl], x[:, m * dl:(m + 1) * dl], b_c, dt[:, m * Hl:(m + 1) * Hl]], 1)
            for m in range(M)], 1)
        for name in ("conv_weight", "conv_bias"):
            w = lp[name]
            lp[name] = np.concatenate([np.concatenate([w[m * dl:(m + 1) * dl], w[di:]], 0) for m in range(M)], 0)
        out["params"][f"layer_{i}"] = lp
    return out


def param_specs(params, model: TinyHybridConfig):
    """PartitionSpecs of the params (:data:`_LAYER_PARAM_SPECS`; embedding, head, norms replicated)."""

    def spec(path, leaf):
        keys = [getattr(k, "key", None) for k in path]
        layer = next((k for k in keys if isinstance(k, str) and k.startswith("layer_")), None)
        if layer is None:
            return P()
        kind = model.layer_types[int(layer.split("_")[1])]
        return _LAYER_PARAM_SPECS[kind].get(keys[-1], P())

    return jax.tree_util.tree_map_with_path(spec, params)


def state_specs(state: DeviceState):
    """PartitionSpecs of the runner state ``[D, ...]``: "data" on the leading axis; KV caches
    split over "model" on their heads axis, Mamba states on their channel / head axis."""
    specs = jax.tree.map(lambda _: P(DATA), state)
    caches = specs.caches.replace(
        key=tuple(P(DATA, None, None, MODEL) for _ in state.caches.key),
        value=tuple(P(DATA, None, None, MODEL) for _ in state.caches.value),
        conv_state=tuple(P(DATA, None, MODEL) for _ in state.caches.conv_state),
        ssm_state=tuple(P(DATA, None, MODEL) for _ in state.caches.ssm_state),
    )
    return specs.replace(caches=caches)


def _tile_model_axis(a: np.ndarray, spec: P, M: int) -> np.ndarray:
    """One shard's uniform initial array -> the whole ``[...]`` array (``spec`` without the data axis)."""
    axes = [i for i, name in enumerate(tuple(spec)[1:]) if name == MODEL]
    return np.concatenate([a] * M, axis=axes[0]) if axes and M > 1 else a


def _bits(a: jax.Array) -> jax.Array:
    """``a`` as unsigned ints of its width (bitwise comparison; NaN-safe)."""
    if jnp.issubdtype(a.dtype, jnp.floating):
        return jax.lax.bitcast_convert_type(a, jnp.dtype(f"uint{8 * a.dtype.itemsize}"))
    return a


def _same(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.all(_bits(a) == _bits(b))


def _is_idle(inp: StepInputs) -> jax.Array:
    """True iff the rank's inputs are a dummy step (no row, block, slot or request named)."""
    ids = (inp.cleared_rows, inp.new.rows, inp.write_rows, inp.zero_blocks, inp.zero_slots,
           inp.poison_blocks, inp.poison_slots, inp.sched.idx_mapping)
    return jnp.all(jnp.stack([jnp.all(a < 0) for a in ids]))


def _check_flags(before: DeviceState, after: DeviceState, inp: StepInputs, blocks_per_kv_block: int):
    """int32 ``[3]`` (:data:`CHECK_FLAGS`) of one rank's step."""
    r = blocks_per_kv_block
    null = [_same(a[: r * (NULL_BLOCK_ID + 1)], b[: r * (NULL_BLOCK_ID + 1)])
            for a, b in zip(before.caches.kv_arrays, after.caches.kv_arrays)]
    null += [_same(a[NULL_BLOCK_ID], b[NULL_BLOCK_ID])
             for a, b in zip(before.caches.state_arrays, after.caches.state_arrays)]
    null_ok = jnp.all(jnp.stack(null)) if null else jnp.bool_(True)
    idle = _is_idle(inp)
    untouched = jnp.all(jnp.stack([_same(a, b) for a, b in
                                   zip(jax.tree.leaves(before), jax.tree.leaves(after))]))
    return jnp.stack([null_ok, idle, ~idle | untouched]).astype(jnp.int32)


def _rank_step(params, dstate, packed, *, config: RunnerConfig, bucket: Bucket, spec: PackSpec,
               check: bool):
    """One (data rank, head shard)'s step inside ``shard_map``: drop the leading axis, run ``step_fn``
    (``config.model`` is one shard's, :func:`tp_shard_config`), add the axis back."""
    local = jax.tree.map(lambda a: a[0], dstate)
    buf = packed[0]
    new, (sampled, num_sampled, logits, _) = step_fn(  # per-rank flags below, not the sanitizer
        params, local, buf, config=config, bucket=bucket, spec=spec, expert_axis=DATA, model_axis=MODEL,
        sanitize=False,
    )
    if check:
        flags = _check_flags(local, new, unpack(buf, spec), config.kv_group.blocks_per_kv_block)
    else:
        flags = jnp.zeros((len(CHECK_FLAGS),), jnp.int32)
    flags = jax.lax.pmin(flags, MODEL)  # a failure on any head shard fails the rank
    out = (sampled, num_sampled, logits, flags)
    return jax.tree.map(lambda a: a[None], new), jax.tree.map(lambda a: a[None], out)


def _split_empty(state: DeviceState, specs: DeviceState, M: int):
    """``(treedef, live, empty)`` of the global state: ``live`` the indices of leaves with
    elements, ``empty`` index -> (one shard's block shape, dtype) of the zero-size ones.

    Zero-size leaves stay out of the SPMD program (each shard builds its own): XLA's GPU
    compiler crashed (segfault) on a program whose donated, data-sharded parameters
    include one, on 2 GPUs; one device and CPUs compiled it.
    """
    leaves, treedef = jax.tree.flatten(state)
    spec_leaves = treedef.flatten_up_to(specs)
    live = tuple(i for i, a in enumerate(leaves) if a.size)
    empty = {}
    for i, (a, s) in enumerate(zip(leaves, spec_leaves)):
        if not a.size:
            names = tuple(s) + (None,) * (a.ndim - len(tuple(s)))
            shape = tuple(n // M if name == MODEL else n for n, name in zip(a.shape[1:], names[1:]))
            empty[i] = ((1,) + shape, a.dtype)  # as a shard sees it: the data axis kept, size 1
    return treedef, live, empty


def _global_array(sharding: NamedSharding, shape, host_value: np.ndarray) -> jax.Array:
    """A global array from a host value every process holds in full."""
    return jax.make_array_from_callback(shape, sharding, lambda idx: host_value[idx])


@dataclasses.dataclass
class MeshStepResult:
    """One mesh step: the common bucket, and per local rank its output and check flags."""

    bucket: Bucket
    outputs: dict[int, StepOutput]
    flags: dict[int, dict[str, bool]]


class MeshRunner(Runner):
    """A :class:`Runner` whose step runs over a ``("data", "model")`` mesh.

    ``config`` sizes one data rank (rows, blocks, state slots per rank). Rank ``d``
    is row ``d`` of the mesh; this process drives the ranks whose devices it can
    address (:attr:`local_ranks`: all of them in a single process).

    Args:
      config: per-rank sizes and options.
      mesh: axes ``("data", "model")``.
      check: compute the per-rank check flags in every step (default: ``config.poison``).
    """

    def __init__(self, config: RunnerConfig, mesh: Mesh, *, strict: bool = True,
                 compiler_options: dict | None = None, check: bool | None = None):
        _check_mesh(mesh)
        D, M = mesh.shape[DATA], mesh.shape[MODEL]
        if M > 1 and config.kv_layout != "flash":
            raise ValueError(f"tensor parallelism supports kv_layout='flash', got {config.kv_layout!r}")
        self.shard_config = dataclasses.replace(config, model=tp_shard_config(config.model, M))
        if "moe" in config.model.layer_types and config.model.moe_num_experts % D:
            raise ValueError(
                f"moe_num_experts={config.model.moe_num_experts} must be a multiple of the data axis "
                f"size {D} (experts are sharded over 'data')"
            )
        self.mesh = mesh
        self.num_ranks = D
        self.check = config.poison if check is None else bool(check)
        me = jax.process_index()
        self.local_ranks = [d for d in range(D) if mesh.devices[d, 0].process_index == me]
        super().__init__(config, strict=strict, compiler_options=compiler_options, layout="tree")
        self.sanitizer = None  # one host mirror cannot describe D ranks: the check flags do instead
        # One shard's initial state (uniform), tiled M times on its heads axis and D times
        # along a new leading axis.
        shard = jax.tree.map(np.asarray, self.state)
        self.state_specs = state_specs(shard)

        def place(a, s):
            whole = _tile_model_axis(a, s, M)
            return _global_array(NamedSharding(mesh, s), (D,) + whole.shape,
                                 np.broadcast_to(whole[None], (D,) + whole.shape))

        self.state = jax.tree.map(place, shard, self.state_specs)
        self._state_def, self._live, self._empty = _split_empty(self.state, self.state_specs, M)
        self.dense_params = self.params  # unsharded, on this process's default device
        host_params = tp_param_layout(jax.tree.map(np.asarray, self.params), config.model, M)
        self.param_specs = param_specs(host_params, config.model)
        self.params = jax.tree.map(
            lambda a, s: _global_array(NamedSharding(mesh, s), a.shape, a), host_params, self.param_specs
        )
        self._in_sharding = NamedSharding(mesh, P(DATA))
        self._agree_exe = None

    # --------------------------------------------------------- compiling

    def _initial_state(self) -> DeviceState:
        """One rank's, one head shard's initial state (``__init__`` tiles and places it)."""
        full = self.config
        self.config = self.shard_config
        try:
            return super()._initial_state()
        finally:
            self.config = full

    def jitted_step(self, bucket: Bucket):
        """``(fn, args, spec)`` of ``bucket``'s SPMD step (see :meth:`Runner.jitted_step`).

        ``fn(params, state, packed)``: ``packed`` int32 ``[D, n]`` sharded over "data" (one
        :class:`StepInputs` buffer per rank); ``args[2]`` is its ``ShapeDtypeStruct``.
        """
        buf, spec = pack(self.pack(None, bucket))
        treedef, live, empty = self._state_def, self._live, self._empty
        live_specs = [treedef.flatten_up_to(self.state_specs)[i] for i in live]
        out_specs = (live_specs, (P(DATA),) * 4)
        per_rank = functools.partial(_rank_step, config=self.shard_config, bucket=bucket, spec=spec,
                                     check=self.check)

        def per_rank_live(params, live_leaves, packed):
            # zero-size leaves (the draft tokens without speculation) are built here, not passed
            leaves = [None] * (len(live) + len(empty))
            for i, a in zip(live, live_leaves):
                leaves[i] = a
            for i, (shape, dtype) in empty.items():
                leaves[i] = jnp.zeros(shape, dtype)
            new, out = per_rank(params, treedef.unflatten(leaves), packed)
            new_leaves = treedef.flatten_up_to(new)
            return [new_leaves[i] for i in live], out

        def sm(params, live_leaves, packed):
            # check_vma=False: the kernels' scans start from unsharded (invariant) carries; the
            # replication of outputs is instead proved by the parity tests. The mesh is picked at
            # trace time: inside tpu_target.lowering, one whose device is the TPU target.
            return jax.shard_map(per_rank_live, mesh=tpu_target.shard_map_mesh(self.mesh),
                                 in_specs=(self.param_specs, live_specs, P(DATA)),
                                 out_specs=out_specs, check_vma=False)(params, live_leaves, packed)

        named = functools.partial(jax.tree.map, lambda s: NamedSharding(self.mesh, s))
        fn = jax.jit(sm, donate_argnums=(1,), compiler_options=self.compiler_options,
                     out_shardings=(named(live_specs), named(out_specs[1])))
        arg = jax.ShapeDtypeStruct((self.num_ranks, buf.size), jnp.int32, sharding=self._in_sharding)
        return fn, (self.params, self._live_leaves(), arg), spec

    def _live_leaves(self) -> list:
        leaves = jax.tree.leaves(self.state)
        return [leaves[i] for i in self._live]

    def precompile(self, *, workers: int = 1) -> tuple[int, float]:
        """Compile every bucket's step and the agreement program."""
        if self._agree_exe is None:
            arg = jax.ShapeDtypeStruct((self.num_ranks, 2), jnp.int32, sharding=self._in_sharding)
            rep = NamedSharding(self.mesh, P())
            self._agree_exe = jax.jit(lambda x: x, out_shardings=rep).lower(arg).compile()
        return super().precompile(workers=workers)

    # ------------------------------------------------------------ running

    def _from_local(self, per_rank: dict[int, np.ndarray]) -> jax.Array:
        """Global ``[D, ...]`` array sharded over "data" from this process's ranks' rows."""
        missing = set(self.local_ranks) - set(per_rank)
        if missing:
            raise ValueError(f"no value given for local rank(s) {sorted(missing)}")
        local = np.stack([per_rank[d] for d in self.local_ranks])
        return jax.make_array_from_process_local_data(self._in_sharding, local,
                                                      (self.num_ranks,) + local.shape[1:])

    def _to_local(self, arr: jax.Array) -> dict[int, np.ndarray]:
        """This process's rows of a ``[D, ...]`` array sharded over "data"."""
        out = {}
        for shard in arr.addressable_shards:
            d = shard.index[0].start or 0
            out.setdefault(d, np.asarray(shard.data)[0])
        return out

    def agree(self, values: dict[int, tuple[int, int]]) -> np.ndarray:
        """All ranks' two ints (local ranks' given here): int32 ``[D, 2]``, the same in every process."""
        if self._agree_exe is None:
            raise RuntimeError("call precompile() first")
        arr = self._from_local({d: np.asarray(v, np.int32) for d, v in values.items()})
        with self.guard.serving():
            out = self._agree_exe(arr)
            return np.asarray(out.addressable_data(0))

    def run_ranks(self, bucket: Bucket, inputs: dict[int, StepInputs]) -> MeshStepResult:
        """One SPMD step in ``bucket`` with one :class:`StepInputs` per local rank."""
        try:
            exe, spec = self.executables[bucket]
        except KeyError:
            raise RuntimeError(f"bucket {bucket} was not precompiled; call precompile() first") from None
        bufs = {}
        for d, inp in inputs.items():
            bufs[d], got = pack(inp)
            if got != spec:
                raise RuntimeError(f"rank {d}'s step inputs do not match bucket {bucket}'s layout")
        buf = self._from_local(bufs)
        with self.guard.serving():
            new_live, (sampled, num_sampled, logits, flags) = exe(self.params, self._live_leaves(), buf)
            leaves = jax.tree.leaves(self.state)
            for i, a in zip(self._live, new_live):
                leaves[i] = a
            self.state = self._state_def.unflatten(leaves)
            s, n, lg, fl = (self._to_local(a) for a in (sampled, num_sampled, logits, flags))
        outputs = {d: StepOutput(s[d], n[d], lg[d]) for d in self.local_ranks}
        checks = {d: dict(zip(CHECK_FLAGS, map(bool, fl[d]))) for d in self.local_ranks} if self.check else {}
        return MeshStepResult(bucket, outputs, checks)

    def execute_ranks(self, plans: dict[int, StepPlan | None], bucket: Bucket) -> MeshStepResult:
        """Run local ranks' plans (``None``: the dummy step) in the common ``bucket``."""
        inputs = {}
        for d in self.local_ranks:
            plan = plans.get(d)
            if plan is not None:
                if self.buckets.buckets.index(plan.bucket) > self.buckets.buckets.index(bucket):
                    raise ValueError(f"rank {d}'s plan needs {plan.bucket}, larger than the step's {bucket}")
                plan = dataclasses.replace(plan, bucket=bucket)
            inputs[d] = self.pack(plan, bucket)
        return self.run_ranks(bucket, inputs)

    def execute(self, plan: StepPlan) -> StepOutput:
        raise NotImplementedError("a MeshRunner runs every rank at once: use execute_ranks")

    def dummy_step(self, bucket: Bucket | None = None) -> MeshStepResult:
        """Every local rank runs the dummy step (warm-up)."""
        bucket = bucket or self.buckets.buckets[0]
        return self.run_ranks(bucket, {d: self.pack(None, bucket) for d in self.local_ranks})

    def warm_up(self) -> list[MeshStepResult]:
        """One all-dummy step through every executable; returns their results (checked flags)."""
        return [self.dummy_step(b) for b in self.buckets.buckets]

    @functools.cached_property
    def dense_reference(self):
        """The dense oracle on unsharded params on this process's device (see :class:`Runner`)."""
        c = self.config
        params = self.dense_params
        fn = jax.jit(lambda toks: dense_forward(params, c.model, toks, c.kv_cache_dtype))

        def reference(tokens):
            with jax.default_matmul_precision(c.matmul_precision):
                return fn(tokens)

        return reference
