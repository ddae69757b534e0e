"""Interop with other serving stacks' cache layouts and step metadata.

* :mod:`kvjax.interop.rpa`: JAX's ``ragged_paged_attention`` (the KV write into
  its layout is :func:`pallas_kernels.write_kv_pages`).
"""

from kvjax.interop.rpa import (
    RPAMetadata as RPAMetadata,
    rpa_metadata as rpa_metadata,
    rpa_metadata_from_batch as rpa_metadata_from_batch,
    rpa_positions as rpa_positions,
    rpa_slot_mapping as rpa_slot_mapping,
)

__all__ = [
    "RPAMetadata",
    "rpa_metadata",
    "rpa_metadata_from_batch",
    "rpa_positions",
    "rpa_slot_mapping",
]
