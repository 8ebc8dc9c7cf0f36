"""Agent workers: where handoffs are taken from an agent's inbox and handled."""

from .agent import Accept as Accept
from .agent import Agent as Agent
from .agent import AgentState as AgentState
from .agent import ReceivedHandoff as ReceivedHandoff
from .agent import Reject as Reject
from .agent import RetryPolicy as RetryPolicy
from .agent import inline as inline
from .runner import Worker as Worker
from .signals import serve_until_signalled as serve_until_signalled

__all__ = [
    "Accept", "Agent", "AgentState", "ReceivedHandoff", "Reject", "RetryPolicy", "Worker", "inline",
    "serve_until_signalled",
]
