"""Edge cases of the policies and the A2A view: message order under ``preserve_history=False``,
what ``remove_all_tools`` keeps, tool-call arguments a model got wrong, the byte threshold of
out-of-band content, results that are not a dict, and sw4rm-style dict history entries."""

from __future__ import annotations

import base64
import json
from datetime import UTC, datetime
from typing import Any

import pytest

from handoffbus import (
    ConversationEntry,
    DecodeError,
    EncodeError,
    HandoffBus,
    HandoffContext,
    InvalidRequest,
    serialize_context,
)
from handoffbus.a2a import a2a_task
from handoffbus.models import HandoffRecord, HandoffRequest, HandoffResponse, HandoffStatus, HistoryEntry
from handoffbus.policies import (
    ContextPolicy,
    Scenario,
    ToolCallError,
    TransferTarget,
    apply_context_policy,
    offload,
    remove_all_tools,
    request_from_tool_call,
    restore,
)
from handoffbus.policies.blobs import BLOB_REF, ENTRY_REF

pytestmark = pytest.mark.anyio


def entries(*dicts: dict[str, Any]) -> list[ConversationEntry]:
    return [ConversationEntry.from_dict(d) for d in dicts]


# ---------------------------------------------------------------------- preserve_history=False


async def test_without_history_the_kept_messages_stay_in_their_order() -> None:
    ctx = HandoffContext(conversation_history=entries(
        {"role": "system", "content": "You are a support agent."},
        {"role": "user", "content": "Refund order A-1002"},
        {"role": "assistant", "content": "Checking..."},
        {"role": "system", "content": "NOTE: the user has since been verified"},
    ))
    out = await apply_context_policy(ctx, ContextPolicy(preserve_history=False))
    assert [e.content for e in out.conversation_history] == [
        "You are a support agent.", "Refund order A-1002", "NOTE: the user has since been verified"]
    alone = await apply_context_policy(ctx, ContextPolicy(preserve_history=False, transfer_system_message=False))
    assert [e.content for e in alone.conversation_history] == ["Refund order A-1002"]


# ---------------------------------------------------------------------- remove_all_tools


async def test_remove_all_tools_keeps_what_a_message_that_called_a_tool_said() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "refund_status", "arguments": "{}"}}
    ctx = HandoffContext(conversation_history=entries(
        {"role": "user", "content": "Where is my order A-1002?"},
        {"role": "assistant", "content": "It shipped on May 2; checking the refund.", "tool_calls": [call],
         "refusal": None},
        {"role": "tool", "tool_call_id": "c1", "content": '{"refund": "none"}'},
        {"role": "assistant", "content": "", "tool_calls": [call]},  # only a call: nothing left to keep
        {"role": "assistant", "content": "Let me look.", "function_call": {"name": "lookup", "arguments": "{}"}},
        {"role": "assistant", "content": " \n", "function_call": {"name": "lookup", "arguments": "{}"}},
        {"role": "user", "content": "OK, transfer me to billing"},
    ), tool_state={"refund_status": {"c1": "none"}})
    out = remove_all_tools(ctx)
    assert [e.to_dict() for e in out.conversation_history] == [
        {"role": "user", "content": "Where is my order A-1002?"},
        {"role": "assistant", "content": "It shipped on May 2; checking the refund.", "refusal": None},
        {"role": "assistant", "content": "Let me look."},
        {"role": "user", "content": "OK, transfer me to billing"},
    ]
    assert out.tool_state == {}
    assert b"tool_calls" not in serialize_context(out) and b"function_call" not in serialize_context(out)


# ---------------------------------------------------------------------- tool-call arguments

SCENARIO = Scenario.from_yaml("name: s\nstart_agent: A\nagents: [A, B]\nhandoffs:\n - {from_agent: A, to_agent: B}\n")


@pytest.mark.parametrize(("arguments", "says"), [
    ('{"target_agent": ' + "[" * 5000, "nested too deeply"),  # a model's output cut off mid-way
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ('{"target_agent": "B", "reason": ' + "9" * 5000 + "}", "number too long"),
    (None, "missing or not JSON text"),
    (42, "missing or not JSON text"),
    (b'{"target_agent": "\xff"}', "not UTF-8"),
], ids=["cut-off", "nested", "huge-number", "none", "int", "not-utf8"])
async def test_bad_tool_call_arguments_raise_a_tool_call_error_the_model_can_read(arguments: Any, says: str) -> None:
    with pytest.raises(ToolCallError, match=says) as caught:
        await request_from_tool_call("handoff_to_agent", arguments, from_agent="A", scenario=SCENARIO)
    assert '{"target_agent": "...", "reason": "..."}' in str(caught.value)  # what to send instead


@pytest.mark.parametrize("kind", [bytes, bytearray])
async def test_tool_call_arguments_may_be_utf8_json_bytes(kind: type[bytes] | type[bytearray]) -> None:
    arguments = kind('{"target_agent": "B", "reason": "le client veut être remboursé"}'.encode())
    request = await request_from_tool_call("handoff_to_agent", arguments, from_agent="A", scenario=SCENARIO)
    assert (request.to_agent, request.reason) == ("B", "le client veut être remboursé")
    transfer = await request_from_tool_call("transfer_to_b", kind(b'{"reason": "r"}'), from_agent="A",
                                            targets=[TransferTarget(agent="B")])
    assert (transfer.to_agent, transfer.reason) == ("B", "r")


