"""The step reads each step's inputs from its rows buffer's input area, which a staging program
fills before every launch (``Runner._stage``), and its outputs come back through the output area
(``Runner._fetch``). A launch that skipped the staging would run the step on stale inputs: the
serving loops would then spin without progress rather than fail, so this checks one step at a
time."""

import numpy as np

from kvjax.host.scheduler import Request
from kvjax.models.tiny_hybrid import TinyHybridConfig
from kvjax.runner import Runner, RunnerConfig

FAST = {"xla_backend_optimization_level": 0}


def test_each_step_runs_on_its_own_staged_inputs():
    cfg = RunnerConfig(model=TinyHybridConfig(layer_types=("attn", "mamba")), block_size=16, num_blocks=64,
                       max_model_len=96, max_num_seqs=4, max_num_batched_tokens=16, token_sizes=(4, 16),
                       max_new_requests_per_step=2)
    runner = Runner(cfg, compiler_options=FAST)
    runner.precompile()
    runner.warm_up()
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
    assert sorted(out.num_sampled.tolist()) == [0, 0, 1, 1]
