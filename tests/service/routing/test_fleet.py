"""Routing decisions of the pool, and membership by DNS re-resolution against a real worker."""

from __future__ import annotations

from collections import Counter

import httpx
import pytest

from service.metrics import GatewayMetrics
from service.routing.fleet import HashRing, Worker, WorkerFleet, parse_waiting, worker_id
from service.settings import GatewaySettings, PoolSpec
from tests.fixtures.worker import WorkerHandle
from tests.service.conftest import MODEL

URLS = [f"http://10.0.0.{i}:8000" for i in range(1, 5)]


def make_pool(routing: str = "least_outstanding") -> WorkerFleet:
    settings = GatewaySettings(workers=URLS, routing=routing)  # type: ignore[arg-type]
    pool = WorkerFleet(settings, httpx.AsyncClient(), GatewayMetrics())
    for worker in pool.workers.values():
        worker.healthy = True
    return pool


def test_least_outstanding_prefers_idle_then_fewest_waiting() -> None:
    pool = make_pool()
    for url, busy in zip(URLS, (2, 1, 1, 3), strict=True):
        pool.workers[url].outstanding = busy
    pool.workers[URLS[1]].waiting = 4
    pool.workers[URLS[2]].waiting = 0
    assert pool.pick("m", None, set()).url == URLS[2]  # type: ignore[union-attr]
    assert pool.pick("m", None, {URLS[2]}).url == URLS[1]  # type: ignore[union-attr]


def test_a_request_is_learnt_at_the_mean_load_it_ran_at(monkeypatch: pytest.MonkeyPatch) -> None:
    """ROUTING=fastest learns each request's speed at the load it ran at: the mean number in
    flight on its worker over its lifetime, not the count as it ended (issue 47)."""
    now = [10.0]
    monkeypatch.setattr("service.routing.fleet.time.monotonic", lambda: now[0])
    worker = Worker(URLS[0])
    first = worker.admit()  # alone for 1 s
    now[0] = 11.0
    second = worker.admit()  # two in flight for 1 s
    now[0] = 12.0
    assert worker.ran_at(second) == pytest.approx(2.0)
    worker.release()
    now[0] = 14.0  # alone again for 2 s: it ends alone, after running at 2 a quarter of its time
    assert worker.outstanding == 1
    assert worker.ran_at(first) == pytest.approx((1 + 2 + 2) / 4)
    worker.release()
    assert worker.outstanding == 0
    now[0] = 20.0  # idle time adds nothing; a request that ends as it starts ran alone
    third = worker.admit()
    assert worker.ran_at(third) == 1.0


