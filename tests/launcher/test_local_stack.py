"""`dflash-serve --compare`: a DFlash pool and a plain pool side by side, each behind its own
gateway, and Ctrl-C stops all of it."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from tests.fixtures.keys import keys_of
from tests.fixtures.serve import announced, base_url, dflash_serve, interrupt
from tests.fixtures.worker import ROOT, free_port, metric, scrape
from tests.service.conftest import MODEL

URLS = {"dflash": ["http://127.0.0.1:1"]}


def one_pool() -> Any:
    from launcher.local_stack import LocalGateway, LocalPool

    return LocalGateway(8000, (LocalPool(name="dflash"),))


def test_compare_serves_dflash_and_plain_side_by_side(tiny_checkpoint: Any) -> None:
    port = free_port()
    spec = {"method": "dflash", "model": str(tiny_checkpoint.drafter_dir)}
    argv = [
        sys.executable,
        "-m",
        "launcher.local_stack",
        "--port",
        str(port),
        "--compare",
        "--compare-port",
        str(free_port()),
        "--log-level",
        "warning",
        f"--worker-arg={tiny_checkpoint.target_dir}",
        f"--worker-arg=--speculative-config={json.dumps(spec)}",
        f"--worker-arg=--served-model-name={MODEL}",
    ]
    with dflash_serve(argv, {**os.environ, "OMP_NUM_THREADS": "1"}) as proc:
        lines = announced(proc, 2)
        assert "dflash (DFlash speculative" in lines[0] and "plain (plain" in lines[1]
        metrics = []
        for url in map(base_url, lines):
            sdk = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
            reply = sdk.completions.create(model=MODEL, prompt="def f():", max_tokens=4)
            metrics.append((reply.model_extra or {})["metrics"])
        assert metrics[0]["speculative_decoding"]["num_spec_steps"] >= 1
        assert "speculative_decoding" not in metrics[1]
        assert interrupt(proc) == 0


def test_the_gateway_reuses_worker_connections_for_less_than_the_workers_keep_them(
    monkeypatch: Any,
) -> None:
    from launcher.local_stack import gateway_settings, worker_env

    monkeypatch.delenv("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", raising=False)
    monkeypatch.delenv("DFLASH_GATEWAY_UPSTREAM_KEEPALIVE_S", raising=False)
    pool = one_pool()
    env = worker_env()
    assert env["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"] == "61"
    assert gateway_settings(pool, URLS, "info", env).upstream_keepalive_s == 60
    monkeypatch.setenv("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "5")  # the user's value wins
    assert gateway_settings(pool, URLS, "info", worker_env()).upstream_keepalive_s == 4
    monkeypatch.setenv("DFLASH_GATEWAY_UPSTREAM_KEEPALIVE_S", "2")
    assert gateway_settings(pool, URLS, "info", worker_env()).upstream_keepalive_s == 2


def test_dflash_serve_leaves_a_lone_worker_its_own_thread_default(monkeypatch: Any) -> None:
    from launcher.local_stack import LocalPool, shared_threads, worker_env

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert "OMP_NUM_THREADS" not in worker_env()  # no override of the worker's measured default
    one = LocalPool(name="dflash")
    assert shared_threads(one, 1, 2) == []
    # Several workers share the CPUs: each its share less one for its HTTP side.
    assert shared_threads(one, 2, 8) == ["--threads", "3"]
    assert shared_threads(one, 2, 2) == ["--threads", "1"]
    chosen = LocalPool(name="dflash", workers=2, worker_args=("--threads=2",))
    assert shared_threads(chosen, 2, 8) == []  # the user's choice wins
    vllm = LocalPool(name="d", workers=2, engine="vllm")
    assert shared_threads(vllm, 2, 8) == []  # embedded only
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert shared_threads(one, 2, 8) == []


def test_dflash_serve_api_key_protects_the_gateway() -> None:
    from launcher.local_stack import build_parser, gateway_settings

    args = build_parser().parse_args(["--api-key", "k1", "--api-key", "k2"])
    pool = one_pool()
    settings = gateway_settings(pool, URLS, "info", {}, args.api_key)
    assert keys_of(settings.load_key_ring(), ["k1", "k2", "k3"]) == ["k1", "k2"]
    assert not gateway_settings(pool, URLS, "info", {}, []).load_key_ring().by_digest


def test_the_gateway_knows_each_pools_engine() -> None:
    """Its /openapi.json offers of the Responses fields only what embedded workers honour."""
    from launcher.local_stack import LocalGateway, LocalPool, gateway_settings

    pools = (LocalPool(name="dflash", model="a"), LocalPool(name="d", model="b", engine="vllm"))
    urls = {"dflash": ["http://127.0.0.1:9001"], "d": ["http://127.0.0.1:9002"]}
    settings = gateway_settings(LocalGateway(8000, pools), urls, "info", {})
    assert [p.engine for p in settings.pool_specs()] == ["embedded", "vllm"]


BUNDLED_DRAFTER = ROOT / "engine" / "assets" / "tiny-coder" / "dflash"
PROMPTS = [
    "def fibonacci(n):",
    "def is_prime(n):",
    "class Stack:\n    def __init__(self):",
    "def reverse_words(text):",
]


def canary_pools(tmp_path: Path) -> Path:
    """The bundled pair drafting 15 tokens per step (weight 75) and a canary drafting 1
    (weight 25) for one model, and the same target under a second model name."""
    one = {"method": "dflash", "model": str(BUNDLED_DRAFTER), "num_speculative_tokens": 1}
    pools = [
        {"name": "b16", "model": "tiny-coder", "weight": 75},
        {
            "name": "k1",
            "model": "tiny-coder",
            "weight": 25,
            "worker_args": [f"--speculative-config={json.dumps(one)}"],
        },
        {"name": "second", "model": "tiny-coder-2", "speculation": False},
    ]
    path = tmp_path / "pools.yaml"
    path.write_text(yaml.safe_dump({"pools": pools}))
    return path


def listening_pid(port: int) -> int:
    """The dflash-worker process started with --port PORT."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                argv = (entry / "cmdline").read_bytes().split(b"\0")
                if b"engine.worker.cli" in argv and str(port).encode() in argv:
                    return int(entry.name)
    raise AssertionError(f"no worker on port {port}")


