"""Causal attention over a paged KV cache, reading only each row's live blocks.

``paged_attention(q, key_cache, value_cache, block_table, seq_lens, positions,
token_row)``: token ``t`` of row ``b = token_row[t]`` attends to the key
positions ``j`` of its row with ``j <= positions[t]`` and ``j < seq_lens[b]``
(and ``j < W * block_size``, the table's width); key ``j`` lives at entry
``j % block_size`` of block ``block_table[b, j // block_size]``. Query head ``h``
reads kv head ``h // (Hq // Hkv)`` (GQA). One call holds any mix of decode rows
(one token each) and chunked-prefill rows (many tokens each).

Contract (every implementation):

* Pad tokens (``token_row[t] == R``) and tokens that see no key (``seq_len`` 0,
  ``positions[t] < 0``) get 0.
* Masking is on values: a masked key's K/V never enters a product, so NaN in the
  null block, in a free block or in the unwritten tail of a row's last block
  (keys ``j >= seq_lens[b]``) cannot reach any output. Keys ``j < seq_lens[b]``
  are live: the caller wrote them. (The GPU kernel multiplies a tile of one
  row's query tokens with V in one product, so a NaN *live* value that a later
  token of the tile sees also reaches the earlier tokens; the reference keeps
  it per token.)
* fp8 (``float8_e4m3fn``) caches are dequantised as ``stored * scale``
  (``k_scale``/``v_scale``: a number, float32 ``[]``, ``[1]`` or per kv head
  ``[Hkv]``); other caches ignore the scales.
* Scores are ``q . k * sm_scale`` (default ``1 / sqrt(D)``), softmax and
  accumulation in float32; the output has ``q``'s dtype.

Implementations (:mod:`pallas_kernels.backend`; a TPU choice runs the reference, the
TPU path being JAX's ragged paged attention, :mod:`pallas_kernels.rpa`):

* Values: ``value_cache`` (its own head size ``Dv``), or ``None`` with ``v_head_dim``: each
  key row's first ``v_head_dim`` features (a latent cache read as MQA, MLA's absorbed form:
  ``kvjax.models.hf.mla``). Head sizes need not be powers of two: the GPU kernel runs the
  key features as at most two power-of-two blocks (576 = 512 + 64, masked where padded), and
  where the values are the keys' first block (MLA's 512 latent features) it reads them once.

* reference (jnp): gathers every block of the table for every token,
  ``[T, W * block_size]`` keys, then :func:`pallas_kernels.attention_math.masked_attention`
  — the math of the model's first attention (``kvjax.models.attention.paged_attention``,
  bitwise for float32). Its cost follows ``W`` (``max_model_len``), not the context.
* GPU (Pallas Triton): grid ``(T, Hkv, splits)``. Program ``(i, h, s)`` owns the
  query tile that starts at token ``i`` — a run of consecutive tokens of one row
  inside one aligned window of ``block_q`` tokens, all ``G`` query heads of kv head
  ``h`` — if token ``i`` starts one, and returns otherwise (a pad token's program
  stores its zeros, or with split statistics only its empty max and sum, from which the
  combine writes the zeros). The tile's keys are ``ceil(n / block_n)`` chunks, ``n`` the
  largest ``min(seq_len, pos + 1)`` of its tokens: only live blocks its tokens see,
  gathered through the block table, with an online softmax (float32 running max,
  sum and accumulator; bf16 products where q and cache are bf16 or fp8, IEEE float32
  products otherwise). Split ``s`` takes the ``s``-th share of the chunks; with
  ``splits > 1`` (few tokens: decode at small batch) a second kernel combines the
  splits' maxima, sums and outputs (``_combine_gpu``), otherwise the call is one
  launch. Tiles of a decode row hold one token; a prefill chunk of ``L`` tokens makes about
  ``L / block_q`` tiles. Compiled: head sizes >= 16. The same body
  runs in interpret mode on a CPU. Measured on an H100:
  ``benchmarks/results/2026-11-24-h100-paged-attention.json``.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels import backend as _backend
from pallas_kernels import contract as validation
from pallas_kernels import gpu_tiling
from pallas_kernels.attention_math import MASK_VALUE, lse_of, masked_attention
from pallas_kernels.contract import FP8_DTYPE

__all__ = ["PagedAttentionConfig", "paged_attention", "paged_attention_reference", "reads_live_keys_only"]

OP_ATTENTION = "paged_attention"


@dataclasses.dataclass(frozen=True)
class PagedAttentionConfig:
    """Tuning knobs of the GPU kernel (a static argument).

    Attributes:
      gpu_block_m: rows of a query tile, tokens x GQA group (padded to a power of
        two): ``block_q = gpu_block_m // G`` tokens. None: 16 when the call has at
        most one token per row (decode), else 64.
      gpu_block_n: keys per loop step (a power of two, >= 16 compiled). None: 64 (more
        programs resident per SM than 128 allows; BENCHMARKS.md's H200 notes, item 29).
      gpu_kv_splits: programs sharing one tile's keys (flash-decoding: each takes a
        slice of the key chunks, a second kernel combines them). None: the rule of
        ``_kv_splits``: a power of two giving about ``gpu_min_programs`` programs,
        at most ``gpu_max_kv_splits``, each with two chunks of the table's width.
      gpu_max_kv_splits, gpu_min_programs: bounds of that rule (128 splits let a call of one
        kv head at batch 1, MLA's absorbed decode, spread a long context over 128 programs;
        BENCHMARKS.md's H200 note 51).
      gpu_num_warps: Triton warps; None: the rule of ``_fit_registers`` (4, or 8 for MLA's
        prefill tiles).
      gpu_num_stages: software pipelining of the key loop; None: the rule of ``_stages`` (3
        for a decode tile over wide key rows, MLA's latent rows, else 2).
    """

    gpu_block_m: int | None = None
    gpu_block_n: int | None = None
    gpu_kv_splits: int | None = None
    gpu_max_kv_splits: int = 128
    gpu_min_programs: int = 256
    gpu_num_warps: int | None = None
    gpu_num_stages: int | None = None

    def __post_init__(self):
        validation.check_config_ints(self, ("gpu_block_m", "gpu_block_n", "gpu_kv_splits", "gpu_max_kv_splits"))


# --------------------------------------------------------------------------
# Reference (plain XLA): the whole table for every token
# --------------------------------------------------------------------------


@_backend.register(OP_ATTENTION, "reference")
def _reference(q, key_cache, value_cache, block_table, seq_lens, positions, token_row,
               k_scale, v_scale, *, sm_scale, v_head_dim, return_lse, config, interpret):
    """The model's jnp paged attention (bitwise for float32 with ``sm_scale=None``)."""
    del config, interpret
    T, _, D = q.shape
    R, W = block_table.shape
    _, bs, Hkv, _ = key_cache.shape
    Dv = v_head_dim if value_cache is None else value_cache.shape[-1]
    S = W * bs
    real = token_row < R
    row = jnp.where(real, token_row, 0)  # gather index only, masked by `real`
    blocks = block_table[row]  # [T, W]
    j = jnp.arange(S, dtype=jnp.int32)
    visible = (
        real[:, None]
        & (j[None, :] <= positions[:, None])
        & (j[None, :] < seq_lens[row][:, None])
    )  # [T, S]

    def read(cache, scale, width):
        kv = cache[blocks][..., :width].reshape(T, S, Hkv, width).astype(jnp.float32)
        if scale is not None:  # [1] or [Hkv]
            kv = kv * scale[None, None, :, None]
        return kv

    k = read(key_cache, k_scale, D)
    v = read(key_cache, v_scale, Dv) if value_cache is None else read(value_cache, v_scale, Dv)
    if return_lse:
        return masked_attention(q, k, v, visible, sm_scale=sm_scale, return_lse=True)
    return masked_attention(q, k, v, visible, sm_scale=sm_scale).astype(q.dtype)


# --------------------------------------------------------------------------
# GPU: Pallas Triton, one program per (query tile, kv head), live blocks only
# --------------------------------------------------------------------------


def _decode_tiles(T: int, R: int) -> bool:
    """Whether the call's tiles are decode tiles: at most one token per row (``T <= R``)."""
    return T <= R


def _tile_rows(T: int, R: int, group: int, cfg: PagedAttentionConfig) -> int:
    """``block_m``: rows of a query tile (a power of two >= the padded group)."""
    gp = pl.next_power_of_2(group)
    want = cfg.gpu_block_m if cfg.gpu_block_m is not None else (16 if _decode_tiles(T, R) else 64)
    return int(max(want, gp))


def _feature_segments(D: int) -> tuple[tuple[int, int], ...]:
    """``((start, width), ...)``: the key features cut into at most two power-of-two blocks,
    the largest power of two ``<= D`` then the rest padded to one (>= 16): 576 (MLA's latent
    and rope features) is 512 + 64, not 1024; 192 is 128 + 64. A power of two is one block."""
    head = max(16, gpu_tiling.pow2_floor(D))
    rest = D - head
    return ((0, head),) if rest <= 0 else ((0, head), (head, max(16, pl.next_power_of_2(rest))))


def _fit_shared_memory(T: int, R: int, G: int, Dp: int, Dvp: int, itemsize: int, stages: int,
                       cfg: PagedAttentionConfig, budget: int) -> tuple[int, int]:
    """``(block_m, block_n)``: the defaults (or the config's), the defaults halved while one
    program's tiles would not fit ``budget`` bytes (:func:`gpu_tiling.shared_memory_budget` of
    the GPU at hand: 192 KiB on Hopper, 138 on an A100, 84 on an L4): the query tile plus the K
    and V chunks the key loop's pipeline holds, ``stages - 1`` of them (one at least), ``Dp`` /
    ``Dvp`` their padded widths (``Dvp`` 0 where the values are the keys' first block). An
    estimate: at 2 stages MLA's rows padded to 1024 / 512 at 16 x 128 asked Triton for 320 KiB,
    this said 425; at 3 stages MLA's 576-wide bf16 decode tile of 64 keys compiles in Hopper's
    227 KiB, this says 162. Wide heads get narrower tiles; the usual head sizes keep the
    defaults."""
    BM = _tile_rows(T, R, G, cfg)
    BN = cfg.gpu_block_n or 64
    chunks = max(1, stages - 1)

    def need(bm, bn):
        return (bm * Dp + chunks * bn * (Dp + Dvp)) * itemsize

    floor_m = pl.next_power_of_2(G)
    while cfg.gpu_block_m is None and BM > max(16, floor_m) and need(BM, BN) > budget:
        BM //= 2
    while cfg.gpu_block_n is None and BN > 16 and need(BM, BN) > budget:
        BN //= 2
    return int(BM), int(BN)


#: Key-chunk elements (block_n x padded key width) one warp holds in registers, at most: MLA's
#: 576-wide rows take 64 keys on 4 warps (37K elements), the fastest of 16-128 keys on 4 or 8
#: warps in the H200's sweep; 128 keys (74K) ran 1.2x slower (BENCHMARKS.md's H200 notes).
KEY_CHUNK_ELEMENTS_PER_WARP = 16384


def _fit_registers(BM: int, BN: int, Dp: int, Dvp: int, cfg: PagedAttentionConfig) -> tuple[int, int]:
    """``(block_n, num_warps)``: 8 warps where the float32 accumulator (``BM`` x ``Dvp``) passes
    16K elements, else 4 (or the config's); ``block_n`` halved (unless the config sets it)
    while a key chunk passes :data:`KEY_CHUNK_ELEMENTS_PER_WARP` per warp."""
    warps = cfg.gpu_num_warps or (8 if BM * Dvp > 16384 else 4)
    while cfg.gpu_block_n is None and BN > 16 and BN * Dp > KEY_CHUNK_ELEMENTS_PER_WARP * warps:
        BN //= 2
    return int(BN), int(warps)


#: Key rows wider than this (padded) take a third pipeline stage in decode tiles: MLA's
#: 576-wide latent rows ran 1.1-1.3x faster with 3 stages than with 2 on the H200; 128-wide
#: GQA rows gained nothing (-7% to +1%).
WIDE_KEY_ROWS = 256


def _stages(T: int, R: int, Dp: int, cfg: PagedAttentionConfig) -> int:
    """Pipeline stages of the key loop: the config's, else 3 for decode tiles
    (:func:`_decode_tiles`) over key rows wider than :data:`WIDE_KEY_ROWS`, else 2."""
    if cfg.gpu_num_stages is not None:
        return cfg.gpu_num_stages
    return 3 if _decode_tiles(T, R) and Dp > WIDE_KEY_ROWS else 2


def _kv_splits(T: int, Hkv: int, max_keys: int, block_n: int, cfg: PagedAttentionConfig) -> int:
    """Programs that share one tile's keys: enough for ``cfg.gpu_min_programs`` programs
    when the call has few tokens (decode at small batch), each with >= 2 key chunks."""
    if cfg.gpu_kv_splits is not None:
        return cfg.gpu_kv_splits
    most = gpu_tiling.pow2_floor(max_keys // (2 * block_n))  # a power of two, as the combine needs
    return int(min(cfg.gpu_max_kv_splits, most,
                   gpu_tiling.pow2_floor(cfg.gpu_min_programs // (T * Hkv))))


def _dot_dtype(q_dtype, cache_dtype):
    """Operand dtype of the kernel's products: fp8 caches widen to ``q``'s dtype
    (exactly: the scale is applied to the scores and the output instead)."""
    if np.dtype(cache_dtype) == np.dtype(FP8_DTYPE):
        cache_dtype = q_dtype
    dt = jnp.promote_types(q_dtype, cache_dtype)
    return dt if dt in (jnp.bfloat16, jnp.float16) else jnp.float32


@_backend.register(OP_ATTENTION, "gpu")
def _gpu(q, key_cache, value_cache, block_table, seq_lens, positions, token_row,
         k_scale, v_scale, *, sm_scale, v_head_dim, return_lse, config, interpret):
    """The Pallas Triton kernel (module docstring), plus the split combine when splits > 1."""
    T, Hq, D = q.shape
    R, W = block_table.shape
    N, bs, Hkv, _ = key_cache.shape
    shared = value_cache is None  # values: the first Dv features of each key row (MLA's latent)
    Dv = v_head_dim if shared else value_cache.shape[-1]
    Vw = D if shared else Dv  # row width of the array the values are read from
    segs = _feature_segments(D)  # key features as power-of-two blocks (Triton block widths)
    Dp = sum(w for _, w in segs)
    Dvp = max(16, pl.next_power_of_2(Dv))
    # MLA's latent values are the first key block itself: the loaded keys serve as values.
    values_in_keys = shared and Dv == segs[0][1]
    G = Hq // Hkv
    Gp = pl.next_power_of_2(G)
    cdt = _dot_dtype(q.dtype, key_cache.dtype)
    stages = _stages(T, R, Dp, config)
    BM, BN = _fit_shared_memory(T, R, G, Dp, 0 if values_in_keys else Dvp, jnp.dtype(cdt).itemsize,
                                stages, config, gpu_tiling.device_shared_memory_budget())
    BN, warps = _fit_registers(BM, BN, Dp, Dvp, config)
    BQ = BM // Gp  # tokens per tile
    S = W * bs
    splits = _kv_splits(T, Hkv, S, BN, config)
    stats = splits > 1 or return_lse  # float32 outputs with each lane's running max and sum
    if not interpret:
        if D < 16 or Dv < 16 or BN < 16:
            raise NotImplementedError(
                f"the GPU kernel needs head sizes >= 16 and gpu_block_n >= 16 (Triton products), "
                f"got key head size {D}, value head size {Dv}, gpu_block_n {BN}")
    for name, shape in (("key_cache", key_cache.shape), ("q", q.shape),
                        ("the output", (splits, T, Hkv, Gp, Dvp))):
        gpu_tiling.check_int32_offsets(name, shape)  # the kernel's index arithmetic is int32
    scale = (1.0 / math.sqrt(D)) if sm_scale is None else float(sm_scale)
    fp8 = k_scale is not None
    # float32 products in IEEE float32 (Triton's default would be tf32), as the reference.
    prec = jax.lax.Precision.HIGHEST if cdt == jnp.float32 else None
    # Flat views: every access is a gather of whole head rows, ``row * D + column``.
    flat = [a.reshape(-1) for a in (q, key_cache, key_cache if shared else value_cache, block_table)]
    # One scale per kv head: program h reads entry h.
    scales = tuple(jnp.broadcast_to(x, (Hkv,)) for x in (k_scale, v_scale)) if fp8 else ()
    load, store = _backend.triton.load, _backend.triton.store
    lanes = T * Hkv * Gp  # output rows, the group padded to Gp heads

    def read_kv(ref, mask):
        """Masked K/V rows in the product dtype, 0 where masked (on values: fp8 loads take
        no ``other``, so the select does it)."""
        if fp8:
            return jnp.where(mask, load(ref, mask=mask).astype(cdt), 0)
        return load(ref, mask=mask, other=0).astype(cdt)

    def kernel(row_ref, pos_ref, len_ref, table_ref, q_ref, k_ref, v_ref, *refs):
        # Inputs:  row_ref i32[T] (token -> row, R = pad), pos_ref i32[T], len_ref i32[R],
        #          table_ref i32[R * W], q_ref [T * Hq * D], k_ref / v_ref [N * bs * Hkv * D],
        #          fp8 only: k_scale_ref / v_scale_ref f32[Hkv]
        # Outputs: out_ref [splits * lanes * Dvp]: q.dtype, or (splits > 1 or return_lse)
        #          float32 per split (a row only where its sum is > 0), with its running
        #          max and sum m_ref / l_ref
        #          f32[splits * lanes].
        #          Key features run as one or two power-of-two blocks (_feature_segments),
        #          value features as one (Dvp): padded columns read
        #          nothing (masked, their addresses clamped into the row) and are sliced off.
        #          Lane (t, h, g) of the group padded to Gp heads: every lane of a tile has
        #          its own address (interpret mode writes masked lanes back).
        out_ref, m_ref, l_ref = (refs[-3:] if stats else (refs[-1], None, None))
        i, h, sp = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        row_i = row_ref[i]
        real_i = (row_i >= 0) & (row_i < R)
        prev_row = row_ref[jnp.maximum(i - 1, 0)]
        starts = real_i & ((jax.lax.rem(i, BQ) == 0) | (prev_row != row_i))
        m = jnp.arange(BM, dtype=jnp.int32)
        # Tile row m -> token i + k_of_m, query head h * G + g_of_m (lanes g >= G unused).
        k_of_m, g_of_m = jax.lax.div(m, Gp), jax.lax.rem(m, Gp)
        head_ok = g_of_m < G
        # Per key block: (columns, column mask). A block inside the row takes its columns as
        # they are, unmasked: Triton vectorises a row's loads only where it can see the columns
        # are consecutive, and a clamp hides that (each element would be a load of its own).
        # Only a padded block clamps its columns into the row and masks the padding.
        feats = []
        for start, width in segs:
            cols_p = start + jnp.arange(width, dtype=jnp.int32)[None, :]
            feats.append((cols_p, None) if start + width <= D else
                         (jnp.minimum(cols_p, D - 1), cols_p < D))
        vcols_p = jnp.arange(Dvp, dtype=jnp.int32)[None, :]
        vcols, vcol_ok = ((vcols_p, None) if Dvp == Dv else  # value features
                          (jnp.minimum(vcols_p, Dv - 1), vcols_p < Dv))

        def rows_and(ok, col_ok, width):
            """The load mask of rows ``ok`` and columns ``col_ok`` (None: every column)."""
            return (jnp.broadcast_to(ok[:, None], (ok.shape[0], width)) if col_ok is None
                    else ok[:, None] & col_ok)
        t = i + k_of_m
        lane = sp * lanes + (t * Hkv + h) * Gp + g_of_m  # distinct per tile row

        def write(o, m_i, l_i, mask):
            # With split statistics a lane's output row is written only where its sum is
            # positive: the combine reads no other (a split past the live keys writes no row).
            o_mask = (mask & (l_i > 0)) if stats else mask
            store(out_ref.at[lane[:, None] * Dvp + vcols_p], o.astype(out_ref.dtype),
                  mask=jnp.broadcast_to(o_mask[:, None], (BM, Dvp)))
            if stats:
                store(m_ref.at[lane], m_i, mask=mask)
                store(l_ref.at[lane], l_i, mask=mask)

        @pl.when(~real_i)
        def _pad_token_gets_zeros():
            write(jnp.zeros((BM, Dvp), jnp.float32), jnp.full((BM,), MASK_VALUE, jnp.float32),
                  jnp.zeros((BM,), jnp.float32), (k_of_m == 0) & head_ok)

        @pl.when(starts)
        def _attend_tile():
            # The tile: tokens i .. i + k of one row, up to the next window boundary.
            in_t = t < T
            t_c = jnp.where(in_t, t, i)  # loads stay in range; members are all < T
            rows_m = load(row_ref.at[t_c])
            prev_m = load(row_ref.at[jnp.maximum(t_c - 1, 0)])
            boundary = (k_of_m > 0) & (
                ~in_t | (jax.lax.rem(t, BQ) == 0) | (rows_m != prev_m))
            member = (k_of_m < jnp.min(jnp.where(boundary, k_of_m, BQ))) & head_ok
            # Keys each tile row sees: [0, limit); the largest limit bounds the loop.
            kv_len = jnp.clip(len_ref[row_i], 0, S)
            pos_m = load(pos_ref.at[t_c])
            limit = jnp.where(pos_m >= kv_len, kv_len, jnp.maximum(pos_m, -1) + 1)
            limit = jnp.where(member, limit, 0)
            n_keys = jnp.max(limit)
            num_chunks = (n_keys + BN - 1) // BN
            per_split = (num_chunks + splits - 1) // splits
            first = jnp.minimum(sp * per_split, num_chunks)
            last = jnp.minimum(first + per_split, num_chunks)
            q_rows = t_c * Hq + h * G + jnp.minimum(g_of_m, G - 1)
            q_tiles = [load(q_ref.at[q_rows[:, None] * D + cols], other=0,
                            mask=rows_and(member, col_ok, cols.shape[1])).astype(cdt)
                       for cols, col_ok in feats]
            score_scale = jnp.float32(scale)
            if fp8:
                score_scale = score_scale * refs[0][h]
            base = row_i * W

            def step(c, carry):
                acc, m_i, l_i = carry
                j = c * BN + jnp.arange(BN, dtype=jnp.int32)
                live = j < n_keys
                col = jnp.minimum(jax.lax.div(j, bs), W - 1)
                bid = load(table_ref.at[base + col], mask=live, other=0)
                ok = live & (bid >= 0) & (bid < N)  # a bad id reads nothing
                kv_rows = (jnp.where(ok, bid, 0) * bs + jax.lax.rem(j, bs)) * Hkv + h
                kbs = [read_kv(k_ref.at[kv_rows[:, None] * D + cols],
                               rows_and(ok, col_ok, cols.shape[1])) for cols, col_ok in feats]
                if values_in_keys:
                    vb = kbs[0]
                else:
                    vb = read_kv(v_ref.at[kv_rows[:, None] * Vw + vcols], rows_and(ok, vcol_ok, Dvp))
                s = sum(jax.lax.dot_general(qt, kb, (((1,), (1,)), ((), ())), precision=prec,
                                            preferred_element_type=jnp.float32)
                        for qt, kb in zip(q_tiles, kbs)) * score_scale
                vis = j[None, :] < limit[:, None]
                s = jnp.where(vis, s, MASK_VALUE)
                m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
                alpha = jnp.exp(m_i - m_new)
                p = jnp.where(vis, jnp.exp(s - m_new[:, None]), 0.0)
                l_new = l_i * alpha + jnp.sum(p, axis=1)
                pv = jax.lax.dot_general(p.astype(cdt), vb, (((1,), (0,)), ((), ())),
                                         precision=prec, preferred_element_type=jnp.float32)
                return acc * alpha[:, None] + pv, m_new, l_new

            init = (jnp.zeros((BM, Dvp), jnp.float32), jnp.full((BM,), MASK_VALUE, jnp.float32),
                    jnp.zeros((BM,), jnp.float32))
            acc, m_i, l_i = jax.lax.fori_loop(first, last, step, init)
            o = acc / jnp.where(l_i > 0, l_i, 1.0)[:, None]
            if fp8:
                o = o * refs[1][h]
            write(o, m_i, l_i, member)

    out_dtype = jnp.float32 if stats else q.dtype
    out_shape = [jax.ShapeDtypeStruct((splits * lanes * Dvp,), out_dtype)]
    if stats:
        out_shape += [jax.ShapeDtypeStruct((splits * lanes,), jnp.float32)] * 2
    call = pl.pallas_call(
        kernel,
        out_shape=tuple(out_shape),
        grid=(T, Hkv, splits),
        compiler_params=_backend.triton.CompilerParams(
            num_warps=warps,
            num_stages=stages),
        interpret=interpret,
        name="paged_attention_gpu",
    )
    outs = call(token_row, positions, seq_lens, flat[3], *flat[:3], *scales)
    if not stats:
        return outs[0].reshape(T, Hkv, Gp, Dvp)[:, :, :G, :Dv].reshape(T, Hq, Dv)
    out, lse = _combine_gpu(*outs, splits=splits, T=T, Hkv=Hkv, G=G, Dvp=Dvp, Dv=Dv,
                            out_dtype=jnp.float32 if return_lse else q.dtype, interpret=interpret)
    return (out, lse) if return_lse else out


#: Elements of one split-combine program's ``[splits, columns]`` tile of split outputs.
COMBINE_TILE_ELEMENTS = 8192


def _combine_gpu(o, m, l, *, splits, T, Hkv, G, Dvp, Dv, out_dtype, interpret):
    """One softmax from the kernel's per-split results, as one Pallas Triton kernel.

    Inputs (flat): ``o [splits * lanes * Dvp]`` (each split's output normalised by its own
    sum), running maxima ``m`` and sums ``l [splits * lanes]``; lane ``(t, h, g)`` of the group
    padded to ``Gp``. Per lane, with ``top = max_s m_s`` and ``w_s = l_s * exp(m_s - top)``
    (0 where ``l_s`` is 0): ``out = sum_s w_s * o_s / sum_s w_s`` (0 for a lane no split saw)
    and ``lse = top + log(sum_s w_s)`` (``-inf`` there).

    A split's output row is read only where its sum is positive (the kernel writes no other),
    so a call whose live keys fill few of its splits reads few rows.

    Grid ``(lanes, Dvp / BD)``: program ``(lane, j)`` reads its lane's ``splits`` maxima and
    sums and a ``[splits, BD]`` tile of outputs and writes ``out [T, Hq, Dvp]`` in
    ``out_dtype`` (columns ``j * BD ...``; returned sliced to ``Dv``) and, from ``j = 0``,
    ``lse [T, Hq]`` float32. Lanes of the padded group (``g >= G``) store nothing. XLA ran this
    as five kernels (the maxima, the sums, a transpose of the outputs, their weighted sum, the
    division and rounding)."""
    Gp = pl.next_power_of_2(G)
    lanes = T * Hkv * Gp
    Hq = Hkv * G
    # Triton blocks are powers of two: the split axis (``_kv_splits`` and the config give one),
    # and BD, which then divides Dvp
    assert splits & (splits - 1) == 0, f"the split count must be a power of two, got {splits}"
    BD = int(min(Dvp, max(16, COMBINE_TILE_ELEMENTS // splits)))
    load, store = _backend.triton.load, _backend.triton.store

    def kernel(o_ref, m_ref, l_ref, out_ref, lse_ref):
        # Lanes in reverse order: in interpret mode, where programs run one after another, a
        # padded lane's store into the next head's row (were its guard missing) would land on
        # a row already written, and show.
        lane, j = lanes - 1 - pl.program_id(0), pl.program_id(1)
        t, h, g = lane // (Hkv * Gp), jax.lax.rem(lane // Gp, Hkv), jax.lax.rem(lane, Gp)
        s = jnp.arange(splits, dtype=jnp.int32)
        cols = j * BD + jnp.arange(BD, dtype=jnp.int32)
        mv = load(m_ref.at[s * lanes + lane])
        lv = load(l_ref.at[s * lanes + lane])
        top = jnp.max(mv)
        w = jnp.where(lv > 0, lv * jnp.exp(mv - top), 0.0)
        den = jnp.sum(w)
        # Only the splits that saw a key wrote their rows (a sum > 0): the others are not read.
        ov = load(o_ref.at[(s[:, None] * lanes + lane) * Dvp + cols[None, :]],
                  mask=jnp.broadcast_to((lv > 0)[:, None], (splits, BD)), other=0.0)
        wt = w[:, None]
        acc = jnp.sum(wt * ov, axis=0)
        res = (acc / jnp.where(den > 0, den, 1.0)).astype(out_dtype)
        head = t * Hq + h * G + g

        @pl.when(g < G)
        def _store():
            store(out_ref.at[head * Dvp + cols], res)  # BD divides Dvp: no column past the row

            @pl.when(j == 0)
            def _lse():
                lse_ref[head] = lse_of(top, den)

    out, lse = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((T * Hq * Dvp,), out_dtype),
                   jax.ShapeDtypeStruct((T * Hq,), jnp.float32)),
        grid=(lanes, pl.cdiv(Dvp, BD)),
        compiler_params=_backend.triton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="paged_attention_combine_gpu",
    )(o, m, l)
    out = out.reshape(T, Hq, Dvp)
    return (out if Dv == Dvp else out[:, :, :Dv]), lse.reshape(T, Hq)


# --------------------------------------------------------------------------
# Argument checks
# --------------------------------------------------------------------------


def _check(q, key_cache, value_cache, block_table, seq_lens, positions, token_row,
           k_scale, v_scale, v_head_dim):
    """Static checks always, value checks when concrete; returns the fp8 scales (or Nones)."""
    validation.check_rank("q", q, 3)
    T, Hq, D = np.shape(q)
    validation.check_dtype("q", q, (np.float32, jnp.bfloat16, np.float16))
    validation.check_rank("key_cache", key_cache, 4)
    num_blocks, block_size, Hkv = np.shape(key_cache)[:3]
    validation.check_shape("key_cache", key_cache, (None, None, None, D))
    validation.check_dtype("key_cache", key_cache, "floating")
    if value_cache is None:
        if not isinstance(v_head_dim, int) or isinstance(v_head_dim, bool) or not 0 < v_head_dim <= D:
            raise ValueError(f"value_cache=None (values are the keys' first v_head_dim features) needs "
                             f"v_head_dim, an int in [1, {D}], got {v_head_dim!r}")
    else:
        if v_head_dim is not None:
            raise ValueError(f"v_head_dim is only for value_cache=None, got {v_head_dim!r} with a value_cache")
        validation.check_rank("value_cache", value_cache, 4)
        validation.check_shape("value_cache", value_cache, tuple(np.shape(key_cache)[:3]) + (None,))
        validation.check_dtype("value_cache", value_cache, np.dtype(key_cache.dtype))
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(
            f"q's heads must be a multiple of the caches' kv heads: Hq={Hq}, Hkv={Hkv}")
    validation.check_rank("block_table", block_table, 2)
    R, W = np.shape(block_table)
    for name, x, shape in (("seq_lens", seq_lens, (R,)), ("positions", positions, (T,)),
                           ("token_row", token_row, (T,))):
        validation.check_shape(name, x, shape)
    for name, x in (("block_table", block_table), ("seq_lens", seq_lens),
                    ("positions", positions), ("token_row", token_row)):
        validation.check_dtype(name, x, np.int32)
    validation.check_values_in_range("block_table", block_table, 0, num_blocks)
    validation.check_values_in_range("seq_lens", seq_lens, 0, W * block_size + 1)
    validation.check_values_in_range("token_row", token_row, 0, R + 1)
    if np.dtype(key_cache.dtype) != np.dtype(FP8_DTYPE):
        return None, None
    return tuple(validation.fp8_scale_array(name, x, (1, Hkv))  # [1] or [Hkv]
                 for name, x in (("k_scale", k_scale), ("v_scale", v_scale)))


# --------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------


def paged_attention(
    q,  # [T, Hq, D] float
    key_cache,  # [num_blocks, block_size, Hkv, D]
    value_cache,  # [num_blocks, block_size, Hkv, Dv], or None: the keys' first v_head_dim features
    block_table,  # int32 [R, W] block ids
    seq_lens,  # int32 [R]
    positions,  # int32 [T]
    token_row,  # int32 [T], R for pad tokens
    *,
    sm_scale: float | None = None,
    k_scale=None,  # fp8 caches only: number, float32 [], [1] or [Hkv]
    v_scale=None,
    v_head_dim: int | None = None,
    return_lse: bool = False,
    backend: str = "auto",
    interpret: bool | None = None,
    config: PagedAttentionConfig = PagedAttentionConfig(),
):
    """Causal attention of each token over its row's cached keys (see the module docstring).

    Args:
      q: ``[T, Hq, D]``, float32, bfloat16 or float16.
      key_cache, value_cache: ``[num_blocks, block_size, Hkv, D]`` and ``[..., Hkv, Dv]``, one
        float dtype; ``Hq`` a multiple of ``Hkv``. ``value_cache=None``: each key row's first
        ``v_head_dim`` features are its value (a latent cache read as MQA: MLA's absorbed form).
      block_table: int32 ``[R, W]``, ids in ``[0, num_blocks)``.
      seq_lens: int32 ``[R]``, in ``[0, W * block_size]``: keys ``[0, seq_len)`` are live.
      positions: int32 ``[T]``: token ``t`` sees keys ``j <= positions[t]``.
      token_row: int32 ``[T]`` in ``[0, R]``; ``R`` marks a pad token.
      sm_scale: score scale (static); None: ``1 / sqrt(D)``.
      k_scale, v_scale: required for ``float8_e4m3fn`` caches (dequantised as
        ``stored * scale``), ignored otherwise.
      v_head_dim: with ``value_cache=None`` only (static).
      return_lse: also return each query head's log-sum-exp of its scaled visible scores, to
        merge this attention with one over other keys
        (:func:`pallas_kernels.attention_math.merge_attention`); the output is then float32.
      backend, interpret: see :mod:`pallas_kernels._backend` (TPU: the reference).
      config: :class:`PagedAttentionConfig` (static).

    Returns:
      ``[T, Hq, Dv]`` in ``q``'s dtype; 0 for pad tokens and tokens that see no key. With
      ``return_lse``: ``(out float32 [T, Hq, Dv], lse float32 [T, Hq])``, ``lse = -inf``
      where the output is 0.

    Raises:
      ValueError: bad shapes or dtypes; concrete ids, lengths or rows out of range;
        a missing or non-positive fp8 scale.
      NotImplementedError: the compiled GPU kernel cannot take the shapes
        (a head size under 16).
    """
    choice = _backend.choose(OP_ATTENTION, backend, interpret)
    if not isinstance(config, PagedAttentionConfig):
        raise ValueError(f"config must be a PagedAttentionConfig, got {config!r}")
    k_scale, v_scale = _check(q, key_cache, value_cache, block_table, seq_lens, positions,
                              token_row, k_scale, v_scale, v_head_dim)
    T, Hq, D = np.shape(q)
    R, W = np.shape(block_table)
    Dv = v_head_dim if value_cache is None else np.shape(value_cache)[-1]
    if not isinstance(return_lse, bool):
        raise ValueError(f"return_lse must be a bool, got {return_lse!r}")
    if T == 0 or R == 0 or W == 0 or np.shape(key_cache)[0] == 0:
        # nothing to see: every token gets 0
        if return_lse:
            return jnp.zeros((T, Hq, Dv), jnp.float32), jnp.full((T, Hq), -jnp.inf, jnp.float32)
        return jnp.zeros((T, Hq, Dv), q.dtype)
    sm_scale = None if sm_scale is None else float(sm_scale)
    return _backend.run(
        OP_ATTENTION, choice, q, key_cache, value_cache, block_table, seq_lens, positions,
        token_row, k_scale, v_scale, sm_scale=sm_scale, v_head_dim=v_head_dim,
        return_lse=return_lse, config=config)


def reads_live_keys_only(backend: str = "auto", interpret: bool | None = None) -> bool:
    """Whether :func:`paged_attention` with ``backend`` runs the GPU kernel, which reads only the
    keys each token sees, rather than the jnp gather of every token's whole table (whose
    temporaries grow with ``T x W x block_size``)."""
    return _backend.choose(OP_ATTENTION, backend, interpret).flavor == "gpu"


def paged_attention_reference(q, key_cache, value_cache, block_table, seq_lens, positions,
                              token_row, *, sm_scale=None, k_scale=None, v_scale=None):
    """Plain-XLA :func:`paged_attention` (same contract and checks)."""
    return paged_attention(q, key_cache, value_cache, block_table, seq_lens, positions,
                           token_row, sm_scale=sm_scale, k_scale=k_scale, v_scale=v_scale,
                           backend="reference")
