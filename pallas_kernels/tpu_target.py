"""Which TPU the TPU kernels are lowered for, without asking a device that may not be one.

A TPU target is a chip generation (:data:`TARGETS`: ``v5e``, ``v5p``, ``v6e``,
``v7``) with the per-TensorCore figures the kernels and Mosaic's lowering
depend on. :func:`resolve` picks one, in this order:

1. an explicit ``target`` argument (a name, a device-kind string or a
   :class:`TpuTarget`): used as given, the local device is not consulted;
2. the TPU abstract device of the current abstract mesh (set by
   :func:`lowering`, or by the caller's own ``jax.sharding.use_abstract_mesh``);
3. the environment variable ``KVJAX_TPU_TARGET`` (static config);
4. the local device, when the default backend is a TPU;
5. :data:`DEFAULT_TARGET` (``v6e``).

Mosaic's own lowering asks "which TPU?" for some ops (the sign of a signed
division, rank-1 block checks) through the abstract mesh's device first and the
local default device otherwise. Lowering a TPU kernel on a CPU or GPU host
(``jax.export.export(..., platforms=("tpu",))``) would therefore fail with
``Unsupported TPU device kind: cpu``. Two things prevent that:

* :func:`lowering` (and :func:`export`) put the resolved target's abstract
  device into the abstract mesh for the duration, so every such question is
  answered by the target, never by the local device;
* :func:`prepare_compiled_tpu` — called by every op that picks a compiled TPU
  kernel — registers, on a host whose default backend is not a TPU, the
  :func:`resolve`-d target (normally the default) as what Mosaic assumes for
  the local device kind. This is the fallback for a bare ``jax.export`` with no
  target given; an explicit target (1, 2) always takes precedence.

Inside :func:`lowering` the ops also treat the platform as a TPU
(:func:`pallas_kernels.backend.platform` reads the abstract mesh's device), so
``backend="auto"``/``"pallas"``/``"pallas_tpu"`` pick the compiled Mosaic kernels,
not the interpreter: the whole serving step lowers for TPU as it would run there.

``shard_map`` replaces the abstract mesh inside its body by its own mesh's, whose
device is the local one (a CPU); a sharded program meant to lower for TPU from
here builds its ``shard_map`` on :func:`shard_map_mesh` ``(mesh)`` at trace time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import jax
import numpy as np

try:  # Mosaic's table of device kinds (private; see prepare_compiled_tpu)
    from jax._src.pallas.mosaic import tpu_info as _mosaic_tpu_info
except ImportError:  # pragma: no cover - another JAX layout
    _mosaic_tpu_info = None

__all__ = [
    "DEFAULT_TARGET",
    "TARGETS",
    "TARGET_ENV",
    "TpuTarget",
    "check_vmem",
    "export",
    "lowering",
    "prepare_compiled_tpu",
    "resolve",
    "rpa_block_sizes",
    "shard_map_mesh",
    "vmem_buffer_bytes",
]

TARGET_ENV = "KVJAX_TPU_TARGET"
_MiB = 1024 * 1024


@dataclasses.dataclass(frozen=True)
class TpuTarget:
    """One TPU generation as one JAX device sees it (figures per TensorCore).

    Attributes:
      name: kvjax's short name (``"v6e"``).
      device_kind: JAX's ``device_kind`` string for it (``"TPU v6 lite"``).
      generation: 5, 6, 7.
      num_cores: TensorCores behind one JAX device (2 for v5p megacore).
      vmem_bytes: VMEM capacity per TensorCore.
      scoped_vmem_bytes: VMEM one kernel may use without raising Mosaic's
        ``vmem_limit_bytes``: the default scoped limit as kvjax assumes it (16 MiB
        on v5e/v5p, 32 MiB on v6e/v7; not yet confirmed on a chip).
        :func:`check_vmem` holds kernels to it.
      smem_bytes: SMEM per TensorCore (scalar prefetch and SMEM scratch live here).
      hbm_bytes: HBM of one JAX device.
      hbm_bytes_per_s: peak HBM bandwidth of one JAX device.
    """

    name: str
    device_kind: str
    generation: int
    num_cores: int
    vmem_bytes: int
    scoped_vmem_bytes: int
    smem_bytes: int
    hbm_bytes: int
    hbm_bytes_per_s: float

    def abstract_device(self) -> jax.sharding.AbstractDevice:
        """The ``jax.sharding.AbstractDevice`` Mosaic's lowering reads the chip from."""
        return jax.sharding.AbstractDevice(
            device_kind=self.device_kind, num_cores=self.num_cores, platform="tpu"
        )


