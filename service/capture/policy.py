"""Which requests are captured: a share per tenant (the key file's `capture:`) times a share
per pool (the pools file's `capture:`), with the gateway's `capture_uri` set."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Annotated

from pydantic import BeforeValidator

from service.capture.record import RawCapture
from service.capture.writer import CaptureWriter


def share(value: object) -> object:
    """`true` / `false` or a fraction in [0, 1] (a sampling rate)."""
    if isinstance(value, bool):
        return 1.0 if value else 0.0
    if isinstance(value, int | float) and not 0 <= value <= 1:
        raise ValueError("capture must be true, false or a fraction between 0 and 1")
    return value


# The `capture:` of a tenant or a pool.
CaptureShare = Annotated[float, BeforeValidator(share)]


class Capture:
    """The gateway's capture: who is sampled, and the writer the samples go to."""

    def __init__(
        self,
        writer: CaptureWriter,
        pool_shares: dict[str, float],
        draw: Callable[[], float] = random.random,
    ) -> None:
        self.writer, self._pool_shares, self._draw = writer, pool_shares, draw

    def wants(self, tenant_share: float, pool: str) -> bool:
        """Whether to capture a request of this tenant served by this pool (a pool the
        settings do not name, one found by DNS alone, captures fully)."""
        rate = tenant_share * self._pool_shares.get(pool, 1.0)
        return rate >= 1.0 or (rate > 0.0 and self._draw() < rate)

    def offer(self, raw: RawCapture) -> None:
        """Hand one served request to the writer (never blocks; a drop is counted)."""
        self.writer.offer(raw)
