"""agentkv's events go to the stdlib logger ``agentkv`` (and its children): quiet unless asked.

A library should say nothing unless the application asks, as httpx does: every agentkv module logs
through an ``EventLogger`` that checks the stdlib logger's level before it builds an event, and
hands what passes to ``logging.getLogger(name)``. An application that configures nothing sees the
warnings (stdlib's last-resort handler, on stderr) and nothing below. Three ways to see more:

- ``agentkv.configure_logging(level="INFO")``: a stderr handler on ``agentkv`` (what the CLI's
  ``-v`` does); ``json=True`` for one JSON object a line;
- stdlib configuration, e.g. ``logging.basicConfig(level=logging.DEBUG)`` or
  ``logging.getLogger("agentkv").setLevel(logging.INFO)`` plus a handler: a record's message reads
  ``agentkv.turn session_id=... turn=3 ...``;
- structlog's stdlib integration: ``record.msg`` is the event dict and the record carries what
  ``structlog.stdlib.ProcessorFormatter`` looks for, so a ``ProcessorFormatter`` handler renders
  agentkv's events with the application's processors.

The library never calls ``structlog.configure``: the application's structlog configuration is its
own. One exception to the level check, for tests: while ``structlog.testing.capture_logs`` is
active, every event goes to it (as it did when agentkv logged through structlog's global
configuration), and none reaches stdlib.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any, TextIO

import structlog
from structlog.stdlib import BoundLogger, ProcessorFormatter
from structlog.testing import LogCapture

__all__ = ["LOGGER_NAME", "EventLogger", "configure_logging", "get_logger", "turn_logger"]

LOGGER_NAME = "agentkv"


class _Event(dict[str, Any]):
    """An event dict that reads as ``event key=value ...`` where a stdlib formatter prints it.

    ``ProcessorFormatter`` copies it as the dict it is; a plain ``logging.Formatter`` calls
    ``str()`` on the record's message.
    """

    def __str__(self) -> str:
        fields = " ".join(f"{k}={v!r}" for k, v in self.items() if k not in ("event", "exc_info"))
        return f"{self.get('event')} {fields}" if fields else str(self.get("event"))


def _to_record(
    logger: Any, method_name: str, event_dict: MutableMapping[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The last processor: the arguments of the stdlib call (``ProcessorFormatter``'s shape)."""
    exc_info = event_dict.get("exc_info")
    if exc_info is True:
        exc_info = event_dict["exc_info"] = sys.exc_info()
    return (_Event(event_dict),), {
        "extra": {"_logger": logger, "_name": method_name},
        "exc_info": exc_info or None,
    }


_PROCESSORS: list[Any] = [_to_record]


class EventLogger:
    """What an agentkv module logs through: a structlog logger over one stdlib logger, that builds
    an event only when that logger's level (or ``capture_logs``) wants it.

    >>> logger = get_logger("agentkv")
    >>> logger.info("agentkv.example", turn=1)  # dropped unless INFO is enabled for "agentkv"
    """

    __slots__ = ("_bound", "_captured", "_stdlib")

    def __init__(self, name: str) -> None:
        self._stdlib = logging.getLogger(name)
        self._bound = BoundLogger(self._stdlib, _PROCESSORS, {})
        # structlog's global configuration, bound per call: what capture_logs replaces.
        self._captured = structlog.get_logger(name)

    def at(self, level: int) -> Any:
        """The bound logger to send an event of ``level`` to, or ``None`` when nobody listens."""
        processors = structlog.get_config()["processors"]
        if processors and isinstance(processors[-1], LogCapture):
            return self._captured
        return self._bound if self._stdlib.isEnabledFor(level) else None

    def debug(self, event: str, /, **fields: Any) -> None:
        if (log := self.at(logging.DEBUG)) is not None:
            log.debug(event, **fields)

    def info(self, event: str, /, **fields: Any) -> None:
        if (log := self.at(logging.INFO)) is not None:
            log.info(event, **fields)

    def warning(self, event: str, /, **fields: Any) -> None:
        if (log := self.at(logging.WARNING)) is not None:
            log.warning(event, **fields)

    def error(self, event: str, /, **fields: Any) -> None:
        if (log := self.at(logging.ERROR)) is not None:
            log.error(event, **fields)

    def exception(self, event: str, /, **fields: Any) -> None:
        """An error event with the exception being handled (call it in an ``except`` block)."""
        if (log := self.at(logging.ERROR)) is not None:
            log.exception(event, **fields)


def get_logger(name: str = LOGGER_NAME) -> EventLogger:
    """The logger of an agentkv module; ``name`` is ``agentkv`` or one of its children."""
    return EventLogger(name)


_turn = EventLogger(LOGGER_NAME)


def turn_logger() -> Any:
    """The logger for the event of every turn (``agentkv.turn``), or ``None`` when nobody listens
    at INFO: the turn then builds no event for nothing (the SDK's per-turn fast path)."""
    return _turn.at(logging.INFO)


_handler: logging.Handler | None = None


def configure_logging(
    level: int | str = logging.INFO, *, json: bool = False, stream: TextIO | None = None
) -> None:
    """Print agentkv's events at ``level`` and above to ``stream`` (default stderr).

    One handler on the stdlib logger ``agentkv`` (calling again replaces it), rendering with
    structlog's console renderer, or one JSON object a line with ``json=True``. The logger stops
    propagating, so a handler on the root logger does not print the events twice. Nothing else
    (the root logger, structlog's global configuration) is touched.

    >>> import agentkv
    >>> agentkv.configure_logging("DEBUG")  # doctest: +SKIP
    """
    global _handler  # noqa: PLW0603 - the one handler this function owns, replaced on each call
    logger = logging.getLogger(LOGGER_NAME)
    out = sys.stderr if stream is None else stream
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if json
        else structlog.dev.ConsoleRenderer(colors=out.isatty())
    )
    handler = logging.StreamHandler(out)
    handler.setFormatter(
        ProcessorFormatter(
            processors=[
                ProcessorFormatter.remove_processors_meta,
                structlog.stdlib.add_log_level,
                structlog.processors.TimeStamper(fmt="iso" if json else "%Y-%m-%d %H:%M:%S"),
                *([structlog.processors.dict_tracebacks] if json else []),
                renderer,
            ],
            foreign_pre_chain=[structlog.stdlib.add_log_level],
        )
    )
    if _handler is not None:
        logger.removeHandler(_handler)
    _handler = handler
    logger.addHandler(handler)
    logger.setLevel(level.upper() if isinstance(level, str) else level)
    logger.propagate = False
