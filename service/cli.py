"""`dflash-gateway`: run one gateway. Flags override `DFLASH_GATEWAY_*` env, which overrides
defaults; SIGTERM drains (flip /ready, wait shutdown_delay_s, finish in-flight requests)."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

import uvicorn
import yaml
from pydantic import ValidationError

from service.api import GatewayState
from service.app import create_app
from service.capture.writer import dataset_problem
from service.http_server import guarded_protocol, listening_socket
from service.metrics import MULTIPROC_ENV
from service.proxy import Proxy
from service.settings import GatewaySettings
from service.tenancy.tenants import KeyFileError
from wire.http import DrainingServer, run_servers, tune_gc_for_serving

log = logging.getLogger("dflash.gateway")


# Flags whose values are no secret and which their own errors must name (a file's path).
PUBLIC_FLAGS = frozenset({"--pools"})


class SecretSafeParser(argparse.ArgumentParser):
    """argparse whose error messages never repeat a value from the command line: a key given
    to a flag that does not exist (`--api-key sk-...`) must not reach a terminal or a log."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.values: list[str] = []

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        argv = list(sys.argv[1:] if args is None else args)
        values = [a.partition("=")[2] if a.startswith("-") else a for a in argv]
        public = {v for flag, v in itertools.pairwise(argv) if flag in PUBLIC_FLAGS}
        public |= {a.partition("=")[2] for a in argv if a.partition("=")[0] in PUBLIC_FLAGS}
        kept = {v for v in values if v and not v.startswith("-")} - public
        self.values = sorted(kept, key=len)[::-1]
        return super().parse_args(argv, namespace)

    def error(self, message: str) -> NoReturn:
        for value in self.values:
            message = message.replace(value, "***")
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    p = SecretSafeParser(
        prog="dflash-gateway",
        description="OpenAI-compatible gateway over a pool of DFlash workers. "
        "Every flag can also be set as DFLASH_GATEWAY_<NAME> in the environment.",
        argument_default=argparse.SUPPRESS,
        allow_abbrev=False,  # `--api-key` must not silently mean `--api-key-file`
    )
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default 8000)")
    p.add_argument(
        "--worker", dest="workers", action="append", metavar="URL", help="worker base URL (repeat)"
    )
    p.add_argument("--worker-dns", metavar="NAME:PORT", help="re-resolved DNS name of the workers")
    p.add_argument(
        "--pools",
        type=read_pools,
        metavar="FILE",
        help="YAML (or JSON) list of pools: name, model, weight, workers and/or worker_dns "
        "(instead of --worker/--worker-dns; env: DFLASH_GATEWAY_POOLS as JSON)",
    )
    p.add_argument("--routing", choices=["least_outstanding", "prefix_affinity", "fastest"])
    p.add_argument(
        "--api-key-file",
        metavar="PATH",
        help="API keys: one per line, or YAML naming tenants, their keys and limits",
    )
    p.add_argument(
        "--redis-url",
        metavar="URL",
        help="redis[s]://[[user]:password@]host:port/db: tenants' usage shared by every "
        "gateway process and replica (default: counted in this process; rediss: TLS, see "
        "DFLASH_GATEWAY_REDIS_TLS_* and docs/redis.md)",
    )
    p.add_argument(
        "--rate-limit-failure-mode",
        choices=["open", "closed"],
        help="when the store does not answer: serve without limits (open, default) or 503",
    )
    p.add_argument("--rate-limit-deadline-s", type=float, help="store deadline (default 0.1)")
    p.add_argument(
        "--rate-limit-window-s", type=float, help="length of a 'per minute' window (default 60)"
    )
    p.add_argument("--metrics-auth", action="store_true", help="require the API key on /metrics")
    p.add_argument(
        "--metrics-worker-label",
        choices=["id", "url"],
        help="worker label of the metrics: an opaque id (default) or the worker URL",
    )
    p.add_argument("--max-retries", type=int)
    p.add_argument("--health-interval-s", type=float)
    p.add_argument("--drain-timeout-s", type=float)
    p.add_argument("--shutdown-delay-s", type=float)
    p.add_argument("--processes", type=int, help="processes sharing the port (default 1)")
    p.add_argument("--listen-backlog", type=int, help="pending connections (default 4096)")
    p.add_argument(
        "--upstream-keepalive-s",
        type=float,
        help="seconds an idle worker connection is kept for reuse (default 4; keep it below "
        "the workers' idle close, VLLM_HTTP_TIMEOUT_KEEP_ALIVE)",
    )
    p.add_argument(
        "--capture-uri",
        metavar="URI",
        help="capture served traffic for drafter training into this dataset: a folder, s3:// "
        "or gs:// (docs/capture.md; with tenants, only those whose capture is set)",
    )
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    p.add_argument(
        "--log-levels",
        metavar="NAME=LEVEL,...",
        help="single loggers' levels over --log-level, e.g. dflash.gateway.fastest=debug",
    )
    p.add_argument("--access-log", action="store_true")
    return p


