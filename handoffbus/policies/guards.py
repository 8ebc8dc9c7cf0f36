"""Loop guards: the hop chain a conversation carries from agent to agent, a maximum depth,
and a cycle policy, checked before a request is queued.

Every request made from a handoff (``ReceivedHandoff.hand_to`` and ``return_to_sender``)
carries the agents the conversation went through before its sender, in its metadata under
``hb.hops``; its depth is their number plus one. A request deeper than ``max_depth``, or one
that goes back to an agent already visited (a cycle), is refused with a code (the bus's
``HandoffPolicy`` checks them, see policy.py). With
``cycles="allow"``, a conversation may visit one agent up to ``max_visits`` times. Handing
control back to the agent that handed it over (return-to-sender) is not a cycle.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from ..errors import RouteRefused
from ..models import HandoffRequest

__all__ = ["HOPS_KEY", "RETURN_KEY", "check_hops", "hops_of"]

#: metadata key of the hop chain: the agents before the request's sender, oldest first
HOPS_KEY = "hb.hops"
#: metadata key of a return: the handoff id whose receiver hands control back to its sender
RETURN_KEY = "hb.return_of"


def hops_of(metadata: Mapping[str, Any]) -> list[str]:
    hops = metadata.get(HOPS_KEY, [])
    if not isinstance(hops, list) or not all(isinstance(h, str) for h in hops):
        raise RouteRefused("-", "BAD_HOP_CHAIN", f"metadata {HOPS_KEY!r} must be a list of agent ids")
    return hops


def check_hops(request: HandoffRequest, handoff_id: str = "-", *, max_depth: int = 5,
               cycles: Literal["refuse", "allow"] = "refuse", max_visits: int = 2) -> None:
    """Raise ``RouteRefused`` (``MAX_DEPTH`` or ``CYCLE``) for a request the guards do not allow."""
    sender, target = request.from_agent, request.to_agent
    hops = hops_of(request.metadata)
    if len(hops) + 1 > max_depth:
        raise RouteRefused(handoff_id, "MAX_DEPTH", f"the conversation was already handed on {len(hops)} "
                           f"times ({' -> '.join([*hops, sender])}); the limit is {max_depth}")
    if not target:
        return
    returning = request.metadata.get(RETURN_KEY) is not None and bool(hops) and hops[-1] == target
    visits = [*hops, sender].count(target)
    if visits and not returning and (cycles == "refuse" or visits + 1 > max_visits):
        raise RouteRefused(handoff_id, "CYCLE", f"{target!r} already had this conversation "
                           f"({' -> '.join([*hops, sender, target])})")
