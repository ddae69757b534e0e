"""Prefill side of the Mamba2 state masking: a varlen selective scan.

:func:`selective_scan_varlen` runs the Mamba2 recurrence (per-head scalar ``dt`` and
``A``) over a packed batch of requests, starting each request from its cached state
or from ZERO, and writing each request's final state back to its slot.

Two jnp implementations with identical semantics:

* ``_scan_tokens`` (``backend="reference"``): a ``lax.scan`` over tokens; obviously
  correct, the oracle.
* ``_scan_chunked`` (every other backend): the SSD chunked form used by vLLM's
  ``mamba_chunk_scan_combined_varlen``: requests are cut into chunks of
  ``chunk_size`` tokens that never span two requests; inside a chunk the scan is a
  masked ``[Q, Q]`` matrix product, between chunks an associative scan over chunk states.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels import contract as validation
from pallas_kernels.contract import NULL_BLOCK_ID
from pallas_kernels import _backend
from pallas_kernels import mamba_common as mc
from pallas_kernels._xla import scatter_set

__all__ = ["selective_scan_varlen", "DEFAULT_CHUNK_SIZE"]

OP_SCAN = "selective_scan_varlen"
# Tokens per chunk of the chunked form (BENCHMARKS.md, "Kernel design notes").
DEFAULT_CHUNK_SIZE = 128


def _prep(dt, dt_bias, softplus):
    dt = dt.astype(jnp.float32)
    if dt_bias is not None:
        dt = dt + dt_bias.astype(jnp.float32)
    return mc.softplus(dt) if softplus else dt


def _skip_and_init(state, query_start_loc, cache_indices, has_initial_state, null_block_id,
                   num_tokens):
    L = state.shape[0]
    bos, lens = mc.sequence_bounds(query_start_loc, num_tokens)
    ok = mc.valid_index(cache_indices, L, null_block_id) & (lens > 0)
    use_init = ok & has_initial_state
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
                 D, dt_bias, z, *, softplus, null_block_id, chunk_size, max_sequences, config, interpret):
    del chunk_size, max_sequences, config, interpret
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
      chunk_states: how states pass between chunks: ``"associative"`` (an associative
        scan, no loop) or ``"sequential"`` (a ``lax.scan``: an XLA while loop, which a GPU
        runs one iteration after another).
    """

    adapt_chunk: bool = True
    chunk_states: str = "associative"

    def __post_init__(self):
        if self.chunk_states not in ("associative", "sequential"):
            raise ValueError(f"chunk_states must be 'associative' or 'sequential', got {self.chunk_states!r}")


