"""Images and the compose stack, checked without a Docker engine: base images, non-root users,
entrypoints that are our console scripts with valid arguments, files that exist, and the
Prometheus config of the stack accepted by promtool."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from engine.worker.cli import build_parser as worker_parser
from service.cli import settings_from_args as gateway_settings
from tests.deploy.chart import DASHBOARD_FILE, ROOT, RULES_FILE

DOCKER = ROOT / "docker"
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def instructions(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", (DOCKER / name).read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def last_stage(name: str) -> list[tuple[str, str]]:
    steps = instructions(name)
    start = max(i for i, (op, _) in enumerate(steps) if op == "FROM")
    return steps[start:]


def exec_form(name: str, op: str) -> list[str]:
    values = [json.loads(arg) for o, arg in last_stage(name) if o == op]
    assert len(values) == 1, f"{name}: one exec-form {op} expected"
    assert isinstance(values[0], list)
    return [str(v) for v in values[0]]


def froms(name: str) -> list[str]:
    return [arg.split()[0] for op, arg in instructions(name) if op == "FROM"]


def test_base_images() -> None:
    assert froms("worker.Dockerfile") == ["vllm/vllm-openai:v0.33.0"]
    assert all(re.fullmatch(r"python:3\.1[1-3]-slim", f) for f in froms("gateway.Dockerfile"))
    assert all(re.fullmatch(r"python:3\.1[1-3]-slim", f) for f in froms("embedded.Dockerfile"))


@pytest.mark.parametrize("name", ["gateway.Dockerfile", "embedded.Dockerfile"])
def test_runs_as_non_root(name: str) -> None:
    users = [a for o, a in last_stage(name) if o == "USER"]
    assert users and users[-1].split(":")[0] not in {"root", "0"}


@pytest.mark.parametrize(
    ("name", "entrypoint"),
    [
        ("gateway.Dockerfile", ["dflash-gateway"]),
        ("worker.Dockerfile", ["dflash-worker", "--backend", "vllm"]),
        ("embedded.Dockerfile", ["dflash-worker", "--backend", "embedded"]),
    ],
)
def test_entrypoints_are_our_console_scripts(name: str, entrypoint: list[str]) -> None:
    got = exec_form(name, "ENTRYPOINT")
    assert got == entrypoint
    assert got[0] in SCRIPTS


def test_default_commands_parse() -> None:
    gw = gateway_settings(exec_form("gateway.Dockerfile", "CMD"))
    assert gw.port == 8000
    ns, unknown = worker_parser().parse_known_args(
        exec_form("embedded.Dockerfile", "ENTRYPOINT")[1:] + exec_form("embedded.Dockerfile", "CMD")
    )
    assert unknown == [] and ns.backend == "embedded" and ns.host == "0.0.0.0"


def test_gateway_image_listens_on_all_interfaces(monkeypatch: pytest.MonkeyPatch) -> None:
    envs = " ".join(arg for op, arg in last_stage("gateway.Dockerfile") if op == "ENV")
    host = re.search(r"DFLASH_GATEWAY_HOST=(\S+)", envs)
    assert host is not None
    monkeypatch.setenv("DFLASH_GATEWAY_HOST", host.group(1))
    assert gateway_settings(exec_form("gateway.Dockerfile", "CMD")).host == "0.0.0.0"


def test_gateway_image_has_no_torch() -> None:
    core = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not [d for d in core if d.lower().startswith("torch")]
    copies = [a for o, a in instructions("gateway.Dockerfile") if o == "COPY" and "--from" not in a]
    assert not [c for c in copies if "engine" in c]  # the gateway needs only service/
    installs = [a for o, a in instructions("gateway.Dockerfile") if o == "RUN"]
    assert not [r for r in installs if re.search(r"pip install[^&]*(torch|\[engine)", r)]


def test_embedded_image_pins_cpu_torch() -> None:
    runs = " ".join(a for o, a in instructions("embedded.Dockerfile") if o == "RUN")
    assert "torch==2.13.0" in runs and "download.pytorch.org/whl/cpu" in runs
    assert "'.[engine,tracing]'" in runs


@pytest.mark.parametrize("name", ["gateway.Dockerfile", "worker.Dockerfile", "embedded.Dockerfile"])
def test_every_image_installs_the_tracing_extra(name: str) -> None:
    """docs/tracing.md: the OTEL_* environment traces in every image, so each has the SDK."""
    runs = " ".join(a for o, a in instructions(name) if o == "RUN")
    assert re.search(r"pip install[^&]*'\.\[[a-z0-9,-]*\btracing\b[a-z0-9,-]*\]'", runs)


@pytest.mark.parametrize("name", ["gateway.Dockerfile", "worker.Dockerfile"])
def test_the_gateway_and_the_adapt_job_reach_buckets(name: str) -> None:
    """docs/capture.md: the gateway captures to s3:// or gs://, and the adapt job (the worker
    image) reads it back: both images have fsspec's S3 and GCS drivers."""
    runs = " ".join(a for o, a in instructions(name) if o == "RUN")
    extras = re.search(r"pip install[^&]*'\.\[([a-z0-9,-]*)\]'", runs)
    assert extras is not None
    assert {"capture-s3", "capture-gcs"} <= set(extras.group(1).split(","))


