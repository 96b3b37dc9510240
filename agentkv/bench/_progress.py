"""A progress bar on stderr: one line redrawn in place on a terminal, a line per turn otherwise."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

from agentkv.bench._samples import TurnSample

__all__ = ["ProgressBar"]

_WIDTH = 24


class ProgressBar:
    """Counts finished turns out of ``total``.

    >>> import io
    >>> out = io.StringIO()
    >>> bar = ProgressBar(4, stream=out, clock=lambda: 0.0)
    >>> bar.start()
    >>> out.getvalue().strip()
    '[bench] [------------------------] 0/4'
    """

    def __init__(
        self,
        total: int,
        *,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._total = total
        self._done = 0
        self._stream = stream if stream is not None else sys.stderr
        self._clock = clock
        self._started = 0.0
        self._tty = bool(getattr(self._stream, "isatty", lambda: False)())

    def _line(self, note: str) -> str:
        filled = _WIDTH * self._done // max(1, self._total)
        bar = "#" * filled + "-" * (_WIDTH - filled)
        width = len(str(self._total))
        text = f"[bench] [{bar}] {self._done:>{width}}/{self._total}"
        if self._done:
            elapsed = self._clock() - self._started
            left = elapsed / self._done * (self._total - self._done)
            text += f"  {elapsed:5.0f}s elapsed, ~{left:.0f}s left"
        return f"{text}  {note}" if note else text

    def _write(self, note: str = "") -> None:
        line = self._line(note)
        if self._tty:
            self._stream.write("\r\x1b[2K" + line)
        else:
            self._stream.write(line + "\n")
        self._stream.flush()

    def start(self) -> None:
        self._started = self._clock()
        self._write()

    def update(self, sample: TurnSample) -> None:
        self._done += 1
        if sample.ok:
            note = (f"{sample.mode.value} s{sample.session} t{sample.turn}: "
                    f"ttft {sample.ttft_s * 1000:.0f} ms, reused {sample.reused_tokens}"
                    f"/{sample.prompt_tokens}")
        else:
            note = f"{sample.mode.value} s{sample.session} t{sample.turn}: FAILED"
        self._write(note)

    def close(self) -> None:
        if self._tty:
            self._stream.write("\n")
            self._stream.flush()
