"""The gateway and embedded-worker images that test_images_run runs, built from the real
Dockerfiles with the commands `make images` prints for podman, in the private store and with
the stand-in base and build-time home of tests/deploy/podman.py.

`python -m tests.deploy.images` builds them ahead of the suite: CI and `make envs` run it beside
the environments' installs, which mostly wait on downloads, so that the test finds images whose
key (every input of the build) is current and does not build them itself. A build that fails
there is reported by the test, which builds again: this entry point never fails the setup."""

from __future__ import annotations

import hashlib
import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from tests.deploy.chart import ROOT
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
from tests.deploy.test_docker import instructions

BUILT = {"gateway": "docker/gateway.Dockerfile", "embedded": "docker/embedded.Dockerfile"}


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


def prepare(podman: Podman) -> dict[str, str]:
    """{Dockerfile: the reference built}, each image current."""
    ensure_stand_in(podman)
    commands = make_images_commands()
    build(podman, commands, build_home(podman))
    return {c[c.index("-f") + 1]: c[c.index("-t") + 1] for c in commands}


def main() -> int:
    podman = private_podman()
    reason = why_no_engine(podman)
    if reason is not None:
        print(f"images for the tests: none built ({reason})")
        return 0
    try:
        built = prepare(podman)
    except (AssertionError, RuntimeError, OSError, subprocess.SubprocessError) as exc:
        print(f"images for the tests: the build failed, test_images_run builds again:\n{exc}")
        return 0
    print(f"images for the tests: {', '.join(built.values())} current")
    return 0


if __name__ == "__main__":
    sys.exit(main())