@_backend.register(OP_SCAN, "tpu", "gpu")
def _scan_chunked(x, dt, A, B, C, state, query_start_loc, cache_indices, has_initial_state,
                  D, dt_bias, z, *, softplus, null_block_id, chunk_size, max_sequences, config, interpret):
    del interpret
    f32 = jnp.float32
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    R = cache_indices.shape[0]
    L = state.shape[0]
    Rs = R if max_sequences is None else max(1, min(R, max_sequences))  # sequences that take chunks
    Q = _chunk_len(chunk_size, T, Rs, config.adapt_chunk)
    if R == 0 or T == 0:
        return jnp.zeros(x.shape, x.dtype), state
    goh = jnp.arange(H) // (H // G)
    bos, lens, ok, h0 = _skip_and_init(state, query_start_loc, cache_indices,
                                       has_initial_state, null_block_id, T)
    # chunk table: request r owns chunks [coff[r], coff[r] + nch[r]); a chunk never spans
    # two requests; skipped requests own none.
    nch = jnp.where(ok, (lens + Q - 1) // Q, 0)
    cend = jnp.cumsum(nch)
    coff = cend - nch
    NC = -(-T // Q) + Rs  # static bound on the number of chunks
    c = jnp.arange(NC)
    rc = jnp.searchsorted(cend, c, side="right", method="compare_all").astype(jnp.int32)
    c_ok = rc < R
    rc = jnp.where(c_ok, rc, 0)
    k = c - coff[rc]
    q = jnp.arange(Q)
    in_req = k[:, None] * Q + q[None, :]  # [NC, Q] position within the request
    t_ok = c_ok[:, None] & (in_req < lens[rc][:, None])
    tok = jnp.where(t_ok, bos[rc][:, None] + in_req, T)
    first = c_ok & (k == 0)

    xs = jnp.take(x, tok, axis=0, mode="fill", fill_value=0).astype(f32)  # [NC, Q, H, P]
    xs = jnp.where(t_ok[..., None, None], xs, 0.0)
    dts = jnp.take(_prep(dt, dt_bias, softplus), tok, axis=0, mode="fill", fill_value=0)
    dts = jnp.where(t_ok[..., None], dts, 0.0)  # pads: dt' = 0, an identity step
    Bs = jnp.where(t_ok[..., None, None], jnp.take(B, tok, axis=0, mode="fill", fill_value=0).astype(f32), 0.0)
    Cs = jnp.where(t_ok[..., None, None], jnp.take(C, tok, axis=0, mode="fill", fill_value=0).astype(f32), 0.0)
    Bh, Ch = Bs[:, :, goh], Cs[:, :, goh]  # [NC, Q, H, N]

    a = dts * A.astype(f32)[None, None, :]  # [NC, Q, H] log decay per token
    cum = jnp.cumsum(a, axis=1)
    cum_h = jnp.swapaxes(cum, 1, 2)  # [NC, H, Q]
    diff = cum_h[:, :, :, None] - cum_h[:, :, None, :]  # [NC, H, i, j]
    causal = q[:, None] >= q[None, :]
    Lmat = jnp.exp(jnp.where(causal, diff, -jnp.inf))
    CB = jnp.einsum("cihn,cjhn->chij", Ch, Bh, precision="highest")
    Wm = Lmat * CB * jnp.swapaxes(dts, 1, 2)[:, :, None, :]
    y_intra = jnp.einsum("chij,cjhp->cihp", Wm, xs, precision="highest")

    to_end = jnp.exp(cum[:, -1:, :] - cum) * dts  # [NC, Q, H]
    s_loc = jnp.einsum("cjh,cjhp,cjhn->chpn", to_end, xs, Bh, precision="highest")
    lam = jnp.exp(cum[:, -1, :])  # [NC, H]

    s_in, s_out = _chunk_states(s_loc, lam, first, h0[rc], config.chunk_states == "sequential")
    y_inter = jnp.exp(cum)[..., None] * jnp.einsum("cihn,chpn->cihp", Ch, s_in, precision="highest")
    zs = None
    if z is not None:
        zs = jnp.take(z, tok, axis=0, mode="fill", fill_value=0)
    Ds = D
    y = _finish(y_intra + y_inter, xs, Ds, zs, t_ok[..., None, None])
    out = jnp.zeros(x.shape, x.dtype).at[tok.reshape(-1)].set(
        y.reshape(NC * Q, H, P).astype(x.dtype), mode="drop")
    c_last = jnp.where(ok, cend - 1, 0)
    finals = s_out[c_last]
    state = scatter_set(state, jnp.where(ok, cache_indices, L), finals)
    return out, state


def selective_scan_varlen(
    x, dt, A, B, C, state, query_start_loc, cache_indices, has_initial_state,
    D=None, dt_bias=None, z=None, dt_softplus=False, null_block_id=NULL_BLOCK_ID,
    *, chunk_size=DEFAULT_CHUNK_SIZE, max_sequences: int | None = None, config: ScanConfig = ScanConfig(),
    backend="auto", interpret=None,
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

    No Pallas kernel: the ``"reference"`` flavour is a token-by-token ``lax.scan``
    (the oracle; ``backend="auto"`` on a CPU); the ``"tpu"`` and ``"gpu"`` flavours
    both run the chunked XLA form (matrix products XLA maps onto the MXU / tensor
    cores). Both have identical semantics.

    Args:
      chunk_size: most tokens per chunk of the chunked form (static); batches of many
        short requests use fewer (see ``_chunk_len``).
      max_sequences: static: at most this many requests have tokens and a valid cache index
        (the caller guarantees it; a Runner step: its bucket's ``prefill_rows``). The chunked
        form sizes its chunk table ``ceil(T / Q) + max_sequences`` instead of ``+ R``, and its
        chunks by ``T / max_sequences``. More such requests than this: their chunks past the
        table are dropped (wrong outputs), so the bound must hold. None: ``R``.
      config: :class:`ScanConfig` of the chunked form (static).
      backend, interpret: see :mod:`pallas_kernels._backend` (``interpret`` is
        validated but unused: there is no kernel).

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
                        chunk_size=chunk_size, max_sequences=max_sequences, config=config)
