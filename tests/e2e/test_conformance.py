"""API conformance, table-driven: field -> request -> expected effect or 400, run against the
embedded worker (bundled tiny-coder, DFlash) directly AND through the gateway in front of
it, which must answer exactly the same way (it passes every field through untouched).

Real vLLM's side of the same fields: tests/e2e/test_real_vllm.py.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.deploy.stack import running_gateway
from tests.fixtures.worker import running_worker

MODEL = "tiny-coder"
CHAT, COMP = "/v1/chat/completions", "/v1/completions"
HI = [{"role": "user", "content": "def add(a, b):"}]
Check = Callable[[dict[str, Any]], None]


@dataclass(frozen=True)
class Row:
    field: str
    path: str
    body: dict[str, Any]
    check: Check | None = None  # None: a 400 naming `field`
    param: str | None = None  # the field the 400 names, when not `field`


def _choice(body: dict[str, Any]) -> dict[str, Any]:
    choice: dict[str, Any] = body["choices"][0]
    return choice


def _tokens(body: dict[str, Any]) -> list[str]:
    logprobs = _choice(body)["logprobs"]
    if "content" in logprobs:
        return [entry["token"] for entry in logprobs["content"]]
    tokens: list[str] = logprobs["tokens"]
    return tokens


def _all(predicate: Callable[[dict[str, Any]], bool]) -> Check:
    def check(body: dict[str, Any]) -> None:
        assert predicate(body), body

    return check


GREEDY: dict[str, Any] = {"model": MODEL, "temperature": 0, "ignore_eos": True}
ROWS = [
    # Sampling and output fields honoured by the embedded engine.
    Row(
        "logprobs",
        CHAT,
        {**GREEDY, "messages": HI, "max_tokens": 5, "logprobs": True, "top_logprobs": 2},
        _all(
            lambda b: (
                len(_choice(b)["logprobs"]["content"]) == b["usage"]["completion_tokens"]
                and all(len(e["top_logprobs"]) == 2 for e in _choice(b)["logprobs"]["content"])
            )
        ),
    ),
    Row("top_logprobs", CHAT, {**GREEDY, "messages": HI, "top_logprobs": 2}),
    Row(
        "logprobs",
        COMP,
        {**GREEDY, "prompt": "def f(x):", "max_tokens": 4, "logprobs": 0},
        _all(
            lambda b: (
                [list(t) for t in _choice(b)["logprobs"]["top_logprobs"]]
                == [[t] for t in _tokens(b)]
            )
        ),
    ),
    Row("logprobs", COMP, {**GREEDY, "prompt": "x", "logprobs": 21}),
    Row(
        "max_tokens",
        COMP,
        {**GREEDY, "prompt": "def f(x):"},
        _all(lambda b: b["usage"]["completion_tokens"] == 16),  # completions' default
    ),
    Row(
        "echo",
        COMP,
        {**GREEDY, "prompt": "def f(x):", "max_tokens": 3, "echo": True},
        _all(lambda b: _choice(b)["text"].startswith("def f(x):")),
    ),
    Row(
        "n",
        CHAT,
        {"model": MODEL, "messages": HI, "max_tokens": 3, "n": 3, "seed": 1},
        _all(lambda b: [c["index"] for c in b["choices"]] == [0, 1, 2]),
    ),
    Row(
        "prompt",
        COMP,
        {**GREEDY, "prompt": ["def f(x):", "class A:"], "max_tokens": 2},
        _all(lambda b: len(b["choices"]) == 2),
    ),
    Row(
        "stop",
        COMP,
        {**GREEDY, "prompt": "def f(x):", "max_tokens": 40, "stop": ["\n"]},
        _all(
            lambda b: (
                _choice(b)["finish_reason"] == "stop"
                and _choice(b)["stop_reason"] == "\n"
                and "\n" not in _choice(b)["text"]
            )
        ),
    ),
    Row(
        "include_stop_str_in_output",
        COMP,
        {
            **GREEDY,
            "prompt": "def f(x):",
            "max_tokens": 40,
            "stop": ["\n"],
            "include_stop_str_in_output": True,
        },
        _all(lambda b: _choice(b)["text"].endswith("\n")),
    ),
    Row(
        "logit_bias",
        COMP,
        {**GREEDY, "prompt": "x", "max_tokens": 4, "logprobs": 0, "logit_bias": {"300": 100}},
        _all(lambda b: len(set(_tokens(b))) == 1),
    ),
    Row(
        "allowed_token_ids",
        COMP,
        {**GREEDY, "prompt": "x", "max_tokens": 4, "logprobs": 0, "allowed_token_ids": [300]},
        _all(lambda b: len(set(_tokens(b))) == 1),
    ),
    Row(
        "bad_words",
        COMP,
        {**GREEDY, "prompt": "def f(self):", "max_tokens": 32, "bad_words": ["self"]},
        _all(lambda b: "self" not in _choice(b)["text"]),
    ),
    Row(
        "min_tokens",
        COMP,
        {
            "model": MODEL,
            "temperature": 0,
            "prompt": "def f(x):",
            "max_tokens": 12,
            "min_tokens": 12,
            "stop": ["\n", " "],
        },
        _all(lambda b: b["usage"]["completion_tokens"] == 12),
    ),
    Row(
        "repetition_penalty",
        CHAT,
        {**GREEDY, "messages": HI, "max_tokens": 4, "repetition_penalty": 1.5},
        _all(lambda b: b["usage"]["completion_tokens"] == 4),
    ),
    Row("repetition_penalty", CHAT, {**GREEDY, "messages": HI, "repetition_penalty": 0}),
    Row("presence_penalty", CHAT, {**GREEDY, "messages": HI, "presence_penalty": 3}),
    Row("min_p", CHAT, {**GREEDY, "messages": HI, "min_p": 2}),
    Row("min_tokens", CHAT, {**GREEDY, "messages": HI, "max_tokens": 2, "min_tokens": 3}),
    Row("allowed_token_ids", CHAT, {**GREEDY, "messages": HI, "allowed_token_ids": []}),
    Row(
        "continue_final_message",
        CHAT,
        {
            **GREEDY,
            "messages": [*HI, {"role": "assistant", "content": "    return"}],
            "add_generation_prompt": False,
            "continue_final_message": True,
            "max_tokens": 3,
        },
        _all(lambda b: b["usage"]["completion_tokens"] == 3),
    ),
    Row("continue_final_message", CHAT, {**GREEDY, "messages": HI, "continue_final_message": True}),
    Row(
        "chat_template_kwargs",
        CHAT,
        {
            **GREEDY,
            "messages": HI,
            "max_tokens": 2,
            "chat_template_kwargs": {"enable_thinking": False},
        },
        _all(lambda b: b["usage"]["completion_tokens"] == 2),
    ),
    Row(
        "chat_template_kwargs",
        CHAT,
        {**GREEDY, "messages": HI, "chat_template_kwargs": {"messages": []}},
    ),
    # Refused on the embedded engine (the vLLM backend gets them untouched).
    Row(
        "response_format",
        CHAT,
        {"model": MODEL, "messages": HI, "response_format": {"type": "json_object"}},
    ),
    Row(
        "tools",
        CHAT,
        {
            "model": MODEL,
            "messages": HI,
            "tools": [{"type": "function", "function": {"name": "f"}}],
        },
    ),
    Row("use_beam_search", COMP, {"model": MODEL, "prompt": "x", "use_beam_search": True}),
    Row("frobnicate", CHAT, {"model": MODEL, "messages": HI, "frobnicate": 1}),
    Row(
        "echo",  # an eval harness's loglikelihood request: the prompt scored, nothing generated
        COMP,
        {"model": MODEL, "prompt": "def f(x):", "echo": True, "logprobs": 1, "max_tokens": 0},
        _all(
            lambda b: (
                _choice(b)["text"] == "def f(x):"
                and _choice(b)["logprobs"]["token_logprobs"][0] is None
                and all(v <= 0 for v in _choice(b)["logprobs"]["token_logprobs"][1:])
                and "".join(_tokens(b)) == "def f(x):"
            )
        ),
    ),
    Row("max_tokens", COMP, {"model": MODEL, "prompt": "x", "max_tokens": 0}),
]


@dataclass(frozen=True)
class Targets:
    worker: str
    gateway: str


@pytest.fixture(scope="module")
def targets(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Targets]:
    with contextlib.ExitStack() as stack:
        worker = stack.enter_context(running_worker("--max-num-seqs", "4"))
        gateway = stack.enter_context(
            running_gateway([worker.base_url], tmp_path_factory.mktemp("gw"))
        )
        yield Targets(worker.base_url, gateway)


@pytest.mark.parametrize("via", ["worker", "gateway"])
@pytest.mark.parametrize("row", ROWS, ids=lambda r: f"{r.field}-{r.path.rsplit('/', 1)[1]}")
def test_field_is_honoured_or_refused(targets: Targets, row: Row, via: str) -> None:
    base = targets.worker if via == "worker" else targets.gateway
    r = httpx.post(f"{base}{row.path}", json=row.body, timeout=120)
    if row.check is None:
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert error["param"] == (row.param or row.field), error
        return
    assert r.status_code == 200, r.text
    row.check(r.json())


def same_answer(a: Any, b: Any, where: str = "body") -> None:
    """Equal structure, strings, ints and bools; floats (log-probabilities) to 1e-5: the
    worker's default, adaptive speculation, may verify another number of drafts on the
    second call, and a wider verify rounds attention differently (tokens stay the same)."""
    if isinstance(a, float) and isinstance(b, float):
        assert math.isclose(a, b, rel_tol=0, abs_tol=1e-5), (where, a, b)
    elif isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            same_answer(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same_answer(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def test_the_gateway_answers_exactly_as_the_worker(targets: Targets) -> None:
    """Greedy answers with logprobs: the same body both ways, but for id and time."""
    body = {**GREEDY, "messages": HI, "max_tokens": 6, "logprobs": True, "top_logprobs": 3}
    direct, routed = (
        httpx.post(f"{base}{CHAT}", json=body, timeout=120).json()
        for base in (targets.worker, targets.gateway)
    )
    for answer in (direct, routed):
        answer.pop("id"), answer.pop("created"), answer.pop("metrics", None)
    same_answer(direct, routed)


@pytest.mark.parametrize("via", ["worker", "gateway"])
def test_vllm_endpoints(targets: Targets, via: str) -> None:
    base = targets.worker if via == "worker" else targets.gateway
    assert httpx.get(f"{base}/v1/models/{MODEL}", timeout=30).json()["id"] == MODEL
    assert httpx.get(f"{base}/v1/models/nope", timeout=30).status_code == 404
    ids = httpx.post(f"{base}/tokenize", json={"model": MODEL, "prompt": "def f"}, timeout=30)
    tokens = ids.json()["tokens"]
    text = httpx.post(
        f"{base}/detokenize", json={"model": MODEL, "tokens": tokens}, timeout=30
    ).json()["prompt"]
    assert text == "def f"
    assert httpx.get(f"{base}/version", timeout=30).json()["version"]
    r = httpx.post(
        f"{base}{COMP}",
        json={**GREEDY, "prompt": "x", "max_tokens": 1},
        headers={"X-Request-Id": "conformance-1"},
        timeout=60,
    )
    assert r.json()["id"] == "cmpl-conformance-1"
