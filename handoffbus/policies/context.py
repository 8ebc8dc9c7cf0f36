"""What of a conversation crosses a handoff: context policies and input filters.

- ``preserve_history=False``: only the last user message goes (sw4rm, llm4s's
  ``preserveContext``).
- ``transfer_system_message=False``: system messages stay behind (llm4s).
- ``max_history=N``: the last N entries go, less any tool results at the front whose call
  was cut off (a model API refuses a result without its call). The context's metadata records
  ``original_history_length`` and ``trimmed`` (sw4rm's guidance on large contexts), whether
  it trimmed or not.
- ``drop_tool_results``: results of tool calls that completed stay behind (entries with
  role ``tool``), and so do the calls (a call without its result is refused by model APIs;
  a message that made one keeps its own text).
- ``input_filters``: callables (plain or async) from context to context, applied last in
  order, like the Agents SDK's ``input_filter``. ``remove_all_tools`` is one: it drops tool
  calls, tool results and the tool state.

Large content goes out of band, into a key of its own: see ``blobs.py``.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import msgspec

from ..context import ConversationEntry, HandoffContext, deserialize_context, serialize_context
from ..errors import DecodeError, InvalidRequest, PayloadTooLarge

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


#: the extra fields of a message that are its tool calls (chat completions, and its legacy form)
_TOOL_CALL_FIELDS = ("tool_calls", "function_call")
#: the roles of tool results: "tool", and the legacy function-calling API's "function"
TOOL_RESULT_ROLES = frozenset({"tool", "function"})


def entries_of(context: HandoffContext) -> list[ConversationEntry]:
    """The history as entries: sw4rm-style plain dicts, which ``serialize_context`` accepts,
    are converted (``DecodeError`` if one is not a valid entry)."""
    entries = []
    for entry in context.conversation_history:
        if isinstance(entry, Mapping):
            entry = ConversationEntry.from_dict(entry)
        elif not isinstance(entry, ConversationEntry):
            raise InvalidRequest(f"conversation entries must be ConversationEntry or dict, not "
                                 f"{type(entry).__name__}")
        entries.append(entry)
    return entries


def _without_tool_calls(entry: ConversationEntry) -> ConversationEntry | None:
    """``entry`` with its tool calls taken out; None when nothing else was in it."""
    if not any(k in entry.extra for k in _TOOL_CALL_FIELDS):
        return entry
    if any(entry.extra.get(k) for k in _TOOL_CALL_FIELDS) and not entry.content.strip():
        return None  # the message was only its tool calls
    extra = {k: v for k, v in entry.extra.items() if k not in _TOOL_CALL_FIELDS}
    return msgspec.structs.replace(entry, extra=extra)


def remove_all_tools(context: HandoffContext) -> HandoffContext:
    """An input filter: no tool calls, no tool results, no tool state. A message that made a
    tool call keeps its own text."""
    kept = [e for e in map(_without_tool_calls, entries_of(context))
            if e is not None and e.role not in TOOL_RESULT_ROLES]
    return msgspec.structs.replace(context, conversation_history=kept, tool_state={})


async def apply_context_policy(context: HandoffContext, policy: ContextPolicy | None = None,
                               filters: Sequence[InputFilter] = ()) -> HandoffContext:
    """``context`` as the policy and then the filters let it cross."""
    policy = policy or ContextPolicy()
    history = entries_of(context)
    metadata: dict[str, Any] = dict(context.metadata)
    if not policy.preserve_history:
        # kept where they were: a system message after the last user message stays after it
        last_user = max((i for i, e in enumerate(history) if e.role == "user"), default=-1)
        history = [e for i, e in enumerate(history)
                   if i == last_user or (e.role == "system" and policy.transfer_system_message)]
    if not policy.transfer_system_message:
        history = [e for e in history if e.role != "system"]
    if policy.drop_tool_results:
        # the calls go with their results: a call left without its result is refused by model
        # APIs ("tool_calls must be followed by tool messages"); a message keeps its own text
        history = [e for e in map(_without_tool_calls, history) if e is not None and e.role not in TOOL_RESULT_ROLES]
    if policy.max_history is not None:  # recorded whether it trims or not, as sw4rm's guidance does
        metadata["original_history_length"] = len(context.conversation_history)
        metadata["trimmed"] = len(history) > policy.max_history
        if metadata["trimmed"]:
            history = history[-policy.max_history:]
            # results at the front of what is kept had their call cut off: sent alone, a model
            # API refuses them (a tool result must answer a preceding message's tool call)
            while history and history[0].role in TOOL_RESULT_ROLES:
                del history[0]
    result = msgspec.structs.replace(context, conversation_history=history, metadata=metadata)
    for each in filters:
        filtered = each(result)
        if inspect.isawaitable(filtered):
            filtered = await filtered
        if not isinstance(filtered, HandoffContext):
            raise InvalidHook(f"input filter {each!r} returned {type(filtered).__name__}, not HandoffContext")
        result = filtered
    return result


def context_to_shape(snapshot: bytes, *, limit: int, shaper: str) -> HandoffContext:
    """A context that ``shaper`` is to change, decoded. One that is not a sw4rm context raises
    ``InvalidRequest``: shaping fails closed, as sent it would go whole."""
    try:
        return deserialize_context(snapshot, limit=limit)
    except PayloadTooLarge:
        raise
    except DecodeError as exc:
        raise InvalidRequest(f"{shaper} shapes this context, and it is not a sw4rm context ({exc})") from None


#: what ``HandoffRequest.preserve_history=False`` asks of the context it carries
WITHOUT_HISTORY = ContextPolicy(preserve_history=False)


async def without_history(snapshot: bytes, *, limit: int) -> bytes:
    """A request's context when it says ``preserve_history=False`` (sw4rm's field): only the
    last user message and the system messages go."""
    context = context_to_shape(snapshot, limit=limit, shaper="preserve_history=False")
    return serialize_context(await apply_context_policy(context, WITHOUT_HISTORY))
