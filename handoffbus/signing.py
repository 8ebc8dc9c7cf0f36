"""Signed handoffs: HMAC-SHA256 over a canonical envelope, with per-agent keys.

A bus given a ``Keyring`` signs every request its clients make and every decision and
outcome its workers write, and checks each request before its payload is decoded: a worker
dead-letters an unsigned, tampered, spoofed, unknown-key or out-of-window request before any
hook runs. A requester checks every response it reads; a response that fails raises
``SignatureInvalid`` from the handle instead of being believed.

What is signed (``canonical``): a version tag, the kind (``request`` or ``response``), the
fields that say who asks whom for what, the signing time, a SHA-256 of the payload bytes
exactly as stored, and the key id. Names never contain a newline (see names.py), so joining
with newlines is unambiguous. The signature travels as ``<version>.<key id>.<ms>.<hex>``.

A response's payload is its fields (``SIGNED_RESPONSE_FIELDS``). Version ``v2`` gives each
its length; ``v1`` joined them with a separator that a field (a binary result, a reason)
may itself hold, so text could move from one field to another under the same signature.
Responses are signed ``v2``. A ``v1`` signature, made before, is believed only where no
field holds the separator, which makes its fields unambiguous; requests are ``v1``, their
payload being one field.

Keys: each agent has one or more keys; a key signs for its own agent only, which is how a
spoofed sender is caught. Rotation: list the new and the old key of an agent; the newest
key (last listed) signs, and both verify until the old one is removed. Replays: a request
signed longer than ``replay_window`` before its record was created is refused, and within
the window its handoff id is its dedupe key (a resubmission returns the existing handoff,
never a second one). How long it then waits in a queue is its deadline's business.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Iterable, Mapping, Sequence

import msgspec

from .errors import EncodeError, InvalidRequest, SignatureInvalid

__all__ = ["RESPONSE_VERSION", "SIGNED_RESPONSE_FIELDS", "Keyring", "SigningKey", "canonical", "response_body",
           "signature_version", "unsigned_response"]

VERSION = "v1"
#: responses are signed with their fields length-prefixed (see above)
RESPONSE_VERSION = "v2"
_VERSIONS = frozenset({VERSION, RESPONSE_VERSION})
_KEY_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
#: a signing time has at most this many digits (ms since the epoch has 13 until the year 2286)
_AT_DIGITS = 15


#: the response fields a signature covers, in this order (the owner, ``agent``, is the script's)
SIGNED_RESPONSE_FIELDS = ("reason", "code", "retry", "redirect", "result", "error", "rmeta")


def response_body(values: Mapping[str, object], version: str = RESPONSE_VERSION) -> bytes:
    """What a response signature's digest covers: its fields as stored, each with its length
    (``v2``), or unit-separated (``v1``, see above: ``SignatureInvalid`` where a field holds
    the separator). ``EncodeError`` for text that is not UTF-8."""
    out = []
    for name in SIGNED_RESPONSE_FIELDS:
        value = values.get(name)
        if isinstance(value, str):
            try:
                value = value.encode()
            except UnicodeEncodeError as exc:
                raise EncodeError(f"the response's {name} is not UTF-8 text: {exc}") from None
        elif isinstance(value, int):
            value = str(value).encode()
        out.append(value if isinstance(value, bytes) else b"")
    if version == RESPONSE_VERSION:
        return b"".join(b"%d:%b" % (len(value), value) for value in out)
    if any(b"\x1f" in value for value in out):
        raise SignatureInvalid("a v1 response signature over a field holding its separator is ambiguous")
    return b"\x1f".join(out)


def signature_version(signature: bytes | str | None) -> str:
    """The version a signature names (before its first dot)."""
    if not signature:
        return ""
    text = signature.decode(errors="replace") if isinstance(signature, bytes) else signature
    return text.partition(".")[0]


def unsigned_response(status: str, actor: str, code: str | None) -> bool:
    """Responses the bus itself writes, and only those: an expiry, and the router's verdict
    that no capable agent is live. No agent signs them; only the server's access control
    vouches for them, so any other status under those actors must be signed."""
    return (status == "EXPIRED" and actor == "bus") or (
        status == "REJECTED" and actor == "_router" and code == "NO_CAPABLE_AGENT")


class SigningKey(msgspec.Struct, frozen=True, kw_only=True):
    """A secret shared by one agent and the processes that verify it."""

    key_id: str
    agent: str
    secret: bytes

    def __post_init__(self) -> None:
        if not _KEY_ID.fullmatch(self.key_id):
            raise InvalidRequest(f"invalid key id {self.key_id!r}: use letters, digits, '_-' (1-64)")
        if not isinstance(self.secret, bytes):
            raise InvalidRequest(f"key {self.key_id!r}: the secret must be bytes, not {type(self.secret).__name__}")
        if len(self.secret) < 32:
            raise InvalidRequest(f"key {self.key_id!r}: the secret must be at least 32 bytes")

    def __repr__(self) -> str:  # a key in a log line or a traceback's locals must not show its secret
        return f"SigningKey(key_id={self.key_id!r}, agent={self.agent!r}, secret=<{len(self.secret)} bytes>)"


def canonical(kind: str, parts: Sequence[str], at_ms: int, body: bytes, key_id: str,
              version: str = VERSION) -> bytes:
    """The bytes an HMAC covers."""
    return "\n".join(
        ["handoffbus", version, kind, *parts, str(at_ms), hashlib.sha256(body).hexdigest(), key_id]
    ).encode()


class Keyring:
    def __init__(self, keys: Iterable[SigningKey], *, replay_window: float = 300.0, future_skew: float = 5.0) -> None:
        self._by_id: dict[str, SigningKey] = {}
        self._signing: dict[str, SigningKey] = {}
        for key in keys:
            if key.key_id in self._by_id:
                raise InvalidRequest(f"key id {key.key_id!r} listed twice")
            self._by_id[key.key_id] = key
            self._signing[key.agent] = key  # the last listed key of an agent signs
        self.replay_window_ms = int(replay_window * 1000)
        self.future_skew_ms = int(future_skew * 1000)

    def can_sign(self, agent: str) -> bool:
        return agent in self._signing

    def sign(self, agent: str, kind: str, parts: Sequence[str], body: bytes, at_ms: int,
             version: str = VERSION) -> str:
        key = self._signing.get(agent)
        if key is None:
            raise InvalidRequest(f"this bus has no signing key of {agent!r}: what it writes for {agent!r} "
                                 "could not be signed")
        mac = hmac.new(key.secret, canonical(kind, parts, at_ms, body, key.key_id, version), hashlib.sha256)
        return f"{version}.{key.key_id}.{at_ms}.{mac.hexdigest()}"

    def verify(self, signature: bytes | str | None, signer: str, kind: str, parts: Sequence[str], body: bytes,
               now_ms: int, *, window: bool = True) -> None:
        """Raise SignatureInvalid unless ``signature`` is ``signer``'s over these values; with
        ``window``, also unless it was made within the replay window before ``now_ms``."""
        if not signature:
            raise SignatureInvalid("unsigned")
        text = signature.decode(errors="replace") if isinstance(signature, bytes) else signature
        version, _, rest = text.partition(".")
        key_id, _, rest = rest.partition(".")
        at, _, digest = rest.partition(".")
        if (version not in _VERSIONS or not (at.isascii() and at.isdigit()) or len(at) > _AT_DIGITS
                or len(digest) != 64):
            raise SignatureInvalid("malformed signature")
        key = self._by_id.get(key_id)
        if key is None:
            raise SignatureInvalid(f"unknown key id {key_id!r}")
        if key.agent != signer:
            raise SignatureInvalid(f"spoofed sender: key {key_id!r} belongs to {key.agent!r}, not {signer!r}")
        expected = hmac.new(key.secret, canonical(kind, parts, int(at), body, key_id, version),
                            hashlib.sha256).hexdigest()
        if not hmac.compare_digest(expected.encode(), digest.encode()):  # bytes: a str must be ASCII
            raise SignatureInvalid("bad signature")
        if window and not now_ms - self.replay_window_ms <= int(at) <= now_ms + self.future_skew_ms:
            raise SignatureInvalid(f"signed at {at}, outside the replay window around {now_ms}")
