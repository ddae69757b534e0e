"""One host-to-device transfer per step: pack a pytree of small arrays into one int32 buffer.

Every leaf (int32, bool or float32, any shape) becomes a run of int32 words
(bools widened, float32 bit-cast); :class:`PackSpec` remembers the tree
structure, shapes and dtypes (hashable: a static argument), and
:func:`unpack` rebuilds the pytree (inside ``jit`` with static slices, or on the
host from a numpy buffer). :func:`pack_device` is :func:`pack` inside ``jit``.

"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

_NAMES = {np.dtype(np.int32).char: "int32", np.dtype(np.bool_).char: "bool", np.dtype(np.float32).char: "float32"}


def _leaf_kind(dtype) -> str:
    """``"int32"``, ``"bool"`` or ``"float32"``: how a leaf of ``dtype`` is packed (else ValueError)."""
    name = _NAMES.get(np.dtype(dtype).char)
    if name is None:
        raise ValueError(f"pack supports int32, bool and float32 leaves, got {dtype}")
    return name


@dataclasses.dataclass(frozen=True)
class PackSpec:
    """How :func:`pack` laid out a tree: its structure and each leaf's shape and dtype name, in
    leaf order. Hashable (a static argument); ``size`` is the buffer length in int32 words."""

    treedef: jax.tree_util.PyTreeDef
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]

    @property
    def size(self) -> int:
        return int(sum(int(np.prod(s)) for s in self.shapes))


def pack(tree) -> tuple[np.ndarray, PackSpec]:
    """``tree`` (numpy leaves) -> (int32 ``[n]`` buffer, spec)."""
    leaves, treedef = jax.tree.flatten(tree)
    parts, shapes, dtypes = [], [], []
    for leaf in leaves:
        a = np.asarray(leaf)
        name = _leaf_kind(a.dtype)
        shapes.append(a.shape)
        dtypes.append(name)
        parts.append(a.reshape(-1).view(np.int32) if name == "float32" else a.reshape(-1))
    buf = np.concatenate(parts, dtype=np.int32) if parts else np.zeros((0,), np.int32)  # bools widened
    return buf, PackSpec(treedef, tuple(shapes), tuple(dtypes))


def unpack(buf, spec: PackSpec):
    """Inverse of :func:`pack`: under ``jit`` (``spec`` static) or of a numpy buffer on the host."""
    if buf.shape != (spec.size,):
        raise ValueError(f"packed buffer must have shape [{spec.size}], got {list(buf.shape)}")
    host = isinstance(buf, np.ndarray)
    leaves, off = [], 0
    for shape, dtype in zip(spec.shapes, spec.dtypes):
        n = int(np.prod(shape))
        part = buf[off: off + n].reshape(shape)
        off += n
        if dtype == "float32":
            part = part.view(np.float32) if host else jax.lax.bitcast_convert_type(part, jnp.float32)
        elif dtype == "bool":
            part = part != 0
        leaves.append(part)
    return jax.tree.unflatten(spec.treedef, leaves)


def spec_of(tree) -> PackSpec:
    """The :class:`PackSpec` :func:`pack` would give ``tree`` (leaves: arrays or ``jax.ShapeDtypeStruct``)."""
    leaves, treedef = jax.tree.flatten(tree)
    return PackSpec(treedef, tuple(tuple(leaf.shape) for leaf in leaves),
                    tuple(_leaf_kind(leaf.dtype) for leaf in leaves))


def pack_device(tree) -> jax.Array:
    """:func:`pack` of a tree of ``jax.Array`` (under ``jit``): int32 ``[spec_of(tree).size]``."""
    parts = []
    for leaf in jax.tree.leaves(tree):
        if _leaf_kind(leaf.dtype) == "float32":
            leaf = jax.lax.bitcast_convert_type(leaf, jnp.int32)
        parts.append(leaf.reshape(-1).astype(jnp.int32))
    return jnp.concatenate(parts) if parts else jnp.zeros((0,), jnp.int32)
