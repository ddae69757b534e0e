"""Mamba depthwise causal conv1d over a pool of conv states (vLLM ``causal_conv1d.py``).

* :func:`causal_conv1d_update` — decode (and speculative / varlen decode) step;
  reference, Mosaic TPU and Pallas GPU implementations.
* :func:`causal_conv1d_varlen` — prefill over a packed batch of requests
  (vLLM's ``causal_conv1d_fn``); reference only.

Conv-state layout, shared by both: ``conv_state [L, dim, S]`` with ``S >= width - 1``.
The conv window is columns ``[off, off + width - 1)`` of a row (``off`` = 0 except in
the speculative path), and an update rewrites columns ``[0, width - 1)`` (speculative
path: ``[0, width - 2 + len)``); other columns are left bitwise unchanged.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import contract as validation
from pallas_kernels.contract import NULL_BLOCK_ID
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import _backend
from pallas_kernels import mamba_common as mc
from pallas_kernels import tpu_target
from pallas_kernels._xla import scatter_set

__all__ = ["ConvConfig", "causal_conv1d_update", "causal_conv1d_varlen"]

OP_CONV_UPDATE = "causal_conv1d_update"
OP_CONV_VARLEN = "causal_conv1d_varlen"


@dataclasses.dataclass(frozen=True)
class ConvConfig:
    """Tuning knobs of the GPU conv-update kernel (a static argument).

    Attributes:
      gpu_block_dim: channels per GPU program (a power of two).
      gpu_num_warps: warps per GPU program.
    """

    gpu_block_dim: int = 128
    gpu_num_warps: int = 4

    def __post_init__(self):
        validation.check_config_ints(self, ("gpu_block_dim",))


def _silu_flag(activation) -> bool:
    if activation is None or activation is False:
        return False
    if activation is True or activation in ("silu", "swish"):
        return True
    raise ValueError(f"activation must be None, 'silu', 'swish' or a bool, got {activation!r}")


def _silu(v):
    return v * jax.nn.sigmoid(v)


# --------------------------------------------------------------------------- #
# causal_conv1d_update: normalisation
# --------------------------------------------------------------------------- #


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["x", "conv_state", "weight", "bias", "bos", "lens", "idx", "ok", "off"],
    meta_fields=["silu", "spec", "q", "regular"],
)
@dataclasses.dataclass(frozen=True)
class _ConvArgs:
    x: jax.Array  # [T, dim] token-major, caller's dtype
    conv_state: jax.Array  # [L, dim, S]
    weight: jax.Array  # [dim, W]
    bias: jax.Array | None  # [dim]
    bos: jax.Array  # [Nb] int32
    lens: jax.Array  # [Nb] int32, already <= q
    idx: jax.Array  # [Nb] int32 conv-state row (used only where ok)
    ok: jax.Array  # [Nb] bool: valid row and len > 0
    off: jax.Array  # [Nb] int32 window offset (spec: max(num_accepted - 1, 0))
    silu: bool
    spec: bool
    q: int  # static max tokens per sequence
    regular: bool = False  # not varlen: sequence b is tokens b*q .. b*q + q - 1 (bos, lens implied)


def _normalize_update(x, conv_state, weight, bias, activation, conv_state_indices,
                      num_accepted_tokens, query_start_loc, max_query_len, null_block_id):
    null_block_id = mc.check_int_arg("null_block_id", null_block_id)
    max_query_len = mc.check_int_arg("max_query_len", max_query_len)
    silu = _silu_flag(activation)
    for name, arr in (("x", x), ("conv_state", conv_state), ("weight", weight)):
        mc.check_float(name, arr)
    validation.check_rank("conv_state", conv_state, 3)
    L, dim, S = conv_state.shape
    validation.check_rank("weight", weight, 2)
    validation.check_shape("weight", weight, (dim, None))
    W = weight.shape[1]
    if W < 2:
        raise ValueError(f"weight must have width >= 2, got shape {list(weight.shape)}")
    if bias is not None:
        mc.check_float("bias", bias)
        validation.check_shape("bias", bias, (dim,))

    varlen = query_start_loc is not None
    if varlen:
        validation.check_rank("x", x, 2)
        validation.check_shape("x", x, (None, dim))
        T = x.shape[0]
        if conv_state_indices is None:
            raise ValueError("query_start_loc requires conv_state_indices (as in vLLM)")
        validation.check_rank("query_start_loc", query_start_loc, 1)
        nb = query_start_loc.shape[0] - 1
        if nb < 0:
            raise ValueError("query_start_loc must have shape [batch+1], got [0]")
        bos, lens = mc.segments(query_start_loc, nb, T, name="query_start_loc")
        if max_query_len < 1:
            v = validation.concrete_values(lens)
            if v is None:
                raise ValueError("max_query_len must be >= 1 with a traced query_start_loc, "
                                 f"got {max_query_len}")
            max_query_len = max(int(v.max()) if v.size else 1, 1)
        q = max_query_len
        v = validation.concrete_values(lens)
        if v is not None and v.size and int(v.max()) > q:
            raise ValueError(f"query_start_loc: a sequence has {int(v.max())} tokens, "
                             f"more than max_query_len={q}")
        xt = x
        layout = ("varlen",)
    else:
        validation.check_rank("x", x, (2, 3))
        validation.check_shape("x", x, (None, dim) if x.ndim == 2 else (None, dim, None))
        nb = x.shape[0]
        q = 1 if x.ndim == 2 else x.shape[2]
        xt = x if x.ndim == 2 else jnp.swapaxes(x, 1, 2).reshape(nb * q, dim)
        bos = jnp.arange(nb, dtype=jnp.int32) * q
        lens = jnp.full((nb,), q, jnp.int32)
        layout = ("2d",) if x.ndim == 2 else ("3d", nb, q)

    spec = num_accepted_tokens is not None
    need = W - 1 + (q - 1 if spec else 0)
    if S < need:
        raise ValueError(
            f"conv_state must have state_len >= {need} (width-1{' + seqlen-1 for the speculative path' if spec else ''}), "
            f"got shape {list(conv_state.shape)}")
    if conv_state_indices is None:
        if L < nb:
            raise ValueError(f"conv_state must have at least batch={nb} rows when conv_state_indices is None, got {L}")
        idx = jnp.arange(nb, dtype=jnp.int32)
        valid = jnp.ones((nb,), bool)
    else:
        csi = mc.index_array("conv_state_indices", conv_state_indices, (1, 2))
        if csi.shape[0] != nb:
            raise ValueError(f"conv_state_indices must have {nb} rows (one per sequence), got shape {list(csi.shape)}")
        idx = csi if csi.ndim == 1 else csi[:, 0]
        mc.check_index_values("conv_state_indices", idx, L, null_block_id)
        valid = mc.valid_index(idx, L, null_block_id)
    if spec:
        # beyond int32 (traced): S - W + 3, out of range like any other (window past S)
        na = mc.index_array("num_accepted_tokens", num_accepted_tokens, 1, fill=S - W + 3)
        validation.check_shape("num_accepted_tokens", na, (nb,))
        validation.check_values_in_range("num_accepted_tokens", na, 0, S - W + 3)
        off = jnp.maximum(na - 1, 0)
    else:
        off = jnp.zeros((nb,), jnp.int32)
    lens = jnp.minimum(lens, q)  # only reachable under jit with inconsistent inputs
    ok = valid & (lens > 0)
    args = _ConvArgs(xt, conv_state, weight, bias, bos, lens, idx, ok, off, silu, spec, q, not varlen)
    return args, layout


# --------------------------------------------------------------------------- #
# reference
# --------------------------------------------------------------------------- #


def _new_columns(seq, lens, W: int, q: int, spec: bool):
    """New leading state columns from ``seq = [window (W-1), tokens (q)]`` along the last axis.

    Returns (values [..., ncols], mask [Nb, ncols]) with ncols = W-1 (plain: the last W-1
    entries of window+tokens) or W-2+q (spec: everything but the first window entry; only
    the first W-2+len columns are written).
    """
    if spec:
        ncols = W - 2 + q
        vals = seq[..., 1:1 + ncols]
        mask = jnp.arange(ncols)[None, :] < (W - 2 + lens)[:, None]
        return vals, mask
    ncols = W - 1
    pos = lens[:, None] + jnp.arange(ncols)[None, :]  # [Nb, W-1], < W-1+q
    vals = jnp.take_along_axis(seq, pos[:, None, :], axis=-1)
    return vals, jnp.ones(pos.shape, bool)


@_backend.register(OP_CONV_UPDATE, "reference")
def _conv_update_reference(a: _ConvArgs, *, config: ConvConfig, interpret):
    del config, interpret
    f32 = jnp.float32
    T, dim = a.x.shape
    L, _, S = a.conv_state.shape
    W = a.weight.shape[1]
    q = a.q
    sd = a.conv_state.dtype
    nb = a.bos.shape[0]
    if nb == 0 or T == 0:
        return a.x, a.conv_state
    i = jnp.arange(q)
    tok_ok = a.ok[:, None] & (i[None, :] < a.lens[:, None])  # [Nb, q]
    tok = jnp.where(tok_ok, a.bos[:, None] + i[None, :], T)
    xs = jnp.take(a.x, tok, axis=0, mode="fill", fill_value=0)  # [Nb, q, dim]
    xs = jnp.where(tok_ok[..., None], xs.astype(sd).astype(f32), 0.0)
    rows = jnp.take(a.conv_state, jnp.where(a.ok, a.idx, L), axis=0, mode="fill", fill_value=0)
    cols = a.off[:, None] + jnp.arange(W - 1)[None, :]  # [Nb, W-1]
    cok = cols < S
    hist = jnp.take_along_axis(rows, jnp.where(cok, cols, 0)[:, None, :], axis=-1)
    hist = jnp.where(cok[:, None, :] & a.ok[:, None, None], hist.astype(f32), 0.0)
    seq = jnp.concatenate([hist, jnp.swapaxes(xs, 1, 2)], axis=-1)  # [Nb, dim, W-1+q]
    w = a.weight.astype(f32)
    acc = sum(w[None, :, j, None] * seq[:, :, j:j + q] for j in range(W))  # [Nb, dim, q]
    if a.bias is not None:
        acc = acc + a.bias.astype(f32)[None, :, None]
    if a.silu:
        acc = _silu(acc)
    vals, cmask = _new_columns(seq, a.lens, W, q, a.spec)
    ncols = vals.shape[-1]
    keep = rows[..., :ncols]
    new_lead = jnp.where(cmask[:, None, :], vals.astype(sd), keep)
    new_rows = jnp.concatenate([new_lead, rows[..., ncols:]], axis=-1)
    conv_state = scatter_set(a.conv_state, jnp.where(a.ok, a.idx, L), new_rows)
    out = scatter_set(a.x, tok.reshape(-1), jnp.swapaxes(acc, 1, 2).reshape(-1, dim))
    return out, conv_state


# --------------------------------------------------------------------------- #
# TPU (Mosaic) kernel
# --------------------------------------------------------------------------- #


@_backend.register(OP_CONV_UPDATE, "tpu")
def _conv_update_tpu(a: _ConvArgs, *, config: ConvConfig, interpret):
    """Mosaic kernel, grid (sequences,).

    ``x`` (token-major) and ``conv_state`` stay in HBM (``pl.ANY``) and are aliased to
    the outputs. A sequence whose row is null / out of range, or which has no tokens,
    issues no DMA at all, so its state row is untouched and its output rows keep ``x``.
    Otherwise: DMA the state row and the sequence's token rows in, compute in float32,
    DMA the token outputs and the merged state row back.
    """
    T, dim = a.x.shape
    L, _, S = a.conv_state.shape
    W = a.weight.shape[1]
    q = a.q
    nb = a.bos.shape[0]
    sd = a.conv_state.dtype
    if nb == 0 or T == 0:
        return a.x, a.conv_state
    spec, silu = a.spec, a.silu
    has_bias = a.bias is not None
    ncols = W - 2 + q if spec else W - 1
    if not interpret:  # compiled: weights (double-buffered) and scratch must fit VMEM
        tpu_target.check_vmem(OP_CONV_UPDATE, [
            ("weight", (W, dim), a.weight.dtype, 2),
            *([("bias", (1, dim), a.bias.dtype, 2)] if has_bias else []),
            ("state rows", (dim, S), sd, 2), ("token rows", (q, dim), a.x.dtype, 2),
        ], hint=f"dim={dim} channels with a state of {S} columns do not fit: split the channels")

    prefetch = (a.bos, a.lens, a.idx, a.ok.astype(jnp.int32), a.off)
    inputs = [jnp.transpose(a.weight)]  # [W, dim]
    in_specs = [pl.BlockSpec((W, dim), lambda b, *_: (0, 0))]
    if has_bias:
        inputs.append(a.bias[None, :])
        in_specs.append(pl.BlockSpec((1, dim), lambda b, *_: (0, 0)))
    inputs += [a.x, a.conv_state]
    in_specs += [pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)]
    n_in = len(prefetch) + len(inputs)

    def kernel(bos_ref, len_ref, idx_ref, ok_ref, off_ref, *refs):
        it = iter(refs)
        w_ref = next(it)
        bias_ref = next(it) if has_bias else None
        next(it), next(it)  # aliased inputs
        out_hbm, cs_hbm = next(it), next(it)
        row_scr, new_scr, xs_scr, ys_scr, sem = (next(it) for _ in range(5))
        b = pl.program_id(0)
        f32 = jnp.float32

        @pl.when(ok_ref[b] != 0)
        def _():
            r = idx_ref[b]
            t0 = bos_ref[b]
            n = len_ref[b]
            off = off_ref[b]
            cp = pltpu.make_async_copy(cs_hbm.at[r], row_scr, sem)
            cp.start()
            cp.wait()

            def load_tok(i, c):
                cpx = pltpu.make_async_copy(out_hbm.at[pl.ds(t0 + i, 1)], xs_scr.at[pl.ds(i, 1)], sem)
                cpx.start()
                cpx.wait()
                return c

            jax.lax.fori_loop(0, n, load_tok, 0)
            rowT = jnp.transpose(row_scr[...])  # [S, dim], state dtype
            rowT32 = rowT.astype(f32)
            ks = jax.lax.broadcasted_iota(jnp.int32, (S, dim), 0)
            hist = [jnp.sum(jnp.where(ks == off + j, rowT32, 0.0), axis=0, keepdims=True)
                    for j in range(W - 1)]
            ti = jax.lax.broadcasted_iota(jnp.int32, (q, dim), 0)
            xs = jnp.where(ti < n, xs_scr[...].astype(sd).astype(f32), 0.0)
            seqT = jnp.concatenate(hist + [xs], axis=0)  # [W-1+q, dim]
            w = w_ref[...].astype(f32)
            acc = sum(w[j:j + 1, :] * seqT[j:j + q, :] for j in range(W))
            if has_bias:
                acc = acc + bias_ref[...].astype(f32)
            if silu:
                acc = _silu(acc)
            ys_scr[...] = acc.astype(ys_scr.dtype)
            # new leading columns of the state row
            if spec:
                vals = seqT[1:1 + ncols, :]
                lim = W - 2 + n
            else:
                rs = jax.lax.broadcasted_iota(jnp.int32, (W - 1 + q, dim), 0)
                vals = jnp.concatenate(
                    [jnp.sum(jnp.where(rs == n + k, seqT, 0.0), axis=0, keepdims=True)
                     for k in range(ncols)], axis=0)
                lim = ncols
            if S > ncols:
                vals = jnp.concatenate([vals, jnp.zeros((S - ncols, dim), f32)], axis=0)
            merged = jnp.where(ks < lim, vals.astype(sd), rowT)
            new_scr[...] = jnp.transpose(merged)
            cpo = pltpu.make_async_copy(new_scr, cs_hbm.at[r], sem)
            cpo.start()
            cpo.wait()

            def store_tok(i, c):
                cpy = pltpu.make_async_copy(ys_scr.at[pl.ds(i, 1)], out_hbm.at[pl.ds(t0 + i, 1)], sem)
                cpy.start()
                cpy.wait()
                return c

            jax.lax.fori_loop(0, n, store_tok, 0)

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(prefetch),
        grid=(nb,),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
        scratch_shapes=[
            pltpu.VMEM((dim, S), sd),
            pltpu.VMEM((dim, S), sd),
            pltpu.VMEM((q, dim), a.x.dtype),
            pltpu.VMEM((q, dim), a.x.dtype),
            pltpu.SemaphoreType.DMA,
        ],
    )
    out, cs = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct(a.x.shape, a.x.dtype),
                   jax.ShapeDtypeStruct(a.conv_state.shape, sd)],
        input_output_aliases={n_in - 2: 0, n_in - 1: 1},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=interpret,
    )(*prefetch, *inputs)
    return out, cs


# --------------------------------------------------------------------------- #
# GPU kernel
# --------------------------------------------------------------------------- #


@_backend.register(OP_CONV_UPDATE, "gpu")
def _conv_update_gpu(a: _ConvArgs, *, config: ConvConfig, interpret: bool):
    """Pallas GPU kernel: one program per (sequence, block of channels), masked loads
    and stores (the structure of vLLM's Triton kernel)."""
    T, dim = a.x.shape
    L, _, S = a.conv_state.shape
    W = a.weight.shape[1]
    q = a.q
    nb = a.bos.shape[0]
    if nb == 0 or T == 0:
        return a.x, a.conv_state
    # x as columns c0 .. c0 + dim of a wider array: read and written there (in place)
    cols = isinstance(a.x, mc.Columns)
    xarr, c0 = (a.x.parent, a.x.start) if cols else (a.x, 0)
    spec, silu = a.spec, a.silu
    has_bias = a.bias is not None
    BD = min(config.gpu_block_dim, mc.pow2(dim))

    # a regular layout's sequence bounds are b * q and q, its window offset 0 off the
    # speculative path: computed in the kernel rather than passed (no index arrays built per call)
    regular = a.regular
    inputs = ([] if regular else [a.bos, a.lens]) + [a.idx, a.ok.astype(jnp.int32)]
    inputs += ([a.off] if spec or not regular else []) + [a.weight]
    if has_bias:
        inputs.append(a.bias)
    inputs += [xarr, a.conv_state]
    n_in = len(inputs)

    def kernel(*refs):
        it = iter(refs)
        bos_ref, len_ref = (None, None) if regular else (next(it), next(it))
        idx_ref, ok_ref = next(it), next(it)
        off_ref = next(it) if spec or not regular else None
        w_ref = next(it)
        bias_ref = next(it) if has_bias else None
        next(it), next(it)
        out_ref, cs_ref = next(it), next(it)
        f32 = jnp.float32
        sd = cs_ref.dtype
        b = pl.program_id(0)
        d0 = pl.program_id(1) * BD
        offs = d0 + jnp.arange(BD)
        dmask = offs < dim
        dsl = pl.ds(d0, BD)
        xsl = pl.ds(c0 + d0, BD)

        @pl.when(ok_ref[b] != 0)
        def _():
            r = idx_ref[b]
            t0 = b * q if regular else bos_ref[b]
            n = jnp.int32(q) if regular else len_ref[b]
            off = off_ref[b] if off_ref is not None else jnp.int32(0)

            def load_x(t, m):
                v = _backend.triton.load(out_ref.at[t, xsl], mask=dmask & m, other=0.0)
                return v.astype(sd).astype(f32)

            hist = []
            for j in range(W - 1):
                c = off + j
                cm = c < S
                hist.append(_backend.triton.load(cs_ref.at[r, dsl, jnp.where(cm, c, 0)],
                                      mask=dmask & cm, other=0.0).astype(f32))
            # new state columns (read x before the output loop overwrites it in place)
            news = []
            if spec:
                for k in range(W - 2 + q):
                    p = 1 + k
                    if p < W - 1:
                        v = hist[p]
                    else:
                        u = p - (W - 1)
                        v = load_x(jnp.where(u < n, t0 + u, t0), u < n)
                    news.append((k, v, k < W - 2 + n))
            else:
                for k in range(W - 1):
                    p = n + k
                    v = jnp.zeros((BD,), f32)
                    for j in range(W - 1):
                        v = jnp.where(p == j, hist[j], v)
                    in_x = p >= W - 1
                    xv = load_x(jnp.where(in_x, t0 + p - (W - 1), t0), in_x)
                    news.append((k, jnp.where(in_x, xv, v), True))
            if not interpret:  # no interpret rule; the interpreter runs sequentially anyway
                _backend.triton.debug_barrier()
            for k, v, m in news:
                _backend.triton.store(cs_ref.at[r, dsl, jnp.int32(k)], v.astype(sd), mask=dmask & m)
            ws = [_backend.triton.load(w_ref.at[dsl, jnp.int32(j)], mask=dmask, other=0.0).astype(f32) for j in range(W)]
            if has_bias:
                bias = _backend.triton.load(bias_ref.at[dsl], mask=dmask, other=0.0).astype(f32)
            else:
                bias = jnp.zeros((BD,), f32)

            def body(i, win):
                xi = load_x(t0 + i, True)
                acc = bias + ws[W - 1] * xi
                for j in range(W - 1):
                    acc = acc + ws[j] * win[j]
                if silu:
                    acc = _silu(acc)
                _backend.triton.store(out_ref.at[t0 + i, xsl], acc.astype(out_ref.dtype), mask=dmask)
                return tuple(win[1:]) + (xi,)

            jax.lax.fori_loop(0, n, body, tuple(hist))

    out, cs = pl.pallas_call(
        kernel,
        grid=(nb, pl.cdiv(dim, BD)),
        out_shape=[jax.ShapeDtypeStruct(xarr.shape, xarr.dtype),
                   jax.ShapeDtypeStruct(a.conv_state.shape, a.conv_state.dtype)],
        input_output_aliases={n_in - 2: 0, n_in - 1: 1},
        compiler_params=_backend.gpu_compiler_params(config.gpu_num_warps),
        interpret=interpret,
    )(*inputs)
    return (mc.Columns(out, c0, a.x.shape) if cols else out), cs


def causal_conv1d_update(
    x, conv_state, weight, bias=None, activation=None, conv_state_indices=None,
    num_accepted_tokens=None, query_start_loc=None, max_query_len=-1,
    null_block_id=NULL_BLOCK_ID, *, backend="auto", interpret=None,
    config: ConvConfig = ConvConfig(),
):
    """Depthwise causal conv1d decode step over a pool of conv states.

    Mirrors vLLM's ``causal_conv1d_update`` (no APC arguments) and returns
    ``(out, conv_state)``; donate ``conv_state`` (and ``x``) at the enclosing ``jit``.

    Shapes: ``x`` is ``[batch, dim]`` (one token), ``[batch, dim, seqlen]``, or, with
    ``query_start_loc [batch+1]``, varlen ``[num_tokens, dim]``; ``conv_state``
    ``[L, dim, S]``; ``weight [dim, width]`` (width >= 2); ``bias [dim]``;
    ``conv_state_indices [batch]`` or ``[batch, k]`` (column 0 is used; required with
    ``query_start_loc``; without it sequence ``b`` uses row ``b``);
    ``num_accepted_tokens [batch]`` selects the speculative path. ``max_query_len``
    (static) bounds a varlen sequence; if < 1 it is taken from a concrete
    ``query_start_loc``. ``activation``: None / False, or "silu" / "swish" / True.

    Per sequence ``b`` with row ``r = conv_state_indices[b]`` and ``n`` tokens:

    * ``r == null_block_id`` (or, under jit, outside ``[0, L)``), or ``n == 0``: nothing
      is read or written; its rows of ``out`` equal ``x`` bitwise (vLLM's ``out`` aliases ``x``).
    * window = columns ``off .. off+width-2`` of the row, ``off = max(num_accepted-1, 0)``
      in the speculative path, else 0; ``x`` is cast to the state dtype, math in float32:
      ``out[t] = act(bias + sum_j weight[:, j] * seq[t + j])`` with ``seq = window ++ x``;
      ``out`` has ``x``'s dtype.
    * state: plain path writes the last ``width-1`` entries of ``seq`` to columns
      ``[0, width-1)``; speculative path writes ``seq[1:]`` to columns
      ``[0, width-2+n)`` (vLLM's sliding window). Other columns are unchanged.
      Two sequences naming the same row give an unspecified result (as in vLLM).

    Requires ``S >= width-1`` (``+ seqlen-1`` in the speculative path, seqlen being
    ``x``'s seqlen or ``max_query_len``). Concrete indices outside ``[0, L)`` (other than
    ``null_block_id``), ``num_accepted_tokens`` outside ``[0, S-width+2]`` or a varlen
    sequence longer than ``max_query_len`` raise ``ValueError``; under jit such
    entries are masked (window columns past ``S`` read 0, no clamping of indices).
    Unlike vLLM, ``num_accepted_tokens == 0`` reads the window at offset 0 (vLLM reads
    column -1, i.e. the previous channel's memory).

    ``x`` may be a 2-D :class:`~pallas_kernels.mamba_common.Columns` (columns of a wider
    array, as vLLM's ``x`` may be a strided view of the projection): ``out`` is then the same
    columns of a new parent, whose other columns are ``x.parent``'s unchanged; the GPU kernel
    reads and writes them in place (donate the parent).

    ``backend``/``interpret``: see :mod:`pallas_kernels._backend`; ``config``:
    :class:`ConvConfig` GPU tuning knobs (static).

    Returns:
      ``(out, conv_state)``: ``out`` shaped and typed like ``x``.
    """
    choice = _backend.choose(OP_CONV_UPDATE, backend, interpret)
    if not isinstance(config, ConvConfig):
        raise ValueError(f"config must be a ConvConfig, got {config!r}")
    cols = x if isinstance(x, mc.Columns) else None
    if cols is not None:
        if cols.ndim != 2:
            raise ValueError(f"x given as Columns must be 2-D [batch or num_tokens, dim], got shape {list(cols.shape)}")
        if choice.flavor != "gpu":  # only the GPU kernel reads the columns in place
            x = cols.value()
    args, layout = _normalize_update(x, conv_state, weight, bias, activation,
                                     conv_state_indices, num_accepted_tokens,
                                     query_start_loc, max_query_len, null_block_id)
    out, cs = _backend.run(OP_CONV_UPDATE, choice, args, config=config)
    if cols is not None and not isinstance(out, mc.Columns):
        out = cols.with_value(out)
    if layout[0] == "3d":
        _, nb, q = layout
        out = jnp.swapaxes(out.reshape(nb, q, -1), 1, 2)
    return out, cs


# --------------------------------------------------------------------------- #
# prefill: causal_conv1d_varlen
# --------------------------------------------------------------------------- #


@_backend.register(OP_CONV_VARLEN, "reference")
def _conv_varlen_reference(x, weight, bias, conv_states, query_start_loc, cache_indices,
                           has_initial_state, *, silu, null_block_id, interpret):
    del interpret
    f32 = jnp.float32
    dim, T = x.shape
    L, _, S = conv_states.shape
    W = weight.shape[1]
    sd = conv_states.dtype
    R = cache_indices.shape[0]
    if R == 0 or T == 0:
        return x, conv_states
    bos, lens = mc.sequence_bounds(query_start_loc, T)
    ok = mc.valid_index(cache_indices, L, null_block_id) & (lens > 0)
    init = ok & has_initial_state
    rows = jnp.take(conv_states, jnp.where(ok, cache_indices, L), axis=0, mode="fill", fill_value=0)
    hist = jnp.where(init[:, None, None], rows[..., :W - 1].astype(f32), 0.0)  # [R, dim, W-1]
    xt = jnp.transpose(x).astype(sd).astype(f32)  # [T, dim]
    seg, pos, tvalid = mc.token_segment_ids(bos, lens, T)
    tok_ok = tvalid & ok[seg]
    w = weight.astype(f32)
    acc = jnp.zeros((T, dim), f32) if bias is None else jnp.broadcast_to(bias.astype(f32), (T, dim))
    t = jnp.arange(T)
    for j in range(W):
        lag = W - 1 - j  # tap j multiplies the input `lag` tokens back
        p = pos - lag
        from_x = jnp.take(xt, jnp.where(p >= 0, t - lag, T), axis=0, mode="fill", fill_value=0)
        hcol = jnp.where(p < 0, W - 1 + p, 0)  # window column for tokens before the request
        from_h = hist[seg, :, hcol] if W > 1 else jnp.zeros_like(from_x)
        acc = acc + w[:, j][None, :] * jnp.where((p >= 0)[:, None], from_x, from_h)
    if silu:
        acc = _silu(acc)
    out = jnp.where(tok_ok[:, None], acc.astype(x.dtype), jnp.transpose(x))
    # final window: last W-1 entries of (hist ++ request tokens)
    k = jnp.arange(W - 1)
    p = lens[:, None] + k[None, :]  # position in hist ++ tokens, [R, W-1]
    in_x = p >= W - 1
    tok = jnp.where(in_x & ok[:, None], bos[:, None] + p - (W - 1), T)
    xv = jnp.swapaxes(jnp.take(xt, tok, axis=0, mode="fill", fill_value=0), 1, 2)  # [R, dim, W-1]
    hv = jnp.take_along_axis(hist, jnp.where(in_x, 0, p)[:, None, :], axis=-1)
    new_lead = jnp.where(in_x[:, None, :], xv, hv).astype(sd)
    new_rows = jnp.concatenate([new_lead, rows[..., W - 1:]], axis=-1)
    conv_states = scatter_set(conv_states, jnp.where(ok, cache_indices, L), new_rows)
    return jnp.transpose(out), conv_states


def causal_conv1d_varlen(
    x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state,
    activation="silu", null_block_id=NULL_BLOCK_ID, *, backend="auto", interpret=None,
):
    """Prefill depthwise causal conv1d over a packed batch (vLLM's ``causal_conv1d_fn``).

    Shapes (as in vLLM): ``x [dim, num_tokens]`` (channel-major packed tokens);
    ``weight [dim, width]``; ``bias [dim]`` or None; ``conv_states [L, dim, S]`` with
    ``S >= width-1``; ``query_start_loc [R+1]`` non-decreasing (it alone sets the batch
    ``R``, as in vLLM); ``cache_indices [>= R]``; ``has_initial_state [>= R]`` bool
    (entries past the ``R`` sequences are padding: ignored, never read or written).
    ``activation``: None/False or "silu"/"swish"/True.

    Request ``r`` covers tokens ``query_start_loc[r] .. query_start_loc[r+1]-1``:

    * its initial window is columns ``[0, width-1)`` of ``conv_states[cache_indices[r]]``
      when ``has_initial_state[r]``, else ZERO (the slot's contents are never read);
    * outputs ``act(bias + sum_j weight[:, j] * seq[t + j])``, ``seq = window ++ x_r``,
      math in float32 after casting ``x`` to the state dtype, stored in ``x``'s dtype;
    * the last ``width-1`` entries of ``seq`` are written to columns ``[0, width-1)`` of
      the slot; other columns are unchanged.
    * ``cache_indices[r] == null_block_id`` (or, under jit, out of range) or an empty
      request: nothing is read or written and its output columns equal ``x``; pad
      tokens at or beyond ``query_start_loc[R]`` likewise keep ``x`` (vLLM's output
      aliases ``x``).

    Only a reference exists (vectorised jnp: ``width`` shifted gathers and
    multiply-adds, which XLA fuses): every ``backend`` resolves to it through
    :func:`pallas_kernels._backend.choose`; ``backend``/``interpret`` are validated.

    Returns:
      ``(out [dim, num_tokens], conv_states)``.
    """
    choice = _backend.choose(OP_CONV_VARLEN, backend, interpret)
    null_block_id = mc.check_int_arg("null_block_id", null_block_id)
    silu = _silu_flag(activation)
    for name, arr in (("x", x), ("weight", weight), ("conv_states", conv_states)):
        mc.check_float(name, arr)
    validation.check_rank("x", x, 2)
    dim, T = x.shape
    validation.check_rank("weight", weight, 2)
    validation.check_shape("weight", weight, (dim, None))
    W = weight.shape[1]
    if W < 2:
        raise ValueError(f"weight must have width >= 2, got shape {list(weight.shape)}")
    validation.check_rank("conv_states", conv_states, 3)
    validation.check_shape("conv_states", conv_states, (None, dim, None))
    L, _, S = conv_states.shape
    if S < W - 1:
        raise ValueError(f"conv_states must have state_len >= width-1 = {W - 1}, got shape {list(conv_states.shape)}")
    if bias is not None:
        mc.check_float("bias", bias)
        validation.check_shape("bias", bias, (dim,))
    ci, qsl, his = mc.varlen_batch(cache_indices, query_start_loc, has_initial_state, T, L,
                                 null_block_id)
    return _backend.run(OP_CONV_VARLEN, choice, x, weight, bias, conv_states, qsl, ci, his,
                        silu=silu, null_block_id=null_block_id)
