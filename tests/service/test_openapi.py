"""schemathesis against the document the gateway serves at /openapi.json, real worker behind:
every check (status codes and content types declared, bodies as declared, what the document
calls valid is accepted and what it calls invalid refused, never a 5xx), over every operation,
with a fixed seed and a bounded number of examples.

The served document states the context and the vocabulary of the model served, and offers of
the Responses fields only what the embedded engine honours. schemathesis parametrizes at
import, before the gateway runs, so the examples come from the document the gateway serves
with this worker behind it, and a test checks that it serves exactly that one. What no schema
can say is checked rather than allowed: a 400 for a prompt that alone fills the context (or
holds no token) passes only when the gateway's own /tokenize counts that many tokens in it."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance

from service.app import create_app
from service.openapi import Served, served, served_document
from service.settings import GatewaySettings, PoolSpec
from tests.fixtures.tiny_models import default_vocab_size
from tests.fixtures.worker import running_worker
from tests.service.conftest import (
    MODEL,
    Gateway,
    running_gateway,
    sample,
    wait_until,
    worker_args,
)
from wire.responses import ResponsesRequest, chat_messages

# A short context bounds every generation (a body without max_tokens runs to the end of it):
# the answers that run to it are most of this module's time.
MAX_LEN = 20
# What the gateway serves with the worker below behind it (embedded engine, tiny checkpoint).
# The sequences (n x prompts) the worker takes in one request: running and waiting. Few, so
# that an example with the largest `n` stays cheap.
RUNNING, WAITING = 4, 4
SEQUENCES = RUNNING + WAITING
SERVED = Served(MAX_LEN, default_vocab_size(), SEQUENCES, embedded_only=True)
DOCUMENT = served_document(create_app(GatewaySettings()).openapi(), SERVED)
# schemathesis reports its operations under one node id, which pytest-xdist cannot
# forward (tests/conftest.py): make test runs this module in a process of its own.
pytestmark = pytest.mark.serial

schema = schemathesis.openapi.from_dict(DOCUMENT)
schema.config.output.sanitization.update(enabled=False)  # `max_tokens` is no secret


@pytest.fixture(scope="module")
def stack(tiny_checkpoint: Any) -> Iterator[tuple[Gateway, httpx.Client]]:
    """The gateway and a client of its one embedded worker."""
    # The worker serves "tiny-coder" as the schema's examples do: examples reach the worker,
    # generated bodies mostly exercise the gateway's 400 and 404 paths.
    args = worker_args(tiny_checkpoint, "--max-model-len", str(MAX_LEN))
    args += ["--max-num-seqs", str(RUNNING), "--max-waiting", str(WAITING)]
    with running_worker(*args) as worker:
        pool = PoolSpec(name="default", engine="embedded", workers=[worker.base_url])
        with running_gateway(pools=[pool]) as gw, httpx.Client(base_url=worker.base_url) as c:
            yield gw, c


@pytest.fixture(scope="module")
def live(stack: tuple[Gateway, httpx.Client]) -> Gateway:
    return stack[0]


def settle(worker: httpx.Client) -> None:
    """Wait until the worker holds no request. schemathesis reads 20 events of a stream and
    hangs up; the worker frees a stream cut short at its next step, and a request that needs
    the whole worker before then gets a 503 (busy: retry later). That answer is declared,
    but each example here is checked against an idle worker. One kept-alive connection: a
    fresh client per look cost more than most examples (1,700 of them)."""

    def idle() -> bool:
        text = worker.get("/metrics").text
        held = ("vllm:num_requests_running", "vllm:num_requests_waiting")
        return sum(sample(text, name) for name in held) == 0

    wait_until(idle, timeout=30, interval=0.02)


def test_the_gateway_serves_the_document_tested_here(live: Gateway) -> None:
    """The bounds come from the worker's card, the Responses fields from the embedded engine."""
    assert httpx.get(live.base_url + "/openapi.json", timeout=10).json() == DOCUMENT
    card = httpx.get(f"{live.v1}/models/{MODEL}", timeout=10).json()
    assert (card["max_model_len"], card["vocab_size"]) == (MAX_LEN, SERVED.vocab_size)
    assert card["max_sequences_per_request"] == SEQUENCES
    components = DOCUMENT["components"]["schemas"]
    chat = components["ChatCompletionRequest"]["properties"]["max_tokens"]["anyOf"][0]
    assert chat["maximum"] == MAX_LEN
    assert components["DetokenizeRequest"]["properties"]["tokens"]["items"]["maximum"] == (
        card["vocab_size"] - 1
    )
    truncation = components["ResponsesRequest"]["properties"]["truncation"]
    assert truncation == {"anyOf": [{"type": "null"}, {"const": "disabled"}]}
    assert components["ResponsesRequest"]["properties"]["store"]["anyOf"][0] == {"type": "boolean"}