def read_pools(path: str) -> list[Any]:
    """The pools file: a list, or a mapping with a `pools` list (a chart-like layout)."""
    try:
        loaded = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise argparse.ArgumentTypeError(f"cannot read pools file {path}: {exc}") from None
    if isinstance(loaded, dict):
        unknown = sorted(str(key) for key in loaded if key != "pools")
        if unknown:
            raise argparse.ArgumentTypeError(
                f"pools file {path}: unknown top-level key(s) {', '.join(unknown)}: it holds "
                "`pools:` only (routing and the other settings are flags or "
                "DFLASH_GATEWAY_* variables)"
            )
        loaded = loaded.get("pools")
    if not isinstance(loaded, list):
        raise argparse.ArgumentTypeError(
            f"pools file {path}: expected a list of pools, or `pools:` with one"
        )
    return loaded


def settings_from_args(argv: Sequence[str] | None) -> GatewaySettings:
    overrides: dict[str, Any] = vars(build_parser().parse_args(argv))
    return GatewaySettings(**overrides)


def describe_invalid(exc: ValidationError) -> str:
    """pydantic's complaints without the offending values (one may be a key)."""
    lines = []
    for error in exc.errors():
        where = ".".join(str(part) for part in error["loc"]) or "settings"
        lines.append(f"  {where}: {error['msg']}")
    return "\n".join(lines)


class GatewayServer(DrainingServer):
    """One gateway under uvicorn, on a socket of its own (backlog, SO_REUSEPORT), with header
    and body read deadlines, and the gateway's drain (`drain`)."""

    def __init__(self, settings: GatewaySettings, *, reuse_port: bool = False) -> None:
        app = create_app(settings)
        config = uvicorn.Config(
            app,
            host=settings.host,
            port=settings.port,
            http=guarded_protocol(settings.header_read_timeout_s, settings.body_read_timeout_s),
            log_level=settings.log_level,
            access_log=settings.access_log,
            backlog=settings.listen_backlog,
            proxy_headers=False,  # X-Forwarded-* is not read: no middleware for it
            # `drain` has already ended every request when uvicorn stops; this only bounds
            # the flush of their last bytes.
            timeout_graceful_shutdown=FLUSH_S,
            lifespan="on",
        )
        self.settings = settings
        self.state: GatewayState = app.state.gateway
        sock = listening_socket(
            settings.host, settings.port, settings.listen_backlog, reuse_port=reuse_port
        )
        super().__init__(config, self._begin_drain, settings.shutdown_delay_s, sock=sock)

    @property
    def port(self) -> int:
        assert self.socket is not None
        return int(self.socket.getsockname()[1])

    def _begin_drain(self) -> None:
        self.state.draining = True  # /ready now says 503

    def proxy(self) -> Proxy | None:
        runtime = self.state.runtime
        return runtime.proxy if runtime is not None else None

    async def drain(self) -> None:
        """/ready says 503 at once; requests are still served for shutdown_delay_s (load
        balancers take time to notice); then new ones get 503 + Retry-After while in-flight
        ones get up to drain_timeout_s; streams still open then end with an in-band error and
        [DONE]. Only then does uvicorn close the listener."""
        self._begin_drain()
        log.info("draining: /ready is 503; refusing new requests in %.1fs", self.drain_delay_s)
        await asyncio.sleep(self.drain_delay_s)
        proxy = self.proxy()
        if proxy is not None:
            proxy.refusing = True
            await settled(proxy, self.settings.drain_timeout_s)
            cut = proxy.cut_streams()
            if cut:
                log.warning("drain timeout: cut %d open upstream bodies", cut)
            await settled(proxy, FLUSH_S)


