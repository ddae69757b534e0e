"""The step updates its KV and state pools in place, and returns logits only when asked (issue 24
items 3 and 5).

In place: the pools are donated (``Runner.jitted_step``: rows and pools, ``donate_argnums``), so
every kernel that writes a pool must write into the donated buffer. What is observable here:

* CPU, compiled (``fn.lower(*args).compile().as_text()``, the reference kernels): XLA's
  copy insertion adds a ``copy`` (or ``copy-start``) wherever a pool's buffer cannot be
  updated in place (a scatter whose operand is still read afterwards, a conditional branch
  that returns its operand while the other writes it, ...). No ``copy`` of a pool's shape
  may appear.
* CUDA, lowered before optimisation (``lowering_platforms=("cuda",)``, the Pallas Triton
  kernels): every ``custom_call`` result the size of a pool (in any view: the zeroing
  kernel sees a pool as ``uint32 [blocks, words]``, the KV write as ``[slots, H*D]``) is
  aliased to one of the call's operands (``output_operand_aliases``); an unaliased result
  would be a fresh buffer the size of the pool. The GPU compiler's own copies are visible
  only on a GPU.

Both for the tiny hybrid model (one attention and one Mamba layer) and a Hugging Face hybrid
(Mamba + attention + MLP), with the flash and the rpa KV layouts, poison off.

Planted (by hand, then restored): ``input_output_aliases`` removed from the Triton KV write
(``pallas_kernels/kv_write.py``) -> the CUDA test fails; a pool read after its scatter in
``mamba_mixer`` (``ssm_state`` of the input kept alive into the output) -> the CPU test
fails on a ``copy`` of the ``ssm_state`` shape.
"""

from __future__ import annotations

import math
import re

import jax
import numpy as np
import pytest

from kvjax.host.scheduler import Request
from kvjax.models import TinyHybridConfig
from kvjax.models.attention import AttnSpec
from kvjax.models.hf.hybrid import Block, HybridConfig, HybridModel
from kvjax.models.mamba_layer import MambaSpec
from kvjax.models.moe import MLPSpec
from kvjax.runner.runner import Runner, RunnerConfig
from kvjax.testing.fast_compile import DEFAULT_FUSION_OPTIONS, FAST_COMPILER_OPTIONS
from tests.cuda_lowering import abstract_cuda

HF = HybridModel(HybridConfig(
    "GraniteMoeHybridForCausalLM", vocab_size=96, d_model=32, rms_eps=1e-5,
    blocks=(Block("mamba"), Block("attn"), Block("mlp")), attn=AttnSpec(4, 2, 16),
    mamba=MambaSpec(4, 8, 8, conv_width=4), mlp=MLPSpec(48)))
# Pool shapes unlike any temporary of these steps: 37 blocks, 6 state slots (11 with one draft).
SIZES = dict(block_size=4, num_blocks=37, max_model_len=32, max_num_seqs=5, max_num_batched_tokens=8,
             token_sizes=(8,))
# The compiled-HLO checks' sizes: a token table of 24 x 4096 (int32), far larger than any other
# int32 array of the step, for test_step_writes_only_the_token_rows_it_names; 25 state slots
# (49 with one draft) and 37 blocks, still unlike any temporary, for test_compiled_step_copies_no_pool.
# One compile per (case, bucket) serves both tests (compiled_hlo).
HLO_SIZES = dict(SIZES, max_model_len=4096, max_num_seqs=24)
# The tiny model with one attention and one Mamba layer (the default has two of each): every kind
# of pool a step writes (K and V or the combined KV pages, conv and SSM state), each layer's pools
# its own; half the layers to compile and lower.
SMALL = TinyHybridConfig(layer_types=("attn", "mamba"))
CASES = {
    "tiny-flash": dict(model=SMALL, kv_layout="flash"),
    "tiny-rpa": dict(model=SMALL, kv_layout="rpa"),
    "tiny-spec-fp8": dict(model=SMALL, kv_layout="flash", num_speculative_tokens=1, kv_cache_dtype="fp8"),
    "hf-flash": dict(model=HF, kv_layout="flash"),
    "hf-rpa": dict(model=HF, kv_layout="rpa"),
}


def _pool_shapes(args) -> set[tuple[int, ...]]:
    pools = args[2]
    out = set()
    for v in pools.values():
        out.add(tuple(v.shape))
        out.add(tuple(v.shape[1:]))  # one rank's pool inside shard_map
    return out


