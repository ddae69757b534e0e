"""The checked mode (``RunnerConfig(poison=True)``): clean runs pass every check with no
serving-time compile, and each memory invariant names the step, the array and the first
offending index when the device state is corrupted behind the runner's back."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import NULL_BLOCK_ID
from kvjax.cli.demo import serve
from kvjax.host.scheduler import Request
from kvjax.models import TinyHybridConfig
from kvjax.runner import Runner, RunnerConfig
from kvjax.runner import sanitizer
from kvjax.runner.sanitizer import SanitizerError
from kvjax.testing.asserts import assert_bitwise, bits
from kvjax.testing.fast_compile import FAST_COMPILER_OPTIONS


FAST = FAST_COMPILER_OPTIONS  # kvjax.testing.fast_compile (also in XLA_FLAGS, tests/conftest.py)
# One attention and one Mamba layer, one bucket: the smallest runner that has every kind of memory.
SMALL = RunnerConfig(model=TinyHybridConfig(layer_types=("attn", "mamba")), block_size=4, num_blocks=12,
                     max_model_len=24, max_num_seqs=2, max_num_batched_tokens=8, token_sizes=(8,), poison=True)
# Three requests on two rows: a row is reused, blocks are freed, poisoned and handed out again.
WORKLOAD = (("a", [1, 2, 3, 4, 5], 3, 0), ("b", [7, 8], 4, 0), ("c", [9, 9, 9, 9, 9, 9], 3, 1))


def requests():
    return [Request(i, list(p), m, a) for i, p, m, a in WORKLOAD]


def small_runner() -> Runner:
    r = Runner(SMALL, compiler_options=FAST)
    r.precompile()
    return r


@pytest.fixture(scope="module")
def runner():
    return small_runner()


@pytest.fixture
def restore(runner):
    """Give the test a runner whose device state and host mirror are put back afterwards."""
    saved, mirror = runner.read_state(), runner.sanitizer.mirror
    yield runner
    runner.write_state(saved)
    runner.sanitizer.mirror = mirror


def test_clean_workload_passes_every_check_with_no_serving_compile(runner):
    report, _ = serve(SMALL, requests(), runner=runner, progress_stream=None)
    assert report.all_match and report.nan_count == 0 and report.serving_compiles == 0
    assert {inv for inv, _, _ in runner.sanitizer.layout} == set(sanitizer.INVARIANTS)


def test_poison_is_a_payload_nan_and_fills_the_null_block(runner):
    key0 = runner.read_state().pools["key[0]"]
    assert (bits(key0[NULL_BLOCK_ID]) == 0x7FE5A5A5).all()
    ssm = runner.read_state().pools["ssm_state[0]"]
    assert (bits(ssm[NULL_BLOCK_ID]) == 0x7FE5A5A5).all()
    # A computed NaN differs from the poison bitwise.
    assert bits(np.asarray(jnp.float32(0) / jnp.float32(0))) != 0x7FE5A5A5


def _set(runner, where, index, value):
    """Set one element of one array of the runner's state (``where``: pool key/value/ssm_state
    of layer 0, or a request field, or table 0)."""
    state = runner.read_state()
    if where in ("key", "value", "ssm_state"):
        a = np.array(state.pools[f"{where}[0]"])
        a[index] = value
        state = state.replace(pools={**state.pools, f"{where}[0]": a})
    elif where == "table":
        t = np.array(state.tables.tables[0])
        t[index] = value
        state = state.replace(tables=state.tables.replace(tables=(t,)))
    else:
        f = np.array(getattr(state.requests, where))
        f[index] = value
        state = state.replace(requests=state.requests.replace(**{where: f}))
    runner.write_state(state)


@pytest.mark.parametrize(
    "where, index, value, invariant, array",
    [
        ("key", (0, 1, 0, 3), 1.0, "null_block_changed", "key[0]"),
        ("ssm_state", (0, 2, 5, 1), 0.0, "null_slot_changed", "ssm_state[0]"),
        ("last_sampled_tokens", (0,), 7, "free_row_not_reset", "last_sampled_tokens"),
        ("table", (1, 2), 5, "device_table_differs", "block_tables[0]"),
    ],
)
def test_each_corruption_is_reported_with_array_and_index(restore, where, index, value, invariant, array):
    runner = restore
    runner.reset()  # every row free on both sides
    runner.dummy_step()  # consistent: passes
    _set(runner, where, index, value)
    with pytest.raises(SanitizerError) as e:
        runner.dummy_step()
    err = e.value
    assert (err.step, err.invariant, err.array, err.index) == ("dummy", invariant, array, index)
    assert str(err) == f"sanitizer: step dummy: {invariant} in {array} at index {index}"


def test_nan_in_a_live_block_is_reported_mid_run(restore):
    runner = restore
    runner.release_all()  # a new scheduler: every row free on the device too
    sched = SMALL.make_scheduler()
    sched.add_request(Request("live", [3, 1, 4, 1, 5, 9], 5, 0))
    plan = sched.schedule()
    out = runner.execute(plan)
    sched.update(plan, out.sampled, out.num_sampled, out.logits)
    (req,) = sched.running
    block = req.blocks[0][-1]
    _set(runner, "value", (block, 3, 1, 2), np.nan)
    plan = sched.schedule()
    with pytest.raises(SanitizerError) as e:
        runner.execute(plan)
    assert (e.value.step, e.value.invariant, e.value.array) == (plan.step, "live_block_holds_nan", "value[0]")
    assert e.value.index == (block, 3, 1, 2)


def check_fresh_blocks_are_zero_past_the_written_tokens(runner):
    """One prefill of 5 tokens (block size 4) into fully poisoned caches, run through the
    executable directly (no sanitizer): the request's second block holds the written
    token in slot 0 and bitwise zeros after it; every block it does not own keeps the
    poison. Guards the zeroing of fresh KV blocks (PR 43990) without the sanitizer."""
    state = runner.read_state()
    runner.write_state(state.replace(pools=jax.tree.map(lambda a: np.asarray(sanitizer.poison_like(a)), state.pools)))
    sched = SMALL.make_scheduler()
    sched.add_request(Request("z", [1, 2, 3, 4, 5], 1, 0))
    plan = sched.schedule()
    (s,) = plan.scheduled
    owned = s.req.blocks[0]
    assert len(owned) == 2
    runner.launch(runner.prepare(plan)).wait()  # no fetch: no verdict
    pools = runner.read_state().pools
    for name, cache in (("key[0]", pools["key[0]"]), ("value[0]", pools["value[0]"])):
        got = np.asarray(cache)
        expected = np.asarray(sanitizer.poison_like(cache)).copy()
        expected[owned[0]] = got[owned[0]]
        expected[owned[1], 0] = got[owned[1], 0]
        expected[owned[1], 1:] = 0.0
        assert not np.isnan(got[owned[0]]).any() and not np.isnan(got[owned[1], 0]).any(), name
        assert_bitwise(got, expected, name)


def test_fresh_blocks_are_zero_past_the_written_tokens(restore):
    check_fresh_blocks_are_zero_past_the_written_tokens(restore)


def test_bf16_pools_keep_the_poison_payload(tmp_path):
    """A bfloat16 model in checked mode serves without a false alarm: the pools start with the
    poison's own bits (not the canonical NaN that XLA:CPU folds a bf16 NaN constant into), so the
    null block is unchanged after every step."""
    import json

    from kvjax.models.hf.loader import model_from_dir

    cfg = {"architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid",
           "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "layer_types": ["mamba", "attention"],
           "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 32,
           "shared_intermediate_size": 32, "num_local_experts": 0, "num_experts_per_tok": 0,
           "mamba_n_heads": 2, "mamba_d_head": 16, "mamba_d_state": 8, "mamba_n_groups": 1, "mamba_d_conv": 4,
           "mamba_expand": 1, "mamba_chunk_size": 16, "position_embedding_type": None,
           "tie_word_embeddings": True, "max_position_embeddings": 64}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    model = model_from_dir(tmp_path, dtype="bfloat16")
    config = RunnerConfig(model=model, block_size=4, num_blocks=12, max_model_len=24, max_num_seqs=2,
                          max_num_batched_tokens=8, token_sizes=(8,), poison=True)
    r = Runner(config, compiler_options=FAST)
    pools = {n: np.asarray(jax.device_get(a)) for n, a in r._pools.items()}
    assert any(a.dtype == jnp.bfloat16 for a in pools.values())
    for name, a in pools.items():
        assert (bits(a) == sanitizer.poison_bits(a.dtype)).all(), name
    report, _ = serve(config, requests(), runner=r, progress_stream=None, compile_workers=1)
    assert report.checked and report.generated_tokens == sum(m for _, _, m, _ in WORKLOAD)
