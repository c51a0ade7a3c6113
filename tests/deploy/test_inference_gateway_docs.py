"""docs/inference-gateway.md runs as written, as far as it can here: every command of its bash
blocks is one this test knows and checks (an unknown one fails), and its YAML validates.

- `helm install` of the chart: rendered with `helm template` and linted with `helm lint
  --strict` with the same flags, by the real helm;
- `kubectl apply -f` of the CRDs and `helm install` of upstream's body-based router: the
  release, chart and values are upstream's at the fixture's release (no network to fetch
  them here);
- `kubectl get` and `helm test`: their namespace and release are the installed ones, the
  resources exist in what the install renders;
- the Gateways in its YAML blocks: valid against Gateway API v1.5.1's CRD (converted)."""

from __future__ import annotations

import json
import re
import shlex
from typing import Any

import jsonschema
import pytest
import yaml

from tests.deploy.chart import ROOT, helm
from tests.deploy.test_install_commands import namespace, shell_commands

DOC = ROOT / "docs" / "inference-gateway.md"
FIXTURES = ROOT / "tests" / "fixtures" / "inference-extension"
EPP = json.loads((FIXTURES / "epp-v1.5.0.json").read_text())
RELEASE = EPP["source"]["release"]
CRDS = (
    "https://github.com/kubernetes-sigs/gateway-api-inference-extension/releases/download/"
    f"{RELEASE}/manifests.yaml"
)
BBR_CHART = "oci://registry.k8s.io/gateway-api-inference-extension/charts/body-based-routing"
COMMANDS = shell_commands(DOC)
INSTALLS = {(namespace(w), w[2]): w for w in COMMANDS if w[:3] == ["helm", "install", "dflash"]}


def flag_values(words: list[str], flag: str) -> list[str]:
    return [words[i + 1] for i, w in enumerate(words[:-1]) if w == flag]


def rendered(ns: str) -> list[dict[str, Any]]:
    words = INSTALLS[(ns, "dflash")]
    flags = [w for w in words[4:] if w != "--create-namespace"]
    proc = helm("template", words[2], words[3], *flags, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def test_the_doc_has_its_commands() -> None:
    kinds = {" ".join(w[:2]) for w in COMMANDS}
    assert kinds == {"kubectl apply", "helm install", "kubectl -n", "helm test"}
    assert len(INSTALLS) == 2


@pytest.mark.parametrize("words", COMMANDS, ids=[shlex.join(w)[:60] for w in COMMANDS])
def test_every_command_is_known_and_right(words: list[str]) -> None:
    if words[:2] == ["kubectl", "apply"]:
        assert words[2:] == ["-f", CRDS]
    elif words[:3] == ["helm", "install", "body-based-router"]:
        assert words[3] == BBR_CHART and flag_values(words, "--version") == [RELEASE]
        sets = dict(s.split("=", 1) for s in flag_values(words, "--set"))
        assert set(sets) <= set(EPP["body_based_routing"]["values"])
        assert sets["provider.name"] in EPP["body_based_routing"]["providers"]
    elif words[:3] == ["helm", "install", "dflash"]:
        assert words[3] == "helm/dflash-serving" and "--create-namespace" in words
        lint_flags = [
            f for flag in ("-f", "--set") for v in flag_values(words, flag) for f in (flag, v)
        ]
        linted = helm("lint", "--strict", words[3], *lint_flags, cwd=ROOT)
        assert linted.returncode == 0, linted.stdout + linted.stderr
        assert [d for d in rendered(namespace(words) or "") if d["kind"] == "InferencePool"]
    elif words[:2] == ["kubectl", "-n"]:
        assert words[3] == "get"
        kinds = {d["kind"].lower() + "s" for d in rendered(words[2])}
        assert set(words[4].split(",")) <= kinds
    elif words[:2] == ["helm", "test"]:
        assert (namespace(words), words[2]) in INSTALLS
        pods = [d for d in rendered(namespace(words) or "") if d["kind"] == "Pod"]
        assert any(p["metadata"]["name"].endswith("-test-inference") for p in pods)
    else:
        pytest.fail(f"a command this test does not check: {shlex.join(words)}")


def test_the_docs_gateways_validate_against_the_gateway_api_crd() -> None:
    schema = json.loads((FIXTURES / "gateway-gateway-v1.json").read_text())
    blocks = re.findall(r"^```yaml\n(.*?)^```", DOC.read_text(), flags=re.M | re.S)
    gateways = [yaml.safe_load(b) for b in blocks]
    assert [g["kind"] for g in gateways] == ["Gateway", "Gateway"]
    for gateway in gateways:
        jsonschema.validate(gateway, schema)
    # The examples' routes attach to these Gateways.
    refs = {(g["metadata"]["namespace"], g["metadata"]["name"]) for g in gateways}
    for ns in {ns for ns, _ in INSTALLS}:
        (route,) = [d for d in rendered(ns) if d["kind"] == "HTTPRoute"]
        assert {(p["namespace"], p["name"]) for p in route["spec"]["parentRefs"]} <= refs


def test_the_body_based_router_goes_where_the_gke_gateway_is() -> None:
    (bbr,) = [w for w in COMMANDS if w[:3] == ["helm", "install", "body-based-router"]]
    sets = dict(s.split("=", 1) for s in flag_values(bbr, "--set"))
    gke = rendered("llm")
    (route,) = [d for d in gke if d["kind"] == "HTTPRoute"]
    (parent,) = route["spec"]["parentRefs"]
    assert namespace(bbr) == parent["namespace"]
    assert sets["inferenceGateway.name"] == parent["name"]
