"""The worker's request models: the gateway's strict types plus the worker's own fields,
and the fields the embedded engine refuses."""

from __future__ import annotations

from typing import Any

import pytest

from engine.worker.schemas import ChatCompletionRequest, CompletionRequest
from wire.errors import InvalidRequest
from wire.schemas import validate_request

HI = [{"role": "user", "content": "hi"}]


def chat(**kw: Any) -> ChatCompletionRequest:
    parsed = validate_request(ChatCompletionRequest, {"messages": HI, **kw})
    assert isinstance(parsed, ChatCompletionRequest)
    return parsed


def test_model_is_optional_at_a_worker_and_worker_fields_parse() -> None:
    req = chat(top_k=5, stop_token_ids=[1, 2], ignore_eos=True)
    assert req.model is None and req.top_k == 5 and req.stop_token_ids == [1, 2]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("stream", "true"),
        ("stream_options", {"include_usage": "yes"}),
        ("max_tokens", "8"),
        ("top_k", -2),
        ("seed", 2**70),
        ("temperature", -1),
    ],
)
def test_as_strict_as_the_gateway(field: str, value: Any) -> None:
    extra = {"stream": True} if field == "stream_options" else {}
    with pytest.raises(InvalidRequest) as err:
        chat(**{field: value}, **extra)
    assert err.value.param is not None and err.value.param.startswith(field)


def test_messages_flatten_text_parts_and_refuse_others() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    req = chat(messages=[{"role": "developer", "content": parts}])
    assert req.template_messages() == [{"role": "system", "content": "ab"}]
    image = [{"type": "image_url", "image_url": {"url": "x"}}]
    with pytest.raises(InvalidRequest, match="text-only"):
        chat(messages=[{"role": "user", "content": image}]).template_messages()
    with pytest.raises(InvalidRequest, match="unsupported role") as refused:
        chat(messages=[{"role": "tool", "content": "x"}]).template_messages()
    assert "developer" in refused.value.message  # every role the template takes is listed


def test_max_completion_tokens_wins_in_chat() -> None:
    assert chat(max_tokens=3, max_completion_tokens=5).max_tokens_field() == (
        "max_completion_tokens",
        5,
    )
    assert chat(max_tokens=3).max_tokens_field() == ("max_tokens", 3)


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [("x", "x"), (["x"], "x"), ([1, 2], [1, 2]), ([[1, 2]], [1, 2])],
)
def test_one_prompt_in_any_shape(prompt: Any, expected: Any) -> None:
    req = CompletionRequest.model_validate({"prompt": prompt})
    assert req.prompts() == [expected]


def test_batched_prompts() -> None:
    assert CompletionRequest.model_validate({"prompt": ["a", "b"]}).prompts() == ["a", "b"]
    batch = CompletionRequest.model_validate({"prompt": [[1], [2, 3]]})
    assert batch.prompts() == [[1], [2, 3]]
