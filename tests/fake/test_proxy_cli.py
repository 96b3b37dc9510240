"""``agentkv proxy``'s flags, and the command itself serving the fake pair in a child process."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx2
import pytest

from agentkv import ConfigError
from agentkv.proxy import ProxyConfig
from agentkv.proxy._cli import add_parser, config_from_args
from agentkv.testing import FakeCluster

# What `agentkv proxy ARGS` runs, until agentkv.cli wires the subcommand in.
# ``agentkv -v proxy ...``: the CLI's -v prints agentkv's info events (quiet by default).
RUN_CLI = """
import sys
from agentkv.cli import main
sys.exit(main(["-v", *sys.argv[1:]]))
"""


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="agentkv")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["proxy", *argv])


def test_flags_map_onto_proxy_config(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("alice sk-a\n")
    args = _parse(
        "--host", "0.0.0.0", "--port", "9000", "--api-keys", str(keys),
        "--session-idle-timeout", "30", "--max-sessions", "7", "--max-body-bytes", "4096",
        "--default-max-tokens", "64",
    )  # fmt: skip
    config = config_from_args(args)
    assert (config.host, config.port) == ("0.0.0.0", 9000)
    assert config.api_keys is not None
    assert config.api_keys.principal("sk-a") == "alice"
    assert config.session_idle_timeout_s == 30
    assert (config.max_sessions, config.max_body_bytes, config.default_max_tokens) == (7, 4096, 64)


def test_slow_client_flags_map_onto_proxy_config_and_zero_turns_each_off():
    config = config_from_args(
        _parse(
            "--body-timeout", "2.5", "--body-min-rate", "1000", "--header-timeout", "3",
            "--max-connections", "50",
        )
    )  # fmt: skip
    assert (config.body_timeout_s, config.body_min_rate) == (2.5, 1000)
    assert (config.header_timeout_s, config.max_connections) == (3, 50)
    off = config_from_args(
        _parse(
            "--body-timeout", "0", "--body-min-rate", "0", "--header-timeout", "0",
            "--max-connections", "0",
        )
    )  # fmt: skip
    assert (off.body_timeout_s, off.body_min_rate) == (None, None)
    assert (off.header_timeout_s, off.max_connections) == (None, None)


def test_defaults_are_proxy_configs():
    config = config_from_args(_parse())
    assert config == ProxyConfig()


@pytest.mark.parametrize(
    "bad",
    [
        ["--max-sessions", "0"],
        ["--api-keys", "/nonexistent/keys"],
        ["--body-timeout", "-1"],
        ["--body-timeout", "inf"],
        ["--body-min-rate", "-5"],
        ["--header-timeout", "nan"],
        ["--max-connections", "1"],
    ],
)
def test_bad_flags_are_config_errors(bad):
    with pytest.raises(ConfigError):
        config_from_args(_parse(*bad))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_the_command_serves_until_terminated(tmp_path):
    """The real path: cluster file, uvicorn, a conversation, then a clean SIGTERM shutdown."""
    fake = FakeCluster(pairs=1)
    with fake.serve() as served:
        cluster_file = tmp_path / "cluster.json"
        cluster_file.write_text(json.dumps(served.cluster_spec))
        port = _free_port()
        argv = ["proxy", "--cluster-file", str(cluster_file), "--port", str(port),
                "--log-level", "warning"]  # fmt: skip
        process = subprocess.Popen(
            [sys.executable, "-c", RUN_CLI, *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 30
            while True:
                try:
                    if httpx2.get(f"{url}/healthz").status_code == 200:
                        break
                except httpx2.TransportError:
                    pass
                assert process.poll() is None, process.stdout.read()
                assert time.monotonic() < deadline, "the proxy did not start"
                time.sleep(0.1)
            messages = [
                {"role": "system", "content": "Answer briefly. " * 40},
                {"role": "user", "content": "Hi"},
            ]
            for turn in range(2):
                response = httpx2.post(
                    f"{url}/v1/chat/completions",
                    json={"messages": messages, "max_tokens": 8},
                    headers={"X-Session-ID": "cli"},
                )
                assert response.status_code == 200, response.text
                assert response.headers["x-agentkv-handle"] == ("none", "attached")[turn]
                messages += [response.json()["choices"][0]["message"],
                             {"role": "user", "content": "More"}]  # fmt: skip
        finally:
            process.send_signal(signal.SIGTERM)
            output = process.communicate(timeout=30)[0].decode()
        # uvicorn shuts down gracefully, then re-raises the signal for the exit status.
        assert process.returncode in (0, -signal.SIGTERM), output
        assert "agentkv.proxy.session_closed" in output  # sessions are closed on shutdown
        assert "agentkv.proxy.stopped" in output
