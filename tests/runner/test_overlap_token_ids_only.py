"""Overlapped serving with ``return_logits=False`` (the serving mode: only token ids come back):
the same tokens as lockstep, and no logits rows kept on the requests.

Planted (then restored): ``serving._resolve`` appending ``out.logits[b]`` whatever the step
returned: IndexError on the empty ``[0, vocab]`` logits (the bug this guards)."""

from __future__ import annotations

from kvjax.host.scheduler import Request
from kvjax.models import TinyHybridConfig
from kvjax.runner.runner import Runner, RunnerConfig
from kvjax.runner.serving import run_to_completion
from kvjax.testing.fast_compile import FAST_COMPILER_OPTIONS

FAST = FAST_COMPILER_OPTIONS  # kvjax.testing.fast_compile (also in XLA_FLAGS, tests/conftest.py)


def test_overlap_without_logits_matches_lockstep():
    config = RunnerConfig(block_size=4, num_blocks=37, max_model_len=32, max_num_seqs=3,
                          max_num_batched_tokens=8, token_sizes=(4, 8), return_logits=False,
                          model=TinyHybridConfig(layer_types=("attn", "mamba")))
    runner = Runner(config, compiler_options=FAST)
    runner.precompile()
    outputs = {}
    for overlap in (False, True):
        runner.reset()
        sched = config.make_scheduler()
        reqs = [Request(f"r{i}", list(range(3 + i, 8 + 2 * i)), max_tokens=5 + i) for i in range(3)]
        for r in reqs:
            sched.add_request(r)
        run_to_completion(sched, runner, overlap=overlap)
        outputs[overlap] = [list(r.output) for r in reqs]
        assert all(r.logits == [] for r in reqs), overlap
    assert outputs[True] == outputs[False]
    assert [len(o) for o in outputs[True]] == [5, 6, 7]
