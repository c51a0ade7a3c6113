"""End to end: a real Prometheus scrapes a real gateway and two real embedded workers while
the OpenAI SDK sends traffic to two pools of one model (the canary's worker is killed mid-way,
so errors and retries happen too, and its share moves to the baseline);
then every metric the dashboard and the alerts read is in the components' real /metrics, and
the dashboard's acceptance and latency queries return data."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.deploy.chart import DASHBOARD_FILE, RULES_FILE
from tests.deploy.promql import (
    dashboard_targets,
    exposition_names,
    metric_names,
    recorded_names,
    rule_exprs,
    substitute_grafana_vars,
)
from tests.deploy.stack import finite_values, query, running_gateway, running_prometheus
from tests.fixtures.tiny_models import TinyCheckpoint
from tests.fixtures.worker import WorkerHandle, running_worker

pytestmark = pytest.mark.skipif(
    shutil.which("prometheus") is None, reason="prometheus missing: run `make tools`"
)

MODEL = "tiny"
PROMPT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "def add(a, b):"}]
# Panels whose every query must return data once traffic has flowed.
MUST_HAVE_DATA = {
    "Acceptance length distribution (per request)",
    "Acceptance length: quantiles and mean",
    "Draft acceptance rate",
    "Acceptance by draft position",
    "Share of output tokens from drafts",
    "Time to first token",
    "Time per output token",
    "End-to-end latency",
    "Tokens per second",
    "Requests in flight and waiting",
    "KV cache usage",
    "Requests per second by status",
    # The pools row: the two workers are two pools of one model (a canary and its baseline).
    "Acceptance length by pool",
    "Time per output token by pool",
    "Traffic share by pool",
    "Output tokens per second by pool",
    "Output tokens per second per GPU by pool",
    # The tenants row: traffic comes with a tenant's key; another tenant is refused once.
    "Requests per second by tenant",
    "Tokens per second by tenant",
    "Rate-limited requests by tenant",
    "Tokens per minute against the limit",
}
TENANTS = """
tenants:
  - {name: team, keys: [sk-team], requests_per_minute: 1000, tokens_per_minute: 100000}
  - {name: batch, keys: [sk-batch], requests_per_minute: 1}
