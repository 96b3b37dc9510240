"""The pinned coding-agent CLIs' installer: a warm cache needs no npm, a failure says why."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from agentkv.testing import (
    CODING_AGENT_PACKAGES,
    CodingAgentsUnavailableError,
    install_coding_agents,
)


def _fake_install(prefix: Path, *, skip: str | None = None, version: str | None = None) -> None:
    """What ``npm install --prefix`` leaves: each package's manifest and its command's link."""
    for package, (pinned, command) in CODING_AGENT_PACKAGES.items():
        if package == skip:
            continue
        manifest = prefix / "node_modules" / package / "package.json"
        manifest.parent.mkdir(parents=True, exist_ok=True)
        manifest.write_text(json.dumps({"name": package, "version": version or pinned}))
        binary = prefix / "node_modules" / ".bin" / command
        binary.parent.mkdir(parents=True, exist_ok=True)
        binary.write_text("#!/bin/sh\n")


def _script(path: Path, body: str) -> str:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_a_cache_at_the_pinned_versions_is_used_without_npm(tmp_path: Path) -> None:
    _fake_install(tmp_path)
    calls = tmp_path / "npm-called"
    npm = _script(tmp_path / "npm", f"touch {calls}; exit 1")
    agents = install_coding_agents(tmp_path, npm=npm)
    assert not calls.exists()
    assert agents.bin("codex") == tmp_path / "node_modules" / ".bin" / "codex"
    assert agents.versions["@openai/codex"] == CODING_AGENT_PACKAGES["@openai/codex"][0]


def test_another_version_in_the_cache_is_reinstalled_at_the_pin(tmp_path: Path) -> None:
    _fake_install(tmp_path, version="0.0.1")
    args = tmp_path / "npm-args"
    npm = _script(tmp_path / "npm", f'echo "$@" > {args}; exit 3')
    with pytest.raises(CodingAgentsUnavailableError, match="exited with 3"):
        install_coding_agents(tmp_path, npm=npm)
    asked = args.read_text().split()
    assert asked[:3] == ["install", "--prefix", str(tmp_path)]
    for package, (version, _) in CODING_AGENT_PACKAGES.items():
        assert f"{package}@{version}" in asked


def test_only_what_is_missing_is_installed_and_progress_says_so(tmp_path: Path) -> None:
    _fake_install(tmp_path, skip="opencode-ai")
    args = tmp_path / "npm-args"
    # A stand-in npm that installs what it was asked for.
    pinned = CODING_AGENT_PACKAGES["opencode-ai"][0]
    modules = tmp_path / "node_modules"
    npm = _script(
        tmp_path / "npm",
        f'echo "$@" > {args}; mkdir -p {modules}/opencode-ai; '
        f"echo '{{\"version\": \"{pinned}\"}}' > {modules}/opencode-ai/package.json; "
        f"touch {modules}/.bin/opencode",
    )
    said: list[str] = []
    install_coding_agents(tmp_path, npm=npm, progress=said.append)
    assert args.read_text().split()[-1] == f"opencode-ai@{pinned}"
    assert said[0].startswith(f"installing opencode-ai@{pinned} into {tmp_path}")
    assert said[-1] == "installed"


def test_no_npm_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(CodingAgentsUnavailableError, match="npm is not on PATH"):
        install_coding_agents(tmp_path / "cache")
