"""POST /v1/responses on the embedded worker, over real HTTP with the OpenAI SDK as client:
the same tokens as chat completions for the same conversation, typed stream events, the
per-request metrics, and a 400 naming every field it cannot honour."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import (
    ResponseCompletedEvent,
    ResponseCreatedEvent,
    ResponseTextDeltaEvent,
)

from engine.worker.settings import WorkerSettings, load_settings
from tests.fixtures.tiny_models import TinyCheckpoint
from tests.fixtures.worker import AppHandle, serving_app
from wire.refused import RESPONSES_REFUSED as REFUSED

NAME = "tiny"
KEY = "sk-responses"
CONVERSATION: list[dict[str, Any]] = [
    {"role": "developer", "content": "Answer in code."},
    {"role": "user", "content": [{"type": "input_text", "text": "def fib(n):"}]},
    {"role": "assistant", "content": [{"type": "output_text", "text": "return n"}]},
    {"role": "user", "content": "again"},
]
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "developer", "content": "Answer in code."},
    {"role": "user", "content": "def fib(n):"},
    {"role": "assistant", "content": "return n"},
    {"role": "user", "content": "again"},
]


@pytest.fixture(scope="module")
def settings(tiny_checkpoint: TinyCheckpoint) -> WorkerSettings:
    return load_settings(
        model=str(tiny_checkpoint.target_dir),
        served_model_name=NAME,
        max_model_len=256,
        speculative_config={"method": "dflash", "model": str(tiny_checkpoint.drafter_dir)},
        # K drafts every step: the adaptive planner may rightly choose plain steps after a
        # request that accepted little (CI saw 0 drafting steps once), and this module checks
        # the Responses API's per-request metrics, not the planner
        speculation="fixed",
        max_num_seqs=2,
        api_key=KEY,
    )


@pytest.fixture(scope="module")
def worker(settings: WorkerSettings) -> Iterator[AppHandle]:
    with serving_app(settings) as handle:
        yield handle


@pytest.fixture
def client(worker: AppHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{worker.base_url}/v1", api_key=KEY, max_retries=0)


def test_greedy_output_equals_chat_completions(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model=NAME,
        messages=CHAT,  # type: ignore[arg-type]
        max_tokens=12,
        temperature=0,
    )
    resp = client.responses.create(
        model=NAME,
        instructions="Be brief.",
        input=CONVERSATION,  # type: ignore[arg-type]
        max_output_tokens=12,
        temperature=0,
        metadata={"case": "greedy"},
    )
    assert resp.output_text == chat.choices[0].message.content
    assert resp.usage is not None and chat.usage is not None
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.usage.output_tokens == chat.usage.completion_tokens
    assert resp.status == (
        "incomplete" if chat.choices[0].finish_reason == "length" else "completed"
    )
    assert resp.metadata == {"case": "greedy"} and resp.store is False
    # Echoed as vLLM 0.33 echoes it: as asked, default true (it said false whatever was asked).
    assert resp.parallel_tool_calls is True
    asked_not = client.responses.create(
        model=NAME, input="x", max_output_tokens=2, parallel_tool_calls=False
    )
    assert asked_not.parallel_tool_calls is False
    assert resp.id.startswith("resp_") and resp.output[0].type == "message"
    spec = (resp.model_extra or {})["metrics"]["speculative_decoding"]
    assert spec["num_spec_steps"] >= 1


def test_stream_sends_typed_events_and_the_same_text(client: openai.OpenAI) -> None:
    whole = client.responses.create(
        model=NAME, input="def add(a, b):", max_output_tokens=10, temperature=0
    )
    events = list(
        client.responses.create(
            model=NAME, input="def add(a, b):", max_output_tokens=10, temperature=0, stream=True
        )
    )
    assert isinstance(events[0], ResponseCreatedEvent)
    assert (
        isinstance(events[-1], ResponseCompletedEvent) or events[-1].type == "response.incomplete"
    )
    deltas = "".join(e.delta for e in events if isinstance(e, ResponseTextDeltaEvent))
    assert deltas == whole.output_text
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == whole.output_text
    assert final.usage is not None and whole.usage is not None
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert "metrics" in (final.model_extra or {})
    assert [e.sequence_number for e in events] == list(range(len(events)))


@pytest.mark.parametrize(
    "name", sorted(n for n, rule in REFUSED.items() if rule.example is not None)
)
def test_a_field_the_worker_cannot_honour_is_400_naming_it(worker: AppHandle, name: str) -> None:
    body = {"model": NAME, "input": "x", "max_output_tokens": 2, name: REFUSED[name].example}
    answer = httpx.post(
        f"{worker.base_url}/v1/responses", json=body, headers={"Authorization": f"Bearer {KEY}"}
    )
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == name


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"frobnicate": 1}, "frobnicate"),
        ({"text": {"format": {"type": "json_object"}}}, "text.format"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "text": "x"}]}]}, None),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"max_output_tokens": 100_000}, "max_output_tokens"),
        ({"max_output_tokens": 2.5}, "max_output_tokens"),  # an integer, no fraction
        ({"model": "other"}, "model"),
    ],
)
def test_bad_requests_are_400s_naming_the_field(
    worker: AppHandle, extra: dict[str, Any], param: str | None
) -> None:
    body = {"model": NAME, "input": "x", "max_output_tokens": 2, **extra}
    answer = httpx.post(
        f"{worker.base_url}/v1/responses", json=body, headers={"Authorization": f"Bearer {KEY}"}
    )
    assert answer.status_code in (400, 404), answer.text
    error = answer.json()["error"]
    if param is not None:
        assert error["param"] is not None and error["param"].startswith(param), error


def test_an_integer_may_come_as_a_float_with_no_fraction(worker: AppHandle) -> None:
    """`max_output_tokens: 2.0` is 2, as JSON Schema's integer and vLLM's models say."""
    body = {"model": NAME, "input": "x", "max_output_tokens": 2.0, "top_logprobs": 0.0}
    answer = httpx.post(
        f"{worker.base_url}/v1/responses", json=body, headers={"Authorization": f"Bearer {KEY}"}
    )
    assert answer.status_code == 200, answer.text
    done = answer.json()
    assert done["max_output_tokens"] == 2 and type(done["max_output_tokens"]) is int
    assert 1 <= done["usage"]["output_tokens"] <= 2


def test_stop_strings_end_a_response_as_they_end_a_chat(client: openai.OpenAI) -> None:
    """vLLM's `stop` extension: the text up to the first stop string, then `completed`."""
    greedy = client.responses.create(model=NAME, input="x", max_output_tokens=12, temperature=0)
    text = greedy.output_text
    # The first character not seen before it: the answer stops just short of it.
    cut = next(i for i in range(1, len(text)) if text[i] not in text[:i])
    stopped = client.responses.create(
        model=NAME,
        input="x",
        max_output_tokens=12,
        temperature=0,
        extra_body={"stop": [text[cut]]},
    )
    assert stopped.output_text == text[:cut] and stopped.status == "completed"
    chat = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=12,
        temperature=0,
        stop=[text[cut]],
    )
    assert chat.choices[0].message.content == text[:cut]
    assert chat.choices[0].finish_reason == "stop"
