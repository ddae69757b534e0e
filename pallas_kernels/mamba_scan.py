"""Prefill side of the Mamba2 state masking: a varlen selective scan.

:func:`selective_scan_varlen` runs the Mamba2 recurrence (per-head scalar ``dt`` and
``A``) over a packed batch of requests, starting each request from its cached state
or from ZERO, and writing each request's final state back to its slot.

Two jnp implementations with identical semantics:

* ``_scan_tokens`` (``backend="reference"``): a ``lax.scan`` over tokens; obviously
  correct, the oracle.
* ``_scan_chunked`` (``backend="pallas_tpu"`` and the GPU's fallback): the SSD chunked
  form used by vLLM's ``mamba_chunk_scan_combined_varlen``, in jnp: requests are cut into
  chunks of ``chunk_size`` tokens that never span two requests; inside a chunk the scan is
  a masked ``[Q, Q]`` matrix product, between chunks an associative scan over chunk states.

And three Pallas GPU kernels of the same chunked form (``_scan_gpu``, the ``"gpu"``
flavour, the structure of vLLM's Triton scan); the chunk table is built in jnp
(``[chunks]``-sized), then

* ``chunk_states`` (grid: chunks x heads of one group): each chunk's own state from a zero
  start, ``(x * exp(cum_end - cum) * dt)^T @ B``, and its total log decay;
* ``state_passing`` (grid: heads x blocks of the state) walks the chunks in order: the
  state entering a chunk is its request's initial state at a first chunk (a select, so a
  NaN cannot cross requests), else the previous chunk's leaving state; each request's
  final state is written in place into the pool;
* ``chunk_outputs`` (grid: chunks x heads of one group x row blocks) computes a chunk's
  outputs, ``(L o C B^T o dt) @ x + exp(cum) * C @ s_in^T + D x``, gated by ``z``, straight
  from the packed token arrays into the packed output: no ``[chunks, Q, ...]`` copies, no
  transposes, and ``C B^T`` once per group.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import contract as validation
from pallas_kernels.contract import NULL_BLOCK_ID
from pallas_kernels import _backend
from pallas_kernels import mamba_common as mc
from pallas_kernels._xla import scatter_set
from pallas_kernels import gpu_tiling

__all__ = ["selective_scan_varlen", "DEFAULT_CHUNK_SIZE"]

OP_SCAN = "selective_scan_varlen"
# Tokens per chunk of the chunked form (BENCHMARKS.md, "Kernel design notes").
DEFAULT_CHUNK_SIZE = 128


def _prep(dt, dt_bias, softplus):
    dt = dt.astype(jnp.float32)
    if dt_bias is not None:
        dt = dt + dt_bias.astype(jnp.float32)
    return mc.softplus(dt) if softplus else dt


def _requests(query_start_loc, cache_indices, has_initial_state, null_block_id, num_lines, num_tokens):
    """``(bos, lens, ok, use_init)`` per request: its tokens, whether it runs (a real cache index
    and tokens), whether it starts from its slot's state (else from zero)."""
    bos, lens = mc.sequence_bounds(query_start_loc, num_tokens)
    ok = mc.valid_index(cache_indices, num_lines, null_block_id) & (lens > 0)
    return bos, lens, ok, ok & has_initial_state


def _skip_and_init(state, query_start_loc, cache_indices, has_initial_state, null_block_id,
                   num_tokens):
    L = state.shape[0]
    bos, lens, ok, use_init = _requests(query_start_loc, cache_indices, has_initial_state,
                                        null_block_id, L, num_tokens)
    h0 = jnp.take(state, jnp.where(use_init, cache_indices, L), axis=0, mode="fill", fill_value=0)
    h0 = jnp.where(use_init[:, None, None, None], h0.astype(jnp.float32), 0.0)
    return bos, lens, ok, h0


def _finish(y, x, D, z, mask):
    f32 = jnp.float32
    if D is not None:
        Df = D.astype(f32)
        y = y + x.astype(f32) * (Df[:, None] if Df.ndim == 1 else Df)
    if z is not None:
        zf = z.astype(f32)
        y = y * (zf * jax.nn.sigmoid(zf))
    return jnp.where(mask, y, 0.0)


