"""The HTTP surface: OpenAI endpoints, models, probes and metrics."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from service.metrics import GatewayMetrics, code_label
from service.proxy import Proxy, ProxyCall
from service.responses import affinity_text, items_page, load, prepare
from service.routing.fleet import WorkerFleet
from service.routing.promotion import evidence_card, request_class
from service.routing.upstream import ConnectionPool
from service.settings import GatewaySettings
from service.tenancy.auth import ApiKeyAuth
from service.tenancy.ledger import TenantUsage
from service.tenancy.limits import RateLimiter, Ticket
from service.tenancy.response_store import ResponseStore
from service.tenancy.tenants import LIMIT_FIELDS, Tenant
from service.tracing import RequestTrace
from wire.errors import (
    ApiError,
    InvalidRequest,
    ModelNotFound,
    NoHealthyWorker,
    NotFound,
    PermissionDenied,
    Unavailable,
)
from wire.http import package_version, read_json
from wire.responses import ResponsesRequest
from wire.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    prompt_text,
    validate_request,
)

REQUEST_ID_KEY = "dflash.request_id"
STARTED_KEY = "dflash.started"
# The metrics label of the request's model, once the body named a served one: a refusal
# after that point (no healthy worker, draining) is counted under that model.
MODEL_LABEL_KEY = "dflash.model_label"
MODELS_NAMED = 10  # a 404 for an unknown model names at most this many served ones
# The Tenant of the request's key, when the key file names tenants (service/tenancy/tenants.py).
TENANT_KEY = "dflash.tenant"
# Generation endpoints: the ones tenants' limits count and charge.
RESPONSES_PATH = "/v1/responses"
LIMITED_ENDPOINTS = frozenset({"/v1/chat/completions", "/v1/completions", RESPONSES_PATH})
log = logging.getLogger("dflash.gateway.api")
ADMIN_USAGE_PATH = "/admin/usage"
ADMIN_POOLS_PATH = "/admin/pools"
# With tracing on: the request's RequestTrace (service/tracing.py), or for a request the
# sampler left out, the traceparent header line the worker gets.
TRACE_KEY = "dflash.trace"
TRACEPARENT_KEY = "dflash.traceparent"


@dataclass
class Runtime:
    """What the lifespan opens: the upstream clients, the fleet of workers and the proxy over them.
    httpx serves the fleet's health checks; service.routing.upstream the request path (a lean
    keep-alive HTTP/1.1 client: most of a proxied request's CPU was client setup)."""

    client: httpx.AsyncClient
    upstream: ConnectionPool
    fleet: WorkerFleet
    proxy: Proxy


@dataclass
class GatewayState:
    settings: GatewaySettings
    metrics: GatewayMetrics
    auth: ApiKeyAuth
    limiter: RateLimiter
    responses: ResponseStore
    draining: bool = False
    runtime: Runtime | None = field(default=None)

    def live(self) -> Runtime:
        if self.runtime is None:
            raise NoHealthyWorker("The gateway is starting.", headers={"Retry-After": "1"})
        return self.runtime


def gateway(request: Request) -> GatewayState:
    state: GatewayState = request.app.state.gateway
    return state


def upstream_body(raw: bytes, payload: dict[str, Any], stream: bool) -> bytes:
    """Non-streaming: the client's bytes untouched. Streaming: always ask the worker for the
    usage chunk (it carries usage and the per-request metrics); the proxy strips it again
    when the client did not ask for it."""
    if not stream:
        return raw
    options = payload.get("stream_options") or {}
    forwarded = {**payload, "stream_options": {**options, "include_usage": True}}
    return json.dumps(forwarded, separators=(",", ":")).encode()


