"""The kernels' contract: sentinels and argument checks shared by every op.

Sentinels (never mixed, vLLM PR 35431):

* ``PAD_SLOT_ID = -1`` appears only in slot mappings (token -> flat KV slot).
  A write whose slot is negative writes nothing at all.
* ``PAD_ROW_ID = -1`` appears only in ``idx_mapping`` (batch row -> request row):
  the batch row is padding, with no tokens, no logits and no block-table row.
* ``NULL_BLOCK_ID = 0`` appears only in block tables and recurrent-state
  indices. Block 0 of every cache and slot 0 of every state pool is reserved:
  never allocated, its contents never trusted, never read or written by a kernel.

Argument checks raise ``ValueError`` naming the argument, the expectation and
what came:

* static (shapes, dtypes, ranks): always run, at trace time.
* value checks (ids in range, non-decreasing offsets): run only when the array
  is concrete (not a tracer); under ``jit`` the kernels mask invalid entries
  instead. A value check is never replaced by a clamp.

``kvjax.constants`` re-exports the sentinels: this module is their one definition.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

PAD_SLOT_ID: int = -1
PAD_ROW_ID: int = -1
NULL_BLOCK_ID: int = 0


def is_concrete(x) -> bool:
    """True when ``x`` holds values we can read now (not a tracer)."""
    if isinstance(x, jax.core.Tracer):
        return False
    return True


def concrete_values(x):
    """``x`` as a numpy array if concrete, else ``None``."""
    if not is_concrete(x):
        return None
    return np.asarray(x)


def check_rank(name: str, x, rank: int | Sequence[int]) -> None:
    ranks = (rank,) if isinstance(rank, int) else tuple(rank)
    if np.ndim(x) not in ranks:
        want = " or ".join(str(r) for r in ranks)
        raise ValueError(f"{name} must have rank {want}, got shape {tuple(np.shape(x))}")


def check_shape(name: str, x, shape: Sequence[int | None]) -> None:
    """``x.shape`` must equal ``shape``; ``None`` entries match any size."""
    got = tuple(np.shape(x))
    if len(got) != len(shape) or any(s is not None and s != g for s, g in zip(shape, got)):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name} must have shape {want}, got {list(got)}")


def check_dtype(name: str, x, dtypes) -> None:
    """``x.dtype`` must be one of ``dtypes`` (numpy/jnp dtypes or kinds like 'integer')."""
    dt = np.dtype(x.dtype) if hasattr(x, "dtype") else np.asarray(x).dtype
    allowed = []
    for d in (dtypes if isinstance(dtypes, (tuple, list)) else (dtypes,)):
        if d == "integer":
            if np.issubdtype(dt, np.integer):
                return
            allowed.append("an integer dtype")
        elif d == "floating":
            if jax.numpy.issubdtype(dt, jax.numpy.floating):
                return
            allowed.append("a floating dtype")
        else:
            if dt == np.dtype(d):
                return
            allowed.append(str(np.dtype(d)))
    raise ValueError(f"{name} must have dtype {' or '.join(allowed)}, got {dt}")


def check_values_in_range(name: str, x, lo: int, hi: int, *, allow=()) -> None:
    """When concrete, every value of ``x`` must lie in ``[lo, hi)`` or be in ``allow``."""
    v = concrete_values(x)
    if v is None or v.size == 0:
        return
    ok = (v >= lo) & (v < hi)
    for a in allow:
        ok |= v == a
    if not ok.all():
        bad_idx = tuple(int(i) for i in np.argwhere(~ok)[0])
        extra = f" (or {', '.join(map(str, allow))})" if allow else ""
        raise ValueError(
            f"{name} must have values in [{lo}, {hi}){extra}; "
            f"got {v[bad_idx]} at index {bad_idx if len(bad_idx) > 1 else bad_idx[0]}"
        )


def check_non_decreasing(name: str, x) -> None:
    """When concrete, ``x`` (1-D) must be non-decreasing."""
    v = concrete_values(x)
    if v is None or v.size < 2:
        return
    d = np.diff(v.astype(np.int64))
    if (d < 0).any():
        i = int(np.argmax(d < 0))
        raise ValueError(f"{name} must be non-decreasing; got {v[i]} then {v[i + 1]} at index {i}")


def narrow_ids(name: str, x, lo: int, hi: int, *, fill: int, allow=()) -> jax.Array:
    """Integer ids as int32, range-checked before the narrowing (so ``2**32 + 1`` never reads 1).

    Concrete ``x``: a value outside ``[lo, hi)`` and not in ``allow`` raises ``ValueError``
    (:func:`check_values_in_range` on the original dtype). Traced ``x``: such values become
    ``fill`` (the caller's "writes nothing" value), compared in ``x``'s own dtype. Without
    ``JAX_ENABLE_X64`` a traced int64 is already int32 when the function sees it: pass
    concrete arrays, or enable x64, to have wide ids checked.
    """
    check_dtype(name, x, "integer")
    check_values_in_range(name, x, lo, hi, allow=allow)
    if is_concrete(x):  # every value is in range now, so int32 holds it exactly
        return jax.numpy.asarray(np.asarray(x).astype(np.int32))
    x = jax.numpy.asarray(x)
    info = jax.numpy.iinfo(x.dtype)
    if lo <= info.min and hi > info.max:  # every value is in range: no op to add
        return x.astype(jax.numpy.int32)
    ok = jax.numpy.ones(x.shape, bool)
    if lo > info.min:  # bounds outside the dtype hold already (and would not convert)
        ok &= x >= lo
    if hi <= info.max:
        ok &= x < hi
    for a in allow:
        if info.min <= a <= info.max:
            ok |= x == a
    return jax.numpy.where(ok, x, fill).astype(jax.numpy.int32)


# --------------------------------------------------------------------------
# KV-cache storage
# --------------------------------------------------------------------------

# Accepted ``kv_cache_dtype`` strings -> storage mode ("auto": the input dtype,
# "fp8": float8_e4m3fn with a float32 scale).
KV_CACHE_DTYPES: dict[str, str] = {"auto": "auto", "fp8": "fp8", "fp8_e4m3": "fp8"}
# The dtype of an "fp8" cache (quantisation: pallas_kernels.fp8).
FP8_DTYPE = jnp.float8_e4m3fn


def kv_cache_storage(kv_cache_dtype) -> str:
    """``"auto"`` or ``"fp8"`` for an accepted ``kv_cache_dtype`` string, else ``ValueError``."""
    mode = KV_CACHE_DTYPES.get(kv_cache_dtype) if isinstance(kv_cache_dtype, str) else None
    if mode is None:
        raise ValueError(
            f"kv_cache_dtype must be one of {sorted(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}"
        )
    return mode


def check_fp8_scale(name: str, scale) -> None:
    """When concrete, every value of a float32 fp8 scale must be a positive normal number.

    NaN, 0, negative, +-inf and float32 denormals (whose reciprocal overflows, so
    every stored value saturates) are rejected.
    """
    v = concrete_values(scale)
    if v is None:
        return
    v = v.astype(np.float32)
    ok = np.isfinite(v) & (v >= np.finfo(np.float32).tiny)
    if not ok.all():
        raise ValueError(
            f"{name} must be finite and > 0, a normal float32 (>= "
            f"{np.finfo(np.float32).tiny:.4g}), got {v.tolist()}"
        )


def check_cache_dtype(name: str, cache, mode: str, input_name: str, input_dtype) -> None:
    """A KV cache's dtype for storage ``mode`` (:func:`kv_cache_storage`): ``input_name``'s
    dtype for ``"auto"``, :data:`FP8_DTYPE` for ``"fp8"``."""
    if mode == "auto":
        if np.dtype(cache.dtype) != np.dtype(input_dtype):
            raise ValueError(
                f'{name} must have the dtype of {input_name} ({np.dtype(input_dtype)}) when '
                f'kv_cache_dtype="auto", got {np.dtype(cache.dtype)}'
            )
    elif np.dtype(cache.dtype) != np.dtype(FP8_DTYPE):
        raise ValueError(
            f"{name} must have dtype float8_e4m3fn for an fp8 kv_cache_dtype, got "
            f"{np.dtype(cache.dtype)} (view a uint8 cache with lax.bitcast_convert_type)"
        )


def fp8_scale_array(name: str, scale, sizes: Sequence[int]):
    """A float32 ``[size]`` array from a Python number or a float32 ``[]``/``[size]`` scale."""
    if scale is None:
        raise ValueError(f"{name} is required for an fp8 kv_cache_dtype, got None")
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        scale = np.float32(scale)
    check_dtype(name, scale, np.float32)
    shape = tuple(np.shape(scale))
    allowed = [()] + [(s,) for s in dict.fromkeys(sizes)]
    if shape not in allowed:
        want = " or ".join("[" + ", ".join(map(str, a)) + "]" for a in allowed)
        raise ValueError(f"{name} must have shape {want}, got {list(shape)}")
    check_fp8_scale(name, scale)
    return jnp.reshape(jnp.asarray(scale, jnp.float32), (-1,))


# --------------------------------------------------------------------------
# Integer ids: range check first, then narrow to int32
# --------------------------------------------------------------------------

INT32_MIN, INT32_MAX = int(np.iinfo(np.int32).min), int(np.iinfo(np.int32).max)


def as_int32(name: str, x, *, fill: int = -1) -> jax.Array:
    """Any integer array as int32 for a kernel, never wrapping (:func:`narrow_ids` over
    the int32 range): a concrete value beyond int32 is a ``ValueError``; a traced one
    becomes ``fill`` (default -1), a value the op masks as out of range."""
    return narrow_ids(name, x, INT32_MIN, INT32_MAX + 1, fill=fill)


def live_ids(ids, upper: int, *, lower: int = 0, pad: int = -1):
    """int32 ``ids`` where ``lower <= id < upper``, else ``pad`` (compared before narrowing)."""
    jnp = jax.numpy
    live = (ids >= lower) & (ids < upper)
    return jnp.where(live, ids, jnp.asarray(pad, ids.dtype)).astype(jnp.int32)


def check_ids(name: str, ids, upper: int, *, what: str, lower: int = 0):
    """Checks a 1-D int32/int64 id array whose negative entries are padding.

    Static: rank 1, dtype int32 or int64. Concrete: every id must be negative
    (padding) or in ``[lower, upper)``, else ``ValueError`` naming ``what`` bounds
    ``upper``; an int64 array is then narrowed to int32 on the host (negatives
    become -1), after the check. Traced: returned unchanged (kernels mask with
    :func:`live_ids`, which compares before narrowing).
    """
    check_rank(name, ids, 1)
    check_dtype(name, ids, (np.int32, np.int64))
    v = concrete_values(ids)
    if v is None or v.size == 0:
        return ids
    bad = np.flatnonzero((v >= upper) | ((v >= 0) & (v < lower)))
    if bad.size:
        i = int(bad[0])
        lo = f"[{lower}, {upper})"
        raise ValueError(
            f"{name} values must be in {lo} ({what}), or negative for padding; "
            f"got {int(v[i])} at index {i}"
        )
    if v.dtype == np.int64:
        return np.where(v >= 0, v, -1).astype(np.int32)
    return ids


def live_block_ids(block_ids, num_logical_blocks: int):
    """int32 ``[N]``: the id where it is a real block (not the null block, in range), else -1."""
    return live_ids(block_ids, num_logical_blocks, lower=NULL_BLOCK_ID + 1)


def check_slot_mapping(slot_mapping, num_tokens: int, num_blocks: int, block_size: int):
    """A KV write's ``slot_mapping`` (int32/int64 ``[N]``, ``N <= num_tokens``, valid slots
    unique and below ``num_blocks * block_size``, negative = PAD): static and (when
    concrete) value checks; returns the slot mapping to use.

    A concrete int64 mapping is narrowed to int32 here, on the host, after the
    range check: without ``jax_enable_x64`` JAX would wrap it, and e.g.
    ``-2**32 + 5`` would become the valid slot 5.
    """
    check_rank("slot_mapping", slot_mapping, 1)
    n = np.shape(slot_mapping)[0]
    if n > num_tokens:
        raise ValueError(
            f"slot_mapping must not be longer than the number of tokens: "
            f"{n=} > num_tokens={num_tokens}"
        )
    num_slots = num_blocks * block_size
    if num_slots > INT32_MAX - 1:
        raise ValueError(
            f"num_blocks * block_size must be < {INT32_MAX} (slots are int32 internally), "
            f"got {num_blocks} * {block_size} = {num_slots}"
        )
    slot_mapping = check_ids(
        "slot_mapping", slot_mapping, num_slots,
        what=f"num_blocks={num_blocks} * block_size={block_size}")
    v = concrete_values(slot_mapping)
    if v is None or v.size == 0:
        return slot_mapping
    uniq, counts = np.unique(v[v >= 0], return_counts=True)
    if (counts > 1).any():
        slot = int(uniq[np.argmax(counts > 1)])
        first, second = (int(i) for i in np.flatnonzero(v == slot)[:2])
        raise ValueError(
            f"slot_mapping must not repeat a valid slot (which token lands would be "
            f"unspecified); got slot {slot} at indices {first} and {second}"
        )
    return slot_mapping


def is_int(value) -> bool:
    """Whether ``value`` is an int as the project takes one: a Python or numpy int, not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def static_int(name: str, value, *, minimum: int = 1, power_of_two: bool = False,
               optional: bool = False) -> int | None:
    """The one rule for a kernel's static size (a config field, a static argument): an int
    (:func:`is_int`) >= ``minimum`` (a power of two where asked; None where ``optional``),
    returned as a plain int. ``ValueError`` naming ``name`` otherwise: "must be a power of two"
    or "must be an int >= minimum", with "or None" where None is allowed."""
    if value is None and optional:
        return None
    if not is_int(value) or value < minimum or (power_of_two and (value < 1 or value & (value - 1))):
        want = "a power of two" if power_of_two else f"an int >= {minimum}"
        raise ValueError(f"{name} must be {want}{' or None' if optional else ''}, got {value!r}")
    return int(value)


def check_config_ints(config, powers_of_two: Sequence[str] = ()) -> None:
    """The one rule for a kernel config's sizes: each field of the frozen dataclass ``config``
    declared ``int`` must be a Python or numpy int (not a bool) >= 1, and each declared
    ``int | None`` that or None; the fields named in ``powers_of_two``, and every
    ``gpu_num_warps`` (Triton's warps are a power of two), must be powers of two.
    Numpy ints are stored back as plain ints. ``ValueError`` from :func:`static_int`, naming
    ``Config.field``, otherwise. Call it from the config's ``__post_init__``."""
    for f in dataclasses.fields(config):
        kind = str(f.type).replace(" ", "")
        if kind in ("int", "int|None"):
            v = static_int(f"{type(config).__name__}.{f.name}", getattr(config, f.name),
                           power_of_two=f.name in powers_of_two or f.name == "gpu_num_warps",
                           optional=kind == "int|None")
            object.__setattr__(config, f.name, v)
