"""Per-request `metrics` (vLLM 0.33) and the worker's /metrics: fields, arithmetic, agreement."""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from engine.worker.settings import load_settings
from engine.worker.state import build_engine
from tests.fixtures.tiny_models import TinyCheckpoint
from tests.fixtures.worker import AppHandle, metric, scrape, serving_app

NAME = "tiny"
K = 3
CONTRACT_NAMES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:spec_decode_num_drafts": "counter",
    "vllm:spec_decode_num_draft_tokens": "counter",
    "vllm:spec_decode_num_accepted_tokens": "counter",
    "vllm:spec_decode_num_accepted_tokens_per_pos": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
}


@pytest.fixture(scope="module")
def worker(tiny_checkpoint: TinyCheckpoint) -> Iterator[AppHandle]:
    ckpt = tiny_checkpoint
    settings = load_settings(
        model=str(ckpt.target_dir),
        served_model_name=NAME,
        max_model_len=512,
        speculative_config={"method": "dflash", "model": str(ckpt.drafter_dir)},
        per_request_spec_decode_metrics="detailed",
        speculation="fixed",  # vLLM's policy: K drafts every step, as its counters assume
    )
    # A pre-built engine handed to create_app (test_server covers the app loading its own).
    with serving_app(settings, engine=build_engine(settings)) as handle:
        yield handle


@pytest.fixture
def client(worker: AppHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{worker.base_url}/v1", api_key="x", max_retries=0)


def chat(client: openai.OpenAI, max_tokens: int, **kwargs: Any) -> Any:
    return client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "for i in range(10):"}],
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True},
        **kwargs,
    )


def check_spec_arithmetic(sd: dict[str, Any], completion_tokens: int) -> None:
    steps, hist = sd["num_spec_steps"], sd["acceptance_histogram"]
    accepted, drafted = sd["num_accepted_draft_tokens"], sd["num_draft_tokens"]
    assert sd["num_spec_tokens"] == K and len(hist) == K + 1
    assert sum(hist) == steps >= 1
    assert sum(j * n for j, n in enumerate(hist)) == accepted
    assert 0 <= accepted <= drafted == steps * K
    assert sd["mean_acceptance_length"] == pytest.approx(1 + accepted / steps)
    assert sd["draft_acceptance_rate"] == pytest.approx(accepted / drafted)
    assert sd["per_step_accepted"] == [a for a in sd["per_step_accepted"] if 0 <= a <= K]
    assert len(sd["per_step_accepted"]) == steps and sum(sd["per_step_accepted"]) == accepted
    assert sum(sd["per_step_drafted"]) == drafted
    # One token from prefill, then accepted + 1 bonus per step (the last step may be cut).
    assert steps < completion_tokens <= 1 + steps + accepted


def test_response_metrics_fields_and_arithmetic(client: openai.OpenAI) -> None:
    resp = chat(client, 40)
    assert resp.usage is not None
    n = resp.usage.completion_tokens
    m = (resp.model_extra or {})["metrics"]
    assert set(m) == {
        "time_to_first_token_ms",
        "generation_time_ms",
        "queue_time_ms",
        "mean_itl_ms",
        "tokens_per_second",
        "speculative_decoding",
    }
    assert m["time_to_first_token_ms"] >= 0 and m["queue_time_ms"] >= 0
    assert m["mean_itl_ms"] == pytest.approx(m["generation_time_ms"] / (n - 1))
    assert m["tokens_per_second"] > 0
    check_spec_arithmetic(m["speculative_decoding"], n)


def test_stream_usage_chunk_metrics_agree_with_prometheus(
    client: openai.OpenAI, worker: AppHandle
) -> None:
    before = scrape(worker.base_url)
    chunks = list(chat(client, 30, stream=True, stream_options={"include_usage": True}))
    after = scrape(worker.base_url)
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    sd = (last.model_extra or {})["metrics"]["speculative_decoding"]
    check_spec_arithmetic(sd, last.usage.completion_tokens)

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("vllm:spec_decode_num_drafts_total") == sd["num_spec_steps"]
    assert delta("vllm:spec_decode_num_draft_tokens_total") == sd["num_draft_tokens"]
    assert delta("vllm:spec_decode_num_accepted_tokens_total") == sd["num_accepted_draft_tokens"]
    for pos in range(K):  # steps that accepted draft `pos` = steps accepting more than pos
        expected = sum(1 for a in sd["per_step_accepted"] if a > pos)
        got = delta("vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(pos))
        assert got == expected
    assert delta("vllm:generation_tokens_total") == last.usage.completion_tokens
    assert delta("vllm:prompt_tokens_total") == last.usage.prompt_tokens
    for name in (
        "vllm:e2e_request_latency_seconds_count",
        "vllm:time_to_first_token_seconds_count",
    ):
        assert delta(name) == 1
    assert delta("vllm:request_success_total", finished_reason="length") == 1
    assert delta("vllm:inter_token_latency_seconds_count") >= 1
    assert metric(after, "vllm:num_requests_running") == 0


def test_exposition_has_vllm_names_and_types(worker: AppHandle) -> None:
    text = httpx.get(f"{worker.base_url}/metrics").text
    for name, kind in CONTRACT_NAMES.items():
        exposed = f"{name}_total" if kind == "counter" else name  # text format 0.0.4
        assert f"# TYPE {exposed} {kind}" in text, name
    assert f'model_name="{NAME}"' in text


def test_promtool_accepts_the_exposition(worker: AppHandle) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not on PATH (make tools)")
    text = httpx.get(f"{worker.base_url}/metrics").text
    proc = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    report = proc.stdout + proc.stderr
    # Exit 3 = lint findings only; vLLM's names carry ':', which promtool's lint dislikes.
    assert proc.returncode in (0, 3), report
    findings = [line for line in report.splitlines() if line.strip()]
    assert all("should not contain ':'" in line for line in findings), report


# ---- the model-server protocol series under load ------------------------------------------
# The Gateway API Inference Extension's endpoint picker scores a vLLM pod on
# vllm:num_requests_waiting, vllm:num_requests_running, vllm:kv_cache_usage_perc and the
# block_size / num_gpu_blocks labels of vllm:cache_config_info (its engine config for vllm at
# v1.5.0: tests/fixtures/inference-extension/epp-v1.5.0.json).

SLOTS = 2
LONG = {"prompt": "x", "max_tokens": 900, "ignore_eos": True, "temperature": 0, "stream": True}


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint: TinyCheckpoint) -> Iterator[tuple[AppHandle, Any]]:
    settings = load_settings(
        model=str(tiny_checkpoint.target_dir),
        served_model_name=NAME,
        max_model_len=1024,
        max_num_seqs=SLOTS,
        max_waiting=4,
    )
    engine = build_engine(settings)
    with serving_app(settings, engine=engine) as handle:
        yield handle, engine


