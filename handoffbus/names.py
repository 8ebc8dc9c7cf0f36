"""The one name rule for agent ids, capabilities and request ids.

Names end up inside Redis keys (agent ids form hash tags) and inside the handoff id
``<from_agent>/<request_id>``, so braces, slashes, spaces, wildcards and control
characters are refused before anything reaches Redis.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from functools import lru_cache

from .errors import InvalidName

__all__ = ["MAX_NAME_LENGTH", "RESERVED_AGENT_IDS", "check_agent_id", "check_name", "check_names", "join_handoff_id",
           "split_handoff_id", "stored_names"]

log = logging.getLogger("handoffbus")

MAX_NAME_LENGTH = 128
_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,128}")


def check_name(value: object, what: str) -> str:
    """Return ``value`` if it is a valid name, else raise InvalidName."""
    if not isinstance(value, str) or _NAME.fullmatch(value) is None:
        raise InvalidName(
            f"invalid {what} {value!r}: use 1-{MAX_NAME_LENGTH} ASCII letters, digits or '-_.:'"
        )
    return value


#: the names the bus itself acts under (an expiry's actor, the router's verdicts): an agent of
#: that name would have its decisions pass for the bus's, which need no signature
RESERVED_AGENT_IDS = frozenset({"bus", "_router"})


def check_agent_id(value: object) -> str:
    """``check_name`` for an agent that acts or is handed work: never one of the bus's own names."""
    name = check_name(value, "agent id")
    if name in RESERVED_AGENT_IDS:
        raise InvalidName(f"agent id {name!r} is the bus's own (its expiries and routing verdicts act under it)")
    return name


def check_names(values: Iterable[object], what: str) -> tuple[str, ...]:
    """Validate a collection of names and return it as a sorted, de-duplicated tuple (a set)."""
    if isinstance(values, str | bytes):
        raise InvalidName(f"{what} must be a list of names, not a single string")
    try:
        items = list(values)
    except TypeError:  # not iterable at all (an int, None)
        raise InvalidName(f"{what} must be a list of names, not {type(values).__name__}") from None
    return tuple(sorted({check_name(v, what) for v in items}))


#: (set, member) of the members of sets of names that are none: each logged once per process
#: (a bounded few)
_skipped: set[tuple[str, bytes]] = set()


def stored_names(members: Iterable[bytes], where: str) -> list[str]:
    """The agent ids among ``members`` of the set ``where`` (agents, targets, requesters),
    sorted. A member that is none (written by hand, or mangled) is skipped and logged once:
    never one to stop a sweep, a monitor or a listing for all the others."""
    found = []
    for member in members:
        try:
            found.append(check_name(member.decode(), "agent id"))
        except (UnicodeDecodeError, InvalidName):
            if (where, member) not in _skipped and len(_skipped) < 1000:
                _skipped.add((where, member))
                log.warning("skipping %r in %s, which is not an agent id", member, where)
    return sorted(found)


def join_handoff_id(from_agent: str, request_id: str) -> str:
    return f"{from_agent}/{request_id}"


def split_handoff_id(handoff_id: object) -> tuple[str, str]:
    """Split a handoff id into (requester agent id, request id), validating both."""
    if not isinstance(handoff_id, str):
        raise InvalidName(f"invalid handoff id {handoff_id!r}: expected '<from_agent>/<request_id>'")
    return _split(handoff_id)


@lru_cache(maxsize=4096)  # a handoff's id is split several times on its way (request, load, each transition)
def _split(handoff_id: str) -> tuple[str, str]:
    if handoff_id.count("/") != 1:
        raise InvalidName(f"invalid handoff id {handoff_id!r}: expected '<from_agent>/<request_id>'")
    agent, _, request_id = handoff_id.partition("/")
    return check_name(agent, "agent id"), check_name(request_id, "request id")