@pytest.mark.parametrize("name", ["gateway.Dockerfile", "worker.Dockerfile", "embedded.Dockerfile"])
def test_copied_sources_exist(name: str) -> None:
    for op, arg in instructions(name):
        if op == "COPY" and "--from" not in arg:
            for src in arg.split()[:-1]:
                assert (ROOT / src).exists(), f"{name}: COPY {src} missing"
    assert (DOCKER / f"{name}.dockerignore").exists()


def compose() -> dict:  # type: ignore[type-arg]
    data: dict = yaml.safe_load((DOCKER / "compose.yaml").read_text())  # type: ignore[type-arg]
    return data


def test_compose_stack_references_real_files() -> None:
    services = compose()["services"]
    assert set(services) == {"gateway", "worker", "prometheus", "grafana"}
    for svc in services.values():
        if "build" in svc:
            context = (DOCKER / svc["build"]["context"]).resolve()
            assert context == ROOT and (context / svc["build"]["dockerfile"]).exists()
        for volume in svc.get("volumes", []):
            host = volume.split(":")[0]
            assert (DOCKER / host).resolve().exists(), volume
    mounts = {
        v.split(":")[1]: (DOCKER / v.split(":")[0]).resolve()
        for v in services["grafana"]["volumes"]
    }
    assert DASHBOARD_FILE.resolve().parent == mounts["/var/lib/grafana/dashboards"]
    assert (mounts["/etc/grafana/provisioning"] / "dashboards" / "dflash.yml").exists()


def test_compose_gateway_finds_the_worker() -> None:
    services = compose()["services"]
    gw = gateway_settings(services["gateway"]["command"])
    ns, unknown = worker_parser().parse_known_args(
        exec_form("embedded.Dockerfile", "ENTRYPOINT")[1:] + services["worker"]["command"]
    )
    assert unknown == []
    assert gw.worker_dns == f"worker:{ns.port}"
    scrape = yaml.safe_load((DOCKER / "prometheus.yml").read_text())["scrape_configs"]
    targets = {job["job_name"]: job for job in scrape}
    assert targets["gateway"]["static_configs"][0]["targets"] == [f"gateway:{gw.port}"]
    assert targets["worker"]["dns_sd_configs"][0] == {
        "names": ["worker"],
        "type": "A",
        "port": ns.port,
        "refresh_interval": "10s",
    }


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool missing: run `make tools`")
def test_stack_prometheus_config_is_valid(tmp_path: Path) -> None:
    text = (DOCKER / "prometheus.yml").read_text()
    assert "/etc/prometheus/rules/alerts.yaml" in text  # where compose mounts the chart's rules
    config = tmp_path / "prometheus.yml"
    config.write_text(text.replace("/etc/prometheus/rules/alerts.yaml", str(RULES_FILE)))
    proc = subprocess.run(
        ["promtool", "check", "config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout
