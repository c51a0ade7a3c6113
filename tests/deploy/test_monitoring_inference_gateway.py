"""inferenceGateway.mode=inference: no dflash gateway, so no per-request acceptance histograms
and no gateway series. A real Prometheus, with the rules the chart renders in that mode, scrapes
a real embedded worker that takes its traffic directly (as the inference Gateway sends it to a
pool's pod); the dashboard's acceptance and worker panels still show data, from the workers' own
series through the engines' recording rules, and their values are the worker's counters."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import yaml

from tests.deploy.chart import COMPOSE_SELECTORS, DASHBOARD_FILE, find, render
from tests.deploy.promql import dashboard_targets, substitute_grafana_vars
from tests.deploy.stack import finite_values, query, running_prometheus
from tests.fixtures.tiny_models import TinyCheckpoint
from tests.fixtures.worker import metric, running_worker, scrape

pytestmark = pytest.mark.skipif(
    shutil.which("prometheus") is None, reason="prometheus missing: run `make tools`"
)

MODEL = "tiny"
INFERENCE_ONLY = (
    "inferenceGateway.mode=inference",
    "inferenceGateway.parentRefs[0].name=inference-gateway",
    "worker.requireApiKey=false",
    "monitoring.prometheusRule.enabled=true",
)
# The acceptance and worker panels; in this mode their worker targets must carry them.
WORKER_PANELS = {
    "Draft acceptance rate",
    "Acceptance by draft position",
    "Share of output tokens from drafts",
    "Time to first token",
    "Time per output token",
    "End-to-end latency",
    "Tokens per second",
    "Requests in flight and waiting",
    "KV cache usage",
}


@dataclass(frozen=True)
class Stack:
    prometheus: str
    worker: str  # base URL
    rules: dict[str, list[str]]  # group -> its record/alert names


def worker_target(expr: str) -> bool:
    return "worker:dflash_" in expr or "engine:dflash_worker_" in expr


def chat(client: openai.OpenAI, stream: bool) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "def add(a, b):"}],
        max_tokens=12,
        temperature=0,
        stream=stream,
        extra_body={"ignore_eos": True},
    )
    if stream:
        list(reply)  # type: ignore[arg-type]  # read to the end


@pytest.fixture(scope="module")
def stack(
    tiny_checkpoint: TinyCheckpoint, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    # The chart's rules in mode inference, with the compose stack's job names as selectors.
    spec = find(render(sets=INFERENCE_ONLY, set_json=COMPOSE_SELECTORS), "PrometheusRule")["spec"]
    rules = tmp_path_factory.mktemp("rules") / "inference-only.yaml"
    rules.write_text(yaml.safe_dump(spec))
    names = {g["name"]: [r.get("record") or r["alert"] for r in g["rules"]] for g in spec["groups"]}
    draft = {
        "method": "dflash",
        "model": str(tiny_checkpoint.drafter_dir),
        "num_speculative_tokens": 3,
    }
    args = (
        str(tiny_checkpoint.target_dir),
        "--speculative-config",
        json.dumps(draft),
        "--served-model-name",
        MODEL,
        "--max-model-len",
        "256",
        "--speculation",
        "fixed",  # vLLM's policy: every verify step drafts num_speculative_tokens
    )
    with running_worker(*args) as worker:
        hostport = worker.base_url.removeprefix("http://")
        with running_prometheus({"worker": [hostport]}, Path(rules)) as prometheus:
            # Counters at 0 in Prometheus first: their rates then cover all the traffic.
            deadline = time.monotonic() + 60
            while not finite_values(
                query(prometheus, 'vllm:spec_decode_num_drafts_total{job="worker"}')
            ):
                assert time.monotonic() < deadline, "the worker was not scraped in 60 s"
                time.sleep(0.25)
            client = openai.OpenAI(base_url=f"{worker.base_url}/v1", api_key="x", max_retries=0)
            # A request's histograms exist from its first observation on: one request, one
            # scrape of them, then the traffic, so their 5 min rates see it.
            chat(client, stream=False)
            deadline = time.monotonic() + 60
            while not query(prometheus, 'vllm:e2e_request_latency_seconds_count{job="worker"}'):
                assert time.monotonic() < deadline, "the first request's histograms not scraped"
                time.sleep(0.25)
            for i in range(6):  # streamed and not, straight to the worker
                chat(client, stream=bool(i % 2))
            deadline = time.monotonic() + 60
            while not finite_values(query(prometheus, "worker:dflash_spec_steps:rate5m > 0")):
                assert time.monotonic() < deadline, "no recorded verify steps after 60 s"
                time.sleep(0.5)
            time.sleep(3)  # a few more scrapes and rule evaluations of the final counters
            yield Stack(prometheus, worker.base_url, names)


def test_the_rules_of_mode_inference_read_no_gateway_series(stack: Stack) -> None:
    assert "dflash-serving.recording" not in stack.rules
    alerts = {n for names in stack.rules.values() for n in names}
    assert "DFlashGatewayDown" not in alerts and "DFlashDrafterMismatch" in alerts
    assert len(stack.rules["dflash-serving.engines"]) >= 8


def test_acceptance_and_worker_panels_show_data_from_the_workers(stack: Stack) -> None:
    targets = dashboard_targets(DASHBOARD_FILE)
    ours = [(t, e) for t, e in targets if worker_target(e)]
    assert {t for t, _ in ours} >= WORKER_PANELS, sorted(WORKER_PANELS - {t for t, _ in ours})

    def empty() -> list[tuple[str, str]]:
        return [
            (t, e)
            for t, e in ours
            if not finite_values(query(stack.prometheus, substitute_grafana_vars(e)))
        ]

    # A scrape that timed out on a loaded machine can leave a 5 min rate short of samples for
    # a moment: a bounded wait.
    deadline = time.monotonic() + 30
    while empty() and time.monotonic() < deadline:
        time.sleep(1)
    assert empty() == []
    for title, expr in targets:  # the gateway's series: there is no gateway in this mode
        if not worker_target(expr):
            result = query(stack.prometheus, substitute_grafana_vars(expr))
            assert not finite_values(result), (title, expr)


def test_the_recorded_acceptance_is_the_workers_own_counters(stack: Stack) -> None:
    """Every count started at 0 with Prometheus watching: the ratio of two rates over the
    window is the ratio of the worker's totals."""
    samples = scrape(stack.worker)
    accepted = metric(samples, "vllm:spec_decode_num_accepted_tokens_total")
    drafted = metric(samples, "vllm:spec_decode_num_draft_tokens_total")
    steps = metric(samples, "vllm:spec_decode_num_drafts_total")
    assert steps > 0 and drafted == 3 * steps
    rate = [
        e
        for t, e in dashboard_targets(DASHBOARD_FILE)
        if t == "Draft acceptance rate" and worker_target(e)
    ]
    got = finite_values(query(stack.prometheus, substitute_grafana_vars(rate[0])))
    assert got == pytest.approx([accepted / drafted], rel=1e-6)
    length = query(
        stack.prometheus,
        "1 + worker:dflash_spec_accepted_tokens:rate5m / worker:dflash_spec_steps:rate5m",
    )
    assert finite_values(length) == pytest.approx([1 + accepted / steps], rel=1e-6)
