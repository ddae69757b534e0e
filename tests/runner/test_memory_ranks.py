"""Issue 25: on a CPU every data rank of a mesh lives in the same RAM, so the memory check counts
all of this process's ranks, not one."""

import pytest

from kvjax.cli import main as cli
from kvjax.runner import RunnerConfig
from kvjax.runner import memory as mem


def test_times_scales_every_part():
    est = mem.estimate_memory(RunnerConfig())
    two = est.times(2)
    assert two.total == 2 * est.total and all(v == 2 * est.parts()[k] for k, v in two.parts().items())


def test_a_cpu_mesh_is_refused_when_its_ranks_together_exceed_ram(monkeypatch, capsys):
    one = mem.estimate_memory(RunnerConfig(num_blocks=96, max_model_len=96, token_sizes=(4, 16, 32)),
                              longest_request=0).total
    # room for one rank's estimate (and its dense reference), not for four ranks'
    monkeypatch.setattr(cli, "available_memory", lambda: (int(2.2 * one / mem.USABLE_FRACTION), "test RAM"))
    monkeypatch.setattr(cli.demo_cli, "start_devices", lambda args, shape: False)
    assert cli.main(["demo", "--quiet", "--mesh", "data=4", "--requests", "1"]) == 2
    err = capsys.readouterr().err
    assert "more than the" in err and "test RAM" in err, err
