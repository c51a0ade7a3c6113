"""The engine's exceptions carry what the worker layer needs to render them."""

from __future__ import annotations

from engine.errors import EngineError, QueueFull, RequestRejected


def test_request_rejected_names_the_field_and_the_reason() -> None:
    err = RequestRejected("too long", "max_tokens", "context_length_exceeded")
    assert (err.message, err.param, err.code) == (
        "too long",
        "max_tokens",
        "context_length_exceeded",
    )
    assert str(err) == "too long" and isinstance(err, ValueError)
    assert RequestRejected("x").param is None and RequestRejected("x").code is None


def test_capacity_and_step_failures_are_runtime_errors() -> None:
    assert issubclass(QueueFull, RuntimeError) and issubclass(EngineError, RuntimeError)
    assert not issubclass(QueueFull, ValueError)
