"""What the dashboard and the alert rules ask Prometheus: their PromQL, and the metric names
it reads. Names come from a small lexer (strings, label matchers, ranges and grouping clauses
removed first), then promtool proves each expression parses."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
    "inf",
    "nan",
    "atan2",
    "le",
}
# Grafana variables, replaced by values that keep the expression valid PromQL.
GRAFANA_VARS = {
    "$__rate_interval": "1m",
    "$__interval": "15s",
    "$__range": "1h",
    "$namespace": ".*",
    "$job": ".*",
    "$model": ".*",
    "$worker": ".*",
    "$tenant": ".*",
    "${datasource}": "",
}

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_NUMBER_SUFFIX = re.compile(r"\b\d+(\.\d+)?(ms|s|m|h|d|w|y)?\b")


def substitute_grafana_vars(expr: str) -> str:
    for name, value in GRAFANA_VARS.items():
        expr = expr.replace(name, value)
    return expr


# A name selected in either spelling, `prefix:name` or `prefix_name` (escaped by an exporter).
_EITHER_SPELLING = re.compile(r'__name__=~"([a-z]+)\[:_\]([a-z0-9_]+)"')


def metric_names(expr: str) -> set[str]:
    """Metric names an expression reads (functions and keywords excluded); a name selected as
    `{__name__=~"a[:_]b"}` counts as `a:b`."""
    either = {f"{prefix}:{name}" for prefix, name in _EITHER_SPELLING.findall(expr)}
    text = _STRING.sub('""', substitute_grafana_vars(expr))
    text = _MATCHERS.sub(" ", text)
    text = _RANGE.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    text = _NUMBER_SUFFIX.sub(" ", text)
    names = set()
    for match in _IDENT.finditer(text):
        rest = text[match.end() :].lstrip()
        if rest.startswith("("):
            continue  # a function or an aggregation
        if match.group(0).lower() in KEYWORDS:
            continue
        names.add(match.group(0))
    return names | either


def dashboard_targets(path: Path) -> list[tuple[str, str]]:
    """(panel title, expr) of every query in a Grafana dashboard JSON."""
    dash: dict[str, Any] = json.loads(path.read_text())
    out = []
    for panel in _all_panels(dash["panels"]):
        for target in panel.get("targets", []):
            if target.get("expr"):
                out.append((panel["title"], target["expr"]))
    return out


def _all_panels(panels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    found = []
    for panel in panels:
        found.append(panel)
        found.extend(_all_panels(panel.get("panels", [])))
    return found


def rule_exprs(path: Path) -> list[tuple[str, str]]:
    """(record or alert name, expr) of every rule in a Prometheus rule file."""
    data = yaml.safe_load(path.read_text())
    return [
        (rule.get("record") or rule["alert"], rule["expr"])
        for group in data["groups"]
        for rule in group["rules"]
    ]


def recorded_names(path: Path) -> set[str]:
    data = yaml.safe_load(path.read_text())
    return {
        rule["record"] for group in data["groups"] for rule in group["rules"] if "record" in rule
    }


def as_rule_file(exprs: list[str]) -> str:
    """A rule file with one recording rule per expression, for `promtool check rules`."""
    rules = [
        {"record": f"dashboard:query_{i}", "expr": substitute_grafana_vars(e)}
        for i, e in enumerate(exprs)
    ]
    return yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}, sort_keys=False)


def exposition_names(text: str) -> set[str]:
    """Sample names in a Prometheus text exposition (`_bucket`, `_total`... included)."""
    names = set()
    for line in text.splitlines():
        if line and not line.startswith("#"):
            names.add(re.split(r"[{\s]", line, maxsplit=1)[0])
    return names
