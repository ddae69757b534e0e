"""`python -m kvjax demo` (the scheduling-trace demo)."""

import io

from kvjax.__main__ import main
from kvjax.demo_trace import run_trace


def test_trace_demo_passes_every_check_and_prints_them():
    out = io.StringIO()
    summary = run_trace(seed=3, num_requests=3, out=out)
    text = out.getvalue()
    assert summary["checks"] and all(summary["checks"].values())
    assert summary["blocks_in_use_at_end"] == 0 and summary["generated_tokens"] > 0
    assert "[ok] dummy step: every slot PAD" in text and "add 'req0' -> row" in text


def test_cli_rejects_bad_requests_count(capsys):
    try:
        main(["trace", "--requests", "0"])
    except SystemExit as e:
        assert e.code == 2
    assert "--requests must be positive" in capsys.readouterr().err
