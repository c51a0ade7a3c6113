"""One streamed chat completion, measured: prompt mix, request body, SSE parsing, record.

Locust-free on purpose: importing locust monkey-patches the process with gevent, so what the
locustfile and the sweep share lives here and is unit-tested on recorded streams.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

DEFAULT_PROMPTS = Path(__file__).parent / "prompts" / "mix.jsonl"


class StreamError(RuntimeError):
    """The server answered something that is not a complete, well-formed completion."""


@dataclass(frozen=True)
class Prompt:
    """One entry of the prompt mix; `kind` (code, prose, math) names the Locust events."""

    kind: str
    messages: tuple[tuple[str, str], ...]  # (role, content)
    weight: float = 1.0

    def as_messages(self) -> list[dict[str, str]]:
        return [{"role": role, "content": content} for role, content in self.messages]


def parse_prompt_line(line: str) -> Prompt:
    """`{"class": "code", "prompt": "..."}` or `{"class": ..., "messages": [...]}` (+ weight)."""
    item = json.loads(line)
    if not isinstance(item, dict) or not isinstance(item.get("class"), str):
        raise ValueError('each line needs a string "class"')
    if isinstance(item.get("prompt"), str):
        messages: tuple[tuple[str, str], ...] = (("user", item["prompt"]),)
    elif isinstance(item.get("messages"), list) and item["messages"]:
        messages = tuple((str(m["role"]), str(m["content"])) for m in item["messages"])
    else:
        raise ValueError('each line needs "prompt" (string) or "messages" (non-empty list)')
    weight = float(item.get("weight", 1.0))
    if weight <= 0:
        raise ValueError('"weight" must be > 0')
    return Prompt(kind=item["class"], messages=messages, weight=weight)


def load_prompts(path: Path) -> list[Prompt]:
    """Read a JSONL prompt mix; blank lines and `#` comments are skipped."""
    prompts: list[Prompt] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            prompts.append(parse_prompt_line(line))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{number}: {exc}") from exc
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def pick_prompt(prompts: list[Prompt], rng: random.Random) -> Prompt:
    return rng.choices(prompts, weights=[p.weight for p in prompts], k=1)[0]


def chat_body(
    prompt: Prompt,
    *,
    model: str,
    max_tokens: int,
    temperature: float,
    stream: bool = True,
    ignore_eos: bool = False,
) -> dict[str, Any]:
    """The OpenAI request; include_usage asks for the final chunk with usage + metrics."""
    body: dict[str, Any] = {
        "model": model,
        "messages": prompt.as_messages(),
        "max_tokens": max_tokens,
        "temperature": temperature,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    if ignore_eos:
        body["ignore_eos"] = True  # vLLM extension: fixed-length outputs for benchmarks
    return body


def iter_sse_data(lines: Iterable[bytes | str]) -> Iterator[dict[str, Any]]:
    """JSON payloads of an SSE stream up to `data: [DONE]`; in-band errors raise StreamError.

    Data lines of one event are joined (SSE spec); comments, `event:`, `id:` are ignored.
    """
    data: list[str] = []
    for raw in lines:
        line = (raw.decode("utf-8") if isinstance(raw, bytes) else raw).rstrip("\r\n")
        if line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
            continue
        if line or not data:
            continue
        payload, data = "\n".join(data), []
        if payload.strip() == "[DONE]":
            return
        yield _decode_event(payload)
    if data and "\n".join(data).strip() == "[DONE]":
        return  # a server that does not end the last event with a blank line
    raise StreamError("stream ended without data: [DONE]")


def _decode_event(payload: str) -> dict[str, Any]:
    try:
        event = json.loads(payload)
    except json.JSONDecodeError as exc:
        raise StreamError(f"bad SSE payload: {payload[:120]!r}") from exc
    if not isinstance(event, dict):
        raise StreamError(f"SSE payload is not an object: {payload[:120]!r}")
    if "error" in event:
        error = event["error"]
        message = error.get("message", error) if isinstance(error, dict) else error
        raise StreamError(f"in-band error: {message}")
    return event


@dataclass(frozen=True)
class RequestRecord:
    """What one request measured; times in seconds (start is epoch, the rest offsets)."""

    kind: str
    start: float
    latency_s: float
    ttft_s: float | None
    output_tokens: int
    prompt_tokens: int | None
    chunks: int
    acceptance_length: float | None
    finish_reason: str | None
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        """(end - first token) / (tokens - 1), as the gateway's TPOT; None when undefined."""
        if self.ttft_s is None or self.output_tokens < 2 or self.latency_s <= self.ttft_s:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def tokens_per_s(self) -> float | None:
        """Per-user tokens/s (interactivity) = 1 / TPOT."""
        tpot = self.tpot_s
        return None if tpot is None else 1.0 / tpot

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, line: str) -> RequestRecord:
        return cls(**json.loads(line))


