"""Torch implementations of the kvjax ops (what a torch runner would write), for differential tests.

One module per kvjax area; each function takes torch tensors with kvjax's
argument names, updates the caches / states in place as vLLM does, and
returns them too:

* :mod:`~kvjax.testing.torch_ref.kv_write`: ``reshape_and_cache_flash``, ``concat_and_cache_mla``;
* :mod:`~kvjax.testing.torch_ref.block_zero`: ``zero_blocks``;
* :mod:`~kvjax.testing.torch_ref.mamba`: ``selective_state_update``, ``causal_conv1d_update``,
  ``selective_scan_varlen``, ``causal_conv1d_varlen``;
* :mod:`~kvjax.testing.torch_ref.token_combine`: ``combine_sampled_and_draft_tokens``;
* :mod:`~kvjax.testing.torch_ref.state`: ``compute_slot_mapping``, ``append_block_ids``,
  ``gather_block_tables``, ``TorchRequestState`` (``add_request`` / ``post_update``).
"""

from kvjax.testing.torch_ref import block_zero, kv_write, mamba, state, token_combine
from kvjax.testing.torch_ref.block_zero import zero_blocks
from kvjax.testing.torch_ref.kv_write import concat_and_cache_mla, reshape_and_cache_flash
from kvjax.testing.torch_ref.mamba import (
    causal_conv1d_update,
    causal_conv1d_varlen,
    selective_scan_varlen,
    selective_state_update,
)
from kvjax.testing.torch_ref.state import (
    TorchRequestState,
    append_block_ids,
    compute_slot_mapping,
    gather_block_tables,
)
from kvjax.testing.torch_ref.token_combine import combine_sampled_and_draft_tokens

__all__ = [
    "TorchRequestState",
    "append_block_ids",
    "block_zero",
    "causal_conv1d_update",
    "causal_conv1d_varlen",
    "combine_sampled_and_draft_tokens",
    "compute_slot_mapping",
    "concat_and_cache_mla",
    "gather_block_tables",
    "kv_write",
    "mamba",
    "reshape_and_cache_flash",
    "selective_scan_varlen",
    "selective_state_update",
    "state",
    "token_combine",
    "zero_blocks",
]
