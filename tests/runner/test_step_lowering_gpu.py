"""The whole bucketed step lowers for an NVIDIA GPU on this CPU, every Triton kernel verified.

The step is the one :class:`~kvjax.runner.Runner` compiles, lowered with
``lowering_platforms=("cuda",)`` under an abstract CUDA device (so every op picks
its compiled GPU kernel, not the interpreter). Each Pallas Triton kernel's MLIR
module is run through the MLIR verifier as it is built: a module that does not
verify is what the GPU's XLA rejects at compile time ("Failed to parse Triton
module"), which no CPU test would otherwise see.
"""

from __future__ import annotations

import jax
import pytest
from jax._src.pallas.triton import lowering as triton_lowering

from kvjax.runner.runner import Runner, RunnerConfig

CUDA = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=None, platform="cuda")
CONFIGS = {
    "plain": RunnerConfig(backend="pallas_gpu", max_num_batched_tokens=8, max_num_seqs=4),
    "spec-fp8": RunnerConfig(backend="pallas_gpu", num_speculative_tokens=1, kv_cache_dtype="fp8",
                             max_num_batched_tokens=8, max_num_seqs=2),
    "rpa-layout": RunnerConfig(backend="pallas_gpu", kv_layout="rpa", max_num_batched_tokens=4,
                               max_num_seqs=2),
}


@pytest.fixture
def verified_modules(monkeypatch):
    """Every Triton module built while the test runs, verified (MLIR errors raised)."""
    built = []
    build = triton_lowering.lower_jaxpr_to_triton_module

    def build_and_verify(*args, **kwargs):
        result = build(*args, **kwargs)
        result.module.operation.verify()  # raises MLIRError naming the op that fails
        built.append(result)
        return result

    monkeypatch.setattr(triton_lowering, "lower_jaxpr_to_triton_module", build_and_verify)
    return built


def _abstract(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_bucket_lowers_for_cuda_with_verified_triton_kernels(name, verified_modules):
    config = CONFIGS[name]
    runner = Runner(config)
    mesh = jax.sharding.get_abstract_mesh()
    for bucket in runner.buckets.buckets:
        fn, args, _ = runner.jitted_step(bucket)
        before = len(verified_modules)
        with jax.sharding.use_abstract_mesh(mesh.update(abstract_device=CUDA)), \
                jax.default_matmul_precision(config.matmul_precision):
            text = fn.trace(*_abstract(args)).lower(lowering_platforms=("cuda",)).as_text()
        calls = text.count('custom_call @"__gpu$xla.gpu.triton"') + text.count("custom_call @__gpu$xla.gpu.triton")
        assert calls >= 5, (bucket, calls)  # KV write, zeroing, combine, conv, SSM at least
        assert len(verified_modules) > before, bucket


def test_packed_layout_lowers_for_cuda_with_its_state_donated(verified_modules):
    """The GPU default argument layout (``layout="packed"``, stable input) lowers too: the rows
    buffer and every cache are donated (aliased to outputs), the input is read through one barrier."""
    config = CONFIGS["plain"]
    runner = Runner(config, layout="packed")
    bucket = runner.buckets.buckets[-1]
    fn, args, _ = runner.jitted_step(bucket)
    mesh = jax.sharding.get_abstract_mesh()
    with jax.sharding.use_abstract_mesh(mesh.update(abstract_device=CUDA)), \
            jax.default_matmul_precision(config.matmul_precision):
        text = fn.trace(*_abstract(args)).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count('custom_call @"__gpu$xla.gpu.triton"') + text.count("custom_call @__gpu$xla.gpu.triton") >= 5
    assert text.count("tf.aliasing_output") == 1 + len(jax.tree.leaves(runner._pstate.caches))
    assert text.count("optimization_barrier") == 1
