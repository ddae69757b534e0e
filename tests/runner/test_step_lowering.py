"""The whole bucketed step of the demo model lowers for TPU on this CPU, every bucket.

The step is the one :class:`~kvjax.runner.Runner` compiles (``Runner.jitted_step``:
``step_fn`` under ``shard_map`` on the 1x1 mesh, jitted with the device state donated), exported for TPU through
``pallas_kernels.tpu_target.export`` with ``backend="pallas_tpu"``: the exported
module must hold the Mosaic kernels (KV write, block zeroing, token combine, SSM and
conv updates) and keep the state donated. The mesh-sharded step (2x2) is lowered in
tests/mesh/test_mesh.py (it needs several host devices, so a subprocess).
"""

from __future__ import annotations

import re

import jax
import pytest

from kvjax.models import TinyHybridConfig
from kvjax.runner.runner import Runner, RunnerConfig
from pallas_kernels import tpu_target

# Named Mosaic kernels every step runs (the Mamba updates are unnamed "kernel"s).
COMMON = {"zero_blocks_tpu", "combine_sampled_and_draft_tokens_tpu"}
# name -> (config, Mosaic kernels per step, named kernels): KV write, zeroing of KV and of
# states, token combine, conv and SSM updates; with the RPA layout JAX's attention kernel too.
CONFIGS = {
    "plain": (RunnerConfig(backend="pallas_tpu", max_num_batched_tokens=8, max_num_seqs=4), 6,
              COMMON | {"kv_write_tpu"}),
    "spec-fp8": (RunnerConfig(backend="pallas_tpu", num_speculative_tokens=1, kv_cache_dtype="fp8",
                              max_num_batched_tokens=8, max_num_seqs=2), 6, COMMON | {"kv_write_tpu"}),
    # K/V in JAX's ragged-paged-attention layout (write_kv_pages' own TPU kernel + JAX's RPA
    # kernel, which needs head_dim % 128 == 0).
    "rpa-layout": (RunnerConfig(model=TinyHybridConfig(head_dim=128), backend="pallas_tpu",
                                kv_layout="rpa", max_num_batched_tokens=4, max_num_seqs=2), 7,
                   COMMON | {"kv_pages_tpu"}),
}


def _abstract(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_bucket_lowers_for_tpu(name):
    config, kernels_per_step, named = CONFIGS[name]
    runner = Runner(config)
    num_state_leaves = len(jax.tree.leaves(runner._rows)) + len(runner.pool_specs)  # rows' arrays, every pool
    assert len(runner.buckets.buckets) >= 2
    for bucket in runner.buckets.buckets:
        fn, args, _ = runner.jitted_step(bucket)
        with jax.default_matmul_precision(config.matmul_precision):
            text = tpu_target.export(fn, *_abstract(args)).mlir_module()
        kernels = re.findall(r'kernel_name = "([^"]*)"', text)
        assert text.count("stablehlo.custom_call @tpu_custom_call") == kernels_per_step, bucket
        assert named <= set(kernels), (bucket, kernels)
        # The donated state: every leaf aliases an output of the step.
        assert text.count("tf.aliasing_output") == num_state_leaves, bucket


def test_rpa_layout_rejects_a_head_dim_the_tpu_kernel_cannot_take():
    runner = Runner(RunnerConfig(backend="pallas_tpu", kv_layout="rpa", max_num_batched_tokens=2,
                                 max_num_seqs=1))  # the demo model's head_dim is 16
    fn, args, _ = runner.jitted_step(runner.buckets.buckets[0])
    with pytest.raises(ValueError, match="head_dim must be a multiple of 128 .* got 16"):
        tpu_target.export(fn, *_abstract(args))
