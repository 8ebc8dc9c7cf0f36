"""Names never reach Redis unchecked, and no Lua source is ever built from runtime data.

Agent ids, capabilities, request ids and consumer names end up inside keys (an agent id is a
hash tag), inside the handoff id ``<from>/<request_id>``, inside JSON the scripts assemble by
concatenation (the history) and inside comma- and ``=``-separated lists (routing). Each
character below would break one of those, so every public entry point must refuse it with a
typed error. The guard bus proves "before anything reaches Redis": any Redis command or
script call on it raises ``ReachedRedis``, and each refusal test has a positive control that
shows a valid name does get that far.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

import handoffbus
from handoffbus import (
    Agent,
    BusConfig,
    HandoffBus,
    HandoffbusError,
    HandoffClient,
    HandoffRequest,
    InvalidName,
    InvalidRequest,
    NotPermitted,
    Worker,
)
from handoffbus.names import check_name
from handoffbus.routing import capability_set
from handoffbus.scripts import SCRIPT_NAMES, Scripts, script_flags

BAD_NAMES = [
    "{", "}", "a{b}", "{a", "a*", "*", "a'b", "'", 'a"b', '"', "a]]", "]]", "a\nb", "a\n", "\n", "a\rb",
    "a\tb", "a\x00b", "a\x1bb", "a\x7fb", "a\x85b", "a\u2028b", "a b", " a", "a/b", "a,b", "a=b", "a|b",
    "a?b", "a[b", "a\\b", "a~b", "é", "\uff41", "x" * 129,  # é, a fullwidth a
]
IDS = [repr(n)[1:-1][:12] or "empty" for n in BAD_NAMES]
bad_names = pytest.mark.parametrize("bad", BAD_NAMES, ids=IDS)
pytestmark = pytest.mark.anyio


class ReachedRedis(Exception):
    """A call got as far as Redis."""


class Tripwire:
    def __getattr__(self, name: str) -> Any:
        raise ReachedRedis(name)


async def _tripped(*_args: Any, **_kwargs: Any) -> Any:
    raise ReachedRedis("script")


@pytest.fixture
def bus() -> HandoffBus:
    """A bus whose every Redis command and script call raises ReachedRedis."""
    guarded = HandoffBus(redis=Tripwire(), prefix="names")
    guarded.script = _tripped  # type: ignore[method-assign]
    guarded.scripts_many = _tripped  # type: ignore[method-assign]
    return guarded


@pytest.fixture
def client(bus: HandoffBus) -> HandoffClient:
    return bus.client("req-1")


async def refused(call: Callable[[], Awaitable[Any]], error: type[Exception] | tuple[type[Exception], ...]
                  = InvalidName) -> str:
    """Await ``call`` and return the message of the typed error it must raise before Redis."""
    with pytest.raises(error) as raised:
        await call()
    return str(raised.value)


async def reaches_redis(call: Callable[[], Awaitable[Any]]) -> None:
    with pytest.raises(ReachedRedis):
        await call()


def request(**fields: Any) -> HandoffRequest:
    return HandoffRequest(**{"from_agent": "req-1", "to_agent": "tgt-1", **fields})


def test_every_bad_name_breaks_the_rule() -> None:
    """The list is only useful if each entry is one the rule must refuse."""
    for bad in BAD_NAMES:
        assert re.fullmatch(r"[A-Za-z0-9_.:-]{1,128}", bad) is None
        with pytest.raises(InvalidName, match=re.escape(repr(bad))):
            check_name(bad, "agent id")


# ---------------------------------------------------------------------------- requests


@bad_names
async def test_bad_target_agent(client: HandoffClient, bad: str) -> None:
    message = await refused(lambda: client.request_handoff(request(to_agent=bad)))
    assert "agent id" in message and repr(bad) in message


@bad_names
async def test_bad_request_id(client: HandoffClient, bad: str) -> None:
    message = await refused(lambda: client.request_handoff(request(request_id=bad)))
    assert "request id" in message and repr(bad) in message


@bad_names
@pytest.mark.parametrize("routed", [False, True], ids=["direct", "routed"])
async def test_bad_capability(client: HandoffClient, bad: str, routed: bool) -> None:
    caps = ["code_review", bad]
    message = await refused(lambda: client.request_handoff(request(to_agent="" if routed else "tgt-1",
                                                                   capabilities_required=caps)))
    assert "capability" in message and repr(bad) in message
    with pytest.raises(InvalidName):
        capability_set(caps)


@bad_names
async def test_bad_requester(client: HandoffClient, bus: HandoffBus, bad: str) -> None:
    # a request speaks for the client's agent, whose id was checked when the client was made
    await refused(lambda: client.request_handoff(request(from_agent=bad)), (InvalidName, NotPermitted))
    with pytest.raises(InvalidName, match=re.escape(repr(bad))):
        bus.client(bad)


async def test_valid_requests_reach_redis(client: HandoffClient) -> None:
    """The positive control: with the names fixed, the same calls get as far as Redis."""
    await reaches_redis(lambda: client.request_handoff(request(request_id="r:1.a_b-c", capabilities_required=["x"])))
    await reaches_redis(lambda: client.request_handoff(request(to_agent="", capabilities_required=["a", "b.c"])))


@pytest.mark.parametrize("caps", [5, None, "code_review", b"code_review"], ids=["int", "none", "str", "bytes"])
async def test_capabilities_must_be_a_list(client: HandoffClient, caps: Any) -> None:
    message = await refused(lambda: client.request_handoff(request(capabilities_required=caps)))
    assert "must be a list of names" in message


# ---------------------------------------------------------------------------- transitions and reads


def _handoff_calls(client: HandoffClient, hid: str) -> dict[str, Callable[[], Awaitable[Any]]]:
    async def handle() -> Any:
        return client.handle(hid)

    return {
        "accept": lambda: client.accept_handoff(hid),
        "reject": lambda: client.reject_handoff(hid, "no"),
        "complete": lambda: client.complete_handoff(hid, {"ok": 1}),
        "fail": lambda: client.fail_handoff(hid, "broke"),
        "cancel": lambda: client.cancel_handoff(hid),
        "status": lambda: client.get_handoff_status(hid),
        "handle": handle,
    }


@bad_names
async def test_bad_handoff_ids(client: HandoffClient, bad: str) -> None:
    for hid in (f"req-1/{bad}", f"{bad}/r1"):
        for name, call in _handoff_calls(client, hid).items():
            message = await refused(call)
            assert "invalid" in message, name


async def test_valid_handoff_ids_reach_redis(client: HandoffClient) -> None:
    for name, call in _handoff_calls(client, "req-1/r1").items():
        if name == "handle":
            continue  # a handle reads nothing until awaited
        await reaches_redis(call)


@bad_names
async def test_bad_rejection_code_and_redirect(client: HandoffClient, bad: str) -> None:
    message = await refused(lambda: client.reject_handoff("tgt-1/r1", "no", code=bad))
    assert "rejection code" in message
    message = await refused(lambda: client.reject_handoff("tgt-1/r1", "no", redirect_to=bad))
    assert "agent id" in message
    await reaches_redis(lambda: client.reject_handoff("tgt-1/r1", "no", code="BUSY", redirect_to="other-1"))


@bad_names
async def test_bad_agent_in_listings(client: HandoffClient, bad: str) -> None:
    await refused(lambda: client.get_pending_handoffs(bad))
    await refused(lambda: client.get_dead_letters(bad))
    await refused(lambda: client.replay_dead_letter(bad, "1-0"))
    await refused(lambda: client.fail_dead_letter(bad, "1-0", "given up"))
    await reaches_redis(lambda: client.get_pending_handoffs("tgt-1"))
    await reaches_redis(lambda: client.get_dead_letters("tgt-1"))


# ---------------------------------------------------------------------------- agents and workers


def agent_class(agent_id: str, capabilities: list[str] | None = None) -> type[Agent]:
    class Named(Agent):
        async def on_handoff_received(self, handoff: Any) -> None:
            return None

    Named.agent_id = agent_id
    Named.capabilities = capabilities or ["code_review"]
    return Named


@bad_names
async def test_bad_agent_id_of_a_worker(bus: HandoffBus, bad: str) -> None:
    with pytest.raises(InvalidName, match=re.escape(repr(bad))):
        Worker(bus, agent_class(bad)())


@bad_names
async def test_bad_consumer_name(bus: HandoffBus, bad: str) -> None:
    with pytest.raises(InvalidName, match="consumer name"):
        Worker(bus, agent_class("tgt-1")(), consumer=bad)


async def test_a_valid_worker_is_made(bus: HandoffBus) -> None:
    worker = Worker(bus, agent_class("tgt-1", ["code_review", "security_analysis"])(), consumer="host-1.a")
    assert worker.consumer == "host-1.a"


async def test_bad_capability_of_an_agent(bus: HandoffBus) -> None:
    with pytest.raises(InvalidName):
        Worker(bus, agent_class("tgt-1", ["code_review", "a{b}"])())


# ---------------------------------------------------------------------------- the key prefix


@bad_names
def test_bad_prefix(bad: str) -> None:
    with pytest.raises(InvalidRequest, match="invalid key prefix"):
        HandoffBus(redis=Tripwire(), prefix=bad)
    with pytest.raises(InvalidRequest, match="invalid key prefix"):
        BusConfig(prefix=bad)


@pytest.mark.parametrize("bad", ["", "a:b", "x" * 65], ids=["empty", "colon", "long"])
def test_prefixes_are_stricter_than_names(bad: str) -> None:
    with pytest.raises(InvalidRequest, match="invalid key prefix"):
        HandoffBus.memory(prefix=bad)


def test_valid_prefixes() -> None:
    for prefix in ("hb", "team-a.prod_2", "x" * 64):
        assert HandoffBus(redis=Tripwire(), prefix=prefix).keys.slot("a") == f"{prefix}:{{a}}:"


def test_a_prefix_that_is_not_text() -> None:
    with pytest.raises(HandoffbusError):
        BusConfig(prefix=None)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- constant Lua

PACKAGE = Path(handoffbus.__file__).parent
LUA = PACKAGE / "lua"
#: redis-py methods that send Lua (or a function library) source to the server
SOURCE_SENDERS = {"eval", "eval_ro", "register_script", "script_load", "function_load", "function_restore"}
#: commands that carry source, as an ``execute_command`` name or inside a hand-packed RESP constant
SOURCE_COMMANDS = re.compile(r"\b(EVAL|EVAL_RO|SCRIPT\s+LOAD|FUNCTION\s+(LOAD|RESTORE))\b", re.IGNORECASE)


def _text(value: str | bytes) -> str:
    return value.decode("latin-1") if isinstance(value, bytes) else value


def scan(text: str, filename: str) -> tuple[list[str], list[str]]:
    """(violations, source-sending calls seen) of one Python file.

    Source may only travel as ``<script>.source``, and only ``scripts.py`` sets that attribute,
    from ``script_source`` (which reads the files under ``lua/``). Anything else that can put
    source on the wire is a violation: eval/exec/compile, a source sender given any other
    expression, ``execute_command`` with EVAL or SCRIPT/FUNCTION LOAD or a computed command
    name (but in a method ``execute_command`` that passes its own ``*args`` on unchanged),
    ``getattr`` of a source sender, and a hand-packed RESP constant naming one of those
    commands. (Plain strings such as ACL command names are not calls and are left alone.)
    """
    tree = ast.parse(text, filename)
    docstrings = {
        id(node.body[0].value) for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
    }
    # a method ``execute_command(self, *args, ...)`` that passes its own ``*args`` on unchanged
    # builds no command: it forwards one built, and checked, where it was made
    forwarded = {
        id(call) for func in ast.walk(tree)
        if isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef) and func.name == "execute_command"
        and func.args.vararg is not None
        for call in ast.walk(func)
        if isinstance(call, ast.Call) and len(call.args) == 1 and isinstance(call.args[0], ast.Starred)
        and isinstance(call.args[0].value, ast.Name) and call.args[0].value.id == func.args.vararg.arg
    }
    violations: list[str] = []
    senders: list[str] = []

    def flag(node: ast.AST, why: str) -> None:
        violations.append(f"{filename}:{getattr(node, 'lineno', '?')}: {why}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in {"eval", "exec", "compile"}:
                flag(node, f"{func.id}() of runtime data")
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if name in SOURCE_SENDERS:
                senders.append(f"{filename}:{node.lineno}:{name}")
                source = node.args[0] if node.args else next(iter(k.value for k in node.keywords), None)
                if not (isinstance(source, ast.Attribute) and source.attr == "source"):
                    flag(node, f"{name}() of something other than a Script's .source")
            if name == "execute_command":
                command = node.args[0] if node.args else None
                if id(node) in forwarded:
                    pass
                elif not (isinstance(command, ast.Constant) and isinstance(command.value, str | bytes)):
                    flag(node, "execute_command with a computed command name")
                elif SOURCE_COMMANDS.fullmatch(_text(command.value).strip()):
                    flag(node, f"execute_command({_text(command.value)!r}) sends source")
            if name == "getattr" and len(node.args) > 1:
                attr = node.args[1]
                if isinstance(attr, ast.Constant) and attr.value in SOURCE_SENDERS:
                    flag(node, f"getattr of {attr.value!r}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str | bytes) and id(node) not in docstrings:
            value = _text(node.value)
            if "\r\n" in value and SOURCE_COMMANDS.search(value):
                flag(node, f"a hand-packed command that carries source: {value[:40]!r}")
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Attribute) and target.attr == "source":
                    value = node.value
                    from_files = (
                        filename.endswith("scripts.py") and isinstance(value, ast.Call)
                        and isinstance(value.func, ast.Name) and value.func.id in {"script_source", "library_source"}
                    )
                    if not from_files:
                        flag(node, "a .source set from something other than script_source() or library_source()")
    return violations, senders


@pytest.mark.parametrize("snippet", [
    'await redis.eval(f"return {x}", 0)',
    'redis.register_script("return " + name)',
    "await pipe.script_load(TEMPLATE % args)",
    "await redis.eval_ro(script.source.replace('X', x), 0)",
    'await r.function_load(code=f"#!lua name={lib}")',
    'pipe.execute_command("EVAL", src, 0)',
    "pipe.execute_command(command, src, 0)",
    "async def execute_command(self, *args):\n    return await node.execute_command('EVAL', *args)",
    "async def send(self, *args):\n    return await node.execute_command(*args)",
    'getattr(redis, "eval")(src, 0)',
    'raw = b"*3\\r\\n$4\\r\\nEVAL\\r\\n"',
    'await redis.execute_command("script load", src)',
    'await redis.execute_command(b"EVAL_RO", src, 0)',
    "eval(expression)",
    "script.source = text + extra",
], ids=["f-string", "concat", "percent", "derived", "function", "raw-eval", "computed", "forwarder-eval",
        "not-a-forwarder", "getattr", "resp", "script-load", "eval-ro", "py-eval", "assigned"])
def test_the_scan_catches_runtime_built_scripts(snippet: str) -> None:
    violations, _ = scan(snippet, "handoffbus/somewhere.py")
    assert violations, snippet


def test_the_scan_allows_what_the_package_does() -> None:
    allowed = """
