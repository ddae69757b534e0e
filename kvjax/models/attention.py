"""GQA attention over the paged KV cache: RoPE, the cache write, a jnp paged attention.

The paged attention reads every key through the step's block tables and masks
by position (causal) and by ``seq_len``. Masking is done on *values* with
``jnp.where`` — scores of masked keys become a large negative finite number,
their probabilities exactly 0, and their K/V entries 0 before any product — so
a NaN in the null block, in an unused block or in a block's unwritten tail
cannot reach a real token (``0 * NaN`` would).

A step of one fresh prefill (:func:`one_fresh_prefill`: one row with tokens, no context)
attends over its own tokens instead, with a dense causal attention
(:func:`dense_causal_attention`; cuDNN's flash kernel on a Hopper GPU,
:func:`self_attention_impl`), its pad tokens' keys and values zeroed first. MLA's split form
(:mod:`kvjax.models.hf.mla`) takes the same three functions.
"""

from __future__ import annotations

import dataclasses
import inspect

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from kvjax.interop.rpa import RPAMetadata, rpa_metadata
from kvjax.models.config import TinyHybridConfig
from kvjax.models.step_context import StepContext
from pallas_kernels import backend as kernel_backend
from pallas_kernels import ragged_paged_attention
from pallas_kernels.attention_math import MASK_VALUE as MASK_VALUE
from pallas_kernels.kv_pages import write_kv_pages
from pallas_kernels.kv_write import reshape_and_cache_flash
from pallas_kernels.paged_attention import paged_attention as paged_attention_op
from pallas_kernels.paged_attention import reads_live_keys_only

#: cuDNN's flash attention serves a fresh prefill from this CUDA capability on (Hopper: heads up
#: to 256 wide, MLA's 192 included).
CUDNN_MIN_CAPABILITY = (9, 0)



def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last axis, float32."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def apply_rope(x: jax.Array, positions: jax.Array, theta: float, rotary_dim: int | None = None) -> jax.Array:
    """Rotate-half (NeoX) RoPE. ``x [T, H, D]``, ``positions int [T]`` -> ``[T, H, D]``.

    ``rotary_dim`` (even, ``<= D``; None: ``D``): only the first ``rotary_dim`` features are
    rotated (frequencies over ``rotary_dim``), the rest pass through (partial rotary).
    """
    D = x.shape[-1]
    if rotary_dim is not None and rotary_dim != D:
        if rotary_dim % 2 or not 0 < rotary_dim < D:
            raise ValueError(f"rotary_dim must be even and in (0, {D}], got {rotary_dim}")
        rot = apply_rope(x[..., :rotary_dim], positions, theta)
        return jnp.concatenate([rot, x[..., rotary_dim:].astype(rot.dtype)], axis=-1)
    inv_freq = theta ** (-jnp.arange(0, D, 2, dtype=jnp.float32) / D)  # [D/2]
    ang = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    cos, sin = jnp.cos(ang)[:, None, :], jnp.sin(ang)[:, None, :]
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def paged_attention(
    q: jax.Array,  # [T, Hq, D] float32
    key_cache: jax.Array,  # [num_blocks, block_size, Hkv, D]
    value_cache: jax.Array,  # [num_blocks, block_size, Hkv, D]
    block_table: jax.Array,  # int32 [R, W] kernel-block ids
    seq_lens: jax.Array,  # int32 [R]
    positions: jax.Array,  # int32 [T]
    token_row: jax.Array,  # int32 [T], R for pad tokens
    *,
    k_scale: float | None = None,
    v_scale: float | None = None,
    sm_scale: float | None = None,
) -> jax.Array:
    """Causal attention of each token over its row's cached keys: the jnp gather over the whole
    block table (``pallas_kernels.paged_attention``'s reference flavour, which owns the rules:
    token ``t`` of row ``b`` sees key ``j`` iff ``j <= positions[t]`` and ``j < seq_lens[b]``;
    masked on values; pad tokens get 0; fp8 dequantised as ``stored * scale``).

    Returns:
      float32 ``[T, Hq, D]``.
    """
    return paged_attention_op(q.astype(jnp.float32), key_cache, value_cache, block_table, seq_lens, positions,
                              token_row, k_scale=k_scale, v_scale=v_scale, sm_scale=sm_scale,
                              backend="reference").astype(jnp.float32)


