"""The worker's Prometheus exposition, with vLLM's metric names (ARCHITECTURE.md, "The worker
wire contract").

Load and speculation counters are read from `Engine.stats()` at scrape time by a custom
collector (the engine owns the counts; nothing is double-booked), latency histograms are
observed here once per finished request. Each app owns its CollectorRegistry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
)
ITL_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (
    0.05,
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
)


class EngineStatsView(Protocol):
    """What the collector reads from `Engine.stats()` (engine.engine.EngineStats)."""

    @property
    def num_running(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def kv_cache_usage(self) -> float: ...
    @property
    def kv_block_size(self) -> int: ...
    @property
    def kv_num_blocks(self) -> int: ...
    @property
    def num_drafts(self) -> int: ...
    @property
    def num_draft_tokens(self) -> int: ...
    @property
    def num_accepted_tokens(self) -> int: ...
    @property
    def accepted_per_pos(self) -> list[int]: ...
    @property
    def steps_by_k(self) -> list[int]: ...
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def generation_tokens(self) -> int: ...
    @property
    def step_seconds(self) -> dict[str, float]: ...
    @property
    def step_counts(self) -> dict[str, int]: ...


StatsSource = Callable[[], "EngineStatsView | None"]


class EngineCollector(Collector):
    """Gauges and cumulative counters straight from the engine, at scrape time."""

    def __init__(self, source: StatsSource, model_name: str) -> None:
        self._source = source
        self._labels = {"model_name": model_name, "engine": "0"}

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=list(self._labels))
        g.add_metric(list(self._labels.values()), value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=list(self._labels))
        c.add_metric(list(self._labels.values()), value)
        return c

    def collect(self) -> Iterator[Metric]:
        s = self._source()
        if s is None:  # still loading: the names exist, at zero
            yield from self._gauges(0, 0, 0.0)
            return
        yield from self._gauges(s.num_running, s.num_waiting, s.kv_cache_usage)
        yield self._cache_config_info(s)
        yield self._counter("vllm:spec_decode_num_drafts", "Verify steps.", s.num_drafts)
        yield self._counter(
            "vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.", s.num_draft_tokens
        )
        yield self._counter(
            "vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", s.num_accepted_tokens
        )
        per_pos = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens by position in the block.",
            labels=[*self._labels, "position"],
        )
        for pos, count in enumerate(s.accepted_per_pos):
            per_pos.add_metric([*self._labels.values(), str(pos)], count)
        yield per_pos
        by_k = CounterMetricFamily(
            "dflash:spec_decode_steps_by_num_drafts",
            "Row-steps by the number of draft tokens verified (adaptive speculation chooses "
            "it per step; 0 = a plain decoding step).",
            labels=[*self._labels, "num_drafts"],
        )
        for k, count in enumerate(s.steps_by_k):
            by_k.add_metric([*self._labels.values(), str(k)], count)
        yield by_k
        yield self._counter("vllm:prompt_tokens", "Prefill tokens processed.", s.prompt_tokens)
        yield self._counter("vllm:generation_tokens", "Tokens generated.", s.generation_tokens)
        yield from self._step_profile(s)

    def _step_profile(self, s: EngineStatsView) -> Iterator[Metric]:
        """Where the engine's time goes, per kind of forward: prefill, drafting groups,
        plain groups and the catch-up of drafter context before a drafting group."""
        for name, doc, values in (
            ("dflash:engine_step_seconds", "Seconds of engine forwards by kind.", s.step_seconds),
            ("dflash:engine_steps", "Engine forwards by kind.", s.step_counts),
        ):
            family = CounterMetricFamily(name, doc, labels=[*self._labels, "kind"])
            for kind, value in values.items():
                family.add_metric([*self._labels.values(), kind], value)
            yield family

    def _cache_config_info(self, s: EngineStatsView) -> Metric:
        """vLLM's info gauge (always 1): its cache config as labels, named as vLLM's
        CacheConfig fields (a few of real vLLM 0.32's many), without model_name (vLLM labels it
        by engine only). The Gateway API Inference Extension's endpoint picker reads
        block_size x num_gpu_blocks as the cache's size in tokens; here a block is a request's
        slot (max_model_len positions plus room for one draft block)."""
        info = {
            "block_size": str(s.kv_block_size),
            "num_gpu_blocks": str(s.kv_num_blocks),
            "cache_dtype": "auto",  # vLLM's word for the model's dtype: the cache's here
            "enable_prefix_caching": "False",  # a slot starts empty: no prefix is reused
            "engine": self._labels["engine"],
        }
        g = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=list(info)
        )
        g.add_metric(list(info.values()), 1)
        return g

    def _gauges(self, running: int, waiting: int, kv: float) -> Iterator[Metric]:
        yield self._gauge("vllm:num_requests_running", "Requests in engine slots.", running)
        yield self._gauge("vllm:num_requests_waiting", "Requests waiting for a slot.", waiting)
        yield self._gauge("vllm:kv_cache_usage_perc", "KV cache usage (1 = full).", kv)


def describe_adaptation(
    registry: CollectorRegistry, model_name: str, manifest: dict[str, Any]
) -> None:
    """The served drafter's `dflash-train adapt` run (its manifest.json, docs/capture.md): the
    mean acceptance length it measured before and after, on held-out traffic and on the
    recipe's prompts, and the run's size. A dashboard shows what the canary was adapted to
    reach beside what it reaches live."""
    tau = Gauge(
        "dflash:drafter_adaptation_tau",
        "Acceptance length (tau at T=0) the served drafter's adaptation measured",
        ["model_name", "data", "when"],
        registry=registry,
    )
    measured = manifest.get("tau")
    for data in ("traffic", "recipe"):
        values = measured.get(data) if isinstance(measured, dict) else None
        for when in ("before", "after"):
            value = values.get(when) if isinstance(values, dict) else None
            if isinstance(value, int | float) and not isinstance(value, bool):
                tau.labels(model_name, data, when).set(float(value))
    runs = Gauge(
        "dflash:drafter_adaptation_steps",
        "Training steps of the served drafter's adaptation (absent: not an adapted drafter)",
        ["model_name"],
        registry=registry,
    )
    steps = manifest.get("steps")
    if isinstance(steps, int) and not isinstance(steps, bool):
        runs.labels(model_name).set(steps)


class WorkerMetrics:
    """The app's registry: the engine collector plus per-request histograms."""

    def __init__(
        self, model_name: str, source: StatsSource, adaptation: dict[str, Any] | None = None
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(EngineCollector(source, model_name))
        if adaptation is not None:
            describe_adaptation(self.registry, model_name, adaptation)
        labels = ["model_name"]
        self._model = model_name
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Arrival to first token.",
            labels,
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Gap between successive outputs of a request.",
            labels,
            buckets=ITL_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Arrival to finish.",
            labels,
            buckets=E2E_BUCKETS,
            registry=self.registry,
        )
        self.success = Counter(
            "vllm:request_success",
            "Finished requests by reason.",
            [*labels, "finished_reason"],
            registry=self.registry,
        )

    def observe_itl(self, seconds: float) -> None:
        self.itl.labels(self._model).observe(seconds)

    def observe_finished(self, ttft_s: float | None, e2e_s: float, reason: str) -> None:
        if ttft_s is not None:
            self.ttft.labels(self._model).observe(ttft_s)
        self.e2e.labels(self._model).observe(e2e_s)
        self.success.labels(self._model, reason).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
