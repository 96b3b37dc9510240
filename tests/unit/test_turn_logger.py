"""The turn event's logger follows structlog's configuration as the module's proxy does."""

from __future__ import annotations

import logging

import structlog
from structlog.testing import capture_logs

from agentkv._client.state import turn_logger


def test_each_configuration_gets_the_event() -> None:
    with capture_logs() as first:
        turn_logger().info("agentkv.turn", turn=1)
    with capture_logs() as second:
        turn_logger().info("agentkv.turn", turn=2)
    assert first == [{"event": "agentkv.turn", "turn": 1, "log_level": "info"}]
    assert second == [{"event": "agentkv.turn", "turn": 2, "log_level": "info"}]


def test_a_logger_bound_under_one_configuration_is_reused_until_it_changes() -> None:
    saved = structlog.get_config()
    try:
        structlog.configure(processors=[structlog.testing.LogCapture()])
        assert turn_logger() is turn_logger()
        before = turn_logger()
        structlog.configure(processors=[structlog.testing.LogCapture()])
        assert turn_logger() is not before
    finally:
        structlog.configure(**saved)


def test_no_logger_when_the_configuration_drops_info_events() -> None:
    """A turn builds no event that the configured level would drop, and builds it again when
    the level lets it through."""
    saved = structlog.get_config()
    try:
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
        assert turn_logger() is None
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
        assert turn_logger() is not None
    finally:
        structlog.configure(**saved)
    with capture_logs() as events:
        turn_logger().info("agentkv.turn", turn=3)
    assert events == [{"event": "agentkv.turn", "turn": 3, "log_level": "info"}]
