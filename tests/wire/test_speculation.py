"""One request's acceptance, one formula: the worker's `metrics` object, the worker's decode
span and the gateway's server span give the same numbers for the same counts, zero steps
included."""

from __future__ import annotations

import pytest

from engine.sequence import SpecDecodeStats
from engine.worker.formatting import speculative_object
from engine.worker.tracing import decoding_attributes
from service.reports import SpecStats, parse_spec
from service.tracing import summed
from wire.speculation import draft_acceptance_rate, mean_acceptance_length, spec_span_attributes


def test_the_formulas_and_their_zero_step_answers() -> None:
    assert mean_acceptance_length(6, 4) == 2.5
    assert mean_acceptance_length(0, 0) == 1.0  # no verify step: one token per forward
    assert draft_acceptance_rate(3, 12) == 0.25
    assert draft_acceptance_rate(0, 0) == 0.0
    assert "dflash.spec.draft_acceptance_rate" not in spec_span_attributes(2, 1, None)


def stats(per_step: list[tuple[int, int]]) -> SpecDecodeStats:
    spec = SpecDecodeStats(num_spec_tokens=3)
    for drafted, accepted in per_step:
        spec.observe(drafted, accepted)
    return spec


@pytest.mark.parametrize(
    "per_step", [[], [(3, 0)], [(3, 3), (3, 1)], [(3, 2), (3, 0), (3, 3)]], ids=str
)
def test_worker_object_worker_span_and_gateway_span_agree(per_step: list[tuple[int, int]]) -> None:
    spec = stats(per_step)
    body = {"metrics": {"speculative_decoding": speculative_object(spec, "summary", stream=False)}}
    worker_span = decoding_attributes(spec, output_tokens=9)
    reported = parse_spec(body)
    assert reported  # the gateway reads the worker's object, zero steps included
    total = summed(reported)
    gateway_span = spec_span_attributes(
        total.steps, total.accepted_tokens, total.draft_tokens, total.acceptance_length
    )
    for name, value in gateway_span.items():
        assert worker_span[name] == pytest.approx(value), name
    wire_object = body["metrics"]["speculative_decoding"]
    assert (
        wire_object["mean_acceptance_length"] == worker_span["dflash.spec.mean_acceptance_length"]
    )
    assert wire_object["draft_acceptance_rate"] == worker_span["dflash.spec.draft_acceptance_rate"]


def test_choices_summed_at_the_gateway_use_the_same_formula() -> None:
    a = SpecStats(
        steps=0, draft_tokens=0, accepted_tokens=0, acceptance_length=1.0, acceptance_rate=None
    )
    both = summed([a, a])
    assert both.acceptance_length == 1.0  # was None at the gateway, 1.0 at the worker
