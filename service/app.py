"""Gateway application factory: `create_app(settings)`."""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api import (
    ADMIN_POOLS_PATH,
    ADMIN_USAGE_PATH,
    MODEL_LABEL_KEY,
    PROXY_ENDPOINTS,
    REQUEST_ID_KEY,
    STARTED_KEY,
    TENANT_KEY,
    TRACE_KEY,
    TRACEPARENT_KEY,
    GatewayState,
    Runtime,
    proxy_endpoint,
    router,
)
from service.capture.policy import Capture
from service.capture.writer import OUTCOMES, CaptureWriter
from service.metrics import GatewayMetrics, code_label
from service.openapi import served_openapi
from service.proxy import CLIENT_CLOSED, Proxy
from service.routing.fleet import WorkerFleet
from service.routing.promotion import Promotions, Rollout, rollouts_of
from service.routing.promotion_store import SharedPromotions
from service.routing.upstream import ConnectionPool
from service.settings import GatewaySettings
from service.tenancy.auth import ApiKeyAuth, KeyFileWatcher
from service.tenancy.ledger import Ledger, MemoryLedger
from service.tenancy.limits import RateLimiter
from service.tenancy.redis_client import RedisAddress, RedisClient, tls_context
from service.tenancy.redis_ledger import RedisLedger
from service.tenancy.response_store import (
    MemoryResponseStore,
    RedisResponseStore,
    ResponseStore,
)
from service.tenancy.tenants import KeyRing, Tenant
from service.tracing import RequestTrace, begin_trace
from wire.capture import redact_uri
from wire.errors import (
    ApiError,
    AuthenticationFailed,
    InternalError,
    install_handlers,
    render,
)
from wire.http import client_request_id
from wire.tracing import GATEWAY_SERVICE, open_tracing

if TYPE_CHECKING:
    from wire.otel import Tracing

log = logging.getLogger("dflash.gateway")
STORE_DEADLINE_S = 2.0  # a stored response's read or write in Redis

# Probes, scrapes and the API docs are not client requests: they stay out of
# dflash_requests_total (a kubelet's probes would outnumber the traffic of a quiet gateway).
UNCOUNTED_PATHS = frozenset({"/health", "/ready", "/metrics", "/docs", "/redoc", "/openapi.json"})
COUNTED_PATHS = frozenset(
    {path for path, _ in PROXY_ENDPOINTS}
    | {"/tokenize", "/detokenize", "/v1/models", "/version", ADMIN_USAGE_PATH, ADMIN_POOLS_PATH}
)


def endpoint_label(path: str) -> str:
    """A bounded `endpoint` label: a route of the API, or "other" (a 404's path is the
    client's to choose)."""
    if path in COUNTED_PATHS:
        return path
    if path.startswith("/v1/responses/"):
        return "/v1/responses/{id}"
    if path.startswith(ADMIN_POOLS_PATH + "/"):
        return ADMIN_POOLS_PATH + "/{pool}"
    return "/v1/models/{model}" if path.startswith("/v1/models/") else "other"


