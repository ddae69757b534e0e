"""Mamba2-style layer over the recurrent-state pools, for one mixed step.

``in_proj -> [z | xBC | dt]``; ``xBC -> causal depthwise conv (width W) + SiLU ->
[x | B | C]``; selective SSM with per-head scalar ``dt`` and ``A``, ``D`` skip and
gate ``y * silu(z)``; gated RMS norm; ``out_proj``.

A step mixes prefill chunks and decode rows, in any row order. Both paths run
over the whole batch, each with the other's rows (and padded rows) given
``NULL_BLOCK_ID`` as their state index, so each row reads and writes state in
exactly one path; the token outputs are then picked per row:

* prefill rows: ``causal_conv1d_varlen`` + ``selective_scan_varlen`` over the
  packed tokens, starting from the slot's state iff ``num_computed_tokens > 0``
  (else from zero, never reading the slot);
* decode rows: ``causal_conv1d_update`` + ``selective_state_update``. Without
  speculation each decode row's single token is gathered into a ``[R, ...]``
  batch; with speculation (``state_indices [R, 1 + k]``) the decode rows' tokens
  are packed into a varlen batch and the kernels' speculative path runs (vLLM:
  token ``i`` stores its SSM state to ``state_indices[b, i]``, the initial state
  and conv window come from column / offset ``num_accepted_tokens - 1``).
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from kvjax.constants import NULL_BLOCK_ID
from kvjax.models.attention import _dense_init, rms_norm
from kvjax.models.config import TinyHybridConfig
from kvjax.models.step_context import StepContext
from kvjax.state.padding import gather_index, token_rows
from pallas_kernels.mamba import (
    causal_conv1d_update,
    causal_conv1d_varlen,
    selective_scan_varlen,
    selective_state_update,
)

# Mamba2's dt initialisation range (softplus(dt_bias) is log-uniform in it) and A range.
_DT_MIN, _DT_MAX = 1e-3, 1e-1
_A_MIN, _A_MAX = 1.0, 16.0


def _dt_bias_init(key, shape, dtype=jnp.float32):
    u = jax.random.uniform(key, shape, dtype)
    dt = jnp.exp(u * (math.log(_DT_MAX) - math.log(_DT_MIN)) + math.log(_DT_MIN))
    return dt + jnp.log(-jnp.expm1(-dt))  # inverse softplus


def _a_log_init(key, shape, dtype=jnp.float32):
    return jnp.log(jax.random.uniform(key, shape, dtype, _A_MIN, _A_MAX))


def _conv_init(key, shape, dtype=jnp.float32):
    """Uniform in ``+-1/sqrt(width)`` (torch's Conv1d default for a depthwise conv)."""
    bound = 1.0 / math.sqrt(shape[-1])
    return jax.random.uniform(key, shape, dtype, -bound, bound)


def _conv_bias_init(key, shape, dtype=jnp.float32):
    return jax.random.uniform(key, shape, dtype, -0.5, 0.5)


class MambaLayer(nn.Module):
    """Pre-norm Mamba2 block; ``x + mixer(norm(x))``.

    Params: ``norm [d]``, ``in_proj [d, in_proj_dim]``, ``conv_weight [conv_dim, W]``,
    ``conv_bias [conv_dim]``, ``dt_bias [H]``, ``A_log [H]`` (``A = -exp(A_log)``),
    ``D [H]``, ``gate_norm [d_inner]``, ``out_proj [d_inner, d]``.

    ``model_axis`` (tensor parallel, inside ``shard_map``): ``config`` gives this shard's
    heads; ``in_proj`` holds ``[z | x | B | C | dt]`` of its heads (B, C whole:
    ``mamba_n_groups == 1``), the gated norm's mean square and ``out_proj`` (a row
    shard) are summed over the axis.
    """

    config: TinyHybridConfig
    model_axis: str | None = None

    def setup(self):
        c = self.config
        H = c.mamba_num_heads
        self.norm = self.param("norm", nn.initializers.ones, (c.d_model,))
        self.in_proj = self.param("in_proj", _dense_init, (c.d_model, c.in_proj_dim))
        self.conv_weight = self.param("conv_weight", _conv_init, (c.conv_dim, c.conv_width))
        self.conv_bias = self.param("conv_bias", _conv_bias_init, (c.conv_dim,))
        self.dt_bias = self.param("dt_bias", _dt_bias_init, (H,))
        self.A_log = self.param("A_log", _a_log_init, (H,))
        self.D = self.param("D", nn.initializers.ones, (H,))
        self.gate_norm = self.param("gate_norm", nn.initializers.ones, (c.d_inner,))
        self.out_proj = self.param("out_proj", _dense_init, (c.d_inner, c.d_model))

    def declare(self):
        """Creates the params (used by ``init``)."""

    def __call__(
        self,
        x: jax.Array,  # [T, d] float32
        ctx: StepContext,
        conv_state: jax.Array,  # [num_slots, conv_dim, W - 1 + k]
        ssm_state: jax.Array,  # [num_slots, H, P, N]
        backend: str,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Returns ``(x, conv_state, ssm_state)``."""
        c = self.config
        T = x.shape[0]
        H, P = c.mamba_num_heads, c.mamba_head_dim
        h = rms_norm(x, self.norm, c.rms_eps)
        zxbcdt = h @ self.in_proj
        z = zxbcdt[:, : c.d_inner]
        xbc = zxbcdt[:, c.d_inner : c.d_inner + c.conv_dim]
        dt = zxbcdt[:, c.d_inner + c.conv_dim :]  # [T, H]
        A = -jnp.exp(self.A_log)  # [H]

        y_pre, conv_state, ssm_state = self._prefill(
            ctx, xbc, z, dt, A, conv_state, ssm_state, backend
        )
        if ctx.is_speculative:
            y_dec, conv_state, ssm_state = self._decode_spec(
                ctx, xbc, z, dt, A, conv_state, ssm_state, backend
            )
        else:
            y_dec, conv_state, ssm_state = self._decode(
                ctx, xbc, z, dt, A, conv_state, ssm_state, backend
            )
        R = ctx.num_rows
        row = gather_index(ctx.token_row, R)  # masked by token_real
        is_dec = ctx.token_real & ctx.decode_row[row]
        is_pre = ctx.token_real & ctx.prefill_row[row]
        y = jnp.where(is_dec[:, None, None], y_dec, jnp.where(is_pre[:, None, None], y_pre, 0.0))
        y = y.reshape(T, H * P)
        if self.model_axis is None:
            y = rms_norm(y, self.gate_norm, c.rms_eps)
            return x + y @ self.out_proj, conv_state, ssm_state
        ax = self.model_axis
        ms = jax.lax.psum(jnp.sum(y * y, axis=-1, keepdims=True), ax) / (H * P * jax.lax.axis_size(ax))
        y = y * jax.lax.rsqrt(ms + c.rms_eps) * self.gate_norm
        return x + jax.lax.psum(y @ self.out_proj, ax), conv_state, ssm_state

    # ------------------------------------------------------------------ paths

    def _split_xbc(self, xbc):
        """``[n, conv_dim]`` -> x ``[n, H, P]``, B, C ``[n, G, N]``."""
        c = self.config
        n = xbc.shape[0]
        G, N = c.mamba_n_groups, c.mamba_d_state
        xs = xbc[:, : c.d_inner].reshape(n, c.mamba_num_heads, c.mamba_head_dim)
        B = xbc[:, c.d_inner : c.d_inner + G * N].reshape(n, G, N)
        C = xbc[:, c.d_inner + G * N :].reshape(n, G, N)
        return xs, B, C

    def _prefill(self, ctx, xbc, z, dt, A, conv_state, ssm_state, backend):
        """Masked varlen conv + scan over the prefill rows; ``y [T, H, P]``."""
        c = self.config
        T = xbc.shape[0]
        slots = jnp.where(ctx.prefill_row, ctx.state_slot, NULL_BLOCK_ID)
        conv_out, conv_state = causal_conv1d_varlen(
            xbc.T,
            self.conv_weight,
            self.conv_bias,
            conv_state,
            ctx.query_start_loc,
            slots,
            ctx.has_initial_state,
            activation="silu",
            backend=backend,
        )
        xs, B, C = self._split_xbc(conv_out.T)
        y, ssm_state = selective_scan_varlen(
            xs,
            dt,
            A,
            B,
            C,
            ssm_state,
            ctx.query_start_loc,
            slots,
            ctx.has_initial_state,
            D=self.D,
            dt_bias=self.dt_bias,
            z=z.reshape(T, c.mamba_num_heads, c.mamba_head_dim),
            dt_softplus=True,
            backend=backend,
        )
        return y, conv_state, ssm_state

    def _decode_tokens(self, xbc_d, z_d, dt_d, A, conv_state, ssm_state, backend, **idx):
        """The two decode kernels on gathered tokens; ``y [n, H, P]``."""
        c = self.config
        n = xbc_d.shape[0]
        H, P = c.mamba_num_heads, c.mamba_head_dim
        conv_out, conv_state = causal_conv1d_update(
            xbc_d,
            conv_state,
            self.conv_weight,
            self.conv_bias,
            activation="silu",
            backend=backend,
            **idx["conv"],
        )
        xs, B, C = self._split_xbc(conv_out)
        y, ssm_state = selective_state_update(
            ssm_state,
            xs,
            dt_d[:, :, None],  # per-head scalar dt, broadcast over P (vLLM's TIE_HDIM)
            A[:, None, None],
            B,
            C,
            D=self.D[:, None],
            dt_bias=self.dt_bias[:, None],
            z=z_d.reshape(n, H, P),
            dt_softplus=True,
            backend=backend,
            **idx["ssm"],
        )
        return y, conv_state, ssm_state

    def _decode(self, ctx, xbc, z, dt, A, conv_state, ssm_state, backend):
        """One token per decode row, gathered into ``[R, ...]``; ``y [T, H, P]``."""
        T = xbc.shape[0]
        tok = jnp.where(ctx.decode_row, ctx.query_start_loc[:-1], T)  # T -> zero fill

        def gather(a):
            return jnp.take(a, tok, axis=0, mode="fill", fill_value=0)

        slots = jnp.where(ctx.decode_row, ctx.state_slot, NULL_BLOCK_ID)
        y_rows, conv_state, ssm_state = self._decode_tokens(
            gather(xbc),
            gather(z),
            gather(dt),
            A,
            conv_state,
            ssm_state,
            backend,
            conv={"conv_state_indices": slots},
            ssm={"state_batch_indices": slots},
        )
        row = gather_index(ctx.token_row, ctx.num_rows)  # masked by the caller
        return y_rows[row], conv_state, ssm_state

    def _decode_spec(self, ctx, xbc, z, dt, A, conv_state, ssm_state, backend):
        """Decode rows' tokens packed into a varlen batch (speculative path)."""
        T = xbc.shape[0]
        R = ctx.num_rows
        width = ctx.state_indices.shape[1]  # 1 + num_spec
        qsl = ctx.query_start_loc
        dlen = jnp.where(ctx.decode_row, ctx.query_len, 0)
        cu = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(dlen, dtype=jnp.int32)])
        u = jnp.arange(T, dtype=jnp.int32)  # packed index
        ub = gather_index(token_rows(cu, T), R)  # masked below by u < cu[R]
        src = jnp.where(u < cu[R], qsl[ub] + u - cu[ub], T)  # T -> zero fill

        def gather(a):
            return jnp.take(a, src, axis=0, mode="fill", fill_value=0)

        slots = jnp.where(ctx.decode_row[:, None], ctx.state_indices, NULL_BLOCK_ID)
        na = ctx.num_accepted_tokens
        y_packed, conv_state, ssm_state = self._decode_tokens(
            gather(xbc),
            gather(z),
            gather(dt),
            A,
            conv_state,
            ssm_state,
            backend,
            conv={
                "conv_state_indices": slots,
                "num_accepted_tokens": na,
                "query_start_loc": cu,
                "max_query_len": width,
            },
            ssm={
                "state_batch_indices": slots,
                "num_accepted_tokens": na,
                "cu_seqlens": cu,
            },
        )
        row = gather_index(ctx.token_row, R)  # masked by the caller
        t = jnp.arange(T, dtype=jnp.int32)
        packed = jnp.clip(cu[row] + t - qsl[row], 0, T - 1)  # masked by the caller
        return y_packed[packed], conv_state, ssm_state
