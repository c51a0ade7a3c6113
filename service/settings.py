"""The gateway's one settings object: read once at the edge (env `DFLASH_GATEWAY_*`, CLI)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Literal, Protocol

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from service.capture.policy import CaptureShare
from service.capture.writer import CaptureConfig
from service.routing.promotion import PromotionSpec
from service.tenancy.redis_client import MAX_BULK, RedisAddress, TlsFiles
from service.tenancy.tenants import KeyRing, parse_key_file
from wire.capture import dataset_scheme_problem
from wire.tracing import TracingSettings

# fastest: each request to the pool expected fastest for it (service/routing/fastest.py),
# the worker within it by prefix affinity.
RoutingPolicy = Literal["least_outstanding", "prefix_affinity", "fastest"]
# What serves a pool: its wire is adapted by service/routing/engines.py (embedded speaks vLLM's).
Engine = Literal["vllm", "embedded", "sglang", "trtllm"]
# The name of the one pool of a gateway configured with plain `workers`/`worker_dns`.
DEFAULT_POOL = "default"
# A pool's name is a metrics label and part of Kubernetes object names: a DNS label.
POOL_NAME = r"^[a-z0-9]([-a-z0-9]{0,38}[a-z0-9])?$"

LogLevel = Literal["debug", "info", "warning", "error"]


def worker_urls(value: list[str]) -> list[str]:
    for url in value:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"worker URL must start with http:// or https://: {url!r}")
    return [url.rstrip("/") for url in value]


def dns_target(value: str | None) -> str | None:
    if value is not None:
        host, _, port = value.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"worker_dns must be NAME:PORT, got {value!r}")
    return value


# The fields a pool and the gateway's own single pool share, validated where they are typed.
WorkerUrls = Annotated[list[str], AfterValidator(worker_urls)]
DnsTarget = Annotated[str | None, AfterValidator(dns_target)]


class PoolSpec(BaseModel):
    """Workers that serve one model the same way (one engine, one drafter), and the share of
    that model's traffic they get. Several pools of one model split it by `weight`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=POOL_NAME)
    # The served model name requests ask for; None: whatever the workers list (one pool).
    model: str | None = Field(default=None, min_length=1)
    # Relative share among the pools of its model. 0: no traffic while a weighted pool of the
    # model has a healthy worker (a drained canary that still takes over as a fallback).
    weight: float = Field(default=100.0, ge=0, allow_inf_nan=False)
    engine: Engine = "vllm"
    workers: WorkerUrls = Field(default_factory=list)
    worker_dns: DnsTarget = None
    # GPUs behind one worker (tensor x pipeline parallel, x nodes): the denominator of the
    # pool's tokens/s per GPU. A CPU worker counts 1 (the series is then per worker).
    gpus_per_worker: int = Field(default=1, ge=1)
    # The share of this pool's requests captured when the gateway captures (capture_uri):
    # true, false or a fraction; it multiplies the tenant's.
    capture: CaptureShare = 1.0
    # Automatic promotion against a baseline pool (service/routing/promotion.py).
    promotion: PromotionSpec | None = None

    @model_validator(mode="after")
    def _has_workers(self) -> PoolSpec:
        if not self.workers and not self.worker_dns:
            raise ValueError(f"pool {self.name!r} needs workers or worker_dns")
        return self


class PoolLike(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def model(self) -> str | None: ...
    @property
    def weight(self) -> float: ...


def check_pools(pools: Sequence[PoolLike]) -> None:
    """What no single pool can see: duplicate names, a model whose pools all have weight 0,
    a pool without `model` beside others (dflash-serve checks its pools file with it too)."""
    names = [pool.name for pool in pools]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"duplicate pool names: {', '.join(duplicates)}")
    if len(pools) > 1:
        unnamed = [pool.name for pool in pools if pool.model is None]
        if unnamed:
            raise ValueError(f"with several pools each needs a model: {', '.join(unnamed)}")
    check_promotions(pools)
    weights: dict[str | None, float] = {}
    for pool in pools:
        weights[pool.model] = weights.get(pool.model, 0.0) + pool.weight
    idle = sorted(str(model) for model, total in weights.items() if total == 0)
    if idle:
        raise ValueError(f"every pool of model {', '.join(idle)} has weight 0")


