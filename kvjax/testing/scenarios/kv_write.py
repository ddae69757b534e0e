"""Scenarios of the paged KV writes: ``reshape_and_cache_flash`` and ``concat_and_cache_mla``."""

from __future__ import annotations

import numpy as np

from kvjax.testing.scenarios.common import (
    BF16, BITWISE, DEAD_TOKEN, F16, F32, FP8, PAD, normal, op_scenarios, pick, poisoned,
    random_slots,
)

FLASH = dict(T=8, H=2, D=8, NB=6, BS=4)
_FLASH_SLOTS = FLASH["NB"] * FLASH["BS"]


def _flash_inputs(rng, kind, slots, *, src=F32, k_scale=None, v_scale=None, key=None, value=None):
    T, H, D, NB, BS = (FLASH[k] for k in ("T", "H", "D", "NB", "BS"))
    fp8 = kind == "fp8"
    dtype = {"f32": F32, "bf16": BF16, "f16": F16, "fp8": src}[kind]
    if key is None:
        key = normal(rng, (T, H, D), F32, 3.0)
        value = normal(rng, (T, H, D), F32, 3.0)
        # Tokens that must never be written (PAD slots, tokens past N) carry DEAD_TOKEN.
        dead = [t for t in range(T) if t >= len(slots) or slots[t] < 0]
        key[dead], value[dead] = DEAD_TOKEN, -DEAD_TOKEN
    cache_dtype = FP8 if fp8 else dtype
    a = dict(
        key=np.asarray(key).astype(dtype), value=np.asarray(value).astype(dtype),
        key_cache=poisoned(rng, (NB, BS, H, D), cache_dtype),
        value_cache=poisoned(rng, (NB, BS, H, D), cache_dtype),
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
    kind = pick(rng, ("f32", "bf16", "f16", "fp8"))
    n = pick(rng, (T, T - 2))
    slots = random_slots(rng, n, int(rng.integers(0, 4)), _FLASH_SLOTS, FLASH["BS"],
                   dtype=pick(rng, (np.int32, np.int64)))
    return _flash_inputs(rng, kind, slots, src=pick(rng, (F32, BF16)))


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


def flash_scenarios(cases):
    """Scenarios of ``reshape_and_cache_flash``: ``cases`` random, then the adversarial ones."""
    T, BS = FLASH["T"], FLASH["BS"]
    cmp = {"*": BITWISE}
    random_case = (_flash_random,
                   "random dtype (f32/bf16/f16/fp8), N in {T, T-2}, 0-3 PAD slots")
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
    return op_scenarios("reshape_and_cache_flash", cases, cmp, random_case, fixed)


MLA = dict(T=6, L=16, R=8, NB=4, BS=4)
_MLA_SLOTS = MLA["NB"] * MLA["BS"]


def _mla_inputs(rng, kind, slots, *, scale=None, values=None):
    T, Lr, R, NB, BS = (MLA[k] for k in ("T", "L", "R", "NB", "BS"))
    fp8 = kind == "fp8"
    dtype = {"f32": F32, "bf16": BF16, "fp8": BF16}[kind]
    if values is None:
        kv_c, k_pe = normal(rng, (T, Lr), F32, 3.0), normal(rng, (T, R), F32, 3.0)
        dead = [t for t in range(T) if t >= len(slots) or slots[t] < 0]
        kv_c[dead], k_pe[dead] = DEAD_TOKEN, -DEAD_TOKEN
    else:
        kv_c, k_pe = values
    a = dict(kv_c=kv_c.astype(dtype), k_pe=k_pe.astype(dtype),
             kv_cache=poisoned(rng, (NB, BS, Lr + R), FP8 if fp8 else dtype),
             slot_mapping=np.asarray(slots), kv_cache_dtype="fp8" if fp8 else "auto", scale=None)
    if fp8:
        a["scale"] = np.asarray([scale if scale is not None else rng.uniform(0.3, 1.5)], np.float32)
    return a


def _mla_random(seed):
    rng = np.random.default_rng(seed)
    T = MLA["T"]
    n = pick(rng, (T, T - 2))
    slots = random_slots(rng, n, int(rng.integers(0, 3)), _MLA_SLOTS, MLA["BS"])
    return _mla_inputs(rng, pick(rng, ("f32", "bf16", "fp8")), slots)


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


def mla_scenarios(cases):
    """Scenarios of ``concat_and_cache_mla``: ``cases`` random, then the adversarial ones."""
    T, BS = MLA["T"], MLA["BS"]
    cmp = {"*": BITWISE}
    random_case = (_mla_random,
                   "random dtype (f32/bf16/fp8), N in {T, T-2}, 0-2 PAD slots")
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
    return op_scenarios("concat_and_cache_mla", cases, cmp, random_case, fixed)
