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
from service.routing.engines import WIRES, Wire
from service.routing.fastest import fastest_pool, speed_map
from service.routing.promotion import Promotions
from service.routing.split import SmoothWeighted, pool_of
from service.settings import DEFAULT_POOL, GatewaySettings, PoolSpec

log = logging.getLogger("dflash.gateway.pool")


def worker_id(url: str) -> str:
    """A stable, opaque name for a worker: the same on every gateway replica (alerts group by
    it), without the internal address (which the logs map to it when the worker joins)."""
    return "w-" + hashlib.blake2b(url.encode(), digest_size=4).hexdigest()


@dataclass(frozen=True)
class LoadMark:
    """A worker's load integral at a request's start (Worker.admit)."""

    area: float
    at: float
    mixed: float = 0.0  # the worker's mixed_area for the request's class


@dataclass
class Worker:
    url: str
    label: str = ""  # the `worker` label of its metrics: worker_id(url), or the URL itself
    pool: str = DEFAULT_POOL  # the name of its pool (the `pool` label)
    pool_model: str | None = None  # the one model its pool serves; None: what it lists
    healthy: bool = False
    outstanding: int = 0
    waiting: float = 0.0  # its engine's queue length, from its Prometheus endpoint
    wire: Wire = WIRES["vllm"]  # its pool's engine (service/routing/engines.py)
    # Distinct requests that failed on it since its last success: one request (one client
    # retrying the same poison input under new ids is still many) counts once at most.
    failed_requests: set[int] = field(default_factory=set)
    ejected_until: float = 0.0
    models: list[dict[str, Any]] = field(default_factory=list)
    model_ids: frozenset[str] = frozenset()
    # Requests x seconds in flight on it (the integral of `outstanding` up to `load_at`): the
    # load a request ran at is this area's growth over its lifetime (`ran_at`).
    load_area: float = 0.0
    load_at: float = 0.0
    # Requests in flight here by class (promotion's request_class): ROUTING=fastest reads
    # whether a pool already holds a request its class is not at home on.
    in_flight_by_class: dict[str, int] = field(default_factory=dict)
    # Per class seen here, seconds a request of another class was in flight (up to
    # `load_at`): how much of a request's life it shared the worker with another class
    # (`mixed_since`), which ROUTING=fastest reads a class's harm from.
    mixed_area: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.pool_header = (b"x-dflash-pool", self.pool.encode())

    def admit(self, klass: str = "") -> LoadMark:
        """One more request (of `klass`) in flight here; its mark, for `ran_at` when it ends."""
        now = self._accrue()
        self.outstanding += 1
        self.in_flight_by_class[klass] = self.in_flight_by_class.get(klass, 0) + 1
        return LoadMark(self.load_area, now, self.mixed_area.setdefault(klass, 0.0))

    def release(self, klass: str = "") -> None:
        self._accrue()
        self.outstanding -= 1
        left = self.in_flight_by_class.pop(klass, 0) - 1
        if left > 0:
            self.in_flight_by_class[klass] = left

    def ran_at(self, mark: LoadMark) -> float:
        """The mean number of requests in flight here since `mark` (its own included), over
        time. Not the count at its end: a greedy request that shared a DFlash batch with a
        sampled one that left before it ended ran slowed, at 2, not alone (issue 47)."""
        now = self._accrue()
        if now <= mark.at:
            return float(max(self.outstanding, 1))
        return max(1.0, (self.load_area - mark.area) / (now - mark.at))

    def mixed_since(self, mark: LoadMark, klass: str) -> float:
        """The share of the time since `mark` that a request of a class other than `klass`
        was in flight here (issue 47: a sampled row keeps a DFlash batch's greedy rows
        plain)."""
        now = self._accrue()
        if now <= mark.at:
            return float(self.outstanding > self.in_flight_by_class.get(klass, 0))
        return min(1.0, (self.mixed_area.get(klass, 0.0) - mark.mixed) / (now - mark.at))

    def _accrue(self) -> float:
        now = time.monotonic()
        elapsed = now - self.load_at
        self.load_area += self.outstanding * elapsed
        for klass, area in self.mixed_area.items():
            if self.outstanding > self.in_flight_by_class.get(klass, 0):
                self.mixed_area[klass] = area + elapsed
        self.load_at = now
        return now

    @property
    def failures(self) -> int:
        return len(self.failed_requests)

    def routable(self, now: float) -> bool:
        return self.healthy and now >= self.ejected_until

    def serves(self, model: str) -> bool:
        # A worker whose model list is not known yet may serve anything its pool serves.
        if self.pool_model is not None and model != self.pool_model:
            return False
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


