"""Every value of the chart is documented in its README, and every documented value exists."""

from __future__ import annotations

import re
from typing import Any

import yaml

from tests.deploy.chart import CHART


def leaf_paths(node: Any, prefix: str = "") -> set[str]:
    if isinstance(node, dict) and node:
        paths: set[str] = set()
        for key, value in node.items():
            paths |= leaf_paths(value, f"{prefix}.{key}" if prefix else str(key))
        return paths
    return {prefix}


def documented() -> set[str]:
    readme = (CHART / "README.md").read_text().split("\n## Values\n", 1)[1]
    return set(re.findall(r"^\| `([A-Za-z0-9_.]+)` \|", readme, re.M))


def test_every_value_is_documented() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    docs = documented()
    missing = []
    for path in leaf_paths(values):
        parts = path.split(".")
        prefixes = {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
        if not prefixes & docs:  # a documented map covers its entries (e.g. resources)
            missing.append(path)
    assert missing == []


def test_every_documented_value_exists() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for path in documented():
        node = values
        for part in path.split("."):
            assert isinstance(node, dict) and part in node, path
            node = node[part]
