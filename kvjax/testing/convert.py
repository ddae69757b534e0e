"""Exact array conversion between numpy / JAX and torch, for differential tests.

Every conversion copies bits, never values: NaN payloads, the sign of zero and
subnormals survive a round trip. bfloat16 travels as its 16-bit pattern
(``int16`` view) and float8_e4m3fn as bytes (``uint8`` view), because numpy
only knows those types through ``ml_dtypes`` and torch cannot build them from
numpy directly.

Supported dtypes: bool, uint8, int8, int16, int32, int64, float16, bfloat16,
float32, float64, float8_e4m3fn.

64-bit values and JAX: with ``jax_enable_x64`` off JAX has no 64-bit arrays.
:func:`to_jax` then returns int64 data as int32 and float64 data as float32
only when every value is exactly representable there, and raises
``ValueError`` otherwise (it never truncates silently).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

__all__ = ["to_jax", "to_numpy", "to_torch", "torch_dtype", "SUPPORTED_DTYPES"]

SUPPORTED_DTYPES = (
    np.dtype(np.bool_),
    np.dtype(np.uint8),
    np.dtype(np.int8),
    np.dtype(np.int16),
    np.dtype(np.int32),
    np.dtype(np.int64),
    np.dtype(np.float16),
    np.dtype(ml_dtypes.bfloat16),
    np.dtype(np.float32),
    np.dtype(np.float64),
    np.dtype(ml_dtypes.float8_e4m3fn),
)

# numpy dtypes that torch cannot take through torch.from_numpy: carried as a
# same-width integer view, then reinterpreted on the torch side.
_BITS_VIEW = {
    np.dtype(ml_dtypes.bfloat16): np.dtype(np.int16),
    np.dtype(ml_dtypes.float8_e4m3fn): np.dtype(np.uint8),
}


def _torch():
    import torch  # torch is a test-only dependency: imported on first use

    return torch


def torch_dtype(dt: np.dtype):
    """The torch dtype of numpy dtype ``dt`` (one of :data:`SUPPORTED_DTYPES`)."""
    torch = _torch()
    table = {
        np.dtype(np.bool_): torch.bool,
        np.dtype(np.uint8): torch.uint8,
        np.dtype(np.int8): torch.int8,
        np.dtype(np.int16): torch.int16,
        np.dtype(np.int32): torch.int32,
        np.dtype(np.int64): torch.int64,
        np.dtype(np.float16): torch.float16,
        np.dtype(ml_dtypes.bfloat16): torch.bfloat16,
        np.dtype(np.float32): torch.float32,
        np.dtype(np.float64): torch.float64,
        np.dtype(ml_dtypes.float8_e4m3fn): torch.float8_e4m3fn,
    }
    return table[dt]


def _numpy_dtype(tdtype) -> np.dtype:
    for dt in SUPPORTED_DTYPES:
        if torch_dtype(dt) == tdtype:
            return dt
    raise ValueError(
        f"tensor dtype must be one of {[str(d) for d in SUPPORTED_DTYPES]}, got {tdtype}"
    )


def to_torch(x, device=None):
    """A torch tensor holding exactly the bits of ``x`` (numpy or JAX array, or scalar).

    The result owns its memory (a copy; never a view of a JAX buffer).
    ``device``: torch device for the result (default CPU).

    Raises:
      ValueError: an unsupported dtype.
    """
    torch = _torch()
    a = np.array(x, copy=True, order="C")  # JAX -> host copy; bits are preserved
    dt = a.dtype
    if dt not in SUPPORTED_DTYPES:
        raise ValueError(f"x must have one of {[str(d) for d in SUPPORTED_DTYPES]}, got {dt}")
    view = _BITS_VIEW.get(dt)
    if view is None:
        t = torch.from_numpy(a)
    else:
        t = torch.from_numpy(a.view(view)).view(torch_dtype(dt))
    return t if device is None else t.to(device)


def to_numpy(t) -> np.ndarray:
    """A numpy array (``ml_dtypes`` types for bf16/fp8) with exactly the bits of torch ``t``.

    Raises:
      ValueError: an unsupported dtype.
    """
    torch = _torch()
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"t must be a torch.Tensor, got {type(t).__name__}")
    dt = _numpy_dtype(t.dtype)
    t = t.detach().to("cpu").contiguous()
    view = _BITS_VIEW.get(dt)
    if view is None:
        return t.numpy().copy()
    return t.view(torch_dtype(view)).numpy().copy().view(dt)


def to_jax(t) -> jax.Array:
    """A JAX array with exactly the bits of torch ``t`` (see the module note on 64-bit data).

    Raises:
      ValueError: an unsupported dtype, or 64-bit values that do not fit 32 bits
        exactly while ``jax_enable_x64`` is off.
    """
    a = to_numpy(t)
    if a.dtype.itemsize == 8 and not jax.config.jax_enable_x64:
        narrow = np.dtype(np.int32) if a.dtype == np.int64 else np.dtype(np.float32)
        with np.errstate(over="ignore", invalid="ignore"):
            b = a.astype(narrow)
        # Bitwise round trip: catches overflow, lost precision, -0.0 and NaN payloads.
        same = np.array_equal(b.astype(a.dtype).view(np.uint64), a.view(np.uint64))
        if not same:
            raise ValueError(
                f"t has {a.dtype} values that {narrow} cannot hold exactly and jax_enable_x64 "
                f"is off; enable x64 (jax.config.update('jax_enable_x64', True)) to convert it"
            )
        a = b
    return jnp.asarray(a)
