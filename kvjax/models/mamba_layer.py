"""Mamba2-style layer over the recurrent-state pools, for one mixed step.

``in_proj -> [z | xBC | dt]``; ``xBC -> causal depthwise conv (width W) + SiLU ->
[x | B | C]``; selective SSM with per-head scalar ``dt`` and ``A``, ``D`` skip and
gate ``y * silu(z)``; gated RMS norm; ``out_proj``.

A step mixes prefill chunks and decode rows, in any row order. A decode-only step
(``ctx.decode_only``, from its bucket: static) runs only the decode path; a mixed
step runs both, each over the whole batch, the other's rows (and padded rows)
given ``NULL_BLOCK_ID`` as their state index, so each row reads and writes state
in exactly one path; the token outputs are then picked per row:

* prefill rows: ``causal_conv1d_varlen`` + ``selective_scan_varlen`` over the
  packed tokens, starting from the slot's state iff ``num_computed_tokens > 0``
  (else from zero, never reading the slot);
* decode rows: ``causal_conv1d_update`` + ``selective_state_update``. Without
  speculation each decode row's single token is gathered into a ``[R, ...]``
  batch in a mixed step; a decode-only step runs the kernels over its tokens as
  they are (token ``t`` reads and writes its row's slot, a pad token the null
  slot), so nothing is gathered in or out, and they read z / xBC / dt as columns of the
  projection in place (:class:`~pallas_kernels.mamba.Columns`); with speculation (``state_indices
  [R, 1 + k]``) the decode rows' tokens are packed into a varlen batch and the
  kernels' speculative path runs (vLLM: token ``i`` stores its SSM state to
  ``state_indices[b, i]``, the initial state and conv window come from column /
  offset ``num_accepted_tokens - 1``).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from kvjax.constants import NULL_BLOCK_ID
from kvjax.models.attention import _dense_init, linear, pad_rows, rms_norm
from kvjax.models.config import TinyHybridConfig
from kvjax.models.step_context import StepContext
from kvjax.state.padding import gather_index, token_rows
from pallas_kernels.mamba import (
    Columns,
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


@dataclasses.dataclass(frozen=True)
class MambaSpec:
    """What one Mamba2 mixer computes (hashable; one tensor-parallel shard's heads).

    Attributes:
      num_heads, head_dim, d_state: SSM heads ``H``, head dim ``P``, state size ``N``.
      n_groups: B / C groups ``G`` (head ``h`` reads group ``h // (H / G)``).
      conv_width: depthwise causal conv width ``W``.
      rms_eps: epsilon of the gated RMS norm.
      norm_groups: the gated norm normalises each of ``norm_groups`` contiguous slices of
        ``d_inner`` on its own (Hugging Face's ``group_size = d_inner / n_groups``).
      norm_spans_shards: under ``model_axis``, the norm's (single) group spans every shard:
        its mean square is summed over the axis; otherwise each shard holds whole groups.
      dt_limit: ``dt' = clip(softplus(dt + dt_bias), lo, hi)``; ``(0, inf)`` is no clip.
    """

    num_heads: int
    head_dim: int
    d_state: int
    n_groups: int = 1
    conv_width: int = 4
    rms_eps: float = 1e-5
    norm_groups: int = 1
    norm_spans_shards: bool = True
    dt_limit: tuple[float, float] = (0.0, math.inf)

    @property
    def d_inner(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.n_groups * self.d_state

    @property
    def in_proj_dim(self) -> int:
        return self.d_inner + self.conv_dim + self.num_heads

    @property
    def clips_dt(self) -> bool:
        return tuple(self.dt_limit) != (0.0, math.inf)


def gated_rms_norm(y: jax.Array, weight: jax.Array, eps: float, groups: int) -> jax.Array:
    """RMS norm of each of ``groups`` contiguous slices of the last axis (float32), times ``weight``."""
    if groups == 1:
        return rms_norm(y, weight, eps)
    n, d = y.shape
    g = y.astype(jnp.float32).reshape(n, groups, d // groups)
    g = g * jax.lax.rsqrt(jnp.mean(g * g, axis=-1, keepdims=True) + eps)
    return g.reshape(n, d) * weight


def decay_rates(a_logs) -> jax.Array:
    """``A = -exp(A_log)`` (float32) of one or more Mamba layers with the same heads, heads
    major: ``[H, layers]``.

    A model computes its layers' rates here once per step and hands layer ``j``'s column,
    :func:`decay_rate` ``(rates, j)``, to that layer's :func:`mamba_mixer` (``A=``): one kernel
    for all layers, and the GPU SSM kernel reads its column in place (a row of a stacked array
    or a per-layer ``-exp`` is one copy or one kernel per layer: 36 per step in Granite). The
    table is materialised behind an optimisation barrier so that XLA keeps it one
    computation."""
    rates = -jnp.exp(jnp.stack([jnp.asarray(a).astype(jnp.float32) for a in a_logs], axis=1))
    return jax.lax.optimization_barrier(rates)


def decay_rate(rates: jax.Array, j: int) -> Columns:
    """Layer ``j``'s rates in :func:`decay_rates`' table, as the SSM's ``A [H, 1, 1]``."""
    return Columns(rates, j, (rates.shape[0], 1, 1))


def mamba_mixer(
    h: jax.Array,  # [T, d] (normed)
    ctx: StepContext,
    conv_state: jax.Array,  # [num_slots, conv_dim, W - 1 + k]
    ssm_state: jax.Array,  # [num_slots, H, P, N]
    w: dict,
    spec: MambaSpec,
    *,
    backend: str,
    model_axis: str | None = None,
    A: Columns | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One mixed step of the Mamba2 mixer (see the module docstring). Returns
    ``(out [n, d] float32, conv_state, ssm_state)``; ``out`` of pad tokens is the output
    projection of zeros (plus ``out_proj_bias``): the caller masks it. ``h [n, d]`` may have
    ``n >= T`` rows (the step's ``T`` tokens first, zero rows after them, as
    :func:`~kvjax.models.attention.row_count` pads a single token): the projections run over all
    ``n`` rows, the conv and the SSM over the ``T`` tokens (read in place from the projection).

    ``w``: ``in_proj [d, in_proj_dim]`` (+ ``in_proj_bias``), ``conv_weight [conv_dim, W]``,
    ``conv_bias`` (or absent), ``dt_bias``, ``A_log``, ``D [H]``, ``gate_norm [d_inner]``,
    ``out_proj [d_inner, d]`` (+ ``out_proj_bias``, added once after the ``model_axis`` sum).
    The SSM, the conv and the norm run in float32 whatever the weights' dtype. ``A``: this
    layer's :func:`decay_rate` (None: computed here from ``A_log``).
    """
    n, T = h.shape[0], ctx.num_tokens
    H, P = spec.num_heads, spec.head_dim
    di = spec.d_inner
    f32 = jnp.float32
    # A step that prefills gets the projection in the weights' dtype (a bf16 model's is bf16, as
    # in vLLM: the step's widest activation at half the bytes); a decode-only step gets it in
    # float32 from the product itself: its kernels read z / xBC / dt from that buffer in place
    # and the conv writes its float32 output there. Everything after it computes in float32.
    proj_dtype = f32 if ctx.decode_only else w["in_proj"].dtype
    zxbcdt = linear(h, w["in_proj"], w.get("in_proj_bias"), out_dtype=proj_dtype).astype(f32)
    # a decode-only step's kernels read z / xBC / dt in place from the projection (no copy of
    # each slice; the conv writes its output over xBC's columns); the other paths slice it
    in_place = ctx.decode_only and not ctx.is_speculative
    cd = spec.conv_dim
    if in_place:
        z, xbc, dt = Columns(zxbcdt, 0, (T, di)), Columns(zxbcdt, di, (T, cd)), Columns(zxbcdt, di + cd, (T, H))
    else:
        z, xbc, dt = zxbcdt[:T, :di], zxbcdt[:T, di : di + cd], zxbcdt[:T, di + cd :]  # dt [T, H]
    A = decay_rate(decay_rates([w["A_log"]]), 0) if A is None else A  # [H, 1, 1], read in place
    k = {
        # in the weights' own dtype: every conv implementation widens them to float32 as it reads
        # them, so a convert here would only add a kernel to every step
        "conv_weight": w["conv_weight"],
        "conv_bias": w.get("conv_bias"),
        "D": w["D"].astype(f32),
        "dt_bias": w["dt_bias"].astype(f32),
        "softplus": True,
        # the prefill scan's products take the weights' precision (a bf16 model: bf16 operands
        # accumulated in float32, as vLLM's Triton scan has them); the recurrence stays float32
        "dot_dtype": None if w["in_proj"].dtype == f32 else w["in_proj"].dtype,
    }
    if spec.clips_dt:  # clip after softplus: pass the kernels the final dt
        lo, hi = spec.dt_limit
        dt = jnp.clip(jax.nn.softplus((dt.value() if in_place else dt) + k["dt_bias"]), lo, hi)
        k["dt_bias"], k["softplus"] = None, False

    R = ctx.num_rows
    row = gather_index(ctx.token_row, R)  # masked by token_real
    is_dec = ctx.token_real & ctx.decode_row[row]
    if ctx.is_speculative:
        decode = _decode_spec
    elif in_place:
        decode = functools.partial(_decode_tokens_as_rows, row=row, is_dec=is_dec)
    else:
        decode = _decode
    y_dec, conv_state, ssm_state = decode(spec, k, ctx, xbc, z, dt, A, conv_state, ssm_state, backend)
    y = jnp.where(is_dec[:, None, None], y_dec, 0.0)
    if not ctx.decode_only:
        y_pre, conv_state, ssm_state = _prefill(spec, k, ctx, xbc, z, dt, A.value().reshape(H), conv_state,
                                                ssm_state, backend)
        is_pre = ctx.token_real & ctx.prefill_row[row]
        y = jnp.where(is_pre[:, None, None], y_pre, y)
    y = y.reshape(T, H * P)
    bo = w.get("out_proj_bias")
    if model_axis is None or not spec.norm_spans_shards:
        y = gated_rms_norm(y, w["gate_norm"], spec.rms_eps, spec.norm_groups)
    else:
        ax = model_axis
        ms = jax.lax.psum(jnp.sum(y * y, axis=-1, keepdims=True), ax) / (H * P * jax.lax.axis_size(ax))
        y = y * jax.lax.rsqrt(ms + spec.rms_eps) * w["gate_norm"]
    out = linear(pad_rows(y, n), w["out_proj"])
    if model_axis is not None:
        out = jax.lax.psum(out, model_axis)
    if bo is not None:
        out = out + bo.astype(f32)
    return out, conv_state, ssm_state


def _split_xbc(spec: MambaSpec, xbc):
    """``[n, conv_dim]`` -> x ``[n, H, P]``, B, C ``[n, G, N]`` (of a :class:`Columns`: the
    same columns of its parent)."""
    n = xbc.shape[0]
    G, N, di = spec.n_groups, spec.d_state, spec.d_inner
    if isinstance(xbc, Columns):
        p, s = xbc.parent, xbc.start
        return (Columns(p, s, (n, spec.num_heads, spec.head_dim)), Columns(p, s + di, (n, G, N)),
                Columns(p, s + di + G * N, (n, G, N)))
    xs = xbc[:, :di].reshape(n, spec.num_heads, spec.head_dim)
    B = xbc[:, di : di + G * N].reshape(n, G, N)
    C = xbc[:, di + G * N :].reshape(n, G, N)
    return xs, B, C


def _prefill(spec, k, ctx, xbc, z, dt, A, conv_state, ssm_state, backend):
    """Masked varlen conv + scan over the prefill rows; ``y [T, H, P]``."""
    T = xbc.shape[0]
    slots = jnp.where(ctx.prefill_row, ctx.state_slot, NULL_BLOCK_ID)
    conv_out, conv_state = causal_conv1d_varlen(
        xbc.T,
        k["conv_weight"],
        k["conv_bias"],
        conv_state,
        ctx.query_start_loc,
        slots,
        ctx.has_initial_state,
        activation="silu",
        backend=backend,
    )
    xs, B, C = _split_xbc(spec, conv_out.T)
    z = z.reshape(T, spec.num_heads, spec.head_dim)
    if k["dot_dtype"] is not None:  # the scan's inputs in the products' dtype (vLLM's bf16 activations)
        xs, B, C, z = (v.astype(k["dot_dtype"]) for v in (xs, B, C, z))
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
        D=k["D"],
        dt_bias=k["dt_bias"],
        z=z,
        dt_softplus=k["softplus"],
        max_sequences=ctx.max_prefill_rows,
        dot_dtype=k["dot_dtype"],
        backend=backend,
    )
    return y, conv_state, ssm_state


def _decode_tokens(spec, k, gather, xbc, z, dt, A, conv_state, ssm_state, backend, **idx):
    """The two decode kernels on the tokens ``gather`` picks from ``xbc``, ``z``, ``dt``;
    ``y [n, H, P]``. Given as :class:`Columns` of one projection (``gather`` the identity), the
    three are read in place: the conv writes its output over xBC's columns, and the SSM reads
    x, B, C, z and dt as columns of that new buffer."""
    xbc_d, z_d, dt_d = gather(xbc), gather(z), gather(dt)
    n = xbc_d.shape[0]
    H, P = spec.num_heads, spec.head_dim
    conv_out, conv_state = causal_conv1d_update(
        xbc_d,
        conv_state,
        k["conv_weight"],
        k["conv_bias"],
        activation="silu",
        backend=backend,
        **idx["conv"],
    )
    xs, B, C = _split_xbc(spec, conv_out)

    def view(v, shape):  # v read as shape; columns of the conv's input now live in its output
        if not isinstance(v, Columns):
            return v.reshape(shape)
        return Columns(conv_out.parent if v.parent is xbc_d.parent else v.parent, v.start, shape)

    y, ssm_state = selective_state_update(
        ssm_state,
        xs,
        view(dt_d, (n, H, 1)),  # per-head scalar dt, broadcast over P (vLLM's TIE_HDIM)
        A,  # [H, 1, 1]
        B,
        C,
        D=k["D"][:, None],
        dt_bias=None if k["dt_bias"] is None else k["dt_bias"][:, None],
        z=view(z_d, (n, H, P)),
        dt_softplus=k["softplus"],
        backend=backend,
        **idx["ssm"],
    )
    return y, conv_state, ssm_state


def _decode(spec, k, ctx, xbc, z, dt, A, conv_state, ssm_state, backend):
    """One token per decode row, gathered into ``[R, ...]``; ``y [T, H, P]``."""
    T = xbc.shape[0]
    tok = jnp.where(ctx.decode_row, ctx.query_start_loc[:-1], T)  # T -> zero fill

    def gather(a):
        return jnp.take(a, tok, axis=0, mode="fill", fill_value=0)

    slots = jnp.where(ctx.decode_row, ctx.state_slot, NULL_BLOCK_ID)
    y_rows, conv_state, ssm_state = _decode_tokens(
        spec, k, gather, xbc, z, dt, A, conv_state, ssm_state, backend,
        conv={"conv_state_indices": slots},
        ssm={"state_batch_indices": slots},
    )
    row = gather_index(ctx.token_row, ctx.num_rows)  # masked by the caller
    return y_rows[row], conv_state, ssm_state


def _decode_tokens_as_rows(spec, k, ctx, xbc, z, dt, A, conv_state, ssm_state, backend, *, row, is_dec):
    """A decode-only step: every real token is its row's one token, so the kernels run over the
    ``T`` tokens in place, token ``t`` on its row's slot (``row[t]``; a token not ``is_dec``, a
    pad token, on the null slot: nothing read or written); ``y [T, H, P]``, pad tokens' rows
    masked by the caller."""
    slots = jnp.where(is_dec, ctx.state_slot[row], NULL_BLOCK_ID)
    return _decode_tokens(
        spec, k, lambda a: a, xbc, z, dt, A, conv_state, ssm_state, backend,
        conv={"conv_state_indices": slots},
        ssm={"state_batch_indices": slots},
    )


def _decode_spec(spec, k, ctx, xbc, z, dt, A, conv_state, ssm_state, backend):
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
    y_packed, conv_state, ssm_state = _decode_tokens(
        spec, k, gather, xbc, z, dt, A, conv_state, ssm_state, backend,
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


class MambaLayer(nn.Module):
    """Pre-norm Mamba2 block; ``x + mixer(norm(x))`` (:func:`mamba_mixer`).

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
        spec = MambaSpec(c.mamba_num_heads, c.mamba_head_dim, c.mamba_d_state, c.mamba_n_groups,
                         c.conv_width, c.rms_eps)
        w = {name: getattr(self, name) for name in (
            "in_proj", "conv_weight", "conv_bias", "dt_bias", "A_log", "D", "gate_norm", "out_proj")}
        h = rms_norm(x, self.norm, c.rms_eps)
        out, conv_state, ssm_state = mamba_mixer(
            h, ctx, conv_state, ssm_state, w, spec, backend=backend, model_axis=self.model_axis)
        return x + out, conv_state, ssm_state
