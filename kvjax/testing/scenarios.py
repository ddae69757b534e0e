"""Named, seeded scenarios for differential testing of every kvjax op.

A :class:`Scenario` is a name, the op it drives, a function ``seed -> inputs``
(numpy arrays and plain Python options, named as the kvjax function's
arguments) and metadata: how each output is compared (:class:`Compare`:
bitwise, exact integers, or a float tolerance with its source) and which
adversarial rule it exercises. :func:`scenarios` lists them;
:mod:`kvjax.testing.difftest` runs them through kvjax and the torch / vLLM
implementations.

Every op has ``random-<i>`` cases (``cases`` of them) plus fixed adversarial
ones taken from the vLLM bug classes (``vllm-semantics.md`` section 7) and the
rules a port must enforce (section 8):

===============================  ================================================
adversarial scenario             what it catches
===============================  ================================================
``all-pad-dummy-step``           a dummy step must write nothing (PR 39444)
``pad-inside-and-tail``          PAD slots / padded rows between and after real ones
``n-lt-t``                       slot mapping shorter than the (padded) inputs
``null-block-nan``               the null block is NaN and must stay untouched
``last-block``                   ids at the very end of the cache / table / pool
``kernel-blocks-per-block-<r>``  logical -> kernel block expansion (rules 3, 4, 16)
``fp8-saturation``               +-448, beyond, +-inf, NaN, ties, subnormals
``fp8-per-head-scales``          ``[H]`` scales (rule 13)
``fp8-exact-quotients``          quotients that are fp8 values (vLLM bitwise)
``null-mamba-rows``              null state indices: no read, no write (18, 19)
``null-dst``                     a null destination with a valid source
``speculative-mamba-rows``       per-token dst columns, num_accepted offsets (20)
``spec-decode-0..k-drafts``      sequences of 1..k+1 tokens, num_accepted 0..k
``decode-0..k-drafts``           decode windows with 0..k drafts (combine, post_update)
``reused-row-fresh-start``       a NaN-poisoned reused state row, fresh request (17)
``chunked-prefill-gap``          real tokens, then padding (NaN / stale positions) to T
``prompt-tail-straddling``       a decode window that starts inside the prompt
``reused-row-*``                 add_request on a row with a previous tenant (21)
===============================  ================================================

Shapes are small and fixed per op (and per variant), so that a kernel
compiles a handful of times per run even in interpret mode.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable, Mapping

import ml_dtypes
import numpy as np

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

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
F16 = np.dtype(np.float16)
NULL = 0  # NULL_BLOCK_ID
PAD = -1  # PAD_SLOT_ID


# --------------------------------------------------------------------------
# metadata
# --------------------------------------------------------------------------


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
# Float tolerances. Measured with difftest(against="all", cases=40, seed=7) on the
# reference and on the Pallas (interpret) backends, the largest fraction of the
# tolerance any element used (ArrayDiff.tolerance_used) was: SSM_F32 5.5% (vLLM, out
# of selective_state_update; 4.2% against torch), 1.3% for the conv outputs;
# SCAN_F32 2.1%; the bf16 tolerances 0% (every bf16 output came out bitwise equal).
#
# SSM / conv decode math in float32: the torch reference (F.softplus, torch.exp,
# einsum), kvjax's jnp / Pallas kernels and vLLM's Triton kernel (exp via exp2)
# evaluate one float32 formula in different orders: a few float32 ulps times the
# dstate reduction (N = 8 here). 2e-5 is tests/test_vllm_oracle.py's F32_TOL and
# 15x-50x tighter than vLLM's own tests/kernels/mamba/test_mamba_ssm.py (3e-4 / 1e-3).
SSM_F32 = Compare("close", 2e-5, 2e-5, source=(
    "float32 SSM/conv math in another order (exp vs exp2, reduction order); measured <= 6% "
    "of it; tests/test_vllm_oracle.py F32_TOL; vLLM's own test uses rtol 3e-4, atol 1e-3"))
# bfloat16 outputs: every side computes in float32 and rounds once to bfloat16 (2^-8
# relative spacing); a float32 difference next to a rounding boundary flips one bf16
# ulp, so a few ulps are allowed. vLLM's own bf16 tolerance is 1e-2 / 5e-2.
SSM_BF16 = Compare("close", 2e-2, 2e-2, source=(
    "float32 math rounded once to bfloat16 (ulp 2^-8 relative): a few bf16 ulps; "
    "tests/test_vllm_oracle.py BF16_TOL; vLLM's own test uses rtol 1e-2, atol 5e-2"))
# The prefill scan: off the reference backend kvjax runs the chunked SSD form (exp of
# segment sums, [Q, Q] matrix products) against the token-by-token recurrence of the
# torch reference, a different float32 evaluation whose error grows with the chunk.
SCAN_F32 = Compare("close", 5e-5, 5e-5, source=(
    "float32: the chunked SSD form vs the token recurrence; measured <= 2.1% of it; "
    "tests/test_mamba.py uses 1e-5 relative to the output scale"))
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


def scenario_seed(seed: int, scenario: Scenario) -> int:
    """The seed a scenario's inputs are drawn from: stable across processes."""
    return zlib.crc32(f"{seed}:{scenario.key}".encode()) & 0x7FFFFFFF


# --------------------------------------------------------------------------
# shared helpers
# --------------------------------------------------------------------------


