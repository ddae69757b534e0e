"""Torch version of ``combine_sampled_and_draft_tokens``, written the way a torch runner would.

Same contract as :func:`pallas_kernels.token_combine.combine_sampled_and_draft_tokens`
(vLLM 0.33.0 model-runner-V2 semantics, padded rows marked by ``idx_mapping == -1``
write nothing). Like vLLM's op it updates ``input_ids`` in place; it returns
``(input_ids, logits_indices)`` with ``logits_indices`` int64 as in vLLM,
zero where no row writes (vLLM leaves those entries uninitialised). Rows are
expected to be well formed (see the kvjax docstring); nothing is validated here.
"""

from __future__ import annotations

import torch


def combine_sampled_and_draft_tokens(
    input_ids: torch.Tensor,  # int32 [T], updated in place
    idx_mapping: torch.Tensor,  # int [R]; -1 = padded row
    last_sampled_tokens: torch.Tensor,  # int [MR] or [MR, 1]
    query_start_loc: torch.Tensor,  # int [>= R + 1]
    seq_lens: torch.Tensor,  # int [>= R]
    prefill_len: torch.Tensor,  # int [MR]
    draft_tokens: torch.Tensor,  # int [MR, S]
    cu_num_logits: torch.Tensor,  # int [>= R + 1]
    num_logits: int,
    num_new_sampled_tokens: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fill decode windows ``[last_sampled, drafts...]`` and compute the logits rows."""
    if num_new_sampled_tokens not in (0, 1):
        raise ValueError(f"num_new_sampled_tokens must be 0 or 1, got {num_new_sampled_tokens}")
    last = last_sampled_tokens.reshape(-1)
    logits_indices = torch.zeros(num_logits, dtype=torch.int64, device=input_ids.device)
    for b, s in enumerate(idx_mapping.tolist()):
        if s < 0:
            continue  # padded row
        start_logit, end_logit = int(cu_num_logits[b]), int(cu_num_logits[b + 1])
        num_logits_b = end_logit - start_logit
        num_drafts = num_logits_b - num_new_sampled_tokens
        query_end = int(query_start_loc[b + 1])
        first = query_end - num_logits_b
        logits_indices[start_logit:end_logit] = torch.arange(
            first, query_end, dtype=torch.int64, device=input_ids.device
        )
        seq_len, prefill = int(seq_lens[b]), int(prefill_len[s])
        if seq_len <= prefill:
            continue  # prefill chunk: the prompt ids stay
        if num_new_sampled_tokens == 1 and seq_len - num_logits_b >= prefill:
            input_ids[first] = last[s].to(input_ids.dtype)
        if num_drafts > 0:
            input_ids[query_end - num_drafts : query_end] = draft_tokens[s, :num_drafts].to(
                input_ids.dtype
            )
    return input_ids, logits_indices
