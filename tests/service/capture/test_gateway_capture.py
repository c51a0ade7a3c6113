"""Capture through the real gateway and a real embedded worker: every endpoint, unary and
streamed, what the client got is what the dataset holds; tenants opt in; pools' shares; no
key or header is ever written."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
import zstandard

from service.settings import GatewaySettings, PoolSpec
from tests.fixtures.worker import WorkerHandle
from tests.service.conftest import MODEL, Gateway, running_gateway, wait_until
from wire.capture import read_samples

QUICK = {"capture_flush_s": 0.2}
MESSAGES = [{"role": "user", "content": "def add(a, b):"}]


def written(gw: Gateway) -> float:
    return gw.metric("dflash_capture_samples_total", outcome="written")


def test_every_endpoint_is_captured_as_the_client_saw_it(
    worker: WorkerHandle, tmp_path: Path
) -> None:
    data = tmp_path / "capture"
    with running_gateway(workers=[worker.base_url], capture_uri=str(data), **QUICK) as gw:
        client = openai.OpenAI(base_url=gw.v1, api_key="none")
        chat = client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=12,
            temperature=0,  # type: ignore[arg-type]
        )
        pieces = client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=12,
            temperature=0.8,
            seed=7,
            stream=True,
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in pieces if c.choices)
        completion = client.completions.create(
            model=MODEL, prompt="import os\n", max_tokens=8, temperature=0
        )
        events = client.responses.create(
            model=MODEL, input="def sub(a, b):", max_output_tokens=8, stream=True
        )
        answered = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        wait_until(lambda: written(gw) == 4)
        assert gw.metric("dflash_capture_shards_total") >= 1
        assert gw.metric("dflash_capture_writer_cpu_seconds_total") > 0
    samples = {
        s.endpoint + ("-stream" if s.sampling.get("seed") else ""): s
        for s in read_samples(str(data))
    }
    assert samples["chat"].completions[0].text == chat.choices[0].message.content
    assert samples["chat"].messages == MESSAGES and samples["chat"].sampling["temperature"] == 0
    assert samples["chat"].acceptance_length is not None  # the worker's speculation summary
    assert chat.usage is not None and samples["chat"].usage == {
        "prompt_tokens": chat.usage.prompt_tokens,
        "completion_tokens": chat.usage.completion_tokens,
    }
    assert samples["chat-stream"].completions[0].text == streamed
    # A stream's usage and acceptance, as the proxy read them from its last events.
    assert samples["chat-stream"].usage is not None
    assert samples["chat-stream"].acceptance_length is not None
    assert samples["chat-stream"].sampling == {"max_tokens": 12, "temperature": 0.8, "seed": 7}
    assert samples["completions"].prompt == "import os\n"
    assert samples["completions"].completions[0].text == completion.choices[0].text
    assert samples["responses"].messages == [{"role": "user", "content": "def sub(a, b):"}]
    assert samples["responses"].completions[0].text == answered
    assert all(s.model == MODEL and s.pool == "default" for s in samples.values())


def test_only_tenants_that_opted_in_are_captured_and_no_key_is_written(
    worker: WorkerHandle, tmp_path: Path
) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text(
        "tenants:\n"
        "  - {name: search, keys: [sk-search-secret], capture: true}\n"
        "  - {name: ops, keys: [sk-ops-secret]}\n"
        "  - {name: half, keys: [sk-half-secret], capture: 0.0}\n"
    )
    data = tmp_path / "capture"
    settings = {"capture_uri": str(data), "api_key_file": keys, **QUICK}
    with running_gateway(workers=[worker.base_url], **settings) as gw:
        for key in ("sk-search-secret", "sk-ops-secret", "sk-half-secret"):
            reply = httpx.post(
                gw.v1 + "/chat/completions",
                headers={"Authorization": f"Bearer {key}", "X-Secret-Header": "hush"},
                json={"model": MODEL, "messages": MESSAGES, "max_tokens": 4},
                timeout=60,
            )
            assert reply.status_code == 200
        wait_until(lambda: written(gw) == 1)
    samples = list(read_samples(str(data)))
    assert [s.tenant for s in samples] == ["search"]
    raw = b"".join(zstandard.decompress(p.read_bytes()) for p in data.iterdir())
    assert b"secret" not in raw and b"hush" not in raw and b"Bearer" not in raw


def test_a_pool_with_capture_zero_is_never_captured(worker: WorkerHandle, tmp_path: Path) -> None:
    data = tmp_path / "capture"
    pools = [PoolSpec(name="canary", model=MODEL, workers=[worker.base_url], capture=0)]
    with running_gateway(pools=pools, capture_uri=str(data), **QUICK) as gw:
        reply = httpx.post(
            gw.v1 + "/chat/completions",
            json={"model": MODEL, "messages": MESSAGES, "max_tokens": 4},
            timeout=60,
        )
        assert reply.status_code == 200
        assert written(gw) == 0
    assert list(read_samples(str(data))) == []


@pytest.mark.parametrize("value", [1.5, -0.1, "often"])
def test_a_capture_share_outside_zero_to_one_is_refused_naming_it(value: object) -> None:
    with pytest.raises(ValueError, match="capture"):
        GatewaySettings(pools=[{"name": "p", "workers": ["http://x:1"], "capture": value}])
