"""Sentinels shared by every piece of runner state.

The two sentinels have different jobs and must never be mixed (vLLM PR 35431):

* ``PAD_SLOT_ID = -1`` appears only in slot mappings (token -> flat KV slot).
  A KV write whose slot is ``PAD_SLOT_ID`` (or any negative value) writes
  nothing at all.
* ``NULL_BLOCK_ID = 0`` appears only in block tables and recurrent-state
  indices. Physical block 0 of every cache (and recurrent slot 0 of every state
  pool) is reserved: it is never allocated, and its contents are never trusted.
"""

PAD_SLOT_ID: int = -1
NULL_BLOCK_ID: int = 0
