"""Mamba decode step: ``selective_state_update`` (vLLM ``mamba_ssm.py`` semantics).

One public function, :func:`selective_state_update`, with three implementations
that share one argument normalisation (:func:`_normalize`):

* ``_ssu_reference``: pure jnp, the CPU default and the test oracle;
* ``_ssu_tpu``: Mosaic TPU kernel (scalar prefetch, state in HBM with manual DMA,
  aliased in place);
* ``_ssu_gpu``: Pallas GPU kernel.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels import contract as validation
from pallas_kernels.contract import NULL_BLOCK_ID
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import _backend
from pallas_kernels import mamba_common as mc
from pallas_kernels import tpu_target
from pallas_kernels._xla import scatter_set

__all__ = ["SSUConfig", "selective_state_update"]

OP_SSU = "selective_state_update"


# --------------------------------------------------------------------------- #
# argument normalisation
# --------------------------------------------------------------------------- #


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["state", "x", "dt", "A", "B", "C", "D", "dt_bias", "z", "cu", "sbi", "dsbi",
                 "na"],
    meta_fields=["dt_softplus", "num_seqs", "null", "has_heads"],
)
@dataclasses.dataclass(frozen=True)
class _SSUArgs:
    """Canonical "with heads" arguments of one call; index tables as passed (int32).

    The per-sequence tables the kernels need (:class:`_Tables`) follow from them by
    one rule (:func:`_first_column`, :func:`_reads`, :func:`_writes`,
    :func:`pallas_kernels.mamba_common.sequence_bounds`): vectorised in
    :func:`_tables` for the reference and the TPU kernel, per sequence inside the
    GPU kernel.
    """

    state: jax.Array  # [L, H, P, Ns]
    x: jax.Array  # [T, H, P]
    dt: jax.Array  # [T, H, Pdt], Pdt in {1, P}
    A: jax.Array  # [H, Pa, Na], Pa in {1, P}, Na in {1, Ns}
    B: jax.Array  # [T, G, Ns]
    C: jax.Array  # [T, G, Ns]
    D: jax.Array | None  # [H, Pd]
    dt_bias: jax.Array | None  # [H, Pb]
    z: jax.Array | None  # [T, H, P]
    cu: jax.Array | None  # [N + 1] cu_seqlens (varlen), else None: token b is sequence b
    sbi: jax.Array | None  # [>= N, W] state_batch_indices, None: sequence b uses row b
    dsbi: jax.Array | None  # [>= N, Wd] dst_state_batch_indices, None: sbi (in place)
    na: jax.Array | None  # [N] num_accepted_tokens (speculative path), else None
    dt_softplus: bool
    num_seqs: int  # N
    null: int  # null_block_id
    has_heads: bool

    @property
    def varlen(self) -> bool:
        return self.cu is not None

    @property
    def per_token(self) -> bool:
        """Speculative path: token i stores to dst[:, i]; else the final store to dst[:, 0]."""
        return self.na is not None


class _Tables(NamedTuple):
    """Per-sequence tables of one call (vectorised form)."""

    bos: jax.Array  # [N] int32, first token of each sequence
    lens: jax.Array  # [N] int32
    src: jax.Array  # [N] int32, state row read (only where src_ok)
    src_ok: jax.Array  # [N] bool
    dst: jax.Array  # [N, Wd] int32
    dst_ok: jax.Array  # [N, Wd] bool (already includes src_ok)


def _first_column(na, W: int):
    """(column, exists): the ``state_batch_indices`` column a sequence reads its initial
    state from, ``max(num_accepted_tokens - 1, 0)`` (1 outside the speculative path),
    and whether the table has that column."""
    col = jnp.maximum(na - 1, 0)
    return col, col < W


def _reads(col_ok, src, L: int, null: int):
    """The sequence reads state row ``src``: its column exists and the row is real."""
    return col_ok & mc.valid_index(src, L, null)


def _writes(src_ok, dst, L: int, null: int):
    """The sequence writes row ``dst``: it read a real row and ``dst`` is real."""
    return src_ok & mc.valid_index(dst, L, null)


def _tables(a: _SSUArgs) -> _Tables:
    """The per-sequence tables, vectorised (reference and TPU kernel)."""
    L = a.state.shape[0]
    T = a.x.shape[0]
    N = a.num_seqs
    if a.cu is None:
        bos, lens = jnp.arange(N, dtype=jnp.int32), jnp.ones((N,), jnp.int32)
    else:
        bos, lens = mc.sequence_bounds(a.cu, T)
    if a.sbi is None:
        src = jnp.arange(N, dtype=jnp.int32)
        src_ok = jnp.ones((N,), bool)
        return _Tables(bos, lens, src, src_ok, src[:, None], src_ok[:, None])
    sbi = a.sbi[:N]
    dsbi = sbi if a.dsbi is None else a.dsbi[:N]
    W = sbi.shape[1]
    init_col, col_ok = _first_column(a.na if a.per_token else jnp.ones((N,), jnp.int32), W)
    src = jnp.take_along_axis(sbi, jnp.where(col_ok, init_col, 0)[:, None], axis=1)[:, 0]
    src_ok = _reads(col_ok, src, L, a.null)
    if a.per_token:
        return _Tables(bos, lens, src, src_ok, dsbi, _writes(src_ok[:, None], dsbi, L, a.null))
    dcol_ok = init_col < dsbi.shape[1]
    dst = jnp.take_along_axis(dsbi, jnp.where(dcol_ok, init_col, 0)[:, None], axis=1)
    return _Tables(bos, lens, src, src_ok, dst, _writes((src_ok & dcol_ok)[:, None], dst, L, a.null))


def _normalize(
    state, x, dt, A, B, C, D, dt_bias, z, dt_softplus, state_batch_indices,
    dst_state_batch_indices, null_block_id, num_accepted_tokens, cu_seqlens,
) -> _SSUArgs:
    """Checks every argument and returns the canonical form.

    Under ``jit`` (traced int32 indices) this adds no op: the index rules run in
    the kernels (the GPU flavour is then one launch per call).
    """
    null_block_id = mc.check_int_arg("null_block_id", null_block_id)
    validation.check_rank("state", state, (3, 4))
    has_heads = np.ndim(state) == 4
    for name, arr in (("state", state), ("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C)):
        mc.check_float(name, arr)
    if has_heads:
        L, H, P, Ns = state.shape
        validation.check_rank("x", x, 3)
        T = x.shape[0]
        validation.check_shape("x", x, (T, H, P))
        validation.check_rank("B", B, 3)
        G = B.shape[1]
    else:
        L, P, Ns = state.shape
        H = 1
        validation.check_rank("x", x, 2)
        T = x.shape[0]
        validation.check_shape("x", x, (T, P))
        validation.check_rank("B", B, 2)
        G = 1
    # Expand the no-heads form to heads = 1 (vLLM unsqueezes the same way).
    if has_heads:
        validation.check_rank("dt", dt, 3)
        if dt.shape[:2] != (T, H) or dt.shape[2] not in (1, P):
            raise ValueError(f"dt must have shape [{T}, {H}, {P}] (or [{T}, {H}, 1] for a per-head dt), got {list(dt.shape)}")
        validation.check_rank("A", A, 3)
        if A.shape[0] != H or A.shape[1] not in (1, P) or A.shape[2] not in (1, Ns):
            raise ValueError(f"A must have shape [{H}, {P}, {Ns}] (size-1 axes broadcast), got {list(A.shape)}")
        validation.check_shape("B", B, (T, G, Ns))
        validation.check_shape("C", C, (T, G, Ns))
    else:
        validation.check_rank("dt", dt, 2)
        if dt.shape[0] != T or dt.shape[1] not in (1, P):
            raise ValueError(f"dt must have shape [{T}, {P}] (or [{T}, 1]), got {list(dt.shape)}")
        validation.check_rank("A", A, 2)
        if A.shape[0] not in (1, P) or A.shape[1] not in (1, Ns):
            raise ValueError(f"A must have shape [{P}, {Ns}] (size-1 axes broadcast), got {list(A.shape)}")
        validation.check_shape("B", B, (T, Ns))
        validation.check_shape("C", C, (T, Ns))
        state, x = _unit_axis(state, 1), _unit_axis(x, 1)
        dt, A = _unit_axis(dt, 1), _unit_axis(A, 0)
        B, C = _unit_axis(B, 1), _unit_axis(C, 1)
    if G == 0 or H % G:
        raise ValueError(f"B must have a group count dividing nheads={H}, got {G} groups (B shape {list(B.shape)})")

    def per_head(name, arr):
        if arr is None:
            return None
        mc.check_float(name, arr)
        if has_heads:
            validation.check_rank(name, arr, 2)
            if arr.shape[0] != H or arr.shape[1] not in (1, P):
                raise ValueError(f"{name} must have shape [{H}, {P}] (or [{H}, 1]), got {list(arr.shape)}")
            return arr
        validation.check_rank(name, arr, 1)
        if arr.shape[0] not in (1, P):
            raise ValueError(f"{name} must have shape [{P}] (or [1]), got {list(arr.shape)}")
        return _unit_axis(arr, 0)

    D = per_head("D", D)
    dt_bias = per_head("dt_bias", dt_bias)
    if z is not None:
        mc.check_float("z", z)
        validation.check_shape("z", z, (T, H, P) if has_heads else (T, P))
        if not has_heads:
            z = _unit_axis(z, 1)

    if cu_seqlens is not None:
        validation.check_rank("cu_seqlens", cu_seqlens, 1)
        if cu_seqlens.shape[0] < 1:
            raise ValueError("cu_seqlens must have shape [N+1] with N >= 0, got [0]")
        N = cu_seqlens.shape[0] - 1
        cu = mc.offsets("cu_seqlens", cu_seqlens, N, T)
    else:
        N = T
        cu = None

    spec = num_accepted_tokens is not None
    if state_batch_indices is None:
        if dst_state_batch_indices is not None:
            raise ValueError("dst_state_batch_indices requires state_batch_indices")
        if spec:
            raise ValueError("num_accepted_tokens requires a 2-D state_batch_indices [N, max_seqlen]")
        if L < N:
            raise ValueError(f"state must have at least N={N} rows when state_batch_indices is None, got {L}")
        return _SSUArgs(state, x, dt, A, B, C, D, dt_bias, z, cu, None, None, None,
                        bool(dt_softplus), N, null_block_id, has_heads)

    def table(name, arr):
        t = mc.index_array(name, arr, (1, 2))
        if t.ndim == 1:
            t = t.reshape(t.shape[0], 1)
        if t.shape[0] < N:
            raise ValueError(f"{name} must have at least N={N} rows, got shape {list(t.shape)}")
        mc.check_index_values(name, _head_rows(t, N), L, null_block_id)
        return t

    sbi = table("state_batch_indices", state_batch_indices)
    dsbi = None if dst_state_batch_indices is None else table(
        "dst_state_batch_indices", dst_state_batch_indices)
    W = sbi.shape[1]
    na = None
    if spec:
        # beyond int32 (traced): W + 1, out of range, so the sequence is masked
        na = mc.index_array("num_accepted_tokens", num_accepted_tokens, 1, fill=W + 1)
        validation.check_shape("num_accepted_tokens", na, (N,))
        validation.check_values_in_range("num_accepted_tokens", na, 0, W + 1)
        cu_vals = None if cu is None else validation.concrete_values(cu)
        if cu is None or cu_vals is not None:
            lens = np.ones((N,), np.int32) if cu is None else np.asarray(mc.sequence_bounds(cu_vals, T)[1])
            Wd = W if dsbi is None else dsbi.shape[1]
            if lens.size and int(lens.max()) > Wd:
                raise ValueError(
                    f"cu_seqlens: a sequence has {int(lens.max())} tokens but dst_state_batch_indices "
                    f"has only {Wd} columns (one per token in the speculative path)")
    return _SSUArgs(state, x, dt, A, B, C, D, dt_bias, z, cu, sbi, dsbi, na,
                    bool(dt_softplus), N, null_block_id, has_heads)


def _unit_axis(arr, axis: int):
    """``arr`` with a size-1 axis inserted at ``axis`` (a reshape: no copy, no op on a GPU)."""
    shape = list(np.shape(arr))
    return jnp.reshape(arr, shape[:axis] + [1] + shape[axis:])


def _head_rows(t, n: int):
    """The first ``n`` rows of a concrete table (for its value check), else ``t``."""
    v = validation.concrete_values(t)
    return t if v is None else v[:n]


# --------------------------------------------------------------------------- #
# reference
# --------------------------------------------------------------------------- #


def _step_math(h, x, dt, A, B, C, D, dt_bias, z, dt_softplus, group_of_head):
    """One recurrence step for every head, float32.

    h [..., H, P, Ns]; x, z [..., H, P]; dt [..., H, Pdt]; A [H, Pa, Na]; B, C [..., G, Ns];
    D, dt_bias [H, P|1]. Returns (h_new, y).
    """
    f32 = jnp.float32
    x = x.astype(f32)
    dt = dt.astype(f32)
    if dt_bias is not None:
        dt = dt + dt_bias.astype(f32)
    if dt_softplus:
        dt = mc.softplus(dt)
    Bh = jnp.take(B.astype(f32), group_of_head, axis=-2)  # [..., H, Ns]
    Ch = jnp.take(C.astype(f32), group_of_head, axis=-2)
    dA = jnp.exp(A.astype(f32) * dt[..., :, None])  # [..., H, P|1, Ns|1]
    dB = Bh[..., None, :] * dt[..., :, None]  # [..., H, P|1, Ns]
    h = h * dA + dB * x[..., :, None]
    y = jnp.sum(h * Ch[..., None, :], axis=-1)
    if D is not None:
        y = y + x * D.astype(f32)
    if z is not None:
        zf = z.astype(f32)
        y = y * (zf * jax.nn.sigmoid(zf))
    return h, y


def _gather_initial(state, src, src_ok):
    """Initial states [N, H, P, Ns] float32: state[src] where src_ok, else zeros (never read)."""
    L = state.shape[0]
    idx = jnp.where(src_ok, src, L)
    h0 = jnp.take(state, idx, axis=0, mode="fill", fill_value=0).astype(jnp.float32)
    return jnp.where(src_ok[:, None, None, None], h0, 0.0)


@_backend.register(OP_SSU, "reference")
def _ssu_reference(a: _SSUArgs, *, config: SSUConfig, interpret):
    del config, interpret
    state = a.state
    L, H, P, Ns = state.shape
    T = a.x.shape[0]
    G = a.B.shape[1]
    goh = jnp.arange(H) // (H // G)
    if a.num_seqs == 0 or T == 0:
        return jnp.zeros(a.x.shape, a.x.dtype), state
    tab = _tables(a)
    h0 = _gather_initial(state, tab.src, tab.src_ok)

    if not a.varlen:
        # One token per sequence: fully vectorised.
        h1, y = _step_math(h0, a.x, a.dt, a.A, a.B, a.C, a.D, a.dt_bias, a.z, a.dt_softplus, goh)
        tgt = jnp.where(tab.dst_ok[:, 0], tab.dst[:, 0], L)
        state = scatter_set(state, tgt, h1)
        return y.astype(a.x.dtype), state

    seg, pos, tvalid = mc.token_segment_ids(tab.bos, tab.lens, T)
    Wd = tab.dst.shape[1]
    zs = a.z if a.z is not None else jnp.zeros((T, 0), a.x.dtype)

    def body(carry, inp):
        h, st = carry
        t, xt, dtt, Bt, Ct, zt = inp
        b, i, ok = seg[t], pos[t], tvalid[t]
        h = jnp.where(i == 0, h0[b], h)
        hn, y = _step_math(h, xt, dtt, a.A, Bt, Ct, a.D, a.dt_bias,
                           zt if a.z is not None else None, a.dt_softplus, goh)
        if a.per_token:
            col = jnp.minimum(i, Wd - 1)
            wr = ok & (i < Wd) & tab.dst_ok[b, col]
            d = tab.dst[b, col]
        else:
            wr = ok & (i == tab.lens[b] - 1) & tab.dst_ok[b, 0]
            d = tab.dst[b, 0]
        st = scatter_set(st, jnp.where(wr, d, L), hn)
        return (hn, st), jnp.where(ok, y, 0.0)

    init = (jnp.zeros((H, P, Ns), jnp.float32), state)
    (_, state), ys = jax.lax.scan(
        body, init, (jnp.arange(T), a.x, a.dt, a.B, a.C, zs))
    return ys.astype(a.x.dtype), state


# --------------------------------------------------------------------------- #
# TPU (Mosaic) kernel
# --------------------------------------------------------------------------- #


def _row_to_col(v):
    """[1, n] -> [n, 1]."""
    return jnp.transpose(v)


@_backend.register(OP_SSU, "tpu")
def _ssu_tpu(a: _SSUArgs, *, config: SSUConfig, interpret):
    """Mosaic kernel, grid (heads, sequences).

    * Index tables (bos, lens, src, src_ok, dst, dst_ok) are scalar-prefetched to SMEM.
    * ``state`` stays in HBM (``memory_space=pl.ANY``), aliased to the output: a row is
      DMA'd in only when ``src_ok`` (else the accumulator is zeroed with ``pl.when``) and
      DMA'd out only when its ``dst_ok``; a null or out-of-range row issues no DMA at all.
    * Token inputs are head-major VMEM blocks (one head per block); the output block of a
      head stays resident across the sequence axis ("arbitrary"), is zeroed at the first
      sequence and written back once, so tokens outside every sequence read 0.
    """
    state = a.state
    L, H, P, Ns = state.shape
    T = a.x.shape[0]
    G = a.B.shape[1]
    ratio = H // G
    N = a.num_seqs
    if N == 0 or T == 0:
        return jnp.zeros(a.x.shape, a.x.dtype), state
    tab = _tables(a)
    Wd = tab.dst.shape[1]

    x_hm = jnp.swapaxes(a.x, 0, 1)  # [H, T, P]
    dt_hm = jnp.swapaxes(a.dt, 0, 1)  # [H, T, Pdt]
    B_gm = jnp.swapaxes(a.B, 0, 1)  # [G, T, Ns]
    C_gm = jnp.swapaxes(a.C, 0, 1)
    Pdt = dt_hm.shape[2]
    _, Pa, Na = a.A.shape
    has_D, has_bias, has_z = a.D is not None, a.dt_bias is not None, a.z is not None
    if not interpret:  # compiled: one grid step's blocks (double-buffered) must fit VMEM
        tpu_target.check_vmem(OP_SSU, [
            ("x", (T, P), a.x.dtype, 2), ("dt", (T, Pdt), a.dt.dtype, 2),
            ("B", (T, Ns), a.B.dtype, 2), ("C", (T, Ns), a.C.dtype, 2), ("A", (Pa, Na), a.A.dtype, 2),
            *([("D", (1, a.D.shape[-1]), a.D.dtype, 2)] if has_D else []),
            *([("dt_bias", (1, a.dt_bias.shape[-1]), a.dt_bias.dtype, 2)] if has_bias else []),
            *([("z", (T, P), a.z.dtype, 2)] if has_z else []),
            ("out", (T, P), a.x.dtype, 2), ("state", (P, Ns), state.dtype, 1),
            ("accumulator", (P, Ns), jnp.float32, 1),
        ], hint=f"the kernel holds all {T} tokens of a head in VMEM: pass fewer tokens per call")

    prefetch = (tab.bos, tab.lens, tab.src, tab.src_ok.astype(jnp.int32),
                tab.dst.reshape(-1), tab.dst_ok.astype(jnp.int32).reshape(-1))
    n_pf = len(prefetch)

    def head_spec(last):
        return pl.BlockSpec((None, T, last), lambda h, b, *_: (h, 0, 0))

    inputs = [x_hm, dt_hm, B_gm, C_gm, a.A]
    in_specs = [
        head_spec(P),
        head_spec(Pdt),
        pl.BlockSpec((None, T, Ns), lambda h, b, *_: (jax.lax.div(h, jnp.int32(ratio)), 0, 0)),
        pl.BlockSpec((None, T, Ns), lambda h, b, *_: (jax.lax.div(h, jnp.int32(ratio)), 0, 0)),
        pl.BlockSpec((None, Pa, Na), lambda h, b, *_: (h, 0, 0)),
    ]
    if has_D:
        inputs.append(a.D[:, None, :])
        in_specs.append(pl.BlockSpec((None, 1, a.D.shape[1]), lambda h, b, *_: (h, 0, 0)))
    if has_bias:
        inputs.append(a.dt_bias[:, None, :])
        in_specs.append(pl.BlockSpec((None, 1, a.dt_bias.shape[1]), lambda h, b, *_: (h, 0, 0)))
    if has_z:
        inputs.append(jnp.swapaxes(a.z, 0, 1))
        in_specs.append(head_spec(P))
    inputs.append(state)
    in_specs.append(pl.BlockSpec(memory_space=pl.ANY))
    state_in_index = n_pf + len(inputs) - 1

    per_token = a.per_token
    softplus = a.dt_softplus

    def kernel(bos_ref, len_ref, src_ref, srcok_ref, dst_ref, dstok_ref, *refs):
        it = iter(refs)
        x_ref, dt_ref, B_ref, C_ref, A_ref = (next(it) for _ in range(5))
        D_ref = next(it) if has_D else None
        bias_ref = next(it) if has_bias else None
        z_ref = next(it) if has_z else None
        _state_in = next(it)  # aliased with state_hbm; never touched through this name
        out_ref, state_hbm = next(it), next(it)
        stage, hacc, sem = next(it), next(it), next(it)
        h = pl.program_id(0)
        b = pl.program_id(1)
        f32 = jnp.float32

        @pl.when(b == 0)
        def _():
            out_ref[...] = jnp.zeros(out_ref.shape, out_ref.dtype)

        @pl.when(srcok_ref[b] != 0)
        def _():
            cp = pltpu.make_async_copy(state_hbm.at[src_ref[b], h], stage, sem)
            cp.start()
            cp.wait()
            hacc[...] = stage[...].astype(f32)

        @pl.when(srcok_ref[b] == 0)
        def _():
            hacc[...] = jnp.zeros(hacc.shape, f32)

        def store_state(dst_row):
            stage[...] = hacc[...].astype(stage.dtype)
            cp = pltpu.make_async_copy(stage, state_hbm.at[dst_row, h], sem)
            cp.start()
            cp.wait()

        n_tok = len_ref[b]
        t0 = bos_ref[b]

        def body(i, carry):
            t = t0 + i
            x_row = x_ref[pl.ds(t, 1), :].astype(f32)  # [1, P]
            dt_row = dt_ref[pl.ds(t, 1), :].astype(f32)  # [1, Pdt]
            if has_bias:
                dt_row = dt_row + bias_ref[...].astype(f32)
            if softplus:
                dt_row = mc.softplus(dt_row)
            dt_col = _row_to_col(dt_row)  # [Pdt|Pb, 1]
            x_col = _row_to_col(x_row)  # [P, 1]
            dA = jnp.exp(A_ref[...].astype(f32) * dt_col)
            B_row = B_ref[pl.ds(t, 1), :].astype(f32)  # [1, Ns]
            C_row = C_ref[pl.ds(t, 1), :].astype(f32)
            hn = hacc[...] * dA + (dt_col * B_row) * x_col
            hacc[...] = hn
            if per_token:
                @pl.when(i < Wd)
                def _():
                    k = b * Wd + i

                    @pl.when(dstok_ref[k] != 0)
                    def _():
                        store_state(dst_ref[k])
            y_row = _row_to_col(jnp.sum(hn * C_row, axis=1, keepdims=True))  # [1, P]
            if has_D:
                y_row = y_row + x_row * D_ref[...].astype(f32)
            if has_z:
                z_row = z_ref[pl.ds(t, 1), :].astype(f32)
                y_row = y_row * (z_row * jax.nn.sigmoid(z_row))
            out_ref[pl.ds(t, 1), :] = y_row.astype(out_ref.dtype)
            return carry

        jax.lax.fori_loop(0, n_tok, body, 0)

        if not per_token:
            @pl.when((dstok_ref[b * Wd] != 0) & (n_tok > 0))
            def _():
                store_state(dst_ref[b * Wd])

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=n_pf,
        grid=(H, N),
        in_specs=in_specs,
        out_specs=[head_spec(P), pl.BlockSpec(memory_space=pl.ANY)],
        scratch_shapes=[
            pltpu.VMEM((P, Ns), state.dtype),
            pltpu.VMEM((P, Ns), jnp.float32),
            pltpu.SemaphoreType.DMA,
        ],
    )
    out_hm, state = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((H, T, P), a.x.dtype),
                   jax.ShapeDtypeStruct(state.shape, state.dtype)],
        input_output_aliases={state_in_index: 1},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
    )(*prefetch, *inputs)
    return jnp.swapaxes(out_hm, 0, 1), state


# --------------------------------------------------------------------------- #
# GPU kernel
# --------------------------------------------------------------------------- #


@dataclasses.dataclass(frozen=True)
class SSUConfig:
    """Tuning knobs of the GPU kernel (a static argument; defaults: BENCHMARKS.md,
    "Kernel design notes").

    A program holds ``[block_m, pow2(dstate)]`` of one head's state.

    Attributes:
      gpu_tile_elems: ``block_m * pow2(dstate)`` aims at this many elements.
      gpu_block_m: a fixed ``block_m`` instead of the rule.
      gpu_num_warps: warps per program.
      gpu_eviction: eviction policy of the state row loads and stores (None: default).
    """

    gpu_tile_elems: int = 4096
    gpu_block_m: int | None = None
    gpu_num_warps: int = 4
    gpu_eviction: str | None = None

    def __post_init__(self):
        # block_m (or gpu_tile_elems // pow2(dstate)) is a Triton block: a power of two
        validation.check_config_ints(self, ("gpu_tile_elems", "gpu_block_m"))


def _ssu_gpu_tile(P: int, Ns: int, cfg: SSUConfig) -> tuple[int, int]:
    """(BM, num_warps) for the GPU kernel."""
    bm = cfg.gpu_block_m or max(1, cfg.gpu_tile_elems // mc.pow2(Ns))
    bm = min(bm, mc.pow2(P))
    return bm, cfg.gpu_num_warps


@_backend.register(OP_SSU, "gpu")
def _ssu_gpu(a: _SSUArgs, *, config: SSUConfig, interpret: bool):
    """Pallas GPU kernel: one program per (sequence, head, block of ``dim``), masked
    loads/stores (the structure of vLLM's Triton kernel, with larger blocks).

    One launch per call: the kernel reads the index tables as passed and applies the
    rules of :func:`_tables` per sequence, and writes every token of ``out`` (the
    tokens outside every sequence get zeros from the programs in turn), so nothing
    runs before or after it.
    """
    state = a.state
    L, H, P, Ns = state.shape
    T = a.x.shape[0]
    G = a.B.shape[1]
    ratio = H // G
    N = a.num_seqs
    if N == 0 or T == 0:
        return jnp.zeros(a.x.shape, a.x.dtype), state
    BM, num_warps = _ssu_gpu_tile(P, Ns, config)
    evict = config.gpu_eviction
    BN = mc.pow2(Ns)
    Pdt = a.dt.shape[2]
    _, Pa, Na = a.A.shape
    has_D, has_bias, has_z = a.D is not None, a.dt_bias is not None, a.z is not None
    per_token = a.per_token
    softplus = a.dt_softplus
    varlen = a.varlen
    has_sbi, has_dsbi = a.sbi is not None, a.dsbi is not None
    W = a.sbi.shape[1] if has_sbi else 1
    Wd = a.dsbi.shape[1] if has_dsbi else W
    null = a.null
    NB = mc.pow2(N)

    def operand(v):  # (array the kernel reads, its first column) for a Columns operand
        return (v.parent, v.start) if isinstance(v, mc.Columns) else (v, None)

    (xa, xc), (dta, dtc), (Ba, Bc), (Ca, Cc) = (operand(v) for v in (a.x, a.dt, a.B, a.C))
    za, zc = operand(a.z) if has_z else (None, None)
    Aa, Ac = operand(a.A)  # Columns only of shape [H, 1, 1]: column Ac of an [H, *] array
    optional = [a.cu, a.sbi, a.dsbi, a.na]
    inputs = [v for v in optional if v is not None] + [xa, dta, Ba, Ca, Aa]
    inputs += [v for v in (a.D, a.dt_bias, za) if v is not None]
    inputs.append(state)

    def kernel(*refs):
        it = iter(refs)
        cu_ref, sbi_ref, dsbi_ref, na_ref = (next(it) if v is not None else None for v in optional)
        x_ref, dt_ref, B_ref, C_ref, A_ref = (next(it) for _ in range(5))
        D_ref = next(it) if has_D else None
        bias_ref = next(it) if has_bias else None
        z_ref = next(it) if has_z else None
        next(it)  # state input, aliased to state_ref
        out_ref, state_ref = next(it), next(it)
        if not has_dsbi:
            dsbi_ref = sbi_ref
        f32 = jnp.float32
        b = pl.program_id(0)
        h = pl.program_id(1)
        zero = jnp.int32(0)  # index literals stay int32 under jax_enable_x64
        m0 = pl.program_id(2) * BM
        g = h // ratio
        offs_m = m0 + jnp.arange(BM, dtype=jnp.int32)
        offs_n = jnp.arange(BN, dtype=jnp.int32)
        mask_m = offs_m < P
        mask_n = offs_n < Ns
        mask2 = mask_m[:, None] & mask_n[None, :]
        ds_m = pl.ds(m0, BM)
        ds_n = pl.ds(zero, BN)

        # The sequence: tokens t0 .. t0 + n_tok - 1 (mc.sequence_bounds, per sequence).
        if varlen:
            j = jnp.arange(NB, dtype=jnp.int32)
            lo = _backend.triton.load(cu_ref.at[pl.ds(zero, NB)], mask=j < N, other=0)
            hi = _backend.triton.load(cu_ref.at[j + 1], mask=j < N, other=0)
            # k: the number of leading well-formed sequences; sequence b is real iff b < k
            k = jnp.min(jnp.where(mc.offsets_good(lo, hi, T) | (j >= N), N, j))
            real = b < k
            t0 = jnp.where(real, cu_ref[b], T)
            n_tok = jnp.where(real, cu_ref[b + 1] - jnp.where(real, cu_ref[b], 0), 0)
        else:
            t0, n_tok = b, 1

        # Its state rows (_tables, per sequence).
        if not has_sbi:
            src, src_ok = b, True
        elif W == 0:
            src, src_ok = zero, False
        else:
            col, col_ok = _first_column(na_ref[b] if per_token else 1, W)
            # int32 `zero`, not a Python 0: Triton lowered that literal to an i1 here
            src = sbi_ref[b, jnp.where(col_ok, col, zero)]
            src_ok = _reads(col_ok, src, L, null)

        def load_vec(ref, c0, t, width):
            # row [t, h, :] of a [T, H, width] array, width in {1, P}; with a first column c0,
            # of columns c0 .. c0 + H * width of a 2-D array
            if width == 1:
                at = ref.at[t, h, pl.ds(zero, 1)] if c0 is None else ref.at[t, pl.ds(c0 + h, 1)]
                return _backend.triton.load(at).astype(f32)
            at = ref.at[t, h, ds_m] if c0 is None else ref.at[t, pl.ds(c0 + h * width + m0, BM)]
            return _backend.triton.load(at, mask=mask_m, other=0.0).astype(f32)

        def load_group(ref, c0, t):
            # row [t, g, :] of a [T, G, Ns] array (or of columns c0 .. c0 + G * Ns)
            at = ref.at[t, g, ds_n] if c0 is None else ref.at[t, pl.ds(c0 + g * Ns, BN)]
            return _backend.triton.load(at, mask=mask_n, other=0.0).astype(f32)

        def load_head_vec(ref, width):
            if width == 1:
                return _backend.triton.load(ref.at[h, pl.ds(zero, 1)]).astype(f32)
            return _backend.triton.load(ref.at[h, ds_m], mask=mask_m, other=0.0).astype(f32)

        if Ac is not None:
            A = _backend.triton.load(A_ref.at[pl.ds(h, 1), pl.ds(Ac, 1)]).astype(f32)
        elif Pa == 1 and Na == 1:
            A = _backend.triton.load(A_ref.at[h, pl.ds(zero, 1), pl.ds(zero, 1)]).astype(f32)
        else:
            am = (mask_m if Pa > 1 else jnp.ones((1,), bool))[:, None] & (
                mask_n if Na > 1 else jnp.ones((1,), bool))[None, :]
            A = _backend.triton.load(A_ref.at[h, ds_m if Pa > 1 else pl.ds(zero, 1),
                                    ds_n if Na > 1 else pl.ds(zero, 1)],
                          mask=am, other=0.0).astype(f32)
        D = load_head_vec(D_ref, D_ref.shape[1]) if has_D else None
        bias = load_head_vec(bias_ref, bias_ref.shape[1]) if has_bias else None

        def read_state():
            v = _backend.triton.load(state_ref.at[src, h, ds_m, ds_n], mask=mask2, other=0.0,
                          eviction_policy=evict)
            return v.astype(f32)

        if src_ok is True:
            h0 = read_state()
        elif src_ok is False:
            h0 = jnp.zeros((BM, BN), f32)
        else:
            h0 = jax.lax.cond(src_ok, read_state, lambda: jnp.zeros((BM, BN), f32))

        def write_state(row, val):
            _backend.triton.store(state_ref.at[row, h, ds_m, ds_n], val.astype(state_ref.dtype), mask=mask2,
                       eviction_policy=evict)

        def body(i, hc):
            t = t0 + i
            x = load_vec(x_ref, xc, t, P)
            dt = load_vec(dt_ref, dtc, t, Pdt)
            if has_bias:
                dt = dt + bias
            if softplus:
                dt = mc.softplus(dt)
            dA = jnp.exp(A * dt[:, None])
            Bv = load_group(B_ref, Bc, t)
            Cv = load_group(C_ref, Cc, t)
            hn = hc * dA + (Bv[None, :] * dt[:, None]) * x[:, None]
            if per_token and Wd > 0:
                @pl.when(i < Wd)
                def _():
                    d = dsbi_ref[b, i]

                    @pl.when(_writes(src_ok, d, L, null))
                    def _():
                        write_state(d, hn)
            y = jnp.sum(hn * Cv[None, :], axis=1)
            if has_D:
                y = y + x * D
            if has_z:
                zz = load_vec(z_ref, zc, t, P)
                y = y * (zz * jax.nn.sigmoid(zz))
            _backend.triton.store(out_ref.at[t, h, ds_m], y.astype(out_ref.dtype), mask=mask_m)
            return hn

        # Without cu_seqlens every sequence is one token: no loop.
        hf = body(zero, h0) if not varlen else jax.lax.fori_loop(0, n_tok, body, h0)
        if not per_token and Wd > 0:
            if has_sbi:
                d = dsbi_ref[b, 0]
                store = _writes(src_ok, d, L, null)
            else:
                d, store = b, True
            if varlen:
                store = store & (n_tok > 0)
            if store is True:
                write_state(d, hf)
            else:
                @pl.when(store)
                def _():
                    write_state(d, hf)

        if varlen:
            # Tokens outside every sequence (before cu[0], after the last real one,
            # all of them when none is real) read 0: zeroed by program b at b, b + N, ...
            first = jnp.where(k > 0, cu_ref[zero], T)
            last = jnp.where(k > 0, cu_ref[k], T)
            zeros = jnp.zeros((BM,), out_ref.dtype)

            def zero_tokens(lo_t, hi_t):
                def zbody(i, carry):
                    _backend.triton.store(out_ref.at[lo_t + b + i * N, h, ds_m], zeros, mask=mask_m)
                    return carry

                jax.lax.fori_loop(0, (jnp.maximum(hi_t - lo_t - b, 0) + (N - 1)) // N, zbody, 0)

            zero_tokens(zero, first)
            zero_tokens(last, T)

    out, state = pl.pallas_call(
        kernel,
        grid=(N, H, pl.cdiv(P, BM)),
        out_shape=[jax.ShapeDtypeStruct(a.x.shape, a.x.dtype),
                   jax.ShapeDtypeStruct(state.shape, state.dtype)],
        input_output_aliases={len(inputs) - 1: 1},
        compiler_params=_backend.gpu_compiler_params(num_warps),
        interpret=interpret,
    )(*inputs)
    return out, state


# --------------------------------------------------------------------------- #
# public entry point
# --------------------------------------------------------------------------- #


def selective_state_update(
    state, x, dt, A, B, C, D=None, dt_bias=None, z=None, dt_softplus=False,
    state_batch_indices=None, dst_state_batch_indices=None, null_block_id=NULL_BLOCK_ID,
    num_accepted_tokens=None, cu_seqlens=None, *, backend="auto", interpret=None,
    config: SSUConfig = SSUConfig(),
):
    """One SSM recurrence step per token, reading and writing a pool of states.

    Mirrors vLLM's ``selective_state_update`` (``mamba_ssm.py``) but returns
    ``(out, state)`` instead of writing ``out``/``state`` in place; donate ``state``
    at the enclosing ``jit`` so the kernels update it in place.

    Shapes (``T`` tokens, ``L`` state rows, ``H`` heads, ``P`` = dim, ``Ns`` = dstate,
    ``G`` groups with ``H % G == 0``; head ``h`` uses group ``h // (H // G)``). With heads:

    * ``state``: ``[L, H, P, Ns]`` float (any float dtype; it is stored in that dtype).
    * ``x``, ``z``: ``[T, H, P]``; ``dt``: ``[T, H, P]`` or ``[T, H, 1]`` (per-head dt,
      vLLM's TIE_HDIM case, broadcast over ``P``).
    * ``A``: ``[H, P, Ns]`` or any of ``[H, 1, 1]``, ``[H, P, 1]``, ``[H, 1, Ns]`` (broadcast).
    * ``B``, ``C``: ``[T, G, Ns]``.
    * ``D``, ``dt_bias``: ``[H, P]`` or ``[H, 1]``.

    Without heads drop the ``H`` axis everywhere (``state [L, P, Ns]``, ``x [T, P]``,
    ``A [P, Ns]``, ``B [T, Ns]``, ``D [P]``...): it is treated as ``H = G = 1``.

    ``x``, ``dt``, ``B``, ``C``, ``z`` and ``A`` may each be a
    :class:`~pallas_kernels.mamba_common.Columns` of that shape (columns of a wider 2-D array,
    as vLLM's may be strided views of one projection; ``A [H, 1, 1]``, one column of an
    ``[H, layers]`` table of every layer's rates): the GPU kernel reads them in place.

    Index tables (any integer dtype; computed in int32):

    * ``state_batch_indices``: ``[N]`` or ``[N, W]`` (extra rows beyond N are ignored);
      ``dst_state_batch_indices`` the same, defaulting to ``state_batch_indices``
      (in place). Without them sequence ``b`` uses state row ``b`` (needs ``L >= N``).
    * ``cu_seqlens``: ``[N + 1]`` non-decreasing token offsets (varlen: sequence ``b``
      is tokens ``cu_seqlens[b] .. cu_seqlens[b+1]-1``); without it ``N = T`` and each
      token is its own sequence.
    * ``num_accepted_tokens``: ``[N]``; selects the speculative path.

    Semantics (math in float32, ``softplus(v) = v if v > 20 else log1p(exp(v))``):

    * initial column ``c = max(num_accepted_tokens[b] - 1, 0)`` in the speculative path,
      else 0; ``src = state_batch_indices[b, c]``. ``src == null_block_id`` reads a
      ZERO initial state (slot ``null_block_id`` is never read) and the sequence writes
      no state at all; its output rows are still computed from the zero state (finite).
    * each token: ``dt' = softplus?(dt + dt_bias)``, ``h = h*exp(A*dt') + (B*dt')*x``,
      ``y = sum(h*C, -1) + x*D``, ``y *= z*sigmoid(z)``; ``out`` has ``x``'s dtype.
    * precision (kvjax's own convention): ``h`` stays float32 from the read to the
      output, and is rounded to ``state.dtype`` only when stored. vLLM's reference
      (``selective_state_update_ref``) rounds the new state to the state dtype
      *before* computing ``y``; with a bf16 state the two outputs differ by up to that
      rounding (up to ``2**-8 |h|`` per state element). kvjax's ``out`` is the closer
      one to a float64 evaluation of the same inputs: in vLLM's largest bf16 case
      (dim 4096, ngroups 4, dstate 64, heads, batch indices, z) every element is
      within bf16 rounding (``2**-8`` relative, ``1e-3`` absolute) of float64, where
      the bf16-rounded state misses that bound on about 1 element in 6 (and in one
      reported run 1 element of 12,288 missed vLLM's own tolerance against vLLM's
      reference); ``tests/peers/test_vllm_mamba_ssm.py``. There is no switch to
      vLLM's rounding.
    * speculative path: token ``i`` of sequence ``b`` stores ``h`` to
      ``dst_state_batch_indices[b, i]``, skipped iff that entry is null (or the src is
      null, as in vLLM's kernel, whose store mask includes the src check).
    * otherwise the final ``h`` goes to ``dst_state_batch_indices[b, 0]``, only when the
      src is valid and the sequence has >= 1 token. A null dst is skipped too (vLLM
      would write the null row here; kvjax never writes row ``null_block_id``).
    * varlen sequences of length 0 compute and write nothing; tokens that belong to no
      sequence get ``out = 0``.
    * a row written by one sequence and read or written by another in the same call
      gives an unspecified result (as in vLLM, whose programs run in parallel).

    Errors: shape/dtype mismatches raise ``ValueError`` at trace time; concrete indices
    outside ``[0, L)`` (other than ``null_block_id``), a concrete ``num_accepted_tokens``
    above ``W``, or a varlen speculative sequence longer than the dst table raise
    ``ValueError``. Under ``jit`` such entries are masked, never clamped: an
    out-of-range src (or initial column) is treated like the null row (zero state, no
    writes), an out-of-range dst is never written, tokens past the dst table's width
    store no state.

    Args:
      backend, interpret: see :mod:`pallas_kernels._backend`.
      config: :class:`SSUConfig` GPU tuning knobs (static).

    Returns:
      ``(out, state)``: ``out`` shaped like ``x``; the updated state pool.
    """
    choice = _backend.choose(OP_SSU, backend, interpret)
    if not isinstance(config, SSUConfig):
        raise ValueError(f"config must be an SSUConfig, got {config!r}")
    for name, v in (("state", state), ("D", D), ("dt_bias", dt_bias)):
        if isinstance(v, mc.Columns):
            raise ValueError(f"{name} cannot be given as Columns (only x, dt, A, B, C and z can)")
    if any(isinstance(v, mc.Columns) for v in (x, dt, A, B, C, z)) and (
            choice.flavor != "gpu" or np.ndim(state) != 4):  # only the GPU kernel reads them in place
        x, dt, A, B, C, z = mc.values(x, dt, A, B, C, z)
    elif isinstance(A, mc.Columns) and tuple(A.shape[1:]) != (1, 1):
        A = A.value()  # the kernel reads a per-head scalar in place, a wider A as an array
    args = _normalize(state, x, dt, A, B, C, D, dt_bias, z, dt_softplus,
                      state_batch_indices, dst_state_batch_indices, null_block_id,
                      num_accepted_tokens, cu_seqlens)
    out, new_state = _backend.run(OP_SSU, choice, args, config=config)
    if not args.has_heads:
        out = out.reshape(x.shape)
        new_state = new_state.reshape(state.shape)
    return out, new_state
