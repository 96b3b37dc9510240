"""agentkv's vLLM general plugin: off unless asked, and loud when half configured."""

from __future__ import annotations

import logging

import pytest

from agentkv.connector import _plugin

# register() configures the agentkv logger for the server's process: reset around each test.
pytestmark = pytest.mark.usefixtures("agentkv_logging")


def test_the_plugin_environment_adds_agentkv_to_the_allowlist_and_keeps_others() -> None:
    assert _plugin.plugin_env({}) == {"AGENTKV_VLLM_PLUGIN": "1", "VLLM_PLUGINS": "agentkv"}
    assert _plugin.plugin_env({"VLLM_PLUGINS": "a,agentkv"})["VLLM_PLUGINS"] == "a,agentkv"
    assert _plugin.plugin_env({"VLLM_PLUGINS": "a"})["VLLM_PLUGINS"] == "a,agentkv"


@pytest.mark.parametrize("allowlist", [None, "agentkv"])
def test_without_the_flag_the_plugin_does_nothing(
    monkeypatch: pytest.MonkeyPatch, allowlist: str | None
) -> None:
    from agentkv.connector import _compile_cache, _engine_rpc, _quiet

    calls: list[str] = []
    monkeypatch.setattr(_quiet, "apply", lambda: calls.append("quiet"))
    monkeypatch.setattr(_engine_rpc, "install", lambda: calls.append("leases"))
    monkeypatch.setattr(_compile_cache, "apply", lambda: calls.append("compile_cache"))
    monkeypatch.delenv("AGENTKV_VLLM_PLUGIN", raising=False)
    if allowlist is None:
        monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    else:
        monkeypatch.setenv("VLLM_PLUGINS", allowlist)
    assert _plugin.enabled() is False
    _plugin.register()  # no error, and nothing installed in this vLLM process
    assert calls == []
    assert not logging.getLogger("agentkv").isEnabledFor(logging.INFO)
    # The same environment with the flag installs all three (so the check above can fail).
    monkeypatch.setenv("AGENTKV_VLLM_PLUGIN", "1")
    monkeypatch.setenv("VLLM_PLUGINS", "agentkv")
    _plugin.register()
    assert sorted(calls) == ["compile_cache", "leases", "quiet"]
    # The connector's events reach the server's log at every level.
    assert logging.getLogger("agentkv.connector").isEnabledFor(logging.DEBUG)


@pytest.mark.parametrize("allowlist", [None, "", "lora_filesystem_resolver"])
def test_the_flag_without_the_endpoint_allowlisted_refuses_to_start(
    monkeypatch: pytest.MonkeyPatch, allowlist: str | None
) -> None:
    monkeypatch.setenv("AGENTKV_VLLM_PLUGIN", "1")
    if allowlist is None:
        monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    else:
        monkeypatch.setenv("VLLM_PLUGINS", allowlist)
    with pytest.raises(RuntimeError, match="VLLM_PLUGINS"):
        _plugin.register()


@pytest.mark.parametrize(("quiet", "applied"), [(None, True), ("1", True), ("0", False)])
def test_agentkv_quiet_0_keeps_vllms_busy_waits_and_the_lease_calls(
    monkeypatch: pytest.MonkeyPatch, quiet: str | None, applied: bool
) -> None:
    from agentkv.connector import _engine_rpc, _quiet

    calls: list[str] = []
    monkeypatch.setattr(_quiet, "apply", lambda: calls.append("quiet"))
    monkeypatch.setattr(_engine_rpc, "install", lambda: calls.append("leases"))
    monkeypatch.setenv("AGENTKV_VLLM_PLUGIN", "1")
    monkeypatch.setenv("VLLM_PLUGINS", "agentkv")
    if quiet is None:
        monkeypatch.delenv("AGENTKV_QUIET", raising=False)
    else:
        monkeypatch.setenv("AGENTKV_QUIET", quiet)
    _plugin.register()
    assert calls == (["quiet", "leases"] if applied else ["leases"])