# ---------------------------------------------------------------------- out of band, in bytes


async def test_the_offload_threshold_counts_utf8_bytes_not_characters(bus: HandoffBus) -> None:
    texts = {
        "ascii at the threshold": "e" * 1000,  # 1000 bytes: stays
        "euros under it": "€" * 333,  # 999 bytes: stays
        "euros over it": "€" * 334,  # 334 characters, 1002 bytes: goes
        "kanji far over it": "日本" * 450,  # 900 characters, 2700 bytes: goes
        "an emoji over it": "🙂" * 251,  # 251 characters, 1004 bytes: goes
    }
    ctx = HandoffContext(conversation_history=[ConversationEntry(role="user", content=t) for t in texts.values()],
                         tool_state=dict(texts))
    out = await offload(bus, "req", ctx, threshold=1000, ttl=60)
    went = {name for name, value in out.tool_state.items() if isinstance(value, dict)}
    assert went == {"euros over it", "kanji far over it", "an emoji over it"}
    for name in went:
        assert out.tool_state[name]["size"] == len(texts[name].encode())
    assert [ENTRY_REF in e.extra for e in out.conversation_history] == [False, False, True, True, True]
    assert [e.extra[ENTRY_REF]["size"] for e in out.conversation_history if ENTRY_REF in e.extra] == [1002, 2700, 1004]
    assert BLOB_REF.encode() in serialize_context(out)
    assert await restore(bus, out) == ctx


# ---------------------------------------------------------------------- A2A results


def completed(result: Any) -> HandoffRecord:
    status = HandoffStatus.COMPLETED
    return HandoffRecord(handoff_id="a-1:r1", request=HandoffRequest(from_agent="a-1", to_agent="b-1"),
                         status=status, created_ms=0, deadline_ms=1000, updated_ms=5,
                         history=(HistoryEntry(status=HandoffStatus.PENDING, actor="a-1", at_ms=0),
                                  HistoryEntry(status=status, actor="b-1", at_ms=5)),
                         response=HandoffResponse(handoff_id="a-1:r1", status=status, result=result))


def result_part(result: Any) -> dict[str, Any]:
    task = a2a_task(completed(result))
    assert json.loads(json.dumps(task)) == task  # a Task is JSON, whatever the result
    [part] = task["artifacts"][0]["parts"]
    return part  # type: ignore[no-any-return]


def test_a_bytes_result_is_an_a2a_file_part() -> None:
    pdf = b"%PDF-1.7\x00\x01\xff"
    part = result_part(pdf)
    assert part == {"kind": "file", "file": {"bytes": base64.b64encode(pdf).decode(),
                                             "mimeType": "application/octet-stream"}}
    assert base64.b64decode(part["file"]["bytes"]) == pdf


@pytest.mark.parametrize(("result", "text"), [
    (["ok", None, True], '["ok", null, true]'),
    (False, "false"),
    (0, "0"),
    (2.5, "2.5"),
], ids=["list", "bool", "int", "float"])
def test_a_result_that_is_neither_a_dict_nor_text_is_json_text(result: Any, text: str) -> None:
    assert result_part(result) == {"kind": "text", "text": text, "metadata": {"mimeType": "application/json"}}
    assert json.loads(text) == result


def test_a_text_result_stays_text_as_it_is() -> None:
    assert result_part("b'not bytes'") == {"kind": "text", "text": "b'not bytes'"}


def test_bytes_inside_a_result_go_as_base64_and_the_part_says_where() -> None:
    part = result_part({"report": {"a/b": b"\x00\x01", "pages": [b"p1", "text"]}, "n": 1, 7: b"k"})
    assert part == {"kind": "data",
                    "data": {"report": {"a/b": "AAE=", "pages": ["cDE=", "text"]}, "n": 1, "7": "aw=="},
                    "metadata": {"handoffbus.base64": ["/report/a~1b", "/report/pages/0", "/7"]}}
    listed = result_part([{"blob": b"\xff"}])
    assert listed["metadata"] == {"mimeType": "application/json", "handoffbus.base64": ["/0/blob"]}
    assert json.loads(listed["text"]) == [{"blob": "/w=="}]


@pytest.mark.parametrize("result", [float("nan"), {"at": datetime(2026, 1, 2, tzinfo=UTC)}, {b"key": 1},
                                    {7: b"k", "7": "v"}, {"x": {1: 1, "1": 2}}],
                         ids=["nan", "datetime", "bytes-key", "keys-alike-as-text", "nested-keys-alike"])
def test_a_result_json_cannot_hold_is_an_encode_error(result: Any) -> None:
    with pytest.raises(EncodeError, match="cannot be given as A2A JSON"):
        a2a_task(completed(result))


# ---------------------------------------------------------------------- dict history entries


