"""schemathesis against the gateway's own OpenAPI schema, real worker behind: never a 5xx."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from service.app import create_app
from service.settings import GatewaySettings
from tests.fixtures.worker import running_worker
from tests.service.conftest import Gateway, running_gateway, worker_args

# The schema the app serves at /openapi.json (built without starting anything).
schema = schemathesis.openapi.from_dict(create_app(GatewaySettings()).openapi())


@pytest.fixture(scope="module")
def live(tiny_checkpoint: Any) -> Iterator[Gateway]:
    # The worker serves "tiny-coder" as the schema's examples do: examples reach the worker,
    # generated bodies mostly exercise the gateway's 400 and 404 paths. A short context
    # bounds every generation (a body without max_tokens runs to the end of the context).
    with (
        running_worker(*worker_args(tiny_checkpoint, "--max-model-len", "96")) as worker,
        running_gateway(workers=[worker.base_url]) as gw,
    ):
        yield gw


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_input_makes_the_gateway_fail(case: Any, live: Gateway) -> None:
    response = case.call(base_url=live.base_url, timeout=30)
    case.validate_response(response, checks=[not_a_server_error])
    if response.status_code >= 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
