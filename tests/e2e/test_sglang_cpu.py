"""End to end on REAL SGLang (0.5.23, the `.venv-sglang` `make sglang-env` builds: CPU torch,
no CUDA), started the way users start it, `dflash-worker --backend sglang`, serving the bundled
target with PLAIN decoding (SGLang refuses DFlash on a CPU), behind the real gateway as a pool
whose engine is sglang: the wire contract (stream, usage, errors, disconnect), greedy parity
with transformers, and a real Prometheus reading SGLang's own /metrics through the chart's
recording rules. SGLang's DFlash responses need a GPU: tests/fixtures/engine_wires.py.

SGLang on a CPU torch needs two stand-ins (tests/fixtures/sglang_cpu/sitecustomize.py) and the
torch-native attention and sampling; one start (~35 s) serves the module.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.worker.settings import BUNDLED_TARGET
from tests.deploy.chart import RULES_FILE
from tests.deploy.stack import finite_values, query, running_gateway, running_prometheus
from tests.fixtures.sglang_parser import SGLANG_PYTHON, require_sglang_env
from tests.fixtures.worker import ROOT, WorkerHandle, running_worker

MODEL = "tiny-coder"
SHIM = ROOT / "tests" / "fixtures" / "sglang_cpu"
SGLANG_CPU = (
    "--backend",
    "sglang",
    "--no-speculation",
    "--device",
    "cpu",
    "--dtype",
    "float32",
    "--max-model-len",
    "1024",
    "--max-num-seqs",
    "4",
    # SGLang's own flags (passed through): its CPU path in plain torch, a small KV cache
    # (sized from host memory otherwise), and no busy-polling scheduler while idle.
    "--attention-backend=torch_native",
    "--sampling-backend=pytorch",
    "--disable-cuda-graph",
    "--max-total-tokens=16384",
    "--sleep-on-idle",
)


@dataclass(frozen=True)
class Stack:
    sglang: WorkerHandle
    gateway: str


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    require_sglang_env()
    env = {
        # dflash-worker execs `python3` from PATH: SGLang's environment's.
        "PATH": f"{SGLANG_PYTHON.parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(SHIM),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    workdir = tmp_path_factory.mktemp("sglang")
    with contextlib.ExitStack() as es:
        # SGLang's /health runs a one-token generation when idle: on these 2 shared cores that
        # can take longer than the gateway's default 1 s (on a GPU it takes milliseconds).
        mp = es.enter_context(pytest.MonkeyPatch.context())
        mp.setenv("DFLASH_GATEWAY_HEALTH_TIMEOUT_S", "20")
        sglang = es.enter_context(running_worker(*SGLANG_CPU, env=env, startup_timeout=240))
        pools = workdir / "pools.json"
        pools.write_text(
            json.dumps(
                [{"name": "sg", "model": MODEL, "engine": "sglang", "workers": [sglang.base_url]}]
            )
        )
        gateway = es.enter_context(running_gateway([], workdir, "--pools", str(pools)))
        yield Stack(sglang, gateway)


def sdk(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.gateway}/v1", api_key="unused", max_retries=0)


def chat(content: str) -> list[Any]:
    return [{"role": "user", "content": content}]


def test_sglang_is_what_serves(stack: Stack) -> None:
    log = stack.sglang.log()
    assert "starting SGLang" in log and "sglang.launch_server" in log
    info = httpx.get(f"{stack.sglang.base_url}/get_server_info", timeout=10).json()
    assert info["version"].startswith("0.5.23")
    assert info["device"] == "cpu" and info["served_model_name"] == MODEL


def test_chat_through_the_gateway_with_usage(stack: Stack) -> None:
    reply = sdk(stack).chat.completions.create(
        model=MODEL, messages=chat("def add(a, b):"), max_tokens=8, temperature=0
    )
    assert reply.choices[0].message.content
    assert reply.usage is not None and 1 <= reply.usage.completion_tokens <= 8
    # The gateway asked SGLang for its speculation details; a client that did not ask gets none.
    assert "sglext" not in reply.model_dump()


def test_greedy_completion_equals_transformers(stack: Stack) -> None:
    prompt = "def is_prime(n):"
    reply = sdk(stack).completions.create(
        model=MODEL, prompt=prompt, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    )
    tok = AutoTokenizer.from_pretrained(BUNDLED_TARGET)
    hf = AutoModelForCausalLM.from_pretrained(BUNDLED_TARGET, dtype=torch.float32)
    ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)])
    out = hf.generate(ids, max_new_tokens=16, do_sample=False)
    assert reply.choices[0].text == tok.decode(out[0, ids.shape[1] :])


@pytest.mark.parametrize("include_usage", [True, False])
def test_stream_usage_is_as_openai_defines_it(stack: Stack, include_usage: bool) -> None:
    options = {"include_usage": True} if include_usage else None
    chunks = list(
        sdk(stack).chat.completions.create(
            model=MODEL,
            messages=chat("class Stack:"),
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options=options,  # type: ignore[arg-type]
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    with_usage = [c for c in chunks if c.usage is not None]
    if include_usage:
        (last,) = with_usage
        assert chunks[-1] is last and last.choices == []
        assert last.usage is not None and 1 <= last.usage.completion_tokens <= 6
    else:
        assert with_usage == []
    assert not any("sglext" in c.model_dump() for c in chunks)


def test_sglangs_refusal_reaches_the_client_as_an_openai_error(stack: Stack) -> None:
    """A prompt longer than the context: SGLang's 400, relayed in OpenAI's error shape, and
    the worker stays in rotation (bad input never ejects a healthy worker)."""
    client = sdk(stack)
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=chat("x " * 3000), max_tokens=4)
    body = exc.value.response.json()
    assert set(body) == {"error"}, body
    assert "context length" in body["error"]["message"]
    assert body["error"]["code"] == 400
    for _ in range(2):
        reply = client.chat.completions.create(
            model=MODEL, messages=chat("x = 1"), max_tokens=2, temperature=0
        )
        assert reply.choices[0].message.content is not None


def running_requests(stack: Stack) -> float:
    text = httpx.get(f"{stack.sglang.base_url}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("sglang:num_running_reqs{")
    )


def test_a_client_that_disconnects_frees_sglangs_slot(stack: Stack) -> None:
    body = {
        "model": MODEL,
        "messages": chat("def long():"),
        "max_tokens": 400,
        "stream": True,
        "ignore_eos": True,
    }
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", f"{stack.gateway}/v1/chat/completions", json=body) as response,
    ):
        assert response.status_code == 200
        next(response.iter_lines())
    deadline = time.monotonic() + 30
    while running_requests(stack) > 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert running_requests(stack) == 0  # SGLang aborted it: not 400 tokens later
    reply = sdk(stack).chat.completions.create(model=MODEL, messages=chat("y = 2"), max_tokens=2)
    assert reply.choices


def test_prometheus_reads_sglangs_own_metrics_through_the_rules(stack: Stack) -> None:
    host = stack.sglang.base_url.removeprefix("http://")
    with running_prometheus({"worker": [host]}, RULES_FILE) as prometheus:
        # Prometheus applies new targets a few seconds after it starts: traffic after the
        # first scrape, so the counters are seen to rise.
        deadline = time.monotonic() + 30
        while not query(prometheus, 'up{job="worker"} == 1') and time.monotonic() < deadline:
            time.sleep(0.5)
        client = sdk(stack)
        for _ in range(3):
            client.chat.completions.create(model=MODEL, messages=chat("z = 3"), max_tokens=4)
            time.sleep(1.2)
        deadline = time.monotonic() + 30
        wanted = (
            'worker:dflash_requests_running:sum{engine="sglang"}',
            'worker:dflash_requests_waiting:sum{engine="sglang"}',
            'worker:dflash_kv_cache_usage:ratio{engine="sglang"}',
            'worker:dflash_generation_tokens:rate5m{engine="sglang"} > 0',
            'engine:dflash_worker_time_to_first_token_seconds:p95_5m{engine="sglang"}',
        )
        missing = list(wanted)
        while missing and time.monotonic() < deadline:
            missing = [q for q in wanted if not finite_values(query(prometheus, q))]
            time.sleep(0.5)
        # This Prometheus (2.42) asks for OpenMetrics without an escaping scheme, so SGLang's
        # prometheus_client stores sglang_* names ('_' for ':'): the rules read either spelling.
        assert missing == []
        # Plain decoding: no verify steps, so no acceptance is made up.
        assert query(prometheus, 'worker:dflash_spec_steps:rate5m{engine="sglang"}') == []