await redis.function_load(self.source, replace=True)
await redis.fcall(bus.scripts.lease.function, 1, key)
pipe.execute_command("FCALL", call.script.function, len(call.keys), *call.keys)
parts = [b"*%d\\r\\n$5\\r\\nFCALL\\r\\n" % n]
_SCRIPTS = ("fcall", "eval", "function|load")  # ACL command names: not calls
async def execute_command(self, *args, **kwargs):
    return await self._node.execute_command(*args, **kwargs)
"""
    assert scan(allowed, "handoffbus/x.py")[0] == []
    for setter in ("self.source = script_source(name)", "self.source = library_source()"):
        assert scan(setter, "handoffbus/scripts.py")[0] == []
        assert scan(setter, "handoffbus/other.py")[0] != []


def test_no_script_is_built_from_runtime_data() -> None:
    violations: list[str] = []
    senders: list[str] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found, sent = scan(path.read_text("utf-8"), str(path.relative_to(PACKAGE.parent)))
        violations += found
        senders += sent
    assert violations == []
    # the scan saw where scripts are loaded (it is looking at the right code), and that is scripts.py alone
    loads = [s for s in senders if s.endswith("function_load")]
    assert len(loads) >= 1 and all("scripts.py" in s for s in loads), senders


def _from_disk(name: str) -> str:
    """A script's source assembled from the files alone, independently of scripts.py."""
    [path] = LUA.glob(f"{name}-*.lua")
    return re.sub(r"^-- @include (\w+)$", lambda m: (LUA / "includes" / f"{m[1]}.lua").read_text("utf-8"),
                  path.read_text("utf-8"), flags=re.MULTILINE)


