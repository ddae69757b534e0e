"""Torch versions of the paged KV writes, written the way a torch runner would.

In place like vLLM's ops (the caches are mutated), and the caches are also
returned for convenience. fp8 caches are ``torch.float8_e4m3fn``; since CPU
``index_copy_`` has no fp8 kernel, fp8 rows are copied through a ``uint8``
view of the cache, the way vLLM stores fp8 KV as bytes.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``clamp(x / scale, -448, 448)`` in float32, cast to float8_e4m3fn (NaN stays NaN)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def _store_rows(flat_cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    if flat_cache.dtype == torch.float8_e4m3fn:
        flat_cache.view(torch.uint8).index_copy_(0, slots, rows.view(torch.uint8))
    else:
        flat_cache.index_copy_(0, slots, rows.to(flat_cache.dtype))


def _valid_tokens(slot_mapping: torch.Tensor):
    """(token indices, slots) of the tokens whose slot is >= 0."""
    slots = slot_mapping.long()
    keep = slots >= 0
    return torch.nonzero(keep).squeeze(1), slots[keep]


def reshape_and_cache_flash(
    key: torch.Tensor,  # [T, H, D]
    value: torch.Tensor,  # [T, H, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, H, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, H, D]
    slot_mapping: torch.Tensor,  # int32 | int64 [N], N <= T; < 0 = skip
    kv_cache_dtype: str = "auto",
    k_scale: torch.Tensor | None = None,  # float32 [1] or [H]
    v_scale: torch.Tensor | None = None,
):
    """``cache.view(-1, H, D)[slot] = key[t]`` for the first N tokens with slot >= 0."""
    num_heads, head_size = key.shape[1:]
    tokens, slots = _valid_tokens(slot_mapping)
    for x, cache, scale in ((key, key_cache, k_scale), (value, value_cache, v_scale)):
        rows = x[tokens]
        if kv_cache_dtype in ("fp8", "fp8_e4m3"):
            rows = quantize_fp8(rows, scale.float().reshape(1, -1, 1))
        _store_rows(cache.view(-1, num_heads, head_size), slots, rows)
    return key_cache, value_cache


def concat_and_cache_mla(
    kv_c: torch.Tensor,  # [T, L]
    k_pe: torch.Tensor,  # [T, R]
    kv_cache: torch.Tensor,  # [num_blocks, block_size, L + R]
    slot_mapping: torch.Tensor,  # int32 | int64 [N], N <= T; < 0 = skip
    kv_cache_dtype: str = "auto",
    scale: torch.Tensor | None = None,  # float32 [1]
):
    """``kv_cache.view(-1, L + R)[slot] = cat(kv_c[t], k_pe[t])`` for slots >= 0."""
    tokens, slots = _valid_tokens(slot_mapping)
    rows = torch.cat([kv_c[tokens], k_pe[tokens]], dim=-1)
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        rows = quantize_fp8(rows, scale.float().reshape(-1))
    _store_rows(kv_cache.view(-1, kv_cache.shape[-1]), slots, rows)
    return kv_cache
