"""A dependency-free progress bar on stderr: redrawn in place on a terminal, a line every 10%
elsewhere (CI logs). Also one-line notices of slow one-time work (compiling a decode program,
timing it for draft_len="auto"), which the command line shows on a terminal (`show_notices`)."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import Iterator

# Where notices go (None: nowhere, the library's default) and whether one is showing: a notice
# inside another (a timing loop compiled while the costs are measured) or in another thread (SSD
# compiles its draft's programs beside the target's) stays silent, so the line stays whole.
_notice_stream = None
_notice_lock = threading.Lock()
_notice_open = False
# A notice that ends sooner leaves no line on a terminal (it is erased): only what a user waited
# for stays on the screen.
NOTICE_KEPT_S = 1.0


def show_notices(stream=None) -> None:
    """Sends notices (`notice`) to `stream` (None: none, the default). The command line sends them
    to stderr where that is a terminal."""
    global _notice_stream
    _notice_stream = stream


@contextlib.contextmanager
def notice(text: str) -> Iterator[None]:
    """Says that `text` ("compiling a decode program") is under way and, when it ends, how long it
    took ("... 13.8 s"), on the stream `show_notices` set; on a terminal a notice shorter than
    NOTICE_KEPT_S is erased when it ends. Nothing where notices are off, or while another shows."""
    global _notice_open
    stream = _notice_stream
    with _notice_lock:
        shown = stream is not None and not _notice_open
        _notice_open = _notice_open or shown
    if not shown:
        yield
        return
    tty = hasattr(stream, "isatty") and stream.isatty()
    line = f"ssd-jax: {text} ..."
    start = time.perf_counter()
    try:
        stream.write(line)
        stream.flush()
        yield
    finally:
        elapsed = time.perf_counter() - start
        if tty and elapsed < NOTICE_KEPT_S:
            stream.write("\r\033[K")
        else:
            stream.write(f" {elapsed:.1f} s\n")
        stream.flush()
        with _notice_lock:
            _notice_open = False


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
