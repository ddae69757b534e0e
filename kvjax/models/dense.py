"""Dense reference forward of the tiny hybrid model: the correctness oracle.

One request, no cache, no padding, full recompute, written apart from the paged
path on purpose: plain causal softmax attention with repeated KV heads, RoPE as
a complex rotation, the conv as a sum over a zero-left-padded sequence and the
SSM as a plain recurrent loop. No kernel and no :mod:`kvjax.models` layer code
is used; only the parameter layout of :func:`kvjax.models.init_params` is shared.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from kvjax.models.caches import kv_storage_dtype
from kvjax.models.config import TinyHybridConfig

_FP8_MAX = 448.0  # largest finite float8_e4m3fn


def _rms(x, w, eps):
    return x / jnp.sqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps) * w


def _rope(x, theta):
    """RoPE of ``x [n, H, D]`` at positions ``0..n-1``: ``x_i + i*x_{i+D/2}`` as complex numbers."""
    n, _, D = x.shape
    half = D // 2
    freqs = 1.0 / (theta ** (np.arange(half, dtype=np.float64) * 2.0 / D))
    rot = np.exp(1j * np.outer(np.arange(n), freqs)).astype(np.complex64)[:, None, :]
    xc = jax.lax.complex(x[..., :half], x[..., half:]) * rot
    return jnp.concatenate([jnp.real(xc), jnp.imag(xc)], axis=-1)


# float32 value of every float8_e4m3fn bit pattern.
_FP8_VALUES = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)


def _fp8_round_trip(x, scale):
    """What an fp8 cache gives back: ``float8(saturate(x / scale)) * scale``.

    The float8 value is read back from a table indexed by its bits: XLA:GPU
    (``xla_allow_excess_precision``) drops a plain ``f32 -> fp8 -> f32`` convert
    pair, which would leave K/V unquantised on the reference side.
    """
    q = jnp.clip(x / scale, -_FP8_MAX, _FP8_MAX).astype(jnp.float8_e4m3fn)
    bits = jax.lax.bitcast_convert_type(q, jnp.uint8).astype(jnp.int32)
    return jnp.asarray(_FP8_VALUES)[bits] * scale


def _attention(lp, c: TinyHybridConfig, x, fp8: bool):
    n = x.shape[0]
    h = _rms(x, lp["norm"], c.rms_eps)
    q = _rope((h @ lp["wq"]).reshape(n, c.num_heads, c.head_dim), c.rope_theta)
    k = _rope((h @ lp["wk"]).reshape(n, c.num_kv_heads, c.head_dim), c.rope_theta)
    v = (h @ lp["wv"]).reshape(n, c.num_kv_heads, c.head_dim)
    if fp8:
        k, v = _fp8_round_trip(k, c.k_scale), _fp8_round_trip(v, c.v_scale)
    rep = c.num_heads // c.num_kv_heads
    k, v = jnp.repeat(k, rep, axis=1), jnp.repeat(v, rep, axis=1)
    s = jnp.einsum("qhd,khd->hqk", q, k) / np.sqrt(c.head_dim)
    causal = np.tril(np.ones((n, n), bool))
    p = jax.nn.softmax(jnp.where(causal, s, -jnp.inf), axis=-1)
    o = jnp.einsum("hqk,khd->qhd", p, v).reshape(n, -1)
    return x + o @ lp["wo"]


def _mamba(lp, c: TinyHybridConfig, x):
    n = x.shape[0]
    H, P, N = c.mamba_num_heads, c.mamba_head_dim, c.mamba_d_state
    G, W = c.mamba_n_groups, c.conv_width
    di = c.d_inner
    h = _rms(x, lp["norm"], c.rms_eps)
    proj = h @ lp["in_proj"]
    z, xbc, dt = proj[:, :di], proj[:, di : di + c.conv_dim], proj[:, di + c.conv_dim :]
    # Causal depthwise conv: output t sees inputs t-W+1 .. t (zeros before the start).
    padded = jnp.concatenate([jnp.zeros((W - 1, c.conv_dim), xbc.dtype), xbc], axis=0)
    conv = lp["conv_bias"] + sum(lp["conv_weight"][:, j] * padded[j : j + n] for j in range(W))
    conv = conv * jax.nn.sigmoid(conv)
    xs = conv[:, :di].reshape(n, H, P)
    Bg = conv[:, di : di + G * N].reshape(n, G, N)
    Cg = conv[:, di + G * N :].reshape(n, G, N)
    Bh, Ch = jnp.repeat(Bg, H // G, axis=1), jnp.repeat(Cg, H // G, axis=1)  # [n, H, N]
    delta = jax.nn.softplus(dt + lp["dt_bias"])  # [n, H]
    A = -jnp.exp(lp["A_log"])  # [H]

    def step(state, inp):  # state [H, P, N]
        xt, dtt, bt, ct = inp
        decay = jnp.exp(dtt * A)[:, None, None]
        state = state * decay + (dtt[:, None] * xt)[:, :, None] * bt[:, None, :]
        return state, jnp.einsum("hpn,hn->hp", state, ct)

    _, y = jax.lax.scan(step, jnp.zeros((H, P, N), jnp.float32), (xs, delta, Bh, Ch))
    y = y + lp["D"][None, :, None] * xs
    y = y.reshape(n, di) * jax.nn.silu(z)
    y = _rms(y, lp["gate_norm"], c.rms_eps)
    return x + y @ lp["out_proj"]


def _moe(lp, c: TinyHybridConfig, x):
    """Every expert on every token, weighted by the top-k softmax gate (0 for unpicked experts)."""
    h = _rms(x, lp["norm"], c.rms_eps)
    logits = h @ lp["router"]
    vals, picked = jax.lax.top_k(logits, c.moe_top_k)
    weights = jax.nn.softmax(vals, axis=-1)
    out = jnp.zeros_like(x)
    for e in range(c.moe_num_experts):
        gate = jnp.sum(jnp.where(picked == e, weights, 0.0), axis=-1)  # [n]
        hidden = jax.nn.silu(h @ lp["w_gate"][e]) * (h @ lp["w_up"][e])
        out = out + gate[:, None] * (hidden @ lp["w_down"][e])
    return x + out


@functools.partial(jax.jit, static_argnames=("config", "kv_cache_dtype"))
def dense_forward(
    params: dict,
    config: TinyHybridConfig,
    tokens: jax.Array,
    kv_cache_dtype: str = "auto",
) -> jax.Array:
    """Logits of every position of one request, recomputed from scratch.

    Args:
      params: from :func:`kvjax.models.init_params`.
      config: static.
      tokens: int32 ``[n]``, ``n >= 1``, ids in ``[0, vocab_size)``.
      kv_cache_dtype: ``"fp8"`` applies the fp8 cache's quantise / dequantise
        (``config.k_scale`` / ``v_scale``) to K and V, as the paged path sees them.

    Returns:
      float32 ``[n, vocab_size]``; row ``t`` predicts token ``t + 1``.
    """
    fp8 = kv_storage_dtype(kv_cache_dtype) != jnp.float32
    c = config
    p = params["params"]
    if tokens.ndim != 1 or tokens.shape[0] == 0:
        raise ValueError(f"tokens must have shape [n] with n >= 1, got {list(tokens.shape)}")
    x = p["embed"][tokens]
    for i, kind in enumerate(c.layer_types):
        lp = p[f"layer_{i}"]
        if kind == "attn":
            x = _attention(lp, c, x, fp8)
        elif kind == "moe":
            x = _moe(lp, c, x)
        else:
            x = _mamba(lp, c, x)
    return _rms(x, p["final_norm"], c.rms_eps) @ p["lm_head"]
