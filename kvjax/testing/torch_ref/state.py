"""Torch versions of kvjax's runner-state functions, written the way a torch runner would.

Plain loops over batch rows on CPU tensors, after vLLM 0.33.0's model runner V2
(``vllm/v1/worker/gpu/block_table.py``, ``gpu/states.py``, ``gpu/input_batch.py``)
with kvjax's rules where kvjax is stricter than vLLM (each difference is noted
where it applies):

* :func:`compute_slot_mapping`: ``slot = table[row, pos // bs] * bs + pos % bs``;
  ``PAD_SLOT_ID`` for padded rows and from the real token count to the end. A
  real token whose block is ``NULL_BLOCK_ID`` (or past the row) also gets PAD
  (vLLM would write into the null block; kvjax never does). int64, as vLLM's.
* :func:`append_block_ids` / :func:`gather_block_tables`: a write leaves the
  row ``NULL_BLOCK_ID`` past its new live length (vLLM leaves the previous
  tenant's ids there); a gathered row is the live prefix, NULL after it, all
  NULL for a padded batch row; with a sliding window the leading blocks that
  no query of the step can see are NULL too.
* :class:`TorchRequestState`: ``add_request`` rewrites every per-row field read
  before the row's first write (PR 39833: ``last_sampled`` and ``draft_tokens``;
  kvjax also zeroes the token-id tail and resets ``num_accepted_tokens`` to 1 and
  the sampling parameters), ``post_update`` applies the sampled tokens
  (``get_num_sampled_and_rejected`` + ``post_update``; a sample past
  ``max_model_len`` is dropped and not counted in ``total_len`` or
  ``last_sampled``, where vLLM's kernel would write past the row).
"""

from __future__ import annotations

import dataclasses

import torch

PAD_SLOT_ID = -1
NULL_BLOCK_ID = 0

__all__ = [
    "TorchRequestState",
    "append_block_ids",
    "compute_slot_mapping",
    "gather_block_tables",
]


# --------------------------------------------------------------------------
# slot mapping
# --------------------------------------------------------------------------


def compute_slot_mapping(
    block_table: torch.Tensor,  # int [max_num_reqs, width], kernel-block ids
    idx_mapping: torch.Tensor,  # int [R]; -1 = padded batch row
    query_start_loc: torch.Tensor,  # int [R + 1]
    positions: torch.Tensor,  # int [>= query_start_loc[R]]
    block_size: int,  # kernel block size
    num_tokens_padded: int,
) -> torch.Tensor:
    """Flat KV slot of each token of the step, int64 ``[num_tokens_padded]``."""
    width = block_table.shape[1]
    slots = torch.full((num_tokens_padded,), PAD_SLOT_ID, dtype=torch.int64)
    qsl = query_start_loc.tolist()
    for b, row in enumerate(idx_mapping.tolist()):
        if row < 0:
            continue  # padded batch row: its tokens stay PAD
        start, end = qsl[b], qsl[b + 1]
        pos = positions[start:end].long()
        col = pos // block_size
        inside = (pos >= 0) & (col < width)
        blk = block_table[row].long()[col.clamp(0, width - 1)]
        ok = inside & (blk > NULL_BLOCK_ID)
        slots[start:end] = torch.where(ok, blk * block_size + pos % block_size, PAD_SLOT_ID)
    return slots


# --------------------------------------------------------------------------
# block tables
# --------------------------------------------------------------------------


def append_block_ids(
    tables: torch.Tensor,  # int32 [max_num_reqs, width], updated in place
    num_blocks: torch.Tensor,  # int32 [max_num_reqs] live kernel blocks, updated in place
    row: int,
    block_ids: list[int],  # logical block ids
    overwrite: bool,
    blocks_per_kv_block: int = 1,
) -> None:
    """Append (``overwrite``: replace) a row's logical block ids, expanded to kernel blocks."""
    r = blocks_per_kv_block
    start = 0 if overwrite else int(num_blocks[row])
    ids = [b * r + k for b in block_ids for k in range(r)]
    end = start + len(ids)
    if ids:
        tables[row, start:end] = torch.tensor(ids, dtype=tables.dtype)
    tables[row, end:] = NULL_BLOCK_ID  # kvjax: nothing stale past the live length
    num_blocks[row] = end


