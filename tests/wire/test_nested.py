"""Unknown and missing keys inside nested objects are 400s naming their path, at the gateway
and at the embedded worker alike; the accepted keys are OpenAI's plus real vLLM's."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.fixtures.worker import ROOT, WorkerHandle
from tests.service.conftest import MODEL, Gateway, running_gateway, wait_until
from tests.service.fake_upstream import FakeWorker, fake_worker
from wire.errors import InvalidRequest
from wire.nested import MESSAGES, PARTS, UNTYPED_PART, VLLM_MESSAGE_KEYS
from wire.schemas import ChatCompletionRequest, CompletionRequest, validate_request

USER = {"role": "user", "content": "hi"}

# (request body less model, the path named, the code)
BAD: list[tuple[dict[str, Any], str, str]] = [
    ({"messages": [{"role": "user", "text": "hi"}]}, "messages[0].text", "unknown_parameter"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "missing_required_parameter"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role", "missing_required_parameter"),
    (
        {"messages": [USER, {"role": "system", "content": "x", "contents": "y"}]},
        "messages[1].contents",
        "unknown_parameter",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "text", "txt": "hi"}]}]},
        "messages[0].content[0].txt",
        "unknown_parameter",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
        "messages[0].content[0].text",
        "missing_required_parameter",
    ),
    (
        {"messages": [{"role": "user", "content": [{"text": "hi"}]}]},
        "messages[0].content[0].type",
        "missing_required_parameter",
    ),
    (
        {
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"uri": "x"}}]}
            ]
        },
        "messages[0].content[0].image_url.uri",
        "unknown_parameter",
    ),
    (
        {
            "messages": [
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f"}}],
                }
            ]
        },
        "messages[0].tool_calls[0].function.arguments",
        "missing_required_parameter",
    ),
    (
        {"messages": [USER], "stream": True, "stream_options": {"include_usage": True, "usage": 1}},
        "stream_options.usage",
        "unknown_parameter",
    ),
    (
        {
            "messages": [USER],
            "tools": [{"type": "function", "function": {"name": "f", "params": {}}}],
        },
        "tools[0].function.params",
        "unknown_parameter",
    ),
    (
        {"messages": [USER], "tool_choice": {"type": "function", "function": {}}},
        "tool_choice.function.name",
        "missing_required_parameter",
    ),
    (
        {
            "messages": [USER],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schma": {}}},
        },
        "response_format.json_schema.schma",
        "unknown_parameter",
    ),
]


@pytest.mark.parametrize(("body", "path", "code"), BAD)
def test_the_gateway_names_the_path(body: dict[str, Any], path: str, code: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        validate_request(ChatCompletionRequest, {"model": "m", **body})
    assert (err.value.param, err.value.code, err.value.status_code) == (path, code, 400)
    assert f"'{path}'" in err.value.message


def test_completions_check_stream_options_too() -> None:
    body = {"model": "m", "prompt": "x", "stream": True, "stream_options": {"include_usages": True}}
    with pytest.raises(InvalidRequest) as err:
        validate_request(CompletionRequest, body)
    assert err.value.param == "stream_options.include_usages"


@pytest.mark.parametrize(
    "message",
    [
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            ],
        },
        {"role": "assistant", "content": None, "refusal": "no"},
        {"role": "tool", "content": "42", "tool_call_id": "c"},
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": "x", "detail": "low"}}],
        },
        {"role": "user", "content": [{"image_url": "https://example.invalid/a.png"}]},  # vLLM's
        {"role": "user", "content": [{"type": "video_url", "video_url": {"url": "x"}}]},  # vLLM's
        {"role": "assistant", "content": "x", "reasoning": "y"},  # vLLM's
        {"role": "user", "content": "x", "name": "ann"},
    ],
)
def test_what_openai_or_vllm_take_passes(message: dict[str, Any]) -> None:
    validate_request(ChatCompletionRequest, {"model": "m", "messages": [message]})


VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
PROBE = r"""
import json, typing
from vllm.renderers.chat_utils import types as t
from openai.types.chat import ChatCompletionMessageParam as OpenAIMessage
def keys(td):
    return sorted(getattr(td, "__annotations__", {}))
