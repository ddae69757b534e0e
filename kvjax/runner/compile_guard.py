"""Counting JAX traces and compiles, to prove nothing compiles at serving time.

Uses only public JAX means: ``jax.monitoring`` duration events for tracing and
backend compilation, and the ``jax.no_tracing`` context (strict mode).
"""

from __future__ import annotations

import contextlib
import threading
import warnings

import jax

from pallas_kernels import backend as kernel_backend

_TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class ServingCompileError(RuntimeError):
    """Something traced or compiled while serving (strict mode)."""


def check_compiles_ahead(backend: str) -> None:
    """``ValueError`` unless a step with kernel ``backend`` can be compiled ahead of time here.

    The Pallas TPU interpreter (``backend="pallas"`` or ``"pallas_tpu"`` where there is no
    TPU, or ``"auto"`` with ``KVJAX_INTERPRET=1`` on a CPU) runs each kernel through host
    callbacks that trace when the step runs, so a strict :class:`ServingGuard` stops the
    first step. The GPU kernels' interpreter lowers to plain XLA and compiles ahead of time.
    """
    choice = kernel_backend.resolve(backend, None)
    if choice.flavor == "tpu" and choice.interpret:
        raise ValueError(
            f"backend={backend!r} on {kernel_backend.platform()} runs the TPU kernels through the "
            "Pallas TPU interpreter, which traces at run time: the step cannot be compiled ahead of "
            "time. Use --backend pallas_gpu (the GPU kernels, interpreted as XLA, compiled ahead "
            "of time) or --backend reference, or pass --no-strict to run it with compiles at "
            "serving time"
        )


class CompileCounter:
    """Counts traces and backend compiles process-wide while installed."""

    _lock = threading.Lock()
    _installed: "CompileCounter | None" = None

    def __init__(self):
        self.traces = 0
        self.compiles = 0

    def _listener(self, event: str, duration: float, **kwargs) -> None:
        if event == _TRACE_EVENT:
            self.traces += 1
        elif event == _COMPILE_EVENT:
            self.compiles += 1

    @classmethod
    def get(cls) -> "CompileCounter":
        """The process-wide counter (installed on first use; listeners cannot be removed singly)."""
        with cls._lock:
            if cls._installed is None:
                cls._installed = CompileCounter()
                jax.monitoring.register_event_duration_secs_listener(cls._installed._listener)
            return cls._installed


class ServingGuard:
    """Wraps serving-time work: counts compiles/traces inside it.

    ``strict=True``: any trace is an error (``jax.no_tracing``) and any compile
    raises :class:`ServingCompileError`; otherwise each is a counted warning.
    """

    def __init__(self, strict: bool = True):
        self.strict = strict
        self.serving_compiles = 0
        self.serving_traces = 0
        self._counter = CompileCounter.get()

    @contextlib.contextmanager
    def serving(self):
        c0, t0 = self._counter.compiles, self._counter.traces
        ctx = jax.no_tracing() if self.strict else contextlib.nullcontext()
        try:
            with ctx:
                yield
        except RuntimeError as e:
            if self.strict and "tracing" in str(e):
                self.serving_traces += 1
                raise ServingCompileError(f"a JAX trace happened at serving time: {e}") from e
            raise
        finally:
            dc, dt = self._counter.compiles - c0, self._counter.traces - t0
            self.serving_compiles += dc
            self.serving_traces += dt
        if dc or dt:
            msg = f"{dc} compile(s) and {dt} trace(s) happened at serving time"
            if self.strict:
                raise ServingCompileError(msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=3)
