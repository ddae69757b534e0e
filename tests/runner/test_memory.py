"""The memory estimate: exact for the persistent state, close to XLA's own analysis for the step
and the dense reference, not driven by max_model_len where it need not be, and used by the CLI
to refuse a configuration before compiling."""

import jax
import jax.numpy as jnp
import pytest

import kvjax.cli.main as cli
from kvjax.models.caches import KV_LAYOUTS
from kvjax.runner import Runner, RunnerConfig
from kvjax.testing.fast_compile import DEFAULT_FUSION_OPTIONS
from kvjax.runner.memory import (GIB, InsufficientMemoryError, MemoryEstimate, check_fits,
                                 dense_reference_length, estimate_memory)


def _nbytes(tree):
    return sum(a.nbytes for a in jax.tree.leaves(tree))


def test_dense_reference_length_is_a_power_of_two_of_the_request_capped_by_max_model_len():
    assert [dense_reference_length(n, 1000) for n in (1, 16, 17, 100, 512, 513, 999, 1000)] == \
        [16, 16, 32, 128, 512, 1000, 1000, 1000]
    assert dense_reference_length(5, 8) == 8
    for bad in (0, 1001):
        with pytest.raises(ValueError, match=r"num_tokens must be in \[1, max_model_len=1000\]"):
            dense_reference_length(bad, 1000)


@pytest.mark.parametrize("config", [
    RunnerConfig(max_model_len=64, num_blocks=20, token_sizes=(8, 16)),
    RunnerConfig(max_model_len=48, num_blocks=30, block_size=4, num_speculative_tokens=2,
                 kv_cache_dtype="fp8", max_num_seqs=3, token_sizes=(6, 12)),
    RunnerConfig(max_model_len=32, num_blocks=12, kv_layout="rpa", token_sizes=(8,)),
])
def test_persistent_parts_are_exact(config):
    runner = Runner(config)
    state = runner.read_state()
    e = estimate_memory(config)
    kinds = {p.name: p.kind for p in runner.pool_specs}
    assert e.kv_cache == sum(a.nbytes for n, a in state.pools.items() if kinds[n] == "kv") > 0
    assert e.states == sum(a.nbytes for n, a in state.pools.items() if kinds[n] == "state") > 0
    assert e.rows_and_tables == _nbytes((state.requests, state.tables))


# XLA's backend optimisation level 0 changes LLVM code generation only: buffer assignment runs on the
# same optimised HLO, so memory_analysis() reports the same temporaries at either level (checked for
# every layout and KV dtype below, and for the dense reference, byte for byte), each compile faster.
# XLA:CPU's default fusion emitters, not the suite's older ones (tests/conftest.py): the
# temporaries of the program a user gets.
FAST = DEFAULT_FUSION_OPTIONS


def _step_temp_bytes(runner, bucket) -> int:
    fn, args, _ = runner.jitted_step(bucket)
    with jax.default_matmul_precision(runner.config.matmul_precision):
        return fn.lower(*args).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("layout", KV_LAYOUTS)
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_step_estimate_agrees_with_xla_memory_analysis_for_every_layout(layout, kv_dtype):
    """At a long max_model_len (the attention temporaries dominate) the step's estimate is
    within 15% of XLA's own analysis of the compiled step, for every KV layout and dtype
    (issue 25 item 6: the rpa layout was 1.70x short in float32)."""
    c = RunnerConfig(max_model_len=512, num_blocks=70, token_sizes=(32,), kv_layout=layout,
                     kv_cache_dtype=kv_dtype)
    e = estimate_memory(c, longest_request=0)
    temp = _step_temp_bytes(Runner(c, compiler_options=FAST), c.bucket_spec.buckets[0])
    assert 0.85 * e.step <= temp <= 1.15 * e.step, (layout, kv_dtype, temp, e.step, temp / e.step)


def test_step_estimate_counts_the_logits_output_area_of_the_state_buffer():
    """With ``return_logits`` the runner keeps an output area of ``[L, vocab]`` float32
    logits beside the rows (no XLA temporary counts it): the estimate grows by exactly what the
    runner's buffer grows by."""
    c = dict(max_model_len=64, num_blocks=20, token_sizes=(8, 16))
    with_logits, ids_only = RunnerConfig(**c), RunnerConfig(**c, return_logits=False)
    grown = estimate_memory(with_logits).step - estimate_memory(ids_only).step
    outputs = [Runner(cfg)._rows[2] for cfg in (with_logits, ids_only)]  # the output areas
    assert grown == (outputs[0].shape[1] - outputs[1].shape[1]) * 4 > 0
    L = max(b.num_logits for b in with_logits.bucket_spec.buckets)
    assert grown == L * with_logits.model.vocab_size * 4


