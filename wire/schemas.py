"""Validation of the OpenAI request fields the gateway depends on.

Models allow extra fields (vLLM's `top_k`, `chat_template_kwargs`, ...): the gateway forwards
the client's original JSON, so validation only decides accept or 400, and never rewrites.
Strict types: what passes here reaches the worker exactly as the client sent it.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)

from wire.errors import InvalidRequest, from_validation_errors
from wire.nested import STREAM_OPTIONS, check_chat_objects, check_messages, check_object

_OPEN = ConfigDict(extra="allow", strict=True)


def integral(value: Any) -> Any:
    """JSON has one number type: `8.0` is the integer 8 (JSON Schema's `integer` includes it,
    and vLLM's lax models accept it). `8.5` stays a float, which the strict int refuses with a
    400 naming the field; so do a string and a bool."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# An integer field: an int, or a float with no fractional part. INTEGRAL comes after a
# field's bounds, so that they stay JSON Schema's `minimum` and `maximum`.
INTEGRAL = BeforeValidator(integral)
Int = Annotated[int, INTEGRAL]
Role = Literal["system", "developer", "user", "assistant", "tool", "function"]
# Counts and token ids fit int32 on every engine; a seed fits int64 (torch's generator).
Count = Annotated[int, Field(ge=1, le=2**31 - 1), INTEGRAL]
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1), INTEGRAL]
Seed = Annotated[int, Field(ge=-(2**63), le=2**63 - 1), INTEGRAL]
StopString = Annotated[str, Field(min_length=1)]
# Completions' max_tokens may be 0 with echo: the prompt alone (with its logprobs), as vLLM;
# eval harnesses score prompts this way.
EchoCount = Annotated[int, Field(ge=0, le=2**31 - 1), INTEGRAL]


class StreamOptions(BaseModel):
    model_config = _OPEN
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class ChatMessage(BaseModel):
    model_config = _OPEN
    role: Role
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


# vLLM 0.33's rule for a prefix-cache salt (vllm/entrypoints/generate/base/protocol.py,
# validate_cache_salt): a non-empty string of at most 128 characters, without @ / \ or NUL.
CacheSalt = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[^@/\\\x00]+$")]


class SamplingFields(BaseModel):
    """Fields shared by both endpoints that the gateway reads or that must be sane."""

    model_config = _OPEN
    model: Annotated[str, Field(min_length=1, max_length=256)]
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=128), INTEGRAL] | None = 1
    max_tokens: Count | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    seed: Seed | None = None
    stop: StopString | list[StopString] | None = None  # empty: refused by every engine
    user: str | None = None
    cache_salt: CacheSalt | None = None

    @model_validator(mode="before")
    @classmethod
    def _shapes_and_stops(cls, data: Any) -> Any:
        if isinstance(data, dict):
            check_object(data.get("stream_options"), STREAM_OPTIONS, "stream_options")
            stop = data.get("stop")
            if stop == "" or (isinstance(stop, list) and "" in stop):  # said plainly
                raise InvalidRequest("stop: stop strings must not be empty", param="stop")
        return data

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest(
                "stream_options: can only be set when stream is true", param="stream_options"
            )
        return self


class ChatCompletionRequest(SamplingFields):
    model_config = ConfigDict(
        extra="allow",
        strict=True,
        json_schema_extra={
            "examples": [
                {
                    "model": "tiny-coder",
                    "messages": [{"role": "user", "content": "def fib(n):"}],
                    "max_tokens": 8,
                }
            ]
        },
    )
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Count | None = None

    @model_validator(mode="before")
    @classmethod
    def _nested_shapes(cls, data: Any) -> Any:
        if isinstance(data, dict):
            check_chat_objects(data)
        return data


# A prompt of token ids holds at least one (an empty one is refused by every engine).
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
PromptItems = (
    Annotated[list[str], Field(min_length=1)]
    | TokenIds
    | Annotated[list[TokenIds], Field(min_length=1)]
)


class CompletionRequest(SamplingFields):
    model_config = ConfigDict(
        extra="allow",
        strict=True,
        json_schema_extra={
            "examples": [{"model": "tiny-coder", "prompt": "def fib(n):", "max_tokens": 8}]
        },
    )
    prompt: str | PromptItems
    echo: bool | None = None
    max_tokens: EchoCount | None = None

    @model_validator(mode="after")
    def _no_tokens_only_with_echo(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise InvalidRequest(
                "max_tokens: must be at least 1 (0 only with echo)", param="max_tokens"
            )
        return self


class RoutedRequest(BaseModel):
    """A one-shot request routed to a worker serving `model` (no stream, one answer)."""

    model_config = _OPEN
    # Not fields: what the proxy reads of every request it forwards.
    stream: ClassVar[bool] = False
    stream_options: ClassVar[None] = None
    n: ClassVar[int] = 1
    model: Annotated[str, Field(min_length=1, max_length=256)]


class TokenizeRequest(RoutedRequest):
    """vLLM's /tokenize: a completion prompt or chat messages."""

    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # None: vLLM's default, true for a prompt only
    return_token_strs: bool = False

    @model_validator(mode="before")
    @classmethod
    def _message_shapes(cls, data: Any) -> Any:
        if isinstance(data, dict):
            check_messages(data.get("messages"))
        return data

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self

    def special_tokens(self) -> bool:
        """Add the tokenizer's special tokens? (A chat template writes its own.)"""
        if self.add_special_tokens is not None:
            return self.add_special_tokens
        return self.messages is None


class DetokenizeRequest(RoutedRequest):
    """vLLM's /detokenize: token ids back to text."""

    tokens: list[TokenId]


M = TypeVar("M", bound=BaseModel)


def validate_request(model: type[M], payload: object) -> M:
    """Validate a parsed JSON body; a failure is a 400 naming the first bad field."""
    if not isinstance(payload, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        raise from_validation_errors(list(exc.errors())) from None


def prompt_text(request: SamplingFields, limit: int) -> str:
    """The first `limit` characters of the prompt: the key of prefix-affinity routing."""
    if isinstance(request, ChatCompletionRequest):
        parts: list[str] = []
        for message in request.messages:
            parts.append(message.role)
            parts.append(message.content if isinstance(message.content, str) else "")
            if sum(len(part) for part in parts) >= limit:
                break
        return "\x1f".join(parts)[:limit]
    if isinstance(request, CompletionRequest):
        prompt = request.prompt
        if isinstance(prompt, str):
            return prompt[:limit]
        return repr(prompt[:1])[:limit]
    return ""
