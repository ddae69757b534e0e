"""What every scenario module shares: dtypes and sentinels, :class:`Compare` and its
tolerances, :class:`Scenario`, seeds, and the random / poisoned input helpers."""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable, Mapping

import ml_dtypes
import numpy as np

from kvjax.constants import NULL_BLOCK_ID, PAD_SLOT_ID

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
F16 = np.dtype(np.float16)
NULL = NULL_BLOCK_ID
PAD = PAD_SLOT_ID


@dataclasses.dataclass(frozen=True)
class Compare:
    """How one output array is compared.

    Attributes:
      kind: ``"bitwise"`` (same dtype, same bytes: copies and fp8 casts),
        ``"exact"`` (integer values equal; int32 and int64 may meet), or
        ``"close"`` (floats: ``|got - want| <= atol + rtol * |want|``, NaN
        positions equal; bitwise-equal elements always pass).
      rtol, atol: the tolerance of ``"close"``.
      source: where the rule or the tolerance comes from (printed in reports).
    """

    kind: str
    rtol: float = 0.0
    atol: float = 0.0
    source: str = ""

    def describe(self) -> str:
        if self.kind == "close":
            return f"close(rtol={self.rtol:g}, atol={self.atol:g})"
        return self.kind


BITWISE = Compare("bitwise", source="a copy or an fp8 cast: every byte must match")
EXACT = Compare("exact", source="integers: every value must match")
# Float tolerances; how much of each a measured run used is in BENCHMARKS.md ("Design notes:
# difftest tolerances").
#
# SSM / conv decode math in float32: the torch reference (F.softplus, torch.exp,
# einsum), kvjax's jnp / Pallas kernels and vLLM's Triton kernel (exp via exp2)
# evaluate one float32 formula in different orders: a few float32 ulps times the
# dstate reduction (N = 8 here). 2e-5 is tests/kernels/test_vllm_oracle.py's F32_TOL and
# 15x-50x tighter than vLLM's own tests/kernels/mamba/test_mamba_ssm.py (3e-4 / 1e-3).
SSM_F32 = Compare("close", 2e-5, 2e-5, source=(
    "float32 SSM/conv math in another order (exp vs exp2, reduction order); "
    "tests/kernels/test_vllm_oracle.py F32_TOL; vLLM's own test uses rtol 3e-4, atol 1e-3"))
# bfloat16 outputs: every side computes in float32 and rounds once to bfloat16 (2^-8
# relative spacing); a float32 difference next to a rounding boundary flips one bf16
# ulp, so a few ulps are allowed. vLLM's own bf16 tolerance is 1e-2 / 5e-2.
SSM_BF16 = Compare("close", 2e-2, 2e-2, source=(
    "float32 math rounded once to bfloat16 (ulp 2^-8 relative): a few bf16 ulps; "
    "tests/kernels/test_vllm_oracle.py BF16_TOL; vLLM's own test uses rtol 1e-2, atol 5e-2"))
# The prefill scan: off the reference backend kvjax runs the chunked SSD form (exp of
# segment sums, [Q, Q] matrix products) against the token-by-token recurrence of the
# torch reference, a different float32 evaluation whose error grows with the chunk.
SCAN_F32 = Compare("close", 5e-5, 5e-5, source=(
    "float32: the chunked SSD form vs the token recurrence; "
    "tests/kernels/test_mamba.py uses 1e-5 relative to the output scale"))
