"""The OpenAI Agents SDK (openai-agents) running an agent without tools against `dflash-serve`
(one embedded DFlash worker behind the gateway), through the Responses API: a run and a second
turn both ways (the whole history sent back, and previous_response_id), and a streamed run.
The tiny random model runs to max_tokens unless stopped, and a stream that hits
max_output_tokens ends with response.incomplete (as OpenAI's does), which this SDK's streamed
runs raise as an error; so the streamed run stops on a stop string (vLLM's `stop` extension,
which the embedded worker honours), taken from the greedy answer, and completes.
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


def agent(base_url: str, stop: str | None = None) -> Agent[Any]:
    set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    extra = None if stop is None else {"stop": [stop]}
    return Agent(
        name="coder",
        instructions=INSTRUCTIONS,
        model=OpenAIResponsesModel(model=MODEL, openai_client=client),
        model_settings=ModelSettings(temperature=0, max_tokens=8, extra_body=extra),
    )


def direct(base_url: str, conversation: list[dict[str, str]], stop: str | None = None) -> str:
    sdk = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    answer = sdk.responses.create(
        model=MODEL,
        instructions=INSTRUCTIONS,
        input=conversation,  # type: ignore[arg-type]
        max_output_tokens=8,
        temperature=0,
        store=False,
        extra_body=None if stop is None else {"stop": [stop]},
    )
    assert answer.status == ("incomplete" if stop is None else "completed")
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


async def test_a_streamed_run_completes_when_a_stop_string_ends_it(serve: str) -> None:
    asked = [{"role": "user", "content": "def fib(n):"}]
    greedy = direct(serve, asked)
    # The first character not seen before it: the answer stops just short of it.
    cut = next(i for i in range(1, len(greedy)) if greedy[i] not in greedy[:i])
    run = Runner.run_streamed(agent(serve, stop=greedy[cut]), "def fib(n):")
    raw = [e.data.type async for e in run.stream_events() if e.type == "raw_response_event"]
    assert run.is_complete and raw[0] == "response.created" and raw[-1] == "response.completed"
    assert "response.output_text.delta" in raw
    assert run.final_output == greedy[:cut] == direct(serve, asked, stop=greedy[cut])
    assert run.raw_responses[-1].usage.output_tokens < 8
