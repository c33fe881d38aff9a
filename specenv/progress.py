"""Progress of long work: a bar in a terminal, periodic plain lines elsewhere, nothing when quiet.

The one owner of how specenv shows progress (DESIGN.md section 8). Library functions never print:
they take an optional ``progress`` callback, and the caller (the CLI, a script) feeds it into a
:class:`Progress`::

    with Progress("bench", total=19, unit="policies") as prog:
        run_benchmark(..., progress=lambda name: prog.advance(what=name))

What a :class:`Progress` shows depends on where its stream goes:

* a terminal: a rich progress bar (description, bar, done/total, elapsed, time left), erased at the end;
* anything else (a log file, CI, a notebook, a pipe): one plain line every ``interval`` seconds
  (default 5, environment variable ``SPECENV_PROGRESS_INTERVAL``) with the counts, the elapsed time
  and an ETA, e.g. ``bench: 7/19 policies (ucb), 41 s elapsed, ETA 70 s``; a timer thread writes it,
  so a step that reports nothing for a while still shows that it runs. If any line was written, a
  last ``... done in`` line follows when the work ends without an error;
* quiet (:func:`set_quiet`, the CLI's ``--quiet``): nothing.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from types import TracebackType
from typing import Any, TextIO

__all__ = ["DEFAULT_INTERVAL", "Progress", "format_duration", "is_quiet", "set_quiet"]

#: Seconds between two plain progress lines (overridden by ``SPECENV_PROGRESS_INTERVAL``).
DEFAULT_INTERVAL = 5.0

_quiet = False


def set_quiet(quiet: bool) -> None:
    """Turn every :class:`Progress` created afterwards off (``True``) or on again (``False``)."""
    global _quiet
    _quiet = bool(quiet)


def is_quiet() -> bool:
    """Whether progress output is turned off (:func:`set_quiet`)."""
    return _quiet


def _interval_from_env() -> float:
    raw = os.environ.get("SPECENV_PROGRESS_INTERVAL", "")
    try:
        value = float(raw)
    except ValueError:
        return DEFAULT_INTERVAL
    return value if math.isfinite(value) and value > 0 else DEFAULT_INTERVAL


def format_duration(seconds: float) -> str:
    """``41 s``, ``3 min 05 s`` or ``1 h 02 min``: a duration for a progress line."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


