"""``make setup`` hands pip's index configuration to uv (``scripts/uv_index_opts.py``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "uv_index_opts.py"
_spec = importlib.util.spec_from_file_location("uv_index_opts", _PATH)
assert _spec is not None
assert _spec.loader is not None
uv_index_opts = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(uv_index_opts)


def test_pips_index_keys_become_uv_flags_and_the_environment_wins() -> None:
    listed = "\n".join([
        ":env:.default-timeout='180'",
        ":env:.find-links='/opt/env-wheels'",
        "global.cert='/etc/ssl/certs/ca-certificates.crt'",
        "global.constraint='/etc/pip/constraints.txt'",
        "global.extra-index-url='file:///opt/a/simple file:///opt/b/simple'",
        "global.find-links='/opt/wheels'",
        "install.index-url='https://mirror.example/simple'",
    ])
    assert uv_index_opts.uv_flags(listed) == [
        "--index-url", "https://mirror.example/simple",
        "--extra-index-url", "file:///opt/a/simple",
        "--extra-index-url", "file:///opt/b/simple",
        "--find-links", "/opt/env-wheels",
        "--constraint", "/etc/pip/constraints.txt",
    ]  # fmt: skip


def test_no_pip_configuration_gives_no_flags() -> None:
    assert uv_index_opts.uv_flags("") == []