async def test_policies_take_history_entries_given_as_plain_dicts() -> None:
    history: list[Any] = [  # sw4rm style, as serialize_context accepts
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "calling", "tool_calls": [{"id": "c1"}]},
        {"role": "tool", "content": "done", "tool_call_id": "c1"},
        {"role": "user", "content": "b"},
    ]
    ctx = HandoffContext(conversation_history=history)
    out = await apply_context_policy(ctx, ContextPolicy(preserve_history=False))
    assert out.conversation_history == entries({"role": "system", "content": "be brief"},
                                               {"role": "user", "content": "b"})
    assert (await apply_context_policy(ctx, ContextPolicy(max_history=1))).conversation_history == entries(
        {"role": "user", "content": "b"})
    assert remove_all_tools(ctx).conversation_history == entries(
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "a"},
        {"role": "assistant", "content": "calling"}, {"role": "user", "content": "b"})


async def test_a_history_entry_that_is_no_message_is_a_typed_error() -> None:
    bad = HandoffContext(conversation_history=[{"role": "user"}])  # type: ignore[list-item]
    with pytest.raises(DecodeError, match="invalid conversation entry"):
        await apply_context_policy(bad)
    with pytest.raises(DecodeError, match="invalid conversation entry"):
        remove_all_tools(bad)
    odd = HandoffContext(conversation_history=["hello"])  # type: ignore[list-item]
    with pytest.raises(InvalidRequest, match="ConversationEntry or dict, not str"):
        await apply_context_policy(odd)
    with pytest.raises(InvalidRequest, match="ConversationEntry or dict, not str"):
        remove_all_tools(odd)


SURROGATE_SCENARIO = "name: s\nstart_agent: A\nagents: [A, B]\nhandoffs:\n - {from_agent: A, to_agent: B}\n"


async def test_a_reason_with_a_lone_surrogate_is_a_tool_call_error() -> None:
    """A JSON escape of half an emoji passed the tool call, and the request failed to encode
    later (EncodeError), where the model never saw a tool error to correct."""
    with pytest.raises(ToolCallError, match="lone surrogates"):
        await request_from_tool_call("handoff_to_agent", '{"target_agent": "B", "reason": "refund \\ud83d"}',
                                     from_agent="A", scenario=Scenario.from_yaml(SURROGATE_SCENARIO))


async def test_offload_takes_text_ending_in_half_an_emoji_and_plain_dict_entries() -> None:
    """offload encoded text strictly (UnicodeEncodeError on a lone surrogate, which a context
    carries), and offload and restore read entries' attributes (AttributeError on the plain
    dicts serialize_context and the context policies accept)."""
    text = "\U0001f642" * 300 + "\ud83d"
    contexts = [HandoffContext(conversation_history=[ConversationEntry(role="user", content=text)],
                               tool_state={"note": text}),
                HandoffContext(conversation_history=[{"role": "user", "content": "x" * 2000}])]  # type: ignore[list-item]
    async with HandoffBus.memory(prefix="surrogate-blobs") as bus:
        for context in contexts:
            out = await offload(bus, "req", context, threshold=1000, ttl=60)
            assert BLOB_REF.encode() in serialize_context(out)  # the long text went out of band
            assert serialize_context(await restore(bus, out)) == serialize_context(context)


async def test_remove_all_tools_drops_legacy_function_results() -> None:
    """The legacy function-calling API answers a ``function_call`` with a ``function`` message:
    the call went, its result (here an IBAN) crossed."""
    context = HandoffContext(conversation_history=[
        ConversationEntry(role="user", content="balance?"),
        ConversationEntry.from_dict({"role": "assistant", "content": "",
                                     "function_call": {"name": "balance", "arguments": "{}"}}),
        ConversationEntry(role="function", name="balance", content='{"iban": "FR76 3000 6000 0112"}'),
        ConversationEntry(role="assistant", content="It is 12 EUR."),
    ])
    assert [e.role for e in remove_all_tools(context).conversation_history] == ["user", "assistant"]
    kept = await apply_context_policy(context, ContextPolicy(drop_tool_results=True))
    assert "function" not in [e.role for e in kept.conversation_history]


async def test_a_tool_call_without_the_reason_its_schema_requires_is_a_tool_call_error() -> None:
    # taken as an empty reason, the handoff went out with nothing to tell the next agent why
    with pytest.raises(ToolCallError, match=r'handoff_to_agent needs a reason: .*"reason": "\.\.\."'):
        await request_from_tool_call("handoff_to_agent", {"target_agent": "B"}, from_agent="A", scenario=SCENARIO)
    with pytest.raises(ToolCallError, match=r'transfer_to_b needs a reason: call it again with \{"reason": "\.\.\."\}'):
        await request_from_tool_call("transfer_to_b", "{}", from_agent="A", targets=[TransferTarget(agent="B")])
    made = await request_from_tool_call("transfer_to_b", {"reason": ""}, from_agent="A",
                                        targets=[TransferTarget(agent="B")])
    assert made.reason == ""  # given, if empty: the schema asks for the field, not for text in it
