"""Interop with other serving stacks' cache layouts and step metadata.

* :mod:`kvjax.interop.rpa`: JAX's ``ragged_paged_attention`` (the KV write into
  its layout is :func:`pallas_kernels.write_kv_pages`); ``null_block_id=None``
  for engines without a null page.
* :mod:`kvjax.interop.tpu_inference`: tpu-inference's slice-encoded KV update
  (``kv_cache_start, new_kv_start, slice_len``) as a slot mapping.
"""

from kvjax.interop.rpa import (
    RPAMetadata as RPAMetadata,
    rpa_metadata as rpa_metadata,
    rpa_metadata_from_batch as rpa_metadata_from_batch,
    rpa_positions as rpa_positions,
    rpa_slot_mapping as rpa_slot_mapping,
)
from kvjax.interop.tpu_inference import (
    kv_cache_update as kv_cache_update,
    slices_to_slot_mapping as slices_to_slot_mapping,
)

__all__ = [
    "RPAMetadata",
    "kv_cache_update",
    "rpa_metadata",
    "rpa_metadata_from_batch",
    "rpa_positions",
    "rpa_slot_mapping",
    "slices_to_slot_mapping",
]
