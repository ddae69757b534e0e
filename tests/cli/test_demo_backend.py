"""``demo --backend pallas`` on a CPU (issue 10 item 6): the Pallas TPU interpreter traces at
run time, so a strict demo rejects it up front (exit 2, naming what to use) instead of failing
its first step with ServingCompileError; the GPU kernels' interpreter compiles ahead of time."""

import jax
import jax.numpy as jnp
import pytest

from kvjax.cli import main as cli
from kvjax.runner import Runner
from kvjax.runner.compile_guard import ServingCompileError, ServingGuard, check_compiles_ahead
from pallas_kernels import zero_blocks

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU's interpreters")


@pytest.mark.parametrize("backend", ["pallas", "pallas_tpu"])
def test_demo_rejects_the_tpu_interpreter_before_compiling(backend, monkeypatch, capsys):
    def boom(*a, **k):
        raise AssertionError("compiled before rejecting the backend")

    monkeypatch.setattr(Runner, "precompile", boom)
    assert cli.main(["demo", "--backend", backend, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"backend='{backend}' on cpu" in err and "--backend pallas_gpu" in err and "--backend reference" in err


def test_auto_with_interpret_env_is_the_tpu_interpreter_too(monkeypatch):
    monkeypatch.setenv("KVJAX_INTERPRET", "1")
    with pytest.raises(ValueError, match="cannot be compiled ahead of time"):
        check_compiles_ahead("auto")
    monkeypatch.delenv("KVJAX_INTERPRET")
    for backend in ("auto", "reference", "pallas_gpu"):
        check_compiles_ahead(backend)


@pytest.mark.parametrize("backend, traces_at_run_time", [("pallas_gpu", False), ("pallas", True)])
def test_only_the_tpu_interpreter_traces_when_a_compiled_kernel_runs(backend, traces_at_run_time):
    """The premise of the rule, on the smallest kernel: compile ahead, then run under a strict guard.
    (Caches cleared first: the interpreter's run-time trace is cached once an earlier test in the
    process ran the same interpreted kernel.)"""
    jax.clear_caches()
    cache = jnp.ones((3, 2, 8), jnp.float32)
    ids = jnp.array([1, -1], jnp.int32)
    compiled = jax.jit(lambda c, i: zero_blocks([c], i, backend=backend)[0]).lower(cache, ids).compile()
    guard = ServingGuard(strict=True)
    if traces_at_run_time:
        with pytest.raises(ServingCompileError):
            with guard.serving():
                jax.block_until_ready(compiled(cache, ids))
    else:
        with guard.serving():
            out = jax.block_until_ready(compiled(cache, ids))
        assert (out[1] == 0).all() and (out[0] == 1).all() and (out[2] == 1).all()
