"""Handoff policies: scenario routes, loop guards, context policies, and the LLM tool surface.

- ``scenario.py``: scenarios (allowed routes, announced/discrete, greetings, context_vars).
- ``guards.py``: the hop chain, maximum depth, cycles, return-to-sender.
- ``context.py`` and ``blobs.py``: what of a conversation crosses, and large content out of band.
- ``tools.py``: ``handoff_to_agent`` and ``transfer_to_<agent>`` tool schemas, and tool calls
  turned into requests.
- ``policy.py``: ``HandoffPolicy``, what a bus applies to every request before it is queued.
- ``service.py``: ``HandoffService``, the same answers for an orchestrator that switches agents
  itself (the voice-agent accelerator's API).
"""

from __future__ import annotations

from .blobs import offload as offload
from .blobs import restore as restore
from .context import ContextPolicy as ContextPolicy
from .context import InvalidHook as InvalidHook
from .context import apply_context_policy as apply_context_policy
from .context import remove_all_tools as remove_all_tools
from .guards import HOPS_KEY as HOPS_KEY
from .guards import RETURN_KEY as RETURN_KEY
from .guards import check_hops as check_hops
from .guards import hops_of as hops_of
from .policy import RESOLUTION_KEY as RESOLUTION_KEY
from .policy import HandoffPolicy as HandoffPolicy
from .scenario import AgentProfile as AgentProfile
from .scenario import HandoffResolution as HandoffResolution
from .scenario import Route as Route
from .scenario import Scenario as Scenario
from .scenario import ScenarioError as ScenarioError
from .scenario import sanitize_shared_context as sanitize_shared_context
from .service import HandoffService as HandoffService
from .service import ServiceResolution as ServiceResolution
from .tools import HANDOFF_TOOL as HANDOFF_TOOL
from .tools import ToolCallError as ToolCallError
from .tools import TransferTarget as TransferTarget
from .tools import handoff_tool as handoff_tool
from .tools import request_from_tool_call as request_from_tool_call
from .tools import transfer_tool_name as transfer_tool_name
from .tools import transfer_tools as transfer_tools

__all__ = [
    "HANDOFF_TOOL", "HOPS_KEY", "RESOLUTION_KEY", "RETURN_KEY", "AgentProfile", "ContextPolicy", "HandoffPolicy",
    "HandoffResolution", "HandoffService", "InvalidHook", "Route", "Scenario", "ScenarioError", "ServiceResolution",
    "ToolCallError", "TransferTarget",
    "apply_context_policy", "check_hops", "handoff_tool", "hops_of", "offload", "remove_all_tools",
    "request_from_tool_call", "restore", "sanitize_shared_context", "transfer_tool_name", "transfer_tools",
]