def _normal(rng, shape, dtype=F32, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(dtype)


# The NaN that poisons null blocks / null rows: a payload that no computation and
# no NaN input of a scenario produces, so a write of a NaN token into a poisoned
# block still changes its bits. fp8 e4m3fn has only +-NaN: the poison is -NaN.
POISON_BITS = {F32: 0x7FE5A5A5, BF16: 0x7FE5, F16: 0x7EA5, FP8: 0xFF}
# K/V of tokens that must never be written (PAD slots, tokens past N): a finite value
# that shows wherever it lands, exact in f32 / bf16 / f16 (-448 once cast to fp8).
DEAD_TOKEN = 12288.0
_UINTS = {1: np.uint8, 2: np.uint16, 4: np.uint32}


def _poisoned(rng, shape, dtype, rows=(0,), positive=False):
    """Random previous contents; rows ``rows`` of axis 0 hold the poison NaN (:data:`POISON_BITS`)."""
    dtype = np.dtype(dtype)
    if dtype == FP8:
        a = rng.integers(0, 256, size=shape, dtype=np.uint8).view(FP8)
    else:
        v = _normal(rng, shape, F32, 2.0)
        a = (np.abs(v) + 1.0 if positive else v).astype(dtype)
    a.view(_UINTS[dtype.itemsize])[list(rows)] = POISON_BITS[dtype]
    return a


def _nan_rows(a, rows):
    """``a`` with rows ``rows`` (axis 0) set to NaN: inputs that must never be read."""
    a = a.copy()
    if len(rows):
        a[np.asarray(rows)] = np.nan
    return a


def _slots(rng, n, num_pad, num_slots, block_size, *, pad_at=None, dtype=np.int32):
    """``n`` unique slots outside the null block, ``num_pad`` of them PAD."""
    live = rng.choice(np.arange(block_size, num_slots), size=n - num_pad, replace=False)
    out = np.full((n,), PAD, np.int64)
    where = rng.choice(n, size=num_pad, replace=False) if pad_at is None else np.asarray(pad_at)
    keep = np.setdiff1d(np.arange(n), where)
    out[keep] = live
    return out.astype(dtype)


def _pick(rng, options):
    return options[int(rng.integers(len(options)))]


# --------------------------------------------------------------------------
# reshape_and_cache_flash
# --------------------------------------------------------------------------

FLASH = dict(T=8, H=2, D=8, NB=6, BS=4)
_FLASH_SLOTS = FLASH["NB"] * FLASH["BS"]


def _flash_inputs(rng, kind, slots, *, src=F32, k_scale=None, v_scale=None, key=None, value=None):
    T, H, D, NB, BS = (FLASH[k] for k in ("T", "H", "D", "NB", "BS"))
    fp8 = kind == "fp8"
    dtype = {"f32": F32, "bf16": BF16, "f16": F16, "fp8": src}[kind]
    if key is None:
        key = _normal(rng, (T, H, D), F32, 3.0)
        value = _normal(rng, (T, H, D), F32, 3.0)
        # Tokens that must never be written (PAD slots, tokens past N) carry DEAD_TOKEN.
        dead = [t for t in range(T) if t >= len(slots) or slots[t] < 0]
        key[dead], value[dead] = DEAD_TOKEN, -DEAD_TOKEN
    cache_dtype = FP8 if fp8 else dtype
    a = dict(
        key=np.asarray(key).astype(dtype), value=np.asarray(value).astype(dtype),
        key_cache=_poisoned(rng, (NB, BS, H, D), cache_dtype),
        value_cache=_poisoned(rng, (NB, BS, H, D), cache_dtype),
        slot_mapping=np.asarray(slots), kv_cache_dtype="fp8" if fp8 else "auto",
        k_scale=None, v_scale=None,
    )
    if fp8:
        a["k_scale"] = np.asarray(k_scale if k_scale is not None else [rng.uniform(0.5, 2.0)], np.float32)
        a["v_scale"] = np.asarray(v_scale if v_scale is not None else [rng.uniform(0.5, 2.0)], np.float32)
    return a


def _flash_random(seed):
    rng = np.random.default_rng(seed)
    T = FLASH["T"]
    kind = _pick(rng, ("f32", "bf16", "f16", "fp8"))
    n = _pick(rng, (T, T - 2))
    slots = _slots(rng, n, int(rng.integers(0, 4)), _FLASH_SLOTS, FLASH["BS"],
                   dtype=_pick(rng, (np.int32, np.int64)))
    return _flash_inputs(rng, kind, slots, src=_pick(rng, (F32, BF16)))


def _flash_fixed(kind, slot_list, *, src=F32, **kw):
    def make(seed):
        rng = np.random.default_rng(seed)
        return _flash_inputs(rng, kind, np.asarray(slot_list, np.int32), src=src, **kw)
    return make


_FP8_EDGE = np.array([448.0, -448.0, 449.0, -464.0, 500.0, -1000.0, np.inf, -np.inf, np.nan,
                      1.0625, 17.0, 232.0, 0.001, 3 * 2.0**-10, 7 * 2.0**-10, -0.0], np.float32)


def _flash_fp8_saturation(seed):
    rng = np.random.default_rng(seed)
    T, H, D = FLASH["T"], FLASH["H"], FLASH["D"]
    k_scale, v_scale = np.float32(1.5), np.float32(1.0)
    key = np.resize(_FP8_EDGE, (T, H, D)) * k_scale
    value = -np.resize(_FP8_EDGE[::-1], (T, H, D)) * v_scale
    slots = np.array([5, 9, 23, 4, 13, 17, 20, 8], np.int32)
    return _flash_inputs(rng, "fp8", slots, key=key, value=value, k_scale=[k_scale], v_scale=[v_scale])


def _fp8_exact_values(rng, shape):
    finite = np.arange(256, dtype=np.uint8).view(FP8)
    finite = finite[np.isfinite(finite.astype(np.float32))]
    q = rng.choice(finite, size=shape).astype(np.float32)
    q.reshape(-1)[:4] = [448.0, -448.0, 2.0**-9, -(2.0**-9)]
    return q


def _flash_fp8_exact(seed):
    rng = np.random.default_rng(seed)
    T, H, D = FLASH["T"], FLASH["H"], FLASH["D"]
    k_scale, v_scale = np.float32(2.0), np.float32(0.25)
    key = _fp8_exact_values(rng, (T, H, D)) * k_scale
    value = _fp8_exact_values(rng, (T, H, D)) * v_scale
    slots = np.array([5, -1, 23, 4, 9], np.int32)
    key[[1, 5, 6, 7]], value[[1, 5, 6, 7]] = DEAD_TOKEN, -DEAD_TOKEN
    return _flash_inputs(rng, "fp8", slots, src=BF16, key=key, value=value,
                         k_scale=[k_scale], v_scale=[v_scale])


def _flash_scenarios(cases):
    T, BS = FLASH["T"], FLASH["BS"]
    cmp = {"*": BITWISE}
    out = [Scenario("reshape_and_cache_flash", f"random-{i}", _flash_random, cmp,
                    "random dtype (f32/bf16/f16/fp8), N in {T, T-2}, 0-3 PAD slots", False)
           for i in range(cases)]
    fixed = [
        ("all-pad-dummy-step", _flash_fixed("f32", [PAD] * T),
         "every slot PAD: the caches (null block NaN) must not change at all"),
        ("pad-inside-and-tail", _flash_fixed("bf16", [6, PAD, 11, 7, PAD, 19, PAD, PAD]),
         "PAD between real slots and at the tail; PAD tokens hold DEAD_TOKEN"),
        ("n-lt-t", _flash_fixed("f16", [21, 4, 10, 15, 7]),
         "N=5 slots for T=8 tokens: tokens 5..7 (DEAD_TOKEN) are ignored"),
        ("null-block-nan", _flash_fixed("f32", [BS, BS + 1, PAD, 2 * BS - 1, PAD, PAD, PAD, PAD]),
         "slots next to the NaN null block: block 0 stays NaN bit for bit"),
        ("last-block", _flash_fixed("bf16", [_FLASH_SLOTS - 1, _FLASH_SLOTS - BS, PAD, 5]),
         "the last slot of the last block and the first slot of it"),
        ("fp8-saturation", _flash_fp8_saturation,
         "fp8: +-448, 449, 464, 500, 1000, +-inf, NaN, ties and subnormals; scale 1.5 / 1.0"),
        ("fp8-per-head-scales", _flash_fixed("fp8", [5, 9, PAD, 23, 14, 6, 18, 12], src=BF16,
                                             k_scale=[0.5, 2.0], v_scale=[3.0, 0.75]),
         "fp8 with per-head [H] k/v scales"),
        ("fp8-exact-quotients", _flash_fp8_exact,
         "fp8 where every quotient x/scale is an fp8 value (incl. +-448, subnormals)"),
    ]
    out += [Scenario("reshape_and_cache_flash", n, f, cmp, d) for n, f, d in fixed]
    return out


# --------------------------------------------------------------------------
# concat_and_cache_mla
# --------------------------------------------------------------------------

MLA = dict(T=6, L=16, R=8, NB=4, BS=4)
_MLA_SLOTS = MLA["NB"] * MLA["BS"]


def _mla_inputs(rng, kind, slots, *, scale=None, values=None):
    T, Lr, R, NB, BS = (MLA[k] for k in ("T", "L", "R", "NB", "BS"))
    fp8 = kind == "fp8"
    dtype = {"f32": F32, "bf16": BF16, "fp8": BF16}[kind]
    if values is None:
        kv_c, k_pe = _normal(rng, (T, Lr), F32, 3.0), _normal(rng, (T, R), F32, 3.0)
        dead = [t for t in range(T) if t >= len(slots) or slots[t] < 0]
        kv_c[dead], k_pe[dead] = DEAD_TOKEN, -DEAD_TOKEN
    else:
        kv_c, k_pe = values
    a = dict(kv_c=kv_c.astype(dtype), k_pe=k_pe.astype(dtype),
             kv_cache=_poisoned(rng, (NB, BS, Lr + R), FP8 if fp8 else dtype),
             slot_mapping=np.asarray(slots), kv_cache_dtype="fp8" if fp8 else "auto", scale=None)
    if fp8:
        a["scale"] = np.asarray([scale if scale is not None else rng.uniform(0.3, 1.5)], np.float32)
    return a


def _mla_random(seed):
    rng = np.random.default_rng(seed)
    T = MLA["T"]
    n = _pick(rng, (T, T - 2))
    slots = _slots(rng, n, int(rng.integers(0, 3)), _MLA_SLOTS, MLA["BS"])
    return _mla_inputs(rng, _pick(rng, ("f32", "bf16", "fp8")), slots)


def _mla_fixed(kind, slot_list, **kw):
    def make(seed):
        return _mla_inputs(np.random.default_rng(seed), kind, np.asarray(slot_list, np.int32), **kw)
    return make


def _mla_fp8_saturation(seed):
    rng = np.random.default_rng(seed)
    T, Lr, R = MLA["T"], MLA["L"], MLA["R"]
    scale = np.float32(1.25)
    kv_c = np.resize(_FP8_EDGE, (T, Lr)) * scale
    k_pe = -np.resize(_FP8_EDGE[::-1], (T, R)) * scale
    return _mla_inputs(rng, "fp8", np.array([4, 15, 9, 6, 12, 7], np.int32), scale=scale,
                       values=(kv_c, k_pe))


def _mla_scenarios(cases):
    T, BS = MLA["T"], MLA["BS"]
    cmp = {"*": BITWISE}
    out = [Scenario("concat_and_cache_mla", f"random-{i}", _mla_random, cmp,
                    "random dtype (f32/bf16/fp8), N in {T, T-2}, 0-2 PAD slots", False)
           for i in range(cases)]
    fixed = [
        ("all-pad-dummy-step", _mla_fixed("bf16", [PAD] * T), "every slot PAD: nothing written"),
        ("pad-inside-and-tail", _mla_fixed("f32", [5, PAD, 9, PAD, PAD, PAD]),
         "PAD between and after real slots"),
        ("n-lt-t", _mla_fixed("fp8", [14, 4, 8]), "N=3 slots for T=6 tokens"),
        ("null-block-nan", _mla_fixed("f32", [BS, PAD, BS + 3, PAD, PAD, PAD]),
         "writes next to the NaN null block"),
        ("last-block", _mla_fixed("bf16", [_MLA_SLOTS - 1, _MLA_SLOTS - BS, PAD, PAD, PAD, PAD]),
         "the first and last slot of the last block"),
        ("fp8-saturation", _mla_fp8_saturation, "fp8 edge values (saturation, inf, NaN, ties)"),
    ]
    out += [Scenario("concat_and_cache_mla", n, f, cmp, d) for n, f, d in fixed]
    return out


# --------------------------------------------------------------------------
# zero_blocks
# --------------------------------------------------------------------------

ZERO_NKB = 8  # kernel blocks
_ZERO_ARRAYS = (((ZERO_NKB, 4, 2, 4), F32), ((ZERO_NKB, 4, 8), BF16), ((ZERO_NKB, 16), FP8),
                ((ZERO_NKB, 3), np.dtype(np.int32)))


def _zero_inputs(rng, ids, r):
    caches = []
    for shape, dtype in _ZERO_ARRAYS:
        if dtype == np.dtype(np.int32):
            a = rng.integers(1, 1000, size=shape).astype(np.int32)
            a[0] = -1
        else:  # never 0 outside the null block, so a zeroed element always shows
            a = _poisoned(rng, shape, dtype, positive=True)
        caches.append(a)
    return dict(caches=caches, block_ids=np.asarray(ids, np.int32), kernel_blocks_per_block=r)


def _zero_random(seed):
    rng = np.random.default_rng(seed)
    r = _pick(rng, (1, 2, 4))
    ids = rng.integers(-2, ZERO_NKB // r, size=5)
    return _zero_inputs(rng, np.where(ids == 0, -1, ids), r)  # block 0 is null: never zeroed


def _zero_fixed(ids, r):
    return lambda seed: _zero_inputs(np.random.default_rng(seed), ids, r)


def _zero_scenarios(cases):
    cmp = {"*": BITWISE}
    out = [Scenario("zero_blocks", f"random-{i}", _zero_random, cmp,
                    "random r in {1,2,4}, 5 ids in [-2, NKB/r) but not 0 (repeats allowed)", False)
           for i in range(cases)]
    fixed = [
        ("all-pad-dummy-step", _zero_fixed([-1] * 5, 1), "every id negative: nothing zeroed"),
        ("pad-inside-and-tail", _zero_fixed([3, -1, 1, -1, -1], 1), "padding between and after ids"),
        ("null-block-nan", _zero_fixed([1, 2, -1, -1, -1], 1),
         "ids next to the NaN null block: block 0 keeps its NaN"),
        ("last-block", _zero_fixed([ZERO_NKB // 2 - 1, -1, -1, -1, -1], 2),
         "the last logical block (r=2): the last two kernel blocks"),
        ("kernel-blocks-per-block-2", _zero_fixed([2, 1, -1, 2, -1], 2),
         "r=2: both kernel sub-blocks of each id, a repeated id"),
        ("kernel-blocks-per-block-4", _zero_fixed([1, -1, -1, -1, -1], 4),
         "r=4: all four kernel sub-blocks of block 1"),
    ]
    out += [Scenario("zero_blocks", n, f, cmp, d) for n, f, d in fixed]
    return out


# --------------------------------------------------------------------------
# selective_state_update
# --------------------------------------------------------------------------

SSU = dict(L=10, T=6, H=4, P=4, N=8, G=2, K=3)


def _ssu_base(rng, *, dtype=F32, heads=True, tied=False):
    L, T, H, P, N, G = (SSU[k] for k in ("L", "T", "H", "P", "N", "G"))
    a = dict(
        state=_poisoned(rng, (L, H, P, N), F32), x=_normal(rng, (T, H, P)),
        dt=_normal(rng, (T, H, P), F32, 0.5), A=-np.abs(_normal(rng, (H, P, N))),
        B=_normal(rng, (T, G, N)), C=_normal(rng, (T, G, N)), D=_normal(rng, (H, P)),
        dt_bias=_normal(rng, (H, P), F32, 0.1), z=_normal(rng, (T, H, P)),
    )
    if tied:
        a.update(dt=a["dt"][:, :, :1].copy(), A=a["A"][:, :1, :1].copy(), D=a["D"][:, :1].copy(),
                 dt_bias=a["dt_bias"][:, :1].copy())
    if not heads:
        a = dict(state=a["state"][:, 0].copy(), x=a["x"][:, 0].copy(), dt=a["dt"][:, 0].copy(),
                 A=a["A"][0].copy(), B=a["B"][:, 0].copy(), C=a["C"][:, 0].copy(),
                 D=a["D"][0].copy(), dt_bias=a["dt_bias"][0].copy(), z=a["z"][:, 0].copy())
    a = {k: v.astype(dtype) for k, v in a.items()}
    a.update(dt_softplus=True, state_batch_indices=None, dst_state_batch_indices=None,
             null_block_id=NULL, num_accepted_tokens=None, cu_seqlens=None)
    return a


def _ssu_plain(sbi, dst=None, **kw):
    def make(seed):
        a = _ssu_base(np.random.default_rng(seed), **kw)
        a["state_batch_indices"] = np.asarray(sbi, np.int32)
        if dst is not None:
            a["dst_state_batch_indices"] = np.asarray(dst, np.int32)
        return a
    return make


def _ssu_spec(cu, src, dst, acc, *, nan_tokens=()):
    def make(seed):
        a = _ssu_base(np.random.default_rng(seed))
        a.update(cu_seqlens=np.asarray(cu, np.int32), state_batch_indices=np.asarray(src, np.int32),
                 dst_state_batch_indices=None if dst is None else np.asarray(dst, np.int32),
                 num_accepted_tokens=None if acc is None else np.asarray(acc, np.int32))
        for k in ("x", "dt", "B", "C", "z"):
            a[k] = _nan_rows(a[k], list(nan_tokens))
        return a
    return make


def _ssu_random(seed):
    rng = np.random.default_rng(seed)
    L, T, K = SSU["L"], SSU["T"], SSU["K"]
    mode = _pick(rng, ("plain", "dst", "spec", "varlen"))
    a = _ssu_base(rng)
    a["dt_softplus"] = bool(rng.integers(2))
    rows = rng.permutation(np.arange(1, L))
    if mode in ("plain", "dst"):
        sbi = rows[:T].astype(np.int32)
        sbi[rng.random(T) < 0.25] = NULL
        a["state_batch_indices"] = sbi
        if mode == "dst":  # write elsewhere: fresh rows, or in place; null only where src is null
            dst = np.where(rng.random(T) < 0.5, sbi, 0)
            fresh = rows[T:]
            for b in range(T):
                if sbi[b] != NULL and dst[b] == 0:
                    dst[b] = fresh[0] if len(fresh) else sbi[b]
                    fresh = fresh[1:]
            a["dst_state_batch_indices"] = dst.astype(np.int32)
        return a
    lens = rng.integers(0, K + 1, size=3)
    while lens.sum() > T:
        lens[int(np.argmax(lens))] -= 1
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    a["cu_seqlens"] = cu
    pad = list(range(int(cu[-1]), T))
    for k in ("x", "dt", "B", "C", "z"):
        a[k] = _nan_rows(a[k].astype(np.float32), pad).astype(a[k].dtype)
    if mode == "varlen":
        sbi = rows[:3].astype(np.int32)
        sbi[rng.random(3) < 0.25] = NULL
        a["state_batch_indices"] = sbi
        return a
    src = rows[:9].reshape(3, K).astype(np.int32)
    dst = src.copy()
    src[rng.random(3) < 0.2] = NULL
    dst[rng.random((3, K)) < 0.2] = NULL
    a.update(state_batch_indices=src, dst_state_batch_indices=dst,
             num_accepted_tokens=rng.integers(1, K + 1, size=3).astype(np.int32))
    return a


def _ssu_scenarios(cases):
    L = SSU["L"]
    f32, bf16 = {"*": SSM_F32}, {"*": SSM_BF16}
    out = [Scenario("selective_state_update", f"random-{i}", _ssu_random, f32,
                    "random path (plain / separate dst / varlen / speculative), random null rows",
                    False) for i in range(cases)]
    fixed = [
        ("null-mamba-rows", _ssu_plain([3, 0, 5, 1, 0, 7]), f32,
         "null src rows read a zero state and write nothing; row 0 is NaN"),
        ("null-dst", _ssu_plain([1, 2, 3, 4, 5, 6], [7, 0, 3, 4, 5, 6]), f32,
         "valid src 2 with a null dst: kvjax writes no state (vLLM writes the null row)"),
        ("speculative-mamba-rows",
         _ssu_spec([0, 3, 4, 6], [[1, 2, 3], [0, 0, 0], [5, 6, 7]], [[4, 2, 0], [0, 0, 0], [7, 6, 5]],
                   [2, 1, 3]), f32,
         "per-token dst columns, initial column num_accepted-1, a null dst entry, a null src"),
        ("spec-decode-0..k-drafts",
         _ssu_spec([0, 1, 1, 3, 6], [[1, 0, 0], [0, 0, 0], [2, 3, 0], [4, 5, 6]], None, [1, 1, 2, 0]),
         f32, "sequences of 1, 0, 2, 3 tokens (0..2 drafts); num_accepted 1, 1, 2, 0"),
        ("chunked-prefill-gap", _ssu_spec([0, 2, 2, 4], [3, 1, 5], None, None, nan_tokens=[4, 5]),
         f32, "varlen: tokens 4, 5 belong to no sequence (NaN inputs): out 0, no state"),
        ("last-block", _ssu_plain([L - 1, 2, 0, 4, 6, 8], [L - 1, 2, 0, 4, 6, 8]), f32,
         "the last state row (L-1) read and written"),
        ("bf16", _ssu_plain([3, 0, 5, 1, 8, 2], dtype=BF16), bf16, "bfloat16 state and inputs"),
        ("no-heads", _ssu_plain([1, 4, 0, 2, 9, 5], heads=False), f32,
         "the headless layout: state [L, P, N]"),
        ("tied-head-dim", _ssu_plain([3, 1, 0, 5, 7, 9], tied=True), f32,
         "per-head dt [T, H, 1], A [H, 1, 1], D and dt_bias [H, 1]"),
    ]
    out += [Scenario("selective_state_update", n, f, c, d) for n, f, c, d in fixed]
    return out


# --------------------------------------------------------------------------
# causal_conv1d_update
# --------------------------------------------------------------------------

CONV = dict(L=6, dim=8, W=4)


def _conv_base(rng, S, dtype=F32, bias=True):
    L, dim, W = CONV["L"], CONV["dim"], CONV["W"]
    return dict(conv_state=_poisoned(rng, (L, dim, S), dtype),
                weight=_normal(rng, (dim, W), F32, 0.5).astype(dtype),
                bias=_normal(rng, (dim,)).astype(dtype) if bias else None)


def _conv_case(x_shape, idx, *, S=None, qsl=None, acc=None, activation="silu", bias=True,
               dtype=F32, max_query_len=-1, nan_tokens=()):
    W = CONV["W"]

    def make(seed):
        rng = np.random.default_rng(seed)
        a = _conv_base(rng, S or W - 1, dtype, bias)
        x = _normal(rng, x_shape)
        x = _nan_rows(x, list(nan_tokens))
        a.update(x=x.astype(dtype), activation=activation,
                 conv_state_indices=None if idx is None else np.asarray(idx, np.int32),
                 num_accepted_tokens=None if acc is None else np.asarray(acc, np.int32),
                 query_start_loc=None if qsl is None else np.asarray(qsl, np.int32),
                 max_query_len=max_query_len, null_block_id=NULL)
        return a
    return make


def _conv_random(seed):
    rng = np.random.default_rng(seed)
    L, dim, W = CONV["L"], CONV["dim"], CONV["W"]
    rows = rng.permutation(np.arange(1, L))
    mode = _pick(rng, ("2d", "3d", "3d-spec", "varlen", "varlen-spec"))
    act = _pick(rng, ("silu", None))
    idx = rows[:4].astype(np.int32)
    idx[rng.random(4) < 0.25] = NULL
    if mode == "2d":
        return _conv_case((4, dim), idx, activation=act)(seed)
    if mode == "3d":
        return _conv_case((4, dim, 2), idx, activation=act)(seed)
    if mode == "3d-spec":
        return _conv_case((4, dim, 2), idx, S=W, acc=rng.integers(1, 3, size=4),
                          activation=act)(seed)
    q = 3
    lens = np.full(4, q) if mode == "varlen" else rng.integers(0, q + 1, size=4)
    lens[rng.random(4) < 0.2] = 0
    qsl = np.concatenate([[0], np.cumsum(lens)])
    T = 4 * q + 2  # one shape for every case; tokens past qsl[-1] are NaN padding
    pad = list(range(int(qsl[-1]), T))
    if mode == "varlen":
        return _conv_case((T, dim), idx, qsl=qsl, activation=act, max_query_len=q,
                          nan_tokens=pad)(seed)
    return _conv_case((T, dim), idx, S=W - 1 + q - 1, qsl=qsl, acc=rng.integers(1, q + 1, size=4),
                      activation=act, max_query_len=q, nan_tokens=pad)(seed)


def _conv_scenarios(cases):
    L, dim, W = CONV["L"], CONV["dim"], CONV["W"]
    # out: float math -> tolerance; conv_state: a copy of x (cast to the state dtype) -> bitwise.
    f32 = {"out": SSM_F32, "conv_state": BITWISE}
    bf16 = {"out": SSM_BF16, "conv_state": BITWISE}
    out = [Scenario("causal_conv1d_update", f"random-{i}", _conv_random, f32,
                    "random layout (2d / 3d / 3d-spec / varlen / varlen-spec), random null rows",
                    False) for i in range(cases)]
    fixed = [
        ("null-mamba-rows", _conv_case((4, dim), [2, 0, 5, 1]), f32,
         "single token; a null row: no state read/write, out keeps x"),
        ("multi-token-3d", _conv_case((2, dim, 3), [3, 1], activation=None, bias=False), f32,
         "x [batch, dim, seqlen], no bias, no activation"),
        ("chunked-prefill-gap",
         _conv_case((11, dim), [2, 3, 0, 4], qsl=[0, 3, 3, 6, 9], max_query_len=3, nan_tokens=[9, 10]),
         f32, "varlen, every live sequence max_query_len long; tokens 9, 10 are NaN padding"),
        ("varlen-short-sequences",
         _conv_case((6, dim), [2, 3, 0, 4], qsl=[0, 3, 3, 4, 6], max_query_len=3), f32,
         "varlen sequences shorter than max_query_len (vLLM state quirk)"),
        ("speculative-mamba-rows",
         _conv_case((6, dim), [2, 3, 0, 4], S=W + 1, qsl=[0, 3, 3, 4, 6], acc=[2, 1, 1, 3],
                    max_query_len=3), f32,
         "speculative sliding window with num_accepted offsets 1..3"),
        ("spec-decode-0..k-drafts",
         _conv_case((4, dim, 2), [1, 3, 0, 5], S=W, acc=[1, 0, 1, 2]), f32,
         "3d speculative, num_accepted 0..2 (0 reads offset 0 in kvjax)"),
        ("last-block", _conv_case((4, dim), [L - 1, 2, 0, 1]), f32, "the last conv-state row"),
        ("bf16", _conv_case((4, dim), [2, 0, 4, 5], dtype=BF16), bf16, "bfloat16 state and x"),
    ]
    out += [Scenario("causal_conv1d_update", n, f, c, d) for n, f, c, d in fixed]
    return out


# --------------------------------------------------------------------------
# prefill: selective_scan_varlen, causal_conv1d_varlen
# --------------------------------------------------------------------------

SCAN = dict(T=12, H=2, P=4, N=8, G=1, L=6)


def _prefill_layout(rng, R=3):
    """Random (query_start_loc, cache_indices, has_initial_state) for R requests."""
    T, L = SCAN["T"], SCAN["L"]
    lens = rng.integers(0, 5, size=R)
    qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    ci = rng.permutation(np.arange(1, L))[:R].astype(np.int32)
    ci[rng.random(R) < 0.2] = NULL
    his = rng.random(R) < 0.5
    assert qsl[-1] <= T
    return qsl, ci, his


def _scan_case(layout=None, *, dtype=F32, poison_rows=(0,)):
    T, H, P, N, G, L = (SCAN[k] for k in ("T", "H", "P", "N", "G", "L"))

    def make(seed):
        rng = np.random.default_rng(seed)
        qsl, ci, his = layout if layout is not None else _prefill_layout(rng)
        qsl = np.asarray(qsl, np.int32)
        pad = list(range(int(qsl[-1]), T))
        arr = dict(x=_normal(rng, (T, H, P)), dt=_normal(rng, (T, H), F32, 0.5),
                   B=_normal(rng, (T, G, N)), C=_normal(rng, (T, G, N)), z=_normal(rng, (T, H, P)))
        arr = {k: _nan_rows(v, pad).astype(dtype) for k, v in arr.items()}
        return dict(arr, A=-np.abs(_normal(rng, (H,))).astype(dtype),
                    state=_poisoned(rng, (L, H, P, N), dtype, rows=poison_rows),
                    query_start_loc=qsl, cache_indices=np.asarray(ci, np.int32),
                    has_initial_state=np.asarray(his, bool), D=_normal(rng, (H,)).astype(dtype),
                    dt_bias=_normal(rng, (H,), F32, 0.1).astype(dtype), dt_softplus=True,
                    null_block_id=NULL)
    return make


def _conv_varlen_case(layout=None, *, dtype=F32, poison_rows=(0,), activation="silu"):
    T, L = SCAN["T"], SCAN["L"]
    dim, W = CONV["dim"], CONV["W"]

    def make(seed):
        rng = np.random.default_rng(seed)
        qsl, ci, his = layout if layout is not None else _prefill_layout(rng)
        qsl = np.asarray(qsl, np.int32)
        x = _nan_rows(_normal(rng, (T, dim)), list(range(int(qsl[-1]), T))).T.copy()
        return dict(x=x.astype(dtype), weight=_normal(rng, (dim, W), F32, 0.5).astype(dtype),
                    bias=_normal(rng, (dim,)).astype(dtype),
                    conv_states=_poisoned(rng, (L, dim, W), dtype, rows=poison_rows),
                    query_start_loc=qsl, cache_indices=np.asarray(ci, np.int32),
                    has_initial_state=np.asarray(his, bool), activation=activation,
                    null_block_id=NULL)
    return make


_PREFILL_FIXED = [
    ("reused-row-fresh-start", ([0, 4, 7, 12], [2, 3, 5], [False, True, False]), (0, 2, 5),
     "fresh requests on NaN-poisoned reused rows 2, 5: the old state is never read"),
    ("null-mamba-rows", ([0, 3, 8, 12], [1, 0, 4], [True, True, False]), (0,),
     "a null cache index: no read, no write"),
    ("chunked-prefill-gap", ([0, 3, 5, 8], [4, 1, 3], [True, False, True]), (0,),
     "8 real tokens, 4 NaN padding tokens after them"),
    ("empty-request", ([0, 4, 4, 9], [2, 3, 1], [True, True, True]), (0,),
     "a zero-length request between two real ones: its row is untouched"),
    ("last-block", ([0, 5, 6, 12], [5, 1, 2], [True, False, True]), (0,),
     "the last state row (L-1)"),
]


def _prefill_scenarios(cases):
    out = []
    for op, case, f32, bf16 in (
        ("selective_scan_varlen", _scan_case, {"*": SCAN_F32}, {"*": SCAN_BF16}),
        ("causal_conv1d_varlen", _conv_varlen_case, {"out": SSM_F32, "conv_states": BITWISE},
         {"out": SSM_BF16, "conv_states": BITWISE}),
    ):
        out += [Scenario(op, f"random-{i}", case(), f32,
                         "3 random requests (0-4 tokens), random null rows and has_initial_state",
                         False) for i in range(cases)]
        out += [Scenario(op, n, case(layout, poison_rows=rows), f32, d)
                for n, layout, rows, d in _PREFILL_FIXED]
        out.append(Scenario(op, "bf16", case(([0, 4, 7, 10], [1, 4, 2], [True, False, True]),
                                             dtype=BF16), bf16, "bfloat16 state and inputs"))
    return out


# --------------------------------------------------------------------------
# combine_sampled_and_draft_tokens
# --------------------------------------------------------------------------

COMBINE = dict(T=24, R=6, MR=8, S=3, L=16)
_SENTINEL = 9000


def _combine_inputs(reqs, *, num_new=1):
    """Arguments for ``reqs``: tuples (row, num_computed, qlen, prefill_len, drafts) or None (padded)."""
    T, R, MR, S, L = (COMBINE[k] for k in ("T", "R", "MR", "S", "L"))
    idx = np.full((R,), -1, np.int32)
    qsl = np.zeros((R + 1,), np.int32)
    seq = np.zeros((R,), np.int32)
    cu = np.zeros((R + 1,), np.int32)
    prefill = np.full((MR,), 10_000, np.int32)  # unused rows: a read by mistake shows
    for b in range(R):
        r = reqs[b] if b < len(reqs) else None
        qsl[b + 1], cu[b + 1] = qsl[b], cu[b]
        if r is None:
            continue
        row, nc, qlen, pre, nd = r
        idx[b] = row
        qsl[b + 1] += qlen
        seq[b] = nc + qlen
        prefill[row] = pre
        cu[b + 1] += nd + num_new
    return dict(
        input_ids=_SENTINEL + np.arange(T, dtype=np.int32), idx_mapping=idx,
        last_sampled_tokens=(100 + np.arange(MR, dtype=np.int32))[:, None], query_start_loc=qsl,
        seq_lens=seq, prefill_len=prefill,
        draft_tokens=1000 + 10 * np.arange(MR, dtype=np.int32)[:, None] + np.arange(S, dtype=np.int32),
        cu_num_logits=cu, num_logits=L, num_new_sampled_tokens=num_new)


def _combine_random(seed):
    rng = np.random.default_rng(seed)
    T, R, MR, S, L = (COMBINE[k] for k in ("T", "R", "MR", "S", "L"))
    num_new = int(rng.random() < 0.8)
    rows = rng.permutation(MR)
    reqs, tokens, logits = [], 0, 0
    for b in range(int(rng.integers(0, R + 1))):
        kind = _pick(rng, ("decode", "prefill", "straddle"))
        pre = int(rng.integers(2, 20))
        if kind == "decode":
            nd = int(rng.integers(0, S + 1))
            nc, qlen = pre + int(rng.integers(0, 5)), nd + 1
        elif kind == "prefill":
            nd, qlen = 0, int(rng.integers(1, 6))
            nc = int(rng.integers(0, pre))
            qlen = max(qlen, num_new)
        else:
            nd = int(rng.integers(1, S + 1))
            qlen = nd + 1
            nc = pre - int(rng.integers(0, qlen))
        nl = nd + num_new
        if qlen < nl or qlen == 0 or tokens + qlen > T or logits + nl > L:
            break
        tokens, logits = tokens + qlen, logits + nl
        reqs.append((int(rows[b]), nc, qlen, pre, nd))
    return _combine_inputs(reqs, num_new=num_new)


def _combine_scenarios(cases):
    cmp = {"*": EXACT}
    out = [Scenario("combine_sampled_and_draft_tokens", f"random-{i}", _combine_random, cmp,
                    "random decode / prefill / straddling rows, padding after them", False)
           for i in range(cases)]
    fixed = [
        ("decode-0..k-drafts",
         [(5, 20, 1, 12, 0), (2, 20, 2, 12, 1), (7, 20, 3, 12, 2), (0, 20, 4, 12, 3)], 1,
         "four decode rows with 0..3 drafts, rows shuffled"),
        ("prompt-tail-straddling", [(1, 8, 4, 10, 2), (3, 6, 4, 10, 0), (4, 10, 3, 10, 2)], 1,
         "a window starting inside the prompt keeps its prompt id; seq == prefill_len"),
        ("mid-prefill-chunks", [(6, 0, 8, 30, 0), (2, 8, 8, 30, 0)], 1,
         "prefill chunks write no ids, only logits rows"),
        ("no-new-sampled-token", [(2, 20, 2, 3, 2), (5, 20, 1, 3, 1), (1, 3, 3, 5, 1)], 0,
         "num_new_sampled_tokens=0: every logits row is a draft"),
        ("all-pad-dummy-step", [], 1, "every batch row padded: nothing written, logits rows 0"),
        ("pad-inside-and-tail", [(3, 9, 2, 5, 1), None, (0, 4, 1, 4, 0)], 1,
         "a padded (-1) row between real rows and after them writes nothing"),
        ("last-block", [(7, 30, 4, 12, 3), (0, 12, 1, 12, 0)], 1,
         "the last request row (MR-1) with the most drafts"),
    ]
    out += [Scenario("combine_sampled_and_draft_tokens", n,
                     (lambda reqs, k: lambda seed: _combine_inputs(reqs, num_new=k))(r, k), cmp, d)
            for n, r, k, d in fixed]
    return out


# --------------------------------------------------------------------------
# compute_slot_mapping
# --------------------------------------------------------------------------

SLOTMAP = dict(MR=6, KBS=4, NCB=12, MAXB=4, R=4, T=32)  # NCB logical cache blocks


def _slotmap_case(reqs=None, *, r=1, gap_positions=True, last_block=False):
    """reqs: (row, num_computed, qlen) per batch row; row -1: a padded row (with tokens if
    qlen > 0); None entries and rows past the list: padded, no tokens. reqs=None: random."""
    MR, KBS, NCB, MAXB, R, T = (SLOTMAP[k] for k in ("MR", "KBS", "NCB", "MAXB", "R", "T"))
    W = MAXB * r

    def make(seed):
        rng = np.random.default_rng(seed)
        nkb = NCB * r
        table = np.full((MR, W), NULL, np.int32)
        live = rng.integers(1, MAXB + 1, size=MR)  # logical blocks of each row
        for row, nc, qlen in [q for q in (reqs or []) if q is not None and q[0] >= 0]:
            live[row] = max(live[row], -(-(nc + qlen) // (r * KBS)))  # room for the tokens
        for row in range(MR):
            logical = rng.choice(np.arange(1, NCB), size=live[row], replace=False)
            kern = (logical[:, None] * r + np.arange(r)).reshape(-1)
            table[row, :len(kern)] = kern
        if last_block:
            live[MR - 1] = MAXB
            table[MR - 1, -1] = nkb - 1
        batch = reqs
        if batch is None:
            rows = rng.permutation(MR)
            batch = []
            for b in range(int(rng.integers(0, R + 1))):
                cap = int(live[rows[b]]) * r * KBS
                nc = int(rng.integers(0, cap))
                batch.append((int(rows[b]), nc, int(rng.integers(1, min(cap - nc, 6) + 1))))
        idx = np.full((R,), -1, np.int32)
        qsl = np.zeros((R + 1,), np.int32)
        positions = np.zeros((T,), np.int32)
        for b in range(R):
            qsl[b + 1] = qsl[b]
            if b >= len(batch) or batch[b] is None:
                continue
            row, nc, qlen = batch[b]
            idx[b] = row
            positions[qsl[b]: qsl[b] + qlen] = nc + np.arange(qlen) if row >= 0 else 0
            qsl[b + 1] += qlen
        if gap_positions:  # stale positions of an earlier chunk after the real tokens (PR 36580)
            positions[qsl[-1]:] = rng.integers(0, KBS * W, size=T - int(qsl[-1]))
        return dict(block_table=table, idx_mapping=idx, query_start_loc=qsl, positions=positions,
                    block_size=KBS, num_tokens_padded=T)
    return make


def _slotmap_scenarios(cases):
    KBS, MAXB = SLOTMAP["KBS"], SLOTMAP["MAXB"]
    cmp = {"*": EXACT}
    out = [Scenario("compute_slot_mapping", f"random-{i}", _slotmap_case(), cmp,
                    "random rows, progress and query lengths; stale positions after the real tokens",
                    False) for i in range(cases)]
    fixed = [
        ("all-pad-dummy-step", _slotmap_case([]), "no real token: every slot PAD"),
        ("pad-inside-and-tail", _slotmap_case([(2, 0, 3), (-1, 0, 2), (4, 1, 2)]),
         "a padded batch row (with 2 tokens) between real rows, padded rows after them"),
        ("chunked-prefill-gap", _slotmap_case([(1, 0, 5), (3, 2, 4)]),
         "9 real tokens of 32; stale positions of an earlier chunk in [9, 32) -> PAD"),
        ("last-block", _slotmap_case([(5, MAXB * KBS - 2, 2), (0, 0, 1)], last_block=True),
         "the last kernel block id in the last table column, the last slot of the cache"),
        ("kernel-blocks-per-block-2", _slotmap_case([(1, 0, 7), (2, 3, 6)], r=2),
         "logical blocks of 8 tokens split into kernel blocks of 4 (ids b*2, b*2+1)"),
    ]
    out += [Scenario("compute_slot_mapping", n, f, cmp, d) for n, f, d in fixed]
    return out


# --------------------------------------------------------------------------
# gather_block_tables (BlockTables.write_rows + BlockTables.gather)
# --------------------------------------------------------------------------

GATHER = dict(MR=6, KBS=4, MAXB=5, NCB=20, U=3, R=4, M=3)


def _gather_case(writes=None, batch=None, *, r=1, sliding_window=None, stale_tail=True,
                 live=None):
    """writes: (row, [logical ids], overwrite) per entry; batch: request rows (-1 padded);
    live: {row: live logical blocks} (others random)."""
    MR, KBS, MAXB, NCB, U, R, M = (GATHER[k] for k in ("MR", "KBS", "MAXB", "NCB", "U", "R", "M"))
    W = MAXB * r

    def make(seed):
        rng = np.random.default_rng(seed)
        tables = np.full((MR, W), NULL, np.int32)
        counts = np.zeros((MR,), np.int32)
        for row in range(MR):
            n = int(rng.integers(0, MAXB + 1)) * r
            if live is not None and row in live:
                n = live[row] * r
            if stale_tail:  # a previous tenant's ids everywhere, live prefix or not (vLLM leaves them)
                tables[row] = rng.integers(1, NCB * r, size=W)
            else:
                tables[row, :n] = rng.integers(1, NCB * r, size=n)
            counts[row] = n
        w = writes
        if w is None:
            rows = rng.permutation(MR)[:int(rng.integers(0, U + 1))]
            w = []
            for row in rows:
                over = bool(rng.integers(2))
                room = MAXB - (0 if over else counts[row] // r)
                w.append((int(row), rng.integers(1, NCB, size=int(rng.integers(0, min(room, M) + 1))).tolist(), over))
        w_rows = np.full((U,), -1, np.int32)
        w_ids = np.zeros((U, M), np.int32)
        w_num = np.zeros((U,), np.int32)
        w_over = np.zeros((U,), bool)
        for u, (row, ids, over) in enumerate(w):
            w_rows[u], w_num[u], w_over[u] = row, len(ids), over
            w_ids[u, :len(ids)] = ids
        b = batch
        if b is None:
            b = [int(v) for v in rng.permutation(MR)[:R]]
            for i in range(R):
                if rng.random() < 0.25:
                    b[i] = -1
        idx = np.asarray(list(b) + [-1] * (R - len(b)), np.int32)
        first = rng.integers(0, MAXB * r * KBS, size=R).astype(np.int32)
        return dict(tables=tables, num_blocks=counts, block_size=KBS * r, kernel_block_size=KBS,
                    max_num_blocks=MAXB, sliding_window=sliding_window, num_cache_blocks=NCB,
                    write_rows=w_rows, write_block_ids=w_ids, write_num_new=w_num,
                    write_overwrite=w_over, idx_mapping=idx,
                    first_positions=first if sliding_window else None)
    return make


def _gather_scenarios(cases):
    NCB = GATHER["NCB"]
    cmp = {"*": EXACT}
    out = [Scenario("gather_block_tables", f"random-{i}", _gather_case(), cmp,
                    "random appends / overwrites on rows with stale tails, random padded batch rows",
                    False) for i in range(cases)]
    fixed = [
        ("reused-row-overwrite", _gather_case([(2, [7, 3], True)], [2, 0, 4, -1]),
         "a new tenant in row 2 (previous tenant's ids everywhere): the row is NULL past 2 ids"),
        ("append-to-live-row", _gather_case([(1, [9], False), (3, [4, 5], False)], [3, 1, -1, -1],
                                            stale_tail=False, live={1: 2, 3: 1}),
         "appends after the live length"),
        ("all-pad-dummy-step", _gather_case([], [-1, -1, -1, -1]),
         "no write, every batch row padded: gathered tables all NULL"),
        ("pad-inside-and-tail", _gather_case([(4, [1], True)], [4, -1, 5, -1]),
         "padded batch rows between and after real ones are all NULL"),
        ("kernel-blocks-per-block-2", _gather_case([(0, [3, 8, 2], True), (5, [6], False)],
                                                   [5, 0, 1, -1], r=2, live={5: 2}),
         "r=2: logical ids b expand to kernel ids 2b, 2b+1"),
        ("last-block", _gather_case([(1, [NCB - 1, NCB - 2], True)], [1, 2, 3, 4]),
         "the last cache block id written and gathered"),
        ("sliding-window", _gather_case([(2, [5, 6, 7], True)], [2, 1, 0, 3], sliding_window=6,
                                        stale_tail=False),
         "sliding window 6: blocks no query of the step can see are NULL in the gathered table"),
    ]
    out += [Scenario("gather_block_tables", n, f, cmp, d) for n, f, d in fixed]
    return out


# --------------------------------------------------------------------------
# request_state (RequestState.add_requests + RequestState.post_update)
# --------------------------------------------------------------------------

REQSTATE = dict(MR=5, LEN=16, S=3, U=3, R=4)
REQSTATE_FIELDS = ("prompt_len", "prefill_len", "total_len", "num_computed_tokens",
                   "all_token_ids", "last_sampled_tokens", "draft_tokens", "num_accepted_tokens",
                   "temperature", "top_p", "top_k")


def _stale_state(rng):
    """Rows left by previous tenants: junk everywhere, loosely consistent counters."""
    MR, LEN, S = REQSTATE["MR"], REQSTATE["LEN"], REQSTATE["S"]
    prefill = rng.integers(1, 9, size=MR)
    total = prefill + rng.integers(0, 4, size=MR)
    return dict(
        prompt_len=np.maximum(prefill - rng.integers(0, 2, size=MR), 1).astype(np.int32),
        prefill_len=prefill.astype(np.int32), total_len=total.astype(np.int32),
        num_computed_tokens=np.minimum(total, prefill + rng.integers(0, 3, size=MR)).astype(np.int32),
        all_token_ids=rng.integers(1, 500, size=(MR, LEN)).astype(np.int32),
        last_sampled_tokens=rng.integers(1, 500, size=MR).astype(np.int32),
        draft_tokens=rng.integers(1, 500, size=(MR, S)).astype(np.int32),
        num_accepted_tokens=rng.integers(1, S + 2, size=MR).astype(np.int32),
        temperature=rng.random(MR).astype(np.float32), top_p=rng.random(MR).astype(np.float32),
        top_k=rng.integers(0, 50, size=MR).astype(np.int32))


def _reqstate_case(adds=None, steps=None):
    """adds: (row, num_tokens, prompt_len, num_computed); steps: (row | -1, qlen, num_sampled)."""
    MR, LEN, S, U, R = (REQSTATE[k] for k in ("MR", "LEN", "S", "U", "R"))

    def make(seed):
        rng = np.random.default_rng(seed)
        state = _stale_state(rng)
        a = adds
        if a is None:
            rows = rng.permutation(MR)[:int(rng.integers(0, U + 1))]
            a = []
            for row in rows:
                n = int(rng.integers(1, 11))
                a.append((int(row), n, int(rng.integers(1, n + 1)), int(rng.integers(0, n + 1))))
        new = dict(rows=np.full((U,), -1, np.int32), token_ids=np.zeros((U, LEN), np.int32),
                   num_tokens=np.zeros((U,), np.int32), prompt_len=np.zeros((U,), np.int32),
                   num_computed_tokens=np.zeros((U,), np.int32),
                   temperature=np.zeros((U,), np.float32), top_p=np.ones((U,), np.float32),
                   top_k=np.zeros((U,), np.int32))
        for u, (row, n, p, nc) in enumerate(a):
            new["rows"][u], new["num_tokens"][u], new["prompt_len"][u] = row, n, p
            new["num_computed_tokens"][u] = nc
            new["token_ids"][u, :n] = rng.integers(1, 500, size=n)
            new["temperature"][u], new["top_p"][u] = rng.random(), rng.random()
            new["top_k"][u] = rng.integers(0, 50)
        # The state after the adds, to make the step consistent with it.
        after = {k: v.copy() for k, v in state.items()}
        for row, n, p, nc in a:
            after["prefill_len"][row], after["num_computed_tokens"][row] = n, nc
        st = steps
        if st is None:
            rows = [int(v) for v in rng.permutation(MR)[:R]]
            st = []
            for row in rows:
                if rng.random() < 0.2:
                    st.append((-1, 0, 0))
                    continue
                nc, pre = int(after["num_computed_tokens"][row]), int(after["prefill_len"][row])
                if nc < pre:  # prefill chunk (maybe the last one)
                    qlen = int(rng.integers(1, pre - nc + 1))
                    st.append((row, qlen, int(nc + qlen >= pre)))
                else:  # decode with 0..S drafts
                    nd = int(rng.integers(0, S + 1))
                    st.append((row, nd + 1, int(rng.integers(1, nd + 2))))
        post = dict(idx_mapping=np.full((R,), -1, np.int32), query_lens=np.zeros((R,), np.int32),
                    sampled=rng.integers(500, 900, size=(R, S + 1)).astype(np.int32),
                    num_sampled=np.zeros((R,), np.int32))
        for b, (row, qlen, ns) in enumerate(st):
            post["idx_mapping"][b], post["query_lens"][b], post["num_sampled"][b] = row, qlen, ns
        return dict(state=state, new=new, post=post)
    return make


def _reqstate_scenarios(cases):
    MR, LEN = REQSTATE["MR"], REQSTATE["LEN"]
    cmp = {"*": EXACT, "added.temperature": BITWISE, "added.top_p": BITWISE,
           "updated.temperature": BITWISE, "updated.top_p": BITWISE}
    out = [Scenario("request_state", f"random-{i}", _reqstate_case(), cmp,
                    "random adds into stale rows, then a random step (prefill chunks, decode, pads)",
                    False) for i in range(cases)]
    fixed = [
        ("reused-row-pd-disagg", _reqstate_case([(2, 6, 6, 6)], [(2, 1, 1)]),
         "row 2 re-added with 6 computed tokens: last_sampled = token 5, drafts 0 (PR 39833)"),
        ("reused-row-fresh-prefill", _reqstate_case([(1, 9, 7, 0)], [(1, 4, 1)]),
         "row 1 re-added fresh: last_sampled 0, stale tail zeroed; a mid-prefill chunk samples nothing"),
        ("finishing-prefill-chunk", _reqstate_case([(0, 5, 5, 3)], [(0, 2, 1)]),
         "the chunk that ends prefill samples one token"),
        ("decode-0..k-drafts", _reqstate_case([(0, 4, 4, 4), (3, 3, 3, 3), (4, 5, 5, 5)],
                                              [(0, 1, 1), (3, 3, 2), (4, 4, 4), (1, 2, 1)]),
         "decode windows with 0, 2, 3, 1 drafts and partial acceptance"),
        ("pad-inside-and-tail", _reqstate_case([(2, 4, 4, 4)], [(2, 2, 2), (-1, 0, 0), (0, 1, 1)]),
         "padded batch rows between and after real ones touch nothing"),
        ("all-pad-dummy-step", _reqstate_case([], [(-1, 0, 0)] * 4),
         "no add, every batch row padded: nothing changes"),
        ("last-block", _reqstate_case([(MR - 1, LEN - 1, LEN - 2, LEN - 2)], [(MR - 1, 2, 2)]),
         "the last row, a decode window ending at max_model_len: the sample past it is dropped"),
    ]
    out += [Scenario("request_state", n, f, cmp, d) for n, f, d in fixed]
    return out


# --------------------------------------------------------------------------
# registry
# --------------------------------------------------------------------------

_BUILDERS = {
    "reshape_and_cache_flash": _flash_scenarios,
    "concat_and_cache_mla": _mla_scenarios,
    "zero_blocks": _zero_scenarios,
    "selective_state_update": _ssu_scenarios,
    "causal_conv1d_update": _conv_scenarios,
    "selective_scan_varlen": None,  # built with causal_conv1d_varlen
    "causal_conv1d_varlen": None,
    "combine_sampled_and_draft_tokens": _combine_scenarios,
    "compute_slot_mapping": _slotmap_scenarios,
    "gather_block_tables": _gather_scenarios,
    "request_state": _reqstate_scenarios,
}
#: Every op with scenarios, kernels first, then the state functions.
OPS = tuple(_BUILDERS)


def scenarios(ops=None, cases: int = 4) -> list[Scenario]:
    """The scenarios of ``ops`` (default: all of :data:`OPS`): ``cases`` random ones per op, then the adversarial ones.

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
    out = []
    prefill = None
    for op in OPS:
        if op not in ops:
            continue
        if _BUILDERS[op] is None:
            prefill = prefill if prefill is not None else _prefill_scenarios(cases)
            out += [s for s in prefill if s.op == op]
        else:
            out += _BUILDERS[op](cases)
    return out
