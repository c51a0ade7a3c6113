"""OpenAI request bodies the worker accepts (vLLM's extensions included), as pydantic models.

Unknown fields are ignored, as vLLM does; fields we cannot honour (n > 1, logprobs, images)
are refused with a 400 that says so rather than silently dropped.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from service.errors import InvalidRequest

CHAT_ROLES = {"system", "developer", "user", "assistant"}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[TextPart] | None = None


class SamplingFields(BaseModel):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    model_config = ConfigDict(extra="allow", protected_namespaces=())

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = Field(default=None, ge=0.0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(default=None, ge=-1)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)  # torch's int64
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logprobs: Any = None

    def refuse_unsupported(self) -> None:
        if self.n is not None and self.n != 1:
            raise InvalidRequest("n: only n == 1 is supported by this worker", param="n")
        if self.logprobs not in (None, False):
            raise InvalidRequest("logprobs: not supported by this worker", param="logprobs")

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(s == "" for s in stops):
            raise InvalidRequest("stop: stop strings must not be empty", param="stop")
        return stops


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None

    def template_messages(self) -> list[dict[str, str]]:
        """Messages as the chat template takes them: plain role/content strings."""
        if not self.messages:
            raise InvalidRequest("messages: at least one message is required", param="messages")
        return [_flatten(i, m) for i, m in enumerate(self.messages)]


def _flatten(index: int, message: ChatMessage) -> dict[str, str]:
    where = f"messages[{index}]"
    if message.role not in CHAT_ROLES:
        raise InvalidRequest(
            f"{where}.role: unsupported role {message.role!r} (use system, user or assistant)",
            param=f"{where}.role",
        )
    role = "system" if message.role == "developer" else message.role
    content = message.content
    if content is None:
        return {"role": role, "content": ""}
    if isinstance(content, str):
        return {"role": role, "content": content}
    texts: list[str] = []
    for j, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise InvalidRequest(
                f"{where}.content[{j}]: unsupported content part {part.type!r} (text only)",
                param=f"{where}.content",
            )
        texts.append(part.text)
    return {"role": role, "content": "".join(texts)}


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int]
    echo: bool | None = False
    suffix: str | None = None

    def single_prompt(self) -> str | list[int]:
        if self.echo or self.suffix:
            name = "echo" if self.echo else "suffix"
            raise InvalidRequest(f"{name}: not supported by this worker", param=name)
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise InvalidRequest("prompt: batched prompts are not supported; send one",
                                     param="prompt")
            return str(prompt[0])
        if isinstance(prompt, list):
            return [int(t) for t in prompt]
        return prompt


Endpoint = Literal["chat", "completion"]
