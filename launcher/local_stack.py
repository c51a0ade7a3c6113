"""`dflash-serve`: the local stack in one command.

Starts N `dflash-worker` subprocesses on the bundled model (the embedded engine, or real vLLM
with `--backend vllm`) and a gateway in front of them on 127.0.0.1. `--compare` adds a second
pool of plain-decoding workers behind a second gateway (port + 1), so DFlash and plain
decoding can be load-tested side by side. `--pools FILE` serves several pools behind one
gateway instead: models, and weighted pools of one model (a drafter canary).
Ctrl-C / SIGTERM: the gateways drain, then the workers are stopped.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from launcher.processes import free_port, healthy, stop_all
from service.capture.policy import CaptureShare
from service.capture.writer import dataset_problem
from service.cli import (
    GatewayServer,
    configure_logging,
    describe_invalid,
    key_file_problem,
    set_log_levels,
)
from service.routing.promotion import PromotionSpec
from service.settings import POOL_NAME, GatewaySettings, PoolSpec, check_pools
from wire.http import run_servers

# The bundled drafters (`--drafter`): the speculative method and their folder. A path, not an
# import: dflash-serve runs in the gateway's install, without the engine.
ASSETS = Path(__file__).resolve().parents[1] / "engine" / "assets" / "tiny-coder"
BUNDLED_DRAFTERS = {"dflash": ("dflash", "dflash"), "dflash2": ("dflash2", "dflash2")}


class LocalPool(BaseModel):
    """Workers started alike: one engine, one drafter (or none), one served model name."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=POOL_NAME)
    workers: int = Field(default=1, ge=1)
    speculation: bool = True  # False: plain decoding, the baseline
    worker_args: tuple[str, ...] = ()
    engine: Literal["embedded", "vllm"] = "embedded"
    # The name clients send (the workers' --served-model-name); None: the workers' own.
    model: str | None = Field(default=None, min_length=1)
    weight: float = Field(default=100.0, ge=0, allow_inf_nan=False)
    capture: CaptureShare = 1.0  # with --capture: the share of its requests captured
    promotion: PromotionSpec | None = None  # automatic promotion against a baseline pool


class PoolsFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    pools: list[LocalPool] = Field(min_length=1)

    @model_validator(mode="after")
    def _consistent(self) -> PoolsFile:
        check_pools(self.pools)
        return self


def load_pools(path: Path) -> tuple[LocalPool, ...]:
    """The pools of a YAML file (`pools:` list); ValueError naming what is wrong."""
    try:
        loaded = yaml.safe_load(path.read_text())
        return tuple(PoolsFile.model_validate(loaded).pools)
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    except ValidationError as exc:
        raise ValueError(f"invalid pools file {path}:\n{describe_invalid(exc)}") from None


@dataclass(frozen=True)
class LocalGateway:
    """One gateway and the pools behind it."""

    port: int
    pools: tuple[LocalPool, ...]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"


@dataclass
class WorkerProcess:
    url: str
    process: subprocess.Popen[bytes]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash-serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, default=8000, help="gateway port (default 8000)")
    p.add_argument("--workers", type=int, default=None, help="workers per pool (default 1)")
    p.add_argument(
        "--backend",
        choices=["embedded", "vllm"],
        default=None,
        help="embedded: the pure-PyTorch engine; vllm: real vLLM (`make vllm-env` installs a "
        "CPU build; add --worker-arg=--enforce-eager for a faster start on a CPU)",
    )
    p.add_argument(
        "--worker-port",
        type=int,
        default=None,
        metavar="PORT",
        help="pin worker ports: PORT, PORT+1, ... (default: free ports)",
    )
    p.add_argument("--no-speculation", action="store_true", help="plain decoding (no drafter)")
    p.add_argument(
        "--drafter",
        choices=sorted(BUNDLED_DRAFTERS),
        default=None,
        help="which bundled drafter the embedded workers use: dflash (the default) or dflash2 "
        "(DFlash2: a grouped convolution and a candidate selector; docs/worker.md)",
    )
    p.add_argument(
        "--compare",
        action="store_true",
        help="also serve a plain-decoding pool on --compare-port, beside the DFlash one",
    )
    p.add_argument("--compare-port", type=int, default=None, help="default: --port + 1")
    p.add_argument(
        "--pools",
        type=Path,
        default=None,
        metavar="FILE",
        help="YAML list of pools behind the one gateway: name, model, weight, engine, "
        "workers, speculation, worker_args (examples/canary-pools.yaml)",
    )
    p.add_argument(
        "--worker-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for every dflash-worker (repeat), e.g. --worker-arg=--max-num-seqs=4 "
        "(a --speculative-config=... one is left out of plain pools)",
    )
    p.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="require this bearer key on the gateway's /v1/* (repeat for several; default: "
        "no key, or DFLASH_GATEWAY_API_KEYS)",
    )
    p.add_argument(
        "--api-key-file",
        metavar="PATH",
        help="the gateway's key file: one key per line, or tenants with their keys and limits "
        "(YAML; see the README's Tenants section)",
    )
    p.add_argument(
        "--capture",
        metavar="DIR",
        help="capture the served requests into this folder, for `dflash-train adapt` "
        "(docs/capture.md)",
    )
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def drafter_args(name: str | None) -> tuple[str, ...]:
    """--drafter NAME as the worker's --speculative-config (none: the worker's default, the
    bundled DFlash drafter)."""
    if name is None:
        return ()
    method, folder = BUNDLED_DRAFTERS[name]
    config = {"method": method, "model": str(ASSETS / folder)}
    return (f"--speculative-config={json.dumps(config)}",)