def ragged_paged_attention_xla(
    q: jax.Array,  # [T, Hq, D]
    kv_pages: jax.Array,  # [num_pages, page_size, 2 * Hkv, D] (or the packed rank 5)
    metadata: RPAMetadata,
    *,
    sm_scale: float = 1.0,
    k_scale: float | None = None,
    v_scale: float | None = None,
) -> jax.Array:
    """JAX's ``ref_ragged_paged_attention`` semantics with static shapes (jit-able, any backend).

    The ``"reference"`` flavour of :func:`pallas_kernels.ragged_paged_attention` (its
    docstring: masking on values, malformed steps, fp8) on :class:`RPAMetadata`.

    Returns:
      ``[T, Hq, D]`` in ``q.dtype``; rows of tokens past ``cu_q_lens[num_seqs]`` are 0
      (JAX's reference returns only the real rows).
    """
    return ragged_paged_attention(
        q, kv_pages, *metadata.as_args(), sm_scale=sm_scale, k_scale=k_scale, v_scale=v_scale,
        backend="reference",
    )


@dataclasses.dataclass(frozen=True)
class AttnSpec:
    """What one attention mixer computes (hashable; one tensor-parallel shard's heads).

    Attributes:
      num_heads, num_kv_heads, head_dim: GQA (query head ``h`` reads KV head
        ``h // (num_heads // num_kv_heads)``).
      rope_theta: RoPE base; None: no positional rotation (NoPE).
      rotary_dim: features rotated (partial rotary); None: all of ``head_dim``.
      sm_scale: score scale; None: ``1 / sqrt(head_dim)``.
      k_scale, v_scale: fp8 KV-cache scales (used only with an fp8 cache dtype).
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float | None = 10000.0
    rotary_dim: int | None = None
    sm_scale: float | None = None
    k_scale: float = 1.0
    v_scale: float = 1.0


def linear(x: jax.Array, w: jax.Array, b: jax.Array | None = None, out_dtype=jnp.float32) -> jax.Array:
    """``x @ w (+ b)`` with float32 accumulation: ``x`` is cast to ``w``'s dtype (bf16 weights run
    a bf16 matmul into float32; on the CPU, whose XLA lacks that dot, the bf16 operands are
    widened first: the same products); float32 weights are a plain ``x @ w``.

    ``out_dtype``: the result's dtype, the float32 sum rounded once (after ``b``). A narrower one
    is the product's own output type where there is no bias (the GEMM writes it: half the bytes
    of a float32 result)."""
    f32 = jnp.float32
    if w.dtype == f32:
        y = x @ w
    else:
        x, w = dot_operands(x, w)
        pref = _product_type(w, out_dtype) if b is None else f32
        y = row_padded(lambda a: jnp.matmul(a, w, preferred_element_type=pref), x)
    y = y if b is None else y + b.astype(f32)
    return y.astype(out_dtype)


def _product_type(w: jax.Array, out_dtype) -> jnp.dtype:
    """The element type a product over :func:`dot_operands`' ``w`` asks for: ``out_dtype`` where it
    is ``w``'s own (the GEMM accumulates in float32 and writes it: half the bytes of a float32
    result, one rounding either way), else float32."""
    return jnp.dtype(out_dtype) if w.dtype == jnp.dtype(out_dtype) else jnp.dtype(jnp.float32)


def einsum_product(spec: str, x: jax.Array, w: jax.Array, out_dtype=jnp.float32) -> jax.Array:
    """``einsum(spec, x, w)`` as :func:`linear` runs a product (operands from
    :func:`dot_operands`, float32 accumulation), its float32 sum rounded once to ``out_dtype``."""
    x, w = dot_operands(x, w)
    return jnp.einsum(spec, x, w, preferred_element_type=_product_type(w, out_dtype)).astype(out_dtype)


def dot_operands(x: jax.Array, w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(x, w)`` for a product into float32 with ``w``'s precision: ``x`` cast to ``w``'s dtype; on
    the CPU, whose XLA has no bf16 x bf16 -> f32 dot, bf16 operands widened to float32 (the same
    products). Every matmul of the models takes its operands from here."""
    x = x.astype(w.dtype)
    if w.dtype != jnp.float32 and jax.default_backend() == "cpu":
        return x.astype(jnp.float32), w.astype(jnp.float32)
    return x, w


# Tests set it to run the GPU's one-row padding on a CPU (see row_count).
PAD_ONE_ROW_ON_CPU = False


