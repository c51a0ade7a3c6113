"""Shared pytest fixtures. Helpers add fixtures here additively (see tests/fixtures/)."""

from __future__ import annotations

import pytest


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
