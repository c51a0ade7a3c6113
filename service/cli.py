"""`dflash-gateway`: run one gateway. Flags override `DFLASH_GATEWAY_*` env, which overrides
defaults; SIGTERM drains (flip /ready, wait shutdown_delay_s, finish in-flight requests)."""

from __future__ import annotations

import argparse
import logging
import math
import sys
from collections.abc import Sequence
from typing import Any

import uvicorn
from pydantic import ValidationError

from service.api import GatewayState
from service.app import create_app
from service.http import DrainingServer, run_servers
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


class GatewayServer(DrainingServer):
    """One gateway under uvicorn: SIGTERM flips /ready to 503, then after shutdown_delay_s
    the listener closes and in-flight requests finish."""

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
        self.settings = settings
        self.state: GatewayState = app.state.gateway
        super().__init__(config, self._begin_drain, settings.shutdown_delay_s)

    def _begin_drain(self) -> None:
        self.state.draining = True  # /ready now says 503


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


if __name__ == "__main__":
    raise SystemExit(main())
