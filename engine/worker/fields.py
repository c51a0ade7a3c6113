"""Every field of vLLM's chat and completion requests, and what the embedded worker does with
it: honoured exactly, or refused with a 400 naming the field and saying why. Nothing is
accepted and silently ignored.

A refused field is accepted only with a value that asks for nothing (its "off" value, e.g.
`prompt_logprobs: 0`, `use_beam_search: false`), so clients that send defaults keep
working. The gateway passes every field through untouched: a vLLM worker gets them all. A
field that is in neither vLLM's requests nor OpenAI's is unknown: a 400 as well (vLLM
ignores those; we do not).
`tests/engine/worker/test_fields.py` checks this table against real vLLM's request models.
"""

from __future__ import annotations

import json
from typing import Any

from wire.errors import InvalidRequest
from wire.refused import Refused

VLLM_BACKEND = "the vLLM backend supports it"


# Read by the worker and honoured exactly (the endpoint's own fields: ENDPOINT_FIELDS).
HONOURED = frozenset(
    {
        "model",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "include_stop_str_in_output",
        "stream",
        "stream_options",
        "user",  # `user`: an end-user id for the caller's own records
        "n",
        # Logits processors and logprobs, applied position by position in verification, so
        # speculation leaves them exact (engine/logits_processors.py, engine/logprobs.py).
        "logprobs",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "logit_bias",
        "min_p",
        "min_tokens",
        "bad_words",
        "allowed_token_ids",
        "add_special_tokens",
        # No prefix cache is shared between requests here, so every salt is honoured.
        "cache_salt",
    }
)

_SAMPLING = "not supported by the embedded engine yet; " + VLLM_BACKEND
_NO_TOOLS = "the embedded engine has no tool-call parser; " + VLLM_BACKEND
_NO_MM = "the bundled models are text-only"
_OUTPUTS = "the embedded engine does not return it; " + VLLM_BACKEND

REFUSED: dict[str, Refused] = {
    # Sampling and logits processing.
    "prompt_logprobs": Refused((0,), 1, _SAMPLING),
    "logprob_token_ids": Refused(([],), [1], _SAMPLING),
    "length_penalty": Refused((1,), 0.5, "only beam search uses it; beam search is not offered"),
    "use_beam_search": Refused((False,), True, "beam search is not offered"),
    "echo": Refused((False,), True, "chat echo is not offered; completions echo the prompt"),
    "suffix": Refused(("",), "x", "the bundled models have no fill-in-the-middle template"),
    "skip_special_tokens": Refused((True,), False, _OUTPUTS),
    "spaces_between_special_tokens": Refused((True,), False, _OUTPUTS),
    "return_token_ids": Refused((False,), True, _OUTPUTS),
    "return_token_offsets": Refused((False,), True, _OUTPUTS),
    "return_prompt_text": Refused((False,), True, _OUTPUTS),
    "return_tokens_as_token_ids": Refused((False,), True, _OUTPUTS),
    "stream_interval": Refused((1,), 4, _OUTPUTS),
    "truncate_prompt_tokens": Refused((), 16, "prompts are never truncated: a 400 says so"),
    "truncation_side": Refused((), "left", "prompts are never truncated: a 400 says so"),
    "priority": Refused((0,), 1, "the embedded scheduler serves in arrival order"),
    # Structured output and tools.
    "response_format": Refused(({"type": "text"},), {"type": "json_object"}, _SAMPLING),
    "structured_outputs": Refused(({},), {"json": {"type": "object"}}, _SAMPLING),
    "tools": Refused(([],), [{"type": "function", "function": {"name": "f"}}], _NO_TOOLS),
    "tool_choice": Refused(("none",), "required", _NO_TOOLS),
    "parallel_tool_calls": Refused((True, False), None, _NO_TOOLS),  # moot without tools
    "reasoning_effort": Refused((), "high", "the bundled models do not reason"),
    "include_reasoning": Refused((True, False), None, "moot: no reasoning parser"),
    "thinking_token_budget": Refused((), 64, "the bundled models do not reason"),
    # Chat template controls.
    "chat_template": Refused((), "{{ messages }}", "custom chat templates are not accepted"),
    "documents": Refused(([],), [{"text": "x"}], "the bundled chat template takes no documents"),
    # Multimodal inputs.
    "mm_processor_kwargs": Refused(({},), {"x": 1}, _NO_MM),
    "media_io_kwargs": Refused(({},), {"x": 1}, _NO_MM),
    "mm_payload": Refused((), {"x": 1}, _NO_MM),
    "return_mm_kwargs": Refused((False,), True, _NO_MM),
    "prompt_embeds": Refused((), "AAAA", "prompts are text or token ids"),
    # vLLM-internal plumbing.
    "request_id": Refused((), "r-1", "send it as the X-Request-Id header"),
    "session_id": Refused((), "s-1", "vLLM-only routing plumbing"),
    "kv_transfer_params": Refused(({},), {"x": 1}, "no disaggregated prefill here"),
    "ec_transfer_params": Refused(({},), {"x": 1}, "no disaggregated prefill here"),
    "routed_experts_prompt_start": Refused((), 1, "the bundled models have no experts"),
    "repetition_detection": Refused((), {"x": 1}, _SAMPLING),
    "vllm_xargs": Refused(({},), {"x": 1}, "vLLM-only extension arguments"),
    "watermarking": Refused((), {"x": 1}, _SAMPLING),
    # OpenAI's own fields that vLLM does not model.
    "store": Refused((False,), True, "nothing is stored"),
    "metadata": Refused(({},), {"k": "v"}, "nothing is stored"),
    "service_tier": Refused(("auto", "default"), "flex", "one service tier"),
    "modalities": Refused((["text"],), ["audio"], _NO_MM),
    "audio": Refused((), {"voice": "x"}, _NO_MM),
    "prediction": Refused((), {"type": "content", "content": "x"}, _SAMPLING),
    "functions": Refused(([],), [{"name": "f"}], _NO_TOOLS),
    "function_call": Refused(("none",), "auto", _NO_TOOLS),
}

