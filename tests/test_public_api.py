"""The public surface: names re-exported with __all__, one error root, names rule."""

from __future__ import annotations

import inspect

import pytest

import handoffbus
from handoffbus import HandoffbusError, InvalidName
from handoffbus.names import check_name, check_names, split_handoff_id


def test_all_lists_exactly_the_public_names() -> None:
    exported = handoffbus.__all__
    assert exported == sorted(set(exported))
    assert all(hasattr(handoffbus, name) for name in exported)
    classes = {n for n, obj in vars(handoffbus).items() if inspect.isclass(obj) and not n.startswith("_")}
    functions = {n for n, obj in vars(handoffbus).items() if inspect.isfunction(obj) and not n.startswith("_")}
    assert classes | functions == set(exported)


def test_every_exception_derives_from_one_root() -> None:
    errors = [obj for obj in vars(handoffbus).values() if inspect.isclass(obj) and issubclass(obj, Exception)]
    assert len(errors) >= 10
    assert all(issubclass(e, HandoffbusError) for e in errors)


@pytest.mark.parametrize("good", ["a", "agent-1", "svc.billing:eu_1", "A" * 128])
def test_valid_names(good: str) -> None:
    assert check_name(good, "agent id") == good


@pytest.mark.parametrize("bad", ["", "a b", "a{b}", "a/b", "a*", "a\x00", "é", "A" * 129, 7, None, b"a"])
def test_invalid_names(bad: object) -> None:
    with pytest.raises(InvalidName):
        check_name(bad, "agent id")


def test_capabilities_are_a_set_and_ids_split_cleanly() -> None:
    assert check_names(["b", "a", "b"], "capability") == ("a", "b")
    with pytest.raises(InvalidName):
        check_names("ab", "capability")
    assert split_handoff_id("agent-1/req-9") == ("agent-1", "req-9")
