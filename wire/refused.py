"""What the embedded engine refuses of what vLLM takes, shared: the worker refuses it (a 400
naming the field) and the gateway's /openapi.json, when only embedded workers serve, declares
of each such field only the values that ask for nothing, so that the document offers nothing
the worker would refuse (service/openapi.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Refused:
    off: tuple[Any, ...]  # values that ask for nothing (None always does)
    example: Any  # a value that asks for something (for the tests)
    why: str


STATELESS = "this worker keeps no responses: the gateway stores them (send it through the gateway)"
NO_TOOLS = "the embedded engine has no tool-call parser; the vLLM backend supports it"
VLLM = "not supported by the embedded engine; the vLLM backend supports it"

# Every create-response field the embedded worker does not read, accepted only when it asks
# nothing. `store` and `previous_response_id` are the gateway's (it keeps the responses).
RESPONSES_REFUSED: dict[str, Refused] = {
    "store": Refused((False,), True, STATELESS),
    "previous_response_id": Refused((), "resp_1", STATELESS),
    "background": Refused((False,), True, "responses are answered while the client waits"),
    "context_management": Refused((), [{"type": "compaction"}], VLLM),
    "conversation": Refused((), "conv_1", "no conversations are kept; use the gateway's store"),
    "include": Refused(([],), ["message.output_text.logprobs"], VLLM),
    "max_tool_calls": Refused((), 1, NO_TOOLS),
    "moderation": Refused((), {"type": "x"}, "no moderation here"),
    "parallel_tool_calls": Refused((True, False), None, NO_TOOLS),  # moot without tools
    "prompt": Refused((), {"id": "pmpt_1"}, "no stored prompts here"),
    "prompt_cache_key": Refused((), "k", "no prompt cache is shared between requests here"),
    "prompt_cache_options": Refused((), {"mode": "explicit"}, "no prompt cache here"),
    "prompt_cache_retention": Refused((), "24h", "no prompt cache here"),
    "reasoning": Refused(({},), {"effort": "high"}, "the bundled models do not reason"),
    "safety_identifier": Refused((), "u-1", "no safety system here"),
    "service_tier": Refused(("auto", "default"), "flex", "one service tier here: auto or default"),
    # Obfuscation pads a stream's deltas: none is added here, so only `false` asks nothing.
    "stream_options": Refused(
        ({}, {"include_obfuscation": False}), {"include_obfuscation": True}, VLLM
    ),
    "tool_choice": Refused(("none", "auto"), "required", NO_TOOLS),
    "tools": Refused(([],), [{"type": "function", "name": "f"}], NO_TOOLS),
    "top_logprobs": Refused((0,), 2, VLLM),
    "truncation": Refused(("disabled",), "auto", "prompts are never truncated: a 400 says so"),
}
# `text.format` types the embedded worker honours; `text.verbosity` it refuses (one verbosity).
RESPONSES_TEXT_FORMATS = ("text",)

# Chat roles the bundled chat template takes (tool and function messages are refused).
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant"})
# Message keys the gateway passes to vLLM (wire/nested.py) that the embedded worker cannot
# honour: a 400 naming them unless null, never dropped. Content parts: text only.
MESSAGE_REFUSED = {
    "name": "the bundled chat template has no participant names; the vLLM backend passes it "
    "to the model's template",
    "tool_calls": NO_TOOLS,
    "tool_call_id": NO_TOOLS,
    "function_call": NO_TOOLS,
    "tools": NO_TOOLS,
    "reasoning": "the bundled models do not reason",
    "task": "the bundled models have no task markers",
    "refusal": "the bundled chat template has no refusals",
    "audio": "the bundled models are text-only",
}
