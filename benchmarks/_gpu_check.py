"""The harness the gpu_check scripts share: register cases, run them, summarise.

A case is a function returning ``""`` (pass) or a message (fail); an exception
fails it with the traceback. Scripts run from the repository root as
``PYTHONPATH=. python benchmarks/gpu_check_<op>.py`` (this folder is then on
``sys.path``).
"""

from __future__ import annotations

import sys
import traceback

import jax

RESULTS: list[tuple[str, bool, str]] = []
CASES: list = []


def case(name):
    """Register the decorated function as check ``name`` (run by :func:`run_cases`)."""

    def register(fn):
        def run():
            try:
                msg = fn()
            except Exception:  # noqa: BLE001 - report and carry on
                msg = "exception:\n" + traceback.format_exc(limit=6)
            RESULTS.append((name, not msg, msg or ""))
            print(f"{'PASS' if not msg else 'FAIL'} {name}{'' if not msg else ': ' + msg}", flush=True)

        CASES.append(run)
        return fn

    return register


def on_gpu_or_allowed(what: str) -> bool:
    """True on a GPU backend (or with ``--allow-cpu``); otherwise prints a FAIL line."""
    print(f"jax {jax.__version__}, devices {jax.devices()}", flush=True)
    if jax.default_backend() not in ("gpu", "cuda", "rocm") and "--allow-cpu" not in sys.argv:
        print(f"FAIL no GPU backend: this script checks {what}", flush=True)
        return False
    return True


def run_cases() -> None:
    for run in CASES:
        run()


def summary() -> int:
    """Print the PASS count and return the exit status (1 if anything failed)."""
    failed = [name for name, ok, _ in RESULTS if not ok]
    print(f"\n{len(RESULTS) - len(failed)}/{len(RESULTS)} checks passed"
          + (f"; FAILED: {failed}" if failed else ""), flush=True)
    return 1 if failed else 0
