"""The Runner's defaults: XLA command buffers and the packed argument layout on a GPU, XLA's
options and the tree layout elsewhere."""

from __future__ import annotations

import jax

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


def test_default_layout_is_packed_on_gpu_only(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert runner_mod.default_layout() == "packed"
    for platform in ("cpu", "tpu"):
        monkeypatch.setattr(jax, "default_backend", lambda p=platform: p)
        assert runner_mod.default_layout() == "tree"