def check_promotions(pools: Sequence[PoolLike]) -> None:
    """A canary's `promotion.baseline` names another pool of its model, each pool is in one
    rollout at most, and neither side sets `weight` (the promotion sets both)."""
    by_name = {pool.name: pool for pool in pools}
    taken: dict[str, str] = {}
    for pool in pools:
        promotion = getattr(pool, "promotion", None)
        if promotion is None or not promotion.enabled:
            continue
        where = f"pool {pool.name!r}: promotion.baseline"
        baseline = by_name.get(promotion.baseline)
        if baseline is None:
            raise ValueError(f"{where}: no pool named {promotion.baseline!r}")
        if baseline is pool or baseline.model != pool.model:
            raise ValueError(f"{where}: {promotion.baseline!r} is not another pool of its model")
        for name in (pool.name, baseline.name):
            if name in taken:
                raise ValueError(
                    f"pool {name!r} is in two promotions ({taken[name]!r} and {pool.name!r})"
                )
            taken[name] = pool.name
            if "weight" in getattr(by_name[name], "model_fields_set", ()):
                raise ValueError(
                    f"pool {name!r}: weight is set by the promotion of {pool.name!r} "
                    "(its promotion.stages); leave weight out"
                )


class GatewaySettings(BaseSettings):
    """Every knob of one gateway process. Lists in env are comma-separated."""

    model_config = SettingsConfigDict(env_prefix="DFLASH_GATEWAY_", extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    # Static worker base URLs (http://host:port) and/or a DNS name re-resolved on an
    # interval (the headless Service of the worker StatefulSet), as NAME:PORT.
    workers: Annotated[WorkerUrls, NoDecode] = Field(default_factory=list)
    worker_dns: DnsTarget = None
    # GPUs behind each of those workers (see PoolSpec.gpus_per_worker).
    gpus_per_worker: int = Field(default=1, ge=1)
    # Several pools instead (JSON in env): models, and weighted pools of one model (canaries).
    pools: list[PoolSpec] = Field(default_factory=list)
    dns_interval_s: float = Field(default=5.0, gt=0)
    # Auth: keys from env (comma-separated) and/or a file (one per line, `#` comments).
    api_keys: Annotated[list[str], NoDecode] = Field(default_factory=list, repr=False)
    api_key_file: Path | None = None
    key_reload_interval_s: float = Field(default=5.0, gt=0)  # how often the key file is checked
    metrics_auth: bool = False
    # Tenants' limits (a key file in the tenant format, service/tenancy/tenants.py) are kept in a
    # ledger: in this process by default, or in Redis (redis[s]://[[user]:password@]host:
    # port/db; rediss: TLS), shared by every process and replica.
    redis_url: str | None = Field(default=None, repr=False)
    # The password (of `user` in the URL, an ACL user, or of `default`) apart from the URL,
    # e.g. from a Secret; it wins over one in the URL.
    redis_password: str | None = Field(default=None, repr=False)
    # rediss://: the CA bundle that signed the server's certificate (None: the system's
    # store); a client certificate and key for mutual TLS; verify=false skips checking the
    # server's certificate and name (warned at startup: anyone in the path can read keys).
    redis_tls_ca_file: Path | None = None
    redis_tls_cert_file: Path | None = None
    redis_tls_key_file: Path | None = None
    redis_tls_verify: bool = True
    # Settlements the store did not take in time wait here to be retried (the oldest is
    # dropped, and counted, when it is full).
    rate_limit_backlog: int = Field(default=100_000, ge=1)
    # Stored responses (/v1/responses with store): kept with the ledger (in this process, or
    # Redis with redis_url) for this long, each at most this many bytes of JSON; the
    # in-process store holds at most responses_max_entries and responses_memory_bytes in all
    # (the oldest go first).
    responses_ttl_s: float = Field(default=3600.0, ge=1)
    # at most what the Redis client reads back as one reply (a larger one could not be read)
    responses_max_bytes: int = Field(default=MAX_BULK, ge=1024, le=MAX_BULK)
    responses_max_entries: int = Field(default=10_000, ge=1)
    responses_memory_bytes: int = Field(default=256 * 1024 * 1024, ge=1024 * 1024)
    # When the store does not answer within rate_limit_deadline_s: serve without limits
    # (open: logged and counted) or refuse with 503 + Retry-After (closed).
    rate_limit_failure_mode: Literal["open", "closed"] = "open"
    rate_limit_deadline_s: float = Field(default=0.1, gt=0)
    # The length of the "per minute" windows (tests shorten it).
    rate_limit_window_s: float = Field(default=60.0, gt=0)
    # The `worker` label of the metrics: "id" (w-<hash of the URL>: the same on every
    # replica, no internal address on an open /metrics) or "url" (the base URL).
    metrics_worker_label: Literal["id", "url"] = "id"
    # Bearer key the gateway sends to workers started with `--api-key` (vLLM's flag).
    worker_api_key: str | None = Field(default=None, repr=False)
    # Routing.
    routing: RoutingPolicy = "least_outstanding"
    affinity_prefix_chars: int = Field(default=256, ge=1)
    affinity_load_factor: float = Field(default=1.25, ge=1.0)
    affinity_replicas: int = Field(default=64, ge=1)
    # ROUTING=fastest: the share of requests drawn by weights, to keep every pool's speed
    # estimate current (each goes to the drawn pool where a worker of it is idle), and how
    # strongly a request leans to the pool its class has the comparative advantage on (0:
    # each request to the pool fastest for itself) (service/routing/fastest.py).
    fastest_exploration: float = Field(default=0.05, ge=0, le=1)
    fastest_home_bias: float = Field(default=1.0, ge=0)
    # Health: active checks of /health, passive ejection after consecutive failures.
    health_interval_s: float = Field(default=2.0, gt=0)
    health_timeout_s: float = Field(default=1.0, gt=0)
    eject_after_failures: int = Field(default=3, ge=1)
    eject_cooldown_s: float = Field(default=10.0, ge=0)
    max_retries: int = Field(default=2, ge=0)
    retry_after_s: int = Field(default=1, ge=0)
    # Timeouts of one upstream attempt.
    connect_timeout_s: float = Field(default=2.0, gt=0)
    first_byte_timeout_s: float = Field(default=120.0, gt=0)
    idle_stream_timeout_s: float = Field(default=60.0, gt=0)
    request_timeout_s: float = Field(default=600.0, gt=0)
    # Deadlines of the client side: headers from the request's first byte, then the body.
    header_read_timeout_s: float = Field(default=10.0, gt=0)
    body_read_timeout_s: float = Field(default=30.0, gt=0)
    # Processes sharing the port (SO_REUSEPORT); metrics are summed over them.
    processes: int = Field(default=1, ge=1, le=256)
    listen_backlog: int = Field(default=4096, ge=16)
    max_upstream_connections: int = Field(default=2048, ge=1)
    # How long an idle connection to a worker is kept for reuse. It must stay below the
    # worker's own idle close (uvicorn's and vLLM's 5 s, VLLM_HTTP_TIMEOUT_KEEP_ALIVE): a
    # burst of new streams then reuses warm connections instead of opening one each.
    upstream_keepalive_s: float = Field(default=4.0, gt=0)
    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    # Shutdown: /ready flips at once; serving continues for shutdown_delay_s (so load
    # balancers notice); then new requests get 503 + Retry-After while in-flight ones get up
    # to drain_timeout_s; streams still open then end with an in-band error and [DONE].
    shutdown_delay_s: float = Field(default=0.0, ge=0)
    drain_timeout_s: float = Field(default=30.0, ge=0)
    log_level: LogLevel = "info"
    # Single loggers' levels over log_level, "name=level,...": one part's detail without
    # every other's (`dflash.gateway.fastest=debug`: each `fastest` choice and why).
    log_levels: Annotated[dict[str, LogLevel], NoDecode] = Field(default_factory=dict)
    access_log: bool = False
    # Traffic capture for drafter training (docs/capture.md): a dataset URI (a folder, s3://,
    # gs://) the served requests are written to; None: off. With tenants, only those whose
    # `capture:` says so; without, every request (times each pool's `capture:`).
    capture_uri: str | None = None
    capture_shard_bytes: int = Field(default=8 * 1024 * 1024, ge=1024)  # uncompressed
    capture_flush_s: float = Field(default=60.0, gt=0)  # a shard is written at least this often
    capture_queue_bytes: int = Field(default=64 * 1024 * 1024, ge=1024)  # then samples drop
    capture_sample_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)  # larger: not captured
    capture_max_bytes: int | None = Field(default=10 * 1024**3, ge=1024)  # total; oldest go
    capture_retention_s: float | None = Field(default=7 * 86400.0, gt=0)
    # With redis_url: how often each gateway process hands its canaries' evidence over and
    # reads the shared rollouts and pins back (docs/gateway.md, "Automatic promotion").
    promotion_sync_s: float = Field(default=0.5, gt=0)
    # OpenTelemetry's own environment (OTEL_*), read with the rest (docs/tracing.md).
    tracing: TracingSettings = Field(default_factory=TracingSettings)

    @field_validator("workers", "api_keys", mode="before")
    @classmethod
    def _split_commas(cls, value: object) -> object:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("log_levels", mode="before")
    @classmethod
    def _split_log_levels(cls, value: object) -> object:
        if not isinstance(value, str):
            return value
        levels = {}
        for part in filter(None, (p.strip() for p in value.split(","))):
            name, sep, level = part.partition("=")
            if not sep or not name.strip():
                raise ValueError(f"expected logger=level, got {part!r}")
            levels[name.strip()] = level.strip().lower()
        return levels

    @field_validator("capture_uri")
    @classmethod
    def _check_capture_uri(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None  # an empty variable (a template's) is capture off, as unset is
        problem = dataset_scheme_problem(value)
        if problem is not None:
            raise ValueError(problem)
        return value

    @field_validator("redis_url")
    @classmethod
    def _check_redis_url(cls, value: str | None) -> str | None:
        if value is not None:
            RedisAddress.parse(value)
        return value

    @model_validator(mode="after")
    def _check_tls(self) -> GatewaySettings:
        tls = self.redis_url is not None and RedisAddress.parse(self.redis_url).tls
        given = [
            name
            for name in ("redis_tls_ca_file", "redis_tls_cert_file", "redis_tls_key_file")
            if getattr(self, name) is not None
        ]
        if not self.redis_tls_verify:
            given.append("redis_tls_verify")
        if given and not tls:
            raise ValueError(f"{', '.join(given)} need a rediss:// redis_url")
        if (self.redis_tls_cert_file is None) != (self.redis_tls_key_file is None):
            raise ValueError("redis_tls_cert_file and redis_tls_key_file go together")
        return self

    def redis_tls(self) -> TlsFiles:
        def text(path: Path | None) -> str | None:
            return None if path is None else str(path)

        return TlsFiles(
            ca_file=text(self.redis_tls_ca_file),
            cert_file=text(self.redis_tls_cert_file),
            key_file=text(self.redis_tls_key_file),
            verify=self.redis_tls_verify,
        )

    @model_validator(mode="after")
    def _check_pools(self) -> GatewaySettings:
        plain = self.workers or self.worker_dns or "gpus_per_worker" in self.model_fields_set
        if self.pools and plain:
            raise ValueError(
                "give pools, or workers/worker_dns/gpus_per_worker (one pool), not both"
            )
        check_pools(self.pools)
        owner: dict[str, str] = {}
        for pool in self.pools:
            for url in pool.workers:
                if url in owner:
                    raise ValueError(f"worker {url} is in pools {owner[url]!r} and {pool.name!r}")
                owner[url] = pool.name
        return self

    def pool_specs(self) -> list[PoolSpec]:
        """The configured pools; plain workers/worker_dns are one pool serving what they list."""
        if self.pools:
            return list(self.pools)
        if not self.workers and not self.worker_dns:
            return []
        return [
            PoolSpec(
                name=DEFAULT_POOL,
                workers=self.workers,
                worker_dns=self.worker_dns,
                gpus_per_worker=self.gpus_per_worker,
            )
        ]

    def capture_config(self) -> CaptureConfig | None:
        if self.capture_uri is None:
            return None
        return CaptureConfig(
            uri=self.capture_uri,
            shard_bytes=self.capture_shard_bytes,
            flush_s=self.capture_flush_s,
            queue_bytes=self.capture_queue_bytes,
            sample_bytes=self.capture_sample_bytes,
            max_bytes=self.capture_max_bytes,
            retention_s=self.capture_retention_s,
        )

    def load_key_ring(self) -> KeyRing:
        """Keys from env plus the key file (one per line, or the tenant format); no key
        means auth is disabled. Raises KeyFileError naming what is wrong in the file."""
        keys = [key for key in self.api_keys if key]
        if self.api_key_file is None:
            return KeyRing.plain(keys)
        return parse_key_file(self.api_key_file.read_text(), keys)
