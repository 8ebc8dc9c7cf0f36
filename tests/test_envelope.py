"""The request envelope lives in its own key, so a pending record stays a small listpack."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from handoffbus import ConversationEntry, HandoffBus, HandoffContext, HandoffStatus, RequestConflict, serialize_context
from handoffbus.scripts import INLINE_ENVELOPE, STAGE_OVER

from .agents import Echo
from .conftest import make_bus
from .helpers import LARGE, req, routed, serve_until_done

pytestmark = pytest.mark.anyio

#: a context well over hash-max-listpack-value (64 bytes)
CONTEXT = serialize_context(HandoffContext(tool_state={"notes": "n" * 1024}))


async def test_a_pending_record_stays_a_listpack_beside_its_envelope(real_bus: HandoffBus) -> None:
    client = real_bus.client("req")
    handle = await client.request_handoff(req("req", "echo-1", reason="r", context_snapshot=CONTEXT))
    keys = real_bus.keys.record("req", handle.request_id)
    redis = real_bus.redis
    assert await redis.object("encoding", keys.record) == b"listpack"
    assert await redis.hget(keys.record, "env") is None
    envelope = await redis.get(keys.envelope)
    assert envelope is not None and CONTEXT in envelope
    assert await redis.pttl(keys.envelope) == -1  # lives as long as the handoff does

    [outcome], _ = await serve_until_done(real_bus, Echo(), [handle])
    assert outcome.status is HandoffStatus.COMPLETED
    # its history is past 64 bytes now: the embedded servers run with the advised
    # hash-max-listpack-value (deploy/README.md), so it is still a listpack
    assert len(await redis.hget(keys.record, "hist")) > 64
    assert await redis.object("encoding", keys.record) == b"listpack"
    retention_ms = real_bus.config.retention_ms
    for key in (keys.record, keys.envelope):  # both expire together once terminal
        assert retention_ms - 60_000 < await redis.pttl(key) <= retention_ms
    record = await client.get_handoff_status(handle.handoff_id)
    assert record is not None and record.request.context_snapshot == CONTEXT


async def test_a_record_with_its_envelope_inside_is_still_served(bus: HandoffBus) -> None:
    """A record written before the split keeps the request in its `env` field."""
    client = bus.client("req")
    handle = await client.request_handoff(req("req", "echo-1", reason="old", context_snapshot=CONTEXT))
    keys = bus.keys.record("req", handle.request_id)
    await bus.redis.hset(keys.record, "env", await bus.redis.get(keys.envelope))
    await bus.redis.delete(keys.envelope)

    record = await client.get_handoff_status(handle.handoff_id)
    assert record is not None and record.request.reason == "old" and record.request.context_snapshot == CONTEXT
    [outcome], _ = await serve_until_done(bus, Echo(), [handle])
    assert outcome.status is HandoffStatus.COMPLETED and outcome.result["echo"] == "old"


async def test_a_large_envelope_is_read_apart_from_its_record(bus: HandoffBus) -> None:
    assert len(LARGE) > INLINE_ENVELOPE >= len(CONTEXT)
    client = bus.client("req")
    large = await client.request_handoff(req("req", "echo-1", reason="large", context_snapshot=LARGE))
    small = await client.request_handoff(req("req", "echo-1", reason="small", context_snapshot=CONTEXT))
    rows = {}
    for name, handle in (("large", large), ("small", small)):
        keys = bus.keys.record("req", handle.request_id)
        rows[name] = await bus.script("load", [keys.record, keys.envelope], [INLINE_ENVELOPE])
    assert rows["large"][14] == 1 and rows["large"][1] is None  # left out, for a GET
    assert rows["small"][14] == 0 and CONTEXT in rows["small"][1]
    small_record = bus.keys.record("req", small.request_id).record
    assert await bus.redis.hget(small_record, "esz") is None  # a small record keeps its former fields

    loaded = await bus.load_records([large.handoff_id, small.handoff_id])
    assert [item.request.context_snapshot if item and item.request else None for item in loaded] == [LARGE, CONTEXT]
    outcomes, _ = await serve_until_done(bus, Echo(), [large, small])
    assert [(o.status, o.result["echo"], o.result["messages"]) for o in outcomes] == [
        (HandoffStatus.COMPLETED, "large", 8), (HandoffStatus.COMPLETED, "small", 0)]


async def test_a_large_envelope_gone_before_its_get_reads_as_a_poison_record(
        bus: HandoffBus, monkeypatch: pytest.MonkeyPatch) -> None:
    """A record whose envelope is gone (evicted, deleted) between the load and the GET reads as
    one whose envelope is gone at the load: a poison record the worker dead-letters, never a
    request, and never "gone" (which would leave it PENDING until its deadline)."""
    client = bus.client("req")
    large = await client.request_handoff(req("req", "echo-1", reason="large", context_snapshot=LARGE))
    small = await client.request_handoff(req("req", "echo-1", reason="small", context_snapshot=CONTEXT))
    envelopes = [bus.keys.record("req", h.request_id).envelope for h in (large, small)]
    scripts_many = bus.scripts_many

    async def evict_first(calls: list[tuple[str, list[str], list[Any]]]) -> list[Any]:
        if calls and calls[0][0] == "GET":
            await bus.redis.delete(envelopes[0])
        return await scripts_many(calls)

    monkeypatch.setattr(bus, "scripts_many", evict_first)
    await bus.redis.delete(envelopes[1])  # the inline path, for comparison
    loaded = await bus.load_records([large.handoff_id, small.handoff_id])
    assert [(item.status, item.request, bool(item.error)) if item else None for item in loaded] == [
        (HandoffStatus.PENDING, None, True)] * 2


async def test_a_batch_is_read_in_one_load_call_per_requester(
        bus: HandoffBus, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker's batch costs one ``load`` call per requester (one slot), at most LOAD_MANY
    handoffs a call, and reads as the handoffs read one by one: gone records, bad ids, a large
    envelope left to a GET, a record without its envelope."""
    a, b = bus.client("req-a"), bus.client("req-b")
    a1 = await a.request_handoff(req("req-a", "echo-1", reason="a1", context_snapshot=CONTEXT))
    large = await a.request_handoff(req("req-a", "echo-1", reason="large", context_snapshot=LARGE))
    b1 = await b.request_handoff(req("req-b", "echo-1", reason="b1"))
    a2 = await a.request_handoff(req("req-a", "echo-1", reason="a2"))
    torn = await b.request_handoff(req("req-b", "echo-1", reason="torn", context_snapshot=CONTEXT))
    await bus.redis.delete(bus.keys.record("req-b", torn.request_id).envelope)
    ids = [a1.handoff_id, "no slash", b1.handoff_id, large.handoff_id, "req-a/gone", torn.handoff_id,
           a2.handoff_id]
    one_by_one = [(await bus.load_records([hid]))[0] for hid in ids]

    loads: list[list[str]] = []
    scripts_many = bus.scripts_many

    def spy(calls: list[tuple[str, list[str], list[Any]]]) -> Any:
        loads.extend(keys for name, keys, _ in calls if name == "load")
        return scripts_many(calls)

    monkeypatch.setattr(bus, "scripts_many", spy)
    assert await bus.load_records(ids) == one_by_one
    calls = sorted((len(keys), *{key[:key.index("}") + 2] for key in keys}) for keys in loads)  # (keys, slots)
    assert calls == [(4, bus.keys.slot("req-b")), (8, bus.keys.slot("req-a"))]
    loads.clear()
    monkeypatch.setattr("handoffbus.bus.LOAD_MANY", 2)
    assert await bus.load_records(ids) == one_by_one
    assert sorted(map(len, loads)) == [4, 4, 4]
    bus._read_plainly()  # as for a user that may run no script: plain commands, the same rows
    assert await bus.load_records(ids) == one_by_one
    loaded = dict(zip(ids, one_by_one, strict=True))
    assert loaded["req-a/gone"] is None and loaded["no slash"] is not None and loaded["no slash"].error
    assert loaded[torn.handoff_id] is not None and loaded[torn.handoff_id].error  # its envelope gone: poison
    read = [loaded[h.handoff_id] for h in (a1, large)]
    assert [item.request.context_snapshot if item and item.request else None for item in read] == [CONTEXT, LARGE]

    # the script itself: the rows of its pairs of keys one after another, as each pair alone reads
    pairs = [bus.keys.record("req-a", h.request_id) for h in (a1, large, a2)] + [bus.keys.record("req-a", "gone")]
    flat = await bus.script("load", [key for k in pairs for key in (k.record, k.envelope)], [INLINE_ENVELOPE])
    rows = [await bus.script("load", [k.record, k.envelope], [INLINE_ENVELOPE]) for k in pairs]
    assert len(flat) == 15 * len(pairs) and len({flat[i] for i in range(12, len(flat), 15)}) == 1  # one TIME
    assert [[*flat[15 * i:15 * i + 12], *flat[15 * i + 13:15 * i + 15]] for i in range(len(pairs))] == [
        [*row[:12], *row[13:]] for row in rows]
    assert [row[14] for row in rows] == [0, 1, 0, 0] and rows[3][0] is None


