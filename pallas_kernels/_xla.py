"""XLA helpers shared by the jnp references."""

from __future__ import annotations

import jax
import jax.numpy as jnp

_UINT = {1: jnp.uint8, 2: jnp.uint16}


def scatter_set(array: jax.Array, index, values, *, mode: str = "drop") -> jax.Array:
    """``array.at[index].set(values, mode=mode)`` that keeps every untouched bit.

    XLA:CPU scatters into bfloat16 (and float8_e5m2) arrays through float32 and
    canonicalises every NaN of the *whole* array on the way (``0x7fe5`` becomes
    ``0x7fc0``), so a NaN-poisoned null block would change bits it never wrote.
    Floats of 2 bytes or less are therefore scattered through an unsigned view
    (a free bitcast); ``values`` are first cast to ``array.dtype``.
    """
    values = jnp.asarray(values).astype(array.dtype)
    dt = jnp.dtype(array.dtype)
    if jnp.issubdtype(dt, jnp.floating) and dt.itemsize in _UINT:
        u = _UINT[dt.itemsize]
        out = jax.lax.bitcast_convert_type(array, u).at[index].set(
            jax.lax.bitcast_convert_type(values, u), mode=mode
        )
        return jax.lax.bitcast_convert_type(out, dt)
    return array.at[index].set(values, mode=mode)
