"""``benchmarks/bench_moe.py``'s sweep options: the configs given on the command line (``-`` for
a rule's None) and a malformed one refused by name (the sweep itself needs a GPU)."""

from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import bench_moe  # noqa: E402


def test_sweep_configs_parse():
    assert bench_moe.parse_configs("-,-,-,-;256,64,8,4; 128, 32, 8, 5 ;") == [
        (None, None, None, None), (256, 64, 8, 4), (128, 32, 8, 5)]
    assert bench_moe.parse_configs("") == []
    with pytest.raises(SystemExit, match="--sweep-configs: each config is bn,bk,warps,stages, got '128,64,8'"):
        bench_moe.parse_configs("128,64,8")


def test_sweep_lists_are_configs():
    """Every listed config builds (the rule's entry first in each list)."""
    from pallas_kernels import GroupedMatmulConfig

    for sweep in (bench_moe.SWEEP, bench_moe.SWEEP_FEW, bench_moe.SWEEP_MANY):
        assert sweep[0] == (None, None, None, None)
        for bn, bk, warps, stages in sweep:
            GroupedMatmulConfig(gpu_block_n=bn, gpu_block_k=bk, gpu_num_warps=warps, gpu_num_stages=stages)