# Public per-chip figures (Cloud TPU system architecture pages); v7 is Ironwood,
# whose JAX devices are single TensorCores.
TARGETS: dict[str, TpuTarget] = {
    t.name: t
    for t in (
        TpuTarget("v5e", "TPU v5 lite", 5, 1, 128 * _MiB, 16 * _MiB, _MiB, 16 * 1024**3, 819e9),
        TpuTarget("v5p", "TPU v5", 5, 2, 64 * _MiB, 16 * _MiB, _MiB, 95 * 1024**3, 2765e9),
        TpuTarget("v6e", "TPU v6 lite", 6, 1, 128 * _MiB, 32 * _MiB, _MiB, 32 * 1024**3, 1640e9),
        TpuTarget("v7", "TPU7x", 7, 1, 64 * _MiB, 32 * _MiB, _MiB, 96 * 1024**3, 3690e9),
    )
}
# Device-kind spellings JAX reports for each generation.
_KIND_ALIASES = {
    "TPU v5 lite": "v5e", "TPU v5e": "v5e",
    "TPU v5": "v5p", "TPU v5p": "v5p",
    "TPU v6 lite": "v6e", "TPU v6e": "v6e",
    "TPU7x": "v7", "TPU7": "v7", "TPU v7": "v7",
}  # fmt: skip

# The target when nothing says otherwise: v6e (Trillium), the current
# single-TensorCore serving chip. Its scoped VMEM (32 MiB) is not the smallest
# (v5e/v5p: 16 MiB): set KVJAX_TPU_TARGET to check shapes for another chip.
DEFAULT_TARGET = "v6e"


def _lookup(spec: str) -> TpuTarget | None:
    if spec in TARGETS:
        return TARGETS[spec]
    name = _KIND_ALIASES.get(spec)
    return TARGETS[name] if name else None


def _from_spec(name: str, spec) -> TpuTarget:
    if isinstance(spec, TpuTarget):
        return spec
    target = _lookup(spec) if isinstance(spec, str) else None
    if target is None:
        raise ValueError(
            f"{name} must be a TpuTarget or one of {sorted(TARGETS)} (or a TPU device kind "
            f"{sorted(_KIND_ALIASES)}), got {spec!r}"
        )
    return target


def _mesh_target() -> TpuTarget | None:
    """The TPU target of the current abstract mesh's device, if it names one."""
    device = jax.sharding.get_abstract_mesh().abstract_device
    if device is None or device.platform != "tpu":
        return None
    return _lookup(device.device_kind)


def resolve(target: TpuTarget | str | None = None) -> TpuTarget:
    """The TPU target to lower for; see the module docstring for the order.

    Raises:
      ValueError: ``target`` or ``KVJAX_TPU_TARGET`` names no known target.
    """
    if target is not None:
        return _from_spec("target", target)
    from_mesh = _mesh_target()
    if from_mesh is not None:
        return from_mesh
    env = os.environ.get(TARGET_ENV, "").strip()
    if env:
        return _from_spec(TARGET_ENV, env)
    if jax.default_backend() == "tpu":
        local = _lookup(jax.devices()[0].device_kind)
        if local is not None:
            return local
    return TARGETS[DEFAULT_TARGET]


@contextlib.contextmanager
def lowering(target: TpuTarget | str | None = None):
    """Trace and lower inside this block for ``target`` (resolved by :func:`resolve`).

    Sets the abstract mesh's device to the target (keeping the axes of an
    abstract mesh already in effect), so Mosaic reads the chip from it. Yields
    the :class:`TpuTarget`.
    """
    resolved = resolve(target)
    mesh = jax.sharding.get_abstract_mesh()
    with jax.sharding.use_abstract_mesh(mesh.update(abstract_device=resolved.abstract_device())):
        yield resolved


def export(fn, *args, target: TpuTarget | str | None = None, **export_kwargs):
    """``jax.export.export(fn, platforms=("tpu",))(*args)`` inside :func:`lowering`.

    ``fn`` is jitted if it is not already (a ``jax.jit`` result keeps its
    donation and static arguments); ``args`` may be ``jax.ShapeDtypeStruct``.
    """
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    with lowering(target):
        return jax.export.export(jitted, platforms=("tpu",), **export_kwargs)(*args)


def shard_map_mesh(mesh):
    """The mesh a ``shard_map`` traced now should take: ``mesh`` itself, or inside
    :func:`lowering` its abstract mesh with the target's TPU device.

    Call it while tracing (in the jitted function), not when building the function:
    a ``shard_map`` over the local (CPU) mesh would reset the device to the CPU in its
    body, and its ops would pick the interpreter instead of the Mosaic kernels.
    """
    target = _mesh_target()
    if target is None:
        return mesh
    return mesh.abstract_mesh.update(abstract_device=target.abstract_device())


