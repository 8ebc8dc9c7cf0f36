"""What of a conversation crosses a handoff: context policies and input filters.

- ``preserve_history=False``: only the last user message goes (sw4rm, llm4s's
  ``preserveContext``).
- ``transfer_system_message=False``: system messages stay behind (llm4s).
- ``max_history=N``: the last N entries go. The context's metadata records
  ``original_history_length`` and ``trimmed`` (sw4rm's guidance on large contexts).
- ``drop_tool_results``: results of tool calls that completed stay behind (entries with
  role ``tool``).
- ``input_filters``: callables (plain or async) from context to context, applied last in
  order, like the Agents SDK's ``input_filter``. ``remove_all_tools`` is one: it drops tool
  calls, tool results and the tool state.

Large content goes out of band, into a key of its own: see ``blobs.py``.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import msgspec

from ..context import ConversationEntry, HandoffContext
from ..errors import InvalidRequest

__all__ = ["ContextPolicy", "InputFilter", "InvalidHook", "apply_context_policy", "remove_all_tools"]

InputFilter = Callable[[HandoffContext], HandoffContext | Awaitable[HandoffContext]]


class InvalidHook(InvalidRequest, TypeError):
    """A policy's callable (an input filter, a tool's ``is_enabled``) is of the wrong type or
    returned the wrong type. A ``TypeError`` too, as it was before it was an ``InvalidRequest``."""


class ContextPolicy(msgspec.Struct, frozen=True, kw_only=True):
    preserve_history: bool = True
    transfer_system_message: bool = True
    max_history: int | None = None
    drop_tool_results: bool = False

    def __post_init__(self) -> None:
        for name in ("preserve_history", "transfer_system_message", "drop_tool_results"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequest(f"ContextPolicy.{name} must be a bool, not {getattr(self, name)!r}")
        if self.max_history is not None and (type(self.max_history) is not int or self.max_history < 1):
            raise InvalidRequest(f"ContextPolicy.max_history must be None or an int of at least 1, "
                                 f"not {self.max_history!r}")


def _is_tool_call(entry: ConversationEntry) -> bool:
    return entry.role == "assistant" and bool(entry.extra.get("tool_calls"))


def remove_all_tools(context: HandoffContext) -> HandoffContext:
    """An input filter: no tool calls, no tool results, no tool state."""
    kept = [e for e in context.conversation_history if e.role != "tool" and not _is_tool_call(e)]
    return msgspec.structs.replace(context, conversation_history=kept, tool_state={})


async def apply_context_policy(context: HandoffContext, policy: ContextPolicy | None = None,
                               filters: Sequence[InputFilter] = ()) -> HandoffContext:
    """``context`` as the policy and then the filters let it cross."""
    policy = policy or ContextPolicy()
    history = list(context.conversation_history)
    metadata: dict[str, Any] = dict(context.metadata)
    if not policy.preserve_history:
        last_user = [e for e in history if e.role == "user"][-1:]
        system = [e for e in history if e.role == "system"] if policy.transfer_system_message else []
        history = system + last_user
    if not policy.transfer_system_message:
        history = [e for e in history if e.role != "system"]
    if policy.drop_tool_results:
        history = [e for e in history if e.role != "tool"]
    if policy.max_history is not None and len(history) > policy.max_history:
        metadata["original_history_length"] = len(context.conversation_history)
        metadata["trimmed"] = True
        history = history[-policy.max_history:]
    result = msgspec.structs.replace(context, conversation_history=history, metadata=metadata)
    for each in filters:
        filtered = each(result)
        if inspect.isawaitable(filtered):
            filtered = await filtered
        if not isinstance(filtered, HandoffContext):
            raise InvalidHook(f"input filter {each!r} returned {type(filtered).__name__}, not HandoffContext")
        result = filtered
    return result
