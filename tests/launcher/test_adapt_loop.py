"""The loop on the bundled model, as docs/capture.md ("The loop on the bundled model") tells a
user to run it, with real processes and small sizes: `dflash-serve --capture DIR`, prose
traffic (a domain the Python-trained drafter never saw), `dflash-train adapt`, the adapted
drafter served as a canary pool beside the bundled one (`dflash-serve --pools`), and the
gateway's /metrics showing the canary's acceptance above the baseline's on the same traffic."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import yaml

from tests.fixtures.serve import announced, dflash_serve, interrupt
from tests.fixtures.worker import ROOT, free_port, metric, scrape

TOPICS = ["the sea", "a red fox", "winter", "coffee", "mountains", "trains", "the moon", "rain"]
TOPICS += ["bread", "snow", "bees", "a river", "the desert", "a garden", "autumn", "a cat"]
TOPICS += ["a violin", "the stars", "a market", "a bicycle"]
ASKS = ["Write a short poem about {}.", "Tell me a story about {}."]
PROSE = [ask.format(topic) for topic in TOPICS for ask in ASKS]  # 40 requests


def send(port: int, prompts: list[str]) -> list[str]:
    """Greedy chat requests through the gateway; the pool that served each one. Each has its
    own X-Request-Id (the gateway keeps a client's): adapt splits train and held-out by
    request id, so the same ids make the same split on every run."""
    pools = []
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
        for i, prompt in enumerate(prompts):
            body = {
                "model": "tiny-coder",
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": 48,
                "temperature": 0,
            }
            headers = {"X-Request-Id": f"loop-{i}"}
            reply = client.post("/v1/chat/completions", json=body, headers=headers)
            assert reply.status_code == 200, reply.text
            pools.append(reply.headers["x-dflash-pool"])
    return pools


def serve(*flags: str) -> list[str]:
    argv = [sys.executable, "-m", "launcher.local_stack", *flags, "--log-level", "warning"]
    return [*argv, "--worker-arg=--max-num-seqs=2", "--worker-arg=--max-model-len=512"]


def test_captured_traffic_adapts_a_canary_whose_acceptance_beats_the_bundled_drafter(
    tmp_path: Path,
) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    capture, adapted = tmp_path / "capture", tmp_path / "adapted"

    # 1-2. Serve with capture on; send the domain's traffic; Ctrl-C writes the last shard.
    port = free_port()
    with dflash_serve(serve("--port", str(port), "--capture", str(capture)), env) as proc:
        announced(proc)
        send(port, PROSE)
        assert interrupt(proc) == 0
    assert list(capture.glob("capture-*.jsonl.zst"))

    # 3. Adapt (a few steps; the recipe set is made small, as no distillation data exists).
    argv = [sys.executable, "-m", "engine.train.cli", "adapt", "--data", str(capture)]
    argv += ["--out", str(adapted), "--steps", "40", "--batch-seqs", "4", "--device", "cpu"]
    argv += ["--recipe-data", str(tmp_path / "no-distill"), "--recipe-samples", "8"]
    argv += ["--eval-prompts", "2", "--eval-tokens", "24"]
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert (adapted / "manifest.json").is_file()

    # 4. The adapted drafter as a canary pool beside the bundled one, one model name.
    canary = {"method": "dflash", "model": str(adapted)}
    pools = [
        {"name": "bundled", "model": "tiny-coder", "weight": 50},
        {
            "name": "adapted",
            "model": "tiny-coder",
            "weight": 50,
            "worker_args": [f"--speculative-config={json.dumps(canary)}"],
        },
    ]
    pools_file = tmp_path / "pools.yaml"
    pools_file.write_text(yaml.safe_dump({"pools": pools}))

    # 5. The same traffic; acceptance per pool from the gateway's /metrics.
    port = free_port()
    with dflash_serve(serve("--port", str(port), "--pools", str(pools_file)), env) as proc:
        announced(proc, 2)
        served = send(port, PROSE[::2] + PROSE[1::4])
        assert set(served) == {"bundled", "adapted"}, served
        samples = scrape(f"http://127.0.0.1:{port}")
        length = {
            pool: 1
            + metric(samples, "dflash_spec_accepted_tokens_total", pool=pool)
            / metric(samples, "dflash_spec_steps_total", pool=pool)
            for pool in ("bundled", "adapted")
        }
        assert length["adapted"] > length["bundled"], length
        assert interrupt(proc) == 0
