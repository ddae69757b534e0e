"""A block's residual add and the next block's RMS norm, as one op: ``residual_rms_norm``.

A pre-norm block stack ends each block by adding its output to the residual stream and
starts the next one by normalising the stream::

    x' = x + where(keep, out * scale, 0)                      # keep: the step's real tokens
    h  = x' * rsqrt(mean(x'^2, axis=-1) + eps) * weight         # float32

``x'`` has two users (the norm and the next residual add), so XLA:GPU runs this as two
kernels: an elementwise add, then a Triton normalisation fusion. At a one-token decode step
each is a launch-bound kernel of ~1.5-1.8 us, two per block (Granite-4.0-H-Micro: 80 blocks
a step). ``keep`` is a select, not a product: a masked row's ``out`` is never read into
``x'`` (a NaN there stays out), so a padded row of the stream stays as it was.

Implementations (picked by :func:`pallas_kernels.backend.resolve`):

* reference: the two expressions above, in that order (the models' own code before this op:
  on a CPU a model step is bitwise what it was).
* GPU (Pallas Triton): one program per row; the row is read once, ``x'`` and ``h`` are
  written from registers. The row sum runs in a different order from XLA's reduction, so
  ``h`` agrees with the reference to float32 rounding, not bitwise; ``x'`` is exact.

No TPU kernel: there the reference runs (XLA:TPU fuses the pair itself).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels import backend as _backend
from pallas_kernels import contract as validation
from pallas_kernels import gpu_tiling

OP_RESIDUAL_NORM = "residual_rms_norm"


@_backend.register(OP_RESIDUAL_NORM, "reference")
def _reference(x, out, keep, weight, *, eps, scale, interpret):
    del interpret
    if scale != 1.0:
        out = out * jnp.float32(scale)
    x = x + jnp.where(keep.astype(bool)[:, None], out, 0.0)
    h = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * weight
    return x, h


@_backend.register(OP_RESIDUAL_NORM, "gpu")
def _gpu(x, out, keep, weight, *, eps, scale, interpret):
    T, D = x.shape
    gpu_tiling.check_int32_offsets("x", (T, D))  # the kernel's index arithmetic is int32
    Dp = pl.next_power_of_2(D)  # Triton blocks are powers of two: the tail is masked
    load, store = _backend.triton.load, _backend.triton.store
    h_dtype = jnp.result_type(jnp.float32, weight.dtype)

    def kernel(x_ref, out_ref, keep_ref, w_ref, xo_ref, h_ref):
        # Inputs:  x_ref f32[T * D], out_ref [T * D] (float), keep_ref bool / int[T], w_ref [D]
        # Outputs: xo_ref f32[T * Dp] (x'), h_ref [T * Dp] (h, float32 or wider): rows padded
        #          to Dp columns, so that every lane has its own address (interpret mode
        #          writes masked lanes back); the padding is sliced off
        r = pl.program_id(0)
        cols = jnp.arange(Dp, dtype=jnp.int32)
        ok = cols < D
        at = r * D + jnp.minimum(cols, D - 1)  # masked lanes' loads stay in the row
        xr = load(x_ref.at[at], mask=ok, other=0.0)
        o = load(out_ref.at[at], mask=ok, other=0.0).astype(jnp.float32)
        if scale != 1.0:
            o = o * jnp.float32(scale)
        xr = xr + jnp.where(keep_ref[r].astype(jnp.bool_) & ok, o, 0.0)
        ms = jnp.sum(xr * xr) / jnp.float32(D)
        w = load(w_ref.at[jnp.minimum(cols, D - 1)], mask=ok, other=0.0).astype(h_dtype)
        h = xr * jax.lax.rsqrt(ms + jnp.float32(eps)) * w
        store(xo_ref.at[r * Dp + cols], xr, mask=ok)
        store(h_ref.at[r * Dp + cols], h.astype(h_dtype), mask=ok)

    xo, h = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((T * Dp,), jnp.float32), jax.ShapeDtypeStruct((T * Dp,), h_dtype)),
        grid=(T,),
        compiler_params=_backend.gpu_compiler_params(num_warps=4 if Dp <= 2048 else 8),
        interpret=interpret,
        name="residual_rms_norm_gpu",
    )(x.reshape(-1), out.reshape(-1), keep, weight)
    xo, h = xo.reshape(T, Dp), h.reshape(T, Dp)
    return (xo, h) if Dp == D else (xo[:, :D], h[:, :D])


def _check(x, out, keep, weight, eps, scale):
    validation.check_rank("x", x, 2)
    validation.check_dtype("x", x, jnp.float32)
    T, D = np.shape(x)
    validation.check_shape("out", out, (T, D))
    validation.check_dtype("out", out, "floating")
    validation.check_shape("keep", keep, (T,))
    validation.check_dtype("keep", keep, (np.bool_, "integer"))
    validation.check_shape("weight", weight, (D,))
    validation.check_dtype("weight", weight, "floating")
    for name, v, lo in (("eps", eps, 0.0), ("scale", scale, None)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v) or (lo is not None and v <= lo):
            want = "a finite float > 0" if lo is not None else "a finite float"
            raise ValueError(f"{name} must be {want}, got {v!r}")


def residual_rms_norm(x, out, keep, weight, *, eps: float, scale: float = 1.0, backend: str = "auto",
                      interpret: bool | None = None):
    """Add a block's output to the residual stream and RMS-normalise the result (module docstring).

    Args:
      x: float32 ``[T, D]``, the residual stream.
      out: floating ``[T, D]``, the block's output (read only where ``keep``).
      keep: bool or integer ``[T]``: rows whose ``out`` is added (the others keep ``x``).
      weight: floating ``[D]``, the norm's weight.
      eps: the norm's epsilon (static, > 0).
      scale: ``out``'s multiplier (static; a residual multiplier), applied before the add.
      backend, interpret: see :mod:`pallas_kernels.backend`.

    Returns:
      ``(x', h)``: float32 ``[T, D]`` and ``[T, D]`` in float32 (or ``weight``'s dtype where
      that is wider).

    Raises:
      ValueError: a bad shape or dtype, or a non-finite ``eps`` / ``scale`` (``eps`` must be > 0).
    """
    choice = _backend.choose(OP_RESIDUAL_NORM, backend, interpret)
    _check(x, out, keep, weight, eps, scale)
    if np.shape(x)[0] == 0:
        return _reference(x, out, jnp.asarray(keep, bool), weight, eps=float(eps), scale=float(scale),
                          interpret=False)
    return _backend.run(OP_RESIDUAL_NORM, choice, x, out, jnp.asarray(keep), weight,
                        eps=float(eps), scale=float(scale))