def gather_block_tables(
    tables: torch.Tensor,  # int32 [max_num_reqs, width]
    num_blocks: torch.Tensor,  # int32 [max_num_reqs]
    idx_mapping: torch.Tensor,  # int [R]; -1 = padded batch row
    first_positions: torch.Tensor | None = None,  # int [R]
    sliding_window: int | None = None,
    kernel_block_size: int | None = None,
) -> torch.Tensor:
    """The batch's block tables ``[R, width]``: live prefix of each row, NULL elsewhere."""
    width = tables.shape[1]
    out = torch.full((idx_mapping.shape[0], width), NULL_BLOCK_ID, dtype=tables.dtype)
    cols = torch.arange(width)
    for b, row in enumerate(idx_mapping.tolist()):
        if row < 0:
            continue
        keep = cols < int(num_blocks[row])
        if sliding_window is not None and first_positions is not None:
            first_visible = int(first_positions[b]) - sliding_window + 1
            keep &= (cols + 1) * kernel_block_size - 1 >= first_visible
        out[b] = torch.where(keep, tables[row], NULL_BLOCK_ID)
    return out


# --------------------------------------------------------------------------
# request state
# --------------------------------------------------------------------------


@dataclasses.dataclass
class TorchRequestState:
    """Per-row request tensors (the fields of :class:`kvjax.state.RequestState`)."""

    prompt_len: torch.Tensor  # int32 [R]
    prefill_len: torch.Tensor
    total_len: torch.Tensor
    num_computed_tokens: torch.Tensor
    all_token_ids: torch.Tensor  # int32 [R, max_model_len]
    last_sampled_tokens: torch.Tensor
    draft_tokens: torch.Tensor  # int32 [R, num_speculative_tokens]
    num_accepted_tokens: torch.Tensor
    temperature: torch.Tensor  # float32 [R]
    top_p: torch.Tensor
    top_k: torch.Tensor
    seed: torch.Tensor  # int32 [R]

    FIELDS = (
        "prompt_len", "prefill_len", "total_len", "num_computed_tokens", "all_token_ids",
        "last_sampled_tokens", "draft_tokens", "num_accepted_tokens", "temperature", "top_p",
        "top_k", "seed",
    )

    def add_request(self, row: int, token_ids: list[int], prompt_len: int,
                    num_computed_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                    top_k: int = 0, seed: int = 0) -> None:
        """Install a request into ``row`` (in place), rewriting everything read before its first write."""
        n = len(token_ids)
        self.prompt_len[row] = prompt_len
        self.prefill_len[row] = n
        self.total_len[row] = n
        self.all_token_ids[row] = 0  # kvjax: no stale tail (vLLM leaves it)
        self.all_token_ids[row, :n] = torch.tensor(token_ids, dtype=self.all_token_ids.dtype)
        self.num_computed_tokens[row] = num_computed_tokens
        if 0 < num_computed_tokens <= n:  # PR 39833
            self.last_sampled_tokens[row] = token_ids[num_computed_tokens - 1]
        else:
            self.last_sampled_tokens[row] = 0  # kvjax: 0, never the previous tenant's
        self.draft_tokens[row] = 0
        self.num_accepted_tokens[row] = 1
        self.temperature[row] = temperature
        self.top_p[row] = top_p
        self.top_k[row] = top_k
        self.seed[row] = seed

    def post_update(self, idx_mapping: torch.Tensor, query_lens: torch.Tensor,
                    sampled: torch.Tensor, num_sampled: torch.Tensor) -> None:
        """Apply one step's sampled tokens (in place); ``idx_mapping == -1`` rows are skipped."""
        max_len = self.all_token_ids.shape[1]
        for b, s in enumerate(idx_mapping.tolist()):
            if s < 0:
                continue
            qlen = int(query_lens[b])
            nc, pl, tl = (int(self.num_computed_tokens[s]), int(self.prefill_len[s]),
                          int(self.total_len[s]))
            if nc + qlen < pl:  # mid-prefill chunk: nothing sampled, nothing rejected
                n, rejected = 0, 0
            else:
                n = int(num_sampled[b])
                num_drafts = max(qlen - 1, 0) if nc >= pl else 0
                rejected = 1 + num_drafts - n
            stored = min(n, max(max_len - tl, 0))  # kvjax: a row holds max_model_len tokens
            for j in range(stored):
                self.all_token_ids[s, tl + j] = sampled[b, j]
            self.total_len[s] = tl + stored
            self.num_computed_tokens[s] = nc + qlen - rejected
            if stored > 0:
                self.last_sampled_tokens[s] = sampled[b, stored - 1]
            self.num_accepted_tokens[s] = max(n, 1)