FLUSH_S = 2


async def settled(proxy: Proxy, within_s: float) -> None:
    """Until no request is in flight, or `within_s`. Polled: an event per request would cost
    the request path for the sake of shutdown."""
    deadline = asyncio.get_running_loop().time() + within_s
    while proxy.in_flight:
        if asyncio.get_running_loop().time() >= deadline:
            return
        await asyncio.sleep(0.02)


def configure_logging(level: str, levels: Mapping[str, str] | None = None) -> None:
    """The root level, and single loggers' levels over it (`log_levels`)."""
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # httpx logs every upstream request at INFO: far too costly on the request path.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    set_log_levels(levels or {})


def set_log_levels(levels: Mapping[str, str]) -> None:
    """Single loggers' levels (the `log_levels` setting), over the root's."""
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level.upper())


CHILD_ENV = "DFLASH_GATEWAY_CHILD_INDEX"  # set by the supervisor for its processes


def key_file_problem(settings: GatewaySettings) -> str | None:
    """Why the keys cannot be served: a key file that does not parse (at startup there is no
    previous one to keep), or tenants' limits over several processes with no shared store."""
    try:
        ring = settings.load_key_ring()
    except OSError as exc:
        return f"cannot read the API key file: {exc.strerror}"
    except KeyFileError as exc:
        return f"API key file {settings.api_key_file}: {exc}"
    if settings.api_key_file is not None and not ring.by_digest:
        # Auth would be off: a file given to hold keys that holds none is a mistake.
        return f"API key file {settings.api_key_file}: no key in it (auth would be off)"
    if ring.tenancy and settings.processes > 1 and settings.redis_url is None:
        return (
            "tenants' limits with --processes > 1 need a store the processes share: "
            "set DFLASH_GATEWAY_REDIS_URL (each process would otherwise count alone)"
        )
    return None


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        settings = settings_from_args(args)
    except ValidationError as exc:
        print(f"dflash-gateway: invalid settings:\n{describe_invalid(exc)}", file=sys.stderr)
        return 2
    if not settings.pool_specs():
        print(
            "dflash-gateway: give --worker URL (repeatable), --worker-dns NAME:PORT or --pools",
            file=sys.stderr,
        )
        return 2
    refusal = key_file_problem(settings)
    if refusal is not None:
        print(f"dflash-gateway: {refusal}", file=sys.stderr)
        return 2
    capture = None if settings.capture_uri is None else dataset_problem(settings.capture_uri)
    if capture is not None:
        print(f"dflash-gateway: invalid settings:\n  capture_uri: {capture}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level, settings.log_levels)
    if settings.processes > 1 and os.environ.get(CHILD_ENV) is None:
        if settings.port == 0:
            print("dflash-gateway: --processes needs a fixed --port", file=sys.stderr)
            return 2
        return supervise(args, settings.processes)
    server = GatewayServer(settings, reuse_port=settings.processes > 1)
    tune_gc_for_serving()
    run_servers([server])
    return 0


def supervise(args: list[str], processes: int) -> int:
    """Start `processes` gateways on one port (SO_REUSEPORT: the kernel spreads connections)
    sharing a Prometheus multiprocess directory, so that any one's /metrics is the sum;
    forward SIGTERM/SIGINT to them and exit when they all have."""
    own_dir = None
    env = dict(os.environ)
    if not env.get(MULTIPROC_ENV):
        own_dir = tempfile.mkdtemp(prefix="dflash-gateway-metrics-")
        env[MULTIPROC_ENV] = own_dir
    children = []
    for index in range(processes):
        child_env = {**env, CHILD_ENV: str(index)}
        command = [sys.executable, "-m", "service.cli", *args]
        children.append(subprocess.Popen(command, env=child_env))
    log.info("started %d gateway processes: %s", processes, [c.pid for c in children])

    def forward(signum: int, _: Any) -> None:
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        codes = [child.wait() for child in children]
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if own_dir is not None:
            shutil.rmtree(own_dir, ignore_errors=True)
    return max(codes, key=abs)


if __name__ == "__main__":
    raise SystemExit(main())