def test_every_script_is_a_file_under_lua() -> None:
    scripts = Scripts()
    assert {path.name.rsplit("-", 1)[0] for path in LUA.glob("*.lua")} == set(SCRIPT_NAMES)
    for script in scripts:
        assert script.source == _from_disk(script.name)
        assert re.search(r"^-- @include", script.source, re.MULTILINE) is None
    # the library: each include once, then each script's own text as the body of its function
    library = scripts.source
    assert library.startswith(f"#!lua name={scripts.library}\n") and re.fullmatch(r"\w+", scripts.library)
    for include in (LUA / "includes").glob("*.lua"):
        assert library.count(include.read_text("utf-8")) == 1, include.name
    for script in scripts:
        [path] = LUA.glob(f"{script.name}-*.lua")
        body = re.sub(r"^-- @include \w+$", "", path.read_text("utf-8"), flags=re.MULTILINE)
        flags = ", ".join(f"'{flag}'" for flag in script_flags(script.name))
        assert (f"redis.register_function{{function_name='{script.function}', flags={{{flags}}}, "
                f"callback=function(keys, args)\nKEYS, ARGV = keys, args\n{body}\nend}}") in library
        assert script.function.startswith("hb_") and script.function.endswith(f"_{script.name}")


class _RecordingRedis:
    def __init__(self) -> None:
        self.sent: list[str] = []

    async def function_load(self, code: str, replace: bool = False) -> None:
        self.sent.append(code)