def test_pools_split_a_model_by_weight_losslessly_and_survive_a_dead_pool(
    tmp_path: Path,
) -> None:
    port, first_worker = free_port(), free_port()
    argv = [sys.executable, "-m", "launcher.local_stack", "--pools", str(canary_pools(tmp_path))]
    argv += ["--port", str(port), "--worker-port", str(first_worker), "--log-level", "warning"]
    argv += ["--worker-arg=--speculation=fixed"]  # acceptance as configured, for the comparison
    with dflash_serve(argv) as proc:
        lines = announced(proc, 3)
        assert (
            "b16 (DFlash speculative decoding, 1 embedded worker(s), model tiny-coder, "
            "weight 75)" in lines[0]
        )
        base = f"http://127.0.0.1:{port}"
        client = httpx.Client(base_url=base, timeout=60)

        # Two models behind one gateway, each listed once; an unknown one is a 404 naming it.
        listed = [card["id"] for card in client.get("/v1/models").json()["data"]]
        assert sorted(listed) == ["tiny-coder", "tiny-coder-2"]
        other = client.post(
            "/v1/completions", json={"model": "tiny-coder-2", "prompt": "x", "max_tokens": 1}
        )
        assert other.status_code == 200 and other.headers["x-dflash-pool"] == "second"
        missing = client.post("/v1/completions", json={"model": "nope", "prompt": "x"})
        assert missing.status_code == 404 and "`nope`" in missing.json()["error"]["message"]

        # The split: 300 requests, each pool within a few percent of its weight.
        pools = Counter()
        for i in range(300):
            body = {"model": "tiny-coder", "prompt": PROMPTS[i % 4], "max_tokens": 1}
            reply = client.post("/v1/completions", json=body)
            assert reply.status_code == 200
            pools[reply.headers["x-dflash-pool"]] += 1
        assert abs(pools["b16"] / 300 - 0.75) < 0.03 and pools["b16"] + pools["k1"] == 300

        # Lossless: greedy answers are the same tokens on both pools; acceptance differs.
        answers: dict[str, dict[str, str]] = {"b16": {}, "k1": {}}
        for prompt in [p for p in PROMPTS for _ in range(4)]:  # 4 in a row: both pools
            body = {"model": "tiny-coder", "prompt": prompt, "max_tokens": 48, "temperature": 0}
            reply = client.post("/v1/completions", json=body)
            answers[reply.headers["x-dflash-pool"]][prompt] = reply.json()["choices"][0]["text"]
        both = answers["b16"].keys() & answers["k1"].keys()
        assert len(both) == 4 and all(answers["b16"][p] == answers["k1"][p] for p in both)
        samples = scrape(base)
        length = {
            pool: 1
            + metric(samples, "dflash_spec_accepted_tokens_total", pool=pool)
            / metric(samples, "dflash_spec_steps_total", pool=pool)
            for pool in ("b16", "k1")
        }
        assert length["k1"] <= 2.0 < length["b16"], length  # k=1 accepts at most 1 per step
        assert metric(samples, "dflash_spec_acceptance_length_count", pool="k1") > 0

        # The canary's worker dies: its share moves to b16 with no client error.
        os.kill(listening_pid(first_worker + 1), signal.SIGKILL)
        served = Counter()
        for i in range(40):
            body = {"model": "tiny-coder", "prompt": PROMPTS[i % 4], "max_tokens": 1}
            reply = client.post("/v1/completions", json=body)
            assert reply.status_code == 200, reply.text
            served[reply.headers["x-dflash-pool"]] += 1
        assert served == {"b16": 40}
        assert interrupt(proc) == 0


