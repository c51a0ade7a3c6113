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