# Fields of one endpoint only: elsewhere they are unknown.
ENDPOINT_FIELDS: dict[str, frozenset[str]] = {
    "chat": frozenset(
        {
            "messages",
            "max_completion_tokens",
            "top_logprobs",
            "add_generation_prompt",
            "continue_final_message",
            "chat_template_kwargs",
        }
    ),
    "completion": frozenset({"prompt", "echo"}),
}
CHAT_ONLY = frozenset(
    {
        "chat_template",
        "documents",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "reasoning_effort",
        "include_reasoning",
        "functions",
        "function_call",
        "modalities",
        "audio",
        "prediction",
        "store",
        "metadata",
    }
)
COMPLETION_ONLY = frozenset({"suffix", "prompt_embeds"})


def asks_nothing(value: Any, off: tuple[Any, ...]) -> bool:
    # 0 == False and 1 == True in Python: compare with types, so `logprobs: 1` is refused.
    return (
        value is None
        or any(type(value) is type(o) and value == o for o in off)
        or (
            isinstance(value, int | float)
            and not isinstance(value, bool)
            and any(
                isinstance(o, int | float) and not isinstance(o, bool) and value == o for o in off
            )
        )
    )


def _known(name: str, endpoint: str) -> bool:
    if name in HONOURED or name in ENDPOINT_FIELDS[endpoint]:
        return True
    if name in (COMPLETION_ONLY if endpoint == "chat" else CHAT_ONLY):
        return False
    return name in REFUSED  # the other endpoint's own fields are unknown here


def check_fields(payload: dict[str, Any], endpoint: str) -> None:
    """400 for the first field the embedded worker cannot honour as asked."""
    for name, value in payload.items():
        if not _known(name, endpoint):
            raise InvalidRequest(
                # Not "not an OpenAI field": OpenAI fields that vLLM's requests lack and the
                # table does not name (best_of, verbosity, ...) land here too.
                f"{name}: this endpoint does not take this field (docs/api.md lists those it "
                "honours and those it refuses)",
                param=name,
            )
        if name in HONOURED or name in ENDPOINT_FIELDS[endpoint]:
            continue
        if name in REFUSED:
            rule = REFUSED[name]
            if not asks_nothing(value, rule.off):
                raise InvalidRequest(f"{name}: {rule.why}", param=name)


# What a vLLM worker does with a field beyond taking it, where that differs (vLLM 0.32's
# sampling_params.py refuses these two under any speculative decoding).
VLLM_NOTES = {
    "min_p": "passed through; vLLM answers 400 with speculative decoding",
    "logit_bias": "passed through; vLLM answers 400 with speculative decoding",
}


def compatibility_table() -> str:
    """The README's table (tests/test_readme.py keeps the two equal)."""
    rows = ["| field | embedded worker | vLLM backend |", "| --- | --- | --- |"]
    for name in sorted(HONOURED | ENDPOINT_FIELDS["chat"] | ENDPOINT_FIELDS["completion"]):
        where = next((e for e, f in ENDPOINT_FIELDS.items() if name in f), None)
        note = "honoured" if where is None else f"honoured ({where})"
        rows.append(f"| `{name}` | {note} | {VLLM_NOTES.get(name, 'passed through')} |")
    for name, rule in sorted(REFUSED.items()):
        off = ", ".join(f"`{json.dumps(v)}`" for v in rule.off)
        accepted = f" (accepted: {off})" if off else ""
        rows.append(f"| `{name}` | 400: {rule.why}{accepted} | passed through |")
    return "\n".join(rows) + "\n"
