"""LiteLLM's SDK (`litellm.completion`, provider "openai/") against the gateway.

LiteLLM picks its exception class from the status code and from words in the error body
(e.g. "This model's maximum context length is" -> ContextWindowExceededError, which its
routers use to fall back to a longer-context model), so these tests pin that our errors map
to the classes a LiteLLM user catches."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import litellm
import pytest
from litellm.exceptions import (
    AuthenticationError,
    BadRequestError,
    ContextWindowExceededError,
    NotFoundError,
    ServiceUnavailableError,
)

from tests.clients.conftest import MAX_MODEL_LEN, MODEL, live_gateway
from tests.deploy.stack import running_gateway
from tests.fixtures.worker import WorkerHandle, free_port

MAX_TOKENS = 12
MESSAGES = [{"role": "user", "content": "Write a Python function that reverses a string."}]
API_KEY = "sk-clients-test"

# LiteLLM 1.106's own types trip a pydantic warning (ReadOnly TypedDict items) on first use;
# the suite turns warnings into errors, so this one (not ours to fix) is let through.
pytestmark = pytest.mark.filterwarnings(
    "ignore:Item .* is using the `ReadOnly` qualifier:UserWarning"
)


def complete(api_base: str, **overrides: Any) -> Any:
    """Greedy, exactly MAX_TOKENS tokens, no retries (so an error surfaces at once)."""
    kwargs: dict[str, Any] = {
        "model": f"openai/{MODEL}",
        "api_base": api_base + "/v1",
        "api_key": "unused",
        "messages": MESSAGES,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
        "num_retries": 0,
        "max_retries": 0,
        "timeout": 60,
    }
    return litellm.completion(**{**kwargs, **overrides})


def drain(stream: Any) -> list[Any]:
    return list(stream)


@pytest.fixture(scope="module")
def keyed_gateway(worker: WorkerHandle, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A second gateway over the same worker that requires API_KEY."""
    workdir = tmp_path_factory.mktemp("keyed-gateway")
    key_file = workdir / "keys"
    key_file.write_text(API_KEY + "\n")
    with running_gateway([worker.base_url], workdir, "--api-key-file", str(key_file)) as base:
        yield base


@pytest.fixture(scope="module")
def dead_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A gateway whose only worker URL has nothing listening: it can serve nothing."""
    workdir: Path = tmp_path_factory.mktemp("dead-gateway")
    dead_worker = f"http://127.0.0.1:{free_port()}"
    with live_gateway([dead_worker], workdir, "--health-interval-s", "0.2") as base:
        yield base


def test_completion(gateway: str) -> None:
    reply = complete(gateway)
    assert isinstance(reply, litellm.ModelResponse)  # not a stream wrapper
    choice = reply.choices[0]
    assert isinstance(choice.message.content, str) and choice.message.content
    assert choice.finish_reason == "length"
    assert reply.usage.completion_tokens == MAX_TOKENS
    assert reply.usage.prompt_tokens > 0
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + MAX_TOKENS


def test_streamed_completion_equals_non_stream(gateway: str) -> None:
    expected = complete(gateway)
    chunks = drain(complete(gateway, stream=True, stream_options={"include_usage": True}))
    assert len(chunks) > 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.choices[0].message.content
    rebuilt: Any = litellm.stream_chunk_builder(chunks, messages=MESSAGES)
    assert isinstance(rebuilt, litellm.ModelResponse)
    assert rebuilt.choices[0].finish_reason == "length"
    assert rebuilt.usage.completion_tokens == expected.usage.completion_tokens == MAX_TOKENS
    assert rebuilt.usage.prompt_tokens == expected.usage.prompt_tokens


def long_prompt() -> list[dict[str, str]]:
    """Far more tokens than MAX_MODEL_LEN, whatever the tokenizer."""
    return [{"role": "user", "content": "hello world " * MAX_MODEL_LEN * 2}]


ERRORS: dict[str, tuple[dict[str, Any], type[Exception], str]] = {
    # case: (overrides, LiteLLM class, a word the server's message must contain)
    "unknown-model": ({"model": "openai/no-such-model"}, NotFoundError, "no-such-model"),
    "bad-parameter": ({"temperature": -1}, BadRequestError, "temperature"),
    "context-too-long": (
        {"messages": long_prompt()},
        ContextWindowExceededError,
        f"maximum context length is {MAX_MODEL_LEN} tokens",
    ),
}


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("case", list(ERRORS))
def test_error_maps_to_litellm_class(gateway: str, case: str, stream: bool) -> None:
    overrides, expected, word = ERRORS[case]
    with pytest.raises(expected) as caught:
        result = complete(gateway, stream=stream, **overrides)
        if stream:
            drain(result)
    assert type(caught.value) is expected  # exactly: not a subclass picked by other words
    assert word in str(caught.value)


def test_context_error_is_a_bad_request_too(gateway: str) -> None:
    """Code that catches only BadRequestError still catches the context-window error."""
    with pytest.raises(BadRequestError) as caught:
        complete(gateway, messages=long_prompt())
    assert isinstance(caught.value, ContextWindowExceededError)
    assert caught.value.status_code == 400


def test_no_healthy_worker_is_service_unavailable(dead_gateway: str) -> None:
    with pytest.raises(ServiceUnavailableError) as caught:
        complete(dead_gateway)
    assert caught.value.status_code == 503


def test_valid_api_key_is_accepted(keyed_gateway: str) -> None:
    reply = complete(keyed_gateway, api_key=API_KEY)
    assert reply.usage.completion_tokens == MAX_TOKENS


def test_wrong_api_key_is_authentication_error(keyed_gateway: str) -> None:
    with pytest.raises(AuthenticationError) as caught:
        complete(keyed_gateway, api_key="sk-wrong")
    assert caught.value.status_code == 401