def plan(args: argparse.Namespace) -> list[LocalGateway]:
    """The gateways to start: one over one pool, one over the pools of --pools FILE, or a
    DFlash and a plain one side by side with --compare. --worker-arg applies to every pool."""
    extra = (*drafter_args(args.drafter), *args.worker_arg)

    def pool(name: str, speculation: bool) -> LocalPool:
        return LocalPool(
            name=name,
            workers=1 if args.workers is None else args.workers,
            speculation=speculation,
            worker_args=extra,
            engine=args.backend or "embedded",
        )

    if args.pools is not None:
        given = {
            "--workers": args.workers is not None,
            "--backend": args.backend is not None,
            "--compare": args.compare,
            "--no-speculation": args.no_speculation,
            "--drafter": args.drafter is not None,
        }
        clash = [flag for flag, set_ in given.items() if set_]
        if clash:
            raise ValueError(
                f"{', '.join(clash)}: set per pool in {args.pools} (workers, engine, "
                "speculation) instead"
            )
        pools = tuple(
            p.model_copy(update={"worker_args": (*p.worker_args, *extra)})
            for p in load_pools(args.pools)
        )
        return [LocalGateway(args.port, pools)]
    if not args.compare:
        name = "plain" if args.no_speculation else "dflash"
        return [LocalGateway(args.port, (pool(name, not args.no_speculation),))]
    compare_port = args.compare_port if args.compare_port is not None else args.port + 1
    return [
        LocalGateway(args.port, (pool("dflash", True),)),
        LocalGateway(compare_port, (pool("plain", False),)),
    ]


def worker_ports(first: int | None, count: int) -> list[int]:
    """`count` ports: first, first + 1, ... when pinned, else free ones."""
    return (
        [first + i for i in range(count)]
        if first is not None
        else [free_port() for _ in range(count)]
    )


# Seconds workers keep an idle connection (as the chart's worker.httpKeepAliveSeconds);
# the gateway reuses one for a second less, so bursts find warm connections.
WORKER_KEEP_ALIVE_S = 61


def worker_env() -> dict[str, str]:
    defaults = {"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": str(WORKER_KEEP_ALIVE_S)}
    return {**defaults, **os.environ, "PYTHONUNBUFFERED": "1"}


