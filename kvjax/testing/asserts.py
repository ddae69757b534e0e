"""Assertions for kernel and state tests: whole arrays, bit for bit, TPU race checks, and the
near-tie rule for greedy tokens checked against a reference's logits."""

from __future__ import annotations

import numpy as np

try:  # private: the TPU interpreter's race state (JAX's own tests read it the same way)
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as _tpu_interpret
except ImportError:  # pragma: no cover - depends on the JAX version
    _tpu_interpret = None

TPU_INTERPRET_BACKENDS = ("pallas_tpu",)

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def bits(x) -> np.ndarray:
    """The raw bits of an array (NaN payloads and -0.0 included) as unsigned ints."""
    x = np.asarray(x)
    return x.view(_UINT[x.dtype.itemsize])


def assert_bitwise(actual, expected, name: str = "array") -> None:
    """``actual`` and ``expected`` have the same dtype width, shape and every bit.

    The message names the array, how many elements differ, the first index and
    both values in hex.
    """
    a, e = bits(actual), bits(expected)
    assert a.dtype == e.dtype and a.shape == e.shape, (
        f"{name}: {np.asarray(actual).dtype}{a.shape} vs {np.asarray(expected).dtype}{e.shape}"
    )
    diff = np.argwhere(a != e)
    if diff.size:
        i = tuple(int(v) for v in diff[0])
        raise AssertionError(
            f"{name}: {len(diff)} elements differ, first at {i}: got {a[i]:#x}, expected {e[i]:#x}"
        )


def greedy_match(ref_logits: np.ndarray, out: np.ndarray, tie) -> tuple[np.ndarray, np.ndarray]:
    """Per row, bools ``(ok, near_tie)``: greedy token ``out[i]`` is the reference row's argmax or
    within a near tie of it (the reference's logit of ``out[i]`` at most ``tie`` below the row's
    max; ``tie`` a number or one per row); ``near_tie``: ok, and not the argmax."""
    rows = np.arange(len(out))
    ok = ref_logits.max(-1) - ref_logits[rows, out] <= tie
    return ok, ok & (ref_logits.argmax(-1) != out)


def races_found() -> bool | None:
    """The TPU interpreter's race flag, or ``None`` when this JAX does not expose it."""
    races = getattr(_tpu_interpret, "races", None)
    return None if races is None else bool(races.races_found)


def assert_no_races(backend: str) -> None:
    """After a kernel call with ``backend``: the TPU interpreter's race detector found nothing.

    A no-op for backends that do not run the TPU kernel in interpret mode. For
    ``"pallas_tpu"`` it FAILS when the race state is unavailable (a race check
    that cannot run must not pass silently), and when a race was found.
    """
    if backend not in TPU_INTERPRET_BACKENDS:
        return
    found = races_found()
    if found is None:
        raise AssertionError(
            "TPU interpret-mode race detection is unavailable in this JAX "
            "(jax._src.pallas.mosaic.interpret.interpret_pallas_call.races); "
            "update kvjax.testing.asserts.races_found"
        )
    assert not found, "TPU interpret mode detected a race"
