"""The request bodies the embedded worker accepts: the gateway's own models
(wire/schemas.py: the same strict types, the same 400s) plus the fields only the worker
reads. Which fields are honoured and which refused (with a 400 naming them, never silently
dropped) is fields.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from wire import schemas as shared
from wire.errors import InvalidRequest
from wire.refused import CHAT_ROLES, MESSAGE_REFUSED

Endpoint = Literal["chat", "completion"]


class _WorkerFields(shared.SamplingFields):
    # A worker serves one model: like vLLM, a request may leave `model` out.
    model: Annotated[str, Field(min_length=1, max_length=256)] | None = None  # type: ignore[assignment]
    top_k: Annotated[int, Field(ge=-1), shared.INTEGRAL] | None = None
    seed: shared.Seed | None = None  # torch's int64
    stop_token_ids: list[shared.Int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    # Ranges are the engine's to check (engine.py): one place, vLLM's messages.
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: shared.Int = 0
    bad_words: list[str] | None = None
    allowed_token_ids: list[shared.Int] | None = None

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(s == "" for s in stops):
            raise InvalidRequest("stop: stop strings must not be empty", param="stop")
        return stops

    def max_tokens_field(self) -> tuple[str, int | None]:
        """(the field the client used, its value)."""
        return "max_tokens", self.max_tokens

    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """`logit_bias` with its keys read as token ids; the bias clamped to OpenAI's
        [-100, 100] as vLLM does."""
        pairs = []
        for key, bias in (self.logit_bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                raise InvalidRequest(
                    f"logit_bias: keys must be token ids, got {key!r}", param="logit_bias"
                ) from None
            pairs.append((token, min(100.0, max(-100.0, bias))))
        return tuple(pairs)


# Template variables a request may not set through chat_template_kwargs: the worker sets them.
RESERVED_TEMPLATE_VARIABLES = frozenset(
    {"messages", "add_generation_prompt", "continue_final_message", "tools", "documents"}
)


class ChatCompletionRequest(_WorkerFields, shared.ChatCompletionRequest):
    logprobs: bool | None = None
    top_logprobs: shared.Int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False  # the template writes them (vLLM's chat default)

    def template_options(self) -> dict[str, Any]:
        """Tokenizer.apply_chat_template's options, as the request sets them."""
        if self.continue_final_message and self.add_generation_prompt:
            raise InvalidRequest(
                "continue_final_message: cannot be true with add_generation_prompt true "
                "(send add_generation_prompt: false)",
                param="continue_final_message",
            )
        kwargs = self.chat_template_kwargs or {}
        reserved = sorted(RESERVED_TEMPLATE_VARIABLES & set(kwargs))
        if reserved:
            raise InvalidRequest(
                f"chat_template_kwargs: {reserved} are set by the request's own fields",
                param="chat_template_kwargs",
            )
        return {
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
            "template_kwargs": kwargs,
            "add_special_tokens": self.add_special_tokens,
        }

    def num_logprobs(self) -> int | None:
        """Top log-probabilities per output token (None: no logprobs at all). The checks
        and their order are vLLM 0.33's chat request's (`check_logprobs`): -1 is the whole
        vocabulary, which the engine's limit then refuses naming `logprobs`, as vLLM's."""
        if self.top_logprobs is not None and self.top_logprobs < -1:
            raise InvalidRequest(
                "top_logprobs: must be a positive value or -1", param="top_logprobs"
            )
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest("top_logprobs: needs `logprobs` set to true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict[str, str]]:
        """Messages as the chat template takes them: plain role/content strings."""
        return [_flatten(i, m) for i, m in enumerate(self.messages)]

    def max_tokens_field(self) -> tuple[str, int | None]:
        if self.max_completion_tokens is not None:  # chat's newer name wins
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens


ROLE_LIST = ", ".join(sorted(CHAT_ROLES))


def _flatten(index: int, message: shared.ChatMessage) -> dict[str, str]:
    where = f"messages[{index}]"
    if message.role not in CHAT_ROLES:
        raise InvalidRequest(
            f"{where}.role: unsupported role {message.role!r} (use {ROLE_LIST})",
            param=f"{where}.role",
        )
    for key in sorted(message.model_fields_set | set(message.model_extra or {})):
        why = MESSAGE_REFUSED.get(key)
        if why is not None and getattr(message, key, None) is not None:
            raise InvalidRequest(f"{where}.{key}: {why}", param=f"{where}.{key}")
    role = "system" if message.role == "developer" else message.role
    content = message.content
    if content is None:
        return {"role": role, "content": ""}
    if isinstance(content, str):
        return {"role": role, "content": content}
    texts: list[str] = []
    for j, part in enumerate(content):
        # The gateway's shapes (wire/nested.py) have checked each part's keys.
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type", "untyped")
            raise InvalidRequest(
                f"{where}.content[{j}]: the bundled models are text-only: a {kind!r} part "
                "cannot be read (send text parts or a string)",
                param=f"{where}.content[{j}]",
            )
        extra = sorted(set(part) - {"type", "text"})
        if extra:  # e.g. OpenAI's prompt_cache_breakpoint: no prompt cache is kept here
            raise InvalidRequest(
                f"{where}.content[{j}].{extra[0]}: not supported by the embedded engine",
                param=f"{where}.content[{j}].{extra[0]}",
            )
        texts.append(part["text"])
    return {"role": role, "content": "".join(texts)}


class CompletionRequest(_WorkerFields, shared.CompletionRequest):
    max_tokens: shared.EchoCount | None = None  # the gateway's rule, not _WorkerFields'
    logprobs: shared.Int | None = None
    add_special_tokens: bool = True  # vLLM's completions default

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """The prompts of a request, each a string or token ids (a batch: several)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        out: list[str | list[int]] = []
        ids: list[int] = []  # a flat list of token ids is one prompt
        for item in prompt:
            if isinstance(item, int):
                ids.append(item)
            else:
                out.append(item if isinstance(item, str) else list(item))
        return [ids] if ids else out


AnyRequest = ChatCompletionRequest | CompletionRequest


class TokenizeRequest(shared.TokenizeRequest):
    """The gateway's model; a worker serves one model, so `model` may be left out."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: Annotated[str, Field(min_length=1, max_length=256)] | None = None  # type: ignore[assignment]

    def template_messages(self) -> list[dict[str, str]]:
        return [_flatten(i, m) for i, m in enumerate(self.messages or [])]


class DetokenizeRequest(shared.DetokenizeRequest):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: Annotated[str, Field(min_length=1, max_length=256)] | None = None  # type: ignore[assignment]