def test_dense_estimate_is_an_upper_bound_of_xla_memory_analysis():
    """The dense reference: an upper bound (XLA keeps one or two [H, n, n] buffers)."""
    c = RunnerConfig(max_model_len=1024, num_blocks=130, token_sizes=(32,))
    e = estimate_memory(c, longest_request=512)
    runner = Runner(c)
    n = dense_reference_length(512, c.max_model_len)
    dense = jax.jit(lambda t: runner.model.dense_logits(runner.dense_params, t), compiler_options=FAST)
    temp = dense.lower(jnp.zeros((n,), jnp.int32)).compile().memory_analysis().temp_size_in_bytes
    assert 0.45 * e.dense_reference <= temp + n * n <= 1.05 * e.dense_reference, (temp, e.dense_reference)


def test_the_dense_reference_is_sized_by_the_longest_request_not_max_model_len():
    short = estimate_memory(RunnerConfig(max_model_len=96), longest_request=48)
    long = estimate_memory(RunnerConfig(max_model_len=100_000), longest_request=48)
    assert long.dense_reference == short.dense_reference
    assert estimate_memory(RunnerConfig(max_model_len=100_000)).dense_reference > 100 * GIB


def test_check_fits_names_the_largest_part_and_its_flags():
    e = MemoryEstimate(kv_cache=8 * GIB, states=1, rows_and_tables=1, step=GIB, dense_reference=0)
    check_fits(e, 20 * GIB)
    check_fits(e, None)  # unknown: pass
    with pytest.raises(InsufficientMemoryError, match=r"needs an estimated 9 GiB .*more than the 4 GiB of GPU "
                                                      r"memory; the largest part, kv_cache, is sized by --num-blocks"):
        check_fits(e, 4 * GIB, "GPU memory")


@pytest.mark.parametrize("flags, named", [
    (["--max-model-len", "100000000"], "--max-model-len"),
    (["--num-blocks", "300000000"], "--num-blocks"),
])
def test_demo_refuses_a_configuration_that_cannot_fit_before_compiling(flags, named, monkeypatch, capsys):
    def refuse(*args, **kwargs):
        raise AssertionError("the demo started serving")

    monkeypatch.setattr(cli, "serve", refuse)
    monkeypatch.setattr(cli, "available_memory", lambda: (16 * GIB, "available host RAM"))
    assert cli.main(["demo", *flags]) == 2
    err = capsys.readouterr().err
    assert "needs an estimated" in err and "GiB" in err and "16 GiB of available host RAM" in err
    assert named in err.split("is sized by", 1)[1]


class _Device:
    def __init__(self, stats, platform="gpu"):
        self.platform, self.device_kind, self._stats = platform, "NVIDIA H200", stats

    def memory_stats(self):
        if self._stats is None:
            raise RuntimeError("MemoryStats is only supported for addressable PjRt devices.")
        return self._stats


def test_available_memory_asks_this_process_device(monkeypatch):
    # In a two-process run jax.devices()[0] can be the other process's GPU, which has no stats.
    from kvjax.runner import memory

    monkeypatch.setattr(memory.jax, "devices", lambda: [_Device(None)])
    monkeypatch.setattr(memory.jax, "local_devices", lambda: [_Device({"bytes_limit": 10, "bytes_in_use": 4})])
    assert memory.available_memory() == (6, "NVIDIA H200 memory")


def test_the_dense_reference_places_the_params_once(monkeypatch):
    """``Runner.dense_device_params`` is the one device copy of the unsharded params: placed once,
    on first use, and the dense reference reads it (the parity check's variants read it too:
    tests/cli/test_routing_parity.py)."""
    runner = Runner(RunnerConfig(max_model_len=64, num_blocks=20, token_sizes=(8,)))
    puts = []
    real = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda *a, **k: puts.append(1) or real(*a, **k))
    placed = runner.dense_device_params
    assert placed is runner.dense_device_params and len(puts) == 1
    assert all(isinstance(a, jax.Array) for a in jax.tree.leaves(placed))
    runner.dense_reference(jnp.zeros((dense_reference_length(8, 64),), jnp.int32))
    assert len(puts) == 1
