"""Decode windows and logits rows: ``combine_sampled_and_draft_tokens``.

The JAX counterpart of vLLM 0.33.0's model-runner-V2 kernel of the same name
(``vllm/v1/worker/gpu/input_batch.py``). After the prefill tokens of a step
are in ``input_ids``, it

* places each request's logits rows on the last ``nl`` tokens of its query;
* fills the decode window of every request past its prefill: the last sampled
  token, then the draft tokens.

Per batch row ``b`` with request row ``s = idx_mapping[b]``,
``nl = cu_num_logits[b+1] - cu_num_logits[b]``, ``nd = nl - num_new_sampled_tokens``
and ``qe = query_start_loc[b+1]``::

    logits_indices[cu_num_logits[b] + i] = qe - nl + i            for i < nl
    if seq_lens[b] <= prefill_len[s]: done     # (still) prefilling: the ids came from
                                               # the prompt; seq_len == prefill_len
                                               # (the chunk that ends prefill) counts
    if num_new_sampled_tokens == 1 and seq_lens[b] - nl >= prefill_len[s]:
        input_ids[qe - nl] = last_sampled_tokens[s]
    input_ids[qe - nd + i] = draft_tokens[s, i]                   for i < nd

The second condition is vLLM 0.33's "keep prompt-tail slots intact": when the
first logits row is still a prompt token (a window straddling ``prefill_len``)
that token keeps its prompt id and only the drafts are written.
``num_new_sampled_tokens`` is vLLM's argument of the same name (the model
state's ``num_new_sampled_tokens_per_step``): the bonus tokens sampled per
step besides the accepted drafts, 1 normally, 0 for models that sample none;
vLLM asserts it is 0 or 1.

Padded and malformed rows (kvjax additions: vLLM launches exactly ``num_reqs``
programs, so it has no padded rows, and trusts its inputs):

* ``idx_mapping[b] == -1`` marks a padded batch row (``kvjax.state.step_batch``
  pads with -1). It writes nothing, neither ``input_ids`` nor
  ``logits_indices``. -1 is never used as an index: rows are masked.
* A live row must be well formed: ``num_new_sampled_tokens <= nl <=
  num_speculative_steps + num_new_sampled_tokens``; ``cu_num_logits[b] >= 0``
  and ``cu_num_logits[b+1] <= num_logits``; ``0 <= query_start_loc[b] <= qe - nl``
  (the logits rows lie in the row's own query, as vLLM's runner asserts); and
  ``qe <= input_ids.shape[0]``. With concrete arguments a violation is a
  ``ValueError``, as are an ``idx_mapping`` value outside ``[0, max_num_reqs)``
  other than -1 and a decreasing ``query_start_loc[:num_reqs+1]`` or
  ``cu_num_logits[:num_reqs+1]``. Under ``jit`` a malformed row, or one whose
  ``idx_mapping`` is out of range, writes nothing at all.
* ``logits_indices`` entries no live row writes (the tail of a padded bucket,
  past ``cu_num_logits[num_reqs]``) are 0: a valid gather index whose logits
  are never sampled. vLLM leaves them uninitialised (``torch.empty``).

Implementations (picked by :func:`pallas_kernels.backend.resolve`):

* reference: two ``.at[].set(mode="drop")`` scatters; masked lanes are sent to
  an out-of-range index, never to -1.
* TPU (Mosaic): one grid step per batch row; every per-row array sits in SMEM
  through scalar prefetch; ``input_ids`` stays in HBM, aliased to the output,
  and each written id is one DMA from an SMEM staging word issued under
  ``pl.when`` (a row that writes nothing issues nothing);
  ``logits_indices`` is an SMEM output resident for the whole grid.
* GPU (Pallas Triton, see :func:`pallas_kernels.backend.gpu_compiler_params`):
  one program per batch row, one launch per call; masked vector stores for
  the logits rows and the drafts, a one-lane masked store for the last sampled
  token; ``input_ids`` is aliased to the output, and ``logits_indices`` is not
  pre-filled: the kernel writes every entry, the zeros included.

All implementations return identical arrays. ``input_ids`` is aliased to the
returned ids, so a caller that donates it gets the update in place.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import contract as validation
from pallas_kernels import backend as _backend
from pallas_kernels.contract import PAD_ROW_ID

OP_COMBINE = "combine_sampled_and_draft_tokens"

__all__ = [
    "combine_sampled_and_draft_tokens",
    "combine_sampled_and_draft_tokens_reference",
]


# --------------------------------------------------------------------------
# The per-row rule, written once (scalars in the kernels, [R] vectors in the reference)
# --------------------------------------------------------------------------


def _row_terms(s_raw, cs, ce, qs, qe, seq_len, prefill_at, *, max_num_reqs, num_spec,
               num_new, num_logits, num_tokens):
    """Predicates of the contract for one batch row (or all rows at once).

    Args:
      s_raw: ``idx_mapping[b]``; cs, ce: ``cu_num_logits[b]``, ``cu_num_logits[b+1]``;
      qs, qe: ``query_start_loc[b]``, ``query_start_loc[b+1]``; seq_len: ``seq_lens[b]``;
      prefill_at: ``s -> prefill_len[s]`` for an in-range ``s``.

    Returns:
      ``(s, ok, nl, start, decode, write_last)``: an in-range request row (0
      where the row is not live: use it only under ``ok``), the row is live and
      well formed, its logits count, its first logits token ``qe - nl``, it is
      past its prefill, its last sampled token is written at ``start``.
    """
    live = (s_raw >= 0) & (s_raw < max_num_reqs)
    s = jnp.where(live, s_raw, 0)
    nl = ce - cs
    start = qe - nl
    prefill = prefill_at(s)
    ok = (
        live
        & (nl >= num_new)
        & (nl <= num_spec + num_new)
        & (cs >= 0)
        & (ce <= num_logits)
        & (qs >= 0)
        & (start >= qs)
        & (qe <= num_tokens)
        & (seq_len >= 0)
        & (prefill >= 0)
    )
    decode = ok & (seq_len > prefill)
    write_last = decode & (seq_len - nl >= prefill) if num_new else decode & False
    return s, ok, nl, start, decode, write_last


# --------------------------------------------------------------------------
# Reference (plain XLA)
# --------------------------------------------------------------------------


@_backend.register(OP_COMBINE, "reference")
def _reference(input_ids, idx, last, qsl, seq_lens, prefill_len, drafts, cu, *,
               num_logits, num_new, interpret):
    del interpret
    R, T = idx.shape[0], input_ids.shape[0]
    S = drafts.shape[1]
    qe = qsl[1 : R + 1]
    s, ok, nl, start, decode, write_last = _row_terms(
        idx, cu[:R], cu[1 : R + 1], qsl[:R], qe, seq_lens[:R], lambda rows: prefill_len[rows],
        max_num_reqs=prefill_len.shape[0], num_spec=S, num_new=num_new,
        num_logits=num_logits, num_tokens=T,
    )
    # Logits rows: lane i < nl of row b lands at cu[b] + i; masked lanes at num_logits (dropped).
    lanes = jnp.arange(S + num_new, dtype=jnp.int32)[None, :]  # [1, S + num_new]
    li_dest = jnp.where(ok[:, None] & (lanes < nl[:, None]), cu[:R, None] + lanes, num_logits)
    logits_indices = (
        jnp.zeros((num_logits,), jnp.int32)
        .at[li_dest.reshape(-1)]
        .set((start[:, None] + lanes).reshape(-1), mode="drop")
    )

    # Decode windows; masked entries go to T (dropped).
    dests, vals = [], []
    if num_new:
        dests.append(jnp.where(write_last, start, T))  # [R]
        vals.append(last[s])
    if S:
        j = jnp.arange(S, dtype=jnp.int32)[None, :]  # [1, S]
        nd = (nl - num_new)[:, None]
        dests.append(jnp.where(decode[:, None] & (j < nd), qe[:, None] - nd + j, T).reshape(-1))
        vals.append(drafts[s].reshape(-1))
    if dests:
        input_ids = input_ids.at[jnp.concatenate(dests)].set(
            jnp.concatenate(vals).astype(input_ids.dtype), mode="drop"
        )
    return input_ids, logits_indices


# --------------------------------------------------------------------------
# TPU (Mosaic): SMEM scalars, one DMA per written id
# --------------------------------------------------------------------------


@_backend.register(OP_COMBINE, "tpu")
def _tpu(input_ids, idx, last, qsl, seq_lens, prefill_len, drafts, cu, *,
         num_logits, num_new, interpret):
    R, T = idx.shape[0], input_ids.shape[0]
    max_num_reqs, S = drafts.shape
    lanes = S + num_new  # ids (and logits rows) a row can write
    # SMEM holds 1-D arrays; a [max_num_reqs, 0] draft table becomes one unused word.
    drafts_flat = drafts.reshape(-1) if S else jnp.zeros((1,), jnp.int32)
    prefetch = (idx, qsl, seq_lens, cu, prefill_len, last, drafts_flat)

    def kernel(idx_ref, qsl_ref, seq_ref, cu_ref, prefill_ref, last_ref, drafts_ref,
               _ids_in, ids_hbm, li_ref, stage, sem):
        # Prefetch: idx_ref i32[R], qsl_ref i32[>=R+1], seq_ref i32[>=R], cu_ref i32[>=R+1],
        #           prefill_ref i32[MR], last_ref i32[MR], drafts_ref i32[MR*S or 1]   (SMEM)
        # Inputs:   _ids_in  HBM i32[T], aliased to ids_hbm (not read)
        # Outputs:  ids_hbm  HBM i32[T]; li_ref SMEM i32[num_logits], resident
        # Scratch:  stage SMEM i32[lanes] (DMA source words); sem DMA semaphore
        b = pl.program_id(0)

        @pl.when(b == 0)
        def _zero_logits_indices():
            def body(i, carry):
                li_ref[i] = 0
                return carry

            jax.lax.fori_loop(0, num_logits, body, 0)

        s, ok, nl, start, decode, write_last = _row_terms(
            idx_ref[b], cu_ref[b], cu_ref[b + 1], qsl_ref[b], qsl_ref[b + 1], seq_ref[b],
            lambda row: prefill_ref[row],
            max_num_reqs=max_num_reqs, num_spec=S, num_new=num_new,
            num_logits=num_logits, num_tokens=T,
        )
        first_logit = cu_ref[b]
        for i in range(lanes):

            @pl.when(ok & (i < nl))
            def _logits_row():
                li_ref[first_logit + i] = start + i

        # Lane i writes input_ids[start + i]: the last sampled token (lane 0 when
        # num_new == 1), else draft i - num_new.
        for i in range(lanes):
            if i < num_new:
                write, token = write_last, last_ref[s]
            else:
                write, token = decode & (i < nl), drafts_ref[s * S + (i - num_new)]

            @pl.when(write)
            def _write_id():
                stage[i] = token
                copy = pltpu.make_async_copy(
                    stage.at[pl.ds(i, 1)], ids_hbm.at[pl.ds(start + i, 1)], sem
                )
                copy.start()
                copy.wait()

    call = pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((T,), jnp.int32),
            jax.ShapeDtypeStruct((num_logits,), jnp.int32),
        ),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch),
            grid=(R,),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=(
                pl.BlockSpec(memory_space=pl.ANY),
                pl.BlockSpec(memory_space=pltpu.SMEM),
            ),
            scratch_shapes=[pltpu.SMEM((lanes,), jnp.int32), pltpu.SemaphoreType.DMA(())],
        ),
        input_output_aliases={len(prefetch): 0},
        # logits_indices is zeroed by step 0 and accumulated by later steps.
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=interpret,
        name="combine_sampled_and_draft_tokens_tpu",
    )
    return call(*prefetch, input_ids)


# --------------------------------------------------------------------------
# GPU (Pallas Triton): masked stores, one program per batch row
# --------------------------------------------------------------------------


@_backend.register(OP_COMBINE, "gpu")
def _gpu(input_ids, idx, last, qsl, seq_lens, prefill_len, drafts, cu, *,
         num_logits, num_new, interpret):
    R, T = idx.shape[0], input_ids.shape[0]
    max_num_reqs, S = drafts.shape
    NL = num_logits
    lanes = pl.next_power_of_2(S + num_new)  # Triton blocks are powers of two
    draft_lanes = pl.next_power_of_2(max(S, 1))
    rows = pl.next_power_of_2(R)
    zero_w = min(pl.next_power_of_2(NL), 64)  # lanes of one zero store
    chunk = min(pl.next_power_of_2(NL), 1024)  # logits entries per pass of the unordered path

    def kernel(*refs):
        # Inputs:  idx_ref i32[R], qsl_ref i32[>=R+1], seq_ref i32[>=R], cu_ref i32[>=R+1],
        #          prefill_ref i32[MR], last_ref i32[MR], drafts_ref i32[MR, S] (only if S > 0),
        #          _ids_in i32[T] (aliased to ids_ref)
        # Outputs: ids_ref i32[T], li_ref i32[num_logits] (not initialised: every entry is
        #          written below)
        idx_ref, qsl_ref, seq_ref, cu_ref, prefill_ref, last_ref = refs[:6]
        drafts_ref = refs[6] if S else None
        ids_ref, li_ref = refs[-2:]
        b = pl.program_id(0)

        def terms(r):
            return _row_terms(
                idx_ref[r], cu_ref[r], cu_ref[r + 1], qsl_ref[r], qsl_ref[r + 1], seq_ref[r],
                lambda row: prefill_ref[row],
                max_num_reqs=max_num_reqs, num_spec=S, num_new=num_new,
                num_logits=NL, num_tokens=T,
            )

        s, ok, nl, start, decode, write_last = terms(b)
        # Every window starts at an index >= 0 (masked-off rows use 0), so no
        # lane address is negative even where its store is masked.
        base = jnp.where(ok, start, 0)
        lane = jnp.arange(lanes, dtype=jnp.int32)
        if num_new:
            one = jnp.arange(1, dtype=jnp.int32)
            token = _backend.triton.load(last_ref.at[pl.ds(s, 1)])
            _backend.triton.store(ids_ref.at[pl.ds(base, 1)], token, mask=write_last & (one == 0))
        if S:
            j = jnp.arange(draft_lanes, dtype=jnp.int32)
            tokens = _backend.triton.load(drafts_ref.at[s, pl.ds(0, draft_lanes)], mask=j < S, other=0)
            _backend.triton.store(
                ids_ref.at[pl.ds(base + num_new, draft_lanes)],
                tokens,
                mask=decode & (j < nl - num_new),
            )

        # logits_indices: every entry is written, each zero by one program.
        # A live, well formed row writes its values. With cu_num_logits[:R+1]
        # non-decreasing (always, for a call that passes the concrete checks) the
        # rows' ranges [cu[b], cu[b+1]), clipped to [0, NL), tile [cu[0], cu[R]):
        # any other row zeroes its range, and the entries before cu[0] and after
        # cu[R] are zeroed by the programs in turn (zero_w lanes each). Otherwise
        # (a decreasing cu_num_logits under jit) ranges may overlap, and program 0
        # builds the whole array row by row as the reference's scatter does (it
        # writes the live rows' values again: the same values).
        clip = lambda v: jnp.minimum(jnp.maximum(v, 0), NL)  # noqa: E731
        zl = jnp.arange(zero_w, dtype=jnp.int32)

        def chunks(lo_e, hi_e, first, step):
            # how many of the zero_w-lane chunks first, first + step, ... start in [lo_e, hi_e)
            per = step * zero_w  # a Python int: the count stays int32 under x64
            return (jnp.maximum(hi_e - lo_e - first * zero_w, 0) + (per - 1)) // per

        def zero(lo_e, hi_e, first, step):
            def body(i, carry):
                e0 = lo_e + (first + i * step) * zero_w
                _backend.triton.store(li_ref.at[pl.ds(e0, zero_w)], jnp.zeros((zero_w,), jnp.int32),
                                      mask=e0 + zl < hi_e)
                return carry

            jax.lax.fori_loop(0, chunks(lo_e, hi_e, first, step), body, 0)

        @pl.when(ok)
        def _values():
            _backend.triton.store(li_ref.at[pl.ds(cu_ref[b], lanes)], start + lane, mask=lane < nl)

        own = (clip(cu_ref[b]), clip(cu_ref[b + 1]))
        head, tail = (0, clip(cu_ref[0])), (clip(cu_ref[R]), NL)
        zeroes = (jnp.logical_not(ok) & (own[1] > own[0])) | (chunks(*head, b, R) > 0) | (
            chunks(*tail, b, R) > 0)

        @pl.when(zeroes | (b == 0))  # only these programs read all of cu_num_logits
        def _zeros():
            r = jnp.arange(rows, dtype=jnp.int32)
            lo = _backend.triton.load(cu_ref.at[pl.ds(0, rows)], mask=r < R, other=0)
            hi = _backend.triton.load(cu_ref.at[r + 1], mask=r < R, other=0)  # gathered: r + 1 <= R
            ordered = jnp.max(jnp.where(hi < lo, 1, 0)) == 0

            @pl.when(ordered & jnp.logical_not(ok))
            def _masked_row():
                zero(*own, 0, 1)

            @pl.when(ordered)
            def _outside_rows():
                zero(*head, b, R)
                zero(*tail, b, R)

            @pl.when(jnp.logical_not(ordered) & (b == 0))
            def _unordered():
                def pass_body(c, carry):
                    e = c * chunk + jnp.arange(chunk, dtype=jnp.int32)

                    def row_body(q, v):
                        _, ok_q, nl_q, start_q, _, _ = terms(q)
                        cs_q = cu_ref[q]
                        hit = ok_q & (e >= cs_q) & (e - cs_q < nl_q)
                        return jnp.where(hit, start_q + (e - cs_q), v)

                    v = jax.lax.fori_loop(0, R, row_body, jnp.zeros((chunk,), jnp.int32))
                    _backend.triton.store(li_ref.at[pl.ds(c * chunk, chunk)], v, mask=e < NL)
                    return carry

                jax.lax.fori_loop(0, pl.cdiv(NL, chunk), pass_body, 0)

    inputs = [idx, qsl, seq_lens, cu, prefill_len, last] + ([drafts] if S else []) + [input_ids]
    call = pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((T,), jnp.int32),
            jax.ShapeDtypeStruct((NL,), jnp.int32),
        ),
        grid=(R,),
        input_output_aliases={len(inputs) - 1: 0},
        compiler_params=_backend.gpu_compiler_params(),
        interpret=interpret,
        name="combine_sampled_and_draft_tokens_gpu",
    )
    return call(*inputs)


# --------------------------------------------------------------------------
# Dispatch and public API
# --------------------------------------------------------------------------


def _check(input_ids, idx, last, qsl, seq_lens, prefill_len, drafts, cu, num_logits, num_new):
    """Static checks always; value checks where the arguments are concrete."""
    if isinstance(num_logits, bool) or not isinstance(num_logits, (int, np.integer)) or num_logits < 0:
        raise ValueError(f"num_logits must be a static int >= 0, got {num_logits!r}")
    if isinstance(num_new, bool) or num_new not in (0, 1):
        raise ValueError(f"num_new_sampled_tokens must be 0 or 1, got {num_new!r}")
    validation.check_rank("input_ids", input_ids, 1)
    validation.check_dtype("input_ids", input_ids, np.int32)
    validation.check_rank("idx_mapping", idx, 1)
    validation.check_rank("draft_tokens", drafts, 2)
    R = np.shape(idx)[0]
    max_num_reqs, S = np.shape(drafts)
    validation.check_shape("prefill_len", prefill_len, (max_num_reqs,))
    validation.check_rank("last_sampled_tokens", last, (1, 2))
    validation.check_shape(
        "last_sampled_tokens", last, (max_num_reqs,) if np.ndim(last) == 1 else (max_num_reqs, 1)
    )
    for name, a in (("query_start_loc", qsl), ("seq_lens", seq_lens), ("cu_num_logits", cu)):
        validation.check_rank(name, a, 1)
    for name, a, n in (("query_start_loc", qsl, R + 1), ("seq_lens", seq_lens, R),
                       ("cu_num_logits", cu, R + 1)):
        if np.shape(a)[0] < n:
            raise ValueError(
                f"{name} must have at least {n} entries (num_reqs={R} from idx_mapping), "
                f"got shape {list(np.shape(a))}"
            )
    for name, a in (("input_ids", input_ids), ("idx_mapping", idx), ("last_sampled_tokens", last),
                    ("query_start_loc", qsl), ("seq_lens", seq_lens), ("prefill_len", prefill_len),
                    ("draft_tokens", drafts), ("cu_num_logits", cu)):
        validation.check_dtype(name, a, "integer")

    validation.check_values_in_range("idx_mapping", idx, 0, max_num_reqs, allow=(PAD_ROW_ID,))
    validation.check_values_in_range("seq_lens[:num_reqs]", _head(seq_lens, R), 0,
                                     validation.INT32_MAX + 1)
    validation.check_values_in_range("prefill_len", prefill_len, 0, validation.INT32_MAX + 1)
    validation.check_non_decreasing("query_start_loc[:num_reqs+1]", _head(qsl, R + 1))
    validation.check_non_decreasing("cu_num_logits[:num_reqs+1]", _head(cu, R + 1))
    i, q, c = (validation.concrete_values(a) for a in (idx, qsl, cu))
    if i is None or q is None or c is None:
        return
    T = np.shape(input_ids)[0]
    q, c = q.astype(np.int64), c.astype(np.int64)
    for b in np.flatnonzero(i >= 0):
        nl, qs, qe, cs, ce = c[b + 1] - c[b], q[b], q[b + 1], c[b], c[b + 1]
        where = f"batch row {b} (request row {i[b]})"
        if not num_new <= nl <= S + num_new:
            raise ValueError(
                f"{where} has {nl} logits rows (cu_num_logits[{b}:{b + 2}] = [{cs}, {ce}]); "
                f"expected num_new_sampled_tokens={num_new} plus 0..{S} drafts"
            )
        if cs < 0 or ce > num_logits:
            raise ValueError(
                f"{where}: cu_num_logits[{b}:{b + 2}] = [{cs}, {ce}] must lie in "
                f"[0, num_logits={num_logits}]"
            )
        if qs < 0 or qe > T or qe - qs < nl:
            raise ValueError(
                f"{where}: query_start_loc[{b}:{b + 2}] = [{qs}, {qe}] must lie in "
                f"[0, {T}] (input_ids length) and hold its {nl} logits rows"
            )


def _head(a, n):
    v = validation.concrete_values(a)
    return a if v is None else v[:n]


def combine_sampled_and_draft_tokens(
    input_ids,  # i32[T]
    idx_mapping,  # int[R]; -1 = padded row
    last_sampled_tokens,  # int[MR] or int[MR, 1]
    query_start_loc,  # int[>=R+1]
    seq_lens,  # int[>=R]
    prefill_len,  # int[MR]
    draft_tokens,  # int[MR, S]
    cu_num_logits,  # int[>=R+1]
    num_logits: int,
    num_new_sampled_tokens: int = 1,
    *,
    backend: str = "auto",
    interpret: bool | None = None,
):
    """Write the decode windows into ``input_ids`` and return the logits rows.

    vLLM 0.33.0 model-runner-V2 semantics; the module docstring states the rule,
    the handling of padded (``idx_mapping == -1``) and malformed rows, and the
    value of unwritten ``logits_indices`` entries (0). Pure: returns new arrays.

    Args:
      input_ids: int32 ``[T]`` token ids, prefill tokens already in place.
      idx_mapping: integer ``[R]`` request row of each batch row; -1 = padding.
      last_sampled_tokens: integer ``[MR]`` or ``[MR, 1]`` (vLLM's shape), by request row.
      query_start_loc: integer ``[>= R + 1]``, non-decreasing query offsets.
      seq_lens: integer ``[>= R]``, ``num_computed + query_len`` per batch row.
      prefill_len: integer ``[MR]``, by request row.
      draft_tokens: integer ``[MR, S]`` (``S = num_speculative_steps``, may be 0).
      cu_num_logits: integer ``[>= R + 1]``, cumulative logits rows per batch row.
      num_logits: static size of the returned ``logits_indices``.
      num_new_sampled_tokens: 0 or 1 (static), as in vLLM.
      backend, interpret: see :mod:`pallas_kernels.backend`.

    Returns:
      ``(input_ids, logits_indices)``: int32 ``[T]`` and int32 ``[num_logits]``.

    Raises:
      ValueError: bad shapes, dtypes or static arguments; with concrete values,
        an out-of-range ``idx_mapping`` value (other than -1), decreasing
        offsets, or a malformed live row.
    """
    choice = _backend.choose(OP_COMBINE, backend, interpret)
    _check(input_ids, idx_mapping, last_sampled_tokens, query_start_loc, seq_lens,
           prefill_len, draft_tokens, cu_num_logits, num_logits, num_new_sampled_tokens)
    num_logits = int(num_logits)
    # Nothing to launch: no rows, no logits (then no live row is well formed
    # with nl > 0, so nothing is written), or no tokens.
    if np.shape(idx_mapping)[0] == 0 or num_logits == 0 or np.shape(input_ids)[0] == 0:
        return jnp.asarray(input_ids), jnp.zeros((num_logits,), jnp.int32)
    i32 = lambda name, a: jnp.asarray(validation.as_int32(name, a))  # noqa: E731
    return _backend.run(
        OP_COMBINE, choice, input_ids, i32("idx_mapping", idx_mapping),
        i32("last_sampled_tokens", last_sampled_tokens).reshape(-1),
        i32("query_start_loc", query_start_loc), i32("seq_lens", seq_lens),
        i32("prefill_len", prefill_len), i32("draft_tokens", draft_tokens),
        i32("cu_num_logits", cu_num_logits),
        num_logits=num_logits, num_new=int(num_new_sampled_tokens),
    )


def combine_sampled_and_draft_tokens_reference(
    input_ids, idx_mapping, last_sampled_tokens, query_start_loc, seq_lens, prefill_len,
    draft_tokens, cu_num_logits, num_logits: int, num_new_sampled_tokens: int = 1,
):
    """The pure-jnp reference: :func:`combine_sampled_and_draft_tokens` with ``backend="reference"``."""
    return combine_sampled_and_draft_tokens(
        input_ids, idx_mapping, last_sampled_tokens, query_start_loc, seq_lens, prefill_len,
        draft_tokens, cu_num_logits, num_logits, num_new_sampled_tokens, backend="reference",
    )
