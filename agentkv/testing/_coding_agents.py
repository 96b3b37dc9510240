"""The three coding-agent CLIs, pinned, installed from the npm registry into a cache directory.

The end-to-end tests run Claude Code, Codex and OpenCode unmodified against ``agentkv proxy``.
Their versions are pinned here, in one place: DESIGN.md section 6 records what exactly these
versions send on the wire, and a newer CLI may send something else. The install is
``npm install --prefix <cache>`` and happens once: a cache whose packages are already at the
pinned versions is used as it is, without npm and without the network.

Example:
    >>> agents = install_coding_agents(Path.home() / ".cache/agentkv/npm")  # doctest: +SKIP
    >>> agents.bin("codex")  # doctest: +SKIP
    PosixPath('/root/.cache/agentkv/npm/node_modules/.bin/codex')
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "CODING_AGENT_PACKAGES",
    "CodingAgents",
    "CodingAgentsUnavailableError",
    "install_coding_agents",
]

# npm package -> (pinned version, the command it installs).
CODING_AGENT_PACKAGES: dict[str, tuple[str, str]] = {
    "@anthropic-ai/claude-code": ("2.1.328", "claude"),
    "@openai/codex": ("0.169.0", "codex"),
    "opencode-ai": ("1.18.33", "opencode"),
}

# Each CLI ships its native binary as an optional dependency for the platform: about 1 GiB in
# all, a few minutes on a slow link.
_INSTALL_TIMEOUT_S = 900.0


class CodingAgentsUnavailableError(RuntimeError):
    """The CLIs cannot be installed here: no npm, or npm failed (the registry unreachable)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CodingAgents:
    """The installed CLIs: ``bin(name)`` is the path of ``claude``, ``codex`` or ``opencode``."""

    prefix: Path
    versions: dict[str, str]

    def bin(self, command: str) -> Path:
        """The executable of ``command`` (one of the commands in ``CODING_AGENT_PACKAGES``)."""
        return self.prefix / "node_modules" / ".bin" / command


def _installed_version(prefix: Path, package: str) -> str | None:
    manifest = prefix / "node_modules" / package / "package.json"
    try:
        version = json.loads(manifest.read_text()).get("version")
    except (OSError, ValueError):
        return None
    return version if isinstance(version, str) else None


def _missing(prefix: Path) -> list[str]:
    """The pinned ``package@version`` specs the cache does not hold (wrong version or absent)."""
    return [
        f"{package}@{version}"
        for package, (version, command) in sorted(CODING_AGENT_PACKAGES.items())
        if _installed_version(prefix, package) != version
        or not (prefix / "node_modules" / ".bin" / command).exists()
    ]


def install_coding_agents(
    prefix: Path,
    *,
    progress: Callable[[str], None] = lambda _message: None,
    npm: str | None = None,
) -> CodingAgents:
    """Install the pinned CLIs under ``prefix`` unless they are there already; return them.

    ``npm`` is the npm executable (default: the one on ``PATH``). Raises
    :class:`CodingAgentsUnavailableError` with npm's own words when it is missing or fails.
    """
    missing = _missing(prefix)
    if missing:
        npm = npm or shutil.which("npm")
        if npm is None:
            raise CodingAgentsUnavailableError(
                f"npm is not on PATH: cannot install {', '.join(missing)} (install Node.js 20+)"
            )
        prefix.mkdir(parents=True, exist_ok=True)
        progress(f"installing {' '.join(missing)} into {prefix} (npm, once; ~1 GiB)")
        # --ignore-scripts: the packages' postinstall scripts only copy the native binary over
        # a launcher that finds it by itself; npm 11 skips them anyway unless approved.
        command = [
            npm, "install", "--prefix", str(prefix), "--no-audit", "--no-fund",
            "--ignore-scripts", "--save-exact", "--loglevel", "error", *missing,
        ]  # fmt: skip
        try:
            done = subprocess.run(
                command, capture_output=True, text=True, timeout=_INSTALL_TIMEOUT_S, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as error:
            raise CodingAgentsUnavailableError(f"{' '.join(command)}: {error}") from error
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip()[-2000:]
            raise CodingAgentsUnavailableError(
                f"{' '.join(command)} exited with {done.returncode}:\n{tail}"
            )
        still = _missing(prefix)
        if still:
            raise CodingAgentsUnavailableError(f"npm installed, but {', '.join(still)} are missing")
        progress("installed")
    versions = {package: version for package, (version, _) in CODING_AGENT_PACKAGES.items()}
    return CodingAgents(prefix=prefix, versions=versions)
