"""Pallas kernels for the KV cache and recurrent state, each with a jnp reference.

Public API (argument names, order and sentinels mirror vLLM 0.33; every op returns
the updated arrays — donate them at the enclosing ``jit`` to update in place):

==================================  =====================================================
``reshape_and_cache_flash``         paged K/V write; a slot < 0 writes nothing
``concat_and_cache_mla``            MLA latent + rope write, same slot and fp8 rules
``zero_blocks``                     zero whole KV blocks / state slots, all arrays at once
``selective_state_update``          Mamba SSM decode step (incl. speculative windows)
``causal_conv1d_update``            Mamba conv decode step
``selective_scan_varlen``           Mamba2 prefill scan over a packed batch
``causal_conv1d_varlen``            conv prefill over a packed batch
``combine_sampled_and_draft_tokens`` decode windows ``[last_sampled, drafts...]``
``write_kv_pages``                  K/V write into JAX's ragged-paged-attention layout
``ragged_paged_attention``          attention over that layout (JAX's TPU kernel / jnp)
``paged_attention``                 attention over a paged cache, live blocks only
``grouped_matmul``                  row tiles times their group's matrix (MoE experts)
``moe_route``                       router product and each token's top-k experts (MoE)
==================================  =====================================================

Every op takes ``backend=`` (``"auto"``, ``"reference"``, ``"pallas"``,
``"pallas_tpu"``, ``"pallas_gpu"``, ``"mosaic_gpu"``: the KV write and block zeroing
only, :mod:`pallas_kernels.kv_mosaic_gpu`) and ``interpret=``, resolved in one place
(:mod:`pallas_kernels.backend`); ops with GPU/TPU tuning knobs take a frozen
``config=`` (``KVWriteConfig``, ``ZeroBlocksConfig``, ``SSUConfig``, ``ConvConfig``).
Sentinels and argument checks: :mod:`pallas_kernels.contract`; pieces several kernels
share: :mod:`pallas_kernels.fp8` (quantisation), :mod:`pallas_kernels.segments` (what a
KV write copies where), :mod:`pallas_kernels.gpu_tiling` (GPU launch rules). Which TPU the
Mosaic kernels are lowered for (also from a CPU/GPU host, e.g. ``jax.export``):
:mod:`pallas_kernels.tpu_target`. This package imports
nothing from ``kvjax``.
"""

from pallas_kernels.contract import NULL_BLOCK_ID as NULL_BLOCK_ID, PAD_SLOT_ID as PAD_SLOT_ID
from pallas_kernels.block_zero import (
    ZeroBlocksConfig as ZeroBlocksConfig,
    zero_blocks as zero_blocks,
)
from pallas_kernels.kv_write import (
    KVWriteConfig as KVWriteConfig,
    concat_and_cache_mla as concat_and_cache_mla,
    reshape_and_cache_flash as reshape_and_cache_flash,
)
from pallas_kernels.kv_pages import write_kv_pages as write_kv_pages
from pallas_kernels.rpa import ragged_paged_attention as ragged_paged_attention
from pallas_kernels.grouped_matmul import (
    GroupedMatmulConfig as GroupedMatmulConfig,
    group_tiles as group_tiles,
    grouped_matmul as grouped_matmul,
)
from pallas_kernels.moe_route import MoERouteConfig as MoERouteConfig, moe_route as moe_route
from pallas_kernels.paged_attention import (
    PagedAttentionConfig as PagedAttentionConfig,
    paged_attention as paged_attention,
)
from pallas_kernels import kv_mosaic_gpu as kv_mosaic_gpu  # registers the "mosaic_gpu" flavour
from pallas_kernels.mamba import (
    ConvConfig as ConvConfig,
    SSUConfig as SSUConfig,
    causal_conv1d_update as causal_conv1d_update,
    causal_conv1d_varlen as causal_conv1d_varlen,
    selective_scan_varlen as selective_scan_varlen,
    selective_state_update as selective_state_update,
)
from pallas_kernels.token_combine import (
    combine_sampled_and_draft_tokens as combine_sampled_and_draft_tokens,
)

__all__ = [
    "ConvConfig",
    "GroupedMatmulConfig",
    "KVWriteConfig",
    "MoERouteConfig",
    "NULL_BLOCK_ID",
    "PAD_SLOT_ID",
    "PagedAttentionConfig",
    "SSUConfig",
    "ZeroBlocksConfig",
    "causal_conv1d_update",
    "causal_conv1d_varlen",
    "combine_sampled_and_draft_tokens",
    "concat_and_cache_mla",
    "group_tiles",
    "grouped_matmul",
    "moe_route",
    "paged_attention",
    "ragged_paged_attention",
    "reshape_and_cache_flash",
    "selective_scan_varlen",
    "selective_state_update",
    "write_kv_pages",
    "zero_blocks",
]
