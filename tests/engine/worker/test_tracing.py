"""The worker's decode span summary, from the engine's own speculation counts (no span per
step); the spans themselves are received over OTLP in tests/service/test_tracing.py."""

from __future__ import annotations

from engine.sequence import SpecDecodeStats
from engine.worker.tracing import decoding_attributes, epoch_ns


def test_the_decode_summary_of_an_adaptive_request() -> None:
    spec = SpecDecodeStats(num_spec_tokens=4, adaptive=True, num_plain_steps=2)
    for drafted, accepted in [(4, 3), (2, 2), (4, 0)]:
        spec.observe(drafted, accepted)
    attributes = decoding_attributes(spec, output_tokens=10)
    assert attributes["dflash.spec.steps"] == 3
    assert attributes["dflash.spec.draft_tokens"] == 10
    assert attributes["dflash.spec.accepted_tokens"] == 5
    assert attributes["dflash.spec.mean_acceptance_length"] == 1 + 5 / 3
    assert attributes["dflash.adaptive.plain_steps"] == 2
    assert attributes["dflash.adaptive.draft_lengths"] == ["2=1", "4=2"]
    assert attributes["gen_ai.usage.output_tokens"] == 10


def test_plain_decoding_has_no_speculation_attributes() -> None:
    assert decoding_attributes(None, 3) == {"gen_ai.usage.output_tokens": 3}
    assert epoch_ns(1.5, 10) == 1_500_000_010
