"""Bad settings get a typed error (an InvalidRequest, a HandoffbusError) when they are made,
never a bare TypeError or ValueError, nor a bus or worker that breaks later."""

from __future__ import annotations

import math
from typing import Any

import pytest

from handoffbus import BusConfig, HandoffBus, InvalidRequest, RetryPolicy
from handoffbus.codecs import PayloadCodec
from handoffbus.policies import ContextPolicy, HandoffPolicy


@pytest.mark.parametrize("settings", [
    {"payload_limit": "1"}, {"payload_limit": math.inf}, {"payload_limit": 2_000_000.5}, {"payload_limit": True},
    {"payload_limit": 0}, {"compress_threshold": math.nan}, {"compress_threshold": 1024.0},
    {"compress_threshold": -1}, {"compress_threshold": None}, {"codec": ["json"]}, {"codec": b"json"},
    {"codec": "yaml"},
])
def test_sizes_and_the_codec_name_are_type_checked(settings: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequest):
        BusConfig(**settings)
    with pytest.raises(InvalidRequest):
        HandoffBus.memory(**settings)


def test_payload_codec_refuses_what_it_cannot_use() -> None:
    for args, kwargs in [(([],), {}), (("yaml",), {}), ((), {"limit": 1.5}), ((), {"limit": 0}),
                         ((), {"limit": False}), ((), {"compress_threshold": math.inf}),
                         ((), {"compress_threshold": -1})]:
        with pytest.raises(InvalidRequest):
            PayloadCodec(*args, **kwargs)
    assert PayloadCodec("json", compress_threshold=0, limit=1).limit == 1  # the edges are fine
    assert BusConfig(payload_limit=4 << 20, compress_threshold=0, codec="json").make_codec().limit == 4 << 20


@pytest.mark.parametrize("settings", [
    {"attempts": "3"}, {"attempts": 2.0}, {"attempts": True}, {"attempts": 0}, {"delay": math.nan},
    {"delay": math.inf}, {"delay": -1}, {"delay": "1"}, {"max_delay": math.nan}, {"max_delay": math.inf},
    {"backoff": math.inf}, {"backoff": math.nan}, {"backoff": 0.5}, {"jitter": math.nan}, {"jitter": 2},
    {"retry_on": (ValueError, "x")}, {"retry_on": 3},
])
def test_retry_policies_are_checked(settings: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequest):
        RetryPolicy(**settings)


def test_a_retry_delay_stays_at_its_cap_however_many_attempts() -> None:
    """``delay * backoff ** (attempt - 1)`` overflowed a float past about 1,000 attempts."""
    policy = RetryPolicy(attempts=10**9, delay=0.5, backoff=2.0, max_delay=60, jitter=0)
    assert [policy.delay_before(a) for a in (1, 2, 3, 8)] == [0.5, 1.0, 2.0, 60.0]
    assert [policy.delay_before(a) for a in (1000, 1100, 10**6, 10**30)] == [60.0] * 4
    steep = RetryPolicy(attempts=5, delay=1e-300, backoff=1e300, max_delay=5, jitter=0)
    assert [steep.delay_before(a) for a in (1, 2, 3)] == [1e-300, 1.0, 5.0]
    assert RetryPolicy(attempts=5, delay=0.0, backoff=3.0, jitter=0).delay_before(10**6) == 0.0
    jittered = RetryPolicy(attempts=10**9, delay=1.0, max_delay=10.0, jitter=0.5)
    assert all(5.0 <= jittered.delay_before(10**4) <= 10.0 for _ in range(100))
    assert RetryPolicy(retry_on=ConnectionError).should_retry(0, ConnectionError())  # one class is fine


@pytest.mark.parametrize("make", [
    lambda: ContextPolicy(max_history=0),
    lambda: ContextPolicy(max_history=2.5),  # type: ignore[arg-type]
    lambda: ContextPolicy(max_history="3"),  # type: ignore[arg-type]
    lambda: ContextPolicy(preserve_history="no"),  # type: ignore[arg-type]
    lambda: HandoffPolicy(max_depth=0),
    lambda: HandoffPolicy(max_depth="5"),  # type: ignore[arg-type]
    lambda: HandoffPolicy(max_visits=0),
    lambda: HandoffPolicy(cycles="sometimes"),  # type: ignore[arg-type]
    lambda: HandoffPolicy(offload_over=0),
    lambda: HandoffPolicy(offload_over=1.5),  # type: ignore[arg-type]
    lambda: HandoffPolicy(context={"max_history": 3}),  # type: ignore[arg-type]
    lambda: HandoffPolicy(input_filters=["remove_all_tools"]),  # type: ignore[list-item]
    lambda: HandoffPolicy(input_filters=None),  # type: ignore[arg-type]
])
def test_context_and_handoff_policies_are_checked(make: Any) -> None:
    with pytest.raises(InvalidRequest):
        make()
