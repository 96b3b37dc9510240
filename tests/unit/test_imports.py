"""The package's modules import each other without a circle (imports for type checking and
imports written inside a function count), and the apps built on the core import it through one
surface, ``agentkv._core``."""

from __future__ import annotations

import ast
from pathlib import Path

import agentkv

ROOT = Path(agentkv.__file__).parent

# Circles that predate this test, to be broken; nothing may join them and no new one may appear.
KNOWN: set[frozenset[str]] = set()


def _modules(root: Path = ROOT) -> dict[str, Path]:
    modules = {}
    for path in root.rglob("*.py"):
        parts = (root.name, *path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Each module's imports of the package's modules, wherever they are written (in a function,
    under ``TYPE_CHECKING``): ``from agentkv import X`` is an edge to ``agentkv/__init__.py``."""
    top = next(iter(modules)).partition(".")[0]

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
                found = owner(target) if target.partition(".")[0] == top else None
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


def test_the_circle_finder_sees_a_circle_through_a_package_face(tmp_path: Path) -> None:
    """A lazy export (imported in ``__getattr__``) whose module imports the package back."""
    package = tmp_path / "pkg"
    (package / "front").mkdir(parents=True)
    (package / "__init__.py").write_text(
        "def __getattr__(name):\n    from pkg.front import client\n    return client.Client\n"
    )
    (package / "front" / "__init__.py").write_text("")
    (package / "front" / "client.py").write_text("from pkg import Cluster\n")
    (package / "core.py").write_text("from pkg.front.client import *\n")
    assert _circles(_graph(_modules(package))) == [frozenset({"pkg", "pkg.front.client"})]


def test_no_module_of_the_package_is_in_an_import_circle() -> None:
    """``agentkv.OpenAI`` is served by the proxy's app: that app reaches the core through
    ``agentkv._core``, never through the package that exports the drop-in."""
    modules = _modules()
    assert "agentkv._client.session" in modules
    graph = _graph(modules)
    assert "agentkv._openai.client" in graph["agentkv"]
    circles = set(_circles(graph))
    assert circles <= KNOWN, sorted(sorted(circle) for circle in circles - KNOWN)


# The apps built on the core.
APPS = (
    "agentkv.proxy",
    "agentkv.bench",
    "agentkv.local",
    "agentkv.integrations",
    "agentkv.testing",
    "agentkv.connector",
    "agentkv.cli",
    "agentkv._openai",
    "agentkv._anthropic",
)
# What an app may import of the core: the public package and the one internal surface.
SURFACE = ("agentkv", "agentkv._core")
# Core modules an app still imports, each with its reason. Nothing may join this list unnoticed.
ALLOWED = {
    # The vLLM side is the wire protocol's other end (it runs inside vLLM, not on the SDK): it
    # imports the protocol's modules themselves.
    ("agentkv.connector._connector", "agentkv._wire.hints"),
    ("agentkv.connector._connector", "agentkv._wire.tier"),
    ("agentkv.connector._endpoint", "agentkv._wire.hints"),
    ("agentkv.connector._endpoint", "agentkv._wire.tier"),
    ("agentkv.connector._leases", "agentkv._wire.hints"),
    ("agentkv.connector._tier", "agentkv._wire.hints"),
    ("agentkv.connector._tier", "agentkv._wire.tier"),
    ("agentkv.connector._tier_store", "agentkv._wire.tier"),
}


def _app(name: str) -> str | None:
    return next((app for app in APPS if name == app or name.startswith(f"{app}.")), None)


def _reach_ins(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """(app module, core module) for each import of the core other than through its surface."""
    return {
        (name, target)
        for name, targets in graph.items()
        if _app(name) is not None
        for target in targets
        if target not in SURFACE and _app(target) is None
    }


def test_the_reach_in_finder_sees_an_app_importing_a_core_module() -> None:
    graph = {
        "agentkv.proxy._tools": {"agentkv._wire.http", "agentkv._core", "agentkv.proxy._errors"},
        "agentkv.bench._run": {"agentkv", "agentkv.local._config"},
        "agentkv._client.pool": {"agentkv._wire.http"},
    }
    assert _reach_ins(graph) == {("agentkv.proxy._tools", "agentkv._wire.http")}


def test_the_apps_import_the_core_through_its_one_surface() -> None:
    reached_in = _reach_ins(_graph(_modules()))
    assert reached_in == ALLOWED, sorted(reached_in ^ ALLOWED)


def test_the_core_imports_no_app_and_the_package_only_its_drop_in() -> None:
    """The apps sit on top: the core never imports one; the package's face exports the drop-in."""
    graph = _graph(_modules())
    imported = {
        (name, target)
        for name, targets in graph.items()
        if _app(name) is None
        for target in targets
        if _app(target) is not None
    }
    assert imported == {
        ("agentkv", "agentkv._openai.client"),
        ("agentkv", "agentkv._anthropic.client"),
    }


def test_no_module_imports_a_private_name_of_another_package() -> None:
    """A name another package uses is public in its own (``agentkv.local``'s ``server_healthy``)."""
    modules = _modules()
    found = []
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
                continue
            if node.module == "agentkv" or not node.module.startswith("agentkv."):
                continue  # the package's own ``_constants`` module is imported by name
            if node.module.split(".")[:2] == name.split(".")[:2]:
                continue
            found += [f"{name}: {alias.name}" for alias in node.names if alias.name[0] == "_"]
    assert found == []
