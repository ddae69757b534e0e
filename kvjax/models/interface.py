"""The one protocol through which the runner serves a model.

The runner (``kvjax.runner``) knows no layer type. It asks a model for

* its **pools** (:class:`PoolSpec`): every array of device memory the steps mutate,
  each either a KV pool (axis 0 counts kernel KV blocks of one block-table group;
  block 0 is the null block; fresh blocks are zeroed before first use) or a state
  pool (axis 0 counts recurrent-state slots; slot 0 is the null slot; fresh slots
  are zeroed), with the mesh axis of each dimension;
* its **parameters** and their mesh partitioning;
* one **step**: ``apply(params, ctx, pools) -> (logits, pools)`` over a
  :class:`~kvjax.models.step_context.StepContext` (a view of the padded
  :class:`~kvjax.state.StepBatch`);
* a **dense reference**: ``dense_logits(params, tokens) -> logits`` of one
  unpaged sequence, the oracle of the parity checks.

The runner owns zeroing, poisoning, donation, sharding and the checks; the model
owns what a layer computes. :class:`kvjax.models.TinyHybrid` is one implementation,
the Hugging Face architectures of :mod:`kvjax.models.hf` are others.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable

import jax
import numpy as np

from kvjax.models.step_context import StepContext

# The mesh axes: data parallel ranks (own requests, blocks and rows; MoE experts) and
# tensor-parallel head shards.
DATA, MODEL = "data", "model"
MESH_AXES = (DATA, MODEL)
POOL_KINDS = ("kv", "state")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
KV_LAYOUTS = ("flash", "rpa")


@dataclasses.dataclass(frozen=True)
class CacheSizes:
    """The runner's sizes a model needs to lay out its pools (hashable).

    Attributes:
      num_kernel_blocks: entries on axis 0 of a KV pool (kernel blocks, block 0 null).
      kernel_block_size: tokens per kernel block.
      num_state_slots: entries on axis 0 of a state pool (slot 0 null).
      num_spec_tokens: draft tokens per decode window (0: no speculation).
      kv_cache_dtype: ``"auto"`` (the model's activation dtype) or ``"fp8"`` / ``"fp8_e4m3"``.
      kv_layout: ``"flash"`` (separate K and V pools) or ``"rpa"`` (JAX's
        ragged-paged-attention pages, K and V interleaved on the heads axis).
    """

    num_kernel_blocks: int
    kernel_block_size: int
    num_state_slots: int
    num_spec_tokens: int = 0
    kv_cache_dtype: str = "auto"
    kv_layout: str = "flash"

    def __post_init__(self):
        for name, lo in (("num_kernel_blocks", 2), ("kernel_block_size", 1), ("num_state_slots", 1),
                         ("num_spec_tokens", 0)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ValueError(f"CacheSizes.{name} must be an int >= {lo}, got {v!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {self.kv_layout!r}")


@dataclasses.dataclass(frozen=True)
class PoolSpec:
    """One pool of device memory the steps mutate (hashable).

    Attributes:
      name: unique within the model (the key of the pool in ``pools``).
      kind: ``"kv"`` (axis 0: kernel KV blocks of block-table group ``group``) or
        ``"state"`` (axis 0: recurrent-state slots).
      shape: the whole pool's shape on one data rank, axis 0 included.
      dtype: storage dtype (a numpy dtype name, e.g. ``"float32"``, ``"bfloat16"``,
        ``"float8_e4m3fn"``).
      axes: one entry per dimension: ``None`` or the mesh axis name (``"model"``)
        the dimension is split over under tensor parallelism. Axis 0 is never split.
      group: the KV-cache group (``kind="kv"`` only).
    """

    name: str
    kind: str
    shape: tuple[int, ...]
    dtype: str
    axes: tuple[str | None, ...] = ()
    group: int = 0

    def __post_init__(self):
        if self.kind not in POOL_KINDS:
            raise ValueError(f"PoolSpec.kind must be one of {POOL_KINDS}, got {self.kind!r}")
        shape = tuple(int(n) for n in self.shape)
        object.__setattr__(self, "shape", shape)
        axes = tuple(self.axes) or (None,) * len(shape)
        if len(axes) != len(shape):
            raise ValueError(f"PoolSpec {self.name!r}: axes {axes} must name each of the {len(shape)} dimensions")
        if axes[0] is not None:
            raise ValueError(f"PoolSpec {self.name!r}: axis 0 (blocks / slots) cannot be split, got {axes[0]!r}")
        object.__setattr__(self, "axes", axes)
        object.__setattr__(self, "dtype", np.dtype(self.dtype).name)

    def zeros(self):
        """The pool, zeroed, on the default device."""
        import jax.numpy as jnp  # noqa: PLC0415  (keeps this module light to import)

        return jnp.zeros(self.shape, self.dtype)


@runtime_checkable
class Model(Protocol):
    """What the runner needs from a model. Implementations are hashable (static under ``jit``).

    Attributes:
      vocab_size: logits columns.
      kv_groups: the block-table groups the model's KV pools use, e.g. ``(0,)``;
        ``()`` for a model with no attention.
      uses_state: whether the model has state pools (recurrent layers).
    """

    vocab_size: int

    @property
    def kv_groups(self) -> tuple[int, ...]: ...

    @property
    def uses_state(self) -> bool: ...

    def pool_specs(self, sizes: CacheSizes) -> tuple[PoolSpec, ...]:
        """Every pool, in a fixed order (names unique)."""

    def init_params(self, seed: int) -> Any:
        """Random parameters from ``seed`` (deterministic)."""

    def param_partitioning(self, params) -> Any:
        """A pytree like ``params`` of ``jax.sharding.PartitionSpec`` over the mesh axes
        ``("data", "model")`` (replicated: ``P()``)."""

    def shard(self, model_size: int) -> "Model":
        """The model one of ``model_size`` tensor-parallel shards runs (``self`` for 1);
        ``ValueError`` when the heads do not split."""

    def layout_for_shards(self, params, model_size: int):
        """Host (numpy) params reordered so that a contiguous ``1/model_size`` slice along each
        axis named ``"model"`` in :meth:`param_partitioning` is one shard's (``params`` for 1)."""

    def apply(self, params, ctx: StepContext, pools: dict[str, jax.Array], *, backend: str,
              sizes: CacheSizes, expert_axis: str | None = None,
              model_axis: str | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
        """One step: float32 logits ``[L, vocab_size]`` of ``ctx.logits_indices`` and the pools
        with this step's K/V and states written. Pad tokens and padded rows write nothing and
        do not affect real rows."""

    # Optional, for kvjax.runner.memory's estimate (0 when absent):
    # step_temp_bytes(num_tokens, table_tokens, sizes) -> int: temporaries of one step whose rows
    #   address table_tokens keys; dense_temp_bytes(n) -> int: of dense_logits on n tokens.

    def dense_logits(self, params, tokens: jax.Array, *, kv_cache_dtype: str = "auto") -> jax.Array:
        """float32 logits ``[n, vocab_size]`` of one sequence ``tokens int32 [n]``, unpaged (the
        oracle; with an fp8 KV dtype it rounds K/V as the cache stores them)."""
