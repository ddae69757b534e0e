"""XLA:CPU settings that make compiles fast, for a test suite and the processes it starts.

On a CPU the test suite is compile-bound (step programs, dense oracles, Pallas kernels run by
the interpreter). These settings change how XLA:CPU generates code, not what a program
computes, and every test still checks its results against an oracle:

* ``xla_backend_optimization_level=0`` and ``xla_llvm_disable_expensive_passes``: LLVM code
  generation only (what JAX's ``jax_disable_most_optimizations`` sets); the optimised HLO is the
  same text at either level.
* ``xla_cpu_use_fusion_emitters=false``: XLA:CPU's older fusion emitters instead of the MLIR
  ones; they fuse some reductions differently (so the optimised HLO is not byte for byte the
  default's) and compile each program ~1.2-2x faster. jaxlib 0.11 has no such option (and
  refuses it): there the settings leave it out.

* ``xla_cpu_parallel_codegen_split_count=1``: a program's LLVM module is compiled whole, not split
  into up to 32 parts for a pool of compile threads (XLA's default): ~20% less CPU time per
  compile (a 7-test file of runner compiles: 100 -> 81 CPU-s), and no compile threads beside
  the suite's two xdist workers on two cores. Set where it was checked to exist (jaxlib 0.10,
  the CI's): an unknown flag in ``XLA_FLAGS`` stops XLA.

Together they cut the CPU time of a compile-bound test file about in half.
``tests/conftest.py`` puts :data:`FAST_XLA_FLAGS` in ``XLA_FLAGS`` for the whole suite (child
processes inherit it); a script that sets ``XLA_FLAGS`` itself adds them with
:func:`with_fast_xla_flags`. Per-executable ``compiler_options`` override ``XLA_FLAGS``: a test
of the compiled program's own structure (its HLO, its memory analysis) passes
:data:`DEFAULT_FUSION_OPTIONS` to check the fusions a user gets; a test of exact numbers passes
:data:`XLA_DEFAULT_COMPILER_OPTIONS`.
"""

from __future__ import annotations

import jaxlib


def _jaxlib_0_10(**options) -> dict:
    """``options`` under jaxlib < 0.11, else none. Its XLA has ``xla_cpu_use_fusion_emitters``,
    which jaxlib 0.11 dropped (XLA exits with "Unknown flag in XLA_FLAGS" when it is set), and
    the split count was checked there; under 0.11 the settings leave both out."""
    major, minor = (int(x) for x in jaxlib.__version__.split(".")[:2])
    return options if (major, minor) < (0, 11) else {}


#: XLA:CPU's default number of parts a program's LLVM module is split into for compiling.
XLA_DEFAULT_SPLIT_COUNT = 32


#: The settings, as XLA compile options.
FAST_COMPILER_OPTIONS = {
    "xla_backend_optimization_level": 0,
    "xla_llvm_disable_expensive_passes": True,
    **_jaxlib_0_10(xla_cpu_use_fusion_emitters=False, xla_cpu_parallel_codegen_split_count=1),
}

#: The same settings in ``XLA_FLAGS`` form.
FAST_XLA_FLAGS = " ".join(f"--{k}={str(v).lower()}" for k, v in FAST_COMPILER_OPTIONS.items())

#: Per-executable options that restore XLA:CPU's default fusion emitters under
#: :data:`FAST_XLA_FLAGS` (the optimisation level stays 0: it leaves the optimised HLO as it is).
DEFAULT_FUSION_OPTIONS = {"xla_backend_optimization_level": 0, **_jaxlib_0_10(xla_cpu_use_fusion_emitters=True)}

#: XLA's own defaults of these options, for a test whose numbers must be those of the program a
#: user gets on a CPU: level 0 changes how dots accumulate (a float32 ulp or so), and with the
#: older fusion emitters it flushes some subnormal results of ``kv_write.ieee_divide`` to zero.
XLA_DEFAULT_COMPILER_OPTIONS = {
    "xla_backend_optimization_level": 2,
    "xla_llvm_disable_expensive_passes": False,
    **_jaxlib_0_10(xla_cpu_use_fusion_emitters=True,
                   xla_cpu_parallel_codegen_split_count=XLA_DEFAULT_SPLIT_COUNT),
}


def with_fast_xla_flags(flags: str | None = None) -> str:
    """``flags`` (an ``XLA_FLAGS`` value; None or empty: none) with :data:`FAST_XLA_FLAGS`
    instead of any setting of the same options."""
    names = {f"--{k}" for k in FAST_COMPILER_OPTIONS}
    kept = [f for f in (flags or "").split() if f.split("=", 1)[0] not in names]
    return " ".join([*kept, FAST_XLA_FLAGS])
