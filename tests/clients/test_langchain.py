"""LangChain's `ChatOpenAI` (langchain-openai) against the embedded worker and the gateway.

LangChain adds up the `usage` of every streamed chunk, so a server that sends usage twice (or
on every chunk when it was not asked to) makes LangChain over-count: the streamed usage must
equal the non-streamed usage of the same greedy request."""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage
from langchain_openai import ChatOpenAI

from tests.clients.conftest import MODEL

MAX_TOKENS = 12
MESSAGES = [HumanMessage("Write a Python function that reverses a string.")]


@pytest.fixture(params=["worker", "gateway"])
def base_url(request: pytest.FixtureRequest) -> str:
    """The embedded worker directly, then the gateway in front of it."""
    if request.param == "worker":
        url: str = request.getfixturevalue("worker").base_url
        return url
    gateway: str = request.getfixturevalue("gateway")
    return gateway


def chat(base_url: str, **options: Any) -> ChatOpenAI:
    """Greedy, exactly MAX_TOKENS tokens (ignore_eos), no retries (an error must surface)."""
    return ChatOpenAI(
        model=MODEL,
        base_url=base_url + "/v1",
        api_key="unused",  # type: ignore[arg-type]
        temperature=0,
        max_tokens=MAX_TOKENS,  # type: ignore[call-arg]
        max_retries=0,
        timeout=60,
        extra_body={"ignore_eos": True},
        **options,
    )


def stream_all(llm: ChatOpenAI) -> tuple[AIMessageChunk, int]:
    """The chunks merged as LangChain merges them (`+`), and how many there were."""
    merged: AIMessageChunk | None = None
    count = 0
    for chunk in llm.stream(MESSAGES):
        assert isinstance(chunk, AIMessageChunk)
        merged = chunk if merged is None else merged + chunk
        count += 1
    assert merged is not None
    return merged, count


def test_invoke(base_url: str) -> None:
    reply = chat(base_url).invoke(MESSAGES)
    assert isinstance(reply, AIMessage)
    assert isinstance(reply.content, str) and reply.content
    assert reply.response_metadata["finish_reason"] == "length"
    assert reply.response_metadata["model_name"] == MODEL
    usage = reply.usage_metadata
    assert usage is not None
    assert usage["output_tokens"] == MAX_TOKENS
    assert usage["input_tokens"] > 0
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


def test_stream_text_equals_invoke(base_url: str) -> None:
    llm = chat(base_url)
    merged, count = stream_all(llm)
    assert count > 1  # really streamed, not one blob
    assert merged.content == llm.invoke(MESSAGES).content
    assert merged.response_metadata["finish_reason"] == "length"


def test_streamed_usage_equals_non_stream_usage(base_url: str) -> None:
    expected = chat(base_url).invoke(MESSAGES).usage_metadata
    merged, _ = stream_all(chat(base_url, stream_usage=True))
    assert merged.usage_metadata == expected
    assert expected is not None and expected["output_tokens"] == MAX_TOKENS


def test_stream_without_usage_is_not_over_counted(base_url: str) -> None:
    """No usage asked for: LangChain reports none, or (if the server sends it anyway) the true
    count, never a sum of per-chunk counts."""
    expected = chat(base_url).invoke(MESSAGES).usage_metadata
    merged, _ = stream_all(chat(base_url, stream_usage=False))
    assert merged.usage_metadata is None or merged.usage_metadata == expected


@pytest.mark.anyio
async def test_async_stream_usage(base_url: str) -> None:
    llm = chat(base_url, stream_usage=True)
    expected = (await llm.ainvoke(MESSAGES)).usage_metadata
    merged: AIMessageChunk | None = None
    async for chunk in llm.astream(MESSAGES):
        merged = chunk if merged is None else merged + chunk
    assert merged is not None
    assert merged.usage_metadata == expected


def test_logprobs_reach_langchain(base_url: str) -> None:
    """`ChatOpenAI(logprobs=True, top_logprobs=2)`: one entry per generated token in the
    reply's metadata, whole and streamed alike."""
    llm = chat(base_url, logprobs=True, top_logprobs=2)
    reply = llm.invoke(MESSAGES)
    content = reply.response_metadata["logprobs"]["content"]
    assert len(content) == MAX_TOKENS
    assert all(len(entry["top_logprobs"]) == 2 and entry["logprob"] <= 0 for entry in content)
    merged, _ = stream_all(llm)
    streamed = merged.response_metadata["logprobs"]["content"]
    assert [e["token"] for e in streamed] == [e["token"] for e in content]
