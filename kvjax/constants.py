"""The runner's sentinels (defined once, in :mod:`pallas_kernels.contract`).

* ``PAD_SLOT_ID = -1``: slot mappings only; a PAD slot writes nothing.
* ``PAD_ROW_ID = -1``: ``idx_mapping`` only; the batch row is padding.
* ``NULL_BLOCK_ID = 0``: block tables and state indices only; block 0 is reserved.
"""

from pallas_kernels.contract import (
    NULL_BLOCK_ID as NULL_BLOCK_ID,
    PAD_ROW_ID as PAD_ROW_ID,
    PAD_SLOT_ID as PAD_SLOT_ID,
)

__all__ = ["NULL_BLOCK_ID", "PAD_ROW_ID", "PAD_SLOT_ID"]
