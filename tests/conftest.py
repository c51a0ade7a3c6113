"""Shared pytest fixtures. Helpers add fixtures here additively (see tests/fixtures/)."""

from __future__ import annotations

import pytest


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
