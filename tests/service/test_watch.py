"""The watchdog: idle and total deadlines raised into a body reader, a slow client not taken
for an idle worker, and the drain's cut."""

from __future__ import annotations

import asyncio

import pytest

from service.watch import Draining, Watchdog

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Reader:
    def __init__(self) -> None:
        self.raised: BaseException | None = None

    def set_exception(self, exc: BaseException) -> None:
        self.raised = exc


async def test_an_idle_body_times_out_and_progress_defers_it() -> None:
    dog = Watchdog(0.01)
    loop = asyncio.get_running_loop()
    idle, busy = Reader(), Reader()
    dog.add(idle, idle_s=0.1, deadline=loop.time() + 60)
    watch = dog.add(busy, idle_s=0.1, deadline=loop.time() + 60)
    for _ in range(20):  # 0.2 s of reads every 10 ms
        watch.marks += 2
        await asyncio.sleep(0.01)
    assert isinstance(idle.raised, TimeoutError) and busy.raised is None
    dog.discard(watch)
    await dog.close()


async def test_writing_to_a_slow_client_is_not_idleness() -> None:
    dog = Watchdog(0.01)
    reader = Reader()
    watch = dog.add(reader, idle_s=0.05, deadline=asyncio.get_running_loop().time() + 60)
    watch.marks += 1  # odd: blocked in send() to the client
    await asyncio.sleep(0.2)
    assert reader.raised is None
    dog.discard(watch)
    await dog.close()


async def test_the_total_deadline_holds_whatever_the_progress() -> None:
    dog = Watchdog(0.01)
    reader = Reader()
    watch = dog.add(reader, idle_s=10, deadline=asyncio.get_running_loop().time() + 0.05)
    for _ in range(20):
        watch.marks += 2
        await asyncio.sleep(0.01)
    assert isinstance(reader.raised, TimeoutError)
    await dog.close()


async def test_cut_all_raises_draining_into_every_open_body() -> None:
    dog = Watchdog(1.0)
    readers = [Reader() for _ in range(3)]
    for reader in readers:
        dog.add(reader, idle_s=10, deadline=asyncio.get_running_loop().time() + 60)
    assert dog.cut_all() == 3 and len(dog) == 0
    assert all(isinstance(r.raised, Draining) for r in readers)
    await dog.close()
