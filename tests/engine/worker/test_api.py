"""api.py's own steps: sampling parameters from a request, and engine refusals becoming
400s that name the field the client used (end to end over HTTP: test_app.py)."""

from __future__ import annotations

from typing import Any

import pytest

from engine.errors import QueueFull, RequestRejected
from engine.sequence import SamplingParams
from engine.worker import api
from engine.worker.schemas import ChatCompletionRequest, CompletionRequest
from wire.errors import InvalidRequest, Unavailable

HI = [{"role": "user", "content": "hi"}]


def test_sampling_params_defaults_and_fields() -> None:
    req = ChatCompletionRequest.model_validate({"messages": HI})
    assert api._sampling_params(req) == SamplingParams(max_tokens=None)
    req = CompletionRequest.model_validate(
        {
            "prompt": "x",
            "max_tokens": 4,
            "temperature": 0,
            "top_k": -1,
            "stop": "a",
            "stop_token_ids": [9],
            "seed": 3,
            "ignore_eos": True,
        }
    )
    assert api._sampling_params(req) == SamplingParams(
        max_tokens=4,
        temperature=0.0,
        top_k=0,
        stop=("a",),
        stop_token_ids=(9,),
        seed=3,
        ignore_eos=True,
    )


def test_every_logits_processor_field_reaches_the_sampling_params() -> None:
    processors = {
        "min_p": 0.1,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "repetition_penalty": 1.2,
        "logit_bias": {"7": 150, "8": -3},
        "min_tokens": 2,
        "bad_words": ["no"],
        "allowed_token_ids": [1, 2],
    }
    chat = ChatCompletionRequest.model_validate(
        {"messages": HI, "logprobs": True, "top_logprobs": 4, **processors}
    )
    expected = SamplingParams(
        max_tokens=None,
        min_p=0.1,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        logit_bias=((7, 100.0), (8, -3.0)),  # clamped to OpenAI's +-100, as vLLM
        min_tokens=2,
        bad_words=("no",),
        allowed_token_ids=(1, 2),
        logprobs=4,
    )
    assert api._sampling_params(chat) == expected
    completion = CompletionRequest.model_validate({"prompt": "x", "logprobs": 0})
    assert api._sampling_params(completion).logprobs == 0
    plain_chat = ChatCompletionRequest.model_validate({"messages": HI, "logprobs": False})
    assert api._sampling_params(plain_chat).logprobs is None


class _State:
    """The two things `_start` reads from the worker state."""

    metrics = None
    settings = type("Settings", (), {"max_num_seqs": 2, "max_waiting": 2})()


class _Refusing:
    """Stands in for the engine at the one call `_start` makes: it raises as told."""

    tokenizer = None

    def __init__(self, error: Exception) -> None:
        self.error = error

    def generate(self, *args: Any) -> Any:
        raise self.error


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("body", "engine_param", "client_param"),
    [
        ({"messages": HI, "max_completion_tokens": 9}, "max_tokens", "max_completion_tokens"),
        ({"messages": HI}, "prompt", "messages"),
        ({"prompt": [1, 2], "max_tokens": 9}, "max_tokens", "max_tokens"),
    ],
)
async def test_refusals_name_the_clients_field(
    body: dict[str, Any], engine_param: str, client_param: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    kind = ChatCompletionRequest if "messages" in body else CompletionRequest
    req = kind.model_validate(body)
    engine = _Refusing(RequestRejected("too long", engine_param, "context_length_exceeded"))
    state: Any = _State()
    monkeypatch.setattr(api, "_prompts", lambda e, r: [([1, 2], "")])  # no tokenizer needed
    with pytest.raises(InvalidRequest) as err:
        await api._start(engine, state, req, "id")  # type: ignore[arg-type]
    assert err.value.param == client_param and err.value.code == "context_length_exceeded"


@pytest.mark.anyio
async def test_a_full_engine_is_503(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(api, "_prompts", lambda e, r: [([1], "")])
    req = CompletionRequest.model_validate({"prompt": "x"})
    state: Any = _State()
    with pytest.raises(Unavailable) as err:
        await api._start(_Refusing(QueueFull("full")), state, req, "id")  # type: ignore[arg-type]
    assert err.value.code == "queue_full" and err.value.headers["Retry-After"]


@pytest.mark.anyio
async def test_more_choices_than_the_worker_can_hold_is_400(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request that could never be queued whole is the client's error, not a 503."""
    monkeypatch.setattr(api, "_prompts", lambda e, r: [([1], "")])
    req = CompletionRequest.model_validate({"prompt": "x", "n": 5})
    with pytest.raises(InvalidRequest) as err:
        await api._start(_Refusing(QueueFull("full")), _State(), req, "id")  # type: ignore[arg-type]
    assert err.value.param == "n" and "at most 4" in err.value.message
