"""schemathesis against the gateway's own OpenAPI schema, real worker behind: every check
(status codes and content types declared, bodies as declared, what the schema calls valid is
accepted and what it calls invalid refused, never a 5xx), over every operation, with a fixed
seed and a bounded number of examples."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance

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
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_the_gateway_does_what_its_schema_says(case: Any, live: Gateway) -> None:
    response = case.call(base_url=live.base_url, timeout=30)
    # Every check but positive_data_acceptance: what the engine behind refuses of a request
    # the document calls valid (max_tokens past the context, token ids past the vocabulary,
    # a Responses field the embedded engine cannot honour) depends on the model and engine
    # served, which the gateway's document cannot say; and JSON Schema's integers include
    # 1.0, which the strict request models refuse.
    case.validate_response(response, excluded_checks=[positive_data_acceptance])
    if response.status_code >= 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
