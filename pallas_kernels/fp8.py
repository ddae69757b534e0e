"""fp8 (``float8_e4m3fn``) quantisation, shared by every KV write kernel and its reference.

The stored value of an fp8 KV cache is ``saturate(x / scale)``, computed in float32 and
rounded to nearest even (NaN stays NaN, +-inf and anything beyond +-:data:`FP8_MAX`
become +-:data:`FP8_MAX`). Every implementation must produce the same bytes, so the
division itself is shared: :func:`ieee_divide` wherever XLA executes it (references,
interpret mode), :func:`ptx_div_rn` inside a Pallas Triton kernel. The dtype and the
accepted ``kv_cache_dtype`` strings are :mod:`pallas_kernels.contract`'s.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import backend as _backend
from pallas_kernels.contract import FP8_DTYPE

__all__ = ["FP8_DTYPE", "FP8_MAX", "ieee_divide", "ptx_div_rn", "quantize_fp8"]

# Largest finite float8_e4m3fn value; "saturate" clamps to +-FP8_MAX.
FP8_MAX = float(jnp.finfo(FP8_DTYPE).max)  # 448.0


def ieee_divide(x, scale):
    """IEEE float32 ``x / scale`` (round to nearest even), exact under any XLA backend.

    Plain ``x / scale`` is not: XLA:GPU divides float32 with ``div.full.f32``
    (up to 1 ulp off, openxla/xla#37181), and XLA's simplifier rewrites
    ``x / broadcast(s)`` as ``x * broadcast(1 / s)`` (two roundings: -90 / 0.9
    becomes -100.00001, not -100). Either moves some quotients across an fp8
    rounding boundary. So the quotient is computed here by integer long
    division of the significands, which every backend does exactly:

    1. unpack ``x`` and ``scale`` into 24-bit significands ``a``, ``b`` and
       exponents (subnormal ``x`` normalised with ``clz``);
    2. make ``b <= a < 2b`` and take 26 quotient bits, one per step, plus a
       sticky bit for a non-zero remainder;
    3. round to nearest even at bit 24 (further down for a subnormal result)
       and repack; overflow gives +-inf.

    Lanes where ``x`` is 0, inf or NaN, or ``scale`` is not a positive normal
    float32, use ``x / scale`` (exact for those, or the caller's problem).

    Args:
      x: float32 array.
      scale: float32, broadcastable to ``x``.

    Returns:
      float32 array of ``x``'s shape, bit-identical to numpy's ``x / scale``.
    """
    x = x.astype(jnp.float32)
    scale = jnp.broadcast_to(scale, x.shape).astype(jnp.float32)
    xb = jax.lax.bitcast_convert_type(x, jnp.int32)
    sb = jax.lax.bitcast_convert_type(scale, jnp.int32)
    sign = xb & jnp.int32(-(2**31))
    x_exp, x_frac = (xb & 0x7FFFFFFF) >> 23, xb & 0x7FFFFF
    subnormal = x_exp == 0
    norm_shift = jnp.where(subnormal, jax.lax.clz(x_frac) - 8, 0)
    a = jnp.where(subnormal, x_frac << norm_shift, x_frac | 0x800000)  # [2^23, 2^24)
    x_exp = jnp.where(subnormal, 1 - norm_shift, x_exp)
    b = (sb & 0x7FFFFF) | 0x800000  # [2^23, 2^24)
    below = a < b
    a = jnp.where(below, a << 1, a)  # now b <= a < 2b: the quotient is in [1, 2)
    biased_exp = x_exp - (sb >> 23) + 127 - below.astype(jnp.int32)
    q = jnp.zeros_like(a)
    for _ in range(26):  # 24 significand bits + 2 below them
        bit = a >= b
        q = (q << 1) | bit.astype(jnp.int32)
        a = jnp.where(bit, a - b, a) << 1
    bits = (q << 1) | (a != 0).astype(jnp.int32)  # 27 bits: quotient, then sticky
    exp_field = jnp.maximum(biased_exp, 1)  # a subnormal result has exponent field 0
    drop = jnp.minimum(3 + (exp_field - biased_exp), 28)  # bits below the last kept one
    kept = jax.lax.shift_right_logical(bits, drop)
    rest = bits & ((1 << drop) - 1)
    half = 1 << (drop - 1)
    kept = kept + ((rest > half) | ((rest == half) & ((kept & 1) == 1))).astype(jnp.int32)
    # The kept significand carries the implicit 1 (0x800000), so exponent and a
    # rounding carry add up; a subnormal result (exp_field 1, kept < 2^23) too.
    magnitude = ((jnp.minimum(exp_field, 255) - 1) << 23) + kept
    magnitude = jnp.minimum(magnitude, 0x7F800000)  # overflow: inf
    quotient = jax.lax.bitcast_convert_type(sign | magnitude, jnp.float32)
    regular = (
        jnp.isfinite(x) & (x != 0) & (sb >= 0x00800000) & (sb < 0x7F800000)  # scale normal, > 0
    )
    return jnp.where(regular, quotient, x / scale)


def quantize_fp8(x, scale, *, divide=ieee_divide):
    """``saturate(x / scale)`` in float32, rounded to nearest even, as float8_e4m3fn.

    Args:
      x: any float array.
      scale: float32, broadcastable to ``x``.
      divide: the float32 division: :func:`ieee_divide` (the default) for
        anything XLA executes; the GPU kernel passes ``div.rn.f32``.

    Returns:
      float8_e4m3fn array of ``x``'s shape. NaN stays NaN; values beyond
      +-448 (including +-inf) become +-448.
    """
    y = divide(x.astype(jnp.float32), scale)
    # Written as two selects, not jnp.clip: comparisons with NaN are false, so
    # NaN passes through unchanged on every lowering (min/max NaN semantics
    # differ between backends).
    y = jnp.where(y > FP8_MAX, FP8_MAX, y)
    y = jnp.where(y < -FP8_MAX, -FP8_MAX, y)
    return y.astype(FP8_DTYPE)


def ptx_div_rn(x, y):
    """Correctly rounded float32 ``x / y`` inside a Pallas Triton kernel.

    Triton lowers float32 ``/`` to ``div.full.f32`` (up to 2 ulp off), which
    would move some quotients across an fp8 rounding boundary; ``div.rn.f32``
    is IEEE division, identical to XLA's and numpy's.
    """
    [q] = _backend.triton.elementwise_inline_asm(
        "div.rn.f32 $0, $1, $2;",
        args=[x, jnp.broadcast_to(y, x.shape)],
        constraints="=f,f,f",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)],
    )
    return q