def _hlo_dims(s: str) -> tuple[int, ...]:
    return tuple(int(d) for d in s.split(",") if d)


def pool_copies(hlo: str, shapes) -> list[str]:
    """``copy`` / ``copy-start`` instructions of compiled HLO text whose result has a pool's shape."""
    bad = []
    for line in hlo.splitlines():
        m = re.search(r"= \(?\w+\[([\d,]*)\][^ ]* (copy|copy-start)\(", line)
        if m and _hlo_dims(m.group(1)) in shapes:
            bad.append(line.strip()[:200])
    return bad


def unaliased_pool_results(mlir: str, sizes) -> list[str]:
    """Results of ``custom_call``s in StableHLO text with a pool's element count and no
    ``output_operand_alias``."""
    bad = []
    for line in mlir.splitlines():
        if "stablehlo.custom_call" not in line or "->" not in line:
            continue
        results = re.findall(r"tensor<([\dx]+)x\w+>", line.rsplit("->", 1)[1])
        aliased = {int(i) for i in re.findall(r"output_tuple_indices = \[(\d*)\]", line) if i}
        if "output_tuple_indices = []" in line:  # a single result, aliased
            aliased.add(0)
        for i, dims in enumerate(results):
            if math.prod(int(d) for d in dims.split("x")) in sizes and i not in aliased:
                bad.append(f"result {i} ({dims}) of {line.strip()[:160]}")
    return bad


# XLA's backend optimisation level 0 halves the CPU compile; it changes LLVM code generation only:
# the optimised HLO, copy insertion's copies included, is the same text at either level (checked
# for hf-rpa and tiny-spec-fp8, byte for byte). XLA:CPU's default fusion emitters, not the suite's
# older ones (tests/conftest.py): the copies checked are those of the program a user gets.
FAST = DEFAULT_FUSION_OPTIONS


def _runner(case, compiler_options=None, **kw):
    return Runner(RunnerConfig(**SIZES, **CASES[case], **kw), compiler_options=compiler_options)


_COMPILED: dict = {}


def compiled_hlo(case):
    """``(runner, [(bucket, pool shapes, compiled HLO text)])`` of every bucket of ``case`` at
    HLO_SIZES (the reference kernels, FAST), compiled once for the module's tests."""
    if case not in _COMPILED:
        runner = Runner(RunnerConfig(**HLO_SIZES, **CASES[case], backend="reference"), compiler_options=FAST)
        steps = []
        for bucket in runner.buckets.buckets:
            fn, args, _ = runner.jitted_step(bucket)
            with jax.default_matmul_precision(runner.config.matmul_precision):
                steps.append((bucket, _pool_shapes(args), fn.lower(*args).compile().as_text()))
        _COMPILED[case] = runner, steps
    return _COMPILED[case]


@pytest.mark.parametrize("case", sorted(CASES))
def test_compiled_step_copies_no_pool(case):
    _, steps = compiled_hlo(case)
    assert len(steps) >= 2  # decode-only and mixed
    for bucket, shapes, hlo in steps:
        assert "input_output_alias" in hlo
        assert pool_copies(hlo, shapes) == [], (case, bucket)


@pytest.mark.parametrize("case", sorted(CASES))
def test_cuda_kernels_write_pools_in_place(case, verified_triton_modules):
    runner = _runner(case, backend="pallas_gpu")
    for bucket in runner.buckets.buckets:
        fn, args, _ = runner.jitted_step(bucket)
        abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), args)
        with abstract_cuda(), jax.default_matmul_precision(runner.config.matmul_precision):
            mlir = fn.trace(*abstract).lower(lowering_platforms=("cuda",)).as_text()
        sizes = {math.prod(v.shape[1:]) for v in args[2].values()}  # one rank's pool
        assert mlir.count("__gpu$xla.gpu.triton") >= 4, (case, bucket)
        assert unaliased_pool_results(mlir, sizes) == [], (case, bucket)


