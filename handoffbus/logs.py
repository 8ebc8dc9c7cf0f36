"""The library's logger: silent unless the application configures logging (a NullHandler),
and every record carries ``agent`` and ``handoff_id`` attributes ("-" where none applies),
so a format such as ``%(agent)s %(handoff_id)s %(message)s`` works for every record."""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from typing import Any

__all__ = ["FORMAT", "AgentLog", "log"]

#: what ``handoffbus worker`` and ``forwarder`` log with
FORMAT = "%(asctime)s %(levelname)s %(name)s [%(agent)s %(handoff_id)s] %(message)s"

log = logging.getLogger("handoffbus")


class _Defaults(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.__dict__.setdefault("agent", "-")
        record.__dict__.setdefault("handoff_id", "-")
        return True


log.addFilter(_Defaults())
log.addHandler(logging.NullHandler())


class AgentLog(logging.LoggerAdapter[logging.Logger]):
    """The logger as seen by one agent's worker: its records name the agent; a call names the
    handoff with ``extra={"handoff_id": ...}`` (kept, not replaced, unlike LoggerAdapter's)."""

    def __init__(self, agent: str) -> None:
        super().__init__(log, {"agent": agent})

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        kwargs["extra"] = {**(self.extra or {}), **kwargs.get("extra", {})}
        return msg, kwargs
