"""kvjax: LLM model-runner state in JAX that cannot silently corrupt the KV cache.

Public names (see README.md): the sentinels, the state pytrees and their pure
update functions, the host block pool, and the invariant checks. Kernels live
in the sibling package ``pallas_kernels``.
"""

from kvjax.constants import NULL_BLOCK_ID as NULL_BLOCK_ID, PAD_SLOT_ID as PAD_SLOT_ID
from kvjax.spec import KVGroupSpec as KVGroupSpec, cdiv as cdiv
from kvjax.host.block_pool import BlockPool as BlockPool, OutOfBlocksError as OutOfBlocksError
from kvjax.state import *  # noqa: F401,F403

__version__ = "0.1.0"