async def proxy_endpoint(request: Request, schema: type[Any], endpoint: str) -> Response:
    state = gateway(request)
    raw, payload = await read_json(request, state.settings.max_body_bytes)
    parsed = validate_request(schema, payload)
    if endpoint == RESPONSES_PATH:
        return await responses_call(request, state, parsed, payload)
    affinity = None
    if state.settings.routing != "least_outstanding":
        affinity = prompt_text(parsed, state.settings.affinity_prefix_chars)
    options = parsed.stream_options
    return await forward(
        request,
        state,
        endpoint,
        parsed.model,
        payload,
        body=upstream_body(raw, payload, bool(parsed.stream)),
        stream=bool(parsed.stream),
        wants_usage=bool(options is not None and options.include_usage),
        affinity_key=affinity,
        single_choice=(parsed.n or 1) == 1,
        # SGLang's details the client asked for itself (else the gateway drops its own ask).
        spec_details=payload.get("return_spec_tokens_details") is True,
    )


async def responses_call(
    request: Request, state: GatewayState, parsed: ResponsesRequest, payload: dict[str, Any]
) -> Response:
    """POST /v1/responses: the stored conversation expanded (service/responses.py), then
    proxied like a chat completion."""
    tenant: Tenant | None = request.scope.get(TENANT_KEY)
    body, hook = await prepare(
        state.responses,
        tenant.name if tenant is not None else "",
        parsed,
        payload,
        state.settings.responses_max_bytes,
    )
    affinity = None
    if state.settings.routing != "least_outstanding":
        affinity = affinity_text(hook.conversation, state.settings.affinity_prefix_chars)
    return await forward(
        request,
        state,
        RESPONSES_PATH,
        parsed.model,
        payload,
        body=body,
        stream=bool(parsed.stream),
        wants_usage=True,  # usage rides on response.completed: nothing to strip
        affinity_key=affinity,
        single_choice=True,
        responses=hook,
    )