async def test_only_the_files_are_loaded() -> None:
    """The library is the files and the few lines that join them, nothing else."""
    redis = _RecordingRedis()
    scripts = Scripts()
    await scripts.load_all(redis)
    [rest] = redis.sent
    for include in (LUA / "includes").glob("*.lua"):
        rest = rest.replace(include.read_text("utf-8"), "", 1)
    for script in scripts:
        [path] = LUA.glob(f"{script.name}-*.lua")
        body = re.sub(r"^-- @include \w+$", "", path.read_text("utf-8"), flags=re.MULTILINE)
        flags = ", ".join(f"'{flag}'" for flag in script_flags(script.name))
        rest = rest.replace(f"redis.register_function{{function_name='{script.function}', flags={{{flags}}}, "
                            f"callback=function(keys, args)\nKEYS, ARGV = keys, args\n{body}\nend}}", "", 1)
    assert rest.split() == ["#!lua", f"name={scripts.library}", "local", "KEYS,", "ARGV"]


@pytest.mark.parametrize("settings", [
    {"sweep_lease": float("inf")}, {"record_retention": float("nan")}, {"route_guard": 1e300},
    {"read_block": 0.0004},  # 0 ms: XREAD BLOCK 0 blocks forever
    {"sweep_lease": 0.0002},  # 0 ms: the lease script reads it as a release
    {"sweep_batch": 2.5}, {"max_queued": 1.5}, {"max_pending": float("nan")}, {"sweep_batch": True},
    {"max_queued": -1},
    # past 2^53 the sweep script's LIMIT reaches Redis as "9.2233720368547758e+18": every sweep fails
    {"sweep_batch": 2**63 - 1},
])
def test_settings_that_would_break_the_bus_later_are_refused(settings: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequest):
        BusConfig(**settings)