"""


@dataclass(frozen=True)
class Stack:
    gateway: str
    prometheus: str
    workers: list[str]  # host:port of both workers
    exported: set[str]  # sample names in the gateway's and the live worker's /metrics


def send(client: openai.OpenAI, stream: bool) -> None:
    extra = {"ignore_eos": True}
    if stream:
        # Read to the end: a stream left half-read is closed by the garbage collector later,
        # inside another request's connection-pool lock (httpcore then deadlocks).
        chunks = list(
            client.chat.completions.create(
                model=MODEL,
                messages=PROMPT,
                max_tokens=12,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body=extra,
            )
        )
        assert any(c.usage for c in chunks)
    else:
        reply = client.chat.completions.create(
            model=MODEL, messages=PROMPT, max_tokens=12, temperature=0, extra_body=extra
        )
        assert reply.usage is not None and reply.usage.completion_tokens == 12


def traffic(client: openai.OpenAI, streams: int, unary: int) -> None:
    for i in range(max(streams, unary)):
        if i < streams:
            send(client, stream=True)
        if i < unary:
            send(client, stream=False)


def start_both(
    es: contextlib.ExitStack,
    first: ContextManager[WorkerHandle],
    second: ContextManager[WorkerHandle],
) -> tuple[WorkerHandle, WorkerHandle]:
    """Enter two worker contexts at once (model loads overlap); both exit with `es`."""
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(cm.__enter__) for cm in (first, second)]
    for cm, future in zip((first, second), futures, strict=True):
        if future.exception() is None:
            es.push(cm.__exit__)
    return futures[0].result(), futures[1].result()


def hostport(url: str) -> str:
    return url.removeprefix("http://")


def wait_for_scrapes(
    prometheus: str,
    job: str,
    after: float,
    targets: int = 1,
    count: int = 2,
    instance: str | None = None,
) -> None:
    """Bounded wait until each of `job`'s `targets` (or its one `instance`) has been scraped
    SUCCESSFULLY (up == 1) at least `count` times after `after` (unix time). A scrape that
    timed out on a busy machine also moves `up`'s timestamp, but leaves the target's own
    series out."""
    selector = f'job="{job}"' + ("" if instance is None else f',instance="{instance}"')
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stamps = query(prometheus, f"timestamp(up{{{selector}}})")
        ups = query(prometheus, f"up{{{selector}}}")
        if (
            len(stamps) == targets
            and all(float(r["value"][1]) == 1 for r in ups)
            and min(float(r["value"][1]) for r in stamps) > after + count - 1
        ):
            return
        time.sleep(0.25)
    raise TimeoutError(f"{job}: {targets} targets not scraped {count} times after {after}")


@pytest.fixture(scope="module")
def stack(
    tiny_checkpoint: TinyCheckpoint, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    spec = json.dumps(
        {"method": "dflash", "model": str(tiny_checkpoint.drafter_dir), "num_speculative_tokens": 3}
    )
    args = (
        str(tiny_checkpoint.target_dir),
        "--speculative-config",
        spec,
        "--served-model-name",
        MODEL,
        "--max-model-len",
        "256",
        "--max-num-seqs",
        "4",
    )
    workdir = tmp_path_factory.mktemp("stack")
    with contextlib.ExitStack() as es:
        live, doomed = start_both(es, running_worker(*args), running_worker(*args))
        # Two pools of one model, one worker each: requests alternate between them. Active
        # health checks are rare here, so the killed worker is found by a request.
        pools = workdir / "pools.yaml"
        pools.write_text(
            json.dumps(
                [
                    {"name": "baseline", "model": MODEL, "weight": 1, "workers": [live.base_url]},
                    {"name": "canary", "model": MODEL, "weight": 1, "workers": [doomed.base_url]},
                ]
            )
        )
        keys = workdir / "tenants.yaml"
        keys.write_text(TENANTS)
        gateway = es.enter_context(
            running_gateway(
                [],
                workdir,
                "--pools",
                str(pools),
                "--health-interval-s",
                "300",
                "--api-key-file",
                str(keys),
            )
        )
        prometheus = es.enter_context(
            running_prometheus(
                {
                    "gateway": [hostport(gateway)],
                    "worker": [hostport(live.base_url), hostport(doomed.base_url)],
                },
                RULES_FILE,
            )
        )
        client = openai.OpenAI(base_url=f"{gateway}/v1", api_key="sk-team", max_retries=0)
        traffic(client, streams=1, unary=1)  # every series exists before the measured phase
        now = time.time()
        wait_for_scrapes(prometheus, "gateway", now)
        wait_for_scrapes(prometheus, "worker", now, targets=2)
        doomed.process.send_signal(signal.SIGKILL)
        doomed.process.wait(timeout=10)
        # Two at once: least-outstanding routing sends one to the dead worker, which fails
        # before the first byte and is retried on the live one.
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(send, [client, client], [False, True]))
        traffic(client, streams=4, unary=2)
        # One refusal of the gateway's own (a model nobody serves), for the errors panel.
        refused = {"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}
        team = {"Authorization": "Bearer sk-team"}
        answer = httpx.post(f"{gateway}/v1/chat/completions", json=refused, headers=team)
        assert answer.status_code == 404
        # A tenant over its limit: its second request in the minute is refused.
        batch = openai.OpenAI(base_url=f"{gateway}/v1", api_key="sk-batch", max_retries=0)
        send(batch, stream=False)
        with pytest.raises(openai.RateLimitError):
            send(batch, stream=False)
        exported = exposition_names(httpx.get(f"{gateway}/metrics", timeout=10).text)
        exported |= exposition_names(httpx.get(f"{live.base_url}/metrics", timeout=10).text)
        # The panels read the workers' series too: the live worker's last requests must be
        # scraped (on a busy machine a scrape can lag the traffic by seconds).
        after = time.time()
        wait_for_scrapes(prometheus, "gateway", after)
        wait_for_scrapes(prometheus, "worker", after, instance=hostport(live.base_url))
        yield Stack(
            gateway, prometheus, [hostport(live.base_url), hostport(doomed.base_url)], exported
        )


def test_every_metric_used_is_exported(stack: Stack) -> None:
    used: set[str] = set()
    for _, expr in dashboard_targets(DASHBOARD_FILE) + rule_exprs(RULES_FILE):
        used |= metric_names(expr)
    used -= recorded_names(RULES_FILE)
    # SGLang's and TensorRT-LLM's series: test_monitoring_engines.py
    used = {n for n in used if not n.startswith(("sglang:", "trtllm_"))}
    assert len(used) >= 25
    assert used <= stack.exported, sorted(used - stack.exported)


def test_every_dashboard_query_evaluates(stack: Stack) -> None:
    for title, expr in dashboard_targets(DASHBOARD_FILE):
        query(stack.prometheus, substitute_grafana_vars(expr))  # raises on a PromQL error
        assert title


def test_acceptance_and_latency_queries_return_data(stack: Stack) -> None:
    empty = []
    for title, expr in dashboard_targets(DASHBOARD_FILE):
        if title in MUST_HAVE_DATA:
            result = query(stack.prometheus, substitute_grafana_vars(expr))
            if not finite_values(result):
                empty.append((title, expr))
    assert empty == []


def test_acceptance_values_are_plausible(stack: Stack) -> None:
    # 3 draft tokens per step: the mean acceptance length lies in [1, 4].
    mean = next(e for t, e in dashboard_targets(DASHBOARD_FILE) if "1 + sum(rate" in e)
    values = finite_values(query(stack.prometheus, substitute_grafana_vars(mean)))
    assert values and all(1.0 <= v <= 4.0 for v in values)
    positions = query(
        stack.prometheus,
        substitute_grafana_vars(
            next(e for t, e in dashboard_targets(DASHBOARD_FILE) if "by_position" in e)
        ),
    )
    assert {r["metric"]["position"] for r in positions} == {"0", "1", "2"}
    assert all(0.0 <= v <= 1.0 for v in finite_values(positions))


def test_errors_and_worker_health_show_the_killed_worker(stack: Stack) -> None:
    errors = query(stack.prometheus, "sum by (worker, kind) (dflash_upstream_errors_total)")
    assert errors and all(float(r["value"][1]) >= 1 for r in errors)
    assert finite_values(query(stack.prometheus, "sum(dflash_retries_total)")) >= [1.0]
    panels = {t: e for t, e in dashboard_targets(DASHBOARD_FILE)}
    assert finite_values(query(stack.prometheus, substitute_grafana_vars(panels["Worker health"])))


def test_variables_and_recording_rules_on_real_data(stack: Stack) -> None:
    models = httpx.get(
        f"{stack.prometheus}/api/v1/label/model/values",
        params={"match[]": "dflash_requests_total"},
        timeout=10,
    ).json()["data"]
    assert models == sorted([MODEL, "unknown"])  # "unknown": the refusal, before any model
    workers = httpx.get(
        f"{stack.prometheus}/api/v1/label/instance/values",
        params={"match[]": "vllm:num_requests_running"},
        timeout=10,
    ).json()["data"]
    assert sorted(workers) == sorted(stack.workers)  # the killed one too: it was scraped
    length = finite_values(query(stack.prometheus, "model:dflash_spec_acceptance_length:mean15m"))
    assert length and 1.0 <= length[0] <= 4.0
    assert finite_values(query(stack.prometheus, "model:dflash_time_to_first_token_seconds:p95_5m"))


def test_both_pools_show_side_by_side(stack: Stack) -> None:
    panels = {t: e for t, e in dashboard_targets(DASHBOARD_FILE)}
    for title in ("Acceptance length by pool", "Output tokens per second by pool"):
        result = query(stack.prometheus, substitute_grafana_vars(panels[title]))
        assert {r["metric"]["pool"] for r in result} == {"baseline", "canary"}, title
    # Only the baseline has a healthy worker left: only it has GPUs to divide by.
    per_gpu = query(
        stack.prometheus,
        substitute_grafana_vars(panels["Output tokens per second per GPU by pool"]),
    )
    assert {r["metric"]["pool"] for r in per_gpu} == {"baseline"}
    length = query(stack.prometheus, "pool:dflash_spec_acceptance_length:mean15m")
    assert {r["metric"]["pool"] for r in length} == {"baseline", "canary"}
    assert all(1.0 <= v <= 4.0 for v in finite_values(length))


def test_the_readmes_pool_comparison_query_returns_both_pools(stack: Stack) -> None:
    readme = (Path(__file__).resolve().parents[2] / "docs/gateway.md").read_text()
    (promql,) = re.findall(r"^```promql\n(.*?)^```", readme, flags=re.M | re.S)
    result = query(stack.prometheus, promql.replace('"tiny-coder"', f'"{MODEL}"'))
    assert {r["metric"]["pool"] for r in result} == {"baseline", "canary"}
    assert all(1.0 <= v <= 4.0 for v in finite_values(result))


def test_tenants_show_apart(stack: Stack) -> None:
    panels = {title: expr for title, expr in dashboard_targets(DASHBOARD_FILE)}
    requests = query(
        stack.prometheus, substitute_grafana_vars(panels["Requests per second by tenant"])
    )
    assert {r["metric"]["tenant"] for r in requests} == {"team", "batch"}
    limited = query(
        stack.prometheus, substitute_grafana_vars(panels["Rate-limited requests by tenant"])
    )
    assert {(r["metric"]["tenant"], r["metric"]["limit"]) for r in limited} == {
        ("batch", "requests")
    }
    against = query(
        stack.prometheus, substitute_grafana_vars(panels["Tokens per minute against the limit"])
    )
    assert {r["metric"]["tenant"] for r in against} == {"team"}  # batch has no token limit
    assert all(0 < v < 1 for v in finite_values(against))
