"""Clients' ``X-AgentKV-Offload: always``: ignored unless allowed, then a token bucket per principal
(the rule in ``agentkv.proxy._offload_gate``), and the flags that set it (old names included)."""

from __future__ import annotations

import argparse

import pytest

from agentkv._core import ConfigError
from agentkv.proxy import ProxyConfig
from agentkv.proxy._cli import add_parser, config_from_args
from agentkv.proxy._offload_gate import Admission, OffloadGate
from agentkv.testing import ManualClock


def _gate(clock: ManualClock, *, allowed: bool = True, per_minute: float = 2) -> OffloadGate:
    return OffloadGate(allowed=allowed, per_minute=per_minute, clock=clock)


@pytest.mark.parametrize("mode", ["auto", "pin"])
def test_asks_that_write_nothing_always_pass(mode: str) -> None:
    gate = _gate(ManualClock(), allowed=False)
    for _ in range(10):
        assert gate.admit("alice", mode) == Admission(mode=mode)  # type: ignore[arg-type]


def test_a_disk_ask_is_ignored_when_not_allowed() -> None:
    gate = _gate(ManualClock(), allowed=False)
    assert gate.admit("alice", "disk") == Admission(mode="auto", ignored="not_allowed")


def test_a_principal_gets_a_burst_then_the_rate() -> None:
    clock = ManualClock()
    gate = _gate(clock, per_minute=2)
    assert [gate.admit("alice", "disk").ignored for _ in range(3)] == [
        None, None, "rate_limited"]
    clock.advance(29)
    assert gate.admit("alice", "disk").ignored == "rate_limited"  # refused asks cost nothing
    clock.advance(1)
    assert gate.admit("alice", "disk").ignored is None
    assert gate.admit("alice", "disk").ignored == "rate_limited"


def test_one_principal_over_its_rate_does_not_affect_another() -> None:
    gate = _gate(ManualClock(), per_minute=1)
    assert gate.admit("mallory", "disk").ignored is None
    assert all(gate.admit("mallory", "disk").ignored == "rate_limited" for _ in range(50))
    assert gate.admit("alice", "disk") == Admission(mode="disk")


def test_full_buckets_are_pruned_and_a_pruned_principal_keeps_its_allowance() -> None:
    clock = ManualClock()
    gate = _gate(clock, per_minute=1)
    for n in range(5000):
        gate.admit(f"p{n}", "disk")
    clock.advance(60)
    gate.admit("trigger", "disk")  # past the prune size: full buckets go
    gate.admit("trigger2", "disk")
    assert len(gate._buckets) < 100
    assert gate.admit("p0", "disk").ignored is None  # refilled anyway: nothing was lost


def _args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="agentkv")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["proxy", *flags])


def test_client_offloads_are_off_unless_the_flag_allows_them() -> None:
    assert config_from_args(_args()).allow_client_offload is False
    config = config_from_args(_args("--allow-client-offload", "--client-offload-rate", "30"))
    assert (config.allow_client_offload, config.client_offload_per_minute) == (True, 30.0)


def test_the_old_flag_names_still_work_and_say_on_stderr_that_they_are_deprecated(
    capsys: pytest.CaptureFixture[str],
) -> None:
    old = config_from_args(
        _args("--allow-client-persist", "--client-persist-rate", "30", "--persist-idle", "45")
    )
    new = config_from_args(
        _args("--allow-client-offload", "--client-offload-rate", "30", "--offload-idle", "45")
    )
    assert old == new
    err = capsys.readouterr().err
    for flag, replacement in [
        ("--allow-client-persist", "--allow-client-offload"),
        ("--client-persist-rate", "--client-offload-rate"),
        ("--persist-idle", "--offload-idle"),
    ]:
        assert f"{flag} is deprecated; use {replacement}" in err
    config_from_args(_args("--offload-idle", "45"))
    assert capsys.readouterr().err == ""  # the new names say nothing


def test_the_old_flags_are_hidden_from_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _args("--help")
    out = capsys.readouterr().out
    assert "--offload-idle" in out
    assert "--allow-client-offload" in out
    assert "persist" not in out


def test_the_old_config_field_names_warn_and_set_the_new_fields() -> None:
    with pytest.warns(DeprecationWarning, match="allow_client_offload"):
        config = ProxyConfig(allow_client_persist=True)  # type: ignore[call-arg]
    assert config == ProxyConfig(allow_client_offload=True)
    with pytest.warns(DeprecationWarning, match="offload_idle_s"):
        assert ProxyConfig(offload_idle_s=5.0).persist_idle_s == 5.0  # type: ignore[attr-defined]
    with (
        pytest.raises(TypeError, match="both"),
        pytest.warns(DeprecationWarning, match="persist_idle_s"),
    ):
        ProxyConfig(persist_idle_s=1.0, offload_idle_s=2.0)  # type: ignore[call-arg]


@pytest.mark.parametrize("rate", [0.5, 0, -1, float("inf"), float("nan")])
def test_a_rate_below_one_a_minute_or_not_finite_is_a_config_error(rate: float) -> None:
    with pytest.raises(ConfigError, match="client_offload_per_minute"):
        ProxyConfig(client_offload_per_minute=rate)
