"""One place that decides which implementation of a kernel runs (public: tools use it).

Every op registers its implementations here (:func:`register`), one per
*flavour*: ``"reference"`` (pure jnp, plain XLA), ``"tpu"`` (Mosaic TPU Pallas),
``"gpu"`` (Pallas GPU, the Triton lowering) and ``"mosaic_gpu"`` (Pallas Mosaic GPU). A public op resolves ``backend``/``interpret`` once
(:func:`choose`), before its argument checks, and calls :func:`run`, which
calls the registered function under one shared ``jax.jit`` whose static arguments are the op, the
flavour, the interpret mode and the op's static keyword arguments (tuning
configs are frozen dataclasses, so they are hashable static arguments).

``backend`` means the same for every op:

* ``"reference"``: the pure-jnp reference.
* ``"pallas"``: the Pallas kernel for the current platform (Mosaic on TPU, the
  GPU lowering on GPU). On a CPU it runs the TPU kernel in interpret mode.
* ``"pallas_tpu"`` / ``"pallas_gpu"``: that flavour, whatever the platform
  (interpret mode on a CPU).
* ``"mosaic_gpu"``: the Mosaic GPU kernel (compiled only: JAX >= 0.11 on an NVIDIA GPU
  of compute capability >= 9.0, else a ``ValueError`` saying what is missing). Only
  explicitly: ``"auto"`` and ``"pallas"`` on a GPU pick the ``"gpu"`` (Triton) flavour.
* ``"auto"`` (default): Pallas on TPU and GPU, the reference on CPU, unless
  ``KVJAX_INTERPRET=1`` is set, in which case the Pallas kernels run in
  interpret mode on CPU (the switch the test suite uses).

``interpret=None`` means "interpret iff the platform cannot compile this
flavour"; ``True``/``False`` force it. An op that registers no implementation
for the resolved flavour (the varlen conv has only a reference) runs its
reference: :func:`choose` says which implementation a call gets.

For tools (the CLI's ``--backend`` choices, the compile guard, difftest): :data:`BACKENDS`,
:func:`resolve`, :func:`choose`, :func:`platform`, :func:`ops` and :func:`flavors` say what
a call would run here, without running it. ``pallas_kernels._backend`` is this module under
its former name.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from collections.abc import Callable
from typing import Literal

import jax
from jax.experimental.pallas import tpu as pltpu

with warnings.catch_warnings():  # the Triton lowering is deprecated from JAX 0.11 on
    warnings.simplefilter("ignore", DeprecationWarning)
    from jax.experimental.pallas import triton as triton

from pallas_kernels import tpu_target

__all__ = [
    "BACKENDS",
    "FLAVORS",
    "INTERPRET_ENV",
    "MOSAIC_GPU_MIN_CAPABILITY",
    "MOSAIC_GPU_MIN_JAX",
    "Choice",
    "Flavor",
    "check_mosaic_gpu",
    "choose",
    "env_forces_interpret",
    "flavors",
    "gpu_capability",
    "gpu_compiler_params",
    "ops",
    "platform",
    "register",
    "resolve",
    "run",
]

BACKENDS = ("auto", "reference", "pallas", "pallas_tpu", "pallas_gpu", "mosaic_gpu")
FLAVORS = ("reference", "tpu", "gpu", "mosaic_gpu")
INTERPRET_ENV = "KVJAX_INTERPRET"

Flavor = Literal["reference", "tpu", "gpu", "mosaic_gpu"]
# The Mosaic GPU kernels pass the caches as mutable Refs (``jax.new_ref``) to
# ``plgpu.kernel``; JAX 0.10 cannot trace that.
MOSAIC_GPU_MIN_JAX = (0, 11)
MOSAIC_GPU_MIN_CAPABILITY = (9, 0)


@dataclasses.dataclass(frozen=True)
class Choice:
    """The implementation a kernel call runs.

    Attributes:
      flavor: ``"reference"``, ``"tpu"`` (Mosaic TPU kernel), ``"gpu"`` (Pallas
        Triton) or ``"mosaic_gpu"``.
      interpret: run the Pallas kernel through the interpreter.
    """

    flavor: Flavor
    interpret: bool

    def interpret_arg(self):
        """The ``interpret=`` argument this flavour's ``pallas_call`` takes.

        TPU: ``InterpretParams`` (race detection on, uninitialised memory NaN)
        or ``False``; GPU: a bool; reference and Mosaic GPU: ``False``.
        """
        if self.flavor == "tpu" and self.interpret:
            return pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")
        return self.interpret if self.flavor == "gpu" else False


def env_forces_interpret() -> bool:
    """True when ``KVJAX_INTERPRET`` is set to a true value (1/true/yes/on)."""
    return os.environ.get(INTERPRET_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def platform() -> str:
    """The platform being traced for: ``"cpu"``, ``"gpu"`` or ``"tpu"``.

    That of the abstract mesh's device when one is set (e.g. by
    :func:`pallas_kernels.tpu_target.lowering`, to lower for a TPU from a CPU),
    else the default JAX backend's.
    """
    device = jax.sharding.get_abstract_mesh().abstract_device
    p = jax.default_backend() if device is None else device.platform
    return "gpu" if p in ("cuda", "rocm", "gpu") else p


def resolve(backend: str, interpret: bool | None) -> Choice:
    """Pick the flavour for ``backend``/``interpret`` on this platform.

    Raises:
      ValueError: unknown ``backend``, or ``interpret`` not a bool/None.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if interpret is not None and not isinstance(interpret, bool):
        raise ValueError(f"interpret must be None, True or False, got {interpret!r}")
    plat = platform()
    if backend == "reference":
        return Choice("reference", False)
    if backend == "mosaic_gpu":
        if interpret:
            raise ValueError(
                'backend="mosaic_gpu" has no interpret mode; got interpret=True '
                '(use backend="pallas_gpu" or "reference" on a CPU)')
        check_mosaic_gpu(plat)
        return Choice("mosaic_gpu", False)
    if backend == "auto":
        if plat in ("tpu", "gpu") and not interpret:
            return Choice(plat, False)
        if interpret or env_forces_interpret():
            return Choice("tpu" if plat == "cpu" else plat, True)
        return Choice("reference", False)
    if backend == "pallas":
        flavor: Flavor = plat if plat in ("tpu", "gpu") else "tpu"
    else:
        flavor = "tpu" if backend == "pallas_tpu" else "gpu"
    if interpret is None:
        interpret = plat != flavor
    if flavor == "tpu" and not interpret:
        tpu_target.prepare_compiled_tpu()  # Mosaic must not ask a CPU/GPU which TPU it is
    return Choice(flavor, interpret)


