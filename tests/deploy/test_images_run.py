"""The gateway and embedded-worker images, built from the real Dockerfiles with the commands
`make images` runs with podman, then run as the chart runs them (values-embedded.yaml, through
tests/deploy/pods.py) on one network: a chat completion through the gateway container, non-root
users on a read-only root, the images' HEALTHCHECKs, and SIGTERM draining an in-flight stream.

No registry is reachable here, so `python:3.11-slim` is a stand-in made from Debian's packages
in the test's own image store (tests/deploy/podman.py), and torch is this machine's CPU wheel,
mounted with the CA bundle and a pip.conf at build time: the Dockerfiles build unchanged."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.deploy.chart import ROOT, render
from tests.deploy.podman import (
    STAND_IN,
    Podman,
    build_home,
    build_scratch,
    ensure_stand_in,
    free_space,
    private_podman,
    why_no_engine,
)
from tests.deploy.pods import PodRun, pod_run
from tests.deploy.test_docker import froms, instructions

pytestmark = pytest.mark.slow
BUILT = {"gateway": "docker/gateway.Dockerfile", "embedded": "docker/embedded.Dockerfile"}


@pytest.fixture(scope="module")
def podman() -> Podman:
    engine = private_podman()
    reason = why_no_engine(engine)
    if reason is not None:
        pytest.skip(f"no container engine can run here: {reason}")
    return engine


def make_images_commands() -> list[list[str]]:
    """The build commands `make images` prints for podman (gateway and embedded only)."""
    done = subprocess.run(
        [sys.executable, "scripts/images.py", "--dry-run", "--engine", "podman", *BUILT],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        check=True,
    )
    return [shlex.split(line) for line in done.stdout.splitlines() if line.startswith("podman ")]


def copied_files(dockerfile: str) -> list[Path]:
    """The build context the Dockerfile COPYs (the ignore file admits no more)."""
    out: list[Path] = []
    for op, arg in instructions(Path(dockerfile).name):
        if op == "COPY" and "--from" not in arg:
            for source in arg.split()[:-1]:
                path = ROOT / source
                found = sorted(path.rglob("*")) if path.is_dir() else [path]
                out += [f for f in found if f.is_file() and "__pycache__" not in f.parts]
    return out


def inputs_key(podman: Podman, command: list[str], home: Path) -> str:
    """Everything the build reads: a matching key means the image in the store is current."""
    digest = hashlib.sha256(json.dumps(command).encode())
    dockerfile = command[command.index("-f") + 1]
    base = podman("image", "inspect", STAND_IN, "--format", "{{.Id}}").stdout
    digest.update(base.encode() + (ROOT / dockerfile).read_bytes())
    digest.update((home / ".config" / "pip" / "pip.conf").read_bytes())
    digest.update(" ".join(sorted(p.name for p in (home / "wheels").glob("*.whl"))).encode())
    for path in copied_files(dockerfile):
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def build(podman: Podman, commands: list[list[str]], home: Path) -> None:
    """Run the builds side by side, skipping those whose inputs built the stored image."""
    logs, running = podman.home / "builds", []
    logs.mkdir(exist_ok=True)
    scratch = build_scratch(podman.home)  # buildah's TMPDIR
    env = {**podman.env, "TMPDIR": str(scratch)}
    for command in commands:
        ref = command[command.index("-t") + 1]
        mark, key = logs / f"{ref.replace('/', '_')}.key", inputs_key(podman, command, home)
        image = podman("image", "inspect", ref, "--format", "{{.Id}}", check=False).stdout
        if mark.exists() and mark.read_text() == f"{key} {image.strip()}":
            continue
        with (logs / f"{ref.replace('/', '_')}.log").open("w") as log:
            argv = podman.argv("build", "--pull=never", "-v", f"{home}:/root:ro", *command[2:])
            process = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=log)
        running.append((process, mark, key, ref))
    codes = [process.wait(timeout=900) for process, *_ in running]
    space = free_space(podman.home, scratch)
    # buildah empties its scratch; what a killed one left there would hold RAM.
    shutil.rmtree(scratch, ignore_errors=True)
    for code, (_, mark, key, ref) in zip(codes, running, strict=True):
        tail = mark.with_suffix(".log").read_text()[-3000:]
        assert code == 0, f"{ref} did not build ({space}):\n{tail}"
        image = podman("image", "inspect", ref, "--format", "{{.Id}}").stdout.strip()
        mark.write_text(f"{key} {image}")


@pytest.fixture(scope="module")
def images(podman: Podman) -> dict[str, str]:
    """{Dockerfile: the reference built}"""
    for dockerfile in BUILT.values():
        assert set(froms(Path(dockerfile).name)) == {"python:3.11-slim"}, (
            f"{dockerfile}: the stand-in base is Debian bookworm's Python 3.11 ({STAND_IN})"
        )
    ensure_stand_in(podman)
    commands = make_images_commands()
    build(podman, commands, build_home(podman))
    return {c[c.index("-f") + 1]: c[c.index("-t") + 1] for c in commands}


@dataclass
class Stack:
    podman: Podman
    runs: dict[str, PodRun]
    names: dict[str, str]
    api_key: str
    model: str

    def url(self, which: str) -> str:
        fmt = "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}"
        ip = self.podman("inspect", self.names[which], "--format", fmt).stdout.strip()
        return f"http://{ip}:8000"

    def chat(self, **extra: Any) -> dict[str, Any]:
        messages = [{"role": "user", "content": "def fibonacci(n):"}]
        return {"model": self.model, "messages": messages, **extra}

    @property
    def auth(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.api_key}"}


def wait_ready(stack: Stack, timeout: float = 240) -> None:
    """The gateway container answers /ready 200: it found the worker through DNS."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, RuntimeError):
            if httpx.get(stack.url("gateway") + "/ready", timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    logs = {n: stack.podman("logs", c, check=False).stderr[-3000:] for n, c in stack.names.items()}
    raise TimeoutError(f"gateway not ready after {timeout}s: {logs}")


@pytest.fixture(scope="module")
def stack(podman: Podman, images: dict[str, str]) -> Iterator[Stack]:
    files = podman.home / f"pod-files-{os.getpid()}"
    docs = render(("values-embedded.yaml",))
    runs = {
        "gateway": pod_run(docs, "-gateway", files / "gateway"),
        "worker": pod_run(docs, "-worker", files / "worker"),
    }
    assert {r.image for r in runs.values()} == set(images.values())  # what the chart pulls
    dns = runs["gateway"].args[runs["gateway"].args.index("--worker-dns") + 1]
    suffix = os.getpid()
    names = {"gateway": f"dflash-gateway-{suffix}", "worker": f"dflash-worker-{suffix}"}
    network = f"dflash-images-{suffix}"
    podman("rm", "-f", "-t", "0", *names.values(), check=False)
    podman("network", "rm", "-f", network, check=False)
    podman("network", "create", network)
    args = runs["worker"].args
    stack = Stack(
        podman,
        runs,
        names,
        (files / "gateway" / "api-keys" / "api-keys").read_text().split()[0],
        args[args.index("--served-model-name") + 1],
    )
    try:
        # The worker answers to the name the gateway resolves (the chart's headless Service).
        alias = ["--network-alias", dns.split(":")[0]]
        podman(*runs["worker"].argv(names["worker"], network, *alias))
        podman(*runs["gateway"].argv(names["gateway"], network))
        wait_ready(stack)
        yield stack
    finally:
        podman("rm", "-f", "-t", "0", *names.values(), check=False)
        podman("network", "rm", "-f", network, check=False)
        shutil.rmtree(files, ignore_errors=True)


def test_chat_completion_through_the_gateway_container(stack: Stack) -> None:
    body = stack.chat(max_tokens=24, ignore_eos=True)
    url = stack.url("gateway") + "/v1/chat/completions"
    reply = httpx.post(url, json=body, headers=stack.auth, timeout=120)
    assert reply.status_code == 200, reply.text
    data = reply.json()
    assert data["model"] == stack.model and data["usage"]["completion_tokens"] == 24
    spec = data["metrics"]["speculative_decoding"]  # the per-request DFlash metrics
    assert {"num_spec_steps", "num_draft_tokens", "acceptance_histogram"} <= set(spec)
    assert spec["mean_acceptance_length"] >= 1.0
    assert data["metrics"]["tokens_per_second"] > 0
    refused = httpx.post(url, json=body, timeout=30)  # the key file from the chart's Secret
    assert refused.status_code == 401 and refused.json()["error"]["type"]


@pytest.mark.parametrize("which", ["gateway", "worker"])
def test_non_root_on_a_read_only_root_with_a_writable_tmp(stack: Stack, which: str) -> None:
    name, run = stack.names[which], stack.runs[which]
    image_user = stack.podman("image", "inspect", run.image, "--format", "{{.Config.User}}")
    assert image_user.stdout.strip() == "10001:10001"  # the Dockerfile's USER
    assert stack.podman("exec", name, "id", "-u").stdout.strip() == str(run.user[0]) != "0"
    denied = stack.podman("exec", name, "touch", "/probe", check=False)
    assert denied.returncode != 0 and "Read-only file system" in denied.stderr
    assert run.tmpfs == ["/tmp"]
    stack.podman("exec", name, "touch", "/tmp/probe")  # where the chart mounts an emptyDir
    status = stack.podman("exec", name, "cat", "/proc/1/status").stdout
    assert "CapEff:\t0000000000000000" in status and "NoNewPrivs:\t1" in status


@pytest.mark.parametrize("which", ["gateway", "worker"])
def test_the_images_healthcheck_passes(stack: Stack, which: str) -> None:
    name = stack.names[which]
    check = stack.podman("inspect", name, "--format", "{{json .Config.Healthcheck.Test}}")
    assert "/health" in " ".join(json.loads(check.stdout))  # kept by --format docker
    assert stack.podman("healthcheck", "run", name, check=False).returncode == 0
    health = stack.podman("inspect", name, "--format", "{{.State.Health.Status}}")
    assert health.stdout.strip() == "healthy"


@pytest.mark.parametrize("dockerfile", BUILT.values())
def test_the_build_time_mounts_left_nothing_in_the_image(
    podman: Podman, images: dict[str, str], dockerfile: str
) -> None:
    def root_and_pip(image: str, pip: str) -> str:
        script = f"ls -A /root; {pip}"
        return podman(
            "run", "--rm", "--user", "0", "--entrypoint", "sh", image, "-c", script
        ).stdout

    base = root_and_pip(STAND_IN, "true")
    assert root_and_pip(images[dockerfile], "pip config list") == base  # no pip.conf, CA, wheels


def stream_through_sigterm(stack: Stack, signal_target: str) -> tuple[list[str], int]:
    """Stream a long completion through the gateway; SIGTERM `signal_target` once the first
    chunk arrived. (the stream's data lines, how many arrived after the signal was sent)"""
    body = stack.chat(max_tokens=400, ignore_eos=True, stream=True)
    url = stack.url("gateway") + "/v1/chat/completions"
    lines: list[str] = []
    sent_at = -1
    with httpx.stream("POST", url, json=body, headers=stack.auth, timeout=120) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: "):
                lines.append(line)
            if sent_at < 0 and lines:
                stack.podman("kill", "--signal", "TERM", stack.names[signal_target])
                sent_at = len(lines)
    return lines, len(lines) - sent_at


def assert_drained(stack: Stack, which: str, kill: Callable[[], tuple[list[str], int]]) -> None:
    lines, after = kill()
    assert lines[-1] == "data: [DONE]", lines[-3:]
    assert after > 10, f"only {after} chunks after SIGTERM: the stream was not in flight"
    last = json.loads(lines[-2].removeprefix("data: "))
    assert last["choices"][0]["finish_reason"] == "length", last  # every token, not cut short
    code = stack.podman("wait", stack.names[which], timeout=60).stdout.strip()
    assert code == "0", stack.podman("logs", stack.names[which]).stderr[-3000:]


def test_sigterm_drains_the_gateways_in_flight_stream(stack: Stack) -> None:
    try:
        assert_drained(stack, "gateway", lambda: stream_through_sigterm(stack, "gateway"))
    finally:
        stack.podman("start", stack.names["gateway"])
        wait_ready(stack)


def test_sigterm_drains_the_workers_in_flight_stream(stack: Stack) -> None:
    # Last: the worker's restart takes long, and no test after this one needs it.
    assert_drained(stack, "worker", lambda: stream_through_sigterm(stack, "worker"))
