"""docker-compose.yml and deploy/: no Docker engine or cluster runs here, so the files are
checked as data. Every YAML parses; each has the fields its job needs (healthchecks, grace
periods longer than the workers' drain, probes, matching selectors and names); the metrics
the alerts and the autoscaler read exist; and every ``handoffbus`` command the files and the
deploy README run is parsed by the real CLI, options included. The workers' user the Secret
describes runs the Deployment's worker and probes against a real server."""

from __future__ import annotations

import functools
import json
import re
import shlex
import urllib.parse
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest
import redis.asyncio as aioredis
import typer
import yaml
from prometheus_client import CollectorRegistry
from typer.testing import CliRunner

from handoffbus import HandoffBus, HandoffStatus
from handoffbus.acl import agent_user, forwarder_user
from handoffbus.cli import app
from handoffbus.keys import GROUP, Keys
from handoffbus.metrics import Metrics

from .agents import Echo
from .conftest import new_prefix
from .helpers import req, serve_until_done

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
YAML_FILES = [ROOT / "docker-compose.yml", *sorted(DEPLOY.rglob("*.yaml")), *sorted(DEPLOY.rglob("*.yml"))]


def load(path: Path) -> Any:
    [document] = list(yaml.safe_load_all(path.read_text("utf-8")))
    return document


def parse_cli(args: list[str]) -> dict[str, Any]:
    """Parse a handoffbus command line as the installed command would, without running it;
    raises for an unknown command or option. Returns the command's parameters."""
    group: Any = typer.main.get_command(app)
    ctx = group.make_context("handoffbus", list(args))
    rest = [*(getattr(ctx, "_protected_args", None) or []), *ctx.args]
    while True:
        name, command, rest = group.resolve_command(ctx, rest)
        ctx = command.make_context(name, rest, parent=ctx)
        if not hasattr(command, "resolve_command"):
            return dict(ctx.params)
        group, rest = command, [*(getattr(ctx, "_protected_args", None) or []), *ctx.args]


def option(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_every_yaml_file_parses() -> None:
    assert len(YAML_FILES) >= 6
    for path in YAML_FILES:
        assert load(path), path


def test_the_cli_parser_refuses_what_does_not_exist() -> None:
    assert parse_cli(["worker", "a:B", "--concurrency", "3"])["concurrency"] == 3
    assert parse_cli(["dlq", "replay", "a-1", "1-0"])["entry"] == "1-0"
    for bad in (["wrker", "a:B"], ["worker", "a:B", "--nope"], ["check", "--agent"]):
        with pytest.raises(Exception, match=r"No such|no such|requires an argument"):
            parse_cli(bad)


# ---------------------------------------------------------------------- compose


def compose_commands(compose: dict[str, Any]) -> list[list[str]]:
    found = []
    for service in compose["services"].values():
        if "build" in service:  # the handoffbus image: its entrypoint is handoffbus
            found.append(list(service["command"]))
        test = service.get("healthcheck", {}).get("test", [])
        if test[:2] == ["CMD", "handoffbus"]:
            found.append(test[2:])
    return found


def test_compose() -> None:
    compose = load(ROOT / "docker-compose.yml")
    services = compose["services"]
    store = services["valkey"]
    assert store["healthcheck"]["test"][:2] == ["CMD", "valkey-cli"]
    assert option(store["command"], "--maxmemory-policy") == "noeviction"
    workers = {name: s for name, s in services.items() if "build" in s and s["command"][0] == "worker"}
    assert set(workers) == {"security-reviewer", "refunds"}
    for name, service in workers.items():
        assert service["healthcheck"]["test"][:3] == ["CMD", "handoffbus", "check"], name
        assert service["depends_on"]["valkey"]["condition"] == "service_healthy"
        grace = float(option(service["command"], "--grace"))
        assert service["stop_signal"] == "SIGTERM" and int(service["stop_grace_period"].rstrip("s")) > grace
        assert service["environment"]["HANDOFFBUS_REDIS_URL"].startswith("redis://valkey:")
    monitoring = {name for name, s in services.items() if "monitoring" in s.get("profiles", [])}
    assert monitoring == {"prometheus", "redis-exporter", "handoffbus-exporter"}
    for mount in services["prometheus"]["volumes"]:
        assert (ROOT / mount.split(":")[0]).exists(), mount
    assert (ROOT / services["security-reviewer"]["build"]["dockerfile"]).exists()
    for args in compose_commands(compose):
        parse_cli(args)


def test_dockerfile_runs_the_cli() -> None:
    text = (DEPLOY / "Dockerfile").read_text("utf-8")
    assert 'ENTRYPOINT ["handoffbus"]' in text and "STOPSIGNAL SIGTERM" in text
    assert "'.[metrics,otel]'" in text


# ---------------------------------------------------------------------- kubernetes


def test_kubernetes_worker_pdb_and_keda_fit_together() -> None:
    deployment = load(DEPLOY / "kubernetes" / "worker-deployment.yaml")
    pdb = load(DEPLOY / "kubernetes" / "pdb.yaml")
    scaled = load(DEPLOY / "kubernetes" / "keda-scaledobject.yaml")
    assert (deployment["kind"], pdb["kind"], scaled["kind"]) == ("Deployment", "PodDisruptionBudget", "ScaledObject")
    spec = deployment["spec"]["template"]["spec"]
    [container] = spec["containers"]
    args = container["args"]
    assert spec["terminationGracePeriodSeconds"] > float(option(args, "--grace"))
    assert container["livenessProbe"]["exec"]["command"][:2] == ["handoffbus", "check"]
    readiness = container["readinessProbe"]["exec"]["command"]
    agent = option(readiness, "--agent")
    for args_of in (args, container["livenessProbe"]["exec"]["command"][1:], readiness[1:]):
        parse_cli(args_of)
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert labels["handoffbus/agent"] == agent
    assert scaled["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    [stream] = [t for t in scaled["spec"]["triggers"] if t["type"] == "redis-streams"]
    assert stream["metadata"]["stream"] == Keys().target(agent).inbox
    assert stream["metadata"]["consumerGroup"] == GROUP
    [prom] = [t for t in scaled["spec"]["triggers"] if t["type"] == "prometheus"]
    assert f'agent="{agent}"' in prom["metadata"]["query"]
    assert {p["containerPort"] for p in container["ports"]} == {int(option(args, "--metrics-port"))}


def test_keda_logs_in_with_a_trigger_authentication_of_the_deploy_files() -> None:
    """Every authenticationRef of a ScaledObject names a TriggerAuthentication defined in
    deploy/, whose secret refs name keys of a Secret defined there; every secretKeyRef of the
    Deployment does too; the redis-streams trigger's address and TLS match the workers' URL."""
    documents = [load(path) for path in sorted(DEPLOY.rglob("*.yaml")) + sorted(DEPLOY.rglob("*.yml"))]
    of_kind: dict[str, dict[str, Any]] = {}
    for document in documents:
        if isinstance(document, dict) and "kind" in document:
            of_kind.setdefault(document["kind"], {})[document["metadata"]["name"]] = document
    auths, secrets = of_kind.get("TriggerAuthentication", {}), of_kind.get("Secret", {})

    def secret_keys(name: str) -> set[str]:
        assert name in secrets, f"no Secret {name!r} in deploy/"
        secret = secrets[name]
        return {*secret.get("stringData", {}), *secret.get("data", {})}

    scaled = load(DEPLOY / "kubernetes" / "keda-scaledobject.yaml")
    refs = [t["authenticationRef"]["name"] for t in scaled["spec"]["triggers"] if "authenticationRef" in t]
    assert refs
    for name in refs:
        assert name in auths, f"authenticationRef {name!r} names no TriggerAuthentication in deploy/"
        targets = auths[name]["spec"]["secretTargetRef"]
        assert {t["parameter"] for t in targets} >= {"password"}
        for target in targets:
            assert target["key"] in secret_keys(target["name"]), target
    deployment = load(DEPLOY / "kubernetes" / "worker-deployment.yaml")
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    [url_ref] = [e["valueFrom"]["secretKeyRef"] for e in container["env"] if "secretKeyRef" in e.get("valueFrom", {})]
    assert url_ref["key"] in secret_keys(url_ref["name"])
    url = urllib.parse.urlsplit(secrets[url_ref["name"]]["stringData"][url_ref["key"]])
    [stream] = [t for t in scaled["spec"]["triggers"] if t["type"] == "redis-streams"]
    assert stream["metadata"]["address"] == f"{url.hostname}:{url.port}"
    assert stream["metadata"].get("enableTLS", "false") == ("true" if url.scheme == "rediss" else "false")


# ---------------------------------------------------------------------- prometheus


async def known_metric_names() -> set[str]:
    registry = CollectorRegistry()
    async with HandoffBus.memory() as bus:
        Metrics(bus, registry)
    names = set()
    for family in registry.collect():
        names.add(family.name)
        names |= {f"{family.name}{suffix}" for suffix in ("_total", "_bucket", "_count", "_sum")}
    return names


@pytest.mark.anyio
async def test_alert_rules_and_queries_use_real_metrics() -> None:
    known = await known_metric_names()
    rules = load(DEPLOY / "prometheus" / "alerts.yml")["groups"][0]["rules"]
    assert {r["alert"] for r in rules} >= {"HandoffbusBacklogAge", "HandoffbusFailureRate", "HandoffbusNoLiveWorker"}
    queries = [r["expr"] for r in rules]
    triggers = load(DEPLOY / "kubernetes" / "keda-scaledobject.yaml")["spec"]["triggers"]
    queries += [t["metadata"]["query"] for t in triggers if t["type"] == "prometheus"]
    for rule in rules:
        assert rule["for"] and rule["labels"]["severity"] in {"warning", "critical"} and rule["annotations"]["summary"]
    for query in queries:
        used = set(re.findall(r"handoffbus_[a-z_]+", query))
        assert used and used <= known, (query, used - known)
    scrape = load(DEPLOY / "prometheus" / "prometheus.yml")
    assert scrape["rule_files"] == ["/etc/prometheus/alerts.yml"]
    targets = {t for job in scrape["scrape_configs"] for c in job["static_configs"] for t in c["targets"]}
    services = load(ROOT / "docker-compose.yml")["services"]
    assert {t.split(":")[0] for t in targets} <= set(services)


# ---------------------------------------------------------------------- the README's commands


def test_every_handoffbus_command_of_the_deploy_readme_parses() -> None:
    text = (DEPLOY / "README.md").read_text("utf-8")
    lines = [line.split("#")[0].strip() for line in re.findall(r"```sh\n(.*?)```", text, flags=re.DOTALL)
             for line in line.splitlines()]
    commands = []
    for line in lines:
        argv = shlex.split(line.replace("<port>", "7000"))
        if "handoffbus" in argv:
            commands.append(argv[argv.index("handoffbus") + 1:])
    assert len(commands) >= 2
    for argv in commands:
        parse_cli(argv)


# ---------------------------------------------------------------------- the workers' user


@pytest.mark.anyio
async def test_the_kubernetes_workers_and_probes_run_as_the_user_of_their_secret(servers: dict) -> None:
    """The Secret named an agent's own ACL user, which a worker that is not isolated cannot run
    as (it exited at once, refused a key), nor its readiness probe (refused the grants hash and
    the registry); and its name was not the one ``handoffbus acl`` gives. The Secret's user,
    with the rules it names (the forwarder's), runs the Deployment's worker and probes."""
    secret = load(DEPLOY / "kubernetes" / "redis-secret.yaml")["stringData"]
    deployment = load(DEPLOY / "kubernetes" / "worker-deployment.yaml")
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    assert "--isolated" not in container["args"]
    name = urllib.parse.urlsplit(secret["url"]).username
    assert name == secret["username"]
    comment = (DEPLOY / "kubernetes" / "redis-secret.yaml").read_text("utf-8")
    assert "`handoffbus acl` prints for the forwarder user" in comment
    prefix, server = new_prefix(), servers["valkey"]
    user = forwarder_user(prefix, name=name)
    agent = deployment["metadata"]["labels"]["handoffbus/agent"]
    admin = aioredis.Redis.from_url(server.url)
    await admin.execute_command(*user.setuser())
    try:
        url = f"unix://{user.name}:{user.password}@{server.socket_path}"
        async with HandoffBus.connect(url, prefix=prefix) as bus:
            handle = await bus.client("req").request_handoff(req("req", agent))
            [outcome], _ = await serve_until_done(bus, Named(agent), [handle])
        assert outcome.status is HandoffStatus.COMPLETED
        for probe in ("livenessProbe", "readinessProbe"):
            command = container[probe]["exec"]["command"]
            assert command[0] == "handoffbus"
            result = await anyio.to_thread.run_sync(functools.partial(
                CliRunner().invoke, app, [*command[1:], "--prefix", prefix, "--json"],
                env={"HANDOFFBUS_REDIS_URL": url}))
            problems = json.loads(result.stdout)["problems"]
            assert problems == ([f"{agent}: no live worker"] if "--agent" in command else []), (probe, problems)
        # the agent's own user, which the Secret used to name: refused, and said so (not "unavailable")
        own = agent_user(prefix, agent)
        await admin.execute_command(*own.setuser())
        command = container["readinessProbe"]["exec"]["command"]
        result = await anyio.to_thread.run_sync(functools.partial(
            CliRunner().invoke, app, [*command[1:], "--prefix", prefix, "--json"],
            env={"HANDOFFBUS_REDIS_URL": f"unix://{own.name}:{own.password}@{server.socket_path}"}))
        [problem] = json.loads(result.stdout)["problems"]
        assert problem.startswith("the server's ACL refused this user"), problem
    finally:
        await admin.execute_command("ACL", "DELUSER", user.name, agent_user(prefix, agent).name)
        await admin.aclose()


class Named(Echo):
    def __init__(self, agent_id: str) -> None:
        super().__init__()
        self.agent_id = agent_id  # type: ignore[misc]
