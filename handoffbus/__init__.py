"""handoffbus: an asynchronous handoff bus for AI agents on Redis Streams."""

from __future__ import annotations

from . import logs as logs  # first: the logger's NullHandler and record defaults
from .bus import HandoffBus as HandoffBus
from .client import HandoffClient as HandoffClient
from .codecs import PayloadCodec as PayloadCodec
from .config import BusConfig as BusConfig
from .context import ConversationEntry as ConversationEntry
from .context import HandoffContext as HandoffContext
from .context import context_json_schema as context_json_schema
from .context import deserialize_context as deserialize_context
from .context import serialize_context as serialize_context
from .embedded import EmbeddedCluster as EmbeddedCluster
from .embedded import EmbeddedServer as EmbeddedServer
from .errors import AuthenticationFailed as AuthenticationFailed
from .errors import CallRefused as CallRefused
from .errors import DecodeError as DecodeError
from .errors import EncodeError as EncodeError
from .errors import ForwarderUnavailable as ForwarderUnavailable
from .errors import HandoffbusError as HandoffbusError
from .errors import HandoffExpired as HandoffExpired
from .errors import HandoffNotFound as HandoffNotFound
from .errors import InvalidName as InvalidName
from .errors import InvalidRequest as InvalidRequest
from .errors import InvalidTransition as InvalidTransition
from .errors import LeaseLost as LeaseLost
from .errors import NotPermitted as NotPermitted
from .errors import PayloadTooLarge as PayloadTooLarge
from .errors import QueueFull as QueueFull
from .errors import RequestConflict as RequestConflict
from .errors import RouteRefused as RouteRefused
from .errors import ScriptsFlushed as ScriptsFlushed
from .errors import ServerUnavailable as ServerUnavailable
from .errors import ServerUnsupported as ServerUnsupported
from .errors import SignatureInvalid as SignatureInvalid
from .errors import TooManyPending as TooManyPending
from .handle import HandoffHandle as HandoffHandle
from .models import AgentInfo as AgentInfo
from .models import DeadLetter as DeadLetter
from .models import DeadLetterAction as DeadLetterAction
from .models import HandoffRecord as HandoffRecord
from .models import HandoffRequest as HandoffRequest
from .models import HandoffResponse as HandoffResponse
from .models import HandoffStatus as HandoffStatus
from .models import HistoryEntry as HistoryEntry
from .models import PendingHandoff as PendingHandoff
from .models import RouteStep as RouteStep
from .models import WorkerInfo as WorkerInfo
from .signing import Keyring as Keyring
from .signing import SigningKey as SigningKey
from .workers import Accept as Accept
from .workers import Agent as Agent
from .workers import AgentState as AgentState
from .workers import ReceivedHandoff as ReceivedHandoff
from .workers import Reject as Reject
from .workers import RetryPolicy as RetryPolicy
from .workers import Worker as Worker
from .workers import inline as inline
from .workers import serve_until_signalled as serve_until_signalled

__all__ = [
    "Accept",
    "Agent",
    "AgentInfo",
    "AgentState",
    "AuthenticationFailed",
    "BusConfig",
    "CallRefused",
    "ConversationEntry",
    "DeadLetter",
    "DeadLetterAction",
    "DecodeError",
    "EmbeddedCluster",
    "EmbeddedServer",
    "EncodeError",
    "ForwarderUnavailable",
    "HandoffBus",
    "HandoffClient",
    "HandoffContext",
    "HandoffExpired",
    "HandoffHandle",
    "HandoffNotFound",
    "HandoffRecord",
    "HandoffRequest",
    "HandoffResponse",
    "HandoffStatus",
    "HandoffbusError",
    "HistoryEntry",
    "InvalidName",
    "InvalidRequest",
    "InvalidTransition",
    "Keyring",
    "LeaseLost",
    "NotPermitted",
    "PayloadCodec",
    "PayloadTooLarge",
    "PendingHandoff",
    "QueueFull",
    "ReceivedHandoff",
    "Reject",
    "RequestConflict",
    "RetryPolicy",
    "RouteRefused",
    "RouteStep",
    "ScriptsFlushed",
    "ServerUnavailable",
    "ServerUnsupported",
    "SignatureInvalid",
    "SigningKey",
    "TooManyPending",
    "Worker",
    "WorkerInfo",
    "context_json_schema",
    "deserialize_context",
    "inline",
    "serialize_context",
    "serve_until_signalled",
]
__version__ = "0.1.0"

