"""Bad input is a 4xx with an OpenAI error body at the gateway AND at the worker, and nothing
one request sends can take a worker out: a corpus of hostile bodies and headers, sent to both.

The corpus reproduces issue 17's denial of service (a lone surrogate in a prompt or a model
name, JSON nested ~1000 deep made the worker answer 500, which the gateway counted toward
ejection) and the header rules the two sides read differently."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.fixtures.worker import WorkerHandle, running_worker
from tests.service.conftest import MODEL, Gateway, running_gateway, worker_args
from tests.service.fake_upstream import MODEL as FAKE
from tests.service.fake_upstream import FakeWorker, fake_worker

KEY = "sk-test-key"

# Raw bodies (bytes, so that what no JSON library writes can be sent): `%s` is the model.
CORPUS: list[str] = [
    '{"model":"%s","prompt":"\\udfff"}',
    '{"model":"%s","prompt":"a\\ud800b","max_tokens":2}',
    '{"model":"%s","messages":[{"role":"user","content":"\\udc00"}]}',
    '{"model":"\\udfff%s","prompt":"x"}',
    '{"model":"%s","prompt":"x","stop":["\\ud83d"]}',
    '{"model":"%s","prompt":' + "[" * 1000 + "]" * 1000 + "}",
    '{"model":"%s","prompt":"x","logit_bias":' + '{"a":' * 900 + "1" + "}" * 900 + "}",
    '{"model":"%s","prompt":"x","max_tokens":1e999}',
    '{"model":"%s","prompt":"x","max_tokens":' + "9" * 5000 + "}",
    '{"model":"%s","prompt":"x","seed":123456789012345678901234567890}',
    '{"model":"%s","prompt":"x","max_tokens":' + "9" * 40 + "}",
    '{"model":"%s","prompt":"x","max_tokens":' + "9" * 70 + "}",
    '{"model":"%s","prompt":[' + "9" * 40 + "]}",
    '{"model":"%s","prompt":[[1,' + "9" * 40 + "]]}",
    '{"model":"%s","prompt":[-1]}',
    '{"model":"%s","prompt":"x","temperature":-1e400}',
    '{"model":"%s","prompt":"x","max_tokens":NaN}',
    '{"model":"%s","prompt":"x","stream":"true"}',
    '{"model":"%s","prompt":"x","stream":true,"stream_options":{"include_usage":"yes"}}',
    '{"model":"%s","prompt":[]}',
    '{"model":"%s","prompt":"x","max_tokens":-1}',
    '{"model":"%s","prompt":"x","n":"2"}',
    '["not an object"]',
    '{"model":"%s","prompt":"x"',
]


def bodies(model: str) -> list[bytes]:
    return [(text % model if "%s" in text else text).encode() for text in CORPUS]


def assert_openai_4xx(reply: httpx.Response) -> None:
    assert 400 <= reply.status_code < 500, (reply.status_code, reply.text[:300])
    error = reply.json()["error"]
    assert isinstance(error["message"], str) and error["type"]


@pytest.fixture(scope="module")
def keyed_worker(tiny_checkpoint: Any) -> Iterator[WorkerHandle]:
    with running_worker(*worker_args(tiny_checkpoint), "--api-key", KEY) as handle:
        yield handle


@pytest.fixture
def gateway_over_fake() -> Iterator[tuple[Gateway, FakeWorker]]:
    with contextlib.ExitStack() as stack:
        fake = stack.enter_context(fake_worker())
        gw = stack.enter_context(
            running_gateway(workers=[fake.url], api_keys=[KEY], eject_after_failures=1)
        )
        yield gw, fake


def post(base: str, path: str, raw: bytes, *headers: tuple[str, str]) -> httpx.Response:
    sent = [(name.encode(), value.encode("latin-1")) for name, value in headers]
    sent.append((b"content-type", b"application/json"))
    return httpx.post(base + path, content=raw, headers=sent, timeout=60)


AUTH = ("authorization", f"Bearer {KEY}")


def test_the_gateway_refuses_the_corpus_before_any_worker_sees_it(
    gateway_over_fake: tuple[Gateway, FakeWorker],
) -> None:
    gw, fake = gateway_over_fake
    for raw in bodies(FAKE):
        assert_openai_4xx(post(gw.base_url, "/v1/completions", raw, AUTH))
    assert fake.posts == 0
    assert gw.metric("dflash_worker_healthy") == 1


def test_the_worker_answers_the_corpus_with_4xx_and_stays_healthy(
    keyed_worker: WorkerHandle,
) -> None:
    for raw in bodies(MODEL):
        for path in ("/v1/completions", "/v1/chat/completions"):
            assert_openai_4xx(post(keyed_worker.base_url, path, raw, AUTH))
    assert httpx.get(keyed_worker.base_url + "/health", timeout=5).status_code == 200
    ok = post(
        keyed_worker.base_url,
        "/v1/completions",
        b'{"model":"%s","prompt":"hi","max_tokens":2}' % MODEL.encode(),
        AUTH,
    )
    assert ok.status_code == 200


def test_a_worker_behind_the_gateway_is_never_ejected_by_the_corpus(
    keyed_worker: WorkerHandle,
) -> None:
    with running_gateway(
        workers=[keyed_worker.base_url], worker_api_key=KEY, eject_after_failures=1
    ) as gw:
        for raw in bodies(MODEL):
            assert_openai_4xx(post(gw.base_url, "/v1/completions", raw))
        assert gw.metric("dflash_worker_healthy") == 1
        assert gw.metric("dflash_upstream_errors_total") == 0


@pytest.mark.parametrize(
    "headers",
    [
        [],
        [("authorization", KEY)],  # no Bearer scheme
        [("authorization", f"Basic {KEY}")],
        [AUTH, ("authorization", "Bearer wrong")],  # two headers: read differently by servers
        [("authorization", "Bearer wrong"), AUTH],
        [AUTH, AUTH],
    ],
)
def test_one_authorization_rule_on_both_sides(
    headers: list[tuple[str, str]],
    keyed_worker: WorkerHandle,
    gateway_over_fake: tuple[Gateway, FakeWorker],
) -> None:
    gw, _ = gateway_over_fake
    for base, model in ((gw.base_url, FAKE), (keyed_worker.base_url, MODEL)):
        raw = b'{"model":"%s","prompt":"x","max_tokens":1}' % model.encode()
        reply = post(base, "/v1/completions", raw, *headers)
        assert reply.status_code == 401, (base, reply.text)
        assert reply.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize(
    ("given", "echoed"),
    [("abc-123", True), ("x" * 129, False), ("a b", False), ("é", False), ("x" * 10_000, False)],
)
def test_one_request_id_rule_on_both_sides(
    given: str,
    echoed: bool,
    keyed_worker: WorkerHandle,
    gateway_over_fake: tuple[Gateway, FakeWorker],
) -> None:
    gw, _ = gateway_over_fake
    for base, model in ((gw.base_url, FAKE), (keyed_worker.base_url, MODEL)):
        raw = b'{"model":"%s","prompt":"x","max_tokens":1}' % model.encode()
        value = given.encode("utf-8").decode("latin-1")
        reply = post(base, "/v1/completions", raw, AUTH, ("x-request-id", value))
        assert reply.status_code == 200, reply.text
        assert (reply.headers["x-request-id"] == given) is echoed
        assert len(reply.headers["x-request-id"]) <= 128
