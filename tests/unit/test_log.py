"""agentkv's events reach the stdlib logger ``agentkv`` only when someone listens (``_log.py``)."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import pytest
import structlog
from structlog.testing import capture_logs

import agentkv
from agentkv._log import get_logger, turn_logger

pytestmark = pytest.mark.usefixtures("agentkv_logging")


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _listen(level: int) -> _Records:
    handler = _Records()
    logger = logging.getLogger("agentkv")
    logger.addHandler(handler)
    logger.setLevel(level)
    return handler


def test_no_turn_event_is_built_while_nobody_listens_at_info() -> None:
    """The per-turn fast path: an unconfigured ``agentkv`` logger (root at WARNING) gets no
    logger for the turn event, and one as soon as INFO is enabled."""
    assert turn_logger() is None
    logging.getLogger("agentkv").setLevel(logging.INFO)
    assert turn_logger() is not None


def test_events_below_the_loggers_level_are_dropped_and_the_rest_reach_stdlib() -> None:
    records = _listen(logging.INFO)
    logger = get_logger("agentkv.connector")
    logger.debug("agentkv.test_debug", n=1)
    logger.info("agentkv.test_info", n=2)
    logger.warning("agentkv.test_warning", n=3)
    assert [(r.name, r.levelname, r.getMessage()) for r in records.records] == [
        ("agentkv.connector", "INFO", "agentkv.test_info n=2"),
        ("agentkv.connector", "WARNING", "agentkv.test_warning n=3"),
    ]


def test_capture_logs_sees_every_event_whatever_the_level() -> None:
    """Tests catch events with structlog's ``capture_logs``, as before agentkv went quiet; the
    captured events reach no stdlib handler."""
    records = _listen(logging.WARNING)
    with capture_logs() as events:
        get_logger().debug("agentkv.test_debug", n=1)
        turn_logger().info("agentkv.turn", turn=3)
    assert events == [
        {"event": "agentkv.test_debug", "n": 1, "log_level": "debug"},
        {"event": "agentkv.turn", "turn": 3, "log_level": "info"},
    ]
    assert records.records == []
    assert turn_logger() is None


def test_configure_logging_prints_events_at_its_level_and_replaces_its_handler() -> None:
    first, out = io.StringIO(), io.StringIO()
    agentkv.configure_logging("INFO", stream=first)
    agentkv.configure_logging(logging.INFO, stream=out)
    get_logger().debug("agentkv.test_debug")
    get_logger().info("agentkv.test_info", turn=2)
    assert first.getvalue() == ""
    [line] = out.getvalue().splitlines()
    assert "[info     ] agentkv.test_info" in line
    assert "turn=2" in line


def test_configure_logging_json_writes_one_object_a_line_with_the_traceback() -> None:
    out = io.StringIO()
    agentkv.configure_logging("DEBUG", json=True, stream=out)
    try:
        raise ValueError("boom")
    except ValueError:
        get_logger("agentkv.proxy").exception("agentkv.test_failed", session_id="s1")
    [event] = [json.loads(line) for line in out.getvalue().splitlines()]
    assert event["event"] == "agentkv.test_failed"
    assert event["session_id"] == "s1"
    assert event["level"] == "error"
    assert event["exception"][0]["exc_type"] == "ValueError"


def test_a_processor_formatter_gets_the_event_dict() -> None:
    """An application on structlog's stdlib integration renders agentkv's events itself."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.KeyValueRenderer(key_order=["event"]),
        ])
    )
    logger = logging.getLogger("agentkv")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    get_logger().info("agentkv.test_info", turn=4)
    assert out.getvalue() == "event='agentkv.test_info' turn=4\n"


def test_every_module_logs_through_the_quiet_loggers() -> None:
    """A module on structlog's own ``get_logger`` would print through structlog's global
    configuration (every level, to stdout, when unconfigured): only ``_log.py`` touches it."""
    package = Path(agentkv.__file__).parent
    direct = [
        str(path.relative_to(package))
        for path in sorted(package.rglob("*.py"))
        if path.name != "_log.py" and "structlog.get_logger(" in path.read_text()
    ]
    assert direct == []
