"""`dflash-gateway`: run one gateway. Flags override `DFLASH_GATEWAY_*` env, which overrides
defaults; SIGTERM drains (flip /ready, wait shutdown_delay_s, finish in-flight requests)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import uvicorn
from pydantic import ValidationError

from service.api import GatewayState
from service.app import create_app
from service.settings import GatewaySettings

log = logging.getLogger("dflash.gateway")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dflash-gateway",
        description="OpenAI-compatible gateway over a pool of DFlash workers. "
        "Every flag can also be set as DFLASH_GATEWAY_<NAME> in the environment.",
        argument_default=argparse.SUPPRESS,
    )
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default 8000)")
    p.add_argument(
        "--worker", dest="workers", action="append", metavar="URL", help="worker base URL (repeat)"
    )
    p.add_argument("--worker-dns", metavar="NAME:PORT", help="re-resolved DNS name of the workers")
    p.add_argument("--routing", choices=["least_outstanding", "prefix_affinity"])
    p.add_argument("--api-key-file", metavar="PATH", help="file with one API key per line")
    p.add_argument("--metrics-auth", action="store_true", help="require the API key on /metrics")
    p.add_argument("--max-retries", type=int)
    p.add_argument("--health-interval-s", type=float)
    p.add_argument("--drain-timeout-s", type=float)
    p.add_argument("--shutdown-delay-s", type=float)
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    p.add_argument("--access-log", action="store_true")
    return p


def settings_from_args(argv: Sequence[str] | None) -> GatewaySettings:
    overrides: dict[str, Any] = vars(build_parser().parse_args(argv))
    return GatewaySettings(**overrides)


class GatewayServer(uvicorn.Server):
    """uvicorn server whose signals are handled by `serve_all` (several servers, one drain)."""

    def __init__(self, settings: GatewaySettings) -> None:
        app = create_app(settings)
        config = uvicorn.Config(
            app,
            host=settings.host,
            port=settings.port,
            log_level=settings.log_level,
            access_log=settings.access_log,
            timeout_graceful_shutdown=math.ceil(settings.drain_timeout_s),  # 0: no wait
            lifespan="on",
        )
        super().__init__(config)
        self.settings = settings
        self.state: GatewayState = app.state.gateway

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def serve_all(
    servers: Sequence[GatewayServer], on_started: Callable[[], None] | None = None
) -> None:
    """Serve until SIGINT/SIGTERM; the first signal drains gracefully, a second forces exit.
    `on_started` runs once every server listens."""
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()

    def on_signal() -> None:
        if stopping.is_set():
            for server in servers:
                server.force_exit = True
        stopping.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)

    async def drain() -> None:
        await stopping.wait()
        for server in servers:
            server.state.draining = True  # /ready now says 503
        delay = max(server.settings.shutdown_delay_s for server in servers)
        log.info("draining: /ready is 503; stopping in %.1fs", delay)
        await asyncio.sleep(delay)
        for server in servers:
            server.should_exit = True

    async def announce() -> None:
        # uvicorn offers a `started` flag, not an event: poll it.
        while not all(server.started for server in servers):  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        if on_started is not None:
            on_started()

    drainer, announcer = asyncio.create_task(drain()), asyncio.create_task(announce())
    try:
        await asyncio.gather(*(server.serve() for server in servers))
    finally:
        drainer.cancel()
        announcer.cancel()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # httpx logs every upstream request at INFO: far too costly on the request path.
    logging.getLogger("httpx").setLevel(logging.WARNING)


def main(argv: list[str] | None = None) -> int:
    try:
        settings = settings_from_args(argv)
    except ValidationError as exc:
        print(f"dflash-gateway: invalid settings:\n{exc}", file=sys.stderr)
        return 2
    if not settings.workers and not settings.worker_dns:
        print(
            "dflash-gateway: give --worker URL (repeatable) or --worker-dns NAME:PORT",
            file=sys.stderr,
        )
        return 2
    configure_logging(settings.log_level)
    run_servers([GatewayServer(settings)])
    return 0


def run_servers(
    servers: Sequence[GatewayServer], on_started: Callable[[], None] | None = None
) -> None:
    """Run on uvicorn's preferred loop (uvloop when installed) until drained."""
    with asyncio.Runner(loop_factory=servers[0].config.get_loop_factory()) as runner:
        runner.run(serve_all(servers, on_started))


if __name__ == "__main__":
    raise SystemExit(main())
