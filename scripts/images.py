"""Build (and push) the images the Helm chart pulls, under exactly the names and tags it uses.

    python scripts/images.py [--engine podman|docker] [--registry REGISTRY] [--push] [--dry-run]
                             [gateway worker embedded]

The names come from the chart itself (helm/dflash-serving/values.yaml repositories, tag =
Chart.yaml appVersion), so `make images` and the chart cannot drift apart. `--registry`
replaces `ghcr.io/dflash-serving` with yours and prints the `--set` flags that point the
chart at it. `--dry-run` prints the engine and its commands instead of running them. Nothing
is published under ghcr.io/dflash-serving: build and push to a registry your cluster can pull.

The engine is `--engine`, else $CONTAINER_ENGINE, else podman or docker, whichever is on PATH
(podman first: where both are installed, `docker` is often podman's own shim).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "dflash-serving"
# image -> (its values key, its Dockerfile)
IMAGES = {
    "gateway": ("gateway", "docker/gateway.Dockerfile"),
    "worker": ("worker", "docker/worker.Dockerfile"),
    "embedded": ("embedded", "docker/embedded.Dockerfile"),
}
ENGINES = ("podman", "docker")


def find_engine(asked: str | None, env: dict[str, str]) -> tuple[str, str]:
    """(engine, why it was chosen). `asked` and $CONTAINER_ENGINE may name a path."""
    for given, source in ((asked, "--engine"), (env.get("CONTAINER_ENGINE"), "CONTAINER_ENGINE")):
        if given:
            if Path(given).name not in ENGINES:
                raise ValueError(f"{source}={given!r}: choose podman or docker")
            return given, f"from {source}"
    for engine in ENGINES:
        if shutil.which(engine, path=env.get("PATH")):
            return engine, "found on PATH"
    raise ValueError("no container engine: install podman or docker, or set CONTAINER_ENGINE")


def chart_references() -> dict[str, str]:
    """Each image's repository:tag as the chart renders it with its default values."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    refs = {}
    for name, (key, _) in IMAGES.items():
        image = values[key]["image"]
        refs[name] = f"{image['repository']}:{image['tag'] or version}"
    return refs


def retarget(ref: str, registry: str | None) -> str:
    if registry is None:
        return ref
    name = ref.rsplit("/", 1)[1]
    return f"{registry.rstrip('/')}/{name}"


def build_command(engine: str, name: str, ref: str) -> list[str]:
    dockerfile = IMAGES[name][1]
    flags = ["-f", dockerfile, "-t", ref]
    if Path(engine).name == "podman":
        # Docker's BuildKit reads <Dockerfile>.dockerignore by itself; podman 4 is told. Its
        # default OCI format drops HEALTHCHECK, which `docker run`/`podman run` use.
        flags = ["--format", "docker", "--ignorefile", f"{dockerfile}.dockerignore", *flags]
    return [engine, "build", *flags, "."]


def commands(
    names: list[str], registry: str | None, push: bool, engine: str = "docker"
) -> list[list[str]]:
    refs = chart_references()
    out: list[list[str]] = []
    for name in names:
        ref = retarget(refs[name], registry)
        out.append(build_command(engine, name, ref))
        if push:
            out.append([engine, "push", ref])
    return out


def helm_flags(names: list[str], registry: str | None) -> list[str]:
    """The `--set` flags that make the chart pull these images (none for the defaults)."""
    if registry is None:
        return []
    refs = chart_references()
    flags = []
    for name in names:
        repository = retarget(refs[name], registry).rsplit(":", 1)[0]
        flags += ["--set", f"{IMAGES[name][0]}.image.repository={repository}"]
    return flags


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="make images", description=__doc__.splitlines()[0])
    p.add_argument(
        "names", nargs="*", metavar="IMAGE", help=f"any of {', '.join(IMAGES)} (default: all)"
    )
    p.add_argument("--registry", help="e.g. registry.example.com/ml (default: the chart's)")
    p.add_argument("--engine", help="podman or docker (default: $CONTAINER_ENGINE, else found)")
    p.add_argument("--push", action="store_true", help="push each image after building")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = p.parse_args(argv)
    names = args.names or list(IMAGES)
    unknown = [name for name in names if name not in IMAGES]
    if unknown:
        p.error(f"unknown image {unknown[0]!r}: choose from {', '.join(IMAGES)}")
    try:
        engine, why = find_engine(args.engine, dict(os.environ))
    except ValueError as exc:
        p.error(str(exc))
    print(f"# engine: {engine} ({why})", flush=True)
    for command in commands(names, args.registry, args.push, engine):
        print(shlex.join(command), flush=True)
        if not args.dry_run:
            subprocess.run(command, cwd=ROOT, check=True)
    flags = helm_flags(names, args.registry)
    if flags:
        print(f"# then: helm install ... {shlex.join(flags)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
