"""The public API lives at the top: every export is reachable as ``agentkv.NAME`` and says so."""

from __future__ import annotations

import inspect
import pickle
from importlib import metadata

import agentkv


def test_every_exported_class_and_function_names_the_top_module():
    for name in agentkv.__all__:
        value = getattr(agentkv, name)
        if isinstance(value, type) or inspect.isfunction(value):
            assert value.__module__ == "agentkv", name
            assert getattr(agentkv, value.__qualname__) is value, name


def test_public_values_pickle_by_their_public_name():
    message = agentkv.Message.user("hi")
    data = pickle.dumps(message)
    assert b"agentkv._types" not in data  # the pickle names the public module
    assert pickle.loads(data) == message
    assert repr(agentkv.SessionBusyError("x").__class__) == "<class 'agentkv.SessionBusyError'>"


def test_version_is_the_installed_distributions():
    assert agentkv.__version__ == metadata.version("agentkv")