def test_settings_at_their_bounds_are_taken() -> None:
    config = BusConfig(read_block=0.001, sweep_batch=1, max_queued=0, max_pending=0, max_timeout=3600 * 24 * 365.0)
    assert config.read_block == 0.001 and config.max_queued == 0


def test_an_unknown_setting_is_an_invalid_request_naming_the_settings() -> None:
    # a plain TypeError from BusConfig ("Unexpected keyword argument"), no HandoffbusError
    with pytest.raises(InvalidRequest, match=r"unknown setting 'max_queue' \(did you mean 'max_queued'\?\)"):
        HandoffBus.memory(max_queue=5)


async def test_the_bus_own_names_are_no_agent_ids() -> None:
    """An agent named ``_router`` (or ``bus``) acted under the name the bus's own verdicts use:
    repeating the router's NO_CAPABLE_AGENT, it got that refusal back as its own, and with a
    keyring its decisions under that name would need no signature."""
    async with HandoffBus.memory() as bus:
        for name in ("bus", "_router"):
            with pytest.raises(InvalidName, match="the bus's own"):
                bus.client(name)
            with pytest.raises(InvalidName, match="the bus's own"):
                await bus.client("req").request_handoff(HandoffRequest(from_agent="req", to_agent=name))
        assert bus.client("router").agent_id == "router"  # a name like them is fine
