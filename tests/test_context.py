"""The context wire format: sw4rm's exact bytes, strict decoding, and the real sw4rm SDK."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from sw4rm.handoff.context import HandoffContext as Sw4rmContext
from sw4rm.handoff.context import deserialize_context as sw4rm_deserialize
from sw4rm.handoff.context import serialize_context as sw4rm_serialize

from handoffbus import (
    ConversationEntry,
    DecodeError,
    EncodeError,
    HandoffContext,
    PayloadTooLarge,
    context_json_schema,
    deserialize_context,
    serialize_context,
)

GOLDEN = (
    b'{"conversation_history":[{"role":"user","content":"h\\u00e9llo"}],'
    b'"tool_state":{"cart":[1,2]},"metadata":{"ticket":"T-1"}}'
)


def golden_context() -> HandoffContext:
    return HandoffContext(
        conversation_history=[ConversationEntry(role="user", content="héllo")],
        tool_state={"cart": [1, 2]},
        metadata={"ticket": "T-1"},
    )


def test_golden_bytes() -> None:
    assert serialize_context(golden_context()) == GOLDEN
    assert serialize_context(HandoffContext()) == b'{"conversation_history":[],"tool_state":{},"metadata":{}}'


def test_round_trip_keeps_every_field_and_unknown_keys() -> None:
    entry = ConversationEntry(
        role="tool", content='{"total": 1}', timestamp="2025-01-15T10:30:05Z", tool_call_id="call_abc",
        name="query_database", metadata={"k": "v"}, extra={"tool_calls": [{"id": "x"}]},
    )
    ctx = HandoffContext(conversation_history=[entry], tool_state={"active_calls": []}, metadata={"n": 1.5})
    data = serialize_context(ctx)
    assert deserialize_context(data) == ctx
    assert json.loads(data)["conversation_history"][0]["tool_calls"] == [{"id": "x"}]


def test_plain_dict_entries_are_accepted_and_validated() -> None:
    ctx = HandoffContext(conversation_history=[{"role": "user", "content": "hi"}])  # type: ignore[list-item]
    assert serialize_context(ctx) == (
        b'{"conversation_history":[{"role":"user","content":"hi"}],"tool_state":{},"metadata":{}}'
    )
    bad = HandoffContext(conversation_history=[{"role": "user"}])  # type: ignore[list-item]
    with pytest.raises(EncodeError):
        serialize_context(bad)


def test_sw4rm_sdk_reads_our_bytes() -> None:
    theirs = sw4rm_deserialize(serialize_context(golden_context()))
    assert theirs.conversation_history == [{"role": "user", "content": "héllo"}]
    assert theirs.tool_state == {"cart": [1, 2]}
    assert theirs.metadata == {"ticket": "T-1"}


def test_we_read_sw4rm_sdk_bytes() -> None:
    theirs = Sw4rmContext(
        conversation_history=[
            {"role": "user", "content": "Review this code \u2603", "timestamp": "2025-01-15T10:30:00Z"},
            {"role": "tool", "name": "q", "tool_call_id": "c1", "content": "{}"},
        ],
        tool_state={"cached_results": {"c1": {"growth": 0.12}}},
        metadata={"original_request_id": "req-123"},
    )
    data = sw4rm_serialize(theirs)
    ours = deserialize_context(data)
    assert ours.conversation_history[0].content == "Review this code \u2603"
    assert ours.conversation_history[1].tool_call_id == "c1"
    assert ours.tool_state == theirs.tool_state
    # the same document; entries are written in schema order (role, content, timestamp,
    # tool_call_id, name, metadata, then unknown keys), so bytes match when sw4rm's dicts were
    # built in that order (see test_bytes_equal_sw4rm_for_any_content)
    assert json.loads(serialize_context(ours)) == json.loads(data)


json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text()
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
entries = st.builds(
    lambda role, content, name: {"role": role, "content": content, **({"name": name} if name else {})},
    st.text(max_size=10), st.text(max_size=30), st.none() | st.text(min_size=1, max_size=8),
)


@given(
    history=st.lists(entries, max_size=4),
    tool_state=st.dictionaries(st.text(max_size=8), json_values, max_size=4),
    metadata=st.dictionaries(st.text(max_size=8), json_values, max_size=4),
)
def test_bytes_equal_sw4rm_for_any_content(
    history: list[dict[str, Any]], tool_state: dict[str, Any], metadata: dict[str, Any]
) -> None:
    ours = HandoffContext(
        conversation_history=[ConversationEntry.from_dict(e) for e in history],
        tool_state=tool_state, metadata=metadata,
    )
    theirs = Sw4rmContext(conversation_history=history, tool_state=tool_state, metadata=metadata)
    data = serialize_context(ours)
    assert data == sw4rm_serialize(theirs)
    assert deserialize_context(data) == ours


@pytest.mark.parametrize(
    "data",
    [
        b"[]", b"null", b'"s"', b"42", b"", b"{", b"\xff\xfe{}",
        b'{"conversation_history":[],"tool_state":{}}',
        b'{"tool_state":{},"metadata":{}}',
        b'{"conversation_history":{},"tool_state":{},"metadata":{}}',
        b'{"conversation_history":[1],"tool_state":{},"metadata":{}}',
        b'{"conversation_history":[{"content":"x"}],"tool_state":{},"metadata":{}}',
        b'{"conversation_history":[{"role":1,"content":"x"}],"tool_state":{},"metadata":{}}',
        b'{"conversation_history":[{"role":"u","content":"\xc3"}],"tool_state":{},"metadata":{}}',
        b'{"conversation_history":[],"tool_state":[],"metadata":{}}',
        b'{"conversation_history":[],"tool_state":{},"metadata":null}',
        b'{"conversation_history":[],"tool_state":{"x":NaN},"metadata":{}}',
    ],
)
def test_malformed_bytes_raise_decode_error(data: bytes) -> None:
    with pytest.raises(DecodeError):
        deserialize_context(data)


def test_wrong_types_raise_typed_errors() -> None:
    with pytest.raises(DecodeError):
        deserialize_context("not bytes")  # type: ignore[arg-type]
    with pytest.raises(EncodeError):
        serialize_context({"conversation_history": []})  # type: ignore[arg-type]
    with pytest.raises(EncodeError):
        serialize_context(HandoffContext(tool_state={"x": float("nan")}))
    with pytest.raises(EncodeError):
        serialize_context(HandoffContext(tool_state={"x": object()}))


def test_keys_that_are_one_in_json_are_an_encode_error_not_a_lost_value() -> None:
    # both keys were written, and the reader kept the last: "a" was lost without a word
    for clash in ({1: "a", "1": "b"}, {True: "a", "true": "b"}, {None: "a", "null": "b"}):
        with pytest.raises(EncodeError, match="same in JSON"):
            serialize_context(HandoffContext(tool_state={"deep": [{"x": clash}]}))
    # keys that differ as text still cross, as JSON has them (as text)
    assert deserialize_context(serialize_context(HandoffContext(tool_state={"t": {1: "a", "2": "b"}}))).tool_state \
        == {"t": {"1": "a", "2": "b"}}


def test_size_limit_is_checked_before_decoding() -> None:
    data = serialize_context(HandoffContext(metadata={"pad": "x" * 2000}))
    with pytest.raises(PayloadTooLarge):
        deserialize_context(data, limit=1000)
    assert deserialize_context(data, limit=len(data)).metadata["pad"] == "x" * 2000


def test_json_schema_is_sw4rm_schema() -> None:
    schema = context_json_schema()
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"
    assert schema["required"] == ["conversation_history", "tool_state", "metadata"]
    assert schema["properties"]["conversation_history"]["items"]["required"] == ["role", "content"]
    json.dumps(schema)  # exportable as is


def test_an_optional_key_read_as_null_is_written_back_as_null() -> None:
    # sw4rm writes what its dicts hold: a null timestamp or metadata came back without its key
    data = (b'{"conversation_history":[{"role":"user","content":"x","timestamp":null,"metadata":null},'
            b'{"role":"tool","content":"y","tool_call_id":null,"name":"f","extra":1}],"tool_state":{},"metadata":{}}')
    context = deserialize_context(data)
    assert context.conversation_history[0].timestamp is None and context.conversation_history[1].name == "f"
    assert serialize_context(context) == data


def test_a_lone_surrogate_reads_back_as_sw4rm_reads_it() -> None:
    """Half an emoji, cut off: sw4rm and serialize_context both write the lone surrogate's
    escape, and sw4rm reads it back; msgspec refused it, and a worker got no context at all."""
    history = [{"role": "user", "content": "half an emoji: \ud83d"}]
    theirs = sw4rm_serialize(Sw4rmContext(conversation_history=history))
    assert sw4rm_deserialize(theirs).conversation_history == history
    ours = serialize_context(HandoffContext(conversation_history=[ConversationEntry.from_dict(e) for e in history]))
    assert ours == theirs
    assert deserialize_context(ours).conversation_history[0].content == "half an emoji: \ud83d"
    # read that way, still strict: NaN, invalid UTF-8, a wrong shape
    for data in (ours.replace(b"{}", b'{"x":NaN}', 1), ours.replace(b"half", b"\xc3alf"),
                 ours.replace(b'"tool_state":{}', b'"tool_state":[]')):
        assert data != ours
        with pytest.raises(DecodeError):
            deserialize_context(data)


def test_from_dict_leaves_out_what_sw4rm_leaves_out() -> None:
    """sw4rm's HandoffContext.from_dict defaults each key; ported code that builds a context
    from its metadata alone raised DecodeError. The wire stays strict (all three keys)."""
    context = HandoffContext.from_dict({"metadata": {"ticket": "T-1"}})
    assert context == HandoffContext(metadata={"ticket": "T-1"})
    assert Sw4rmContext.from_dict({"metadata": {"ticket": "T-1"}}).to_dict() == context.to_dict()
    with pytest.raises(DecodeError):
        HandoffContext.from_dict({"tool_state": []})
    with pytest.raises(DecodeError):
        HandoffContext.from_dict(["not", "a", "mapping"])  # type: ignore[arg-type]
    with pytest.raises(DecodeError):
        deserialize_context(b'{"metadata":{}}')
