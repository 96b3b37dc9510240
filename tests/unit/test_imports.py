"""The package's modules import each other without a circle (imports for type checking count)."""

from __future__ import annotations

import ast
from pathlib import Path

import agentkv

ROOT = Path(agentkv.__file__).parent

# Circles that predate this test, to be broken; nothing may join them and no new one may appear.
KNOWN: set[frozenset[str]] = set()


def _modules() -> dict[str, Path]:
    modules = {}
    for path in ROOT.rglob("*.py"):
        parts = ("agentkv", *path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, *([node.module] if node.module else [])])
                # ``from package import module`` imports the module, not the package's face.
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                    for alias in node.names
                ]
            for target in targets:
                found = owner(target) if target.startswith("agentkv") else None
                if found is not None and found != name:
                    graph[name].add(found)
    return graph


def _circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for root, children in graph.items():
        if root in index:
            continue
        work = [(root, iter(sorted(children)))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, pending = work[-1]
            child = next(pending, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def test_the_circle_finder_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(graph) == [frozenset({"a", "b", "c"})]


# ``agentkv.OpenAI`` is built on the proxy app, which imports the public package: the package
# imports it on first use (``__getattr__``), never at import time, so that edge is no circle.
LAZY_EXPORTS = {("agentkv", "agentkv._openai.client")}


def test_no_module_of_the_package_is_in_an_import_circle() -> None:
    modules = _modules()
    assert "agentkv._client.session" in modules
    graph = _graph(modules)
    for source, target in LAZY_EXPORTS:
        assert target in graph[source]
        graph[source].discard(target)
    circles = set(_circles(graph))
    assert circles <= KNOWN, sorted(sorted(circle) for circle in circles - KNOWN)


# The apps built on the SDK, and the layer they may share with it besides the public package.
APPS = (
    "agentkv.proxy",
    "agentkv.bench",
    "agentkv.local",
    "agentkv.integrations",
    "agentkv.testing",
    "agentkv.connector",
    "agentkv.cli",
    "agentkv._openai",
)
# Bytes on the wire (JSON, the handoff, the hints and lease routes, HTTP helpers) are a protocol
# the apps speak with the SDK (the connector is its other end), not the SDK's core.
SHARED = ("agentkv._wire",)
# Core names an app still imports, each with its reason. Nothing may join this list unnoticed.
ALLOWED = {
    # The one event loop on a thread (sync twins, the proxy server, the fake pair's HTTP host).
    ("agentkv.proxy._server", "agentkv._client.portal"),
    ("agentkv.testing._fake_http", "agentkv._client.portal"),
    ("agentkv._openai.transport", "agentkv._client.portal"),
}


def _app(name: str) -> str | None:
    return next((app for app in APPS if name == app or name.startswith(f"{app}.")), None)


def test_the_apps_import_the_public_package_not_the_core() -> None:
    modules = _modules()
    graph = _graph(modules)
    reached_in = set()
    for name, targets in graph.items():
        app = _app(name)
        if app is None:
            continue
        for target in targets:
            public = target == "agentkv" or target.startswith(SHARED)
            own = _app(target) == app
            if not public and not own and _app(target) is None:
                reached_in.add((name, target))
    assert reached_in == ALLOWED, sorted(reached_in ^ ALLOWED)
