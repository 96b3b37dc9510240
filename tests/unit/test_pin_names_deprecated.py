"""The old names of the pin hint keep working for one release, each with a DeprecationWarning.

``PersistHint`` became ``PinHint`` and ``CachePolicy.decide_persist`` became ``decide_pin``
(issue 41: "persist" meant three things; a D leg's ask to keep its KV in decode's memory is a pin).
"""

from __future__ import annotations

import pytest

from agentkv import CachePolicy
from agentkv._wire import hints
from agentkv._wire.hints import PinHint


def test_the_old_class_name_warns_and_builds_the_same_pin_hint() -> None:
    with pytest.warns(DeprecationWarning, match="PinHint"):
        from agentkv._wire.hints import PersistHint
    assert PersistHint(persist=False) == PinHint(pin=False)
    assert PersistHint(ttl_s=30) == PinHint(ttl_s=30.0)
    assert PersistHint.from_wire({"v": 1, "persist": False}) == PinHint(pin=False)
    assert isinstance(PersistHint(), PinHint)


def test_a_name_the_module_never_had_is_still_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="NoSuchHint"):
        hints.NoSuchHint  # noqa: B018 - the lookup is the test


def test_the_old_flag_name_warns_and_reads_the_pin_flag() -> None:
    with pytest.warns(DeprecationWarning, match=r"PinHint\.pin"):
        assert PinHint(pin=False).persist is False


def test_decide_persist_warns_and_decides_as_decide_pin() -> None:
    policy = CachePolicy(pin_ttl_s=120)
    for final in (False, True):
        with pytest.warns(DeprecationWarning, match="decide_pin"):
            old = policy.decide_persist(final=final)
        assert old == policy.decide_pin(final=final)


def test_the_wire_key_is_unchanged_so_old_connectors_understand_new_sdks() -> None:
    assert PinHint(pin=False).to_wire() == {"v": 1, "persist": False}
    assert PinHint.from_wire({"v": 1, "persist": True, "ttl_s": 5}) == PinHint(ttl_s=5.0)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("PERSIST_PATH", "LEGACY_OFFLOAD_PATH"),
        ("PersistRequest", "OffloadRequest"),
        ("PersistResult", "OffloadResult"),
    ],
)
def test_the_tier_write_s_old_names_warn_and_are_the_offload_names(old: str, new: str) -> None:
    from agentkv._wire import tier

    with pytest.warns(DeprecationWarning, match=new):
        value = getattr(tier, old)
    assert value is getattr(tier, new)