@_backend.register(OP_SCAN, "reference")
def _scan_tokens(x, dt, A, B, C, state, query_start_loc, cache_indices, has_initial_state,
                 D, dt_bias, z, *, softplus, null_block_id, chunk_size, max_sequences, config,
                 dot_dtype, interpret):
    del chunk_size, max_sequences, config, dot_dtype, interpret
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    R = cache_indices.shape[0]
    L = state.shape[0]
    if R == 0 or T == 0:
        return jnp.zeros(x.shape, x.dtype), state
    goh = jnp.arange(H) // (H // G)
    bos, lens, ok, h0 = _skip_and_init(state, query_start_loc, cache_indices,
                                       has_initial_state, null_block_id, T)
    seg, pos, tvalid = mc.token_segment_ids(bos, lens, T)
    tok_ok = tvalid & ok[seg]
    dtp = _prep(dt, dt_bias, softplus)  # [T, H]
    Af = A.astype(jnp.float32)

    def body(carry, t):
        h, finals = carry
        r, i, good = seg[t], pos[t], tok_ok[t]
        h = jnp.where(i == 0, h0[r], h)
        d = dtp[t]  # [H]
        Bh = B[t].astype(jnp.float32)[goh]  # [H, N]
        Ch = C[t].astype(jnp.float32)[goh]
        h = h * jnp.exp(d * Af)[:, None, None] + (d[:, None, None] * x[t].astype(jnp.float32)[:, :, None]) * Bh[:, None, :]
        y = jnp.sum(h * Ch[:, None, :], axis=-1)  # [H, P]
        last = good & (i == lens[r] - 1)
        finals = finals.at[jnp.where(last, r, R)].set(h, mode="drop")
        return (h, finals), y

    init = (jnp.zeros((H, P, N), jnp.float32), jnp.zeros((R, H, P, N), jnp.float32))
    (_, finals), ys = jax.lax.scan(body, init, jnp.arange(T))
    out = _finish(ys, x, D, z, tok_ok[:, None, None]).astype(x.dtype)
    state = scatter_set(state, jnp.where(ok, cache_indices, L), finals)
    return out, state


def _rounded(a, dot_dtype):
    """``a`` as a product operand: float32, rounded through ``dot_dtype`` first when that is
    narrower (the products of such operands are exact in float32, so a float32 product of
    them equals a ``dot_dtype`` product accumulated in float32)."""
    a = a.astype(jnp.float32)
    return a if dot_dtype is None else a.astype(dot_dtype).astype(jnp.float32)


class _Chunks(NamedTuple):
    """The chunk table of the chunked forms, per chunk ``[NC]`` (``request``'s own: ``[R]``)."""

    request: jax.Array  # its request (0 if unused)
    used: jax.Array  # whether it holds tokens of a running request
    first: jax.Array  # its request's first chunk
    last: jax.Array  # its request's last chunk
    start: jax.Array  # int32: its first token (0 if unused)
    length: jax.Array  # int32: its token count (0 if unused)
    final: jax.Array  # [R]: each request's last chunk (0 for a skipped request)