def failed_record(kind: str, start: float, latency_s: float, error: str) -> RequestRecord:
    return RequestRecord(
        kind=kind,
        start=start,
        latency_s=latency_s,
        ttft_s=None,
        output_tokens=0,
        prompt_tokens=None,
        chunks=0,
        acceptance_length=None,
        finish_reason=None,
        error=error,
    )


def acceptance_length(event: dict[str, Any]) -> float | None:
    """`metrics.speculative_decoding.mean_acceptance_length` (vLLM 0.33), when present."""
    metrics = event.get("metrics")
    spec = metrics.get("speculative_decoding") if isinstance(metrics, dict) else None
    value = spec.get("mean_acceptance_length") if isinstance(spec, dict) else None
    return float(value) if isinstance(value, int | float) else None


class StreamTracker:
    """Feeds on the parsed chunks of one stream, with their arrival offsets, into a record."""

    def __init__(self, kind: str, start: float) -> None:
        self.kind = kind
        self.start = start
        self.ttft_s: float | None = None
        self.content_chunks = 0
        self.usage: dict[str, Any] | None = None
        self.acceptance: float | None = None
        self.finish_reason: str | None = None

    def feed(self, event: dict[str, Any], offset_s: float) -> None:
        for choice in event.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                self.content_chunks += 1
                if self.ttft_s is None:
                    self.ttft_s = offset_s
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        if isinstance(event.get("usage"), dict):
            self.usage = event["usage"]
            self.acceptance = acceptance_length(event)

    def finish(self, latency_s: float) -> RequestRecord:
        # Tokens come from usage: a speculative step streams several tokens in one chunk,
        # so counting chunks would undercount. Chunks are the fallback for servers without it.
        tokens = self.content_chunks
        prompt_tokens = None
        if self.usage is not None:
            tokens = int(self.usage.get("completion_tokens", tokens))
            prompt_tokens = self.usage.get("prompt_tokens")
        return RequestRecord(
            kind=self.kind,
            start=self.start,
            latency_s=latency_s,
            ttft_s=self.ttft_s,
            output_tokens=tokens,
            prompt_tokens=prompt_tokens,
            chunks=self.content_chunks,
            acceptance_length=self.acceptance,
            finish_reason=self.finish_reason,
        )


def record_from_response(
    kind: str, start: float, latency_s: float, body: dict[str, Any]
) -> RequestRecord:
    """A non-streaming completion: no TTFT from the client's side, tokens from usage."""
    usage = body.get("usage") or {}
    choices = body.get("choices") or [{}]
    return RequestRecord(
        kind=kind,
        start=start,
        latency_s=latency_s,
        ttft_s=None,
        output_tokens=int(usage.get("completion_tokens", 0)),
        prompt_tokens=usage.get("prompt_tokens"),
        chunks=0,
        acceptance_length=acceptance_length(body),
        finish_reason=choices[0].get("finish_reason"),
    )


def base_url(host: str) -> str:
    """Accept `http://h:8000` as well as the OpenAI-style `http://h:8000/v1`."""
    host = host.rstrip("/")
    return host if host.endswith("/v1") else host + "/v1"