def _on_local_chip() -> bool:
    """True when the chip being lowered for is the local TPU (no target set over it)."""
    return jax.default_backend() == "tpu" and _mesh_target() is None and not os.environ.get(
        TARGET_ENV, "").strip()


def rpa_block_sizes(pages_per_seq: int, num_tokens: int) -> dict[str, int]:
    """Block-size arguments for JAX's ``ragged_paged_attention`` (compiled).

    JAX picks them from its tuning table for ``jax.devices()[0]``, which asks the
    local device: right on the chip being lowered for, an error ("TPU version must
    be 4 or higher") or the wrong chip otherwise. On the local TPU this returns
    ``{}`` (JAX's table decides); when lowering for a target from elsewhere, JAX's
    own untuned choice for v5 and later: 128 KV pages and 32 queries per block,
    capped by ``pages_per_seq`` and ``num_tokens``.
    """
    if _on_local_chip():
        return {}
    return {"num_kv_pages_per_block": max(1, min(int(pages_per_seq), 128)),
            "num_queries_per_block": max(1, min(int(num_tokens), 32))}


_registered_fallback: dict[str, str] = {}


def prepare_compiled_tpu() -> TpuTarget:
    """Called when an op picks a compiled (not interpreted) TPU kernel; returns the target.

    On a host whose default backend is not a TPU and with no TPU device in the
    abstract mesh, Mosaic would ask the local (CPU/GPU) device which TPU it is
    and fail; register the resolved target under the local device kind instead,
    through Mosaic's table of extra device kinds. Where that table does not
    exist (another JAX version) nothing is registered and lowering off-TPU
    needs :func:`lowering`.
    """
    target = resolve()
    if jax.default_backend() == "tpu" or _mesh_target() is not None:
        return target
    tpu_info = _mosaic_tpu_info
    registry = getattr(tpu_info, "registry", None)
    for_chip = getattr(tpu_info, "get_tpu_info_for_chip", None)
    chip_of = getattr(tpu_info, "chip_version_from_device_kind", None)
    if registry is None or for_chip is None or chip_of is None:
        return target
    chip, cores = chip_of(target.device_kind), target.num_cores
    changed = False
    for kind in {d.device_kind for d in jax.devices()}:
        if _lookup(kind) is None and _registered_fallback.get(kind) != target.name:
            registry[kind] = lambda: for_chip(chip, cores)
            _registered_fallback[kind] = target.name
            changed = True
    cache_clear = getattr(tpu_info.get_tpu_info, "cache_clear", None)
    if changed and cache_clear is not None:
        cache_clear()  # Mosaic caches its answer: drop one for a previous fallback
    return target


# --------------------------------------------------------------------------
# VMEM budget of a kernel
# --------------------------------------------------------------------------


def vmem_buffer_bytes(shape, dtype) -> int:
    """Bytes one VMEM buffer of ``shape`` takes: last two dims padded to whole tiles.

    A tile is 128 lanes by ``8 * packing`` sublanes (``packing = 4 // itemsize``:
    16 rows for 16-bit, 32 for 8-bit dtypes); a rank-1 buffer is one row.
    Generous where Mosaic may pack tighter, so a buffer is never under-counted.
    """
    dims = (1,) * max(0, 2 - len(shape)) + tuple(int(d) for d in shape)
    itemsize = np.dtype(dtype).itemsize
    rows = 8 * max(1, 4 // itemsize)
    *lead, r, c = dims
    return int(np.prod(lead, dtype=np.int64)) * (-(-r // rows) * rows) * (-(-c // 128) * 128) * itemsize


def check_vmem(op: str, buffers, *, hint: str, target: TpuTarget | str | None = None) -> None:
    """Raise ``ValueError`` when ``buffers`` exceed the target's scoped VMEM.

    Args:
      op: the public op, for the message.
      buffers: ``(name, shape, dtype, copies)`` per VMEM buffer of one grid step
        (``copies`` 2 for pipelined blocks, which Pallas double-buffers; 1 for scratch).
      hint: which argument to shrink.
      target: as for :func:`resolve`.
    """
    t = resolve(target)
    sizes = [(name, copies * vmem_buffer_bytes(shape, dtype)) for name, shape, dtype, copies in buffers]
    need = sum(b for _, b in sizes)
    if need > t.scoped_vmem_bytes:
        top = ", ".join(f"{name} {b / _MiB:.1f}" for name, b in sorted(sizes, key=lambda x: -x[1])[:4])
        raise ValueError(
            f"{op}: the TPU kernel needs about {need / _MiB:.1f} MiB of VMEM per grid step "
            f"({top} MiB, ...), more than the {t.name} scoped VMEM limit of "
            f"{t.scoped_vmem_bytes // _MiB} MiB; {hint}"
        )
