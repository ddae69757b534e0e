"""Torch version of KV block zeroing, written the way a torch runner would.

Like vLLM's ``KVBlockZeroer``, it zeroes raw bytes: each cache is viewed as
``uint8`` and whole kernel blocks are filled with 0 (all bits zero, +0.0 for
floats). In place; the caches are also returned.
"""

from __future__ import annotations

import torch


def zero_blocks(
    caches: list[torch.Tensor],  # each [num_kernel_blocks, ...], contiguous
    block_ids: torch.Tensor,  # int [N] logical ids; < 0 = padding
    kernel_blocks_per_block: int = 1,
) -> list[torch.Tensor]:
    """Zero kernel blocks ``b*r .. b*r + r - 1`` of every cache for each id ``b >= 0``."""
    r = kernel_blocks_per_block
    ids = block_ids.long()
    ids = ids[ids >= 0]
    rows = (ids[:, None] * r + torch.arange(r)).reshape(-1)
    for cache in caches:
        cache.view(cache.shape[0], -1).view(torch.uint8).index_fill_(0, rows, 0)
    return caches
