"""The progress reporter: a bar redrawn in place on a terminal, plain periodic lines anywhere else."""

import io

from kvjax.testing.progress import Progress


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_off_a_terminal_prints_plain_periodic_lines():
    stream, clock = io.StringIO(), _Clock()
    bar = Progress(5, stream, unit="requests finished", interval=10.0, clock=clock)
    for done in range(6):
        bar.update(done, f"step {done}")
        clock.t += 4.0
    bar.close()
    text = stream.getvalue()
    assert "\r" not in text
    # first update, then at most one line per 10 s, and the last one
    assert text.splitlines() == ["0/5 requests finished  step 0", "3/5 requests finished  step 3",
                                 "5/5 requests finished  step 5"]


def test_progress_on_a_terminal_redraws_one_line():
    stream = _Terminal()
    bar = Progress(2, stream, unit="scenarios")
    bar.update(1, "a")
    bar.update(2, "done")
    bar.close()
    text = stream.getvalue()
    assert text.count("\r") == 2 and text.endswith("\n") and text.count("\n") == 1
    assert "[###############...............] 1/2 scenarios" in text


def test_progress_none_writes_nothing(capsys):
    """``stream=None`` (``--quiet``) is off: nothing reaches stdout or stderr, the first and
    last updates and ``close`` included (not a default stream in disguise)."""
    bar = Progress(3, None, interval=0.0)
    for done in range(4):
        bar.update(done, f"step {done}")
    bar.close()
    assert not bar.enabled and not bar.terminal
    assert capsys.readouterr() == ("", "")
