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

from kvjax.runner.runner import Runner, RunnerConfig
from tests.cuda_lowering import abstract_cuda

CONFIGS = {
    "plain": RunnerConfig(backend="pallas_gpu", max_num_batched_tokens=8, max_num_seqs=4),
    "spec-fp8": RunnerConfig(backend="pallas_gpu", num_speculative_tokens=1, kv_cache_dtype="fp8",
                             max_num_batched_tokens=8, max_num_seqs=2),
    "rpa-layout": RunnerConfig(backend="pallas_gpu", kv_layout="rpa", max_num_batched_tokens=4,
                               max_num_seqs=2),
}


def _lower_for_cuda(fn, args, config) -> str:
    """StableHLO text of ``fn(*args)`` lowered for CUDA under an abstract CUDA device."""
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), args)
    with abstract_cuda(), jax.default_matmul_precision(config.matmul_precision):
        return fn.trace(*abstract).lower(lowering_platforms=("cuda",)).as_text()


def _triton_calls(text: str) -> int:
    return text.count('custom_call @"__gpu$xla.gpu.triton"') + text.count("custom_call @__gpu$xla.gpu.triton")


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_bucket_lowers_for_cuda_with_verified_triton_kernels(name, verified_triton_modules):
    config = CONFIGS[name]
    runner = Runner(config)
    for bucket in runner.buckets.buckets:
        fn, args, _ = runner.jitted_step(bucket)
        before = len(verified_triton_modules)
        calls = _triton_calls(_lower_for_cuda(fn, args, config))
        assert calls >= 5, (bucket, calls)  # KV write, zeroing, combine, conv, SSM at least
        assert len(verified_triton_modules) > before, bucket


def test_step_lowers_for_cuda_with_its_state_donated(verified_triton_modules):
    """The rows' arrays (request fields, block tables, input and output areas) and every pool are
    donated (aliased to outputs), and the step reads nothing else but the params: its inputs are
    staged into the input area by another program, so on a GPU every launch of the step's CUDA
    graph sees the same buffers."""
    config = CONFIGS["plain"]
    runner = Runner(config)
    bucket = runner.buckets.buckets[-1]
    fn, args, _ = runner.jitted_step(bucket)
    text = _lower_for_cuda(fn, args, config)
    assert _triton_calls(text) >= 5
    rows = len(jax.tree.leaves(runner._rows))
    assert rows == len(runner._split_rows(runner._initial_rows())) + 2  # + the input and output areas
    assert text.count("tf.aliasing_output") == rows + len(runner.pool_specs)
    assert len(jax.tree.leaves(args)) == len(jax.tree.leaves(runner.params)) + rows + len(runner.pool_specs)