def shared_threads(pool: LocalPool, total_workers: int, cpus: int) -> list[str]:
    """`--threads` for an embedded worker that shares the machine with others: its share of
    the CPUs less one for its HTTP side (the worker's own rule for a machine of its own).
    Nothing for a lone worker, or when the user chose (`--worker-arg=--threads=N`, or
    OMP_NUM_THREADS): the worker's default was measured faster than any override
    (engine/threads.py)."""
    chose = any(arg.startswith("--threads") for arg in pool.worker_args)
    if pool.engine != "embedded" or total_workers <= 1 or chose:
        return []
    if "OMP_NUM_THREADS" in os.environ:
        return []
    return ["--threads", str(max(1, cpus // total_workers - 1))]


def start_worker(
    pool: LocalPool, env: dict[str, str], port: int, threads: Sequence[str] = ()
) -> WorkerProcess:
    argv = [sys.executable, "-m", "engine.worker.cli", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--backend", pool.engine, *threads]
    if pool.model is not None:
        argv += ["--served-model-name", pool.model]
    extra = list(pool.worker_args)
    if not pool.speculation:
        # The plain pool of --compare shares the worker args: drop the drafter there.
        extra = [arg for arg in extra if not arg.startswith("--speculative-config")]
        argv.append("--no-speculation")
    argv += extra
    process = subprocess.Popen(argv, env=env, preexec_fn=die_with_parent)
    return WorkerProcess(f"http://127.0.0.1:{port}", process)


def die_with_parent() -> None:
    """In the child: ask Linux to SIGTERM it when dflash-serve dies, even by SIGKILL, so no
    worker outlives the stack. Elsewhere a no-op."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def wait_ready(
    workers: Sequence[WorkerProcess], timeout: float, report_every: float = 10.0
) -> None:
    """Block until every worker answers /health 200; fail fast when one exits; say every
    `report_every` seconds who is still loading (real vLLM takes a minute or more)."""
    start = time.monotonic()
    deadline, next_report = start + timeout, start + report_every
    pending = list(workers)
    while pending:
        if time.monotonic() >= next_report:
            next_report += report_every
            print(
                f"dflash-serve: {len(pending)} worker(s) still loading after "
                f"{time.monotonic() - start:.0f}s: {', '.join(w.url for w in pending)}",
                flush=True,
            )
        for worker in list(pending):
            if worker.process.poll() is not None:
                raise RuntimeError(f"worker {worker.url} exited with {worker.process.returncode}")
            if healthy(f"{worker.url}/health"):
                pending.remove(worker)
        if pending and time.monotonic() > deadline:
            raise TimeoutError(
                f"workers not healthy after {timeout:.0f}s: {[w.url for w in pending]}"
            )
        if pending:
            time.sleep(0.25)


def stop_workers(workers: Sequence[WorkerProcess], timeout: float = 15.0) -> None:
    stop_all([worker.process for worker in workers], timeout)


@contextlib.contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """During startup SIGTERM must unwind through `finally` (and stop the workers)."""

    def raise_exit(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, raise_exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def gateway_settings(
    gateway: LocalGateway,
    urls: Mapping[str, list[str]],
    log_level: str,
    worker_env: Mapping[str, str],
    api_keys: Sequence[str] = (),
    api_key_file: str | None = None,
    capture_uri: str | None = None,
) -> GatewaySettings:
    """The gateway over `gateway.pools`, whose workers are `urls[pool name]`."""
    # The pool's own fields as it gave them: a weight left out stays unset (a promotion
    # refuses one that is set).
    shared = ("model", "weight", "capture", "promotion")
    pools = [
        PoolSpec(
            name=p.name,
            engine=p.engine,  # always: a local pool's default (embedded) is not the gateway's
            workers=urls[p.name],
            **{key: getattr(p, key) for key in shared if key in p.model_fields_set},
        )
        for p in gateway.pools
    ]
    # Env (DFLASH_GATEWAY_*) still applies to everything not decided here.
    fixed: dict[str, Any] = {"host": "127.0.0.1", "port": gateway.port, "pools": pools}
    fixed.update(log_level=log_level, drain_timeout_s=10)
    if api_keys:
        fixed["api_keys"] = list(api_keys)
    if api_key_file is not None:
        fixed["api_key_file"] = api_key_file
    if capture_uri is not None:
        fixed["capture_uri"] = capture_uri
    keep_alive = worker_env.get("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "")
    if "DFLASH_GATEWAY_UPSTREAM_KEEPALIVE_S" not in os.environ and keep_alive.isdigit():
        # (a malformed value is the workers' to report: they refuse to start)
        fixed["upstream_keepalive_s"] = max(0.5, int(keep_alive) - 1.0)
    return GatewaySettings(**fixed)


def announce(gateways: Sequence[LocalGateway]) -> None:
    for gateway in gateways:
        several = len(gateway.pools) > 1
        for pool in gateway.pools:
            kind = "DFlash speculative" if pool.speculation else "plain"
            model = pool.model or "as served"
            share = f", model {model}, weight {pool.weight:g}" if several else ""
            print(
                f"dflash-serve: {pool.name} ({kind} decoding, {pool.workers} {pool.engine} "
                f"worker(s){share}) OpenAI base URL: {gateway.base_url}",
                flush=True,
            )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.workers is not None and args.workers < 1:
        print("dflash-serve: --workers must be at least 1", file=sys.stderr)
        return 2
    try:
        gateways = plan(args)
    except ValueError as exc:
        print(f"dflash-serve: {exc}", file=sys.stderr)
        return 2
    if args.api_key_file is not None:  # before minutes of worker start-up, not after
        keys = GatewaySettings(api_key_file=args.api_key_file, api_keys=args.api_key)
        problem = key_file_problem(keys)
        if problem is not None:
            print(f"dflash-serve: {problem}", file=sys.stderr)
            return 2
    capture = dataset_problem(str(Path(args.capture).resolve())) if args.capture else None
    if capture is not None:
        print(f"dflash-serve: --capture: {capture}", file=sys.stderr)
        return 2
    configure_logging(args.log_level)
    env = worker_env()
    pools = [pool for gateway in gateways for pool in gateway.pools]
    total = sum(pool.workers for pool in pools)
    started: list[WorkerProcess] = []
    try:
        with sigterm_as_exit():
            urls: dict[str, list[str]] = {}
            ports = iter(worker_ports(args.worker_port, total))
            for pool in pools:
                threads = shared_threads(pool, total, len(os.sched_getaffinity(0)))
                procs = [start_worker(pool, env, next(ports), threads) for _ in range(pool.workers)]
                started += procs
                urls[pool.name] = [w.url for w in procs]
            wait_ready(started, args.startup_timeout)
            servers = [
                GatewayServer(
                    gateway_settings(
                        g,
                        urls,
                        args.log_level,
                        env,
                        args.api_key,
                        args.api_key_file,
                        str(Path(args.capture).resolve()) if args.capture else None,
                    )
                )
                for g in gateways
            ]
            for server in servers:  # DFLASH_GATEWAY_LOG_LEVELS, read with the rest of env
                set_log_levels(server.settings.log_levels)
        run_servers(servers, on_started=lambda: announce(gateways))
    except (RuntimeError, TimeoutError) as exc:
        print(f"dflash-serve: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        stop_workers(started)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
