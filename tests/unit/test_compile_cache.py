"""The plugin's compile-cache fix: what vLLM calls on a loaded artifact, and that it is there."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

from agentkv.connector import _compile_cache


def test_vllm_finalizes_the_loaded_artifact_the_fix_completes():
    # If vLLM stops calling this (or calls something else), the fix is stale: look again. The
    # source is read, not imported: importing vLLM's compilation package costs seconds.
    spec = importlib.util.find_spec("vllm")
    assert spec is not None
    assert spec.origin is not None
    text = (Path(spec.origin).parent / "compilation" / "decorators.py").read_text()
    source = text[text.index("def _try_load_aot_compiled_fn("):]
    source = source[: source.index("\ndef ")]
    assert "torch.compiler.load_compiled_function(" in source
    assert "loaded_fn._artifacts.compiled_fn.finalize_loading(" in source


def _loaded(compiled):
    return SimpleNamespace(_artifacts=SimpleNamespace(compiled_fn=compiled))


def test_a_plain_function_artifact_gets_a_no_op_finalize():
    def compiled(*args):
        return args

    loaded = _loaded(compiled)
    _compile_cache.complete_artifact(loaded)
    assert loaded._artifacts.compiled_fn.finalize_loading(object()) is None
    assert loaded._artifacts.compiled_fn(1) == (1,)


def test_an_artifact_that_finalizes_itself_is_left_alone():
    calls = []
    compiled = SimpleNamespace(finalize_loading=calls.append)
    _compile_cache.complete_artifact(_loaded(compiled))
    compiled.finalize_loading("config")
    assert calls == ["config"]
    _compile_cache.complete_artifact(SimpleNamespace())  # no artifacts at all: nothing to do


@pytest.fixture
def fresh_patch(monkeypatch):
    import torch.compiler

    loads = []

    def load_compiled_function(*args, **kwargs):
        loads.append(args)
        return _loaded(lambda: None)

    monkeypatch.setattr(torch.compiler, "load_compiled_function", load_compiled_function)
    monkeypatch.setattr(_compile_cache, "_applied", False)
    return loads


def test_apply_wraps_torch_loader_once_and_completes_what_it_loads(fresh_patch):
    import torch.compiler

    _compile_cache.apply()
    wrapped = torch.compiler.load_compiled_function
    _compile_cache.apply()
    assert torch.compiler.load_compiled_function is wrapped  # idempotent: one wrapper

    loaded = torch.compiler.load_compiled_function("file")
    assert fresh_patch == [("file",)]
    assert loaded._artifacts.compiled_fn.finalize_loading(None) is None
