"""Every install command of the READMEs, run as written against the real helm: each `helm
install` line is rendered with `helm template` and linted with `helm lint --strict` with the
same flags, and the commands agree on one namespace that the install creates."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from tests.deploy.chart import ROOT, helm

DOCS = (
    ROOT / "README.md",
    # docs/inference-gateway.md also installs upstream's CRDs and charts (cluster-wide, in
    # their own namespaces): tests/deploy/test_inference_gateway_docs.py runs its commands.
    *sorted(d for d in (ROOT / "docs").glob("*.md") if d.name != "inference-gateway.md"),
    ROOT / "helm" / "dflash-serving" / "README.md",
)


def shell_commands(doc: Path) -> list[list[str]]:
    """The commands of a document's bash blocks: continuations joined, comments dropped."""
    commands: list[list[str]] = []
    for block in re.findall(r"^```bash\n(.*?)^```", doc.read_text(), flags=re.M | re.S):
        pending = ""
        for line in block.replace("\\\n", " ").splitlines():
            pending += line + "\n"
            try:  # a quoted argument may span lines (the README's curl body)
                words = shlex.split(pending, comments=True)
            except ValueError:
                continue
            pending = ""
            if words:
                commands.append(words)
    return commands


def namespace(words: list[str]) -> str | None:
    for i, word in enumerate(words):
        if word in ("-n", "--namespace"):
            return words[i + 1]
        if word.startswith("--namespace="):
            return word.split("=", 1)[1]
    return None


HELM_COMMANDS = [
    (doc.relative_to(ROOT).as_posix(), words)
    for doc in DOCS
    for words in shell_commands(doc)
    if words[0] in ("helm", "kubectl")
]
INSTALLS = [(doc, words) for doc, words in HELM_COMMANDS if words[:2] == ["helm", "install"]]


def test_the_docs_have_install_commands() -> None:
    assert len(INSTALLS) >= 5


@pytest.mark.parametrize(("doc", "words"), INSTALLS, ids=[" ".join(w[3:]) for _, w in INSTALLS])
def test_an_install_command_renders_and_lints(doc: str, words: list[str]) -> None:
    assert "--create-namespace" in words, f"{doc}: {shlex.join(words)} needs --create-namespace"
    assert namespace(words) is not None, f"{doc}: {shlex.join(words)} names no namespace"
    flags = [w for w in words[4:] if w != "--create-namespace"]
    release, chart = words[2], words[3]
    rendered = helm("template", release, chart, *flags, cwd=ROOT)
    assert rendered.returncode == 0, rendered.stderr
    assert f".{namespace(words)}.svc" in rendered.stdout  # the workers' DNS name
    lint_flags: list[str] = []
    for i, word in enumerate(flags):
        if i and flags[i - 1] in ("-f", "--set"):
            lint_flags += [flags[i - 1], word]
    assert lint_flags, "an install command with no values"
    linted = helm("lint", "--strict", chart, *lint_flags, cwd=ROOT)
    assert linted.returncode == 0, linted.stdout + linted.stderr


def test_every_command_of_a_doc_uses_the_namespace_its_installs_create() -> None:
    for doc in {d for d, _ in HELM_COMMANDS}:
        commands = [w for d, w in HELM_COMMANDS if d == doc]
        created = {namespace(w) for w in commands if w[:2] == ["helm", "install"]}
        created |= {w[3] for w in commands if w[:3] == ["kubectl", "create", "namespace"]}
        for words in commands:
            if words[:3] == ["kubectl", "create", "namespace"]:
                continue
            assert namespace(words) in created, f"{doc}: {shlex.join(words)}"
