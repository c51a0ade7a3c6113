"""What the gateway accepts: OpenAI fields it depends on are checked, extras pass."""

from __future__ import annotations

from typing import Any

import pytest

from wire.errors import InvalidRequest
from wire.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeRequest,
    prompt_text,
    validate_request,
)

CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_a_cache_salt_within_vllms_rule_is_kept() -> None:
    parsed = validate_request(ChatCompletionRequest, {**CHAT, "cache_salt": "s" * 128})
    assert parsed.cache_salt == "s" * 128


def test_unknown_fields_are_kept() -> None:
    payload = {**CHAT, "top_k": 5, "chat_template_kwargs": {"x": 1}}
    parsed = validate_request(ChatCompletionRequest, payload)
    assert parsed.model_extra == {"top_k": 5, "chat_template_kwargs": {"x": 1}}


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        ({"model": 3}, "model"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": "8"}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"stream": "yes"}, "stream"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"max_tokens": 8.5}, "max_tokens"),  # an integer: no fraction
        ({"max_tokens": True}, "max_tokens"),
        ({"n": 2.5}, "n"),
        ({"seed": float("inf")}, "seed"),
        ({"stop": ""}, "stop"),
        ({"stop": ["a", ""]}, "stop"),
        # vLLM 0.33's validate_cache_salt: a non-empty string, <= 128 chars, no @ / \\ NUL
        ({"cache_salt": 5}, "cache_salt"),
        ({"cache_salt": {}}, "cache_salt"),
        ({"cache_salt": ""}, "cache_salt"),
        ({"cache_salt": "s" * 129}, "cache_salt"),
        ({"cache_salt": "a/b"}, "cache_salt"),
        ({"cache_salt": "a\x00b"}, "cache_salt"),
    ],
)
def test_bad_fields_are_400_naming_the_field(patch: dict[str, Any], param: str | None) -> None:
    with pytest.raises(InvalidRequest) as info:
        validate_request(ChatCompletionRequest, {**CHAT, **patch})
    assert info.value.status_code == 400
    assert info.value.param == param


@pytest.mark.parametrize("prompt", ["x", ["a", "b"], [1, 2], [[1], [2]]])
def test_completion_prompt_shapes(prompt: Any) -> None:
    assert validate_request(CompletionRequest, {"model": "m", "prompt": prompt})


@pytest.mark.parametrize(
    ("prompt", "param"), [([], "prompt"), ([[]], "prompt[0]"), ([[1], []], "prompt[1]")]
)
def test_an_empty_prompt_of_token_ids_is_refused(prompt: Any, param: str) -> None:
    """Named as empty: the text branch's "should be a valid string" told the client nothing."""
    with pytest.raises(InvalidRequest) as info:
        validate_request(CompletionRequest, {"model": "m", "prompt": prompt})
    assert info.value.param == param
    assert "at least 1 item" in info.value.message, info.value.message


@pytest.mark.parametrize(
    ("prompt", "param", "says"),
    [
        ([-1], "prompt[0]", "greater than or equal to 0"),
        ([[1, -2]], "prompt[0][1]", "greater than or equal to 0"),
        (5, "prompt", "should be a string or a list"),  # no branch's type: every branch's
        (["a", 1], "prompt", "valid string"),
    ],
)
def test_a_union_names_what_is_wrong_with_the_value(prompt: Any, param: str, says: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        validate_request(CompletionRequest, {"model": "m", "prompt": prompt})
    assert (info.value.param, says in info.value.message) == (param, True), info.value.message


def test_the_first_fields_complaint_wins_over_a_later_fields() -> None:
    body = {**CHAT, "n": "2", "max_tokens": -1}  # a type error first, a value error after
    with pytest.raises(InvalidRequest) as info:
        validate_request(ChatCompletionRequest, body)
    assert info.value.param == "n"


def test_integers_may_be_floats_with_no_fraction() -> None:
    """JSON Schema's `integer` includes 8.0, and vLLM's (lax) request models take it: the
    parsed request holds ints."""
    chat = validate_request(ChatCompletionRequest, {**CHAT, "max_tokens": 8.0, "n": 2.0})
    assert (chat.max_tokens, chat.n) == (8, 2) and type(chat.max_tokens) is int
    body = {"model": "m", "prompt": [[1.0, 2.0]], "seed": -3.0, "max_tokens": 0.0, "echo": True}
    completion = validate_request(CompletionRequest, body)
    assert (completion.prompt, completion.seed, completion.max_tokens) == ([[1, 2]], -3, 0)
    assert all(type(t) is int for t in completion.prompt[0])  # type: ignore[union-attr]


def test_not_an_object() -> None:
    with pytest.raises(InvalidRequest):
        validate_request(CompletionRequest, [1, 2])


def test_affinity_key_is_a_bounded_prefix() -> None:
    long = {**CHAT, "messages": [{"role": "user", "content": "a" * 1000}]}
    key = prompt_text(validate_request(ChatCompletionRequest, long), 64)
    assert len(key) == 64
    assert key.startswith("user")


def test_tokenize_adds_special_tokens_by_vllms_defaults() -> None:
    """True for a prompt, false for chat messages (the template writes its own), else as
    sent: the worker honours it both ways."""
    chat = [{"role": "user", "content": "x"}]
    assert TokenizeRequest.model_validate({"model": "m", "prompt": "x"}).special_tokens()
    assert not TokenizeRequest.model_validate({"model": "m", "messages": chat}).special_tokens()
    both = {"model": "m", "messages": chat, "add_special_tokens": True}
    assert TokenizeRequest.model_validate(both).special_tokens()
