"""Record reads without scripts, for a user the server's ACL lets read but not run scripts.

The monitor user that ``handoffbus acl`` prints may read every key but run no script (a
script can write). The bus reads records with the ``status`` and ``load`` scripts; when the
server answers those with NOPERM, it reads with these plain commands instead. They build the
scripts' replies, so one decoder serves both.

What a plain read cannot do is write: a PENDING handoff past its deadline that no sweep has
expired yet is reported as it stands, PENDING with its deadline passed, instead of being made
EXPIRED by the read.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from redis.exceptions import NoPermissionError

from .keys import RecordKeys, TargetKeys

__all__ = ["LOAD_FIELDS", "LOAD_ROW", "load_rows", "observe_replies", "refuses_scripts", "server_time_ms",
           "status_reply"]

#: a queue score is priority * 2^42 + sequence (see lua/enqueue-5.lua)
BAND_SIZE = 1 << 42

#: the record fields the ``load`` script reads, in its order (see lua/load-2.lua)
LOAD_FIELDS = ("status", "env", "agent", "attempt", "created", "deadline", "id", "from", "to", "routed", "caps",
               "rsig", "lease", "sig")
#: values per handoff in a ``load`` reply, whose rows come one after another
LOAD_ROW = 15


def refuses_scripts(reply: object) -> bool:
    """Whether a reply is the server's NOPERM for FCALL itself (not for a key: a key this
    user may not reach is refused to plain reads as well)."""
    return isinstance(reply, NoPermissionError) and "'fcall'" in str(reply).lower()


async def server_time_ms(redis: Any) -> int:
    """The server's time in ms (a node's, on a cluster: a cluster pipeline takes no TIME, so
    the plain reads ask for it on its own)."""
    seconds, micros = await redis.time()
    return int(seconds) * 1000 + int(micros) // 1000


async def status_reply(redis: Any, keys: RecordKeys) -> list[Any]:
    """What the ``status`` script returns, read without writing: {-1} when there is no record,
    else {now ms, last response id, 0, field, value, ..., 'env', envelope}."""
    async with redis.pipeline(transaction=False) as pipe:
        pipe.hgetall(keys.record)
        pipe.get(keys.envelope)
        pipe.xrevrange(keys.responses, "+", "-", count=1)
        fields, envelope, last = await pipe.execute()
    if not fields:
        return [-1]
    out: list[Any] = [await server_time_ms(redis), last[0][0] if last else b"0-0", 0]
    for name, value in fields.items():
        out += (name, value)
    if envelope is not None:  # else a record written before the envelope had its own key carries `env`
        out += (b"env", envelope)
    return out


async def load_rows(redis: Any, keys: Sequence[RecordKeys]) -> list[list[Any]]:
    """What the ``load`` script returns for each record."""
    async with redis.pipeline(transaction=False) as pipe:
        for record_keys in keys:
            pipe.hmget(record_keys.record, LOAD_FIELDS)
            pipe.get(record_keys.envelope)
        replies = await pipe.execute()
    now_ms = await server_time_ms(redis)
    rows = []
    for i in range(len(keys)):
        row, envelope = list(replies[2 * i]), replies[2 * i + 1]
        if row[0] is not None and envelope is not None:
            row[1] = envelope
        if row[11] is None and row[0] == b"PENDING":  # a record written before `rsig` (see the script)
            row[11] = row[13]
        rows.append([*row[:12], now_ms, row[12], 0])  # the script's order: server time, the lease, left out
    return rows


async def observe_replies(redis: Any, agents: Sequence[tuple[TargetKeys, str]], bands: int) -> list[list[Any]]:
    """What the ``observe`` script returns for each (queue keys, stats key): {queued, in flight,
    oldest in-flight entry id, Redis time ms, flat stats, flat band heads}: the heads of up to
    ``bands`` of the lowest priority bands, then of up to ``bands`` of the highest (each band
    once). The band heads take one round trip per band from below and two per band from above,
    for the agents that have one more."""
    async with redis.pipeline(transaction=False) as pipe:
        for target, stats in agents:
            pipe.zcard(target.queue)
            pipe.hlen(target.inflight)
            pipe.xrange(target.inbox, count=1)
            pipe.hgetall(stats)
        replies = await pipe.execute()
    now_ms = await server_time_ms(redis)
    out: list[list[Any]] = []
    for i in range(len(agents)):
        queued, inflight, first, stats = replies[4 * i:4 * i + 4]
        flat = [part for pair in stats.items() for part in pair]
        out.append([queued, inflight, first[0][0] if first else b"", now_ms, flat, []])
    last_band: dict[int, int] = {}  # agent index: the highest band walked from below
    starts: dict[int, str] = dict.fromkeys(range(len(agents)), "-inf")
    for _ in range(bands):  # the lowest bands, upwards
        if not starts:
            break
        found = await _heads_from(redis, agents, starts)
        following: dict[int, str] = {}
        for i, head in zip(starts, found, strict=True):
            if head:
                member, score = head[0]
                out[i][5] += (member, b"%d" % score)
                last_band[i] = int(score) // BAND_SIZE
                following[i] = str((last_band[i] + 1) * BAND_SIZE)
            else:
                last_band.pop(i, None)  # every band walked: none left above
        starts = following
    ends: dict[int, str] = dict.fromkeys(last_band, "+inf")
    for _ in range(bands):  # the highest bands, downwards, until they meet the ones below
        if not ends:
            break
        async with redis.pipeline(transaction=False) as pipe:
            for i, end in ends.items():
                # ZRANGE BYSCORE REV: the monitor user may run ZRANGE, not ZREVRANGEBYSCORE
                pipe.zrange(agents[i][0].queue, end, "-inf", desc=True, byscore=True, offset=0, num=1,
                            withscores=True)
            tops = await pipe.execute()
        band_starts: dict[int, int] = {}
        for i, top in zip(ends, tops, strict=True):
            if top and int(top[0][1]) // BAND_SIZE > last_band[i]:
                band_starts[i] = int(top[0][1]) // BAND_SIZE * BAND_SIZE
        if not band_starts:
            break
        found = await _heads_from(redis, agents, band_starts)
        for i, head in zip(band_starts, found, strict=True):
            if head:  # else the band emptied between the two reads
                member, score = head[0]
                out[i][5] += (member, b"%d" % score)
        ends = {i: f"({band_start}" for i, band_start in band_starts.items()}
    return out


async def _heads_from(
    redis: Any, agents: Sequence[tuple[TargetKeys, str]], starts: Mapping[int, str | int]
) -> list[Any]:
    """For each agent index in ``starts``: the first queued (member, score) at or above that
    score, or nothing; in one round trip."""
    async with redis.pipeline(transaction=False) as pipe:
        for i, start in starts.items():
            pipe.zrangebyscore(agents[i][0].queue, start, "+inf", start=0, num=1, withscores=True)
        return list(await pipe.execute())