class Progress:
    """Progress of one long step, shown as a bar, as plain lines or not at all (module docstring).

    Use it as a context manager; :meth:`update` and :meth:`advance` may be called from the work's
    callbacks. Outside the ``with`` block (and when quiet) they only record the state.

    Args:
        label: What runs, the start of every line (``bench``, ``fit``).
        total: Number of items, if known (a bar without it pulses; lines show no ETA).
        unit: What an item is, plural (``policies``, ``generations``).
        stream: Where to write (default: ``sys.stderr`` at construction).
        mode: ``"bar"``, ``"lines"`` or ``"off"``; default: off when quiet, a bar when ``stream``
            is a terminal, lines otherwise.
        interval: Seconds between plain lines (default ``SPECENV_PROGRESS_INTERVAL`` or 5).
    """

    def __init__(
        self,
        label: str,
        total: int | None = None,
        unit: str = "",
        *,
        stream: TextIO | None = None,
        mode: str | None = None,
        interval: float | None = None,
    ) -> None:
        self.label = label
        self.total = total
        self.unit = unit
        self.done = 0
        self.what = ""
        self._stream = stream if stream is not None else sys.stderr
        if mode is None:
            mode = "off" if _quiet else ("bar" if _is_terminal(self._stream) else "lines")
        if mode not in ("bar", "lines", "off"):
            raise ValueError(f"mode={mode!r}: expected 'bar', 'lines' or 'off'")
        self.mode = mode
        self.interval = _interval_from_env() if interval is None else float(interval)
        self._start = time.monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lines = 0
        self._t_done = 0.0  # seconds into the phase when ``done`` last changed (the rate behind the ETA)
        self._phase_start = 0.0  # elapsed seconds when the current phase began (:meth:`phase`)
        self.phase_name = ""
        self._bar: Any = None
        self._task: Any = None

    # ---------------------------------------------------------------- state

    def update(self, done: int | None = None, total: int | None = None, what: str | None = None) -> None:
        """Set the items done, the total and/or what runs now (``None`` keeps a value)."""
        with self._lock:
            if done is not None and int(done) != self.done:
                self.done = int(done)
                self._t_done = self.elapsed - self._phase_start
            if total is not None:
                self.total = int(total)
            if what is not None:
                self.what = what
        self._refresh_bar()

    def phase(self, name: str, total: int | None = None) -> None:
        """Begin a new phase of the work (``train fit``, ``repeats``): its own count, total and ETA.

        The elapsed time stays the whole step's; the ETA is the phase's, from its own rate.
        """
        with self._lock:
            self.phase_name, self.done, self.total, self.what = name, 0, total, ""
            self._phase_start, self._t_done = self.elapsed, 0.0
        if self._bar is not None:  # the bar's own clock and time left start again too
            self._bar.reset(self._task, total=total, completed=0, description=self._description())

    def advance(self, n: int = 1, what: str | None = None) -> None:
        """Count ``n`` more items done (and set what runs now)."""
        self.update(done=self.done + n, what=what)

    def echo(self, message: str) -> None:
        """Write one line of the work's own log (above the bar; dropped when off)."""
        if self.mode == "off":
            return
        if self._bar is not None:
            self._bar.console.print(message, markup=False, highlight=False)
        else:
            self._write(message)

    @property
    def elapsed(self) -> float:
        """Seconds since the step started."""
        return time.monotonic() - self._start

    def line(self, final: bool = False) -> str:
        """The plain progress line of the current state (``final``: the closing ``done in`` line)."""
        with self._lock:
            done, total, what, t_done = self.done, self.total, self.what, self._t_done
            label, phase_start = (
                (f"{self.label} {self.phase_name}" if self.phase_name else self.label),
                self._phase_start,
            )
        unit = f" {self.unit}" if self.unit else ""
        count = f"{done}/{total}{unit}" if total is not None else (f"{done}{unit}" if done else "")
        parts = [p for p in (count, f"({what})" if what and not final else "") if p]
        head = f"{label}: {' '.join(parts)}" if parts else f"{label}:"
        if final:
            return f"{head}{',' if parts else ''} done in {format_duration(self.elapsed)}"
        elapsed = self.elapsed
        tail = f"{format_duration(elapsed)} elapsed"
        if total and 0 < done < total:  # the rate up to the last item done, counted down since then
            since = elapsed - phase_start - t_done
            tail += f", ETA {format_duration(max(t_done * (total - done) / done - since, 0.0))}"
        return f"{head}, {tail}" if parts else f"{head} {tail}"

    # ---------------------------------------------------------------- context

    def __enter__(self) -> Progress:
        self._start = time.monotonic()
        if self.mode == "bar":
            self._start_bar()
        elif self.mode == "lines":
            self._thread = threading.Thread(target=self._tick, name=f"progress-{self.label}", daemon=True)
            self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            if exc_type is None and self._lines:
                if self.total is not None:
                    self.done = self.total  # the work ended: every item is done
                self._write(self.line(final=True))
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    # ---------------------------------------------------------------- output

    def _tick(self) -> None:
        while not self._stop.wait(self.interval):
            self._write(self.line())
            self._lines += 1

    def _write(self, text: str) -> None:
        try:
            self._stream.write(text + "\n")
            self._stream.flush()
        except (OSError, ValueError):  # a closed or broken stream never breaks the work
            pass

    def _start_bar(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
        from rich.progress import Progress as RichProgress

        self._bar = RichProgress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=Console(file=self._stream),
            transient=True,
        )
        self._task = self._bar.add_task(self._description(), total=self.total, completed=self.done)
        self._bar.start()

    def _description(self) -> str:
        label = f"{self.label} {self.phase_name}" if self.phase_name else self.label
        return f"{label} ({self.what})" if self.what else label

    def _refresh_bar(self) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done, total=self.total, description=self._description())


def _is_terminal(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False
