"""Build (and push) the images the Helm chart pulls, under exactly the names and tags it uses.

    python scripts/images.py [--registry REGISTRY] [--push] [--dry-run] [gateway worker embedded]

The names come from the chart itself (helm/dflash-serving/values.yaml repositories, tag =
Chart.yaml appVersion), so `make images` and the chart cannot drift apart. `--registry`
replaces `ghcr.io/dflash-serving` with yours and prints the `--set` flags that point the
chart at it. `--dry-run` prints the docker commands instead of running them. Nothing is
published under ghcr.io/dflash-serving: build and push to a registry your cluster can pull.
"""

from __future__ import annotations

import argparse
import shlex
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


def commands(names: list[str], registry: str | None, push: bool) -> list[list[str]]:
    refs = chart_references()
    out: list[list[str]] = []
    for name in names:
        ref = retarget(refs[name], registry)
        out.append(["docker", "build", "-f", IMAGES[name][1], "-t", ref, "."])
        if push:
            out.append(["docker", "push", ref])
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
    p.add_argument("--push", action="store_true", help="docker push each image after building")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = p.parse_args(argv)
    names = args.names or list(IMAGES)
    unknown = [name for name in names if name not in IMAGES]
    if unknown:
        p.error(f"unknown image {unknown[0]!r}: choose from {', '.join(IMAGES)}")
    for command in commands(names, args.registry, args.push):
        print(shlex.join(command), flush=True)
        if not args.dry_run:
            subprocess.run(command, cwd=ROOT, check=True)
    flags = helm_flags(names, args.registry)
    if flags:
        print(f"# then: helm install ... {shlex.join(flags)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
