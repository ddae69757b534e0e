"""Assertions for kernel and state tests: whole arrays, bit for bit, and TPU race checks."""

from __future__ import annotations

import numpy as np

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def bits(x) -> np.ndarray:
    """The raw bits of an array (NaN payloads and -0.0 included) as unsigned ints."""
    x = np.asarray(x)
    return x.view(_UINT[x.dtype.itemsize])


def assert_bitwise(actual, expected, name: str = "array") -> None:
    """``actual`` and ``expected`` have the same dtype width, shape and every bit.

    The message names the array, how many elements differ, the first index and
    both values in hex.
    """
    a, e = bits(actual), bits(expected)
    assert a.dtype == e.dtype and a.shape == e.shape, (
        f"{name}: {np.asarray(actual).dtype}{a.shape} vs {np.asarray(expected).dtype}{e.shape}"
    )
    diff = np.argwhere(a != e)
    if diff.size:
        i = tuple(int(v) for v in diff[0])
        raise AssertionError(
            f"{name}: {len(diff)} elements differ, first at {i}: got {a[i]:#x}, expected {e[i]:#x}"
        )


def races_found() -> bool | None:
    """The TPU interpreter's race flag, or ``None`` when this JAX does not expose it.

    Reads the private ``interpret_pallas_call.races`` (as JAX's own tests do).
    """
    try:
        from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
    except ImportError:
        return None
    races = getattr(ipc, "races", None)
    return None if races is None else bool(races.races_found)
