"""`make images` builds exactly the images the chart pulls: its dry run names the engine and
the references `helm template` renders, with the default registry and with the user's (through
the `--set` flags it prints). Building and running them: test_images_run.py."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.chart import ROOT, render

SCRIPT = ROOT / "scripts" / "images.py"


def dry_run(*args: str, engine: str = "docker") -> list[list[str]]:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, "CONTAINER_ENGINE": engine},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return [shlex.split(line, comments=False) for line in done.stdout.splitlines()]


def built(lines: list[list[str]], engine: str = "docker") -> dict[str, str]:
    """{Dockerfile: tag} of the build commands."""
    return {w[w.index("-f") + 1]: w[w.index("-t") + 1] for w in lines if w[:2] == [engine, "build"]}


def rendered_images(sets: tuple[str, ...] = ()) -> set[str]:
    images = set()
    for values in ((), ("values-embedded.yaml",)):
        for doc in render(values, sets):
            spec = doc.get("spec", {}).get("template", {}).get("spec", {})
            images |= {c["image"] for c in spec.get("containers", [])}
    return images


def test_make_images_names_exactly_the_charts_images() -> None:
    tags = built(dry_run())
    assert set(tags) == {
        "docker/gateway.Dockerfile",
        "docker/worker.Dockerfile",
        "docker/embedded.Dockerfile",
    }
    for dockerfile in tags:
        assert (ROOT / dockerfile).is_file()
    assert set(tags.values()) == rendered_images() - {"curlimages/curl"}, rendered_images()


def test_another_registry_and_the_flags_that_point_the_chart_at_it() -> None:
    lines = dry_run("--registry", "registry.example.com/ml", "--push")
    tags = built(lines)
    pushed = {w[2] for w in lines if w[:2] == ["docker", "push"]}
    assert lines[0] == ["#", "engine:", "docker", "(from", "CONTAINER_ENGINE)"]
    assert pushed == set(tags.values())
    assert all(tag.startswith("registry.example.com/ml/") for tag in tags.values())
    hint = next(w for w in lines if w[:2] == ["#", "then:"])
    sets = tuple(hint[i + 1] for i, w in enumerate(hint) if w == "--set")
    assert set(tags.values()) == rendered_images(sets) - {"curlimages/curl"}


def test_podman_builds_keep_the_healthcheck_and_read_each_ignore_file() -> None:
    lines = dry_run("--push", engine="podman")
    tags = built(lines, "podman")
    assert tags == built(dry_run())  # same Dockerfiles, same references
    for words in lines:
        if words[:2] == ["podman", "build"]:
            dockerfile = words[words.index("-f") + 1]
            assert words[words.index("--format") + 1] == "docker"  # OCI drops HEALTHCHECK
            ignore = words[words.index("--ignorefile") + 1]
            assert ignore == f"{dockerfile}.dockerignore" and (ROOT / ignore).is_file()
    assert {w[2] for w in lines if w[:2] == ["podman", "push"]} == set(tags.values())


def engine_line(path: Path, **env: str) -> str:
    """The first line `images.py --dry-run` prints with only `path` on PATH, or its error."""
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "gateway"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={"PATH": str(path), **env},
        check=False,
    )
    return (done.stdout or done.stderr).splitlines()[0 if done.returncode == 0 else -1]


@pytest.mark.parametrize(
    ("installed", "env", "expected"),
    [
        (("docker",), {}, "# engine: docker (found on PATH)"),
        (("docker", "podman"), {}, "# engine: podman (found on PATH)"),
        (("podman",), {"CONTAINER_ENGINE": "docker"}, "# engine: docker (from CONTAINER_ENGINE)"),
        (
            ("podman",),
            {"CONTAINER_ENGINE": "/x/podman"},
            "# engine: /x/podman (from CONTAINER_ENGINE)",
        ),
        ((), {"CONTAINER_ENGINE": "nerdctl"}, "choose podman or docker"),
        ((), {}, "no container engine: install podman or docker, or set CONTAINER_ENGINE"),
    ],
)
def test_the_engine_found_or_asked_for(
    tmp_path: Path, installed: tuple[str, ...], env: dict[str, str], expected: str
) -> None:
    for name in installed:
        (tmp_path / name).write_text("#!/bin/sh\nexit 0\n")
        (tmp_path / name).chmod(0o755)
    assert expected in engine_line(tmp_path, **env)


def test_make_images_runs_the_script() -> None:
    done = subprocess.run(
        ["make", "-s", "images", "DRY_RUN=1", "REGISTRY=r.example/x", "CONTAINER_ENGINE=docker"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("# engine: docker (from CONTAINER_ENGINE)\n"), done.stdout
    assert "docker build -f docker/gateway.Dockerfile -t r.example/x/gateway:" in done.stdout