def row_count(n: int) -> int:
    """The rows a product of ``n`` token rows runs with: off the CPU a single row runs as two
    (XLA:GPU lowers a one-row product to a column reduction at about half the memory bandwidth,
    two rows take its GEMM path); otherwise ``n``."""
    return 2 if n == 1 and (PAD_ONE_ROW_ON_CPU or jax.default_backend() != "cpu") else n


def pad_rows(x: jax.Array, n: int) -> jax.Array:
    """``x [m, ...]`` with zero rows appended up to ``n >= m``."""
    if x.shape[0] == n:
        return x
    return jnp.concatenate([x, jnp.zeros((n - x.shape[0],) + x.shape[1:], x.dtype)])


def padded_stream(x: jax.Array, token_real: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A model step's residual stream ``x [T, d]`` and token mask ``token_real [T]`` with
    :func:`row_count` rows (off the CPU a single token runs as two, the second zero and
    masked): every norm and product then runs on the rows as they are, with no pad before each
    product and no slice after it; the mixers read the ``T`` tokens' rows."""
    rows = row_count(x.shape[0])
    return pad_rows(x, rows), pad_rows(token_real, rows)


def row_padded(f, x: jax.Array, axis: int = 0) -> jax.Array:
    """``f(x)`` for a product whose ``axis`` is the row (token) axis, run with
    :func:`row_count` rows: a single row padded with zeros, the first output row returned."""
    if x.shape[axis] != 1 or row_count(1) == 1:
        return f(x)
    y = f(jnp.concatenate([x, jnp.zeros_like(x)], axis=axis))
    return jax.lax.slice_in_dim(y, 0, 1, axis=axis)


def attention_query(q: jax.Array, weight_dtype) -> jax.Array:
    """The query attention reads: rounded to the weights' dtype when that is narrower than
    float32 (a bf16 model's query is bf16, as in transformers and vLLM), so the paged-attention
    kernel runs bf16 products over a bf16 or fp8 cache instead of widening every key to IEEE
    float32; float32 models keep a float32 query. The dense references round the same way."""
    return q if jnp.dtype(weight_dtype) == jnp.float32 else q.astype(weight_dtype)


def attention_mixer(
    h: jax.Array,  # [T, d] (normed)
    ctx: StepContext,
    key_cache: jax.Array,
    value_cache: jax.Array | None,
    w: dict,
    spec: AttnSpec,
    *,
    kv_cache_dtype: str,
    backend: str,
    kv_layout: str = "flash",
    model_axis: str | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """Project, rotate, write this step's K/V (pad slots write nothing), attend, project out.

    ``w``: ``wq [d, Hq*D]``, ``wk``, ``wv [d, Hkv*D]``, ``wo [Hq*D, d]`` and optionally biases
    ``bq``, ``bk``, ``bv``, ``bo``. With ``model_axis`` the heads are this shard's and the
    output is summed over the axis (``bo`` added once, after the sum).

    The flash layout attends with :func:`live_paged_attention`, or, in a step of one fresh
    prefill where :func:`self_attention_impl` picks a dense kernel, with
    :func:`dense_causal_attention` (a conditional; not in a decode-only step or over an fp8
    cache).

    Returns ``(out [n, d] float32, key_cache, value_cache)``; ``out`` is not masked (the
    caller masks pad tokens). ``kv_layout="rpa"``: ``key_cache`` holds the combined pages.
    ``h`` may have ``n >= T`` rows (the step's ``T`` tokens first, zero rows after them, as
    :func:`row_count` pads a single token): the products run over all ``n``, the rest over ``T``.
    """
    n, T = h.shape[0], ctx.num_tokens
    Hq, Hkv, D = spec.num_heads, spec.num_kv_heads, spec.head_dim
    q = linear(h, w["wq"], w.get("bq")).reshape(n, Hq, D)[:T]
    k = linear(h, w["wk"], w.get("bk")).reshape(n, Hkv, D)[:T]
    v = linear(h, w["wv"], w.get("bv")).reshape(n, Hkv, D)[:T]
    if spec.rope_theta is not None:
        q = apply_rope(q, ctx.positions, spec.rope_theta, spec.rotary_dim)
        k = apply_rope(k, ctx.positions, spec.rope_theta, spec.rotary_dim)
    q = attention_query(q, w["wq"].dtype)
    fp8 = kv_cache_dtype != "auto"
    k_scale = spec.k_scale if fp8 else None
    v_scale = spec.v_scale if fp8 else None
    scales = (
        None if k_scale is None else jnp.float32(k_scale),
        None if v_scale is None else jnp.float32(v_scale),
    )
    if not fp8:  # "auto": the cache stores K/V in its own dtype (bf16 for a bf16 model)
        k, v = k.astype(key_cache.dtype), v.astype(key_cache.dtype)
    if kv_layout == "rpa":
        key_cache = write_kv_pages(
            k, v, key_cache, ctx.slot_mapping, kv_cache_dtype, *scales, backend=backend
        )
        q_rpa = q
        if spec.sm_scale is not None:  # rpa_attention scales by 1/sqrt(D): fold the rest into q
            q_rpa = (q.astype(jnp.float32) * jnp.float32(spec.sm_scale * float(np.sqrt(D)))).astype(q.dtype)
        o = rpa_attention(
            q_rpa, key_cache, ctx, backend=backend, k_scale=k_scale, v_scale=v_scale
        ).astype(jnp.float32)
    else:
        key_cache, value_cache = reshape_and_cache_flash(
            k, v, key_cache, value_cache, ctx.slot_mapping, kv_cache_dtype, *scales,
            backend=backend,
        )
        def paged():
            return live_paged_attention(
                q, key_cache, value_cache, ctx, backend=backend, k_scale=k_scale, v_scale=v_scale,
                sm_scale=spec.sm_scale,
            )

        # A step of one fresh prefill attends over its own tokens, which are this step's K/V
        # (no context; an "auto" cache holds them as they are): a dense causal attention
        # (cuDNN's flash kernel where self_attention_impl says so), chosen by a conditional. A
        # decode-only step never is one; an fp8 cache keeps the paged path (it reads the
        # quantised keys).
        plain = not (fp8 or ctx.decode_only or k.dtype != q.dtype)
        impl = self_attention_impl(backend, q.dtype) if plain else "paged"
        o = None
        if impl != "paged":
            def dense():
                real = ctx.token_real[:T, None, None]
                scale = spec.sm_scale if spec.sm_scale is not None else 1.0 / float(np.sqrt(D))
                # pad tokens' keys and values zeroed: a masked key's 0 weight times a NaN is NaN
                kz, vz = (jnp.where(real, a, jnp.zeros((), a.dtype)) for a in (k, v))
                o = dense_causal_attention(q, kz, vz, scale, implementation=impl)
                return jnp.where(real, o, jnp.zeros((), o.dtype))

            # Both branches end in the query's dtype (attention_query: wq's; every loader gives
            # wq and wo one dtype, so the product below rounds its operand to it anyway), and the
            # dense branch's output stays as cuDNN writes it (a float32 select and convert of
            # [T, Hq, D] cost a pass each)
            def paged_rounded():
                return paged().astype(q.dtype)

            try:
                o = jax.lax.cond(one_fresh_prefill(ctx.query_len, ctx.seq_lens), dense, paged_rounded)
            except NotImplementedError:  # shapes this cuDNN refuses (raised while tracing): paged
                pass
        if o is None:
            o = paged()
    out = linear(pad_rows(o.reshape(T, -1), n), w["wo"])
    if model_axis is not None:
        out = jax.lax.psum(out, model_axis)
    if w.get("bo") is not None:
        out = out + w["bo"].astype(jnp.float32)
    return out, key_cache, value_cache


def live_paged_attention(q, key_cache, value_cache, ctx: StepContext, *, backend: str,
                         k_scale=None, v_scale=None, sm_scale=None) -> jax.Array:
    """The flash layout's attention: :func:`pallas_kernels.paged_attention` with the step's
    ``backend`` (the GPU flavour reads only each row's live blocks; the reference is
    :func:`paged_attention` above, bitwise for float32). Where the compiled GPU kernel cannot
    take the shapes (a head size under 16) the reference runs. float32 ``[T, Hq, D]``."""
    args = (q, key_cache, value_cache, ctx.block_table, ctx.seq_lens, ctx.positions, ctx.token_row)
    kw = {"k_scale": k_scale, "v_scale": v_scale, "sm_scale": sm_scale}
    try:
        o = paged_attention_op(*args, backend=backend, **kw)
    except NotImplementedError:
        o = paged_attention_op(*args, backend="reference", **kw)
    return o.astype(jnp.float32)


def self_attention_impl(backend: str, dtype) -> str:
    """How a step of one fresh prefill (:func:`one_fresh_prefill`) attends over its own tokens:
    ``"cudnn"`` (:func:`dense_causal_attention` with cuDNN's flash kernel) for bf16 / fp16
    queries and keys where the paged kernel runs on a CUDA GPU of compute capability >= 9.0,
    else ``"paged"`` (the step's paged attention, as every other step). On an H200 the dense
    kernel took an 8k causal attention from 3.0 to 0.71 ms at DeepSeek-V2-Lite's MLA shape and
    from 3.9 to 0.89 ms at Nemotron-H's GQA shape (BENCHMARKS.md)."""
    if (jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
            or not reads_live_keys_only(backend) or kernel_backend.platform() != "gpu"):
        return "paged"
    cap = kernel_backend.gpu_capability()[1]  # None off CUDA (a ROCm GPU reports no CUDA capability)
    return "cudnn" if cap is not None and cap >= CUDNN_MIN_CAPABILITY else "paged"


def one_fresh_prefill(query_len: jax.Array, seq_lens: jax.Array) -> jax.Array:
    """Whether a step is one fresh prefill: exactly one row has tokens and that row has no
    context (``seq_lens == query_len``), whatever the bucket's rows. Its tokens are then the
    step's first ``sum(query_len)`` (rows are packed in order from token 0; the rows before it
    have none) and attend only to each other: a dense causal attention. A bool scalar."""
    active = query_len > 0
    return (jnp.sum(active) == 1) & ~jnp.any(active & (seq_lens > query_len))


def dense_causal_attention(q, k, v, softmax_scale: float, *, implementation: str) -> jax.Array:
    """One sequence's causal self-attention -> ``[T, Hq, Dv]`` in the inputs' dtype (as the kernel
    writes it; the products accumulate in float32): ``q [T, Hq, D]``,
    ``k [T, Hkv, D]``, ``v [T, Hkv, Dv]`` (one dtype; ``Hq`` a multiple of ``Hkv``: query head
    ``h`` reads key head ``h // (Hq / Hkv)``), token ``i`` sees keys ``j <= i``.

    The sequence may end before ``T`` (a bucket's pad tokens after it): causality alone keeps
    every real token's output exact, since a pad key comes after every real query. So no length
    is passed, and the pad tokens' rows (anything; the caller masks them) cost their share of
    the work. That share is the bucket's padding: under the default buckets at most 15 tokens
    from 256 on (19 with 4 speculative tokens), where cuDNN's padding mask cost 10% of an 8k
    MLA prefill's attention (BENCHMARKS.md); a bucket much longer than its prompt pays for its
    whole length. The keys and values must be finite where a real query's tile reads them (a
    masked key's 0 weight times a NaN is NaN).

    ``implementation``: ``"cudnn"``, cuDNN's flash kernel through JAX's own cuDNN entry point
    (bf16 / fp16), which takes values narrower than the keys (MLA's split form; cuDNN >= 9.10
    on Hopper). Where that entry point is missing or refuses the shapes, it raises
    ``NotImplementedError`` while tracing and the callers take the paged path. ``"xla"`` (any
    backend): ``jax.nn.dot_product_attention``, which takes one head size, so narrower values
    are zero-padded to the keys' width and the extra output columns dropped."""
    if implementation == "cudnn":
        return _cudnn_causal(q, k, v, softmax_scale)
    D, Dv = k.shape[-1], v.shape[-1]
    if Dv < D:
        v = jnp.pad(v, ((0, 0), (0, 0), (0, D - Dv)))
    o = jax.nn.dot_product_attention(q[None], k[None], v[None], scale=softmax_scale, is_causal=True,
                                     implementation=implementation)[0]
    return o[..., :Dv]


def _cudnn_causal(q, k, v, softmax_scale: float) -> jax.Array:
    """:func:`dense_causal_attention`'s cuDNN call. ``jax.nn.dot_product_attention`` asks values
    as wide as the keys; the cuDNN entry point it calls does not (padded, an 8k MLA prefill's
    attention did 1.2x the work; BENCHMARKS.md). That entry point is JAX's private API: a JAX
    without it, or whose entry point takes no ``scale`` and ``mask_type``, raises
    ``NotImplementedError`` (the paged path then runs), not an error of its own. The check is on
    the signature, so an error the call itself raises is not mistaken for a missing API."""
    try:
        from jax._src.cudnn import fused_attention_stablehlo as cudnn_fa
        call, causal = cudnn_fa.dot_product_attention, cudnn_fa.MaskType.CAUSAL
        params = inspect.signature(call).parameters
    except (ImportError, AttributeError) as e:
        raise NotImplementedError(f"JAX {jax.__version__} has no cuDNN attention entry point: {e}") from e
    if not {"scale", "mask_type"} <= params.keys():
        raise NotImplementedError(f"JAX {jax.__version__}'s cuDNN attention entry point takes no scale "
                                  f"and mask_type: {list(params)}")
    return call(q[None], k[None], v[None], scale=softmax_scale, mask_type=causal)[0]


def _dense_init(key, shape, dtype=jnp.float32):
    """Normal with std ``1/sqrt(fan_in)`` for a ``[fan_in, fan_out]`` matrix."""
    return jax.random.normal(key, shape, dtype) / jnp.sqrt(jnp.asarray(shape[0], dtype))


class AttentionLayer(nn.Module):
    """Pre-norm GQA attention block with RoPE; ``x + attn(norm(x))``.

    Params: ``norm [d]``, ``wq [d, Hq*D]``, ``wk``, ``wv [d, Hkv*D]``, ``wo [Hq*D, d]``.

    ``model_axis`` (tensor parallel, inside ``shard_map``): ``config`` gives this shard's
    heads, ``wq/wk/wv`` are column shards, ``wo`` a row shard; the output is summed
    over the axis.
    """

    config: TinyHybridConfig
    model_axis: str | None = None

    def setup(self):
        c = self.config
        d, Hq, Hkv, D = c.d_model, c.num_heads, c.num_kv_heads, c.head_dim
        self.norm = self.param("norm", nn.initializers.ones, (d,))
        self.wq = self.param("wq", _dense_init, (d, Hq * D))
        self.wk = self.param("wk", _dense_init, (d, Hkv * D))
        self.wv = self.param("wv", _dense_init, (d, Hkv * D))
        self.wo = self.param("wo", _dense_init, (Hq * D, d))

    def declare(self):
        """Creates the params (used by ``init``)."""

    def __call__(
        self,
        x: jax.Array,  # [T, d] float32
        ctx: StepContext,
        key_cache: jax.Array,
        value_cache: jax.Array | None,
        kv_cache_dtype: str,
        backend: str,
        kv_layout: str = "flash",
    ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
        """Write this step's K/V (pad slots write nothing), then attend. Returns ``(x, K, V)``.

        ``kv_layout="rpa"``: ``key_cache`` is the combined ``kv_pages`` of
        :func:`pallas_kernels.write_kv_pages` and ``value_cache`` is None (returned
        as None); attention is :func:`rpa_attention`.
        """
        c = self.config
        h = rms_norm(x, self.norm, c.rms_eps)
        spec = AttnSpec(c.num_heads, c.num_kv_heads, c.head_dim, c.rope_theta,
                        k_scale=c.k_scale, v_scale=c.v_scale)
        w = {"wq": self.wq, "wk": self.wk, "wv": self.wv, "wo": self.wo}
        out, key_cache, value_cache = attention_mixer(
            h, ctx, key_cache, value_cache, w, spec, kv_cache_dtype=kv_cache_dtype,
            backend=backend, kv_layout=kv_layout, model_axis=self.model_axis,
        )
        return x + jnp.where(ctx.token_real[:, None], out, 0.0), key_cache, value_cache


def rpa_attention(
    q: jax.Array,
    kv_pages: jax.Array,
    ctx: StepContext,
    *,
    backend: str,
    k_scale: float | None = None,
    v_scale: float | None = None,
) -> jax.Array:
    """Attention through the ragged-paged-attention layout, described by :func:`rpa_metadata`.

    :func:`pallas_kernels.ragged_paged_attention` with ``backend``: JAX's TPU kernel
    where it resolves to the TPU flavour, the jnp reference elsewhere. Rows of pad
    tokens are 0 (the caller masks them anyway).
    """
    page_size = kv_pages.shape[1]
    real_rows = ctx.prefill_row | ctx.decode_row
    m = rpa_metadata(
        ctx.query_start_loc, ctx.seq_lens, ctx.block_table, real_rows, page_size=page_size
    )
    sm_scale = 1.0 / float(np.sqrt(q.shape[-1]))
    return ragged_paged_attention(
        q, kv_pages, *m.as_args(), sm_scale=sm_scale, k_scale=k_scale, v_scale=v_scale,
        backend=backend,
    )
