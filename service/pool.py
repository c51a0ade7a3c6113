"""The worker pool: membership (static URLs, DNS re-resolution), health, and routing."""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import hashlib
import logging
import math
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx

from service.metrics import GatewayMetrics
from service.settings import GatewaySettings

log = logging.getLogger("dflash.gateway.pool")


def worker_id(url: str) -> str:
    """A stable, opaque name for a worker: the same on every gateway replica (alerts group by
    it), without the internal address (which the logs map to it when the worker joins)."""
    return "w-" + hashlib.blake2b(url.encode(), digest_size=4).hexdigest()


@dataclass
class Worker:
    url: str
    label: str = ""  # the `worker` label of its metrics: worker_id(url), or the URL itself
    healthy: bool = False
    outstanding: int = 0
    waiting: float = 0.0  # the worker's own vllm:num_requests_waiting, from its /metrics
    # Distinct requests that failed on it since its last success: one request (one client
    # retrying the same poison input under new ids is still many) counts once at most.
    failed_requests: set[int] = field(default_factory=set)
    ejected_until: float = 0.0
    models: list[dict[str, Any]] = field(default_factory=list)
    model_ids: frozenset[str] = frozenset()

    @property
    def failures(self) -> int:
        return len(self.failed_requests)

    def routable(self, now: float) -> bool:
        return self.healthy and now >= self.ejected_until

    def serves(self, model: str) -> bool:
        # A worker whose model list is not known yet may serve anything.
        return not self.model_ids or model in self.model_ids


