"""Locust user: streaming OpenAI chat completions against any OpenAI-compatible base URL.

    locust -f loadtest/locustfile.py --host http://127.0.0.1:8000            # web UI
    locust -f loadtest/locustfile.py --host http://127.0.0.1:8000 --headless -u 4 -r 4 -t 60s

Each user sends requests back to back (closed loop: concurrency = users), with a prompt
picked from the mix file. Besides the request itself (`POST chat <class>`, end-to-end time,
length = output tokens) it reports, per prompt class (the event name), custom events whose
"response time" column holds the measured value:
    TTFT [ms], TPOT [ms], TOKENS_PER_S (per-user tokens/s = 1/TPOT), OUTPUT_TOKENS [tokens],
    ACCEPT_LEN (mean acceptance length from the final usage chunk's
    `metrics.speculative_decoding`, only when the server reports it).
Averages in Locust's tables are exact; Locust rounds percentiles to integers.
Options (command line, env var, or the web UI's custom parameters): see `_add_options`.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests
from locust import User, constant, events, task
from locust.argument_parser import LocustArgumentParser

from loadtest.chat_stream import (
    DEFAULT_PROMPTS,
    Prompt,
    RequestRecord,
    StreamError,
    StreamTracker,
    base_url,
    chat_body,
    failed_record,
    iter_sse_data,
    load_prompts,
    pick_prompt,
    record_from_response,
)


def _add_options(parser: LocustArgumentParser, **_: Any) -> None:
    parser.add_argument(
        "--model",
        env_var="DFLASH_MODEL",
        default="",
        help="model name (default: the first of GET /v1/models)",
    )
    parser.add_argument("--max-tokens", type=int, env_var="DFLASH_MAX_TOKENS", default=128)
    parser.add_argument("--temperature", type=float, env_var="DFLASH_TEMPERATURE", default=0.0)
    parser.add_argument(
        "--api-key",
        env_var="DFLASH_API_KEY",
        default="",
        is_secret=True,
        help="sent as 'Authorization: Bearer ...'",
    )
    parser.add_argument(
        "--prompt-file",
        env_var="DFLASH_PROMPT_FILE",
        default=str(DEFAULT_PROMPTS),
        help="JSONL prompt mix: {class, prompt|messages, weight?} per line",
    )
    parser.add_argument(
        "--no-stream",
        action="store_true",
        env_var="DFLASH_NO_STREAM",
        help="non-streaming requests (no TTFT/TPOT events)",
    )
    parser.add_argument(
        "--ignore-eos",
        action="store_true",
        env_var="DFLASH_IGNORE_EOS",
        help="send vLLM's ignore_eos: every request generates max_tokens",
    )
    parser.add_argument(
        "--request-timeout", type=float, env_var="DFLASH_REQUEST_TIMEOUT", default=300.0
    )
    parser.add_argument(
        "--records-file",
        env_var="DFLASH_RECORDS_FILE",
        default="",
        include_in_web_ui=False,
        help="append one JSON line per request here (read by dflash-bench sweep)",
    )


# Locust's hook for custom options: they get flags, env vars and web UI fields.
events.init_command_line_parser.add_listener(_add_options)  # type: ignore[no-untyped-call]


@dataclass(frozen=True)
class LoadSettings:
    """The user's settings, read once from Locust's parsed options (flags, env, web UI)."""

    model: str
    max_tokens: int
    temperature: float
    api_key: str
    prompt_file: Path
    stream: bool
    ignore_eos: bool
    timeout_s: float
    records_file: Path | None

    @classmethod
    def from_options(cls, options: Any) -> LoadSettings:
        return cls(
            model=options.model,
            max_tokens=int(options.max_tokens),
            temperature=float(options.temperature),
            api_key=options.api_key,
            prompt_file=Path(options.prompt_file),
            stream=not options.no_stream,
            ignore_eos=bool(options.ignore_eos),
            timeout_s=float(options.request_timeout),
            records_file=Path(options.records_file) if options.records_file else None,
        )


class ChatCompletionUser(User):
    """One closed-loop client: pick a prompt, stream the completion, report, repeat."""

    wait_time = constant(0)

    def on_start(self) -> None:
        self.settings = LoadSettings.from_options(self.environment.parsed_options)
        self.prompts = load_prompts(self.settings.prompt_file)
        self.rng = random.Random()
        self.session = requests.Session()
        if self.settings.api_key:
            self.session.headers["Authorization"] = f"Bearer {self.settings.api_key}"
        self.url = base_url(self.host or "http://127.0.0.1:8000")
        self.model = self.settings.model or self._first_model()

    def on_stop(self) -> None:
        self.session.close()

    def _first_model(self) -> str:
        reply = self.session.get(f"{self.url}/models", timeout=self.settings.timeout_s)
        reply.raise_for_status()
        return str(reply.json()["data"][0]["id"])

    @task
    def chat(self) -> None:
        prompt = pick_prompt(self.prompts, self.rng)
        start, t0 = time.time(), time.perf_counter()
        try:
            record = self._send(prompt, start, t0)
        except (requests.RequestException, StreamError, ValueError, KeyError) as exc:
            record = failed_record(prompt.kind, start, time.perf_counter() - t0, str(exc))
        self._report(record)

    def _send(self, prompt: Prompt, start: float, t0: float) -> RequestRecord:
        s = self.settings
        body = chat_body(
            prompt,
            model=self.model,
            max_tokens=s.max_tokens,
            temperature=s.temperature,
            stream=s.stream,
            ignore_eos=s.ignore_eos,
        )
        url = f"{self.url}/chat/completions"
        with self.session.post(url, json=body, stream=s.stream, timeout=s.timeout_s) as reply:
            if reply.status_code != 200:
                raise StreamError(f"HTTP {reply.status_code}: {reply.text[:300]}")
            if not s.stream:
                return record_from_response(
                    prompt.kind, start, time.perf_counter() - t0, reply.json()
                )
            tracker = StreamTracker(prompt.kind, start)
            for event in iter_sse_data(reply.iter_lines()):
                tracker.feed(event, time.perf_counter() - t0)
            return tracker.finish(time.perf_counter() - t0)

    def _report(self, record: RequestRecord) -> None:
        fire = self.environment.events.request.fire
        error = StreamError(record.error) if record.error else None
        fire(
            request_type="POST",
            name=f"chat {record.kind}",
            response_time=record.latency_s * 1000,
            response_length=record.output_tokens,
            exception=error,
            context={},
        )
        if self.settings.records_file is not None:
            with self.settings.records_file.open("a", encoding="utf-8") as out:
                out.write(record.to_json() + "\n")
        if error is not None:
            return
        values = {
            "TTFT": None if record.ttft_s is None else record.ttft_s * 1000,
            "TPOT": None if record.tpot_s is None else record.tpot_s * 1000,
            "TOKENS_PER_S": record.tokens_per_s,
            "OUTPUT_TOKENS": float(record.output_tokens),
            "ACCEPT_LEN": record.acceptance_length,
        }
        for metric, value in values.items():
            if value is not None:
                fire(
                    request_type=metric,
                    name=record.kind,
                    response_time=value,
                    response_length=0,
                    exception=None,
                    context={},
                )