def wait_until(check: Any, timeout: float = 60.0) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return False


def cache_info(samples: dict[str, float]) -> dict[str, str]:
    """The labels of the one vllm:cache_config_info sample (its value must be 1)."""
    keys = [k for k in samples if k.startswith("vllm:cache_config_info{")]
    assert len(keys) == 1, keys
    assert samples[keys[0]] == 1
    return dict(re.findall(r'(\w+)="([^"]*)"', keys[0]))


def test_model_server_protocol_series_follow_the_engine_under_load(
    loaded: tuple[AppHandle, Any],
) -> None:
    handle, engine = loaded
    idle = scrape(handle.base_url)
    info = cache_info(idle)
    stats = engine.stats()
    assert info["num_gpu_blocks"] == str(SLOTS) == str(stats.kv_num_blocks)
    assert info["block_size"] == str(stats.kv_block_size) and stats.kv_block_size >= 1024
    assert info["cache_dtype"] == "auto" and info["engine"] == "0"
    assert metric(idle, "vllm:kv_cache_usage_perc") == 0
    url = f"{handle.base_url}/v1/completions"
    with httpx.Client(timeout=120) as http, contextlib.ExitStack() as streams:
        lines = []
        for _ in range(SLOTS + 1):  # one more than the slots: it waits
            r = streams.enter_context(http.stream("POST", url, json=LONG))
            lines.append(r.iter_lines())
        for it in lines[:SLOTS]:
            next(line for line in it if line.startswith("data: "))
        assert wait_until(lambda: engine.stats().num_waiting == 1)
        before = engine.stats()
        samples = scrape(handle.base_url)
        after = engine.stats()
        assert metric(samples, "vllm:num_requests_running") == before.num_running == SLOTS
        assert metric(samples, "vllm:num_requests_waiting") == before.num_waiting == 1
        usage = metric(samples, "vllm:kv_cache_usage_perc")
        # Running rows only grow while none finishes: the scrape lies between two readings.
        assert 0 < before.kv_cache_usage <= usage <= after.kv_cache_usage < 1
        tokens = usage * stats.kv_block_size * stats.kv_num_blocks  # positions committed
        assert tokens == pytest.approx(round(tokens))
        assert wait_until(
            lambda: metric(scrape(handle.base_url), "vllm:kv_cache_usage_perc") > usage
        )
    # Clients gone: the engine drops their rows and the gauges fall back to zero.
    assert wait_until(lambda: engine.stats().num_running == engine.stats().num_waiting == 0)
    done = scrape(handle.base_url)
    assert (
        metric(done, "vllm:num_requests_running") == metric(done, "vllm:num_requests_waiting") == 0
    )
    assert metric(done, "vllm:kv_cache_usage_perc") == 0
    assert cache_info(done) == info


def test_an_adapted_drafter_exports_what_its_adaptation_measured(
    tmp_path: Any, tiny_checkpoint: TinyCheckpoint
) -> None:
    """dflash-train adapt's manifest.json beside the drafter becomes two gauges; a drafter
    without one exports neither (docs/capture.md)."""
    import json

    from engine.worker.metrics import WorkerMetrics
    from engine.worker.state import adaptation

    manifest = {
        "steps": 120,
        "tau": {"traffic": {"before": 3.2, "after": 5.1}, "recipe": {"before": 4.2, "after": 4.1}},
    }
    from tests.service.conftest import sample

    text = WorkerMetrics(NAME, lambda: None, manifest).exposition().decode()
    assert sample(text, "dflash:drafter_adaptation_tau", data="traffic", when="after") == 5.1
    assert sample(text, "dflash:drafter_adaptation_tau", data="recipe", when="before") == 4.2
    assert sample(text, "dflash:drafter_adaptation_steps") == 120
    plain = WorkerMetrics(NAME, lambda: None).exposition().decode()
    assert "dflash:drafter_adaptation" not in plain

    drafter = tmp_path / "adapted"
    shutil.copytree(tiny_checkpoint.drafter_dir, drafter)
    (drafter / "manifest.json").write_text(json.dumps(manifest))
    spec = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": 3}
    settings = load_settings(model=str(tiny_checkpoint.target_dir), speculative_config=spec)
    assert adaptation(settings) == manifest
    (drafter / "manifest.json").write_text("{truncated")
    assert adaptation(settings) is None  # unreadable: warned, no gauges, the worker serves
