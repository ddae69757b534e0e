"""The step reads each step's inputs from its input area, which a staging program
fills before every launch (``Runner._stage``), and its outputs come back through the output area
(``Runner._fetch``). A launch that skipped the staging would run the step on stale inputs: the
serving loops would then spin without progress rather than fail, so this checks one step at a
time."""

import types

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kvjax.host.scheduler import Request
from kvjax.models.tiny_hybrid import TinyHybridConfig
from kvjax.runner import Runner, RunnerConfig
from kvjax.testing.fast_compile import FAST_COMPILER_OPTIONS

FAST = FAST_COMPILER_OPTIONS  # kvjax.testing.fast_compile (also in XLA_FLAGS, tests/conftest.py)


def test_each_step_runs_on_its_own_staged_inputs():
    """Twice on one runner (one step compile): with the inputs and outputs in device memory, then
    staged from and fetched to pinned host memory, as a GPU runner does (the CPU has that memory
    kind too, so the same programs run here)."""
    cfg = RunnerConfig(model=TinyHybridConfig(layer_types=("attn", "mamba")), block_size=16, num_blocks=64,
                       max_model_len=96, max_num_seqs=4, max_num_batched_tokens=16, token_sizes=(4, 16),
                       max_new_requests_per_step=2)
    runner = Runner(cfg, compiler_options=FAST)
    runner.precompile()
    runner.warm_up()
    for memory in ("device", "pinned_host"):
        if memory == "pinned_host":  # the staging and fetch programs again, for host memory
            runner.__dict__["_transfer_sharding"] = NamedSharding(runner.mesh, P("data"), memory_kind=memory)
            runner.__dict__.pop("_stage")
            runner._fetches.clear()
            runner.reset()
        sched = cfg.make_scheduler()
        sched.add_request(Request("a", [3, 4, 5, 6], 3, 0))
        first = sched.schedule()
        out = runner.execute(first)
        assert not out.dummy
        np.testing.assert_array_equal(out.num_sampled, [1, 0, 0, 0])  # the prompt's step samples its token
        sched.update(first, out.sampled, out.num_sampled, out.logits)
        sched.add_request(Request("b", [9, 8], 2, 1))
        second = sched.schedule()
        out = runner.execute(second)  # new inputs: a decode row and a new request's prompt
        assert sorted(out.num_sampled.tolist()) == [0, 0, 1, 1], memory
        assert runner.put_inputs(runner.prepare(None)).sharding.memory_kind == memory


def test_a_gpu_runner_stages_through_pinned_host_memory(monkeypatch):
    """On a GPU the step's per-step buffers live in pinned host memory (a device buffer allocated
    between steps moved the step's temporaries, and XLA then updated the step's CUDA graph at every
    launch); elsewhere they stay in device memory."""
    cfg = RunnerConfig(model=TinyHybridConfig(layer_types=("attn",)), block_size=16, num_blocks=8,
                       max_model_len=32, max_num_seqs=2, max_num_batched_tokens=4, token_sizes=(4,))
    runner = Runner(cfg, compiler_options=FAST)
    assert runner._transfer_sharding.memory_kind in (None, "device")
    prepared = types.SimpleNamespace(buf=np.zeros((runner.num_ranks, runner._input_words), np.int32))
    assert runner.put_inputs(prepared).sharding.memory_kind == "device"
    del runner.__dict__["_transfer_sharding"]
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert runner._transfer_sharding.memory_kind == "pinned_host"
    monkeypatch.undo()
    assert runner.put_inputs(prepared).sharding.memory_kind == "pinned_host"
