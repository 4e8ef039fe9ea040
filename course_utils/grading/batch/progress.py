"""A progress line for a class's grading: how many are done, the rate, the time left."""

from __future__ import annotations

import sys
import time


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    """``graded 37/200 (12 skipped, 2 failed to run) 0.41/s, 6:38 left``.

    On a terminal the line is redrawn in place; into a file (a cluster job's log) one line is
    written per notebook. The rate counts only notebooks graded in this run (skipped ones cost
    nothing), so the time left is what the rest will take at this run's pace.
    """

    def __init__(self, total: int, skipped: int = 0, stream=None, every: float = 0.5):
        self.total, self.skipped, self.graded, self.failed = total, skipped, 0, 0
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = time.monotonic()
        self.every, self._last = every, 0.0

    def line(self) -> str:
        done = self.graded + self.skipped
        elapsed = time.monotonic() - self.start
        rate = self.graded / elapsed if elapsed > 0 else 0.0
        left = self.total - done
        eta = _clock(left / rate) if rate > 0 else "?"
        extra = [f"{self.skipped} skipped"] if self.skipped else []
        if self.failed:
            extra.append(f"{self.failed} failed to run")
        note = f" ({', '.join(extra)})" if extra else ""
        return (f"graded {done}/{self.total}{note} {rate:.2f}/s, {eta} left, "
                f"{_clock(elapsed)} so far")

    def step(self, failed: bool = False) -> None:
        self.graded += 1
        self.failed += bool(failed)
        now = time.monotonic()
        last = self.graded + self.skipped == self.total
        if self.tty:
            if last or now - self._last >= self.every:
                self.stream.write("\r" + self.line() + ("\n" if last else ""))
                self.stream.flush()
                self._last = now
        else:
            self.stream.write(self.line() + "\n")
            self.stream.flush()
