"""Multi-head latent attention (DeepSeek-V2/V3 MLA) over a paged latent cache.

Each token's key and value of every head are a function of one latent row
``concat(c [kv_lora_rank], k_pe [qk_rope_head_dim])``: ``k_nope[h] = c @ W_uk[:, h]``,
``v[h] = c @ W_uv[:, h]``, and the RoPE part of the key, ``k_pe``, is shared by all
heads. The cache stores only the latent rows (:func:`pallas_kernels.concat_and_cache_mla`
writes them, one per slot), ``[num_blocks, block_size, kv_lora_rank + rope_dim]``.

Three ways to attend, equal up to rounding:

* **naive**: up-project every cached latent row to per-head ``k_nope`` and ``v`` and
  attend as usual (``score = q_nope . k_nope + q_pe . k_pe``);
* **absorbed**: fold ``W_uk`` into the query (``q_lat[h] = W_uk[:, h] @ q_nope[h]``,
  ``score = q_lat . c + q_pe . k_pe``), attend over the latent rows themselves, and
  up-project the ``kv_lora_rank``-wide output with ``W_uv`` once per token. A key costs
  ``kv_lora_rank + rope_dim`` values read instead of ``H * (nope + v)`` computed.
* **split** (vLLM's MLA prefill): the step's own tokens attend to each other in the naive
  form — their keys and values up-projected from this step's latent rows, as the cache holds
  them — and to the row's context cached before the step in the absorbed form; the two
  softmaxes are merged by their log-sum-exps. A prefill chunk's products over its own tokens
  are then ``nope + rope`` and ``v`` wide per head instead of ``kv_lora_rank + rope`` and
  ``kv_lora_rank`` (about 3.4x fewer FLOPs for DeepSeek-V2's shapes). A decode-only step runs
  the absorbed form.

``"auto"`` (:func:`step_form`): the split form where the paged-attention kernel runs (a GPU)
and the step may prefill, the absorbed form otherwise: the jnp reference gathers every token's
keys, and the split form's one-token blocks would make that ``T x T x H x (nope + rope)``.

Masking is on values: invisible latent rows (past the token's position, past the
row's ``seq_len``, the null block, unused block-table columns, pad tokens) are
replaced by 0 before any product and their scores by a large negative finite
number, so a NaN anywhere in the pool never reaches a real token.

RoPE here is DeepSeek's: ``rope_interleave`` rotates the pairs ``(x0, x1), (x2, x3), ...``
(and returns the rotated evens then the rotated odds, as transformers does; q and k are
permuted alike, so their product is that of the interleaved layout); otherwise the
rotate-half pairs ``(x_i, x_{i + D/2})``. ``cos`` and ``sin`` are multiplied by the YaRN
attention factor. (``kvjax.models.attention.apply_rope`` is rotate-half with a plain
theta, no inverse-frequency table nor factor, so it is not used.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.models.attention import (MASK_VALUE, attention_query, dense_causal_attention, dot_operands,
                                    einsum_product, one_fresh_prefill)
from pallas_kernels.attention_math import merge_attention
from pallas_kernels.paged_attention import paged_attention as paged_attention_op
from pallas_kernels.paged_attention import reads_live_keys_only

MLA_FORMS = ("naive", "absorbed", "split", "auto")


def step_form(form: str, backend: str, decode_only: bool) -> str:
    """The form one step runs (``"naive"``, ``"absorbed"`` or ``"split"``) for a model's
    ``form`` (:data:`MLA_FORMS`): ``"split"`` runs absorbed in a decode-only step (one new token
    per row: nothing for the naive products to save); ``"auto"`` is ``"split"`` where
    :func:`pallas_kernels.paged_attention` runs its kernel on ``backend``, else ``"absorbed"``."""
    if form not in MLA_FORMS:
        raise ValueError(f"MLA form must be one of {MLA_FORMS}, got {form!r}")
    if form == "auto":
        form = "split" if reads_live_keys_only(backend) else "absorbed"
    return "absorbed" if form == "split" and decode_only else form


def rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray, attention_factor: float,
         interleave: bool) -> jax.Array:
    """DeepSeek RoPE of ``x [T, ..., D]`` float32 at ``positions int [T]``.

    ``inv_freq`` float32 ``[D/2]``. Output: ``concat(x1 cos - x2 sin, x2 cos + x1 sin)``
    with ``(x1, x2)`` the even / odd entries (``interleave``) or the two halves.
    """
    D = x.shape[-1]
    ang = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq, jnp.float32)[None, :]
    cos = jnp.cos(ang) * jnp.float32(attention_factor)
    sin = jnp.sin(ang) * jnp.float32(attention_factor)
    shape = (x.shape[0],) + (1,) * (x.ndim - 2) + (D // 2,)
    cos, sin = cos.reshape(shape), sin.reshape(shape)
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x[..., : D // 2], x[..., D // 2:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _softmax_on_visible(s: jax.Array, visible: jax.Array) -> jax.Array:
    """``s [T, H, S]`` scaled scores, ``visible bool [T, S]`` -> probabilities, exactly 0 where
    invisible; all 0 for a token that sees nothing."""
    vis = visible[:, None, :]
    s = jnp.where(vis, s, MASK_VALUE)
    p = jnp.where(vis, jnp.exp(s - jnp.max(s, axis=-1, keepdims=True)), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    return p / jnp.where(denom > 0, denom, 1.0)


def latent_attention(
    q_nope: jax.Array,  # float32 [T, H, nope]
    q_pe: jax.Array,  # float32 [T, H, pe] (rotated)
    latent: jax.Array,  # float32 [T, S, r + pe]: token t's keys, invisible ones anything (NaN too)
    visible: jax.Array,  # bool [T, S]
    w_uk: jax.Array,  # [H, r, nope]
    w_uv: jax.Array,  # [H, v, r]
    *,
    softmax_scale: float,
    form: str,
) -> jax.Array:
    """Attention of each token over its own latent rows -> float32 ``[T, H, v]``."""
    if form not in ("naive", "absorbed"):
        raise ValueError(f"latent_attention's form must be 'naive' or 'absorbed', got {form!r}")
    r = w_uk.shape[1]
    latent = jnp.where(visible[:, :, None], latent, 0.0)  # values first: NaN never multiplied
    c, k_pe = latent[..., :r], latent[..., r:]
    f32 = jnp.float32
    if form == "naive":
        k_nope = jnp.einsum("tsr,hrn->tshn", c, w_uk, preferred_element_type=f32)
        v = jnp.einsum("tsr,hvr->tshv", c, w_uv, preferred_element_type=f32)
        s = jnp.einsum("thn,tshn->ths", q_nope, k_nope) + jnp.einsum("thp,tsp->ths", q_pe, k_pe)
        p = _softmax_on_visible(s * f32(softmax_scale), visible)
        return jnp.einsum("ths,tshv->thv", p, v)
    q_lat = jnp.einsum("thn,hrn->thr", q_nope, w_uk, preferred_element_type=f32)
    s = jnp.einsum("thr,tsr->ths", q_lat, c) + jnp.einsum("thp,tsp->ths", q_pe, k_pe)
    p = _softmax_on_visible(s * f32(softmax_scale), visible)
    o_lat = jnp.einsum("ths,tsr->thr", p, c)
    return jnp.einsum("thr,hvr->thv", o_lat, w_uv, preferred_element_type=f32)


def paged_latent_attention(
    q_nope: jax.Array,  # float32 [T, H, nope]
    q_pe: jax.Array,  # float32 [T, H, pe]
    cache: jax.Array,  # [num_blocks, block_size, r + pe] (float, or float8_e4m3fn)
    w_uk: jax.Array,
    w_uv: jax.Array,
    block_table: jax.Array,  # int32 [R, W] kernel-block ids
    seq_lens: jax.Array,  # int32 [R]
    positions: jax.Array,  # int32 [T]
    token_row: jax.Array,  # int32 [T], R for pad tokens
    *,
    softmax_scale: float,
    form: str,
    fp8_scale: float | None = None,
    backend: str = "reference",
) -> jax.Array:
    """Causal MLA of each token over its row's cached latent rows -> float32 ``[T, H, v]``.

    Token ``t`` of row ``b`` sees cache position ``j`` (column ``j // block_size`` of
    ``block_table[b]``) iff ``j <= positions[t]`` and ``j < seq_lens[b]``; pad tokens
    (``token_row == R``) see nothing and get 0. An fp8 cache is read as
    ``float32(stored) * fp8_scale``.

    The absorbed form runs as MQA over the latent rows in :func:`pallas_kernels.paged_attention`
    with ``backend`` (one kv head of ``r + pe`` features, values its first ``r``; the query
    ``[q_lat | q_pe]`` in ``w_uk``'s dtype, as ``kvjax.models.attention.attention_query`` rounds
    it): on a GPU its kernel reads only each row's live blocks. The absorption products take
    their operands from ``dot_operands`` (bf16 weights: bf16 products into float32). The naive
    form: the jnp gather over the whole block table below.
    """
    if form == "absorbed":
        q_lat = jnp.einsum("thn,hrn->thr", *dot_operands(q_nope, w_uk),
                           preferred_element_type=jnp.float32)
        qf = attention_query(jnp.concatenate([q_lat, q_pe], axis=-1), w_uk.dtype)
        scale = None if fp8_scale is None else jnp.float32(fp8_scale)
        o_lat = paged_attention_op(
            qf, cache[:, :, None, :], None, block_table, seq_lens, positions, token_row,
            v_head_dim=w_uk.shape[1], sm_scale=softmax_scale, k_scale=scale, v_scale=scale,
            backend=backend)
        return jnp.einsum("thr,hvr->thv", *dot_operands(o_lat, w_uv),
                          preferred_element_type=jnp.float32)
    T = q_nope.shape[0]
    R, W = block_table.shape
    _, bs, width = cache.shape
    S = W * bs
    real = token_row < R
    row = jnp.where(real, token_row, 0)  # gather index only; masked by `real`
    j = jnp.arange(S, dtype=jnp.int32)
    visible = real[:, None] & (j[None, :] <= positions[:, None]) & (j[None, :] < seq_lens[row][:, None])
    latent = cache[block_table[row]].reshape(T, S, width).astype(jnp.float32)
    if fp8_scale is not None:
        latent = latent * jnp.float32(fp8_scale)
    return latent_attention(q_nope, q_pe, latent, visible, w_uk, w_uv,
                            softmax_scale=softmax_scale, form=form)


def split_latent_attention(
    q_nope: jax.Array,  # float32 [T, H, nope]
    q_pe: jax.Array,  # float32 [T, H, pe] (rotated)
    new_latent: jax.Array,  # float32 [T, r + pe]: this step's latent rows as the cache holds them
    cache: jax.Array,  # [num_blocks, block_size, r + pe] (float, or float8_e4m3fn)
    w_uk: jax.Array,  # [H, r, nope]
    w_uv: jax.Array,  # [H, v, r]
    block_table: jax.Array,  # int32 [R, W] kernel-block ids
    seq_lens: jax.Array,  # int32 [R]: num_computed + query_len
    query_start_loc: jax.Array,  # int32 [R + 1]
    query_len: jax.Array,  # int32 [R]
    positions: jax.Array,  # int32 [T]
    token_row: jax.Array,  # int32 [T], R for pad tokens
    *,
    softmax_scale: float,
    fp8_scale: float | None = None,
    backend: str = "reference",
    self_attention: str = "paged",
) -> jax.Array:
    """The split form (module docstring) -> ``[T, H, v]`` in the dtype attention reads
    (:func:`~kvjax.models.attention.attention_query`: ``w_uk``'s; the output projection rounds
    its operand to it anyway), the same attention as :func:`paged_latent_attention`: token ``t``
    of row ``b`` sees the row's keys up to its own position.

    * Over this step's tokens: row ``b``'s tokens are ``query_start_loc[b] ..`` (``query_len[b]``
      of them, contiguous); ``new_latent`` up-projected to per-head ``[k_nope | k_pe]`` and
      ``v`` and read by :func:`pallas_kernels.paged_attention` through a block table of
      one-token blocks ``[R, T]`` (row ``b``'s column ``j`` is token ``query_start_loc[b] +
      j``), each token at its index inside its row's run.
    * Over the context: the absorbed form over the cache with ``seq_lens - query_len`` keys
      (what was cached before this step); not run when every row's context is empty.

    Both parts return their log-sum-exps and are merged exactly
    (:func:`pallas_kernels.attention_math.merge_attention`; the context's output is
    up-projected with ``W_uv`` first, which commutes with the merge's weighted sum).

    ``self_attention``: ``"paged"`` as above; ``"cudnn"`` or ``"xla"``
    (:func:`kvjax.models.attention.self_attention_impl` picks): a step where one row has tokens
    and that row has no context (one fresh prefill, whatever the bucket's rows) attends through
    :func:`kvjax.models.attention.dense_causal_attention` with that implementation, and nothing
    is merged; any other step (a conditional) takes the paged path.
    """
    T, H, _ = q_nope.shape
    R = seq_lens.shape[0]
    r = w_uk.shape[1]
    f32 = jnp.float32
    real = token_row < R
    row = jnp.where(real, token_row, 0)  # gather index only; pad tokens see nothing anyway
    # -- this step's tokens, naive. Pad tokens' latent rows zeroed (so are their keys and values):
    # the dense branch's causal mask leaves a pad key in a real query's last tile with weight 0,
    # and 0 times a NaN is NaN. Done here on [T, r + pe], not on the [T, H, *] keys and values
    # (an unfused pass over each, 1.8 ms of an 8k prefill); the paged path never reads them.
    # (DeepSeek-V3's layer already hands over zeros there, its PAD slots' rows; this function's
    # other callers need not.)
    new_latent = jnp.where(real[:, None], new_latent, jnp.zeros((), new_latent.dtype))
    c, k_pe = new_latent[:, :r], new_latent[:, r:]
    # Queries, keys and values in the dtype attention reads (attention_query: a bf16 model's are
    # bf16, as the absorbed kernel's), each written once in it: the up-projections write it
    # themselves, and every branch below reads these three (the context's q_nope and q_pe are
    # q's columns: the same roundings), so the conditional's operands are the narrow arrays.
    dt = jnp.dtype(w_uk.dtype)
    nope = q_nope.shape[-1]
    k_nope = einsum_product("tr,hrn->thn", c, w_uk, dt)
    v = einsum_product("tr,hvr->thv", c, w_uv, dt)
    k = jnp.concatenate([k_nope, jnp.broadcast_to(k_pe.astype(dt)[:, None, :], (T, H, k_pe.shape[-1]))],
                        axis=-1)
    q = attention_query(jnp.concatenate([q_nope, q_pe], axis=-1), w_uk.dtype)
    starts = query_start_loc[:R]
    table = jnp.minimum(starts[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :], T - 1)
    local = jnp.arange(T, dtype=jnp.int32) - starts[row]
    context_lens = seq_lens - query_len

    has_context = jnp.any(context_lens > 0)

    def paged_self():  # this step's tokens through the paged kernel, with their log-sum-exps
        return paged_attention_op(
            q, k[:, None], v[:, None], table, query_len, local, token_row,
            sm_scale=softmax_scale, return_lse=True, backend=backend)

    def context():  # the cached context, absorbed, with its log-sum-exps
        q_lat = einsum_product("thn,hrn->thr", q[..., :nope], w_uk)
        qf = attention_query(jnp.concatenate([q_lat, q[..., nope:]], axis=-1), w_uk.dtype)
        scale = None if fp8_scale is None else jnp.float32(fp8_scale)
        o_lat, lse = paged_attention_op(
            qf, cache[:, :, None, :], None, block_table, context_lens, positions, token_row,
            v_head_dim=r, sm_scale=softmax_scale, k_scale=scale, v_scale=scale, return_lse=True,
            backend=backend)
        return jnp.einsum("thr,hvr->thv", *dot_operands(o_lat, w_uv), preferred_element_type=f32), lse

    def no_context():
        return jnp.zeros((T, H, w_uv.shape[1]), f32), jnp.full((T, H), -jnp.inf, f32)

    def with_context():
        return merge_attention(*paged_self(), *context())[0].astype(dt)

    def without_context():  # a step of fresh prefills: no [T, H, kv_lora_rank] float32 zero
        return merge_attention(*paged_self(), *no_context())[0].astype(dt)  # written and up-projected

    if self_attention not in ("paged", "cudnn", "xla"):
        raise ValueError(f"self_attention must be 'paged', 'cudnn' or 'xla', got {self_attention!r}")
    if self_attention != "paged":
        # One row with tokens: they are 0 .. n (the rows before it have none; pad tokens after
        # them). With no context they attend only to each other, a dense causal attention:
        # cuDNN's flash kernel (no log-sum-exp needed, so none is rounded). Otherwise the
        # paged path, with or without the context part: one three-way conditional, not two
        # nested ones (each conditional costs a mixed step; BENCHMARKS.md).

        def dense():
            o = dense_causal_attention(q, k, v, softmax_scale, implementation=self_attention)
            return jnp.where(real[:, None, None], o, jnp.zeros((), dt))

        which = jnp.where(one_fresh_prefill(query_len, seq_lens), 0, jnp.where(has_context, 1, 2))
        try:
            return jax.lax.switch(which, (dense, with_context, without_context))
        except NotImplementedError:  # shapes this cuDNN refuses (raised while tracing): paged
            pass
    # the context part is skipped (a conditional) when no row has one (as without_context)
    return merge_attention(*paged_self(), *jax.lax.cond(has_context, context, no_context))[0].astype(dt)
