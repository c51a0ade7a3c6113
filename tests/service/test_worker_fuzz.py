"""schemathesis against the embedded worker itself, with the gateway's request schema (one
schema module): generated bodies sent straight to the worker never make it answer 5xx, and
its errors are OpenAI bodies. With the corpus in test_bad_input, the worker side of issue 17."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from service.app import create_app
from service.settings import GatewaySettings
from tests.fixtures.worker import WorkerHandle, running_worker
from tests.service.conftest import worker_args

# schemathesis reports its operations under one node id, which pytest-xdist cannot
# forward (tests/conftest.py): make test runs this module in a process of its own.
pytestmark = pytest.mark.serial

schema = schemathesis.openapi.from_dict(create_app(GatewaySettings()).openapi()).include(
    path_regex="^/v1/(chat/)?completions$"
)


@pytest.fixture(scope="module")
def short_worker(tiny_checkpoint: Any) -> Iterator[WorkerHandle]:
    # A short context bounds every generation (a body without max_tokens runs to its end):
    # the answers that run to it were most of this module's time.
    with running_worker(*worker_args(tiny_checkpoint, "--max-model-len", "20")) as worker:
        yield worker


@schema.parametrize()
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_input_makes_the_worker_fail(case: Any, short_worker: WorkerHandle) -> None:
    response = case.call(base_url=short_worker.base_url, timeout=60)
    case.validate_response(response, checks=[not_a_server_error])
    if response.status_code >= 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
