"""`python -m kvjax trace` (the scheduling-trace demo)."""

import io

from kvjax.__main__ import main
from kvjax.cli.trace import run_trace


def test_trace_demo_passes_every_check_and_prints_them():
    out = io.StringIO()
    summary = run_trace(seed=3, num_requests=3, out=out)
    text = out.getvalue()
    assert summary["checks"] and all(summary["checks"].values())
    assert summary["blocks_in_use_at_end"] == 0 and summary["generated_tokens"] > 0
    assert "[ok] dummy step: every slot PAD" in text and "add 'req0' -> row" in text


def test_trace_reports_a_violated_invariant(monkeypatch):
    """The invariant line is a real result: a broken step batch turns it into FAIL."""
    import kvjax.host.trace

    def broken(batch, specs):
        raise AssertionError("step batch invariants violated: pad_token_slot_not_PAD")

    monkeypatch.setattr(kvjax.host.trace, "assert_step_batch", broken)
    out = io.StringIO()
    summary = run_trace(seed=0, num_requests=2, out=out)
    assert summary["checks"]["all step-batch, table, row and pool invariants"] is False
    assert "[FAIL] all step-batch" in out.getvalue() and "pad_token_slot_not_PAD" in out.getvalue()
    assert main(["trace", "--requests", "1"]) == 1



def test_trace_prints_to_the_stdout_of_the_call(capsys):
    """The default ``out`` is ``sys.stdout`` when called (a redirected or captured run gets the log)."""
    run_trace(seed=0, num_requests=1)
    assert "invariant checks:" in capsys.readouterr().out
