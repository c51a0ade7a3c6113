"""`make images` builds exactly the images the chart pulls: its dry run names the references
`helm template` renders, with the default registry and with the user's (through the `--set`
flags it prints)."""

from __future__ import annotations

import shlex
import subprocess
import sys

from tests.deploy.chart import ROOT, render

SCRIPT = ROOT / "scripts" / "images.py"


def dry_run(*args: str) -> list[list[str]]:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return [shlex.split(line, comments=False) for line in done.stdout.splitlines()]


def built(lines: list[list[str]]) -> dict[str, str]:
    """{Dockerfile: tag} of the docker build commands."""
    return {
        w[w.index("-f") + 1]: w[w.index("-t") + 1] for w in lines if w[:2] == ["docker", "build"]
    }


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
    assert pushed == set(tags.values())
    assert all(tag.startswith("registry.example.com/ml/") for tag in tags.values())
    hint = next(w for w in lines if w[:1] == ["#"])
    sets = tuple(hint[i + 1] for i, w in enumerate(hint) if w == "--set")
    assert set(tags.values()) == rendered_images(sets) - {"curlimages/curl"}


def test_make_images_runs_the_script() -> None:
    done = subprocess.run(
        ["make", "-s", "images", "DRY_RUN=1", "REGISTRY=r.example/x"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "docker build -f docker/gateway.Dockerfile -t r.example/x/gateway:" in done.stdout