def parse_waiting(exposition: str, series: str = "vllm:num_requests_waiting") -> float:
    """Sum of a series' samples (an engine's queue length) in a Prometheus text exposition."""
    total = 0.0
    for line in exposition.splitlines():
        if line.startswith(series):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name == series:
                rest = line[line.index("}") + 1 :] if "}" in line else line[len(name) :]
                with contextlib.suppress(ValueError, IndexError):
                    total += float(rest.split()[0])
    return total


async def scrape_load(client: httpx.AsyncClient, worker: Worker, limit_s: float) -> None:
    """The worker's queue (vllm:num_requests_waiting, or its engine's): a tie-breaker of
    routing only."""
    wire = worker.wire
    try:
        reply = await client.get(f"{worker.url}{wire.metrics_path}", timeout=limit_s)
        if reply.status_code == 200:
            worker.waiting = parse_waiting(reply.text, wire.waiting_series)
    except httpx.HTTPError:
        pass  # /health decides health


async def scrape_models(client: httpx.AsyncClient, worker: Worker, limit_s: float) -> None:
    """The models the worker lists (its /v1/models cards, passed on by the gateway's)."""
    try:
        reply = await client.get(f"{worker.url}/v1/models", timeout=limit_s)
        data = reply.json().get("data") if reply.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return
    if isinstance(data, list):
        worker.models = [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
        worker.model_ids = frozenset(m["id"] for m in worker.models)


async def lookup(target: str) -> set[str] | None:
    """The worker URLs NAME:PORT resolves to; None when the lookup fails."""
    host, _, port = target.rpartition(":")
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(
            host, int(port), type=socket.SOCK_STREAM
        )
    except OSError as exc:
        log.warning("DNS lookup of %s failed: %s (keeping the current pool)", host, exc)
        return None
    found = set()
    for family, _, _, _, sockaddr in infos:
        ip = str(sockaddr[0])
        found.add(f"http://[{ip}]:{port}" if family == socket.AF_INET6 else f"http://{ip}:{port}")
    return found


def least_outstanding(candidates: list[Worker], turn: int) -> Worker:
    """The worker with the fewest requests in flight (then waiting); the start rotates with
    `turn`, so that exact ties (an idle pool) still spread requests."""
    start = turn % len(candidates)
    rotated = candidates[start:] + candidates[:start]
    return min(rotated, key=lambda w: (w.outstanding, w.waiting))


class WorkerFleet:
    """Tracks workers and picks one per attempt; background tasks keep membership and health."""

    def __init__(
        self, settings: GatewaySettings, client: httpx.AsyncClient, metrics: GatewayMetrics
    ) -> None:
        self._settings = settings
        self._client = client
        self._metrics = metrics
        self.specs = {spec.name: spec for spec in settings.pool_specs()}
        self.weights = {name: spec.weight for name, spec in self.specs.items()}
        self._configured = frozenset(spec.model for spec in self.specs.values() if spec.model)
        for spec in self.specs.values():
            metrics.describe_pool(spec.model or "", spec.name, spec.weight, spec.gpus_per_worker)
        self.workers: dict[str, Worker] = {
            url: self._new_worker(url, spec) for spec in self.specs.values() for url in spec.workers
        }
        self._tasks: list[asyncio.Task[None]] = []
        self._rings: dict[str, HashRing] = {}  # per pool
        self._turns: dict[str, SmoothWeighted] = {}  # per model: the weighted split's state
        self.promotions: Promotions | None = None  # canaries' rollouts (routing/promotion.py)
        self.speeds = speed_map(settings)  # ROUTING=fastest's (routing/fastest.py)
        self._turn = 0
        # routable() runs several times per request: cached until health changes
        # (`invalidate`) or the earliest ejection ends.
        self._routable: list[Worker] | None = None
        self._routable_until = 0.0

    def _new_worker(self, url: str, spec: PoolSpec) -> Worker:
        label = url if self._settings.metrics_worker_label == "url" else worker_id(url)
        log.info("worker %s of pool %s is %s in metrics", url, spec.name, label)
        wire = WIRES[spec.engine]
        return Worker(url, label, pool=spec.name, pool_model=spec.model, wire=wire)

    async def start(self) -> None:
        """First discovery and health round before serving, then the background loops."""
        await self.resolve_dns()
        await self.check_all()
        self._tasks.append(
            asyncio.create_task(self._every(self._settings.health_interval_s, self.check_all))
        )
        if any(spec.worker_dns for spec in self.specs.values()):
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
        """Re-resolve each pool's NAME:PORT; addresses that appeared join, those that went
        leave. A lookup that fails keeps that pool as it is."""
        for spec in self.specs.values():
            if spec.worker_dns:
                found = await lookup(spec.worker_dns)
                if found is not None:
                    await self._settle(spec, found | set(spec.workers))

    async def _settle(self, spec: PoolSpec, found: set[str]) -> None:
        mine = {url for url, w in self.workers.items() if w.pool == spec.name}
        for url in found - self.workers.keys():
            log.info("worker %s joined pool %s", url, spec.name)
            self.workers[url] = self._new_worker(url, spec)
            self.invalidate()
            await self.check(self.workers[url])
        for url in mine - found:
            log.info("worker %s left pool %s", url, spec.name)
            gone = self.workers.pop(url)
            self.invalidate()
            self._metrics.set_worker_health(gone.label, gone.pool, None)

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
            await asyncio.gather(
                scrape_load(self._client, worker, timeout),
                scrape_models(self._client, worker, timeout),
            )
        if healthy != worker.healthy:
            log.info("worker %s is %s", worker.url, "healthy" if healthy else "unhealthy")
            self.invalidate()
        worker.healthy = healthy
        self._publish(worker)

    def _publish(self, worker: Worker) -> None:
        if worker.url in self.workers:
            healthy = worker.routable(time.monotonic())
            self._metrics.set_worker_health(worker.label, worker.pool, healthy)

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
        if self.promotions is not None:
            self.promotions.failed(worker.pool)
        worker.failed_requests.add(request)
        if worker.failures < self._settings.eject_after_failures:
            return
        now = time.monotonic()
        stand_ins = (w for w in self.workers.values() if w is not worker and w.routable(now))
        if not any(self._stands_in(w, worker) for w in stand_ins):
            log.warning(
                "not ejecting worker %s after %d failed requests (%s): it is the last "
                "routable worker of its model",
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

    def _stands_in(self, other: Worker, worker: Worker) -> bool:
        """`other` can take `worker`'s requests: same pool, or a pool of the same model."""
        return other.pool == worker.pool or (
            worker.pool_model is not None and other.pool_model == worker.pool_model
        )

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

    def engines(self) -> set[str]:
        """The engines of the routable workers (their pools')."""
        return {self.specs[w.pool].engine for w in self.routable()}

    def model_names(self) -> list[str]:
        """What a client may ask for: the models served now, then configured ones that are
        down (a pool's model is a name from configuration, so also a bounded label)."""
        names = [str(card["id"]) for card in self.models()]
        names += sorted(self._configured)
        return list(dict.fromkeys(names))

    def configures(self, model: str) -> bool:
        return model in self._configured

    def knows_model(self, model: str) -> bool:
        return any(w.serves(model) for w in self.routable())

    def lists_model(self, model: str) -> bool:
        """A routable worker names the model in its /v1/models (a bounded metrics label)."""
        return any(model in w.model_ids for w in self.routable())

    def pick(
        self, model: str, key: str | None, exclude: set[str], klass: str = ""
    ) -> Worker | None:
        """The worker for the next attempt, or None when no routable one is left (`fastest`:
        the pool expected fastest for `klass`, then prefix affinity within it)."""
        candidates = [w for w in self.routable() if w.url not in exclude and w.serves(model)]
        if not candidates:
            return None
        if len(self.specs) > 1:
            candidates = self._one_pool(model, candidates, key, klass)
        if self._settings.routing != "least_outstanding" and key is not None:
            return self._by_affinity(candidates, key)
        self._turn += 1
        return least_outstanding(candidates, self._turn)

    def _one_pool(
        self, model: str, candidates: list[Worker], key: str | None, klass: str
    ) -> list[Worker]:
        """The candidates of the pool the weighted split (or `fastest`) picks."""
        offered = list(dict.fromkeys(w.pool for w in candidates))
        if len(offered) == 1:
            return candidates
        affinity = key if self._settings.routing == "prefix_affinity" else None
        if self.speeds is None:
            chosen = pool_of(model, offered, self.weights, affinity, self._turns)
        else:
            weights = {pool: self.weights[pool] for pool in offered}
            chosen = fastest_pool(self.speeds, klass, candidates, weights)
        return [w for w in candidates if w.pool == chosen]

    def _by_affinity(self, candidates: list[Worker], key: str) -> Worker:
        """First worker clockwise from the key whose load stays under the bound:
        ceil(load_factor * (in flight + 1) / workers) (consistent hashing, bounded loads)."""
        by_url = {w.url: w for w in candidates}
        pool = candidates[0].pool
        ring = self._rings.get(pool)
        if ring is None or ring.urls != tuple(sorted(by_url)):
            ring = self._rings[pool] = HashRing(by_url, self._settings.affinity_replicas)
        total = sum(w.outstanding for w in candidates) + 1
        bound = math.ceil(self._settings.affinity_load_factor * total / len(candidates))
        order = [by_url[url] for url in ring.walk(key)]
        for worker in order:
            if worker.outstanding + 1 <= bound:
                return worker
        return order[0]
