"""The backend resolver and the implementation registry (pallas_kernels.backend)."""

from __future__ import annotations

import numpy as np
import pytest

from pallas_kernels import backend as kernel_backend
from pallas_kernels.backend import Choice, choose, resolve

OPS = ("kv_write", "zero_blocks", "selective_state_update", "causal_conv1d_update",
       "selective_scan_varlen", "causal_conv1d_varlen", "combine_sampled_and_draft_tokens",
       "ragged_paged_attention", "grouped_matmul")


@pytest.fixture
def on(monkeypatch):
    """Pretend the default platform is ``plat``; KVJAX_INTERPRET unset."""
    monkeypatch.delenv(kernel_backend.INTERPRET_ENV, raising=False)

    def set_platform(plat):
        monkeypatch.setattr(kernel_backend, "platform", lambda: plat)

    return set_platform


@pytest.mark.parametrize(
    "plat,backend,interpret,want",
    [
        ("cpu", "auto", None, Choice("reference", False)),
        ("cpu", "auto", True, Choice("tpu", True)),
        ("cpu", "reference", True, Choice("reference", False)),
        ("cpu", "pallas", None, Choice("tpu", True)),
        ("cpu", "pallas_tpu", None, Choice("tpu", True)),
        ("cpu", "pallas_gpu", None, Choice("gpu", True)),
        ("gpu", "auto", None, Choice("gpu", False)),
        ("gpu", "auto", True, Choice("gpu", True)),
        ("gpu", "pallas", None, Choice("gpu", False)),
        ("gpu", "pallas_tpu", None, Choice("tpu", True)),
        ("gpu", "pallas_gpu", False, Choice("gpu", False)),
        ("tpu", "auto", None, Choice("tpu", False)),
        ("tpu", "pallas_gpu", None, Choice("gpu", True)),
    ],
)
def test_resolve_table(on, monkeypatch, plat, backend, interpret, want):
    on(plat)
    monkeypatch.setattr(kernel_backend.tpu_target, "prepare_compiled_tpu", lambda: None)
    assert resolve(backend, interpret) == want


def test_env_switch_interprets_auto_on_cpu(on, monkeypatch):
    on("cpu")
    monkeypatch.setenv(kernel_backend.INTERPRET_ENV, "1")
    assert resolve("auto", None) == Choice("tpu", True)
    monkeypatch.setenv(kernel_backend.INTERPRET_ENV, "0")
    assert resolve("auto", None) == Choice("reference", False)


@pytest.mark.parametrize("backend,interpret", [("triton", None), ("", None), ("auto", 1),
                                               ("auto", "yes")])
def test_resolve_rejects_bad_arguments(backend, interpret):
    with pytest.raises(ValueError, match="backend must be one of|interpret must be None"):
        resolve(backend, interpret)


def test_every_op_registers_a_reference_and_its_flavours():
    for op in OPS:
        assert "reference" in kernel_backend.flavors(op), op
    assert kernel_backend.flavors("causal_conv1d_varlen") == ("reference",)
    assert kernel_backend.flavors("selective_scan_varlen") == ("reference", "tpu", "gpu")
    for op in ("kv_write", "zero_blocks"):
        assert kernel_backend.flavors(op) == ("reference", "tpu", "gpu", "mosaic_gpu"), op
    assert kernel_backend.flavors("ragged_paged_attention") == ("reference", "tpu")  # JAX's kernel
    assert kernel_backend.flavors("grouped_matmul") == ("reference", "gpu")  # TPU: the reference
    for op in set(OPS) - {"causal_conv1d_varlen", "kv_write", "zero_blocks",
                          "ragged_paged_attention", "grouped_matmul"}:
        assert kernel_backend.flavors(op) == ("reference", "tpu", "gpu"), op


def test_choose_falls_back_to_the_reference_only_for_missing_flavours(on):
    on("cpu")
    assert choose("causal_conv1d_varlen", "pallas_gpu", None) == Choice("reference", False)
    assert choose("zero_blocks", "pallas_gpu", None) == Choice("gpu", True)
    with pytest.raises(ValueError, match="no kernel named 'nope'"):
        choose("nope", "auto", None)


def test_register_and_run_pass_interpret_and_static_arguments():
    seen = []

    @kernel_backend.register("test_only_op", "reference", "gpu")
    def impl(x, *, interpret, scale):
        seen.append((interpret, scale))
        return x * scale

    try:
        with pytest.raises(ValueError, match="already has a 'gpu'"):
            kernel_backend.register("test_only_op", "gpu")(impl)
        with pytest.raises(ValueError, match="flavor must be one of"):
            kernel_backend.register("test_only_op", "cuda")
        out = kernel_backend.run("test_only_op", Choice("gpu", True), np.float32(2), scale=3)
        assert float(out) == 6.0 and seen[-1] == (True, 3)
        kernel_backend.run("test_only_op", Choice("reference", False), np.float32(2), scale=3)
        assert seen[-1] == (False, 3)
        with pytest.raises(ValueError, match="no 'tpu' implementation"):
            kernel_backend.run("test_only_op", Choice("tpu", True), np.float32(2), scale=3)
    finally:
        del kernel_backend._IMPLS["test_only_op"]


def test_interpret_arg_per_flavour():
    assert Choice("reference", False).interpret_arg() is False
    assert Choice("gpu", True).interpret_arg() is True
    assert Choice("tpu", False).interpret_arg() is False
    params = Choice("tpu", True).interpret_arg()
    assert params.detect_races and params.uninitialized_memory == "nan"
