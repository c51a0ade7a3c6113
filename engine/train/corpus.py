"""The training corpus: the Python standard library's own source code.

Every machine with Python has it, so the recipe needs no download. Selection is
deterministic: sorted relative paths filtered by fixed rules. A fixed set of held-out
modules is never trained on; evaluation prompts (acceptance length, engine benchmark,
tests) come from it only.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

# Directories skipped anywhere in a path: tests, GUI/demo code, vendored or generated data.
EXCLUDED_DIRS = frozenset(
    {
        "__pycache__",
        "test",
        "tests",
        "idlelib",
        "lib2to3",
        "tkinter",
        "turtledemo",
        "site-packages",
        "dist-packages",
        "lib-dynload",
        "encodings",  # codec tables: mostly generated hex literals
        "pydoc_data",  # one huge generated dict of help texts
        "ensurepip",
    }
)
# Files larger than this are generated tables or outliers (e.g. _pydecimal.py).
MAX_FILE_BYTES = 160_000
MIN_FILE_BYTES = 200

# Held-out modules (top-level name: a module file or a package directory). Chosen as
# ordinary, self-contained library code of the kind a coding assistant completes.
HELDOUT_MODULES = (
    "bisect",
    "colorsys",
    "csv",
    "fractions",
    "graphlib",
    "heapq",
    "json",
    "queue",
    "sched",
    "shlex",
    "statistics",
    "string",
    "textwrap",
)


@dataclass(frozen=True)
class CorpusConfig:
    """Where the corpus comes from; `root=None` means this interpreter's stdlib."""

    root: Path | None = None
    max_files: int | None = None  # smoke runs: the first N training files only

    def stdlib_root(self) -> Path:
        return self.root if self.root is not None else Path(sysconfig.get_paths()["stdlib"])


def top_level_name(rel: Path) -> str:
    """`json/decoder.py` -> `json`; `csv.py` -> `csv`."""
    first = rel.parts[0]
    return first[:-3] if first.endswith(".py") else first


def _eligible(rel: Path, size: int) -> bool:
    if any(part in EXCLUDED_DIRS or part.startswith("config-") for part in rel.parts[:-1]):
        return False
    if rel.name.startswith("_sysconfigdata"):
        return False
    return MIN_FILE_BYTES <= size <= MAX_FILE_BYTES


def _all_files(root: Path) -> list[Path]:
    """Eligible source files as sorted paths relative to `root`."""
    rels = sorted(p.relative_to(root) for p in root.rglob("*.py") if p.is_file())
    return [rel for rel in rels if _eligible(rel, (root / rel).stat().st_size)]


def training_files(config: CorpusConfig) -> list[Path]:
    """Absolute paths of the training files, in a fixed order; held-out modules excluded."""
    root = config.stdlib_root()
    rels = [rel for rel in _all_files(root) if top_level_name(rel) not in HELDOUT_MODULES]
    if config.max_files is not None:
        rels = rels[: config.max_files]
    return [root / rel for rel in rels]


def heldout_files(config: CorpusConfig) -> list[Path]:
    """Absolute paths of the held-out evaluation files, in a fixed order."""
    root = config.stdlib_root()
    return [root / rel for rel in _all_files(root) if top_level_name(rel) in HELDOUT_MODULES]


def read_text(path: Path) -> str:
    """File text with tabs expanded and trailing whitespace trimmed (stable tokenization)."""
    raw = path.read_text(encoding="utf-8", errors="replace")
    lines = [line.rstrip().expandtabs(4) for line in raw.splitlines()]
    return "\n".join(lines).strip("\n") + "\n"


def read_documents(paths: list[Path]) -> list[str]:
    return [read_text(p) for p in paths]


def _prompt_ends(text: str) -> list[int]:
    """Offsets just after each `def`/`class` line: natural points to ask for a completion."""
    ends: list[int] = []
    offset = 0
    for line in text.splitlines(keepends=True):
        offset += len(line)
        stripped = line.lstrip()
        if stripped.startswith(("def ", "class ")) and line.rstrip().endswith(":"):
            ends.append(offset)
    return ends


def _prompt_at(text: str, end: int, max_chars: int) -> str:
    """The code before `end`, at most `max_chars`, starting on a line boundary."""
    start = max(0, end - max_chars)
    if start > 0:
        newline = text.find("\n", start)
        start = newline + 1 if 0 <= newline < end else start
    return text[start:end].lstrip("\n")


def heldout_prompts(
    n: int, *, max_chars: int = 600, config: CorpusConfig | None = None
) -> list[str]:
    """`n` deterministic code prompts from held-out modules (never trained on).

    Each prompt is up to `max_chars` of source ending right after a `def ...:` or
    `class ...:` line, so the natural continuation is the body. Candidates from all
    held-out files are taken evenly spaced, so prompts cover many modules.
    """
    if n < 1:
        return []
    candidates: list[tuple[str, int]] = []
    for path in heldout_files(config or CorpusConfig()):
        text = read_text(path)
        candidates.extend((text, end) for end in _prompt_ends(text))
    if not candidates:
        raise ValueError("no held-out prompts found in the corpus root")
    step = len(candidates) / min(n, len(candidates))
    picks = [candidates[int(i * step)] for i in range(min(n, len(candidates)))]
    prompts = [_prompt_at(text, end, max_chars) for text, end in picks]
    # More prompts than candidates: cycle with shorter windows (still deterministic).
    while len(prompts) < n:
        text, end = candidates[len(prompts) % len(candidates)]
        prompts.append(_prompt_at(text, end, max_chars // 2))
    return prompts
