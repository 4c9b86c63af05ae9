"""A dependency-free progress bar on stderr: redrawn in place on a terminal, a line every 10%
elsewhere (CI logs)."""

from __future__ import annotations

import sys
import time


class Progress:
    """Usage: `with Progress(total, "converting") as bar: bar.update(1, loss=0.3)`."""

    def __init__(self, total: int, desc: str, unit: str = "it", stream=None, enabled: bool = True):
        self.total = max(int(total), 1)
        self.desc = desc
        self.unit = unit
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.count = 0
        self.start = time.perf_counter()
        self._tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._last_decile = -1
        self.postfix: dict = {}

    def update(self, n: int = 1, **postfix) -> None:
        self.count = min(self.count + n, self.total)
        self.postfix.update(postfix)
        self._draw()

    def _line(self) -> str:
        frac = self.count / self.total
        elapsed = time.perf_counter() - self.start
        rate = self.count / elapsed if elapsed > 0 else 0.0
        filled = int(24 * frac)
        extra = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in self.postfix.items())
        return (f"{self.desc}: {frac:4.0%} |{'#' * filled}{'.' * (24 - filled)}| {self.count}/{self.total} "
                f"[{elapsed:.1f}s, {rate:.3g} {self.unit}/s] {extra}").rstrip()

    def _draw(self) -> None:
        if not self.enabled:
            return
        if self._tty:
            self.stream.write("\r" + self._line())
            self.stream.flush()
            return
        decile = int(10 * self.count / self.total)
        if decile != self._last_decile:
            self._last_decile = decile
            self.stream.write(self._line() + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self.enabled and self._tty:
            self.stream.write("\n")
            self.stream.flush()

    def __enter__(self) -> "Progress":
        self._draw()
        return self

    def __exit__(self, *exc) -> None:
        self.close()
