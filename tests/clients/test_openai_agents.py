"""The OpenAI Agents SDK (openai-agents) running an agent without tools against `dflash-serve`
(one embedded DFlash worker behind the gateway), through the Responses API: a run and a second
turn both ways (the whole history sent back, and previous_response_id). No streamed run: the
tiny random model always runs to max_tokens, so its stream ends with response.incomplete
(as OpenAI's does), which this SDK's streamed runs raise as an error.
Tracing is disabled: the SDK would export traces to OpenAI's servers."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIResponsesModel,
    Runner,
    set_tracing_disabled,
)

from tests.clients.conftest import MODEL
from tests.fixtures.serve import announced, base_url, dflash_serve
from tests.fixtures.worker import free_port

INSTRUCTIONS = "You write Python."
pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def serve(tiny_checkpoint: Any) -> Iterator[str]:
    """`dflash-serve` on a free port: its OpenAI base URL, once it announces it."""
    spec = {"method": "dflash", "model": str(tiny_checkpoint.drafter_dir)}
    argv = [sys.executable, "-m", "launcher.local_stack", "--port", str(free_port())]
    argv += ["--log-level", "warning", f"--worker-arg={tiny_checkpoint.target_dir}"]
    argv += [f"--worker-arg=--speculative-config={json.dumps(spec)}"]
    argv += [f"--worker-arg=--served-model-name={MODEL}", "--worker-arg=--max-model-len=512"]
    with dflash_serve(argv, {**os.environ, "OMP_NUM_THREADS": "1"}) as proc:
        yield base_url(announced(proc)[0])


def agent(base_url: str) -> Agent[Any]:
    set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    return Agent(
        name="coder",
        instructions=INSTRUCTIONS,
        model=OpenAIResponsesModel(model=MODEL, openai_client=client),
        model_settings=ModelSettings(temperature=0, max_tokens=8),
    )


def direct(base_url: str, conversation: list[dict[str, str]]) -> str:
    sdk = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    answer = sdk.responses.create(
        model=MODEL,
        instructions=INSTRUCTIONS,
        input=conversation,  # type: ignore[arg-type]
        max_output_tokens=8,
        temperature=0,
        store=False,
    )
    return answer.output_text


async def test_an_agent_runs_streams_and_continues(serve: str) -> None:
    coder = agent(serve)
    first = await Runner.run(coder, "def fib(n):")
    assert first.final_output == direct(serve, [{"role": "user", "content": "def fib(n):"}])
    usage = first.raw_responses[0].usage
    assert usage is not None and usage.output_tokens == 8
    history = [*first.to_input_list(), {"role": "user", "content": "again"}]
    second = await Runner.run(coder, history)  # type: ignore[arg-type]
    chained = await Runner.run(coder, "again", previous_response_id=first.last_response_id)
    expected = direct(
        serve,
        [
            {"role": "user", "content": "def fib(n):"},
            {"role": "assistant", "content": first.final_output},
            {"role": "user", "content": "again"},
        ],
    )
    assert second.final_output == expected
    assert chained.final_output == expected
