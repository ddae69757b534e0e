"""Runner state pytrees and the pure functions that update them."""

from kvjax.state.block_tables import (
    BlockTables as BlockTables,
    block_id_limit as block_id_limit,
    compute_slot_mapping as compute_slot_mapping,
    dummy_block_tables as dummy_block_tables,
    dummy_slot_mappings as dummy_slot_mappings,
    expand_to_kernel_blocks as expand_to_kernel_blocks,
)
from kvjax.state.padding import (
    PAD_ROW_ID as PAD_ROW_ID,
    gather_index as gather_index,
    is_real_row as is_real_row,
    is_real_slot as is_real_slot,
    scatter_index as scatter_index,
    token_rows as token_rows,
)
from kvjax.state.request_state import (
    NewRequests as NewRequests,
    RequestRows as RequestRows,
    RequestState as RequestState,
    step_progress as step_progress,
)
from kvjax.state.step_batch import (
    ScheduledBatch as ScheduledBatch,
    StepBatch as StepBatch,
    build_step_batch as build_step_batch,
    dummy_step_batch as dummy_step_batch,
    validate_schedule as validate_schedule,
)
from kvjax.state.invariants import (
    assert_block_tables as assert_block_tables,
    assert_step_batch as assert_step_batch,
    block_table_violations as block_table_violations,
    checkify_slot_mapping_inputs as checkify_slot_mapping_inputs,
    checkify_step_batch as checkify_step_batch,
    free_rows_are_empty as free_rows_are_empty,
    step_batch_violations as step_batch_violations,
)

__all__ = [
    "BlockTables",
    "block_id_limit",
    "compute_slot_mapping",
    "dummy_block_tables",
    "dummy_slot_mappings",
    "expand_to_kernel_blocks",
    "PAD_ROW_ID",
    "gather_index",
    "is_real_row",
    "is_real_slot",
    "scatter_index",
    "token_rows",
    "NewRequests",
    "RequestRows",
    "RequestState",
    "step_progress",
    "ScheduledBatch",
    "StepBatch",
    "build_step_batch",
    "dummy_step_batch",
    "validate_schedule",
    "assert_block_tables",
    "assert_step_batch",
    "block_table_violations",
    "checkify_slot_mapping_inputs",
    "checkify_step_batch",
    "free_rows_are_empty",
    "step_batch_violations",
]
