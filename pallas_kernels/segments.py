"""What a KV write copies where: one description shared by every write op and flavour.

A write op (``reshape_and_cache_flash``, ``concat_and_cache_mla``, ``write_kv_pages``)
is a tuple of :class:`Segment`\\ s: token ``t`` copies row ``t`` of source ``src`` into
slot ``slot_mapping[t]`` of cache ``dst``, starting at column ``col`` of the cache's
last axis. Every implementation (the reference scatter in
:func:`pallas_kernels.kv_write.reference_write`, the TPU, GPU and Mosaic GPU kernels)
reads the same tuple; it is a static argument of the kernel call, so it is hashable.
"""

from __future__ import annotations

import dataclasses

__all__ = ["FLASH_SEGMENTS", "ONE_ROW", "Segment", "mla_segments"]


@dataclasses.dataclass(frozen=True)
class Segment:
    """Copy row ``t`` of source ``src`` into slot ``slot_mapping[t]`` of cache ``dst``.

    ``col`` is the first column of the cache's last axis that the row fills
    (``None``: the source row is the whole cache row).
    """

    src: int
    dst: int
    col: int | None = None


# reshape_and_cache_flash: key -> key_cache, value -> value_cache, whole rows.
FLASH_SEGMENTS = (Segment(0, 0), Segment(1, 1))
# One source row is one whole cache row (write_kv_pages' interleaved K/V row).
ONE_ROW = (Segment(0, 0),)


def mla_segments(kv_lora_rank: int) -> tuple[Segment, ...]:
    """concat_and_cache_mla: ``kv_c`` at columns ``[0, L)``, ``k_pe`` from ``L`` on, one cache."""
    return (Segment(0, 0, 0), Segment(1, 0, kv_lora_rank))
