"""The ``("data", "model")`` device mesh a :class:`~kvjax.runner.Runner` runs over.

Data parallelism: every data rank owns its request rows, block ids, null block 0
and null slot 0, with the same shapes and rules as a single device; each has its
own host scheduler and block pool. Tensor parallelism: the model's heads are
split over "model" (:meth:`~kvjax.models.interface.Model.shard`). One device is
the 1x1 mesh.
"""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from kvjax.models.interface import DATA, MESH_AXES, MODEL

__all__ = ["DATA", "MESH_AXES", "MODEL", "check_mesh", "check_mesh_layout", "force_host_device_count", "global_array", "make_mesh",
           "parse_mesh_shape"]


def parse_mesh_shape(text: str) -> tuple[int, int]:
    """``"data=D,model=M"`` (either part optional, default 1) -> ``(D, M)``."""
    sizes = {DATA: 1, MODEL: 1}
    parts = [p.strip() for p in str(text).split(",")]
    if not any(parts):
        raise ValueError(f"mesh must look like 'data=D,model=M', got {text!r}")
    seen = set()
    for part in filter(None, parts):
        name, sep, value = part.partition("=")
        if not sep or name.strip() not in sizes:
            raise ValueError(f"mesh must look like 'data=D,model=M', got {text!r}")
        if name.strip() in seen:
            raise ValueError(f"mesh names axis {name.strip()!r} twice: {text!r}")
        seen.add(name.strip())
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


def check_mesh_layout(kv_layout: str, model: int) -> None:
    """``ValueError`` unless ``kv_layout`` works with ``model``-way tensor parallelism (the rpa
    layout's K/V interleaving is not split over heads: ``model`` must be 1)."""
    if model > 1 and kv_layout != "flash":
        raise ValueError(f"tensor parallelism (model={model}) supports kv_layout='flash', got {kv_layout!r}")


def check_mesh(mesh) -> None:
    """``ValueError`` unless ``mesh`` is a ``jax.sharding.Mesh`` with axes ``("data", "model")``."""
    if not isinstance(mesh, Mesh) or tuple(mesh.axis_names) != MESH_AXES:
        got = getattr(mesh, "axis_names", type(mesh).__name__)
        raise ValueError(f"mesh must be a jax.sharding.Mesh with axes {MESH_AXES}, got {got}")


def global_array(sharding: NamedSharding, shape, host_value: np.ndarray) -> jax.Array:
    """A global array from a host value every process holds in full."""
    return jax.make_array_from_callback(tuple(shape), sharding, lambda idx: host_value[idx])
