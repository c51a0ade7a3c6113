"""generate.py's pieces that need no engine: leaving clients, aborted requests."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from engine.sequence import RequestMetrics, RequestOutput
from engine.worker.generate import ClientGone, finish_reason, guard_disconnect
from wire.errors import Unavailable


class _Request:
    """The one method guard_disconnect uses: `receive`, which reports a disconnect."""

    def __init__(self, leave_after: float) -> None:
        self.leave_after = leave_after

    async def receive(self) -> dict[str, Any]:
        await asyncio.sleep(self.leave_after)
        return {"type": "http.disconnect"}


@pytest.mark.anyio
async def test_work_done_first_is_returned() -> None:
    async def work() -> int:
        return 7

    assert await guard_disconnect(_Request(10.0), work()) == 7  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_a_leaving_client_cancels_the_work() -> None:
    cancelled = asyncio.Event()

    async def work() -> int:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return 1

    with pytest.raises(ClientGone):
        await guard_disconnect(_Request(0.01), work())  # type: ignore[arg-type]
    assert cancelled.is_set()


@pytest.mark.anyio
async def test_a_leaving_client_cancels_a_gather_of_choices() -> None:
    """`collect` passes a gather, which a cancel ends with an exception, not as cancelled:
    still ClientGone (a CancelledError escaped to the server's log before)."""

    async def choice() -> int:
        await asyncio.sleep(10)
        return 1

    work = asyncio.gather(choice(), choice())
    with pytest.raises(ClientGone):
        await guard_disconnect(_Request(0.01), work)  # type: ignore[arg-type]


def _output(reason: str | None) -> RequestOutput:
    return RequestOutput(
        request_id="r",
        text_delta="",
        token_ids_delta=[],
        finished=True,
        finish_reason=reason,
        num_prompt_tokens=1,
        num_output_tokens=0,
        metrics=RequestMetrics(arrival_time=0.0),
    )  # type: ignore[arg-type]


def test_finish_reasons() -> None:
    assert finish_reason(_output("stop")) == "stop"
    for reason in ("abort", None):
        with pytest.raises(Unavailable) as err:
            finish_reason(_output(reason))
        assert err.value.code == "aborted"
