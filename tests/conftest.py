"""Shared pytest fixtures. Helpers add fixtures here additively (see tests/fixtures/)."""

from __future__ import annotations

import collections
import os

import pytest

SHARED_NODE_IDS = pytest.StashKey[frozenset[str]]()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Tests that share a node id fail at setup in a pytest-xdist worker. schemathesis runs
    each operation of a parametrized test as a sub-report of one item, and xdist forwards
    only the item's own report: an operation failing there passed unseen (checked with an
    injected failure). Such modules are marked `serial`; make test runs them in a process
    of its own, after the rest."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return  # one process: every sub-report reaches the terminal
    counts = collections.Counter(item.nodeid for item in session.items)
    shared = frozenset(nodeid for nodeid, count in counts.items() if count > 1)
    session.config.stash[SHARED_NODE_IDS] = shared


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.nodeid in item.config.stash.get(SHARED_NODE_IDS, frozenset()):
        pytest.fail(
            "tests sharing a node id cannot run under pytest-xdist (a failure of theirs "
            'would be lost): deselect them with -m "not serial" and run them with '
            "-p no:xdist -m serial",
            pytrace=False,
        )


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """A tiny random target + DFlash drafter on disk (see tests/fixtures/tiny_models.py)."""
    from tests.fixtures.tiny_models import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-checkpoint"))


@pytest.fixture(scope="session")
def worker(tiny_checkpoint):  # type: ignore[no-untyped-def]
    """One DFlash worker shared by the tests that do not stop it (gateway and wire tests)."""
    from tests.fixtures.worker import running_worker
    from tests.service.conftest import worker_args

    with running_worker(*worker_args(tiny_checkpoint)) as handle:
        yield handle


@pytest.fixture(scope="session")
def gateway(worker):  # type: ignore[no-untyped-def]
    """A gateway in front of the shared worker."""
    from tests.service.conftest import running_gateway

    with running_gateway(workers=[worker.base_url]) as gw:
        yield gw


@pytest.fixture(scope="module")
def one_torch_thread():  # type: ignore[no-untyped-def]
    """Tiny ops on a shared 2-core CPU: intra-op threads only add contention. A module uses it
    with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