def test_the_example_pools_file_loads_and_bad_files_are_refused(tmp_path: Path) -> None:
    from launcher.local_stack import load_pools, main

    b16, k3 = load_pools(ROOT / "examples" / "canary-pools.yaml")
    assert (b16.weight, k3.weight, b16.model, k3.model) == (90, 10, "tiny-coder", "tiny-coder")
    bad = tmp_path / "bad.yaml"
    for text, named in (
        ("pools: [{name: a, engine: trtllm}]", "pools.0.engine"),
        ("pools: [{name: a, model: m}, {name: a, model: m}]", "duplicate pool names: a"),
        ("pools: [{name: a, model: m, weight: 0}]", "every pool of model m has weight 0"),
        ("pools: [{name: a, colour: red}]", "pools.0.colour"),
    ):
        bad.write_text(text)
        with pytest.raises(ValueError, match=re.escape(named)):
            load_pools(bad)
    bad.write_text("pools: [{name: a}]")
    assert main(["--pools", str(bad), "--workers", "2"]) == 2  # set per pool, not ignored
    # A capture folder that cannot be made: refused before any worker starts.
    assert main(["--capture", str(bad / "capture")]) == 2


def test_the_tracing_page_s_dflash_serve_command_gives_one_trace(tiny_checkpoint: Any) -> None:
    """docs/tracing.md's two lines, as written (the collector and the port are this test's):
    the gateway's and the worker's spans in the curl's trace, parent-linked, with the GenAI
    attributes and the acceptance."""
    from tests.fixtures.otlp import OtlpGrpcReceiver

    (block,) = [b for b in code_blocks_of(ROOT / "docs/tracing.md") if "dflash-serve" in b]
    serve_line, curl_line = block.strip().splitlines()
    assignment, command = serve_line.split(" ", 1)
    name, _, endpoint = assignment.partition("=")
    assert command == "dflash-serve" and endpoint == "http://127.0.0.1:4317"
    trace_id = re.search(r"traceparent: 00-([0-9a-f]{32})-([0-9a-f]{16})-01", curl_line)
    assert trace_id is not None
    body = json.loads(re.search(r"-d '(\{.*\})'", curl_line).group(1))  # type: ignore[union-attr]
    port = free_port()
    spec = {"method": "dflash", "model": str(tiny_checkpoint.drafter_dir)}
    with OtlpGrpcReceiver() as receiver:
        env = {**os.environ, "OMP_NUM_THREADS": "1", name: receiver.endpoint}
        argv = [str(Path(sys.executable).parent / command), "--port", str(port)]
        argv += ["--log-level", "warning", f"--worker-arg={tiny_checkpoint.target_dir}"]
        argv += [f"--worker-arg=--speculative-config={json.dumps(spec)}"]
        argv += [f"--worker-arg=--served-model-name={body['model']}"]
        argv += ["--worker-arg=--speculation=fixed"]  # acceptance every step, on a busy machine
        with dflash_serve(argv, env) as proc:
            announced(proc)
            reply = httpx.post(
                f"http://127.0.0.1:{port}/v1/chat/completions",
                headers={"traceparent": trace_id.group(0).split(": ")[1]},
                json=body,
                timeout=60,
            )
            assert reply.status_code == 200, reply.text
            tid, client_span = trace_id.group(1), trace_id.group(2)
            spans = receiver.received.wait(
                lambda got: (
                    {"decode", "POST /v1/chat/completions"}
                    <= {s.name for s in got if s.trace_id == tid and s.service == "dflash-worker"}
                    and any(
                        s.trace_id == tid and s.kind == 2
                        for s in got
                        if s.service != "dflash-worker"
                    )
                )
            )
    mine = {(s.service, s.name): s for s in spans if s.trace_id == tid}
    server = mine["dflash-gateway", "POST /v1/chat/completions"]
    attempt = mine["dflash-gateway", "attempt 1"]
    worker = mine["dflash-worker", "POST /v1/chat/completions"]
    decode = mine["dflash-worker", "decode"]
    assert server.parent_id == client_span and attempt.parent_id == server.span_id
    assert worker.parent_id == attempt.span_id and decode.parent_id == worker.span_id
    assert server.attributes["gen_ai.request.model"] == body["model"]
    assert (
        server.attributes["gen_ai.usage.output_tokens"]
        == reply.json()["usage"]["completion_tokens"]
    )
    assert server.attributes["dflash.spec.mean_acceptance_length"] >= 1.0
    assert decode.attributes["dflash.spec.steps"] == server.attributes["dflash.spec.steps"]