def _point(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class HashRing:
    """Consistent hashing with bounded load (each worker holds `replicas` ring points)."""

    def __init__(self, urls: Iterable[str], replicas: int) -> None:
        self.urls = tuple(sorted(urls))
        pairs = sorted((_point(f"{url}#{i}"), url) for url in self.urls for i in range(replicas))
        self._points = [p for p, _ in pairs]
        self._owners = [u for _, u in pairs]

    def walk(self, key: str) -> list[str]:
        """Distinct workers clockwise from the key's point: the preference order."""
        if not self._points:
            return []
        start = bisect.bisect(self._points, _point(key))
        order: list[str] = []
        for i in range(len(self._owners)):
            url = self._owners[(start + i) % len(self._owners)]
            if url not in order:
                order.append(url)
                if len(order) == len(self.urls):
                    break
        return order


def parse_waiting(exposition: str) -> float:
    """Sum of `vllm:num_requests_waiting` samples in a Prometheus text exposition."""
    total = 0.0
    for line in exposition.splitlines():
        if line.startswith("vllm:num_requests_waiting"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name == "vllm:num_requests_waiting":
                rest = line[line.index("}") + 1 :] if "}" in line else line[len(name) :]
                with contextlib.suppress(ValueError, IndexError):
                    total += float(rest.split()[0])
    return total


class WorkerPool:
    """Tracks workers and picks one per attempt; background tasks keep membership and health."""

    def __init__(
        self, settings: GatewaySettings, client: httpx.AsyncClient, metrics: GatewayMetrics
    ) -> None:
        self._settings = settings
        self._client = client
        self._metrics = metrics
        self.workers: dict[str, Worker] = {url: self._new_worker(url) for url in settings.workers}
        self._tasks: list[asyncio.Task[None]] = []
        self._ring: HashRing | None = None
        self._turn = 0
        # routable() runs several times per request: cached until health changes
        # (`invalidate`) or the earliest ejection ends.
        self._routable: list[Worker] | None = None
        self._routable_until = 0.0

    def _new_worker(self, url: str) -> Worker:
        label = url if self._settings.metrics_worker_label == "url" else worker_id(url)
        log.info("worker %s is %s in metrics", url, label)
        return Worker(url, label)

    async def start(self) -> None:
        """First discovery and health round before serving, then the background loops."""
        if self._settings.worker_dns:
            await self.resolve_dns()
        await self.check_all()
        self._tasks.append(
            asyncio.create_task(self._every(self._settings.health_interval_s, self.check_all))
        )
        if self._settings.worker_dns:
            self._tasks.append(
                asyncio.create_task(self._every(self._settings.dns_interval_s, self.resolve_dns))
            )

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()

    async def _every(self, interval: float, job: Any) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await job()
            except Exception:  # a background loop must outlive any one bad round
                log.exception("pool background job failed")

    # -- membership ---------------------------------------------------------------------
    async def resolve_dns(self) -> None:
        """Re-resolve NAME:PORT; addresses that appeared join, those that went leave."""
        assert self._settings.worker_dns is not None
        host, _, port = self._settings.worker_dns.rpartition(":")
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(
                host, int(port), type=socket.SOCK_STREAM
            )
        except OSError as exc:
            log.warning("DNS lookup of %s failed: %s (keeping the current pool)", host, exc)
            return
        found = set()
        for family, _, _, _, sockaddr in infos:
            ip = str(sockaddr[0])
            found.add(
                f"http://[{ip}]:{port}" if family == socket.AF_INET6 else f"http://{ip}:{port}"
            )
        found |= set(self._settings.workers)
        for url in found - self.workers.keys():
            log.info("worker %s joined the pool", url)
            self.workers[url] = self._new_worker(url)
            self.invalidate()
            await self.check(self.workers[url])
        for url in self.workers.keys() - found:
            log.info("worker %s left the pool", url)
            gone = self.workers.pop(url)
            self.invalidate()
            self._metrics.set_worker_health(gone.label, None)

    # -- health -------------------------------------------------------------------------
    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(w) for w in list(self.workers.values())))

    async def check(self, worker: Worker) -> None:
        """Active check: /health decides; /metrics and /v1/models refresh load and models."""
        timeout = self._settings.health_timeout_s
        try:
            reply = await self._client.get(f"{worker.url}/health", timeout=timeout)
            healthy = reply.status_code == 200
        except httpx.HTTPError:
            healthy = False
        if healthy:
            await asyncio.gather(self._scrape_load(worker), self._scrape_models(worker))
        if healthy != worker.healthy:
            log.info("worker %s is %s", worker.url, "healthy" if healthy else "unhealthy")
            self.invalidate()
        worker.healthy = healthy
        self._publish(worker)

    async def _scrape_load(self, worker: Worker) -> None:
        try:
            reply = await self._client.get(
                f"{worker.url}/metrics", timeout=self._settings.health_timeout_s
            )
            if reply.status_code == 200:
                worker.waiting = parse_waiting(reply.text)
        except httpx.HTTPError:
            pass  # load is a tie-breaker only; /health decides health

    async def _scrape_models(self, worker: Worker) -> None:
        try:
            reply = await self._client.get(
                f"{worker.url}/v1/models", timeout=self._settings.health_timeout_s
            )
            data = reply.json().get("data") if reply.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            return
        if isinstance(data, list):
            worker.models = [
                m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)
            ]
            worker.model_ids = frozenset(m["id"] for m in worker.models)

    def _publish(self, worker: Worker) -> None:
        if worker.url in self.workers:
            self._metrics.set_worker_health(worker.label, worker.routable(time.monotonic()))

    # -- passive health -----------------------------------------------------------------
    def report_success(self, worker: Worker) -> None:
        worker.failed_requests.clear()

    def report_failure(
        self, worker: Worker, kind: str, request: int, *, counts: bool = True
    ) -> None:
        """A failed attempt of request number `request` (a gateway serial, never the client's
        id). `counts` is False for what says nothing about the worker's health: its 503
        (overload) and its 4xx. Ejection needs `eject_after_failures` distinct requests,
        and never takes out the last routable worker (a panic threshold: with one worker
        left, a bad worker beats no worker, and the active check still decides)."""
        self._metrics.upstream_errors.labels(worker.label, kind).inc()
        if not counts:
            return
        worker.failed_requests.add(request)
        if worker.failures < self._settings.eject_after_failures:
            return
        now = time.monotonic()
        if not any(w is not worker and w.routable(now) for w in self.workers.values()):
            log.warning(
                "not ejecting worker %s after %d failed requests (%s): it is the last "
                "routable worker",
                worker.url,
                worker.failures,
                kind,
            )
            return
        log.warning(
            "ejecting worker %s after %d failed requests (%s)", worker.url, worker.failures, kind
        )
        worker.failed_requests.clear()
        worker.healthy = False  # back only when an active check passes after the cool-down
        worker.ejected_until = now + self._settings.eject_cooldown_s
        self.invalidate()
        self._publish(worker)

    # -- routing ------------------------------------------------------------------------
    def invalidate(self) -> None:
        """Health or membership changed: recompute the routable set on next use."""
        self._routable = None

    def routable(self) -> list[Worker]:
        now = time.monotonic()
        if self._routable is None or now >= self._routable_until:
            workers = self.workers.values()
            self._routable = [w for w in workers if w.routable(now)]
            pending = [w.ejected_until for w in workers if w.healthy and w.ejected_until > now]
            self._routable_until = min(pending, default=math.inf)
        return self._routable

    def models(self) -> list[dict[str, Any]]:
        """Union of the model lists of the routable workers, first seen wins."""
        seen: dict[str, dict[str, Any]] = {}
        for worker in self.routable():
            for model in worker.models:
                seen.setdefault(model["id"], model)
        return list(seen.values())

    def knows_model(self, model: str) -> bool:
        return any(w.serves(model) for w in self.routable())

    def lists_model(self, model: str) -> bool:
        """A routable worker names the model in its /v1/models (a bounded metrics label)."""
        return any(model in w.model_ids for w in self.routable())

    def pick(self, model: str, key: str | None, exclude: set[str]) -> Worker | None:
        """The worker for the next attempt, or None when no routable one is left."""
        candidates = [w for w in self.routable() if w.url not in exclude and w.serves(model)]
        if not candidates:
            return None
        if self._settings.routing == "prefix_affinity" and key is not None:
            return self._by_affinity(candidates, key)
        return self._least_outstanding(candidates)

    def _least_outstanding(self, candidates: list[Worker]) -> Worker:
        # Rotate the start so that exact ties (an idle pool) still spread requests.
        self._turn += 1
        start = self._turn % len(candidates)
        rotated = candidates[start:] + candidates[:start]
        return min(rotated, key=lambda w: (w.outstanding, w.waiting))

    def _by_affinity(self, candidates: list[Worker], key: str) -> Worker:
        """First worker clockwise from the key whose load stays under the bound:
        ceil(load_factor * (in flight + 1) / workers) (consistent hashing, bounded loads)."""
        by_url = {w.url: w for w in candidates}
        if self._ring is None or self._ring.urls != tuple(sorted(by_url)):
            self._ring = HashRing(by_url, self._settings.affinity_replicas)
        total = sum(w.outstanding for w in candidates) + 1
        bound = math.ceil(self._settings.affinity_load_factor * total / len(candidates))
        order = [by_url[url] for url in self._ring.walk(key)]
        for worker in order:
            if worker.outstanding + 1 <= bound:
                return worker
        return order[0]
