"""A one-line text progress bar (no dependency), for the demo and difftest."""

from __future__ import annotations


class Progress:
    """``[#####.....] done/total unit  detail`` rewritten in place on ``stream``.

    ``stream=None`` disables it.
    """

    def __init__(self, total: int, stream, *, unit: str = "done", width: int = 30):
        self.total, self.stream, self.unit, self.width = total, stream, unit, width
        self.enabled = stream is not None

    def update(self, done: int, detail: str = "") -> None:
        if not self.enabled:
            return
        filled = int(self.width * done / max(self.total, 1))
        bar = "#" * filled + "." * (self.width - filled)
        self.stream.write(f"\r[{bar}] {done}/{self.total} {self.unit}  {detail[:48]:<48}")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()