async def forward(
    request: Request,
    state: GatewayState,
    endpoint: str,
    model: str,
    payload: dict[str, Any],
    **call: Any,
) -> Response:
    """Route a validated request: a healthy worker serving `model`, the tenant's admission,
    then the proxy (`call`: the rest of ProxyCall's fields; `payload`: the client's body, for
    the trace's request attributes)."""
    runtime = state.live()
    retry_after = {"Retry-After": str(state.settings.retry_after_s)}
    if not runtime.fleet.routable():
        raise NoHealthyWorker("No healthy worker is available.", headers=retry_after)
    if not runtime.fleet.knows_model(model):
        if runtime.fleet.configures(model):
            raise NoHealthyWorker(
                f"No healthy worker serves `{model}` right now.", headers=retry_after
            )
        raise unknown_model(model, runtime.fleet)
    known = runtime.fleet.configures(model) or runtime.fleet.lists_model(model)
    label = model if known else "unknown"
    request.scope[MODEL_LABEL_KEY] = label
    tenant: Tenant | None = request.scope.get(TENANT_KEY)
    trace: RequestTrace | None = request.scope.get(TRACE_KEY)
    if trace is not None:
        request_id = request.scope.get(REQUEST_ID_KEY, "")
        trace.request(endpoint, model, payload, request_id)
    ticket = None
    if tenant is not None and endpoint in LIMITED_ENDPOINTS:
        ticket = await admit(state.limiter, tenant, label, trace)
    proxied = ProxyCall(
        endpoint=endpoint,
        model=model,
        label=label,
        request_id=request.scope.get(REQUEST_ID_KEY, ""),
        started=request.scope.get(STARTED_KEY, time.perf_counter()),
        tenant=tenant.name if tenant is not None and endpoint in LIMITED_ENDPOINTS else None,
        ticket=ticket,
        trace=trace,
        trace_headers=request.scope.get(TRACEPARENT_KEY, b""),
        capture_share=1.0 if tenant is None else tenant.capture,
        # The prompt's tokens are not known yet: about 4 bytes of body each.
        klass=request_class(temperature_of(payload), len(call.get("body", b"")) // 4),
        **call,
    )
    return runtime.proxy.response(proxied)


def temperature_of(payload: dict[str, Any]) -> float | None:
    """The request's temperature (already validated); None when it names none."""
    value = payload.get("temperature")
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


async def admit(
    limiter: RateLimiter, tenant: Tenant, label: str, trace: RequestTrace | None
) -> Ticket | None:
    """The tenant's limits; traced, a refusal (429) sets the admission span's status."""
    if trace is None:
        return await limiter.admit(tenant, label)
    span = trace.admission(tenant.name)
    try:
        return await limiter.admit(tenant, label)
    except ApiError as error:
        code = code_label(error.code, error.error_type)
        trace.refused(span, error.status_code, code, error.message)
        raise
    finally:
        span.end()


def unknown_model(model: str, fleet: WorkerFleet | None) -> ModelNotFound:
    """404 naming the model asked for and the ones served (OpenAI's wording, plus the list
    a newcomer needs: the name in their client rarely matches a served name at first)."""
    served = fleet.model_names() if fleet is not None else []
    shown = ", ".join(f"`{name}`" for name in served[:MODELS_NAMED])
    more = f" and {len(served) - MODELS_NAMED} more" if len(served) > MODELS_NAMED else ""
    where = f" Served models: {shown}{more}." if served else " No model is served right now."
    return ModelNotFound(f"The model `{model}` does not exist.{where}", param="model")


def _body_schema(name: str) -> dict[str, Any]:
    ref = {"$ref": f"#/components/schemas/{name}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


router = APIRouter()

PROXY_ENDPOINTS: tuple[tuple[str, type[Any]], ...] = (
    ("/v1/chat/completions", ChatCompletionRequest),
    ("/v1/completions", CompletionRequest),
    (RESPONSES_PATH, ResponsesRequest),
)


@router.post(
    "/v1/chat/completions",
    openapi_extra=_body_schema("ChatCompletionRequest"),
    summary="OpenAI chat completions (streaming and not), proxied to a worker",
)
async def chat_completions(request: Request) -> Response:
    return await proxy_endpoint(request, ChatCompletionRequest, "/v1/chat/completions")


@router.post(
    "/v1/completions",
    openapi_extra=_body_schema("CompletionRequest"),
    summary="OpenAI text completions (streaming and not), proxied to a worker",
)
async def completions(request: Request) -> Response:
    return await proxy_endpoint(request, CompletionRequest, "/v1/completions")


@router.post(
    RESPONSES_PATH,
    openapi_extra=_body_schema("ResponsesRequest"),
    summary="OpenAI Responses (streaming and not), proxied to a worker; stored by the gateway",
)
async def create_response(request: Request) -> Response:
    return await proxy_endpoint(request, ResponsesRequest, RESPONSES_PATH)


def _store_scope(request: Request) -> tuple[GatewayState, str]:
    """The store and the caller's tenant (\"\" without tenants): records are per tenant."""
    tenant: Tenant | None = request.scope.get(TENANT_KEY)
    return gateway(request), tenant.name if tenant is not None else ""


@router.api_route(
    RESPONSES_PATH + "/{response_id}",
    methods=["GET", "DELETE"],
    summary="A stored response: GET returns it, DELETE removes it",
)
async def stored_response(request: Request, response_id: str) -> dict[str, Any]:
    """One route for both methods, so a 405 lists both in Allow."""
    state, tenant = _store_scope(request)
    record = await load(state.responses, tenant, response_id, "response_id")
    if request.method == "DELETE":
        await state.responses.delete(tenant, response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}
    response: dict[str, Any] = record["response"]
    return response


@router.get(
    RESPONSES_PATH + "/{response_id}/input_items", summary="A stored response's input items"
)
async def response_input_items(request: Request, response_id: str) -> dict[str, Any]:
    state, tenant = _store_scope(request)
    record = await load(state.responses, tenant, response_id, "response_id")
    return items_page(record["input_items"], request.query_params)


@router.post(
    "/tokenize",
    openapi_extra=_body_schema("TokenizeRequest"),
    summary="vLLM's /tokenize, routed to a worker serving the model",
)
async def tokenize(request: Request) -> Response:
    return await proxy_endpoint(request, TokenizeRequest, "/tokenize")


@router.post(
    "/detokenize",
    openapi_extra=_body_schema("DetokenizeRequest"),
    summary="vLLM's /detokenize, routed to a worker serving the model",
)
async def detokenize(request: Request) -> Response:
    return await proxy_endpoint(request, DetokenizeRequest, "/detokenize")


@router.get("/v1/models/{model_id:path}", summary="One model served by the healthy workers")
async def retrieve_model(request: Request, model_id: str) -> dict[str, Any]:
    runtime = gateway(request).runtime
    for card in runtime.fleet.models() if runtime is not None else []:
        if card.get("id") == model_id:
            return dict(card)
    raise unknown_model(model_id, runtime.fleet if runtime is not None else None)


@router.get("/version", summary="The gateway's version")
async def version() -> dict[str, str]:
    return {"version": package_version()}


@router.get("/v1/models", summary="Models served by the healthy workers")
async def list_models(request: Request) -> dict[str, Any]:
    runtime = gateway(request).runtime
    data = runtime.fleet.models() if runtime is not None else []
    return {"object": "list", "data": data}


@router.get(
    ADMIN_USAGE_PATH,
    summary="Tenants' usage of the current window and month (an admin key sees every tenant)",
)
async def admin_usage(request: Request, tenant: str | None = None) -> dict[str, Any]:
    """A key's own tenant, or with an admin key (`admin: true` in the key file) any tenant
    (`?tenant=NAME`) or all of them. Read from the ledger: with Redis, every replica's usage."""
    state = gateway(request)
    caller: Tenant | None = request.scope.get(TENANT_KEY)
    if caller is None:
        raise NotFound("Usage is kept for tenants only: the key file names none.")
    ring = state.auth.ring
    if tenant is None:
        chosen = list(ring.tenants) if caller.admin else [caller]
    else:
        found = ring.tenant(tenant)
        if found is None or (found.name != caller.name and not caller.admin):
            raise NotFound(f"No tenant `{tenant}` visible to this key.", param="tenant")
        chosen = [found]
    data = []
    for entry in chosen:
        usage = await state.limiter.usage(entry)
        data.append(usage_card(entry, usage))
    window_s = state.settings.rate_limit_window_s
    return {"object": "list", "window_s": window_s, "data": data}


class PoolPin(BaseModel):
    """An operator's weight for a pool; null unpins it (the promotion's weight applies)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    weight: float | None = Field(ge=0, le=100, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _unknown_keys_first(cls, data: Any) -> Any:
        """`{"wieght": 5}` names the typo, not only the `weight` it lacks."""
        if isinstance(data, dict):
            unknown = sorted(str(key) for key in data if key != "weight")
            if unknown:
                raise InvalidRequest(
                    f"{unknown[0]}: unknown field; a pin takes `weight` only", param=unknown[0]
                )
        return data


@router.get(ADMIN_POOLS_PATH, summary="Pools, their weights, and canaries' promotion evidence")
async def admin_pools(request: Request) -> dict[str, Any]:
    runtime = gateway(request).live()
    return {"object": "list", "data": pool_cards(runtime.fleet)}


@router.get(ADMIN_POOLS_PATH + "/{pool}", summary="One pool's weight and promotion evidence")
async def admin_pool(request: Request, pool: str) -> dict[str, Any]:
    return pool_card(gateway(request).live().fleet, pool)


@router.put(
    ADMIN_POOLS_PATH + "/{pool}",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": PoolPin.model_json_schema()}},
        }
    },
    summary="Pin a pool's weight (it wins over automatic promotion); null unpins",
)
async def pin_pool(request: Request, pool: str) -> dict[str, Any]:
    caller: Tenant | None = request.scope.get(TENANT_KEY)
    state = gateway(request)
    if state.auth.enabled and (caller is None or not caller.admin):
        raise PermissionDenied("Pinning a pool's weight needs an admin key (`admin: true`).")
    # Read as /v1 bodies are: JSON whatever the Content-Type (`curl -d` sends a form's), the
    # same errors; and only after the key is checked (a non-admin gets its 403 either way).
    _, payload = await read_json(request, state.settings.max_body_bytes)
    pin = validate_request(PoolPin, payload)
    fleet = state.live().fleet
    require_pool(fleet, pool)
    if pin.weight == 0:
        refuse_draining_every_pool(fleet, pool)
    assert fleet.promotions is not None  # made with the fleet (service/app.py)
    await fleet.promotions.set_pin(pool, pin.weight)
    if pin.weight is None:
        log.warning("pool %s: unpinned by %s", pool, caller_name(caller))
    else:
        log.warning("pool %s: weight pinned to %g by %s", pool, pin.weight, caller_name(caller))
    return pool_card(fleet, pool)


def refuse_draining_every_pool(fleet: WorkerFleet, pool: str) -> None:
    """A pin to 0 may not leave every pool of the model at weight 0: startup refuses that
    state in a pools file, and the weighted split would then offer every pool again (the
    drain lost without a word)."""
    model = fleet.specs[pool].model
    others = [name for name, spec in fleet.specs.items() if spec.model == model and name != pool]
    if not any(fleet.weights.get(name, fleet.specs[name].weight) > 0 for name in others):
        raise InvalidRequest(
            f"Pinning pool `{pool}` to 0 would leave every pool of model "
            f"`{model or pool}` at weight 0, and traffic would go to all of them again; "
            "pin another pool of it above 0 first.",
            param="weight",
        )


def caller_name(caller: Tenant | None) -> str:
    return f"tenant {caller.name}" if caller is not None else "a caller (auth off)"


def require_pool(fleet: WorkerFleet, pool: str) -> None:
    if pool not in fleet.specs:
        raise NotFound(f"No pool `{pool}`.", param="pool")


def pool_card(fleet: WorkerFleet, pool: str) -> dict[str, Any]:
    """One pool's card (pool_cards); a 404 naming it when there is no such pool."""
    require_pool(fleet, pool)
    return next(card for card in pool_cards(fleet) if card["pool"] == pool)


def pool_cards(fleet: WorkerFleet) -> list[dict[str, Any]]:
    """Each pool's weight, pin and workers; a canary's rollout with its evidence."""
    promotions = fleet.promotions
    cards = []
    for name, spec in fleet.specs.items():
        # A pool named for no model (dflash-serve's own) serves what its workers list.
        listed = sorted({m for w in fleet.workers.values() if w.pool == name for m in w.model_ids})
        card: dict[str, Any] = {
            "pool": name,
            "model": spec.model or (listed[0] if len(listed) == 1 else None),
            "models": [spec.model] if spec.model else listed,
            "weight": fleet.weights.get(name, spec.weight),
            "pinned": promotions is not None and name in promotions.pins,
            "workers": sum(1 for w in fleet.workers.values() if w.pool == name),
        }
        rollout = promotions.rollouts.get(name) if promotions is not None else None
        if rollout is not None:
            card["promotion"] = {
                "baseline": rollout.baseline,
                "status": rollout.status,
                "stage": rollout.stage,
                "stages": list(rollout.spec.stages),
                "evidence": evidence_card(rollout.evidence(), rollout),
                "decisions": rollout.decisions,
            }
        cards.append(card)
    return cards


def usage_card(tenant: Tenant, usage: TenantUsage | None) -> dict[str, Any]:
    limits = {name: getattr(tenant.limits, name) for name in LIMIT_FIELDS}
    card: dict[str, Any] = {"tenant": tenant.name, "limits": limits}
    if usage is None:  # the store did not answer
        return {**card, "usage": None}
    window = {"requests": usage.requests, "tokens": usage.tokens, "reset_s": usage.reset_s}
    month = {
        "month": usage.month,
        "requests": usage.month_requests,
        "tokens": usage.month_tokens,
    }
    return {**card, "window": window, "month": month, "concurrent_requests": usage.concurrent}


@router.get("/health", summary="Liveness: the gateway process answers")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/ready", summary="Readiness: a healthy worker exists and no drain is under way")
async def ready(request: Request) -> JSONResponse:
    state = gateway(request)
    healthy = len(state.runtime.fleet.routable()) if state.runtime is not None else 0
    if state.draining or not healthy:
        reason = "draining" if state.draining else "no healthy worker"
        raise Unavailable(f"Not ready: {reason}.", code="not_ready")
    return JSONResponse({"status": "ready", "healthy_workers": healthy})


@router.get("/metrics", summary="Prometheus exposition of the gateway's metrics")
async def metrics(request: Request) -> Response:
    body, content_type = gateway(request).metrics.render(request.headers.get("accept", ""))
    return Response(body, media_type=content_type)
