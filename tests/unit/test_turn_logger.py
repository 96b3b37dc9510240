"""The turn event's logger follows structlog's configuration as the module's proxy does."""

from __future__ import annotations

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
