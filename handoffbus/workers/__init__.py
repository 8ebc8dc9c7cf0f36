"""Agent workers: where handoffs are taken from an agent's inbox and handled."""

from .agent import Accept as Accept
from .agent import Agent as Agent
from .agent import AgentState as AgentState
from .agent import ReceivedHandoff as ReceivedHandoff
from .agent import Reject as Reject
from .runner import Worker as Worker

__all__ = ["Accept", "Agent", "AgentState", "ReceivedHandoff", "Reject", "Worker"]
