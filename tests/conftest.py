import os

# Tests run on the CPU; the GPU checks live in benchmarks/.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from kvjax.testing.fast_compile import with_fast_xla_flags  # noqa: E402

# Every XLA compile of the suite, and of the processes it starts (they inherit XLA_FLAGS), at
# kvjax.testing.fast_compile's settings: LLVM code generation at level 0 and XLA:CPU's older
# fusion emitters, about half the CPU time of each compile; what programs compute is checked
# against oracles either way. Read when JAX creates its CPU client, after this.
os.environ["XLA_FLAGS"] = with_fast_xla_flags(os.environ.get("XLA_FLAGS"))

import jax  # noqa: E402

# CPU programs run inline, not dispatched to a thread: XLA:CPU's asynchronous dispatch can hang
# a program that calls back into Python (jax-ml/jax#25861, open), and the suite calls back a
# lot: the Pallas TPU interpreter's every memory access, and jax.debug.callback counters. Read
# when JAX creates its CPU client, after this; processes the suite starts keep JAX's default.
jax.config.update("jax_cpu_enable_async_dispatch", False)

from kvjax.testing import vllm as _vllm_oracle  # noqa: E402

# Before any test imports transformers (which imports Triton): the vLLM oracle's Triton
# kernels, and Triton's own tl.sum & co., must be decorated for the interpreter on a CPU.
_vllm_oracle.use_interpreter_without_gpu()

import pytest  # noqa: E402
from jax._src.pallas.triton import lowering as triton_lowering  # noqa: E402


@pytest.fixture
def verified_triton_modules(monkeypatch):
    """Every Pallas Triton module built while the test runs, run through the MLIR verifier as it
    is built (a module that fails is what a GPU's XLA rejects: "Failed to parse Triton module").
    Returns the list of modules built."""
    built = []
    build = triton_lowering.lower_jaxpr_to_triton_module

    def build_and_verify(*args, **kwargs):
        result = build(*args, **kwargs)
        result.module.operation.verify()  # raises MLIRError naming the op that fails
        built.append(result)
        return result

    monkeypatch.setattr(triton_lowering, "lower_jaxpr_to_triton_module", build_and_verify)
    return built


@pytest.fixture(scope="session")
def vllm_oracle():
    """``kvjax.testing.vllm`` once its oracle is known to be available; the test skips otherwise.

    CI installs the oracle and sets ``KVJAX_REQUIRE_VLLM_ORACLE=1``: there it must be available,
    and an unavailable oracle fails instead of skipping the tests it guards."""
    if not _vllm_oracle.available():
        why = _vllm_oracle.reason()
        if os.environ.get("KVJAX_REQUIRE_VLLM_ORACLE") == "1":
            pytest.fail(f"KVJAX_REQUIRE_VLLM_ORACLE=1 but the vLLM oracle is unavailable: {why}")
        pytest.skip(f"vLLM oracle unavailable: {why}")
    return _vllm_oracle