class RequestContext:
    """Pure ASGI wrapper around the whole FastAPI app (outside its middleware, so the hot path
    pays for none of it): request id in and out, arrival time, the API-key check, and a
    direct path to the two proxy endpoints (FastAPI's router stays for everything else and
    for the OpenAPI schema)."""

    def __init__(
        self,
        app: ASGIApp,
        auth: ApiKeyAuth,
        metrics: GatewayMetrics,
        tracing: Tracing | None = None,
    ) -> None:
        self.app, self.auth, self.metrics, self.tracing = app, auth, metrics, tracing
        self.fast = {path: schema for path, schema in PROXY_ENDPOINTS}

    def identified(self, scope: Scope) -> bool:
        """The key is known; with tenants configured, its tenant goes into the scope."""
        trace: RequestTrace | None = scope.get(TRACE_KEY)
        started = time.time_ns() if trace is not None else 0
        tenant = self.auth.identify(scope["headers"])
        tenancy = self.auth.ring.tenancy
        if tenant is not None and tenancy:
            scope[TENANT_KEY] = tenant
        if trace is not None:
            name = tenant.name if tenant is not None and tenancy else None
            trace.authenticated(started, name, tenant is not None)
        return tenant is not None

    def count(self, scope: Scope, status: int, error: ApiError | None = None) -> None:
        """A response the gateway answered itself (a proxied one counts itself)."""
        code = code_label(error.code, error.error_type) if error is not None else None
        trace: RequestTrace | None = scope.get(TRACE_KEY)
        if trace is not None:
            trace.error_code = code
        model = scope.get(MODEL_LABEL_KEY, "unknown")
        self.metrics.count_response(model, endpoint_label(scope["path"]), status, code)
        tenant: Tenant | None = scope.get(TENANT_KEY)
        if tenant is not None and scope["path"] in self.fast:
            self.metrics.count_tenant(tenant.name, model, status)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.tracing is not None and scope["path"] not in UNCOUNTED_PATHS:
            await self.traced(self.tracing, scope, receive, send)
            return
        await self.handle(scope, receive, send)

    async def traced(self, tracing: Tracing, scope: Scope, receive: Receive, send: Send) -> None:
        """The request under its server span (docs/tracing.md). A request the sampler left out
        only passes its context on, so the worker makes the same choice."""
        route = endpoint_label(scope["path"])
        trace = begin_trace(tracing, scope["method"], route, scope["headers"])
        if isinstance(trace, bytes):
            scope[TRACEPARENT_KEY] = trace
            await self.handle(scope, receive, send)
            return
        scope[TRACE_KEY] = trace
        try:
            await self.handle(scope, receive, send)
        finally:
            trace.end()

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope[STARTED_KEY] = time.perf_counter()
        request_id = client_request_id(scope["headers"]) or secrets.token_hex(16)
        scope[REQUEST_ID_KEY] = request_id
        rid = request_id.encode()
        # A traced request's status: the gateway's own answers go through send_with_id, a
        # proxied one is set by the proxy (which sends without a wrapper per message).
        trace: RequestTrace | None = scope.get(TRACE_KEY)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid)]
                if trace is not None:
                    trace.status = message["status"]
            await send(message)

        if self.auth.protects(scope["path"]) and not self.identified(scope):
            error = AuthenticationFailed()
            response = render(error, extra={"WWW-Authenticate": "Bearer"})
            await response(scope, receive, send_with_id)
            if scope["path"] not in UNCOUNTED_PATHS:
                self.count(scope, error.status_code, error)
            return
        schema = self.fast.get(scope["path"])
        if schema is not None and scope["method"] == "POST":
            await self.proxy(schema, scope, receive, send, send_with_id)
            return
        if scope["path"] in UNCOUNTED_PATHS:
            await self.app(scope, receive, send_with_id)
            return
        await self.counted(scope, receive, send_with_id)

    async def counted(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The rest of the API (models, tokenize, unknown paths, wrong methods), counted by
        the status it sent; an error's code is read back from its OpenAI body."""
        sent: dict[str, Any] = {}

        async def watch(message: Message) -> None:
            if message["type"] == "http.response.start":
                sent["status"] = message["status"]
            elif message["type"] == "http.response.body" and sent.get("status", 200) >= 400:
                sent["body"] = sent.get("body", b"") + message.get("body", b"")
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            # A request routed to a worker (/tokenize) was counted by the proxy.
            if MODEL_LABEL_KEY not in scope:
                status = sent.get("status", CLIENT_CLOSED)
                code = error_code(sent.get("body", b"")) if status >= 400 else None
                self.metrics.count_response("unknown", endpoint_label(scope["path"]), status, code)

    async def proxy(
        self, schema: type[Any], scope: Scope, receive: Receive, send: Send, send_with_id: Send
    ) -> None:
        """The hot path without router, middleware and dependency machinery: same handler,
        same errors. The proxy writes the X-Request-Id header itself (no wrapper per send)."""
        try:
            response: Response = await proxy_endpoint(
                Request(scope, receive), schema, scope["path"]
            )
        except ApiError as error:
            await render(error)(scope, receive, send_with_id)
            self.count(scope, error.status_code, error)
            return
        except Exception:  # outside FastAPI's handlers here: the same 500 they would give
            log.exception("request %s: unexpected error", scope[REQUEST_ID_KEY])
            internal = InternalError("internal error; see the server log")
            await render(internal)(scope, receive, send_with_id)
            self.count(scope, internal.status_code, internal)
            return
        await response(scope, receive, send)


def error_code(body: bytes) -> str:
    """The `code` (else `type`) of an OpenAI error body the app rendered, as a label."""
    try:
        error = json.loads(body)["error"]
        return code_label(error.get("code"), str(error.get("type") or "error"))
    except (ValueError, KeyError, TypeError, AttributeError):
        return "other"


def outermost(
    app: FastAPI, auth: ApiKeyAuth, metrics: GatewayMetrics, tracing: Tracing | None
) -> None:
    """Put RequestContext around FastAPI's whole middleware stack (add_middleware would put
    it inside the error and exception middleware, which then wrap every relayed chunk)."""
    build = app.build_middleware_stack
    app.build_middleware_stack = lambda: RequestContext(build(), auth, metrics, tracing)  # type: ignore[method-assign]


def upstream_pool(settings: GatewaySettings) -> ConnectionPool:
    """The request path's client. Only the TCP connect has a timeout here: the proxy applies
    first-byte, idle-stream and whole-request deadlines itself."""
    return ConnectionPool(
        connect_timeout_s=settings.connect_timeout_s,
        headers=worker_headers(settings),
        max_idle=settings.max_upstream_connections,
        keepalive_s=settings.upstream_keepalive_s,
    )


def worker_headers(settings: GatewaySettings) -> dict[str, str]:
    # identity: bodies are relayed (and parsed for metrics) as they come; an encoded one
    # would reach the client without its Content-Encoding.
    key = settings.worker_api_key
    headers = {"Accept-Encoding": "identity"}
    return {**headers, "Authorization": f"Bearer {key}"} if key else headers


def upstream_client(settings: GatewaySettings) -> httpx.AsyncClient:
    """The health checker's client (control plane)."""
    timeout = httpx.Timeout(
        connect=settings.connect_timeout_s,
        read=None,
        write=settings.connect_timeout_s * 5,
        pool=settings.first_byte_timeout_s,
    )
    size = settings.max_upstream_connections
    limits = httpx.Limits(max_connections=size, max_keepalive_connections=size)
    return httpx.AsyncClient(
        timeout=timeout, limits=limits, trust_env=False, headers=worker_headers(settings)
    )


def redis_client(settings: GatewaySettings, deadline_s: float) -> RedisClient:
    """A client of the configured Redis: TLS for rediss://, the password apart from the URL."""
    assert settings.redis_url is not None
    tls = None
    if RedisAddress.parse(settings.redis_url).tls:
        tls = tls_context(settings.redis_tls())
    return RedisClient(
        settings.redis_url, deadline_s=deadline_s, password=settings.redis_password, tls=tls
    )


def ledger(settings: GatewaySettings) -> Ledger:
    """Where tenants' usage is counted: Redis when configured (shared by every process and
    replica), else this process. A concurrency lease outlives the longest request."""
    if settings.redis_url is None:
        return MemoryLedger(settings.rate_limit_window_s)
    if RedisAddress.parse(settings.redis_url).tls and not settings.redis_tls_verify:
        log.warning(
            "Redis TLS verification is OFF (DFLASH_GATEWAY_REDIS_TLS_VERIFY=false): the "
            "ledger's connection is encrypted but anyone in its path can pose as Redis"
        )
    client = redis_client(settings, settings.rate_limit_deadline_s)
    lease_s = settings.request_timeout_s + settings.drain_timeout_s + 60
    return RedisLedger(client, settings.rate_limit_window_s, lease_s)


def response_store(settings: GatewaySettings, metrics: GatewayMetrics) -> ResponseStore:
    """Stored responses live beside the ledger: Redis when configured, else this process.
    Its own client: a stored conversation is larger than a ledger call and may take longer."""
    if settings.redis_url is None:
        return MemoryResponseStore(
            settings.responses_ttl_s,
            settings.responses_max_entries,
            settings.responses_memory_bytes,
        )
    client = redis_client(settings, STORE_DEADLINE_S)
    return RedisResponseStore(client, settings.responses_ttl_s, metrics.count_response_store_error)


def describe_tenants(metrics: GatewayMetrics, ring: KeyRing) -> None:
    if ring.tenancy:
        metrics.describe_tenants(
            {tenant.name: tenant.limits.model_dump() for tenant in ring.tenants}
        )


TeardownStep = tuple[str, Callable[[], object]]


async def tear_down(*steps: TeardownStep | None) -> list[str]:
    """Run every step of a shutdown in order, each whatever the others did: one that raises
    is logged and the rest still run (a failing fleet stop must not leave the ledger's
    backlog unflushed or Redis open). Returns the names of the steps that failed."""
    failed: list[str] = []
    for step in steps:
        if step is None:
            continue
        name, run = step
        try:
            result = run()
            if inspect.isawaitable(result):
                await result
        except Exception:
            log.exception("shutdown: could not %s; going on with the rest", name)
            failed.append(name)
    return failed


def describe_pools(fleet: WorkerFleet) -> str:
    """Each pool for the startup log: its model, weight and workers."""
    return ", ".join(
        f"{name} (model {spec.model or 'as served'}, weight {fleet.weights[name]:g}, "
        f"{sum(w.pool == name for w in fleet.workers.values())} worker(s))"
        for name, spec in fleet.specs.items()
    )


def open_promotions(fleet: WorkerFleet, metrics: GatewayMetrics) -> Promotions:
    """The canaries' rollouts (pools with `promotion:`) and operators' pins, applying their
    weights to the fleet's split and to dflash_pool_weight."""
    rollouts = rollouts_of(fleet.specs)

    def apply(weights: dict[str, float]) -> None:
        for pool, weight in weights.items():
            fleet.weights[pool] = weight
            spec = fleet.specs[pool]
            metrics.describe_pool(spec.model or "", pool, weight, spec.gpus_per_worker)

    def healthy(pool: str) -> bool:
        now = time.monotonic()
        return all(w.routable(now) for w in fleet.workers.values() if w.pool == pool)

    for rollout in rollouts:
        metrics.describe_rollout(rollout.model, rollout.canary)
        log.info(
            "promotion: canary %s against %s, stages %s",
            rollout.canary,
            rollout.baseline,
            "/".join(f"{share:g}" for share in rollout.spec.stages),
        )
    weights = {name: spec.weight for name, spec in fleet.specs.items()}

    def count(rollout: Rollout, decision: str) -> None:
        metrics.count_decision(rollout.model, rollout.canary, decision)

    return Promotions(rollouts, weights, apply, healthy, count)


def open_capture(
    settings: GatewaySettings, metrics: GatewayMetrics, ring: KeyRing
) -> Capture | None:
    """Traffic capture (docs/capture.md), when capture_uri is set: its writer started, and the
    startup log saying so and saying whom it captures."""
    config = settings.capture_config()
    if config is None:
        return None
    metrics.describe_capture(OUTCOMES)
    writer = CaptureWriter(config, metrics.count_capture)
    writer.start()
    pools = {pool.name: pool.capture for pool in settings.pool_specs()}
    who = (
        "the tenants whose capture is set: "
        + (", ".join(f"{t.name} ({t.capture:g})" for t in ring.tenants if t.capture) or "none")
        if ring.tenancy
        else "every request"
    )
    log.warning(
        "traffic capture is ON: %s is written to %s (pool shares: %s)",
        who,
        redact_uri(config.uri),
        ", ".join(f"{name} {share:g}" for name, share in pools.items()) or "all",
    )
    return Capture(writer, pools)


def create_app(settings: GatewaySettings) -> FastAPI:
    metrics = GatewayMetrics()
    auth = ApiKeyAuth(settings.load_key_ring(), protect_metrics=settings.metrics_auth)
    describe_tenants(metrics, auth.ring)
    limiter = RateLimiter(
        ledger(settings),
        metrics,
        settings.rate_limit_failure_mode,
        backlog=settings.rate_limit_backlog,
    )
    state = GatewayState(
        settings=settings,
        metrics=metrics,
        auth=auth,
        limiter=limiter,
        responses=response_store(settings, metrics),
    )
    tracing = open_tracing(settings.tracing, GATEWAY_SERVICE)
    if tracing is not None:
        tracing.on_drop(metrics.trace_spans_dropped.inc)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if not auth.enabled:
            log.warning(
                "API-key auth is DISABLED: no key configured (set DFLASH_GATEWAY_API_KEYS "
                "or DFLASH_GATEWAY_API_KEY_FILE)"
            )
        client = upstream_client(settings)
        upstream = upstream_pool(settings)
        fleet = WorkerFleet(settings, client, metrics)
        fleet.promotions = open_promotions(fleet, metrics)
        shared = None
        if settings.redis_url is not None:  # every replica routes by the same weights
            store = redis_client(settings, STORE_DEADLINE_S)
            shared = SharedPromotions(fleet.promotions, store, settings.promotion_sync_s)
            shared.start()
        await fleet.start()
        capture = open_capture(settings, metrics, auth.ring)
        proxy = Proxy(settings, fleet, upstream, metrics, capture)
        state.runtime = Runtime(client, upstream, fleet, proxy)
        log.info(
            "gateway ready: %d of %d workers healthy; routing %s; pools: %s",
            len(fleet.routable()),
            len(fleet.workers),
            settings.routing,
            describe_pools(fleet),
        )
        reloader = None
        if settings.api_key_file is not None:
            watcher = KeyFileWatcher(
                settings.api_key_file,
                settings.load_key_ring,
                auth,
                on_reload=lambda ring: describe_tenants(metrics, ring),
            )
            reloader = asyncio.create_task(watcher.run(settings.key_reload_interval_s))
        try:
            yield
        finally:
            if reloader is not None:
                reloader.cancel()
            state.runtime = None
            await tear_down(
                ("hand the last promotion evidence over", shared.close) if shared else None,
                ("stop the fleet's health checks", fleet.stop),
                ("close the health-check client", client.aclose),
                ("close the watchdog", proxy.watchdog.close),
                ("close the upstream connections", upstream.close),
                ("flush and close the rate limiter's ledger", limiter.close),
                ("close the response store", state.responses.close),
                # write the samples still queued: bounded by the writer's close timeout
                ("write the captured samples", lambda: asyncio.to_thread(capture.writer.close))
                if capture is not None
                else None,
                # flush the spans: bounded by the exporter's timeout
                ("shut the tracer down", lambda: asyncio.to_thread(tracing.shutdown))
                if tracing is not None
                else None,
            )

    app = FastAPI(title="dflash-serving gateway", version="0.1.0", lifespan=lifespan)
    app.state.gateway = state
    app.include_router(router)
    install_handlers(app, log)
    outermost(app, auth, metrics, tracing)
    app.openapi = lambda: served_openapi(app, state.runtime)  # type: ignore[method-assign]
    return app