def test_pool_copy_detectors_see_a_copy():
    """The two detectors on hand-made text (a pool-shaped copy; an unaliased kernel result)."""
    shapes = {(37, 4, 2, 16)}
    assert pool_copies("  %copy.3 = f32[37,4,2,16]{3,2,1,0} copy(f32[37,4,2,16]{3,2,1,0} %p)", shapes)
    assert not pool_copies("  %copy.3 = f32[8,2,16]{2,1,0} copy(f32[8,2,16]{2,1,0} %p)", shapes)
    line = ('%0:2 = stablehlo.custom_call @__gpu$xla.gpu.triton(%a, %b) {output_operand_aliases = '
            '[#stablehlo.output_operand_alias<output_tuple_indices = [0], operand_index = 1, '
            'operand_tuple_indices = []>]} : (tensor<8xf32>, tensor<37x128xf32>) -> '
            '(tensor<37x128xf32>, tensor<37x128xf32>)')
    assert unaliased_pool_results(line, {37 * 128}) == [
        f"result 1 (37x128) of {line[:160]}"]


# The served runs below check what the steps return, not the compiled HLO: the suite's settings.
SERVE_FAST = FAST_COMPILER_OPTIONS


def _serve(config):
    runner = Runner(config, compiler_options=SERVE_FAST)
    runner.precompile()
    runner.warm_up()
    sched = config.make_scheduler()
    sched.add_request(Request("a", [3, 4, 5, 6], 5, 0))
    sched.add_request(Request("b", [9, 8], 4, 1))
    tokens, packed = [], []
    while sched.has_work:
        plan = sched.schedule()
        if plan is None:
            continue
        out = runner.execute(plan)
        tokens.append((out.sampled.copy(), out.num_sampled.copy()))
        packed.append(out.logits.shape)
        sched.update(plan, out.sampled, out.num_sampled, out.logits)
    sizes = {b: runner.output_spec(b).size for b in runner.executables}
    return tokens, packed, sizes


# The packed output does not depend on the model's depth: SMALL's two layers (attention, Mamba)
# instead of the default four halve the two runners' compiles; nor on the number of token sizes:
# one (8), whose decode-only and mixed buckets are both served (2 buckets each).


def test_return_logits_false_returns_token_ids_only():
    config = RunnerConfig(**SIZES, model=SMALL)
    with_logits, shapes_on, sizes_on = _serve(config)
    without, shapes_off, sizes_off = _serve(RunnerConfig(**SIZES, model=SMALL, return_logits=False))
    V = config.model.vocab_size
    assert len(with_logits) == len(without) >= 4
    for (s1, n1), (s2, n2) in zip(with_logits, without):
        np.testing.assert_array_equal(s1, s2)
        np.testing.assert_array_equal(n1, n2)
    assert all(s[0] > 0 and s[1] == V for s in shapes_on)
    assert all(s == (0, V) for s in shapes_off)
    for bucket, size in sizes_off.items():  # the packed output: tokens, counts, flags
        assert size < V <= sizes_on[bucket] - size, (bucket, size, sizes_on[bucket])


def token_table_passes(hlo: str, n: int) -> list[str]:
    """int32 results of compiled HLO text with at least ``n`` elements that are neither a
    parameter, a view (bitcast, tuple element) nor a scatter: a pass over the whole token table."""
    bad = []
    for line in hlo.splitlines():
        m = re.search(r"%(\S+) = \(?s32\[([\d,]*)\]\S* (\S+)\(", line)
        if not m or math.prod(_hlo_dims(m.group(2))) < n:
            continue
        if m.group(3) in ("parameter", "bitcast", "get-tuple-element", "tuple") or "scatter" in m.group(1):
            continue
        bad.append(line.strip()[:200])
    return bad


@pytest.mark.parametrize("case", ["tiny-flash", "tiny-spec-fp8", "hf-flash"])
def test_step_writes_only_the_token_rows_it_names(case):
    """The request rows' token table (``[max_num_seqs, max_model_len]`` int32, here the only
    int32 array that large) is updated in place by scatters of the rows a step names: no copy,
    slice, concatenation or rewrite of the whole table (a step cost grew with max_num_seqs x
    max_model_len on the H100: ~0.2 ms at 256 x 32k)."""
    runner, steps = compiled_hlo(case)  # test_compiled_step_copies_no_pool's programs
    n = HLO_SIZES["max_num_seqs"] * HLO_SIZES["max_model_len"]
    assert runner.read_state().requests.all_token_ids.size == n
    assert len(steps) >= 2  # decode-only and mixed
    for bucket, _, hlo in steps:
        assert token_table_passes(hlo, n) == [], (case, bucket)
        assert "scatter" in hlo
