"""The one progress bar: a single line on stderr, drawn only when stderr is a terminal.

``App.enqueue_many(progress=True)``, the demo and ``awa-fast bench`` all draw
this bar. Call it (or :meth:`ProgressBar.update`) with the amount done so
far; it redraws at most ten times a second, and ends its line when the total
is reached or :meth:`ProgressBar.close` is called.
"""

from __future__ import annotations

import sys
import time

__all__ = ["ProgressBar"]

_WIDTH = 30
_REDRAW_S = 0.1


class ProgressBar:
    """A minimal stderr progress bar; a no-op when stderr is not a terminal.

    ``unit`` is printed after the counts (``"s"`` for a bar over seconds);
    without a unit the bar also shows the rate per second.
    """

    def __init__(self, total: float, label: str = "", unit: str = "") -> None:
        self.total = total
        self.label = label
        self.unit = unit
        self.started = time.perf_counter()
        self.enabled = sys.stderr.isatty()
        self._last_draw = 0.0
        self._ended = False

    def __call__(self, done: float) -> None:
        self.update(done)

    def update(self, done: float, extra: str = "") -> None:
        """Redraw with ``done`` of the total (throttled); ``extra`` is appended to the line."""
        if not self.enabled or self._ended:
            return
        now = time.perf_counter()
        finished = done >= self.total
        if not finished and now - self._last_draw < _REDRAW_S:
            return
        self._last_draw = now
        frac = min(1.0, done / self.total) if self.total > 0 else 1.0
        filled = int(_WIDTH * frac)
        line = f"\r{self.label} [{'#' * filled}{'.' * (_WIDTH - filled)}] {done:,.0f}/{self.total:,.0f}{self.unit}"
        if not self.unit:
            line += f" {done / max(now - self.started, 1e-9):,.0f}/s"
        sys.stderr.write(f"{line} {extra}   " if extra else f"{line}   ")
        if finished:
            sys.stderr.write("\n")
            self._ended = True
        sys.stderr.flush()

    def close(self) -> None:
        """End the bar's line (once), whether or not the total was reached."""
        if self.enabled and not self._ended:
            sys.stderr.write("\n")
            sys.stderr.flush()
        self._ended = True
