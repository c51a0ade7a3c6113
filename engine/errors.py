"""The engine's own exceptions. The engine core knows nothing of HTTP: the worker layer
(engine/worker/api.py) is the only place that maps these to status codes."""

from __future__ import annotations


class RequestRejected(ValueError):
    """A request the engine can never serve as asked (a client error).

    `param` names the request field at fault; `code` is a machine-readable reason
    (e.g. "context_length_exceeded") or None."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class QueueFull(RuntimeError):
    """Every slot and the whole waiting queue are taken, or the engine is shutting down:
    retry later."""


class EngineError(RuntimeError):
    """A step failed inside the engine; the requests it was running are lost."""
