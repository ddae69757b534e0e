"""The Runner's compiler options: command buffers on a GPU, XLA's defaults elsewhere; the GPU
options are ones XLA accepts (names and values, checked by XLA itself on any backend), and the
Runner's step executables are compiled with the options it holds."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from kvjax.runner import Runner, RunnerConfig
from kvjax.runner import runner as runner_mod


def test_gpu_default_compiler_options(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    opts = runner_mod.default_compiler_options()
    assert opts == runner_mod.GPU_COMPILER_OPTIONS and opts is not runner_mod.GPU_COMPILER_OPTIONS
    assert "CUSTOM_CALL" in opts["xla_gpu_enable_command_buffer"].split(",")
    assert "WHILE" in opts["xla_gpu_enable_command_buffer"].split(",")
    assert opts["xla_gpu_graph_min_graph_size"] == 1


def test_no_compiler_options_off_gpu(monkeypatch):
    for platform in ("cpu", "tpu"):
        monkeypatch.setattr(jax, "default_backend", lambda p=platform: p)
        assert runner_mod.default_compiler_options() is None


def test_xla_accepts_the_gpu_compiler_options():
    """XLA parses every option into its DebugOptions whatever the backend: a misspelt name
    ('No such compile option') or a bad value (an unknown command-buffer type, a non-int)
    fails this compile on the CPU as it would fail every step compile on a GPU."""
    f = jax.jit(lambda x: x * 2 + 1, compiler_options=dict(runner_mod.GPU_COMPILER_OPTIONS))
    assert f.lower(jnp.ones(3)).compile()(jnp.ones(3)).tolist() == [3.0, 3.0, 3.0]
    with pytest.raises(Exception, match="No such compile option: 'xla_gpu_enable_command_bufer'"):
        jax.jit(lambda x: x, compiler_options={"xla_gpu_enable_command_bufer": "FUSION"}).lower(1.0).compile()


def test_the_runner_compiles_its_steps_with_its_compiler_options():
    """An option only XLA can refuse proves the Runner's options reach the step's compile."""
    config = RunnerConfig(max_model_len=16, num_blocks=4, block_size=4, max_num_seqs=1, token_sizes=(2,))
    assert Runner(config).compiler_options is None  # CPU: XLA's defaults
    runner = Runner(config, compiler_options={"xla_kvjax_no_such_option": 1})
    with pytest.raises(Exception, match="No such compile option: 'xla_kvjax_no_such_option'"):
        runner.precompile()
