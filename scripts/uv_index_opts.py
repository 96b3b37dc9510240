"""Print pip's index options (pip.conf files, ``PIP_*`` variables) as ``uv pip install`` flags.

``make setup`` installs with uv, which reads no pip configuration: a machine whose pip finds
torch's CPU wheel through a configured index or ``find-links`` directory must give uv the same
places. pip resolves its own configuration (``pip config list``); this maps the keys that say
where packages come from onto uv's flags of the same meaning.
"""

from __future__ import annotations

import shlex
import subprocess
import sys

# pip key -> uv flag; values of the list keys are whitespace-separated, as in pip.conf.
_FLAGS = {
    "index-url": "--index-url",
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraint",
}
# Lowest to highest precedence: pip's environment variables override its files.
_SECTIONS = ("global", "install", ":env:")


def uv_flags(pip_config_list: str) -> list[str]:
    """The uv flags for ``pip config list``'s lines (``section.key='value'``)."""
    found: dict[tuple[str, str], str] = {}
    for line in pip_config_list.splitlines():
        name, _, raw = line.partition("=")
        section, _, key = name.rpartition(".")
        if section in _SECTIONS and key in _FLAGS:
            found[section, key] = " ".join(shlex.split(raw))
    values: dict[str, str] = {}
    for key in _FLAGS:
        for section in reversed(_SECTIONS):
            if (section, key) in found:
                values[key] = found[section, key]
                break
    flags = []
    for key, value in values.items():
        for item in value.split():
            flags += [_FLAGS[key], item]
    return flags


def main() -> int:
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False
    ).stdout
    print(shlex.join(uv_flags(listed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
