"""A one-line progress bar on stderr, for the long commands of every part of pyvis (no dependency)."""
from __future__ import annotations

import sys
import time


class Progress:
    """A one-line progress bar on stderr (no dependency)."""

    def __init__(self, label: str, total: int, unit: str = "MiB", scale: float = 1 / (1 << 20)):
        self.label, self.total, self.unit, self.scale = label, total, unit, scale
        self.t0 = time.monotonic()
        self.last = 0.0
        self.tty = sys.stderr.isatty()

    def __call__(self, done: int, total: int | None = None) -> None:
        total = total or self.total
        now = time.monotonic()
        if done < total and now - self.last < (0.1 if self.tty else 5.0):
            return
        self.last = now
        frac = done / total if total else 1.0
        bar = "#" * int(30 * frac)
        rate = done * self.scale / max(now - self.t0, 1e-9)
        msg = (f"{self.label} [{bar:<30}] {100 * frac:5.1f}% "
               f"{done * self.scale:.0f}/{total * self.scale:.0f} {self.unit} {rate:.0f} {self.unit}/s")
        end = "\r" if self.tty and done < total else "\n"
        sys.stderr.write(msg + end)
        sys.stderr.flush()
