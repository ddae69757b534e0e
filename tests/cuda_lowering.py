"""Lowering for CUDA on a host without a GPU, the one way the tests do it.

JAX 0.11's Pallas Triton lowering reads the target GPU from the abstract mesh ("No supported GPU
devices found" without one; JAX 0.10 did not ask), so every lowering for CUDA runs under an
abstract H100: :func:`abstract_cuda` around a trace, or :func:`lower_for_cuda` for a function
and its arguments.
"""

from __future__ import annotations

import contextlib

import jax

#: The GPU the tests lower for.
CUDA = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=None, platform="cuda")


@contextlib.contextmanager
def abstract_cuda():
    """The current abstract mesh with :data:`CUDA` as its device, for a lowering for CUDA."""
    mesh = jax.sharding.get_abstract_mesh()
    with jax.sharding.use_abstract_mesh(mesh.update(abstract_device=CUDA)):
        yield


def lower_for_cuda(fn, *args) -> str:
    """StableHLO text of ``jax.jit(fn)`` lowered for CUDA over the arguments' shapes and dtypes
    (arrays or ``ShapeDtypeStruct``s, in any pytree)."""
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)
    with abstract_cuda():
        return jax.jit(fn).trace(*abstract).lower(lowering_platforms=("cuda",)).as_text()