SCAN_BF16 = Compare("close", 3e-2, 3e-2, source=(
    "bfloat16 inputs and outputs, float32 math (as SSM_BF16, plus the scan's longer "
    "recurrence); vLLM's own test_selective_scan uses rtol 3e-2, atol 5e-2 for bf16"))


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One named, seeded case of one op.

    Attributes:
      op: the op name (one of :data:`OPS`).
      name: ``random-<i>`` or an adversarial name (module docstring).
      make: ``seed -> inputs``: kvjax's argument names -> numpy arrays or options.
      compare: output name -> :class:`Compare` (``"*"``: every other output).
      description: what the case sets up and what must hold.
      adversarial: False for the ``random-<i>`` cases.
    """

    op: str
    name: str
    make: Callable[[int], dict]
    compare: Mapping[str, Compare]
    description: str = ""
    adversarial: bool = True

    @property
    def key(self) -> str:
        return f"{self.op}/{self.name}"

    def inputs(self, seed: int) -> dict:
        """Fresh inputs for ``seed`` (new arrays every call)."""
        return self.make(seed)

    def compare_for(self, output: str) -> Compare:
        try:
            return self.compare[output]
        except KeyError:
            return self.compare["*"]


def op_scenarios(op: str, cases: int, compare: Mapping[str, Compare], random_case: tuple,
                 fixed: list[tuple]) -> list[Scenario]:
    """The scenarios of ``op``: ``cases`` random ones (``random-<i>``), then the adversarial ones.

    Args:
      random_case: ``(make, description)`` of the random cases.
      fixed: ``(name, make, description)`` per adversarial case, or ``(name, make, compare,
        description)`` where a case compares its outputs differently from ``compare``.
    """
    make, description = random_case
    out = [Scenario(op, f"random-{i}", make, compare, description, False) for i in range(cases)]
    for name, make, *rest in fixed:
        cmp, description = rest if len(rest) == 2 else (compare, rest[0])
        out.append(Scenario(op, name, make, cmp, description))
    return out


def scenario_seed(seed: int, scenario: Scenario) -> int:
    """The seed a scenario's inputs are drawn from: stable across processes."""
    return zlib.crc32(f"{seed}:{scenario.key}".encode()) & 0x7FFFFFFF


def normal(rng, shape, dtype=F32, scale=1.0):
    """``scale`` * standard normal of ``shape``, drawn in float32, then cast to ``dtype``."""
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(dtype)


# The NaN that poisons null blocks / null rows: a payload that no computation and
# no NaN input of a scenario produces, so a write of a NaN token into a poisoned
# block still changes its bits. fp8 e4m3fn has only +-NaN: the poison is -NaN.
POISON_BITS = {F32: 0x7FE5A5A5, BF16: 0x7FE5, F16: 0x7EA5, FP8: 0xFF}
# K/V of tokens that must never be written (PAD slots, tokens past N): a finite value
# that shows wherever it lands, exact in f32 / bf16 / f16 (-448 once cast to fp8).
DEAD_TOKEN = 12288.0
_UINTS = {1: np.uint8, 2: np.uint16, 4: np.uint32}


def poisoned(rng, shape, dtype, rows=(0,), positive=False):
    """Random previous contents; rows ``rows`` of axis 0 hold the poison NaN (:data:`POISON_BITS`)."""
    dtype = np.dtype(dtype)
    if dtype == FP8:
        a = rng.integers(0, 256, size=shape, dtype=np.uint8).view(FP8)
    else:
        v = normal(rng, shape, F32, 2.0)
        a = (np.abs(v) + 1.0 if positive else v).astype(dtype)
    a.view(_UINTS[dtype.itemsize])[list(rows)] = POISON_BITS[dtype]
    return a


def nan_rows(a, rows):
    """``a`` with rows ``rows`` (axis 0) set to NaN: inputs that must never be read."""
    a = a.copy()
    if len(rows):
        a[np.asarray(rows)] = np.nan
    return a


def random_slots(rng, n, num_pad, num_slots, block_size, *, pad_at=None, dtype=np.int32):
    """``n`` unique slots outside the null block, ``num_pad`` of them PAD."""
    live = rng.choice(np.arange(block_size, num_slots), size=n - num_pad, replace=False)
    out = np.full((n,), PAD, np.int64)
    where = rng.choice(n, size=num_pad, replace=False) if pad_at is None else np.asarray(pad_at)
    keep = np.setdiff1d(np.arange(n), where)
    out[keep] = live
    return out.astype(dtype)


def pick(rng, options):
    """One of ``options``, uniformly."""
    return options[int(rng.integers(len(options)))]
