"""/v1/responses through the gateway, with the OpenAI SDK as client: two gateway processes
sharing a real redis-server in front of one real embedded worker. A response stored through
one gateway is continued, retrieved and deleted through the other; another tenant gets 404;
the tenant is charged the response's tokens."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import ResponseCompletedEvent, ResponseTextDeltaEvent

from service.responses import items_page
from tests.fixtures.redis import RedisServer, running_redis
from tests.fixtures.tiny_models import TinyCheckpoint
from tests.fixtures.worker import WorkerHandle, free_port
from tests.service.conftest import MODEL, scrape, wait_until, worker_args, worker_on_port
from tests.service.gateway_process import gateway_process
from wire.errors import InvalidRequest

KEYS = """
tenants:
  - name: search
    keys: [sk-search]
  - name: ops
    keys: [sk-ops]
"""


@pytest.fixture(scope="module")
def worker(tiny_checkpoint: TinyCheckpoint) -> Iterator[WorkerHandle]:
    with worker_on_port(free_port(), worker_args(tiny_checkpoint)) as handle:
        yield handle


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with running_redis(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture(scope="module")
def gateways(
    worker: WorkerHandle, redis: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str]]:
    keys = Path(tmp_path_factory.mktemp("keys")) / "keys.yaml"
    keys.write_text(KEYS)
    env = {"redis_url": redis.url, "api_key_file": str(keys)}
    with (
        gateway_process(worker.base_url, **env) as (a, _),
        gateway_process(worker.base_url, **env) as (b, _),
    ):
        yield a, b


def sdk(base: str, key: str = "sk-search") -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0)


def test_store_continue_retrieve_and_delete_across_two_gateways(
    gateways: tuple[str, str], redis: RedisServer
) -> None:
    a, b = sdk(gateways[0]), sdk(gateways[1])
    first = a.responses.create(model=MODEL, input="def fib(n):", max_output_tokens=6, temperature=0)
    assert first.store is True and first.output_text
    assert redis.command("EXISTS", f"{{dflash:search}}:response:{first.id}") == "1"
    second = b.responses.create(
        model=MODEL,
        input="and again",
        previous_response_id=first.id,
        max_output_tokens=6,
        temperature=0,
    )
    assert second.previous_response_id == first.id
    whole = a.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "def fib(n):"},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "and again"},
        ],
        max_output_tokens=6,
        temperature=0,
        store=False,
    )
    assert second.output_text == whole.output_text  # greedy: the same conversation
    assert whole.store is False
    with pytest.raises(openai.NotFoundError):
        b.responses.retrieve(whole.id)  # not stored
    got = b.responses.retrieve(second.id)
    assert got.output_text == second.output_text and got.id == second.id
    items = list(a.responses.input_items.list(second.id))
    assert [item.role for item in items] == ["user"]  # type: ignore[union-attr]
    # The SDK's query, honoured: pages of one item walk three, oldest first as asked,
    # the reverse of the default order (newest first).
    three = a.responses.create(
        model=MODEL,
        input=[{"role": "user", "content": text} for text in ("one", "two", "three")],
        max_output_tokens=2,
        temperature=0,
    )
    walked = [item.id for item in a.responses.input_items.list(three.id, limit=1, order="asc")]
    newest = [item.id for item in a.responses.input_items.list(three.id)]
    assert len(walked) == 3 and walked == newest[::-1]
    a.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        b.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        b.responses.create(model=MODEL, input="x", previous_response_id=first.id)


def test_streamed_responses_are_relayed_stored_and_charged(gateways: tuple[str, str]) -> None:
    a, b = sdk(gateways[0]), sdk(gateways[1])
    before = usage_tokens(gateways[0])
    steps = scrape(gateways[0], "dflash_spec_acceptance_length_count", model=MODEL)
    served = scrape(gateways[0], "dflash_requests_total", endpoint="/v1/responses", status="200")
    ttft = scrape(gateways[0], "dflash_time_to_first_token_seconds_count", model=MODEL)
    events = list(
        a.responses.create(
            model=MODEL, input="class Stack:", max_output_tokens=8, temperature=0, stream=True
        )
    )
    final = events[-1]
    assert final.type in ("response.completed", "response.incomplete")
    response = final.response  # type: ignore[union-attr]
    assert response.store is True
    text = "".join(e.delta for e in events if isinstance(e, ResponseTextDeltaEvent))
    assert text == response.output_text
    assert b.responses.retrieve(response.id).output_text == text
    assert response.usage is not None
    spent = response.usage.input_tokens + response.usage.output_tokens
    assert usage_tokens(gateways[0]) - before == spent
    assert not any(isinstance(e, ResponseCompletedEvent) for e in events[:-1])
    # The per-request acceptance the worker reported, the request and its first token.
    after = scrape(gateways[0], "dflash_spec_acceptance_length_count", model=MODEL)
    assert after == steps + 1
    count = scrape(gateways[0], "dflash_requests_total", endpoint="/v1/responses", status="200")
    assert count == served + 1
    assert scrape(gateways[0], "dflash_time_to_first_token_seconds_count", model=MODEL) == ttft + 1


def usage_tokens(base: str) -> int:
    card = httpx.get(base + "/admin/usage", headers={"Authorization": "Bearer sk-search"}).json()
    tokens: int = card["data"][0]["month"]["tokens"]
    return tokens


def test_another_tenant_gets_404(gateways: tuple[str, str]) -> None:
    mine = sdk(gateways[0]).responses.create(model=MODEL, input="x", max_output_tokens=2)
    theirs = sdk(gateways[1], "sk-ops")
    for call in (
        lambda: theirs.responses.retrieve(mine.id),
        lambda: theirs.responses.delete(mine.id),
        lambda: theirs.responses.input_items.list(mine.id),
        lambda: theirs.responses.create(model=MODEL, input="y", previous_response_id=mine.id),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert sdk(gateways[1]).responses.retrieve(mine.id).id == mine.id


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"frobnicate": 1}, "frobnicate"),
        ({"input": [{"role": "user", "content": "x", "name": "n"}]}, "input[0].name"),
        ({"input": []}, "input"),
        ({"tools": [{"type": "function", "name": "f"}]}, "tools"),  # the worker's 400
    ],
)
def test_bad_requests_are_400s_naming_the_field(
    gateways: tuple[str, str], extra: dict[str, Any], param: str
) -> None:
    body = {"model": MODEL, "input": "x", "max_output_tokens": 2, **extra}
    answer = httpx.post(
        gateways[0] + "/v1/responses", json=body, headers={"Authorization": "Bearer sk-search"}
    )
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param


def test_a_store_that_is_down_is_counted_and_the_answer_still_goes_out(
    gateways: tuple[str, str], redis: RedisServer
) -> None:
    """redis-server stopped mid-test (last in the module: the others need it): the write is
    skipped, the answer still goes out, and dflash_response_store_errors_total counts it; a
    read answers 503 and is counted too. With Redis back, responses are kept again."""
    base = gateways[0]

    def errors(operation: str) -> float:
        return scrape(base, "dflash_response_store_errors_total", operation=operation)

    writes, reads = errors("write"), errors("read")
    redis.kill()
    try:
        answer = sdk(base).responses.create(model=MODEL, input="x", max_output_tokens=2)
        assert answer.status in ("completed", "incomplete") and answer.store is True
        assert errors("write") == writes + 1
        with pytest.raises(openai.InternalServerError) as caught:
            sdk(base).responses.retrieve(answer.id)
        assert caught.value.status_code == 503 and caught.value.body["code"] == "store"  # type: ignore[index]
        assert errors("read") == reads + 1
    finally:
        redis.start()  # the same port, nothing kept (no persistence)

    def kept_again() -> bool:
        made = sdk(base).responses.create(model=MODEL, input="x", max_output_tokens=2)
        return redis.command("EXISTS", f"{{dflash:search}}:response:{made.id}") == "1"

    wait_until(kept_again, timeout=15, interval=0.5)


ITEMS = [{"id": f"msg_{i}", "type": "message"} for i in range(5)]


def _ids(page: dict[str, Any]) -> list[str]:
    return [item["id"] for item in page["data"]]


def test_input_items_page_by_openais_query() -> None:
    newest = items_page(ITEMS, {})  # OpenAI's defaults: newest first, 20 at most
    assert _ids(newest) == ["msg_4", "msg_3", "msg_2", "msg_1", "msg_0"]
    assert newest["has_more"] is False and newest["first_id"] == "msg_4"
    first = items_page(ITEMS, {"order": "asc", "limit": "2"})
    assert _ids(first) == ["msg_0", "msg_1"] and first["has_more"] is True
    second = items_page(ITEMS, {"order": "asc", "limit": "2", "after": first["last_id"]})
    assert _ids(second) == ["msg_2", "msg_3"] and second["has_more"] is True
    last = items_page(ITEMS, {"order": "asc", "limit": "2", "after": "msg_3"})
    assert _ids(last) == ["msg_4"] and last["has_more"] is False
    assert _ids(items_page(ITEMS, {"after": "msg_2"})) == ["msg_1", "msg_0"]
    assert items_page(ITEMS, {"include": ""})["data"] == newest["data"]


@pytest.mark.parametrize(
    ("query", "param"),
    [
        ({"limit": "0"}, "limit"),
        ({"limit": "101"}, "limit"),
        ({"limit": "abc"}, "limit"),
        ({"order": "sideways"}, "order"),
        ({"after": "msg_9"}, "after"),
        ({"include": "message.output_text.logprobs"}, "include"),
        ({"include[]": "message.output_text.logprobs"}, "include"),
        ({"before": "msg_1"}, "before"),
    ],
)
def test_a_bad_input_items_query_is_400_naming_it(query: dict[str, str], param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        items_page(ITEMS, query)
    assert info.value.param == param
