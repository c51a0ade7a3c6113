"""The request bodies the embedded worker accepts: the gateway's own models
(service/schemas.py: the same strict types, the same 400s) plus the fields only the worker
reads. Fields the embedded engine cannot honour are refused with a 400 naming them, never
silently dropped.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from service import schemas as gateway
from service.errors import InvalidRequest

CHAT_ROLES = {"system", "developer", "user", "assistant"}
Endpoint = Literal["chat", "completion"]


class _WorkerFields(gateway.SamplingFields):
    # A worker serves one model: like vLLM, a request may leave `model` out.
    model: Annotated[str, Field(min_length=1, max_length=256)] | None = None  # type: ignore[assignment]
    top_k: Annotated[int, Field(ge=-1)] | None = None
    seed: gateway.Seed | None = None  # torch's int64
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
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

    def max_tokens_field(self) -> tuple[str, int | None]:
        """(the field the client used, its value)."""
        return "max_tokens", self.max_tokens


class ChatCompletionRequest(_WorkerFields, gateway.ChatCompletionRequest):
    def template_messages(self) -> list[dict[str, str]]:
        """Messages as the chat template takes them: plain role/content strings."""
        return [_flatten(i, m) for i, m in enumerate(self.messages)]

    def max_tokens_field(self) -> tuple[str, int | None]:
        if self.max_completion_tokens is not None:  # chat's newer name wins
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens


def _flatten(index: int, message: gateway.ChatMessage) -> dict[str, str]:
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
        text = part.get("text")
        if part.get("type") != "text" or not isinstance(text, str):
            raise InvalidRequest(
                f"{where}.content[{j}]: unsupported content part {part.get('type')!r} (text only)",
                param=f"{where}.content",
            )
        texts.append(text)
    return {"role": role, "content": "".join(texts)}


class CompletionRequest(_WorkerFields, gateway.CompletionRequest):
    suffix: str | None = None

    def single_prompt(self) -> str | list[int]:
        if self.echo or self.suffix:
            name = "echo" if self.echo else "suffix"
            raise InvalidRequest(f"{name}: not supported by this worker", param=name)
        prompt = self.prompt
        if isinstance(prompt, str):
            return prompt
        if len(prompt) > 1 and not isinstance(prompt[0], int):
            raise InvalidRequest(
                "prompt: batched prompts are not supported; send one", param="prompt"
            )
        first = prompt[0]
        if isinstance(first, str):
            return first
        if isinstance(first, list):
            return list(first)
        return [int(t) for t in prompt]  # type: ignore[arg-type]


AnyRequest = ChatCompletionRequest | CompletionRequest