async def staged_keys(bus: HandoffBus, requester: str) -> list[bytes]:
    return [key async for key in bus.redis.scan_iter(match=f"{bus.keys.slot(requester)}s:*")]


def plain_commands(bus: HandoffBus, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The plain commands the bus sends among its script calls from now on (a spy)."""
    seen: list[str] = []
    scripts_many = bus.scripts_many

    async def spy(calls: list[tuple[str, list[str], list[Any]]]) -> list[Any]:
        seen.extend(name for name, _, _ in calls if name.isupper())
        return await scripts_many(calls)

    monkeypatch.setattr(bus, "scripts_many", spy)
    return seen


async def test_a_large_request_envelope_is_staged_then_renamed_into_place(
        bus: HandoffBus, monkeypatch: pytest.MonkeyPatch) -> None:
    sent = plain_commands(bus, monkeypatch)
    client = bus.client("req")
    handle = await client.request_handoff(req("req", "echo-1", reason="large", context_snapshot=LARGE))
    keys = bus.keys.record("req", handle.request_id)
    envelope = await bus.redis.get(keys.envelope)
    assert envelope is not None and LARGE in envelope
    assert await bus.redis.pttl(keys.envelope) == -1  # the staged copy's expiry is gone with it
    assert int(await bus.redis.hget(keys.record, "esz")) == len(envelope)
    assert sent == ["SET"] and await staged_keys(bus, "req") == []
    # the same request again (resubmitted): its staged copy is dropped, the handoff is the same
    again = await client.request_handoff(req("req", "echo-1", reason="large", context_snapshot=LARGE,
                                             request_id=handle.request_id))
    assert again.handoff_id == handle.handoff_id and await staged_keys(bus, "req") == []
    [outcome], _ = await serve_until_done(bus, Echo(), [handle])
    assert (outcome.status, outcome.result["messages"]) == (HandoffStatus.COMPLETED, 8)
    assert sent == ["SET", "SET", "GET"]  # the worker's load read the envelope apart too


async def test_a_large_request_with_the_id_of_another_leaves_that_one_alone(
        bus: HandoffBus, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each call stages its envelope under a key of its own: a request that conflicts with the
    record never has its envelope renamed over the record's."""
    sent = plain_commands(bus, monkeypatch)
    client = bus.client("req")
    first = await client.request_handoff(req("req", "echo-1", reason="first", context_snapshot=LARGE))
    keys = bus.keys.record("req", first.request_id)
    before = await bus.redis.get(keys.envelope)
    other = LARGE.replace(b"0:h", b"0:x")
    with pytest.raises(RequestConflict):
        await client.request_handoff(req("req", "echo-1", reason="first", context_snapshot=other,
                                         request_id=first.request_id))
    assert await bus.redis.get(keys.envelope) == before
    assert sent == ["SET", "SET"] and await staged_keys(bus, "req") == []


async def test_the_request_script_drops_or_misses_a_staged_envelope(bus: HandoffBus) -> None:
    """Refused for the requester's cap, the staged envelope is deleted; gone before the script
    ran (it outlived its expiry), nothing is written."""
    client = bus.client("req")
    await client.request_handoff(req("req", "echo-1", reason="holds the cap"))

    def call(request_id: str, staged: str, cap: int) -> tuple[str, list[str], list[Any]]:
        keys = bus.keys.record("req", request_id)
        return ("request", [*keys.as_list(), staged], [
            f"req/{request_id}", request_id, "req", "echo-1", 60_000, "", 3_600_000, 3_600_000, "fp",
            "", 0, 1000, cap, "", "1"])

    staged = bus.keys.staged("req", "capped", "n1")
    await bus.scripts_many([("SET", [staged], [LARGE, "PX", 60_000])])
    assert await staged_keys(bus, "req") == [staged.encode()]  # (the scan sees staged keys)
    assert await bus.scripts_many([call("capped", staged, 1)]) == [[-8]]
    assert await staged_keys(bus, "req") == [] and not await bus.redis.exists(bus.keys.record("req", "capped").record)

    [reply] = await bus.scripts_many([call("lost", bus.keys.staged("req", "lost", "n2"), 0)])
    assert reply == [-10]
    assert not await bus.redis.exists(*bus.keys.record("req", "lost").as_list()[:2])


async def test_a_large_routed_request_is_served_like_a_direct_one(bus: HandoffBus) -> None:
    client = bus.client("req")
    handle = await client.request_handoff(routed(["echo"], reason="routed large", context_snapshot=LARGE))
    assert await staged_keys(bus, "req") == []
    [outcome], _ = await serve_until_done(bus, Echo(), [handle])
    assert (outcome.status, outcome.result["echo"], outcome.result["messages"]) == (
        HandoffStatus.COMPLETED, "routed large", 8)


async def test_two_large_requests_with_one_id_at_once_never_mix(bus: HandoffBus) -> None:
    """Sent together, each stages its envelope under a key of its own: the record keeps the
    envelope of the request it was made from. (On a cluster, where a batch goes in waves, both
    SETs can run before either script: a key shared by the two calls failed there.)"""
    client = bus.client("req")
    contents = {"a": LARGE, "b": LARGE.replace(b"0:h", b"0:x")}
    results: dict[str, object] = {}

    async def send(name: str) -> None:
        try:
            results[name] = await client.request_handoff(req(
                "req", "echo-1", reason="same", context_snapshot=contents[name], request_id="same-id"))
        except RequestConflict as exc:
            results[name] = exc

    async with anyio.create_task_group() as tg:
        for name in contents:
            tg.start_soon(send, name)
    [winner] = [name for name, result in results.items() if not isinstance(result, RequestConflict)]
    [loaded] = await bus.load_records(["req/same-id"])
    assert loaded is not None and loaded.request is not None
    assert loaded.request.context_snapshot == contents[winner]
    assert await staged_keys(bus, "req") == []


async def test_a_large_envelope_is_read_apart_by_a_status_read(
        bus: HandoffBus, monkeypatch: pytest.MonkeyPatch) -> None:
    client = bus.client("req")
    handle = await client.request_handoff(req("req", "echo-1", reason="large", context_snapshot=LARGE))
    keys = bus.keys.record("req", handle.request_id)
    reply = await bus.script("status", keys.as_list(), [handle.request_id, 60_000, 60_000, INLINE_ENVELOPE])
    assert b"esz" in reply[3::2] and b"env" not in reply[3::2]  # left out, for a GET
    sent = plain_commands(bus, monkeypatch)
    record = await client.get_handoff_status(handle.handoff_id)
    assert record is not None and record.request.context_snapshot == LARGE
    assert record.status is HandoffStatus.PENDING and sent == ["GET"]


async def test_a_mid_sized_envelope_goes_in_staged_and_comes_out_inline(
        bus: HandoffBus, monkeypatch: pytest.MonkeyPatch) -> None:
    """Between STAGE_OVER and INLINE_ENVELOPE: staging adds no round trip and saves the server
    more than it costs; a GET apart would cost a round trip, so the reads return it themselves."""
    mid = serialize_context(HandoffContext(conversation_history=[
        ConversationEntry(role="user", content=f"{i}:" + "m" * 4096) for i in range(3)]))
    assert STAGE_OVER < len(mid) <= INLINE_ENVELOPE
    sent = plain_commands(bus, monkeypatch)
    client = bus.client("req")
    handle = await client.request_handoff(req("req", "echo-1", reason="mid", context_snapshot=mid))
    keys = bus.keys.record("req", handle.request_id)
    assert int(await bus.redis.hget(keys.record, "esz")) == len(await bus.redis.get(keys.envelope))
    [outcome], _ = await serve_until_done(bus, Echo(), [handle])
    record = await client.get_handoff_status(handle.handoff_id)
    assert (outcome.status, outcome.result["messages"]) == (HandoffStatus.COMPLETED, 3)
    assert record is not None and record.request.context_snapshot == mid
    assert sent == ["SET"] and await staged_keys(bus, "req") == []


async def test_an_envelope_with_bytes_after_its_end_reads_as_a_poison_record(
        real_backend: str, servers: dict) -> None:
    """Bytes after the end of an envelope mean it is not what was written (a torn or clobbered
    key): a plain one is refused as malformed, and so must a gzipped one be, rather than its
    first gzip member read and the rest dropped without a word."""
    async with make_bus(real_backend, servers, compress_threshold=64) as bus:
        client = bus.client("req")
        handles = [await client.request_handoff(req("req", "echo-1", reason=f"r{i}", context_snapshot=CONTEXT))
                   for i in range(2)]
        envelopes = [bus.keys.record("req", h.request_id).envelope for h in handles]
        assert (await bus.redis.get(envelopes[0]))[:2] == b"\x1f\x8b"  # compressed
        await bus.redis.append(envelopes[0], b"junk")
        await bus.redis.append(envelopes[1], b"\x1f\x8b" + b"\x00" * 16)  # a second, broken member
        loaded = await bus.load_records([h.handoff_id for h in handles])
        assert [(item.request, bool(item.error)) if item else None for item in loaded] == [(None, True)] * 2
