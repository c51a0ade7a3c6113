"""The layers of ARCHITECTURE.md, enforced: who may import whom, and a test module for every
module (tests mirror the packages)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("service", "wire", "engine", "launcher", "loadtest")
MAX_CLASS_LINES = 250
WEB = {"fastapi", "starlette", "uvicorn", "aiohttp", "httpx", "prometheus_client"}


def _modules(package: str) -> list[Path]:
    return sorted(p for p in (ROOT / package).rglob("*.py") if p.name != "__init__.py")


def _imports(path: Path) -> set[str]:
    """Top-level names of every module `path` imports (lazy imports inside functions too)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _core(path: Path) -> bool:
    rel = path.relative_to(ROOT / "engine").parts
    return rel[0] not in {"worker", "train"}


@pytest.mark.parametrize("path", [p for p in _modules("engine") if _core(p)], ids=lambda p: p.name)
def test_engine_core_imports_no_web_framework_and_no_gateway(path: Path) -> None:
    bad = {m for m in _imports(path) if m.split(".")[0] in WEB | {"service", "wire"}}
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_engine_control_side_holds_no_tensors() -> None:
    for name in ("engine.py", "scheduler.py", "sequence.py", "errors.py", "config.py"):
        roots = {m.split(".")[0] for m in _imports(ROOT / "engine" / name)}
        assert "torch" not in roots, name


@pytest.mark.parametrize("path", _modules("service"), ids=lambda p: p.name)
def test_gateway_never_imports_the_engine_or_torch(path: Path) -> None:
    bad = {m for m in _imports(path) if m.split(".")[0] in {"engine", "torch", "launcher"}}
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


@pytest.mark.parametrize("path", _modules("wire"), ids=lambda p: p.name)
def test_shared_plumbing_imports_neither_side(path: Path) -> None:
    """wire/ is what the gateway and the worker share: it may import neither of them."""
    bad = {
        m for m in _imports(path) if m.split(".")[0] in {"service", "engine", "launcher", "torch"}
    }
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


@pytest.mark.parametrize("path", _modules("engine/worker"), ids=lambda p: p.name)
def test_worker_never_imports_the_gateway(path: Path) -> None:
    """The worker shares the gateway's plumbing through wire/, never the gateway package."""
    bad = {m for m in _imports(path) if m.split(".")[0] in {"service", "launcher"}}
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


@pytest.mark.parametrize("path", _modules("launcher"), ids=lambda p: p.name)
def test_launcher_starts_workers_as_processes_only(path: Path) -> None:
    """dflash-serve runs in the gateway's install (no torch): workers are processes to it."""
    bad = {m for m in _imports(path) if m.split(".")[0] in {"engine", "torch", "loadtest"}}
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def _classes() -> list[tuple[str, int]]:
    found = []
    for package in PACKAGES:
        for path in _modules(package):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ClassDef):
                    assert node.end_lineno is not None
                    name = f"{path.relative_to(ROOT)}:{node.name}"
                    found.append((name, node.end_lineno - node.lineno + 1))
    return found


def test_no_class_is_longer_than_a_few_screens() -> None:
    assert [(name, n) for name, n in _classes() if n > MAX_CLASS_LINES] == []


def test_importing_the_engine_core_loads_no_web_framework() -> None:
    code = (
        "import sys, engine.async_engine\n"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {sorted(WEB)!r})\n"
        "print(bad)\n"
        "raise SystemExit(1 if bad else 0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _needs_test(path: Path) -> bool:
    # The training recipe's stages are driven end to end by tests/engine/train/test_stages.py.
    return "train" not in path.relative_to(ROOT).parts or path.parent.name != "train"


@pytest.mark.parametrize(
    "path",
    [
        p
        for pkg in ("service", "wire", "engine", "launcher")
        for p in _modules(pkg)
        if _needs_test(p)
    ],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_every_module_has_a_same_named_test_module(path: Path) -> None:
    rel = path.relative_to(ROOT)
    expected = ROOT / "tests" / rel.parent / f"test_{rel.name}"
    assert expected.exists(), f"{rel} has no {expected.relative_to(ROOT)}"


def _project_modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in _modules(package):
            found[".".join(path.relative_to(ROOT).with_suffix("").parts)] = path
    return found


def _imported(path: Path) -> set[str]:
    """_imports, plus `from package import module` as package.module."""
    names = _imports(path)
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_no_module_imports_itself_back() -> None:
    """No import cycles among the project's modules, lazy and TYPE_CHECKING imports included:
    a cycle means two modules that cannot be read (or tested) one without the other."""
    modules = _project_modules()
    graph = {name: _imported(path) & modules.keys() for name, path in modules.items()}
    cycles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for target in sorted(graph[name]):
            if state.get(target) == 1:
                cycles.append(" -> ".join([*path[path.index(target) :], target]))
            elif target not in state:
                visit(target, [*path, target])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert cycles == []