def _sizes(T: int, R: int, chunk_size: int, max_sequences, config) -> tuple[int, int]:
    """``(Q, NC)``: tokens per chunk and the static bound on the chunks: ``ceil(T / Q)`` plus
    one partial chunk per sequence that takes chunks (``max_sequences`` bounds them)."""
    Rs = R if max_sequences is None else max(1, min(R, max_sequences))
    Q = _chunk_len(chunk_size, T, Rs, config.adapt_chunk)
    return Q, -(-T // Q) + Rs


def _chunk_table(bos, lens, ok, Q: int, NC: int) -> _Chunks:
    """Request ``r`` owns chunks ``coff[r] .. coff[r] + nch[r] - 1`` (``Q`` tokens each but its
    last); a chunk never spans two requests and skipped requests own none."""
    R = lens.shape[0]
    nch = jnp.where(ok, (lens + Q - 1) // Q, 0)
    cend = jnp.cumsum(nch)
    coff = cend - nch
    c = jnp.arange(NC)
    rc = jnp.searchsorted(cend, c, side="right", method="compare_all").astype(jnp.int32)
    used = rc < R
    rc = jnp.where(used, rc, 0)
    k = c - coff[rc]
    return _Chunks(
        request=rc, used=used, first=used & (k == 0), last=used & (k == nch[rc] - 1),
        start=jnp.where(used, bos[rc] + k * Q, 0).astype(jnp.int32),
        length=jnp.where(used, jnp.clip(lens[rc] - k * Q, 0, Q), 0).astype(jnp.int32),
        final=jnp.where(ok, cend - 1, 0))


def _chunk_states(s_loc, lam, first, h_first, sequential: bool = False):
    """States entering and leaving each chunk: ``s_out[c] = lam[c] * s_in[c] + s_loc[c]``.

    ``s_in[c]`` is ``h_first[c]`` where ``first[c]`` (a request's first chunk), else
    ``s_out[c - 1]``. Shapes: ``s_loc``, ``h_first`` ``[NC, H, P, N]``; ``lam`` ``[NC, H]``;
    ``first`` bool ``[NC]``. Computed as an associative scan of the affine maps
    ``s -> lam * s + b`` with a reset flag at first chunks (O(log NC) steps, no loop: an
    XLA while loop on a GPU launches every iteration's kernels one after another). A reset
    selects, never multiplies by zero, so a NaN or inf state of one request cannot reach
    the next.
    """
    reset = first[:, None, None, None]
    lam4 = lam[:, :, None, None]
    b = s_loc + jnp.where(reset, lam4 * h_first, 0.0)

    if sequential:
        def step(carry, inp):
            lam_c, b_c, r_c = inp
            out = jnp.where(r_c, b_c, lam_c * carry + b_c)
            return out, out

        _, s_out = jax.lax.scan(step, jnp.zeros(s_loc.shape[1:], s_loc.dtype), (lam4, b, reset))
    else:
        def compose(earlier, later):  # apply `earlier`, then `later`
            a1, b1, r1 = earlier
            a2, b2, r2 = later
            return (jnp.where(r2, a2, a1 * a2), jnp.where(r2, b2, a2 * b1 + b2), r1 | r2)

        _, s_out, _ = jax.lax.associative_scan(compose, (lam4, b, reset))
    prev = jnp.concatenate([jnp.zeros_like(s_out[:1]), s_out[:-1]], axis=0)
    s_in = jnp.where(reset, h_first, prev)
    return s_in, s_out


def _chunk_len(chunk_size: int, T: int, R: int, adapt: bool = True) -> int:
    """Tokens per chunk: ``chunk_size``, or fewer when the batch has many short requests.

    The chunk table is static: ``ceil(T / Q) + R`` chunks of ``Q`` tokens (each request may
    end in a partial chunk), so the padded work grows as ``T + R * Q``. A decode-heavy batch
    (``T`` close to ``R``) with ``Q = 128`` pads every token to a chunk of 128; hence ``Q``
    is the power of two covering ``T / R`` tokens, at least ``_MIN_CHUNK``, at most
    ``chunk_size``. Long prefills (``T / R >= chunk_size``) keep ``chunk_size``.
    """
    if not adapt:
        return chunk_size
    per_request = -(-T // max(R, 1))
    return int(min(chunk_size, max(_MIN_CHUNK, 1 << max(per_request - 1, 0).bit_length())))


_MIN_CHUNK = 16


@dataclasses.dataclass(frozen=True)
class ScanConfig:
    """Knobs of the chunked form (a static argument; the reference flavour ignores them).

    Attributes:
      adapt_chunk: chunks shrink for batches of many short requests (see ``_chunk_len``);
        False keeps ``chunk_size`` always.
      chunk_states: how the jnp form passes states between chunks: ``"associative"`` (an
        associative scan, no loop) or ``"sequential"`` (a ``lax.scan``: an XLA while loop,
        which a GPU runs one iteration after another). The GPU kernels always walk a head's
        chunks in order inside one program.
      gpu_heads_per_program: heads of one group per ``chunk_states`` and ``chunk_outputs``
        program (they share the group's ``B`` / ``C`` rows; at most the heads per group).
      gpu_block_q: chunk rows per ``chunk_outputs`` program (at most the chunk length).
      gpu_block_state: state elements (of ``P * N``) per ``state_passing`` program.
      gpu_num_warps, gpu_num_stages: Triton's, for the three kernels.
    """

    adapt_chunk: bool = True
    chunk_states: str = "associative"
    gpu_heads_per_program: int = 1
    gpu_block_q: int = 64
    gpu_block_state: int = 256
    gpu_num_warps: int = 4
    gpu_num_stages: int = 2

    def __post_init__(self):
        if self.chunk_states not in ("associative", "sequential"):
            raise ValueError(f"chunk_states must be 'associative' or 'sequential', got {self.chunk_states!r}")
        validation.check_config_ints(self, ("gpu_block_q", "gpu_block_state"))


@_backend.register(OP_SCAN, "tpu")
def _scan_chunked(x, dt, A, B, C, state, query_start_loc, cache_indices, has_initial_state,
                  D, dt_bias, z, *, softplus, null_block_id, chunk_size, max_sequences, config,
                  dot_dtype, interpret):
    del interpret
    f32 = jnp.float32
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    R = cache_indices.shape[0]
    L = state.shape[0]
    Q, NC = _sizes(T, R, chunk_size, max_sequences, config)
    if R == 0 or T == 0:
        return jnp.zeros(x.shape, x.dtype), state
    goh = jnp.arange(H) // (H // G)
    bos, lens, ok, h0 = _skip_and_init(state, query_start_loc, cache_indices,
                                       has_initial_state, null_block_id, T)
    ch = _chunk_table(bos, lens, ok, Q, NC)
    q = jnp.arange(Q)
    t_ok = q[None, :] < ch.length[:, None]  # [NC, Q]
    tok = jnp.where(t_ok, ch.start[:, None] + q[None, :], T)

    xs = jnp.take(x, tok, axis=0, mode="fill", fill_value=0).astype(f32)  # [NC, Q, H, P]
    xs = jnp.where(t_ok[..., None, None], xs, 0.0)
    dts = jnp.take(_prep(dt, dt_bias, softplus), tok, axis=0, mode="fill", fill_value=0)
    dts = jnp.where(t_ok[..., None], dts, 0.0)  # pads: dt' = 0, an identity step
    Bs = jnp.where(t_ok[..., None, None], jnp.take(B, tok, axis=0, mode="fill", fill_value=0).astype(f32), 0.0)
    Cs = jnp.where(t_ok[..., None, None], jnp.take(C, tok, axis=0, mode="fill", fill_value=0).astype(f32), 0.0)
    Bh, Ch = Bs[:, :, goh], Cs[:, :, goh]  # [NC, Q, H, N]

    def rnd(a):
        return _rounded(a, dot_dtype)

    a = dts * A.astype(f32)[None, None, :]  # [NC, Q, H] log decay per token
    cum = jnp.cumsum(a, axis=1)
    cum_h = jnp.swapaxes(cum, 1, 2)  # [NC, H, Q]
    diff = cum_h[:, :, :, None] - cum_h[:, :, None, :]  # [NC, H, i, j]
    causal = q[:, None] >= q[None, :]
    Lmat = jnp.exp(jnp.where(causal, diff, -jnp.inf))
    CB = jnp.einsum("cihn,cjhn->chij", rnd(Ch), rnd(Bh), precision="highest")
    Wm = Lmat * CB * jnp.swapaxes(dts, 1, 2)[:, :, None, :]
    y_intra = jnp.einsum("chij,cjhp->cihp", rnd(Wm), rnd(xs), precision="highest")

    to_end = jnp.exp(cum[:, -1:, :] - cum) * dts  # [NC, Q, H]
    s_loc = jnp.einsum("cjhp,cjhn->chpn", rnd(to_end[..., None] * xs), rnd(Bh), precision="highest")
    lam = jnp.exp(cum[:, -1, :])  # [NC, H]

    s_in, s_out = _chunk_states(s_loc, lam, ch.first, h0[ch.request], config.chunk_states == "sequential")
    y_inter = jnp.exp(cum)[..., None] * jnp.einsum("cihn,chpn->cihp", rnd(Ch), rnd(s_in), precision="highest")
    zs = None
    if z is not None:
        zs = jnp.take(z, tok, axis=0, mode="fill", fill_value=0)
    Ds = D
    y = _finish(y_intra + y_inter, xs, Ds, zs, t_ok[..., None, None])
    out = jnp.zeros(x.shape, x.dtype).at[tok.reshape(-1)].set(
        y.reshape(NC * Q, H, P).astype(x.dtype), mode="drop")
    state = scatter_set(state, jnp.where(ok, cache_indices, L), s_out[ch.final])
    return out, state


# --------------------------------------------------------------------------
# GPU: Pallas Triton, the chunked form as three kernels
# --------------------------------------------------------------------------


def _gpu_shapes_ok(Q: int, P: int, N: int) -> bool:
    """Whether the compiled kernels take these sizes: Triton products need power-of-two
    blocks of at least 16 (interpret mode takes any)."""
    return all(v >= 16 and v & (v - 1) == 0 for v in (Q, P, N))


def _gpu_blocks(H: int, G: int, P: int, N: int, Q: int, config) -> tuple[int, int, int]:
    """``(HB, BQ, BE)``: heads per program of ``chunk_states`` and ``chunk_outputs`` (heads
    of one group, which share its ``B`` and ``C`` rows and its ``C B^T``), chunk rows per
    ``chunk_outputs`` program, state elements per ``state_passing`` program."""
    HB = min(config.gpu_heads_per_program, H // G)
    while (H // G) % HB:
        HB -= 1
    BQ = min(Q, config.gpu_block_q)
    BE = min(P * N, config.gpu_block_state)
    while (P * N) % BE:
        BE //= 2
    return HB, BQ, BE


@_backend.register(OP_SCAN, "gpu")
def _scan_gpu(x, dt, A, B, C, state, query_start_loc, cache_indices, has_initial_state,
              D, dt_bias, z, *, softplus, null_block_id, chunk_size, max_sequences, config,
              dot_dtype, interpret):
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    R = cache_indices.shape[0]
    L = state.shape[0]
    Q, NC = _sizes(T, R, chunk_size, max_sequences, config)
    if R == 0 or T == 0:
        return jnp.zeros(x.shape, x.dtype), state
    if not interpret and (dot_dtype is None or not _gpu_shapes_ok(Q, P, N)):
        # IEEE float32 products run on the CUDA cores, where the jnp form's cuBLAS products
        # are 10-20x faster than Triton's (BENCHMARKS.md); float32 models are the small ones
        return _scan_chunked(x, dt, A, B, C, state, query_start_loc, cache_indices,
                             has_initial_state, D, dt_bias, z, softplus=softplus,
                             null_block_id=null_block_id, chunk_size=chunk_size,
                             max_sequences=max_sequences, config=config, dot_dtype=dot_dtype,
                             interpret=False)
    for name, shape in (("x", (T + Q, H, P)), ("state", state.shape), ("the chunk states", (NC, H, P, N))):
        gpu_tiling.check_int32_offsets(name, shape)
    f32 = jnp.float32
    ratio = H // G
    HB, BQ, BE = _gpu_blocks(H, G, P, N, Q, config)
    HP, HPN, GN, PN = H * P, H * P * N, G * N, P * N
    bos, lens, ok, use_init = _requests(query_start_loc, cache_indices, has_initial_state,
                                        null_block_id, L, T)
    ch = _chunk_table(bos, lens, ok, Q, NC)
    start, length = ch.start, ch.length
    slot = cache_indices[ch.request]
    init_slot = jnp.where(ch.first & use_init[ch.request], slot, -1).astype(jnp.int32)
    fin_slot = jnp.where(ch.last, slot, -1).astype(jnp.int32)
    num_chunks = jnp.sum(ch.used.astype(jnp.int32)).reshape(1)  # the used chunks come first
    dtp = _prep(dt, dt_bias, softplus)  # [T, H] float32
    Af = A.astype(f32)
    Dm = jnp.zeros((H, P), f32) if D is None else jnp.broadcast_to(
        (D[:, None] if D.ndim == 1 else D).astype(f32), (H, P))
    has_z = z is not None
    load, store = _backend.triton.load, _backend.triton.store
    narrow = dot_dtype is not None
    params = _backend.triton.CompilerParams(num_warps=config.gpu_num_warps, num_stages=config.gpu_num_stages)

    def operand(v):  # a product operand: dot_dtype (interpret mode: rounded, then float32)
        if not narrow:
            return v
        v = v.astype(dot_dtype)
        return v.astype(f32) if interpret else v

    def dot(a, b, dims):
        prec = jax.lax.Precision.HIGHEST if (interpret or not narrow) else None
        return jax.lax.dot_general(operand(a), operand(b), (dims, ((), ())), precision=prec,
                                   preferred_element_type=f32)

    def decays(dt_ref, A_ref, h, t, t_ok):
        """dt' and its within-chunk cumulative log decay at tokens ``t`` (masked: 0)."""
        d = load(dt_ref.at[t * H + h], mask=t_ok, other=0.0)
        return d, jax.lax.cumsum(d * A_ref[h], axis=0)

    # 1. chunk_states: each chunk's own final state from a zero start,
    #    (x * exp(cum_end - cum) * dt)^T @ B, and its total log decay; one program per
    #    (chunk, HB heads of one group), which load the group's B rows once.
    def states_kernel(start_ref, len_ref, x_ref, B_ref, dt_ref, A_ref, s_ref, tot_ref):
        c, hb = pl.program_id(0), pl.program_id(1)
        t0, ln = start_ref[c], len_ref[c]

        @pl.when(ln > 0)
        def _chunk():
            q = jnp.arange(Q, dtype=jnp.int32)
            p = jnp.arange(P, dtype=jnp.int32)
            n = jnp.arange(N, dtype=jnp.int32)
            t_ok = q < ln
            tok = jnp.minimum(t0 + q, T - 1)
            g = (hb * HB) // ratio
            bq = load(B_ref.at[tok[:, None] * GN + g * N + n[None, :]], mask=t_ok[:, None],
                      other=0.0).astype(f32)  # [Q, N]
            for k in range(HB):
                h = hb * HB + k
                d, cum = decays(dt_ref, A_ref, h, tok, t_ok)
                tot = jnp.sum(jnp.where(q == Q - 1, cum, 0.0))
                w = jnp.exp(tot - cum) * d
                xq = load(x_ref.at[tok[:, None] * HP + h * P + p[None, :]], mask=t_ok[:, None],
                          other=0.0).astype(f32)  # [Q, P]
                store(s_ref.at[c * HPN + h * PN + p[:, None] * N + n[None, :]],
                      dot(xq * w[:, None], bq, ((0,), (0,))))
                store(tot_ref.at[c * H + h + jnp.zeros((1,), jnp.int32)], tot[None])

    s_loc, tot = pl.pallas_call(
        states_kernel,
        grid=(NC, H // HB),
        out_shape=[jax.ShapeDtypeStruct((NC * HPN,), f32), jax.ShapeDtypeStruct((NC * H,), f32)],
        compiler_params=params,
        interpret=interpret,
        name="scan_chunk_states_gpu",
    )(start, length, x.reshape(-1), B.reshape(-1), dtp.reshape(-1), Af)

    # 2. state_passing: one program per (head, BE state elements) walks the chunks in order:
    #    the state entering chunk c is its request's initial state at a first chunk (a
    #    select: a NaN cannot cross requests), else the state leaving chunk c - 1; each
    #    request's final state is written in place into the pool.
    def passing_kernel(n_ref, first_ref, init_ref, fin_ref, tot_ref, s_ref, _, s_in_ref, state_ref):
        h = pl.program_id(0)
        e = h * PN + pl.program_id(1) * BE + jnp.arange(BE, dtype=jnp.int32)

        def body(c, s_prev):
            src, dst = init_ref[c], fin_ref[c]
            h0 = load(state_ref.at[jnp.maximum(src, 0) * HPN + e],
                      mask=jnp.broadcast_to(src >= 0, (BE,)), other=0.0).astype(f32)
            s_in = jnp.where(first_ref[c] != 0, h0, s_prev)
            store(s_in_ref.at[c * HPN + e], s_in.astype(s_in_ref.dtype))
            s_out = jnp.exp(tot_ref[c * H + h]) * s_in + load(s_ref.at[c * HPN + e])
            store(state_ref.at[jnp.maximum(dst, 0) * HPN + e], s_out.astype(state_ref.dtype),
                  mask=jnp.broadcast_to(dst >= 0, (BE,)))
            return s_out

        jax.lax.fori_loop(0, n_ref[0], body, jnp.zeros((BE,), f32))

    # the entering states are only product operands: stored rounded to dot_dtype
    s_in, state = pl.pallas_call(
        passing_kernel,
        grid=(H, PN // BE),
        out_shape=[jax.ShapeDtypeStruct((NC * HPN,), dot_dtype if narrow else f32),
                   jax.ShapeDtypeStruct((L * HPN,), state.dtype)],
        input_output_aliases={6: 1},
        compiler_params=params,
        interpret=interpret,
        name="scan_state_passing_gpu",
    )(num_chunks, ch.first.astype(jnp.int32), init_slot, fin_slot, tot, s_loc, state.reshape(-1))

    # 3. chunk_outputs: one program per (chunk, HB heads of one group, BQ rows of the chunk):
    #    C B^T once for the group, then per head (L o C B^T o dt) @ x + exp(cum) C @ s_in^T
    #    + D x, gated by z. Tokens no chunk covers (padding, skipped requests) keep the
    #    zeros of the aliased output. Interpret mode stores masked rows back, so its output
    #    has Q rows of slack.
    slack = Q if interpret else 0

    def outputs_kernel(start_ref, len_ref, x_ref, B_ref, C_ref, dt_ref, A_ref, D_ref, s_in_ref,
                       *refs):
        z_ref = refs[0] if has_z else None
        o_ref = refs[-1]
        c, hb, qb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        t0, ln = start_ref[c], len_ref[c]
        i = qb * BQ + jnp.arange(BQ, dtype=jnp.int32)

        @pl.when(qb * BQ < ln)
        def _rows():
            j = jnp.arange(Q, dtype=jnp.int32)
            p = jnp.arange(P, dtype=jnp.int32)
            n = jnp.arange(N, dtype=jnp.int32)
            j_ok, i_ok = j < ln, i < ln
            tj, ti = jnp.minimum(t0 + j, T - 1), jnp.minimum(t0 + i, T - 1)
            g = (hb * HB) // ratio
            ci = load(C_ref.at[ti[:, None] * GN + g * N + n[None, :]], mask=i_ok[:, None],
                      other=0.0).astype(f32)  # [BQ, N]
            bj = load(B_ref.at[tj[:, None] * GN + g * N + n[None, :]], mask=j_ok[:, None],
                      other=0.0).astype(f32)  # [Q, N]
            cb = dot(ci, bj, ((1,), (1,)))  # [BQ, Q]
            causal = i[:, None] >= j[None, :]
            for k in range(HB):
                h = hb * HB + k
                dj, cum_j = decays(dt_ref, A_ref, h, tj, j_ok)
                di, cum_i = decays(dt_ref, A_ref, h, ti, i_ok)
                cum_i = cum_i + jnp.sum(jnp.where(j < qb * BQ, dj, 0.0)) * A_ref[h]
                decay = jnp.where(causal, jnp.exp(jnp.where(causal, cum_i[:, None] - cum_j[None, :], 0.0)), 0.0)
                xj = load(x_ref.at[tj[:, None] * HP + h * P + p[None, :]], mask=j_ok[:, None],
                          other=0.0).astype(f32)  # [Q, P]
                y = dot(cb * decay * dj[None, :], xj, ((1,), (0,)))  # [BQ, P]
                s_in = load(s_in_ref.at[c * HPN + h * PN + p[:, None] * N + n[None, :]]).astype(f32)
                y = y + jnp.exp(cum_i)[:, None] * dot(ci, s_in, ((1,), (1,)))
                xi = load(x_ref.at[ti[:, None] * HP + h * P + p[None, :]], mask=i_ok[:, None],
                          other=0.0).astype(f32)
                y = y + xi * load(D_ref.at[h * P + p])[None, :]
                if has_z:
                    zi = load(z_ref.at[ti[:, None] * HP + h * P + p[None, :]], mask=i_ok[:, None],
                              other=0.0).astype(f32)
                    y = y * (zi * jax.nn.sigmoid(zi))
                store(o_ref.at[(t0 + i)[:, None] * HP + h * P + p[None, :]], y.astype(o_ref.dtype),
                      mask=i_ok[:, None])

    inputs = [start, length, x.reshape(-1), B.reshape(-1), C.reshape(-1), dtp.reshape(-1), Af,
              Dm.reshape(-1), s_in]
    if has_z:
        inputs.append(z.reshape(-1))
    inputs.append(jnp.zeros(((T + slack) * HP,), x.dtype))
    out = pl.pallas_call(
        outputs_kernel,
        grid=(NC, H // HB, Q // BQ),
        out_shape=jax.ShapeDtypeStruct(((T + slack) * HP,), x.dtype),
        input_output_aliases={len(inputs) - 1: 0},
        compiler_params=params,
        interpret=interpret,
        name="scan_chunk_outputs_gpu",
    )(*inputs)
    out = out.reshape(T + slack, H, P)
    return (out[:T] if slack else out), state.reshape(L, H, P, N)


def selective_scan_varlen(
    x, dt, A, B, C, state, query_start_loc, cache_indices, has_initial_state,
    D=None, dt_bias=None, z=None, dt_softplus=False, null_block_id=NULL_BLOCK_ID,
    *, chunk_size=DEFAULT_CHUNK_SIZE, max_sequences: int | None = None, config: ScanConfig = ScanConfig(),
    dot_dtype=None, backend="auto", interpret=None,
):
    """Mamba2 selective scan over a packed varlen batch, with state-pool masking.

    Shapes (``T`` packed tokens, ``R`` requests, ``L`` state rows, ``H`` heads, ``P``
    head dim, ``N`` dstate, ``G`` groups with ``H % G == 0``):

    * ``x``, ``z``: ``[T, H, P]``; ``dt``: ``[T, H]`` (per-head scalar); ``A``: ``[H]``;
      ``dt_bias``: ``[H]``; ``D``: ``[H]`` or ``[H, P]``; ``B``, ``C``: ``[T, G, N]``.
    * ``state``: ``[L, H, P, N]``, any float dtype (stored in that dtype).
    * ``query_start_loc``: ``[R+1]`` non-decreasing token offsets (it alone sets ``R``);
      ``cache_indices`` ``[>= R]`` integer; ``has_initial_state`` ``[>= R]`` bool
      (entries past the ``R`` sequences are padding, ignored, as in vLLM).

    Semantics per request ``r`` (tokens ``query_start_loc[r] .. query_start_loc[r+1]-1``;
    math in float32; ``dt' = softplus?(dt + dt_bias)``;
    ``h = h*exp(dt'*A) + dt'*x⊗B``; ``y = C·h + D*x``, ``y *= z*sigmoid(z)``):

    * the initial state is ``state[cache_indices[r]]`` if ``has_initial_state[r]``,
      else ZERO — the slot is not read at all, so whatever a previous tenant left there
      (even NaN) cannot leak;
    * the final state is written to ``state[cache_indices[r]]`` (in the state dtype);
    * ``cache_indices[r] == null_block_id`` (or, under jit, out of ``[0, L)``): the
      request is skipped — no state read or write, and its outputs are ZERO;
    * an empty request reads and writes nothing; tokens at or beyond
      ``query_start_loc[R]`` (padding) or before ``query_start_loc[0]`` output ZERO and
      touch nothing. ``out`` has ``x``'s dtype.

    Concrete cache indices out of range (other than ``null_block_id``) or a bad
    ``query_start_loc`` raise ``ValueError``; shape/dtype mismatches raise at trace time.

    Flavours: ``"reference"`` is a token-by-token ``lax.scan`` (the oracle;
    ``backend="auto"`` on a CPU); ``"tpu"`` runs the chunked form in jnp (matrix products
    XLA maps onto the MXU); ``"gpu"`` runs it as three Pallas kernels (see the module
    docstring) for bf16 / float16 products, and the jnp form for float32 products or where
    the compiled kernels cannot take the sizes (a chunk length, head dim or ``N`` that is
    not a power of two >= 16); interpret mode always runs the kernels. All have these semantics;
    the chunked forms differ from the token scan by float32 summation order, and by the
    rounding ``dot_dtype`` asks for.

    Args:
      chunk_size: most tokens per chunk of the chunked form (static); batches of many
        short requests use fewer (see ``_chunk_len``).
      max_sequences: static: at most this many requests have tokens and a valid cache index
        (the caller guarantees it; a Runner step: its bucket's ``prefill_rows``). The chunked
        form sizes its chunk table ``ceil(T / Q) + max_sequences`` instead of ``+ R``, and its
        chunks by ``T / max_sequences``. More such requests than this: their chunks past the
        table are dropped (wrong outputs), so the bound must hold. None: ``R``.
      config: :class:`ScanConfig` of the chunked form (static).
      dot_dtype: None (the default): the chunked forms' matrix products take float32
        operands (IEEE float32 products). ``jnp.bfloat16`` / ``jnp.float16``: their operands
        (``x``, ``B``, ``C``, the intra-chunk weights and the states entering a chunk) are
        rounded to it and the products accumulate in float32, as vLLM's (mamba_ssm's) Triton
        kernels do for a bf16 model: tensor-core products on a GPU. The recurrence between
        chunks, the decays and the states stay float32. The token scan ignores it.
      backend, interpret: see :mod:`pallas_kernels._backend`.

    Returns:
      ``(out [T, H, P], state)``.
    """
    choice = _backend.choose(OP_SCAN, backend, interpret)
    null_block_id = mc.check_int_arg("null_block_id", null_block_id)
    chunk_size = mc.check_int_arg("chunk_size", chunk_size)
    if max_sequences is not None:
        max_sequences = mc.check_int_arg("max_sequences", max_sequences)
        if max_sequences < 1:
            raise ValueError(f"max_sequences must be None or >= 1, got {max_sequences}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if not isinstance(config, ScanConfig):
        raise ValueError(f"config must be a ScanConfig, got {config!r}")
    if dot_dtype is not None:
        try:
            narrow = jnp.dtype(dot_dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
        except TypeError:
            narrow = False
        if not narrow:
            raise ValueError(f"dot_dtype must be None, jnp.bfloat16 or jnp.float16, got {dot_dtype!r}")
        dot_dtype = jnp.dtype(dot_dtype)
    for name, arr in (("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C), ("state", state)):
        mc.check_float(name, arr)
    validation.check_rank("x", x, 3)
    T, H, P = x.shape
    validation.check_shape("dt", dt, (T, H))
    validation.check_shape("A", A, (H,))
    validation.check_rank("B", B, 3)
    G = B.shape[1]
    if G == 0 or H % G:
        raise ValueError(f"B must have a group count dividing nheads={H}, got shape {list(B.shape)}")
    validation.check_shape("B", B, (T, G, None))
    N = B.shape[2]
    validation.check_shape("C", C, (T, G, N))
    validation.check_rank("state", state, 4)
    validation.check_shape("state", state, (None, H, P, N))
    L = state.shape[0]
    if D is not None:
        mc.check_float("D", D)
        validation.check_rank("D", D, (1, 2))
        validation.check_shape("D", D, (H,) if D.ndim == 1 else (H, P))
    if dt_bias is not None:
        mc.check_float("dt_bias", dt_bias)
        validation.check_shape("dt_bias", dt_bias, (H,))
    if z is not None:
        mc.check_float("z", z)
        validation.check_shape("z", z, (T, H, P))
    ci, qsl, his = mc.varlen_batch(cache_indices, query_start_loc, has_initial_state, T, L,
                                 null_block_id)
    return _backend.run(OP_SCAN, choice, x, dt, A, B, C, state, qsl, ci, his, D, dt_bias, z,
                        softplus=bool(dt_softplus), null_block_id=null_block_id,
                        chunk_size=chunk_size, max_sequences=max_sequences, config=config,
                        dot_dtype=dot_dtype)