def _jax_version() -> tuple[int, ...]:
    return tuple(int(p) for p in jax.__version__.split(".")[:2])


def check_mosaic_gpu(plat: str | None = None) -> None:
    """Raise ``ValueError`` unless the Mosaic GPU flavour can run here.

    Needs: a GPU platform, an NVIDIA device of compute capability
    >= :data:`MOSAIC_GPU_MIN_CAPABILITY`, and JAX >= :data:`MOSAIC_GPU_MIN_JAX`.
    """
    plat = platform() if plat is None else plat
    need = (f"an NVIDIA GPU of compute capability >= "
            f"{'.'.join(map(str, MOSAIC_GPU_MIN_CAPABILITY))} and JAX >= "
            f"{'.'.join(map(str, MOSAIC_GPU_MIN_JAX))}")
    if plat != "gpu":
        raise ValueError(f'backend="mosaic_gpu" needs {need}; got platform {plat!r}')
    if _jax_version() < MOSAIC_GPU_MIN_JAX:
        raise ValueError(f'backend="mosaic_gpu" needs {need}; got JAX {jax.__version__}')
    device, cap = gpu_capability()
    if cap is None or cap < MOSAIC_GPU_MIN_CAPABILITY:
        raise ValueError(
            f'backend="mosaic_gpu" needs {need}; got device {device} with compute '
            f"capability {'unknown' if cap is None else '.'.join(map(str, cap))}")


