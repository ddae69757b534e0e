import os

# Tests run on the CPU; the GPU checks live in benchmarks/.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

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
