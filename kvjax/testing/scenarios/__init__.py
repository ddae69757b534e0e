"""Named, seeded scenarios for differential testing of every kvjax op.

A :class:`Scenario` is a name, the op it drives, a function ``seed -> inputs``
(numpy arrays and plain Python options, named as the kvjax function's
arguments) and metadata: how each output is compared (:class:`Compare`:
bitwise, exact integers, or a float tolerance with its source) and which
adversarial rule it exercises. :func:`scenarios` lists them;
:mod:`kvjax.testing.difftest` runs them through kvjax and the torch / vLLM
implementations.

One module per op family, each with its shapes, input builders and scenario
lists: :mod:`~kvjax.testing.scenarios.kv_write`,
:mod:`~kvjax.testing.scenarios.block_zero`, :mod:`~kvjax.testing.scenarios.mamba`,
:mod:`~kvjax.testing.scenarios.token_combine`, :mod:`~kvjax.testing.scenarios.state`;
what they share (dtypes, sentinels, :class:`Compare` and its tolerances,
poisoned inputs) is :mod:`~kvjax.testing.scenarios.common`.

Every op has ``random-<i>`` cases (``cases`` of them) plus fixed adversarial
ones, each after a vLLM bug class or a rule a port must enforce:

===============================  ================================================
adversarial scenario             what it catches
===============================  ================================================
``all-pad-dummy-step``           a dummy step must write nothing (PR 39444)
``pad-inside-and-tail``          PAD slots / padded rows between and after real ones
``n-lt-t``                       slot mapping shorter than the (padded) inputs
``null-block-nan``               the null block is NaN and must stay untouched
``last-block``                   ids at the very end of the cache / table / pool
``kernel-blocks-per-block-<r>``  logical -> kernel block expansion (``b*r .. b*r+r-1``)
``fp8-saturation``               +-448, beyond, +-inf, NaN, ties, subnormals
``fp8-per-head-scales``          ``[H]`` scales
``fp8-exact-quotients``          quotients that are fp8 values (vLLM bitwise)
``null-mamba-rows``              null state indices: no read, no write
``null-dst``                     a null destination with a valid source
``speculative-mamba-rows``       per-token dst columns, ``num_accepted_tokens`` offsets
``spec-decode-0..k-drafts``      sequences of 1..k+1 tokens, num_accepted 0..k
``decode-0..k-drafts``           decode windows with 0..k drafts (combine, post_update)
``reused-row-fresh-start``       a NaN-poisoned reused state row, fresh request
``chunked-prefill-gap``          real tokens, then padding (NaN / stale positions) to T
``prompt-tail-straddling``       a decode window that starts inside the prompt
``reused-row-*``                 add_request on a row with a previous tenant (PR 39833)
===============================  ================================================

Shapes are small and fixed per op (and per variant), so that a kernel
compiles a handful of times per run even in interpret mode.
"""

from __future__ import annotations

from kvjax.testing.scenarios.block_zero import ZERO_NKB, zero_scenarios
from kvjax.testing.scenarios.common import (
    BF16, BITWISE, DEAD_TOKEN, EXACT, F16, F32, FP8, NULL, PAD, POISON_BITS, SCAN_BF16, SCAN_F32,
    SSM_BF16, SSM_F32, Compare, Scenario, scenario_seed,
)
from kvjax.testing.scenarios.kv_write import FLASH, MLA, flash_scenarios, mla_scenarios
from kvjax.testing.scenarios.mamba import (
    CONV, SCAN, SSU, conv_scenarios, conv_varlen_scenarios, scan_varlen_scenarios, ssu_scenarios,
)
from kvjax.testing.scenarios.state import (
    GATHER, REQSTATE, REQSTATE_FIELDS, SLOTMAP, gather_scenarios, reqstate_scenarios,
    slotmap_scenarios,
)
from kvjax.testing.scenarios.token_combine import COMBINE, combine_scenarios

__all__ = [
    "BITWISE",
    "DEAD_TOKEN",
    "POISON_BITS",
    "Compare",
    "EXACT",
    "OPS",
    "SCAN_BF16",
    "SCAN_F32",
    "SSM_BF16",
    "SSM_F32",
    "Scenario",
    "scenario_seed",
    "scenarios",
]
# Also importable from here, as before the split: the dtypes (FP8, BF16, F32, F16), the
# sentinels (NULL, PAD), each op's shapes (FLASH, MLA, ZERO_NKB, SSU, CONV, SCAN, COMBINE,
# SLOTMAP, GATHER, REQSTATE) and REQSTATE_FIELDS.

_BUILDERS = {
    "reshape_and_cache_flash": flash_scenarios,
    "concat_and_cache_mla": mla_scenarios,
    "zero_blocks": zero_scenarios,
    "selective_state_update": ssu_scenarios,
    "causal_conv1d_update": conv_scenarios,
    "selective_scan_varlen": scan_varlen_scenarios,
    "causal_conv1d_varlen": conv_varlen_scenarios,
    "combine_sampled_and_draft_tokens": combine_scenarios,
    "compute_slot_mapping": slotmap_scenarios,
    "gather_block_tables": gather_scenarios,
    "request_state": reqstate_scenarios,
}
#: Every op with scenarios, kernels first, then the state functions.
OPS = tuple(_BUILDERS)


def scenarios(ops=None, cases: int = 4) -> list[Scenario]:
    """The scenarios of ``ops`` (default: all of :data:`OPS`, in that order): ``cases`` random
    ones per op, then the adversarial ones.

    Raises:
      ValueError: an unknown op name, or a negative ``cases``.
    """
    if isinstance(ops, str):
        ops = [ops]
    ops = list(OPS) if ops is None else list(ops)
    unknown = [o for o in ops if o not in _BUILDERS]
    if unknown:
        raise ValueError(f"unknown op(s) {unknown}; ops are {list(OPS)}")
    if isinstance(cases, bool) or not isinstance(cases, int) or cases < 0:
        raise ValueError(f"cases must be an int >= 0, got {cases!r}")
    return [s for op in OPS if op in ops for s in _BUILDERS[op](cases)]