def test_a_request_is_learnt_with_the_share_of_its_life_it_shared_with_another_class(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ROUTING=fastest reads what another class's rows cost a class from how much of each
    request's life its worker held a request of another class (issue 47)."""
    now = [10.0]
    monkeypatch.setattr("service.routing.fleet.time.monotonic", lambda: now[0])
    worker = Worker(URLS[0])
    greedy = worker.admit("greedy")  # alone for 1 s
    now[0] = 11.0
    other_greedy = worker.admit("greedy")  # the same class: not mixed
    now[0] = 12.0
    sampled = worker.admit("sampled")  # mixed for 2 s
    now[0] = 14.0
    assert worker.mixed_since(sampled, "sampled") == pytest.approx(1.0)
    worker.release("sampled")
    now[0] = 16.0  # greedy only again for 2 s
    assert worker.mixed_since(greedy, "greedy") == pytest.approx(2 / 6)
    assert worker.mixed_since(other_greedy, "greedy") == pytest.approx(2 / 5)
    worker.release("greedy")
    worker.release("greedy")
    now[0] = 20.0
    alone = worker.admit("sampled")  # a request that ends as it starts: not mixed
    assert worker.mixed_since(alone, "sampled") == 0.0


def test_fastest_sends_nothing_to_a_pool_at_weight_0() -> None:
    """An operator's pin to 0 (or a rolled-back canary) drains a pool under ROUTING=fastest
    too, however fast it reads, while another pool of the model has weight; with every pool
    at 0, all are offered again (the weighted split's fallback)."""
    pools = [
        PoolSpec(name=name, model="m", workers=[url])
        for name, url in zip(("fast", "slow"), URLS, strict=False)
    ]
    settings = GatewaySettings(pools=pools, routing="fastest", fastest_exploration=0.0)  # type: ignore[arg-type]
    fleet = WorkerFleet(settings, httpx.AsyncClient(), GatewayMetrics())
    for worker in fleet.workers.values():
        worker.healthy = True
    assert fleet.speeds is not None
    for _ in range(10):
        fleet.speeds.observe("fast", "k", 1.0, 200.0)
        fleet.speeds.observe("slow", "k", 1.0, 100.0)

    def pools_picked() -> set[str]:
        return {fleet.pick("m", None, set(), "k").pool for _ in range(20)}  # type: ignore[union-attr]

    assert pools_picked() == {"fast"}
    fleet.weights["fast"] = 0.0
    assert pools_picked() == {"slow"}
    fleet.weights["slow"] = 0.0
    assert pools_picked() == {"fast"}


def test_exact_ties_spread_over_the_pool() -> None:
    pool = make_pool()
    picks = Counter(pool.pick("m", None, set()).url for _ in range(40))  # type: ignore[union-attr]
    assert set(picks) == set(URLS)


def test_unhealthy_ejected_and_other_model_workers_are_skipped() -> None:
    pool = make_pool()
    pool.workers[URLS[0]].healthy = False
    pool.workers[URLS[1]].ejected_until = float("inf")
    pool.workers[URLS[2]].model_ids = frozenset({"other"})
    assert {pool.pick("m", None, set()).url for _ in range(8)} == {URLS[3]}  # type: ignore[union-attr]
    assert pool.pick("m", None, {URLS[3]}) is None


def test_passive_ejection_after_failures_of_distinct_requests() -> None:
    pool = make_pool()
    worker = pool.workers[URLS[0]]
    pool.report_failure(worker, "connect", 1)
    pool.report_success(worker)  # success resets the count
    pool.report_failure(worker, "connect", 2)
    pool.report_failure(worker, "connect", 3)
    assert worker.routable(0.0)
    pool.report_failure(worker, "connect", 4)  # third distinct request (eject_after_failures=3)
    assert not worker.healthy and worker.ejected_until > 0


def test_one_request_failing_again_and_again_counts_once() -> None:
    pool = make_pool()
    worker = pool.workers[URLS[0]]
    for _ in range(10):
        pool.report_failure(worker, "status_5xx", 7)
    assert worker.failures == 1 and worker.routable(0.0)


def test_overload_and_4xx_never_count() -> None:
    pool = make_pool()
    worker = pool.workers[URLS[1]]
    for request in range(10):
        pool.report_failure(worker, "overloaded", request, counts=False)
    assert worker.failures == 0 and worker.healthy
    assert pool._metrics.upstream_errors.labels(worker.label, "overloaded")._value.get() == 10


def test_the_last_routable_worker_is_never_ejected() -> None:
    pool = make_pool()
    *others, last = pool.workers.values()
    for worker in others:
        worker.healthy = False
    for request in range(20):
        pool.report_failure(last, "status_5xx", request)
    assert last.routable(0.0) and pool.pick("m", None, set()) is last
    others[0].healthy = True  # once another worker is back, the failing one can go
    pool.report_failure(last, "status_5xx", 99)
    assert not last.healthy


def test_metrics_name_workers_by_an_opaque_stable_id() -> None:
    pool = make_pool()
    for worker in pool.workers.values():
        pool._publish(worker)
    text = pool._metrics.render()[0].decode()
    assert "10.0.0." not in text
    label = worker_id(URLS[0])
    assert f'dflash_worker_healthy{{pool="default",worker="{label}"}} 1.0' in text
    assert label == make_pool().workers[URLS[0]].label  # the same on every replica
    settings = GatewaySettings(workers=URLS, metrics_worker_label="url")
    assert (
        WorkerFleet(settings, httpx.AsyncClient(), GatewayMetrics()).workers[URLS[0]].label
        == (URLS[0])
    )


def test_prefix_affinity_is_sticky_and_bounded() -> None:
    pool = make_pool("prefix_affinity")
    first = pool.pick("m", "def fib(n):", set())
    assert first is not None
    assert all(pool.pick("m", "def fib(n):", set()) is first for _ in range(5))
    first.outstanding = 10  # far above ceil(1.25 * 11 / 4): the key moves on
    moved = pool.pick("m", "def fib(n):", set())
    assert moved is not None and moved is not first
    first.outstanding = 0
    keys = Counter(pool.pick("m", f"prompt {i}", set()).url for i in range(200))  # type: ignore[union-attr]
    assert len(keys) == 4


def test_ring_changes_little_when_a_worker_leaves() -> None:
    before = HashRing(URLS, 64)
    after = HashRing(URLS[:-1], 64)
    keys = [f"k{i}" for i in range(400)]
    moved = sum(before.walk(k)[0] != after.walk(k)[0] for k in keys)
    owned_by_gone = sum(before.walk(k)[0] == URLS[-1] for k in keys)
    assert moved == owned_by_gone


def test_parse_waiting_sums_labelled_samples() -> None:
    text = (
        "# HELP vllm:num_requests_waiting x\n"
        'vllm:num_requests_waiting{model_name="a"} 2.0\n'
        'vllm:num_requests_waiting{model_name="b"} 3 1700000000\n'
        "vllm:num_requests_waiting_other 9\n"
    )
    assert parse_waiting(text) == 5.0


@pytest.mark.anyio
async def test_dns_discovery_finds_the_worker(worker: WorkerHandle) -> None:
    settings = GatewaySettings(worker_dns=f"localhost:{worker.port}")
    async with httpx.AsyncClient() as client:
        pool = WorkerFleet(settings, client, GatewayMetrics())
        await pool.resolve_dns()
        await pool.check_all()
        healthy = [w.url for w in pool.routable()]
        assert f"http://127.0.0.1:{worker.port}" in healthy
        assert pool.models()[0]["id"] == MODEL
        assert isinstance(pool.workers[healthy[0]], Worker)


def test_models_are_the_union_over_routable_workers() -> None:
    pool = make_pool()
    for url, names in zip(URLS, (["a"], ["a", "b"], ["c"], ["d"]), strict=True):
        pool.workers[url].models = [{"id": n, "object": "model"} for n in names]
        pool.workers[url].model_ids = frozenset(names)
    pool.workers[URLS[3]].healthy = False
    assert [m["id"] for m in pool.models()] == ["a", "b", "c"]
    assert pool.lists_model("b") and not pool.lists_model("d")
    assert not pool.knows_model("d")


def pools_of(*specs: dict[str, object], routing: str = "least_outstanding") -> WorkerFleet:
    settings = GatewaySettings(pools=list(specs), routing=routing)  # type: ignore[arg-type]
    pool = WorkerFleet(settings, httpx.AsyncClient(), GatewayMetrics())
    for worker in pool.workers.values():
        worker.healthy = True
    return pool


CANARY = (
    {"name": "main", "model": "m", "weight": 90, "workers": URLS[:2]},
    {"name": "canary", "model": "m", "weight": 10, "workers": URLS[2:3]},
    {"name": "other", "model": "o", "workers": URLS[3:]},
)


def test_requests_go_to_the_pools_of_their_model_split_by_weight() -> None:
    pool = pools_of(*CANARY)
    picks = Counter(pool.pick("m", None, set()).pool for _ in range(1000))  # type: ignore[union-attr]
    assert picks == {"main": 900, "canary": 100}
    assert {pool.pick("o", None, set()).url for _ in range(10)} == {URLS[3]}  # type: ignore[union-attr]
    assert pool.pick("nope", None, set()) is None
    assert pool.configures("o") and not pool.configures("nope")
    assert pool.model_names() == ["m", "o"]  # configured, though no worker listed a model yet


def test_a_pool_without_a_healthy_worker_gives_its_share_away() -> None:
    pool = pools_of(*CANARY)
    pool.workers[URLS[2]].healthy = False
    pool.invalidate()
    assert {pool.pick("m", None, set()).pool for _ in range(50)} == {"main"}  # type: ignore[union-attr]
    # A retry that excluded the main pool's workers lands on the canary once it is back.
    pool.workers[URLS[2]].healthy = True
    pool.invalidate()
    retry = pool.pick("m", None, set(URLS[:2]))
    assert retry is not None and retry.pool == "canary"


def test_prefix_affinity_keeps_a_conversation_on_one_pool() -> None:
    pool = pools_of(*CANARY, routing="prefix_affinity")
    keys = [f"user {i}: hello" for i in range(600)]
    chosen = {key: pool.pick("m", key, set()).pool for key in keys}  # type: ignore[union-attr]
    assert chosen == {key: pool.pick("m", key, set()).pool for key in keys}  # type: ignore[union-attr]
    assert Counter(chosen.values())["canary"] / len(keys) == pytest.approx(0.10, abs=0.04)


def test_the_last_worker_of_a_model_is_not_ejected_for_another_models_sake() -> None:
    pool = pools_of(*CANARY)
    only = pool.workers[URLS[3]]  # model "o" has one worker; model "m" has three
    for request in range(10):
        pool.report_failure(only, "status_5xx", request)
    assert only.healthy
    canary = pool.workers[URLS[2]]  # the main pool stands in for the canary
    for request in range(10):
        pool.report_failure(canary, "status_5xx", request)
    assert not canary.healthy


def test_worker_health_series_carry_the_pool() -> None:
    pool = pools_of(*CANARY)
    for worker in pool.workers.values():
        pool._publish(worker)
    text = pool._metrics.render()[0].decode()
    assert f'dflash_worker_healthy{{pool="canary",worker="{worker_id(URLS[2])}"}} 1.0' in text
