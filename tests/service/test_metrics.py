"""The exposition of the gateway's series."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from service.metrics import MULTIPROC_ENV, GatewayMetrics
from service.reports import Usage, parse_spec
from tests.service.test_reports import SPEC


def test_exposition_has_the_design_names() -> None:
    metrics = GatewayMetrics()
    metrics.observe_spec("m", "p", parse_spec({"metrics": {"speculative_decoding": SPEC}}))
    metrics.observe_usage("m", "p", Usage(3, 7))
    metrics.set_worker_health("http://w:1", "p", True)
    text = metrics.render()[0].decode()
    for line in (
        'dflash_spec_steps_total{model="m",pool="p"} 2.0',
        'dflash_spec_draft_tokens_total{model="m",pool="p"} 6.0',
        'dflash_spec_accepted_tokens_total{model="m",pool="p"} 2.0',
        'dflash_spec_acceptance_length_sum{model="m",pool="p"} 2.5',
        'dflash_spec_draft_acceptance_rate_count{model="m",pool="p"} 1.0',
        'dflash_prompt_tokens_total{model="m",pool="p"} 3.0',
        'dflash_completion_tokens_total{model="m",pool="p"} 7.0',
        'dflash_worker_healthy{pool="p",worker="http://w:1"} 1.0',
    ):
        assert line in text
    metrics.set_worker_health("http://w:1", "p", None)
    assert "http://w:1" not in metrics.render()[0].decode()


def test_multiprocess_metrics_drop_workers_that_left_the_pool(tmp_path: Path) -> None:
    """In `--processes N` mode values live in per-process files that cannot be removed: a
    worker that left the pool must still vanish from /metrics (it did not, before)."""
    code = (
        "from service.metrics import GatewayMetrics\n"
        "m = GatewayMetrics()\n"
        "m.set_worker_health('w-a', 'p', True)\n"
        "m.set_worker_health('w-b', 'p', False)\n"
        "m.set_worker_health('w-a', 'p', None)\n"
        "m.requests.labels('m', 'p', 'chat', '200').inc()\n"
        "print(m.render()[0].decode())\n"
    )
    env = {**os.environ, MULTIPROC_ENV: str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout
    assert 'dflash_worker_healthy{pool="p",worker="w-b"} 0.0' in out
    assert "w-a" not in out
    assert 'dflash_requests_total{endpoint="chat",model="m",pool="p",status="200"} 1.0' in out
