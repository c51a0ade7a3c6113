"""The Markdown files hold together: every relative link resolves, to a file and, where it
names one, to a heading of that file; the README stays a short front page."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 150
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", flags=re.M | re.S)


def markdown_files() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "*.md"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    return [ROOT / name for name in listed if (ROOT / name).exists()]


def anchors(doc: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+\s+(.*)$", FENCE.sub("", doc.read_text()), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def relative_links(doc: Path) -> list[str]:
    text = FENCE.sub("", doc.read_text())
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("doc", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(doc: Path) -> None:
    broken = []
    for target in relative_links(doc):
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in anchors(dest)):
            broken.append(target)
    assert broken == []


def test_the_docs_are_linked_from_the_readme() -> None:
    readme = (ROOT / "README.md").read_text()
    unlinked = [d.name for d in (ROOT / "docs").glob("*.md") if f"(docs/{d.name})" not in readme]
    assert unlinked == []


def test_the_readme_is_a_front_page() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= README_MAX_LINES


def test_no_document_outside_the_repository_is_cited() -> None:
    """Comments and docs cite files of this repository, never a design note it lacks."""
    cited = subprocess.run(
        ["git", "grep", "-n", "-I", "-E", r"DESIGN(\.md| §)"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    ).stdout
    assert cited == ""
