"""Deadlines of upstream bodies, enforced by one sweeper instead of a timer per read.

A relayed stream reads thousands of chunks; arming and disarming a timeout around each read
was a measurable share of the gateway's CPU. Here the relay loop only bumps a counter, and a
single task per gateway looks at every open body a few times per idle limit: a body that made
no progress for `idle_s`, or ran past its total deadline, gets a `TimeoutError` raised into
its reader (`set_exception` wakes the pending read). The same hook
cuts every open body when the gateway drains (`Draining`).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Protocol

MIN_TICK_S = 0.005  # a finer sweep would busy-loop for nothing


class Failable(Protocol):
    """A body reader whose pending and later reads can be made to raise."""

    def set_exception(self, exc: BaseException) -> None: ...


class Draining(Exception):
    """The gateway is shutting down and cut this body: not the worker's fault."""


@dataclass(slots=True, eq=False)
class Watch:
    """One upstream body. The relay makes `marks` odd while it writes to the client (a slow
    client is not an idle worker) and even again when it goes back to reading."""

    reader: Failable | None  # None until the request went out on a connection
    idle_s: float
    deadline: float  # loop time
    marks: int = 0
    seen: int = field(default=-1)
    progress_at: float = 0.0
    fired: BaseException | None = None

    def follow(self, reader: Failable) -> None:
        """Watch this reader from now on (the request went out on it; a retry on a fresh
        connection moves the watch along). A deadline already missed fails it at once."""
        self.reader = reader
        if self.fired is not None:
            reader.set_exception(self.fired)

    def fire(self, exc: BaseException) -> None:
        self.fired = exc
        if self.reader is not None:
            self.reader.set_exception(exc)


class Watchdog:
    def __init__(self, tick_s: float) -> None:
        self.tick_s = max(MIN_TICK_S, tick_s)
        self._watches: set[Watch] = set()
        self._task: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self._watches)

    def add(self, reader: Failable | None, idle_s: float, deadline: float) -> Watch:
        watch = Watch(reader, idle_s, deadline)
        watch.progress_at = asyncio.get_running_loop().time()
        self._watches.add(watch)
        if self._task is None:
            # Runs while something is watched, so no task outlives the last request.
            self._task = asyncio.get_running_loop().create_task(self._sweep())
        return watch

    def discard(self, watch: Watch) -> None:
        self._watches.discard(watch)

    def cut_all(self) -> int:
        """Raise `Draining` into every open body; returns how many were cut."""
        cut = list(self._watches)
        self._watches.clear()
        for watch in cut:
            watch.fire(Draining("the gateway is shutting down"))
        return len(cut)

    async def _sweep(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._watches:
                await asyncio.sleep(self.tick_s)
                now = loop.time()
                for watch in list(self._watches):
                    why = self._overdue(watch, now)
                    if why:
                        self._watches.discard(watch)
                        watch.fire(TimeoutError(why))
        finally:
            self._task = None

    @staticmethod
    def _overdue(watch: Watch, now: float) -> str:
        if now >= watch.deadline:
            return "the request ran past its total deadline"
        if watch.marks != watch.seen or watch.marks & 1:
            watch.seen, watch.progress_at = watch.marks, now
            return ""
        if now - watch.progress_at >= watch.idle_s:
            return "the worker sent nothing within the idle limit"
        return ""

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