def gpu_capability() -> tuple[str, tuple[int, ...] | None]:
    """The first device and its CUDA compute capability (None when it reports none)."""
    device = jax.devices()[0]
    try:
        cap = tuple(int(p) for p in str(device.compute_capability).split(".")[:2])
    except (AttributeError, ValueError):
        cap = None
    return str(device), cap


# --------------------------------------------------------------------------
# The registry
# --------------------------------------------------------------------------

# op name -> flavour -> implementation fn(*args, interpret, **static)
_IMPLS: dict[str, dict[str, Callable]] = {}


def register(op: str, *flavors: Flavor):
    """Decorator: the function is ``op``'s implementation for each of ``flavors``.

    An implementation is called as ``fn(*args, interpret=..., **static)``, with
    ``interpret`` from :meth:`Choice.interpret_arg`, inside :func:`run`'s jit.
    Every op must register a ``"reference"``.
    """
    for f in flavors:
        if f not in FLAVORS:
            raise ValueError(f"flavor must be one of {FLAVORS}, got {f!r}")

    def deco(fn):
        table = _IMPLS.setdefault(op, {})
        for f in flavors:
            if f in table:
                raise ValueError(f"{op} already has a {f!r} implementation")
            table[f] = fn
        return fn

    return deco


def flavors(op: str) -> tuple[str, ...]:
    """The flavours ``op`` registers, in :data:`FLAVORS` order."""
    table = _table(op)
    return tuple(f for f in FLAVORS if f in table)


def ops() -> tuple[str, ...]:
    """The names of every registered op, sorted (``"kv_write"``, ``"zero_blocks"``, ...)."""
    return tuple(sorted(_IMPLS))


def _table(op: str) -> dict[str, Callable]:
    try:
        return _IMPLS[op]
    except KeyError:
        raise ValueError(f"no kernel named {op!r}; registered: {sorted(_IMPLS)}") from None


def choose(op: str, backend: str, interpret: bool | None) -> Choice:
    """The implementation of ``op`` that ``backend``/``interpret`` select here.

    :func:`resolve`'s choice, or the reference when ``op`` has no
    implementation of that flavour.
    """
    choice = resolve(backend, interpret)
    if choice.flavor not in _table(op):
        return Choice("reference", False)
    return choice


def run(op: str, choice: Choice, *args, **static):
    """Run ``op``'s implementation for ``choice`` (from :func:`choose`) under jit.

    ``args`` are arrays or pytrees; ``static`` keyword arguments must be
    hashable (ints, tuples, frozen dataclasses): they are jit static arguments.
    """
    if choice.flavor not in _table(op):
        raise ValueError(f"{op} has no {choice.flavor!r} implementation (use choose())")
    return _run(op, choice, tuple(sorted(static.items())), args)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _run(op: str, choice: Choice, static: tuple, args: tuple):
    fn = _IMPLS[op][choice.flavor]
    return fn(*args, interpret=choice.interpret_arg(), **dict(static))


# --------------------------------------------------------------------------
# GPU lowering
# --------------------------------------------------------------------------


def gpu_compiler_params(num_warps: int = 4):
    """``compiler_params`` of every GPU-flavoured ``pallas_call`` in ``pallas_kernels``.

    The one place that picks the Pallas GPU lowering: Pallas Triton (masked
    pointer loads/stores, and the same kernel body runs in interpret mode on a
    CPU). BENCHMARKS.md ("Kernel design notes") records why not Mosaic GPU.
    """
    return triton.CompilerParams(num_warps=num_warps, num_stages=1)
