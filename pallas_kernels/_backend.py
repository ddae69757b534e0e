"""One place that decides which implementation of a kernel runs.

Every public kernel takes ``backend`` and ``interpret`` and calls
:func:`resolve`, which returns a :class:`Choice`:

* ``backend="reference"``: the pure-jnp reference (plain XLA).
* ``backend="pallas"``: the Pallas kernel for the current platform (Mosaic on
  TPU, the GPU lowering on GPU). On a CPU there is nothing to compile for, so
  it runs the TPU kernel in interpret mode.
* ``backend="pallas_tpu"`` / ``"pallas_gpu"``: that flavour of the kernel,
  whatever the platform (interpret mode on a CPU).
* ``backend="auto"`` (default): Pallas on TPU and GPU, the reference on CPU,
  unless the environment variable ``KVJAX_INTERPRET=1`` is set, in which case
  the Pallas kernels run in interpret mode on CPU (the switch the test suite
  uses to run every kernel through the interpreter).

``interpret=None`` means "interpret iff the platform cannot compile this
flavour"; ``True``/``False`` force it.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Literal

import jax

from pallas_kernels import tpu_target

BACKENDS = ("auto", "reference", "pallas", "pallas_tpu", "pallas_gpu")
INTERPRET_ENV = "KVJAX_INTERPRET"

Flavor = Literal["reference", "tpu", "gpu"]


@dataclasses.dataclass(frozen=True)
class Choice:
    """The implementation a kernel call runs.

    Attributes:
      flavor: ``"reference"``, ``"tpu"`` (Mosaic TPU kernel) or ``"gpu"``.
      interpret: run the Pallas kernel through the interpreter.
    """

    flavor: Flavor
    interpret: bool

    def tpu_interpret_params(self):
        """``interpret=`` argument for a TPU-flavoured ``pallas_call``."""
        if not self.interpret:
            return False
        from jax.experimental.pallas import tpu as pltpu

        return pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")


def env_forces_interpret() -> bool:
    """True when ``KVJAX_INTERPRET`` is set to a true value (1/true/yes)."""
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
    """Pick the implementation for ``backend``/``interpret`` on this platform.

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