def code_blocks_of(doc: Path) -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```", doc.read_text(), flags=re.M | re.S)


def test_drafter_names_a_bundled_drafter_for_every_worker() -> None:
    from launcher.local_stack import ASSETS, build_parser, plan

    (gateway,) = plan(build_parser().parse_args(["--drafter", "dflash2"]))
    (pool,) = gateway.pools
    (arg,) = [a for a in pool.worker_args if a.startswith("--speculative-config=")]
    config = json.loads(arg.removeprefix("--speculative-config="))
    assert config == {"method": "dflash2", "model": str(ASSETS / "dflash2")}
    dflash, plain = plan(build_parser().parse_args(["--drafter", "dflash", "--compare"]))
    assert any('tiny-coder/dflash"' in a for a in dflash.pools[0].worker_args)
    assert plain.pools[0].speculation is False  # the plain pool drops the drafter at start
    with pytest.raises(ValueError, match="--drafter"):
        plan(build_parser().parse_args(["--drafter", "dflash2", "--pools", "x.yaml"]))


def test_a_local_pools_capture_and_promotion_reach_the_gateway() -> None:
    from launcher.local_stack import LocalGateway, LocalPool, gateway_settings

    pools = (
        LocalPool(name="base", model="m"),
        LocalPool(name="canary", model="m", capture=0.5, promotion={"baseline": "base"}),
    )
    urls = {"base": ["http://127.0.0.1:9001"], "canary": ["http://127.0.0.1:9002"]}
    base, canary = gateway_settings(LocalGateway(8000, pools), urls, "info", {}).pool_specs()
    assert canary.promotion is not None and canary.promotion.baseline == "base"
    assert canary.capture == 0.5 and base.capture == 1.0
    assert "weight" not in canary.model_fields_set  # left to the promotion


def test_dflash_serve_drafter_dflash2_serves_the_bundled_dflash2_drafter() -> None:
    """`make serve SERVE_ARGS='--drafter dflash2'` (docs/worker.md): the bundled target with
    the bundled DFlash2 drafter behind the gateway, greedy text as plain decoding's."""
    from launcher.local_stack import ASSETS

    if not (ASSETS / "dflash2" / "model.safetensors").exists():
        pytest.fail("the bundled DFlash2 drafter is missing (engine/assets/tiny-coder/dflash2)")
    port, plain_port = free_port(), free_port()
    argv = [sys.executable, "-m", "launcher.local_stack", "--port", str(port), "--compare"]
    argv += ["--compare-port", str(plain_port), "--drafter", "dflash2", "--log-level", "warning"]
    with dflash_serve(argv, {**os.environ, "OMP_NUM_THREADS": "1"}) as proc:
        lines = announced(proc, 2)
        answers, metrics = [], []
        for url in map(base_url, lines):
            sdk = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
            model = sdk.models.list().data[0].id
            reply = sdk.completions.create(
                model=model, prompt="def fibonacci(n):", max_tokens=24, temperature=0
            )
            answers.append(reply.choices[0].text)
            metrics.append((reply.model_extra or {})["metrics"])
        assert answers[0] == answers[1]  # lossless: DFlash2 drafts, the target decides
        assert metrics[0]["speculative_decoding"]["num_spec_steps"] >= 1
        assert interrupt(proc) == 0
