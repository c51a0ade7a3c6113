"""The gateway's Prometheus series: requests, latency, tokens, per-request speculation, tenants
and workers (names in ARCHITECTURE.md, "The gateway's metrics")."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST as OPENMETRICS_CONTENT_TYPE
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest

from service.reports import SpecStats, Usage

# prometheus_client chooses where values live (memory or per-process mmap files) from this
# variable when it is imported; the gateway's supervisor sets it for `--processes N`.
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1)
ACCEPT_LEN_BUCKETS = (1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8, 10, 12, 16)
RATE_BUCKETS = tuple(round(0.1 * i, 1) for i in range(1, 11))
# (operation, outcome) of dflash_rate_limit_store_errors_total: every pair that can happen.
STORE_OUTCOMES = (
    ("admit", "served"),
    ("admit", "refused"),
    ("settle", "served"),
    ("usage", "served"),
)
# The operation label of dflash_response_store_errors_total: a write that fails is skipped (the
# answer still goes out, not kept); a read or delete that fails answers 503.
RESPONSE_STORE_OPERATIONS = ("write", "read", "delete")
# Why a ledger settlement was given up (dflash_rate_limit_ledger_lost_total).
LEDGER_LOSSES = ("backlog_full", "rejected", "shutdown")
# The `pool` label of a response no worker was tried for (refused by the gateway itself).
NO_POOL = "none"
# An error code is a label value only when it looks like one of ours (they are all literals
# in wire/errors.py and service/proxy.py); anything else is counted as "other".
_CODE = re.compile(r"[a-z0-9_]{1,48}")


def code_label(code: str | None, error_type: str) -> str:
    value = code or error_type
    return value if _CODE.fullmatch(value) else "other"


class _Children:
    """Label children looked up once (see `child`)."""

    _children: dict[tuple[int, tuple[str, ...]], Any]

    def child(self, metric: Any, *values: str) -> Any:
        """`metric.labels(*values)`, looked up once: prometheus_client's own lookup validates
        and hashes the labels on every call, a cost on the request path. Only for series
        whose label values are bounded (served models, endpoints, statuses), never removed."""
        key = (id(metric), values)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*values)
        return found


class TenancySeries(_Children):
    """The tenants' series: usage per tenant (names from the key file, never keys), their
    limits and 429s, the ledger's store (errors, retried settlements, what is lost), and the
    stored responses' store (its errors)."""

    def _tenant_series(self, r: CollectorRegistry) -> None:
        """Usage per tenant (names from the key file, never keys), by model."""
        self.tenant_requests = Counter(
            "dflash_tenant_requests",
            "Generation requests of a tenant, by the status sent (429s included)",
            ["tenant", "model", "status"],
            registry=r,
        )
        self.tenant_prompt_tokens = Counter(
            "dflash_tenant_prompt_tokens",
            "Prompt tokens of a tenant",
            ["tenant", "model"],
            registry=r,
        )
        self.tenant_completion_tokens = Counter(
            "dflash_tenant_completion_tokens",
            "Completion tokens of a tenant",
            ["tenant", "model"],
            registry=r,
        )
        self.tenant_rate_limited = Counter(
            "dflash_tenant_rate_limited",
            "Requests refused with 429, by limit: requests, tokens, quota, concurrency",
            ["tenant", "model", "limit"],
            registry=r,
        )
        self.tenant_limit = Gauge(
            "dflash_tenant_limit",
            "A tenant's configured limit (absent: no limit)",
            ["tenant", "limit"],
            registry=r,
            multiprocess_mode="max",
        )
        self.store_errors = Counter(
            "dflash_rate_limit_store_errors",
            "Rate-limit store calls that failed or missed their deadline, and what the request "
            "got (served without limits, or refused with 503)",
            ["operation", "outcome"],
            registry=r,
        )
        # At zero from the start: an alert on failures needs the series before the first one.
        for operation, outcome in STORE_OUTCOMES:
            self.child(self.store_errors, operation, outcome)
        self._ledger_series(r)

    def _ledger_series(self, r: CollectorRegistry) -> None:
        """Settlements retried until they land (tenancy/ledger_backlog.py), and what is lost."""
        self.settle_retries = Counter(
            "dflash_rate_limit_settle_retries",
            "Ledger settlements (and requests served while the store did not answer) retried "
            "because the store did not take them yet",
            registry=r,
        )
        self.ledger_lost = Counter(
            "dflash_rate_limit_ledger_lost",
            "Ledger settlements given up: their requests and tokens are not counted "
            "(backlog_full, rejected, shutdown)",
            ["reason"],
            registry=r,
        )
        for reason in LEDGER_LOSSES:
            self.child(self.ledger_lost, reason)
        self.response_store_errors = Counter(
            "dflash_response_store_errors",
            "Stored-response store calls (Redis) that failed or missed their deadline: a write "
            "is skipped (the answer still goes out, the response is not kept), a read or a "
            "delete answers 503",
            ["operation"],
            registry=r,
        )
        for operation in RESPONSE_STORE_OPERATIONS:
            self.child(self.response_store_errors, operation)
        self.ledger_backlog = Gauge(
            "dflash_rate_limit_ledger_backlog",
            "Ledger settlements waiting for the store to take them",
            registry=r,
            multiprocess_mode="livesum",
        )

    def count_tenant(self, tenant: str, model: str, status: int) -> None:
        self.child(self.tenant_requests, tenant, model, str(status)).inc()

    def count_rate_limited(self, tenant: str, model: str, limit: str) -> None:
        self.child(self.tenant_rate_limited, tenant, model, limit).inc()

    def count_store_error(self, operation: str, outcome: str) -> None:
        self.child(self.store_errors, operation, outcome).inc()

    def count_response_store_error(self, operation: str) -> None:
        self.child(self.response_store_errors, operation).inc()

    def count_settle_retries(self, count: int) -> None:
        self.settle_retries.inc(count)

    def count_ledger_lost(self, reason: str, count: int = 1) -> None:
        self.child(self.ledger_lost, reason).inc(count)

    def describe_tenants(self, limits: dict[str, dict[str, int | None]]) -> None:
        """The configured limits (tenant -> limit name -> value); a limit removed by a
        reload loses its series."""
        for tenant, named in limits.items():
            for name, value in named.items():
                if value is None:
                    with contextlib.suppress(KeyError):
                        self.tenant_limit.remove(tenant, name)
                else:
                    self.tenant_limit.labels(tenant, name).set(value)


