"""The project's skeleton: import boundary, console scripts, README and CI wiring."""

from __future__ import annotations

import re
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gateway_import_leaves_torch_and_engine_out() -> None:
    code = (
        "import sys, service.app\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.split('.')[0] == 'engine')\n"
        "print(bad)\n"
        "raise SystemExit(1 if bad else 0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_console_scripts_are_installed() -> None:
    names = {ep.name for ep in entry_points(group="console_scripts")}
    expected = {"dflash-gateway", "dflash-worker", "dflash-serve", "dflash-bench", "dflash-train"}
    assert expected <= names
    for name in expected:
        assert (Path(sys.executable).parent / name).exists(), name


def test_readme_leads_with_the_two_commands() -> None:
    text = (ROOT / "README.md").read_text()
    first_commands = re.findall(r"^make \w+", text, flags=re.M)[:2]
    assert first_commands == ["make serve", "make test"]


def test_ci_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci
    # lint as a target of a make line (beside the environment installs, or alone)
    assert re.search(r"^make\b[^\n#]*\slint\b", ci, re.MULTILINE), ci


def test_no_environment_or_outside_link_is_tracked() -> None:
    """A fresh clone builds its own environments: a committed link to one (a helper's
    worktree linking main's) would shadow `make vllm-env` and break CI."""
    listed = subprocess.run(
        ["git", "ls-files", "-s"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    links = [line.split("\t", 1)[1] for line in listed if line.startswith("120000 ")]
    assert links == []
    names = [line.split("\t", 1)[1] for line in listed]
    assert [n for n in names if n.split("/")[0].startswith(".venv")] == []
