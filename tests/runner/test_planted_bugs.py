"""The three bugs planted by the issue-10 audit, each caught twice: by the suite's own check
and by the sanitizer (``RunnerConfig(poison=True)``, what ``demo --poison`` runs).

(A) the reference KV write sends PAD tokens to slot 0 (the null block, PR 39444);
(B) the runner skips ``zero_blocks`` for newly allocated KV blocks (PR 43990);
(C) ``add_requests`` keeps the previous tenant's ``last_sampled_tokens`` (PR 39833).

Each test monkeypatches the bug in, then asserts that the suite check fails and that a
sanitized run stops with the invariant, the array and the first offending index.
"""

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import pytest

from kvjax.cli.demo import serve
from kvjax.runner import runner as runner_mod
from kvjax.runner.sanitizer import SanitizerError
from kvjax.state import RequestState
from pallas_kernels import kv_write


TESTS = pathlib.Path(__file__).resolve().parents[1]


def _load(relpath: str):
    """A test module of the suite, by path (test directories are not packages)."""
    path = TESTS / relpath
    spec = importlib.util.spec_from_file_location(f"planted_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


seeds = _load("state/test_seed_regressions.py")
san = _load("runner/test_sanitizer.py")


@pytest.fixture
def plant(monkeypatch):
    """``plant(target, name, value)``: monkeypatch with traces cleared, so jitted code
    (kernels, steps) is traced again with the bug, and again without it afterwards."""
    jax.clear_caches()

    def _plant(target, name, value):
        monkeypatch.setattr(target, name, value)
        jax.clear_caches()

    yield _plant
    monkeypatch.undo()
    jax.clear_caches()


def _sanitized_run():
    runner = san.small_runner()
    serve(san.SMALL, san.requests(), runner=runner, progress_stream=None)
    return runner


def test_bug_a_pad_tokens_written_to_slot_0(plant):
    original = kv_write.scatter_set

    def pad_to_slot_0(flat, rows, values):  # the reference's drop row (PAD) redirected to slot 0
        return original(flat, jnp.where(rows >= flat.shape[0], 0, rows), values)

    plant(kv_write, "scatter_set", pad_to_slot_0)
    with pytest.raises(AssertionError, match="key_cache: .* first at \\(0, 0, 0, 0\\)"):
        seeds.test_pr39444_dummy_step_after_real_step_writes_nothing_to_null_block()
    with pytest.raises(SanitizerError) as e:
        _sanitized_run()
    # The first step of the run (release_all, all PAD) already writes block 0.
    assert (e.value.step, e.value.invariant, e.value.array) == ("release", "null_block_changed", "key[0]")
    assert e.value.index == (0, 0, 0, 0)


def test_bug_b_fresh_kv_blocks_not_zeroed(plant):
    original = runner_mod.zero_blocks

    def skip_kv(arrays, ids, **kw):  # the KV call passes kernel_blocks_per_block; state slots still zeroed
        return list(arrays) if "kernel_blocks_per_block" in kw else original(arrays, ids, **kw)

    plant(runner_mod, "zero_blocks", skip_kv)
    runner = san.small_runner()
    with pytest.raises(AssertionError, match="key\\[0\\]: .* differ"):
        san.check_fresh_blocks_are_zero_past_the_written_tokens(runner)
    runner.reset()
    with pytest.raises(SanitizerError) as e:
        serve(san.SMALL, san.requests(), runner=runner, progress_stream=None)
    # Step 0 hands out block 1 (LIFO pool) and it still holds poison.
    assert (e.value.step, e.value.invariant, e.value.array) == (0, "fresh_block_not_zero", "key[0]")
    assert e.value.index == (1, 0, 0, 0)


def test_bug_c_added_row_keeps_last_sampled_token(plant):
    original = RequestState.add_requests

    def keeps_last_sampled(self, new):
        return original(self, new).replace(last_sampled_tokens=self.last_sampled_tokens)

    plant(RequestState, "add_requests", keeps_last_sampled)
    with pytest.raises(AssertionError):
        seeds.test_pr39833_reused_row_first_decode_reads_new_requests_last_token()
    with pytest.raises(SanitizerError) as e:
        _sanitized_run()
    # Step 0 installs two requests, into rows 1 and 0; row 0 is the first offending index.
    assert (e.value.step, e.value.invariant, e.value.array) == (0, "added_row_holds_poison", "last_sampled_tokens")
    assert e.value.index == (0,)
