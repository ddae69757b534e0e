"""Progress for the demo and difftest: a bar on a terminal, plain lines in a log.

It lives in ``kvjax.testing``, the lowest layer that reports progress (``difftest``); the CLI
sits above and imports it from here, so ``kvjax.testing`` needs nothing from ``kvjax.cli``.
"""

from __future__ import annotations

import time


def is_terminal(stream) -> bool:
    """True when ``stream`` is an interactive terminal (``isatty()``); False for files and pipes."""
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # closed stream
        return False


class Progress:
    """Progress of ``total`` units written to ``stream`` (``None`` disables it).

    On a terminal: ``[#####.....] done/total unit  detail`` redrawn in place with
    a carriage return. Anywhere else (a log file, a pipe, CI): one plain line
    ``done/total unit  detail`` at most every ``interval`` seconds, plus the
    first and the last update, and never a carriage return.
    """

    def __init__(self, total: int, stream, *, unit: str = "done", width: int = 30,
                 interval: float = 10.0, clock=time.monotonic):
        self.total, self.stream, self.unit, self.width = total, stream, unit, width
        self.enabled = stream is not None
        self.terminal = self.enabled and is_terminal(stream)
        self.interval, self._clock = interval, clock
        self._last_line: float | None = None
        self._last_done: int | None = None

    def update(self, done: int, detail: str = "") -> None:
        if not self.enabled:
            return
        if self.terminal:
            filled = int(self.width * done / max(self.total, 1))
            bar = "#" * filled + "." * (self.width - filled)
            self.stream.write(f"\r[{bar}] {done}/{self.total} {self.unit}  {detail[:48]:<48}")
        else:
            now = self._clock()
            finished = done >= self.total and self._last_done != done
            if not (self._last_line is None or now - self._last_line >= self.interval or finished):
                return
            self._last_line, self._last_done = now, done
            self.stream.write(f"{done}/{self.total} {self.unit}  {detail}".rstrip() + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.terminal:
            self.stream.write("\n")
            self.stream.flush()