def literal(ann):  # Required[Literal["user"]] -> "user"
    while ann is not None and typing.get_origin(ann) is not typing.Literal:
        args = typing.get_args(ann)
        ann = args[0] if args else None
    return typing.get_args(ann)[0] if ann is not None else None
messages = {}
for td in typing.get_args(OpenAIMessage):
    messages[literal(typing.get_type_hints(td, include_extras=True)["role"])] = keys(td)
parts = {}
for td in typing.get_args(t.ChatCompletionContentPartParam):
    hints = typing.get_type_hints(td, include_extras=True) if td is not str else {}
    kind = literal(hints.get("type"))
    parts[kind or "untyped:" + getattr(td, "__name__", "str")] = keys(td)
print("SHAPES " + json.dumps({"messages": messages, "parts": parts,
      "custom": keys(t.CustomChatCompletionMessageParam)}))
"""


@pytest.mark.vllm
def test_the_accepted_keys_cover_real_vllms() -> None:
    """Every key real vLLM 0.33 (and the OpenAI types it builds on) reads on a message and a
    content part is accepted: the gateway never refuses what a vLLM worker would take."""
    if not VLLM_PYTHON.exists():
        if os.environ.get("CI") == "true":
            pytest.fail(".venv-vllm is missing: run `make vllm-env`")
        pytest.skip(".venv-vllm is missing: run `make vllm-env`")
    done = subprocess.run(
        [str(VLLM_PYTHON), "-c", PROBE], capture_output=True, text=True, timeout=300, check=False
    )
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("SHAPES ")), None)
    assert line is not None, done.stderr[-2000:]
    found = json.loads(line.removeprefix("SHAPES "))
    assert set(found["custom"]) - {"role", "content"} == set(VLLM_MESSAGE_KEYS.split())
    for role, keys in found["messages"].items():
        assert set(keys) <= MESSAGES[role].keys, role
    for kind, keys in found["parts"].items():
        if kind.startswith("untyped:"):
            if "image_pil" not in keys:  # a Python object: never in a JSON body
                assert set(keys) <= UNTYPED_PART.keys, kind
            continue
        assert set(keys) <= PARTS[kind].keys, kind


# Over HTTP: the gateway refuses before a worker sees the body; the embedded worker, asked
# directly, names the same path.
@pytest.fixture(scope="module")
def over_fake() -> Iterator[tuple[Gateway, FakeWorker]]:
    with fake_worker() as fake, running_gateway(workers=[fake.url]) as gw:
        wait_until(lambda: gw.state.live().fleet.routable() != [])
        yield gw, fake


@pytest.mark.parametrize(("body", "path", "code"), BAD[:8])
def test_both_sides_answer_400_naming_the_path(
    body: dict[str, Any],
    path: str,
    code: str,
    over_fake: tuple[Gateway, FakeWorker],
    worker: WorkerHandle,
) -> None:
    gw, fake = over_fake
    posts = fake.posts
    for base, model in ((gw.base_url, "fake"), (worker.base_url, MODEL)):
        reply = httpx.post(base + "/v1/chat/completions", json={"model": model, **body}, timeout=30)
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert (error["param"], error["code"]) == (path, code), base
    assert fake.posts == posts  # refused before any worker saw it


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "user", "content": "hi", "name": "ann"}, "messages[0].name"),
        (
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
            "messages[0].content[0]",
        ),
        ({"role": "assistant", "content": "x", "reasoning": "y"}, "messages[0].reasoning"),
    ],
)
def test_the_worker_refuses_what_it_cannot_honour_naming_it(
    message: dict[str, Any], param: str, worker: WorkerHandle
) -> None:
    body = {"model": MODEL, "messages": [message]}
    reply = httpx.post(worker.base_url + "/v1/chat/completions", json=body, timeout=30)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param