def test_a_bound_is_declared_only_when_every_card_gives_it() -> None:
    cards = [{"id": "a", "max_model_len": 96, "vocab_size": 10}, {"id": "b", "max_model_len": 128}]
    assert served(cards, {"embedded"}) == Served(128, None, None, embedded_only=True)
    assert served(cards, {"embedded", "vllm"}).embedded_only is False  # vLLM's fields too
    assert served([], set()) == Served()
    base = create_app(GatewaySettings()).openapi()
    assert served_document(base, Served()) is base  # nothing known: the document as built
    bounded = served_document(base, Served(max_model_len=64))
    assert (
        bounded["components"]["schemas"]["ResponsesRequest"]["properties"]["max_output_tokens"][
            "anyOf"
        ][0]["maximum"]
        == 64
    )
    assert (
        base["components"]["schemas"]["ResponsesRequest"]
        != bounded["components"]["schemas"]["ResponsesRequest"]
    )


def prompt_tokens(live: Gateway, path: str, body: dict[str, Any]) -> list[int]:
    """The token counts of the request's prompts, by the gateway's /tokenize."""

    def count(**what: Any) -> int:
        reply = httpx.post(f"{live.base_url}/tokenize", json={"model": MODEL, **what}, timeout=30)
        return int(reply.json()["count"])

    if path == "/v1/chat/completions":
        return [count(messages=body["messages"])]
    if path == "/v1/responses":
        req = ResponsesRequest.model_validate(body)
        return [count(messages=chat_messages(req.instructions, req.input_items()))]
    prompt = body["prompt"]
    if isinstance(prompt, str):
        return [count(prompt=prompt)]
    if all(isinstance(item, int | float) for item in prompt):
        return [len(prompt)]  # one prompt of token ids
    return [count(prompt=p) if isinstance(p, str) else len(p) for p in prompt]


def sequences(body: dict[str, Any]) -> int:
    """n x the number of prompts (a completions batch holds several)."""
    prompt = body.get("prompt")
    batch = isinstance(prompt, list) and any(isinstance(p, str | list) for p in prompt)
    return (body.get("n") or 1) * (len(prompt) if batch else 1)


def refused_for_what_no_schema_says(live: Gateway, case: Any, response: Any) -> bool:
    """A refusal no schema can foresee: it depends on the tokenizer (a prompt of no tokens, an
    empty string where the tokenizer adds none; a prompt that alone fills the context), or on
    a batch's length (n choices for each of its prompts, past what the worker takes)."""
    if response.status_code != 400 or not isinstance(case.body, dict):
        return False
    error = response.json()["error"]
    if "choices for" in error["message"]:  # n per prompt, over a batch of prompts
        return error["param"] in ("n", "prompt") and sequences(case.body) > SEQUENCES
    if error["param"] not in ("prompt", "input"):
        return False
    if error["code"] == "context_length_exceeded":
        return max(prompt_tokens(live, case.path, case.body)) >= MAX_LEN
    if error["message"].startswith("the prompt is empty"):
        return min(prompt_tokens(live, case.path, case.body)) == 0
    return False


def test_what_no_schema_says_is_explained_only_when_it_holds(live: Gateway) -> None:
    """The check above lets a 400 pass only for what it names, verified: never any 400."""

    def sent(path: str, body: dict[str, Any]) -> tuple[Any, httpx.Response]:
        body = {"model": MODEL, "max_tokens": 1, **body}
        return SimpleNamespace(path=path, body=body), httpx.post(live.base_url + path, json=body)

    long = sent("/v1/completions", {"prompt": "def f(x): return x\n" * 40})
    assert long[1].json()["error"]["code"] == "context_length_exceeded"
    assert refused_for_what_no_schema_says(live, *long)
    batch = sent("/v1/completions", {"prompt": ["a"] * SEQUENCES, "n": 2})
    assert batch[1].status_code == 400 and refused_for_what_no_schema_says(live, *batch)
    for path, body in [
        ("/v1/completions", {"prompt": "x", "stop": [""]}),  # a 400 the document foresees
        ("/v1/completions", {"prompt": ["a"] * (SEQUENCES // 2), "n": 2}),  # served: fits
    ]:
        assert not refused_for_what_no_schema_says(live, *sent(path, body))


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_the_gateway_does_what_its_schema_says(
    case: Any, stack: tuple[Gateway, httpx.Client]
) -> None:
    live, worker = stack
    settle(worker)
    response = case.call(base_url=live.base_url, timeout=30)
    case.validate_response(response, excluded_checks=[positive_data_acceptance])
    if not refused_for_what_no_schema_says(live, case, response):
        case.validate_response(response, checks=[positive_data_acceptance])
    if response.status_code >= 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