class GatewayMetrics(TenancySeries):
    """All gateway series in one registry owned by the app (no process-global state).

    With several processes (`multiprocess_dir`, by default the directory prometheus_client
    itself was set up with) each writes its own files and /metrics sums them all, so every
    process answers for the whole gateway."""

    def __init__(self, multiprocess_dir: str | None = None) -> None:
        self.multiprocess_dir = multiprocess_dir or os.environ.get(MULTIPROC_ENV) or None
        self.registry = CollectorRegistry(auto_describe=True)
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self._pool: set[str] = set()  # workers in this process's pool (health series)
        r = self.registry
        self.requests = Counter(
            "dflash_requests",
            "Responses sent, by status: relayed from a worker or answered by the gateway itself",
            ["model", "pool", "endpoint", "status"],
            registry=r,
        )
        self.errors = Counter(
            "dflash_gateway_errors",
            "Error responses the gateway itself answered (not relayed from a worker), by "
            "OpenAI error code",
            ["endpoint", "status", "code"],
            registry=r,
        )
        self.in_flight = Gauge(
            "dflash_requests_in_flight",
            "Requests on a worker now",
            ["model", "pool"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.duration = Histogram(
            "dflash_request_duration_seconds",
            "End-to-end latency, client view",
            ["model", "pool", "endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "dflash_time_to_first_token_seconds",
            "Time to first token, client view (streaming)",
            ["model", "pool"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "dflash_time_per_output_token_seconds",
            "(end - first token) / (tokens - 1) per request",
            ["model", "pool"],
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "dflash_prompt_tokens", "Prompt tokens", ["model", "pool"], registry=r
        )
        self.completion_tokens = Counter(
            "dflash_completion_tokens", "Completion tokens", ["model", "pool"], registry=r
        )
        self._spec_series(r)
        self._tenant_series(r)
        self.worker_healthy = Gauge(
            "dflash_worker_healthy",
            "1 when the worker takes traffic",
            ["worker", "pool"],
            registry=r,
            multiprocess_mode="livemax",  # takes traffic from at least one process
        )
        self.pool_weight = Gauge(
            "dflash_pool_weight",
            "Configured share of its model's traffic (the model's heaviest pool is its baseline)",
            ["model", "pool"],
            registry=r,
            multiprocess_mode="max",
        )
        self.pool_gpus = Gauge(
            "dflash_pool_gpus_per_worker",
            "GPUs behind one worker of the pool (tokens/s per GPU divides by it)",
            ["model", "pool"],
            registry=r,
            multiprocess_mode="max",
        )
        self.upstream_errors = Counter(
            "dflash_upstream_errors", "Failed upstream attempts", ["worker", "kind"], registry=r
        )
        self.retries = Counter(
            "dflash_retries", "Attempts retried on another worker", ["model"], registry=r
        )
        # docs/tracing.md: spans the bounded export queue had no room for (collector down/slow).
        dropped = "Spans dropped: the export queue was full"
        self.trace_spans_dropped = Counter("dflash_trace_spans_dropped", dropped, registry=r)
        self._capture_series(r)
        self.promotion_decisions = Counter(
            "dflash_promotion_decisions",
            "Canary rollouts' decisions: promote (a stage up) or rollback (to 0), by the "
            "canary's model and pool",
            ["model", "pool", "decision"],
            registry=r,
        )

    def _capture_series(self, r: CollectorRegistry) -> None:
        """docs/capture.md: every captured sample ends written or dropped, and why."""
        self.capture_samples = Counter(
            "dflash_capture_samples",
            "Requests offered to traffic capture, by outcome: written, or dropped (queue_full, "
            "too_large, unusable, store_error, shutdown)",
            ["outcome"],
            registry=r,
        )
        self.capture_shards = Counter(
            "dflash_capture_shards", "Dataset shards written by traffic capture", registry=r
        )
        self.capture_cpu = Counter(
            "dflash_capture_writer_cpu_seconds",
            "CPU time of traffic capture's writer thread (parsing, compressing, writing)",
            registry=r,
        )

    def describe_rollout(self, model: str, canary: str) -> None:
        """A canary's decision series, at 0 from the start."""
        for decision in ("promote", "rollback"):
            self.child(self.promotion_decisions, model, canary, decision)

    def count_decision(self, model: str, canary: str, decision: str) -> None:
        """A rollout's promote or rollback (service/routing/promotion.py)."""
        self.child(self.promotion_decisions, model, canary, decision).inc()

    def count_capture(self, outcome: str, count: float) -> None:
        """The capture writer's counts (its thread calls this; the counters are thread-safe)."""
        if outcome == "shards":
            self.capture_shards.inc(count)
        elif outcome == "cpu_seconds":
            self.capture_cpu.inc(count)
        else:
            self.child(self.capture_samples, outcome).inc(count)

    def describe_capture(self, outcomes: tuple[str, ...]) -> None:
        """At zero from the start, so that an alert on drops has its series."""
        for outcome in outcomes:
            self.child(self.capture_samples, outcome)

    def _spec_series(self, r: CollectorRegistry) -> None:
        self.spec_length = Histogram(
            "dflash_spec_acceptance_length",
            "Per-request mean acceptance length (bonus included)",
            ["model", "pool"],
            buckets=ACCEPT_LEN_BUCKETS,
            registry=r,
        )
        self.spec_rate = Histogram(
            "dflash_spec_draft_acceptance_rate",
            "Per-request accepted / drafted tokens",
            ["model", "pool"],
            buckets=RATE_BUCKETS,
            registry=r,
        )
        self.spec_steps = Counter(
            "dflash_spec_steps", "Verify steps", ["model", "pool"], registry=r
        )
        self.spec_drafted = Counter(
            "dflash_spec_draft_tokens", "Draft tokens", ["model", "pool"], registry=r
        )
        self.spec_accepted = Counter(
            "dflash_spec_accepted_tokens", "Accepted draft tokens", ["model", "pool"], registry=r
        )

    def count_response(
        self, model: str, endpoint: str, status: int, code: str | None = None, pool: str = NO_POOL
    ) -> None:
        """One response sent to a client; `code`: the OpenAI error code of an error the
        gateway answered itself (None for a relayed or successful response); `pool`: the
        pool of the worker that answered (NO_POOL when none was tried)."""
        self.child(self.requests, model, pool, endpoint, str(status)).inc()
        if code is not None:
            self.child(self.errors, endpoint, str(status), code).inc()

    def observe_usage(
        self, model: str, pool: str, usage: Usage | None, tenant: str | None = None
    ) -> None:
        if usage is None:
            return
        self.child(self.prompt_tokens, model, pool).inc(usage.prompt_tokens)
        self.child(self.completion_tokens, model, pool).inc(usage.completion_tokens)
        if tenant is not None:
            self.child(self.tenant_prompt_tokens, tenant, model).inc(usage.prompt_tokens)
            self.child(self.tenant_completion_tokens, tenant, model).inc(usage.completion_tokens)

    def observe_spec(self, model: str, pool: str, found: list[SpecStats]) -> None:
        """Per-choice speculation, as each engine's wire reported it (routing/engines.py)."""
        for stats in found:
            self.child(self.spec_steps, model, pool).inc(stats.steps)
            if stats.draft_tokens is not None:
                self.child(self.spec_drafted, model, pool).inc(stats.draft_tokens)
            self.child(self.spec_accepted, model, pool).inc(stats.accepted_tokens)
            if stats.acceptance_length is not None:
                self.child(self.spec_length, model, pool).observe(stats.acceptance_length)
            if stats.acceptance_rate is not None:
                self.child(self.spec_rate, model, pool).observe(stats.acceptance_rate)

    def set_worker_health(self, worker: str, pool: str, healthy: bool | None) -> None:
        """healthy None: the worker left its pool, so its series goes too (bounded labels)."""
        if healthy is None:
            self._pool.discard(worker)
            with contextlib.suppress(KeyError):
                self.worker_healthy.remove(worker, pool)
            return
        self._pool.add(worker)
        self.worker_healthy.labels(worker, pool).set(1 if healthy else 0)

    def describe_pool(self, model: str, pool: str, weight: float, gpus_per_worker: int) -> None:
        """A configured pool (model "" for a pool serving whatever its workers list)."""
        self.pool_weight.labels(model, pool).set(weight)
        self.pool_gpus.labels(model, pool).set(gpus_per_worker)

    def render(self, accept: str = "") -> tuple[bytes, str]:
        if self.multiprocess_dir is None:
            return exposition(self.registry, accept)
        merged = CollectorRegistry()
        files = MultiProcessCollector(None, path=self.multiprocess_dir)  # type: ignore[no-untyped-call]
        merged.register(_PoolOnly(files, self.worker_healthy._name, self._pool))
        return generate_latest(merged), CONTENT_TYPE_LATEST


def exposition(registry: CollectorRegistry, accept: str) -> tuple[bytes, str]:
    """Prometheus text, or OpenMetrics when the scraper asks for it (the only format that
    carries the latency histograms' trace-id exemplars; one process: the multi-process files
    keep no exemplars)."""
    if "application/openmetrics-text" in accept:
        body = openmetrics_latest(registry)  # type: ignore[no-untyped-call]
        return body, OPENMETRICS_CONTENT_TYPE
    return generate_latest(registry), CONTENT_TYPE_LATEST


class _PoolOnly:
    """The merged multi-process series, less the health series of workers that left the
    pool: a value in another process's file cannot be removed, only left out here."""

    def __init__(self, inner: Any, family: str, pool: set[str]) -> None:
        self._inner, self._family, self._pool = inner, family, pool

    def collect(self) -> Iterator[Any]:
        for metric in self._inner.collect():
            if metric.name == self._family:
                metric.samples = [s for s in metric.samples if s.labels["worker"] in self._pool]
            yield metric
