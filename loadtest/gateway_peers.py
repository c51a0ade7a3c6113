"""`dflash-bench gateway --peers`: the gateway side by side with other proxies, on the same stub
upstream, with the same load generator, in interleaved rounds.

Peers: `dflash-gateway` (one process), nginx (the Debian package: `scripts/install-tools.sh`),
vllm-router (PyPI, a Rust router: `scripts/install-vllm-router.sh`), optionally LiteLLM's
proxy (`--litellm`; PyPI: `scripts/install-litellm-proxy.sh`), a second gateway from
another source tree (`--baseline-src`, e.g. a checkout of main) to compare a change, and the
gateway configured with pools (`--pools`: routing by model, then by weight, on every
request), and with API keys, then tenants' limits counted in the process and in Redis
(`--limits`: every limit set, none reached, so every request is checked and charged), Redis
reached over TCP and over TLS, by the gateway's own client and, for the record, by redis-py's
asyncio client (loadtest/redispy_gateway.py), and tracing 1 % and 100 % of requests into a
local OTLP sink (`--tracing`, loadtest/otlp_sink.py), and capturing every request into a folder
(`--capture`, docs/capture.md: also into a store that is down, and by tenant: one gateway
whose load comes with a captured tenant's key or with either of two other tenants' keys,
so that capture is read against no capture, and no capture against itself, in one process;
`--capture-only` runs that gateway alone); the cost of tracing and capture over the gateway
without them is printed after the table (capture's over both uncaptured tenants' mean), and
the capture writer's own CPU: per sample written, and read around each tenant's phases, per
unary request and per stream (`by_the_writer_alone`: capture's cost without the phases' noise).
The stub answers each unary request with 64 x's, or with `--reply-chars N` a new passage of
N characters of prose each time (what capture parses and compresses on real answers).
A peer that is not installed is reported as missing, with why, and skipped.

Every proxy is pinned to the same core (`--proxy-cpu`), the stub and the load generator to
others (`--aux-cpus`); each round runs every phase against every proxy in turn, in an order
that changes each round (`round_order`), so that the machine's load (shared, noisy), a
proxy's place in the round and the proxy before it weigh on all of them alike. Per proxy:
- CPU µs per unary request: the proxy's CPU time (all its processes) over a closed loop of
  `--concurrency` clients, divided by the requests completed; and those requests/s (a
  capturing gateway's CPU is read 1.5 s after the loop: its writer's work on the phase's
  samples is counted);
- streams: the same for SSE streams of `--events` events (CPU µs per stream and per event),
  and completed streams/s (new streams/s the proxy sustains);
- burst: `--burst` streams opened at once on fresh connections: time to first byte, minus the
  same burst sent to the stub directly (added TTFT p50/p99). The first burst after the
  warm-up is reported apart ("first burst"): a proxy then opens most of its upstream
  connections (the warm-up keeps only a few), which the steady-state rounds do not measure;
- RSS after the run.
Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher.processes import cpu_seconds, free_port, rss_mib, stop, wait_healthy
from loadtest.gateway_bench import (
    BENCH_KEY,
    RawClient,
    Sample,
    body,
    closed_loop,
    without_collector,
    write_report,
)
from loadtest.harness import aligned, percentile, pinned, round_order
from wire.http import package_version

ROOT = Path(__file__).resolve().parent.parent
NGINX = "/usr/sbin/nginx"
ROUTER = ROOT / ".tools" / "vllm-router" / "bin" / "vllm-router"
LITELLM = ROOT / ".tools" / "litellm-proxy" / "bin" / "litellm"
REDIS = shutil.which("redis-server") or "/usr/bin/redis-server"
# One model routed to the stub as an OpenAI-compatible server; request fields it does not
# know (the stub's bench_gap_ms) pass through to it.
LITELLM_CONF = """
model_list:
  - model_name: stub
    litellm_params:
      model: openai/stub
      api_base: http://127.0.0.1:{upstream}/v1
      api_key: none
"""
NGINX_CONF = """
worker_processes 1;
daemon off;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 8192; }}
http {{
  access_log off;
  client_body_temp_path {dir};
  proxy_temp_path {dir};
  # nginx closes a keep-alive connection after 1000 requests by default; a load generator
  # whose request was in flight on it then counts an error that is not the proxy's.
  keepalive_requests 10000000;
  upstream stub {{ server 127.0.0.1:{upstream}; keepalive 256; keepalive_requests 10000000; }}
  server {{
    listen 127.0.0.1:{port} backlog=4096;
    location / {{
      proxy_pass http://stub;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
    }}
  }}
}}
"""


# A capturing gateway writes a shard at least a second after its first sample (the bench's
# `capture_flush_s`), the writer looking every quarter second: this long after a phase,
# the phase's samples are written and their CPU counted.
SETTLE_S = 1.5
# Capture by tenant, on the one process (tenant_capture_peers).
TENANT_OFF = "dflash-gateway (tenants, not captured)"
TENANT_ON = "dflash-gateway (tenants, captured)"
TENANT_OFF_TOO = "dflash-gateway (tenants, not captured, A/A)"
NOT_CAPTURED_KEY, NOT_CAPTURED_KEY_TOO = "sk-bench-not-captured", "sk-bench-not-captured-too"


@dataclass
class Peer:
    name: str
    port: int
    process: subprocess.Popen[bytes]
    ready_path: str
    # Processes the peer needs and that go with it (a Redis); not counted in its CPU.
    companions: list[subprocess.Popen[bytes]] = field(default_factory=list)
    key: str = BENCH_KEY  # the load's API key (a gateway with tenants: whose traffic it is)
    # Seconds after each timed phase that still count as its CPU: a capturing gateway's
    # writer works on a phase's samples up to a shard's flush after its last request.
    settle_s: float = 0.0
    captures: bool = False  # a gateway that captures: its samples are counted after the run
    # Its process's capture writer CPU is read around each phase (all three tenants of the
    # capturing process alike: a reading costs the gateway a /metrics render).
    reads_writer: bool = False


@dataclass
class PeerResult:
    unary: Sample = field(default_factory=Sample)
    unary_cpu_s: float = 0.0
    stream: Sample = field(default_factory=Sample)
    stream_cpu_s: float = 0.0
    # The capture writer thread's share of the phases' CPU (reads_writer peers).
    unary_writer_s: float = 0.0
    stream_writer_s: float = 0.0
    burst: Sample = field(default_factory=Sample)
    first_burst: Sample = field(default_factory=Sample)  # opens the upstream connections
    warmup: Sample = field(default_factory=Sample)
    rss_mb: float | None = None
    # After each round: memory that plateaus (bounded) or climbs (a leak, an unbounded queue).
    rss_mb_by_round: list[float] = field(default_factory=list)
    store_errors: float | None = None  # a gateway with a ledger: its calls that failed


def store_errors(port: int) -> float | None:
    """dflash_rate_limit_store_errors_total of a gateway (None: not a gateway). A ledger that
    failed would serve open and look cheap: its row would measure nothing."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
            text = answer.read().decode()
    except OSError:
        return None
    name = "dflash_rate_limit_store_errors_total{"
    found = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name)]
    return sum(found) if found else None


def missing_peers(args: argparse.Namespace) -> dict[str, str]:
    why: dict[str, str] = {}
    if not shutil.which("taskset"):
        why["pinning"] = "taskset (util-linux) not found: proxies run unpinned"
    if args.capture_only:  # no other peer is run
        return why
    if not Path(NGINX).is_file():
        why["nginx"] = f"{NGINX} not found: run scripts/install-tools.sh (Debian package nginx)"
    if not ROUTER.is_file():
        why["vllm-router"] = f"{ROUTER} not found: run scripts/install-vllm-router.sh"
    if args.litellm and not LITELLM.is_file():
        why["litellm"] = f"{LITELLM} not found: run scripts/install-litellm-proxy.sh"
    if args.limits and not Path(REDIS).is_file():
        why["redis-server"] = "not found: run scripts/install-tools.sh (Debian package)"
    return why


def peer_versions(peers: list[Peer]) -> dict[str, str]:
    """The version of each peer that ran, as the peer itself reports it."""

    def venv_package(binary: Path, package: str) -> str:
        code = f"import importlib.metadata as m; print(m.version({package!r}))"
        done = subprocess.run(
            [str(binary.parent / "python"), "-c", code], capture_output=True, text=True
        )
        return done.stdout.strip() or "unknown"

    versions: dict[str, str] = {}
    for peer in peers:
        if peer.name == "nginx":
            done = subprocess.run([NGINX, "-v"], capture_output=True, text=True)
            versions[peer.name] = done.stderr.strip().rsplit("/", 1)[-1] or "unknown"
        elif peer.name == "vllm-router":
            versions[peer.name] = venv_package(ROUTER, "vllm-router")
        elif peer.name == "litellm":
            versions[peer.name] = venv_package(LITELLM, "litellm")
        else:
            versions[peer.name] = package_version()
    return versions


def start_gateway(
    port: int,
    upstream: int,
    extra: list[str],
    cpus: str | None,
    src: Path = ROOT,
    pools: Path | None = None,
    settings: dict[str, str] | None = None,
    module: str = "service.cli",
    env_extra: dict[str, str] | None = None,
    log: Path | None = None,
) -> subprocess.Popen[bytes]:
    """`dflash-gateway` from source tree `src` in front of the stub, without API keys (unless
    `settings`, DFLASH_GATEWAY_* values, give some); with `pools`, configured by that pools
    file instead of one --worker; with `log`, its output appended to that file."""
    # The stub shares its core with the load generator: under a closed loop its /health can
    # take longer than the default 1 s, and a gateway would then mark it down (503s that
    # measure the bench, not the proxy); nginx has no active checks to trip.
    # Idle upstream connections are reused for 60 s, as nginx's `keepalive` does by default
    # (keepalive_timeout 60s): the stub never closes them, so the
    # gateway's default (4 s, below a real worker's 5 s idle close) would make every burst
    # open fresh connections where the peers reuse warm ones.
    env = {
        **os.environ,
        "DFLASH_GATEWAY_API_KEYS": "",
        "DFLASH_GATEWAY_HEALTH_TIMEOUT_S": "5",
        "DFLASH_GATEWAY_UPSTREAM_KEEPALIVE_S": "60",
        "PYTHONPATH": str(src),
    }
    env.pop("DFLASH_GATEWAY_API_KEY_FILE", None)
    env.update(env_extra or {})  # OTEL_* (--tracing), a store's client (--capture)
    for name, value in (settings or {}).items():
        env[f"DFLASH_GATEWAY_{name.upper()}"] = value
    argv = [sys.executable, "-m", module, "--port", str(port)]
    argv += ["--pools", str(pools)] if pools else ["--worker", f"http://127.0.0.1:{upstream}"]
    argv += ["--log-level", "warning", *extra]
    if log is None:
        return subprocess.Popen(pinned(cpus, argv), env=env, cwd=src)
    with log.open("ab") as out:  # the child holds its own descriptor
        return subprocess.Popen(pinned(cpus, argv), env=env, cwd=src, stdout=out, stderr=out)


def start_peers(
    args: argparse.Namespace, upstream: int, workdir: Path, missing: dict[str, str]
) -> list[Peer]:
    if args.capture_only:  # the capture goal's reading alone: more rounds in the same time
        return tenant_capture_peers(args, upstream, workdir)
    peers: list[Peer] = []
    sources = [("dflash-gateway", ROOT)]
    if args.baseline_src is not None:
        sources.append(("dflash-gateway@baseline", args.baseline_src.resolve()))
    for name, src in sources:
        port = free_port()
        process = start_gateway(port, upstream, [], args.proxy_cpu, src)
        peers.append(Peer(name, port, process, "/ready"))
    if args.pools:
        port, pools = free_port(), workdir / "pools.yaml"
        pools.write_text(json.dumps(canary_pools(upstream)))
        process = start_gateway(port, upstream, [], args.proxy_cpu, ROOT, pools)
        peers.append(Peer("dflash-gateway (pools)", port, process, "/ready"))
    if args.limits:
        peers += limit_peers(args, upstream, workdir, missing)
    if args.tracing:
        peers += tracing_peers(args, upstream)
    if args.capture:
        peers += capture_peers(args, upstream, workdir)
    if "nginx" not in missing:
        port = free_port()
        conf = workdir / "nginx.conf"
        conf.write_text(NGINX_CONF.format(dir=workdir, upstream=upstream, port=port))
        argv = [NGINX, "-c", str(conf), "-p", str(workdir)]
        process = subprocess.Popen(pinned(args.proxy_cpu, argv), stderr=subprocess.DEVNULL)
        peers.append(Peer("nginx", port, process, "/health"))
    if "vllm-router" not in missing:
        port = free_port()
        worker = f"http://127.0.0.1:{upstream}"
        argv = [str(ROUTER), "--host", "127.0.0.1", "--port", str(port), "--worker-urls", worker]
        argv += ["--policy", "round_robin", "--log-level", "warning"]
        argv += ["--prometheus-port", str(free_port())]
        process = subprocess.Popen(
            pinned(args.proxy_cpu, argv), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        peers.append(Peer("vllm-router", port, process, "/health"))
    if args.litellm and "litellm" not in missing:
        peers.append(start_litellm(args, upstream, workdir))
    return peers


def limit_peers(
    args: argparse.Namespace, upstream: int, workdir: Path, missing: dict[str, str]
) -> list[Peer]:
    """The gateway with the load's key and no limits, then with every limit of a tenant set
    (never reached) counted in the process, then in Redis (a redis-server of its own on the
    stub's cores)."""
    keys = workdir / "tenants.yaml"
    keys.write_text(json.dumps({"tenants": [{"name": "bench", "keys": [BENCH_KEY], **NO_REACH}]}))
    variants: list[tuple[str, dict[str, str]]] = [
        ("dflash-gateway (keys)", {"api_keys": BENCH_KEY}),
        ("dflash-gateway (limits)", {"api_key_file": str(keys)}),
    ]
    redis = None
    if "redis-server" not in missing:
        redis, shared = start_redis(args, workdir)
        variants += [
            (f"dflash-gateway (limits, {name})", {**settings, "api_key_file": str(keys)})
            for name, settings in shared.items()
        ]
    peers = []
    for name, settings in variants:
        port = free_port()
        module = "loadtest.redispy_gateway" if "redis-py" in name else "service.cli"
        process = start_gateway(
            port, upstream, [], args.proxy_cpu, settings=settings, module=module
        )
        peers.append(Peer(name, port, process, "/ready"))
    if redis is not None:
        peers[-1].companions.append(redis)
    return peers


def start_redis(
    args: argparse.Namespace, workdir: Path
) -> tuple[subprocess.Popen[bytes], dict[str, dict[str, str]]]:
    """One redis-server on the stub's cores, listening on TCP and on TLS (a certificate for
    127.0.0.1 made by `openssl`), and the gateway settings of each way to reach it: the lean
    client and redis-py's asyncio client, each over TCP and over TLS."""
    cert, key = workdir / "redis.crt", workdir / "redis.key"
    openssl = ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt"]
    openssl += ["ec_paramgen_curve:prime256v1", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1"]
    openssl += ["-keyout", str(key), "-out", str(cert), "-addext", "subjectAltName=IP:127.0.0.1"]
    subprocess.run(openssl, check=True, capture_output=True)
    plain, tls = free_port(), free_port()
    argv = [REDIS, "--port", str(plain), "--bind", "127.0.0.1", "--save", ""]
    argv += ["--appendonly", "no", "--dir", str(workdir), "--tls-port", str(tls)]
    argv += ["--tls-cert-file", str(cert), "--tls-key-file", str(key)]
    argv += ["--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no"]
    redis = subprocess.Popen(pinned(args.aux_cpus, argv), stdout=subprocess.DEVNULL)
    # A deadline no call misses on a loaded machine: a missed one is served open, unmeasured
    # (the rows' store_errors say that none was).
    deadline = {"rate_limit_deadline_s": "5"}
    over_tcp = {"redis_url": f"redis://127.0.0.1:{plain}/0", **deadline}
    over_tls = {"redis_url": f"rediss://127.0.0.1:{tls}/0", "redis_tls_ca_file": str(cert)}
    over_tls |= deadline
    shared = {"redis": over_tcp, "rediss": over_tls}
    shared |= {"redis-py": over_tcp, "redis-py, rediss": over_tls}
    return redis, shared


def tracing_peers(args: argparse.Namespace, upstream: int) -> list[Peer]:
    """The gateway tracing 1 % and 100 % of requests into a local OTLP/gRPC sink
    (loadtest/otlp_sink.py, on the stub's cores): beside the plain gateway (tracing off)."""
    sink_port = free_port()
    argv = [sys.executable, "-m", "loadtest.otlp_sink", "--port", str(sink_port)]
    sink = subprocess.Popen(pinned(args.aux_cpus, argv), cwd=ROOT)
    peers = []
    for name, sampler, ratio in (("1%", "traceidratio", "0.01"), ("100%", "always_on", "1")):
        otel = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{sink_port}",
            "OTEL_TRACES_SAMPLER": sampler,
            "OTEL_TRACES_SAMPLER_ARG": ratio,
        }
        port = free_port()
        process = start_gateway(port, upstream, [], args.proxy_cpu, env_extra=otel)
        peers.append(Peer(f"dflash-gateway (tracing {name})", port, process, "/ready"))
    peers[-1].companions.append(sink)
    return peers


def capture_peers(args: argparse.Namespace, upstream: int, workdir: Path) -> list[Peer]:
    """The gateway capturing every request into a local folder (docs/capture.md); and one
    capturing into an S3 store that is down for the whole run (nothing listens at its
    endpoint): it must serve every request with its memory bounded, counting the drops."""
    # A shard a second (the default is a minute): the run's samples are written, and counted,
    # before it ends; more writes than production makes, so the cost is not understated.
    port = free_port()
    settings = {"capture_uri": str(workdir / "capture"), "capture_flush_s": "1"}
    process = start_gateway(port, upstream, [], args.proxy_cpu, settings=settings)
    name = "dflash-gateway (capture)"
    peers = [Peer(name, port, process, "/ready", settle_s=SETTLE_S, captures=True)]
    down = {
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{free_port()}",
    }
    port = free_port()
    settings = {"capture_uri": "s3://bench/capture", "capture_flush_s": "1"}
    process = start_gateway(port, upstream, [], args.proxy_cpu, settings=settings, env_extra=down)
    name = "dflash-gateway (capture, store down)"
    peers.append(Peer(name, port, process, "/ready", settle_s=SETTLE_S, captures=True))
    return peers + tenant_capture_peers(args, upstream, workdir)


def tenant_capture_peers(args: argparse.Namespace, upstream: int, workdir: Path) -> list[Peer]:
    """One gateway capturing by tenant: the load's key belongs to a tenant with `capture:
    true`, two other keys to tenants without. Three peers on the one process, each sending
    with its key, so capture on is compared with capture off in the same process (two
    gateway processes of the same code read up to 7 % apart per request: the A/A of
    `--baseline-src`), and off with off as this comparison's own A/A."""
    keys = workdir / "capture-tenants.yaml"
    tenants = [
        {"name": "captured", "keys": [BENCH_KEY], "capture": True},
        {"name": "not-captured", "keys": [NOT_CAPTURED_KEY]},
        {"name": "not-captured-too", "keys": [NOT_CAPTURED_KEY_TOO]},
    ]
    keys.write_text(json.dumps({"tenants": tenants}))
    settings = {
        "capture_uri": str(workdir / "capture-by-tenant"),
        "capture_flush_s": "1",
        "api_key_file": str(keys),
    }
    port = free_port()
    process = start_gateway(port, upstream, [], args.proxy_cpu, settings=settings)

    # Every phase alike: an off phase must not absorb an on phase's work, nor be read
    # differently.
    def tenant(name: str, key: str, captures: bool = False) -> Peer:
        return Peer(
            name,
            port,
            process,
            "/ready",
            key=key,
            settle_s=SETTLE_S,
            captures=captures,
            reads_writer=True,
        )

    return [
        tenant(TENANT_OFF, NOT_CAPTURED_KEY),
        tenant(TENANT_ON, BENCH_KEY, captures=True),
        tenant(TENANT_OFF_TOO, NOT_CAPTURED_KEY_TOO),
    ]


def settled_outcomes(port: int, served: int, timeout_s: float = 30.0) -> dict[str, float]:
    """dflash_capture_samples_total by outcome once every request served is counted (the
    last samples wait for a shard's flush, a store that is down for its client's retries),
    or as it stands after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    found = capture_outcomes(port)
    while sum(found.values()) < served and time.monotonic() < deadline:
        time.sleep(0.25)
        found = capture_outcomes(port)
    return found


def capture_outcomes(port: int) -> dict[str, float]:
    """dflash_capture_samples_total by outcome."""
    found: dict[str, float] = {}
    for line in capture_series(port):
        if line.startswith("dflash_capture_samples_total{"):
            outcome = line.split('outcome="', 1)[1].split('"', 1)[0]
            found[outcome] = float(line.rsplit(" ", 1)[1])
    return found


def writer_us_per_sample(port: int, written: float) -> float | None:
    """The capture writer thread's CPU over the samples it wrote, in µs: its share of what
    capture costs, without the event loop's (read beside the per-request ratio, which holds
    both and the phases' noise)."""
    cpu_s = writer_cpu_s(port)
    return round(cpu_s * 1e6 / written, 2) if written and cpu_s is not None else None


def writer_cpu_s(port: int) -> float | None:
    """dflash_capture_writer_cpu_seconds_total (None: the gateway does not capture)."""
    for line in capture_series(port):
        if line.startswith("dflash_capture_writer_cpu_seconds_total "):
            return float(line.rsplit(" ", 1)[1])
    return None


def capture_series(port: int) -> list[str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
        return [line for line in answer.read().decode().splitlines() if "dflash_capture" in line]


# The variants of the gateway whose CPU cost is read against a gateway without it: (reading,
# variant, the base's arms (their mean is the base), the most the variant may cost as x of
# the base's CPU per request and per stream, or None: read, no goal). Capture's goal is read
# in one process (capture by tenant): two gateway processes of the same code read
# 0.96-1.07x each other per request (RESULTS), wider than the goal's margin; the two
# processes' reading is kept beside it.
COST_READINGS: tuple[tuple[str, str, tuple[str, ...], float | None], ...] = (
    ("tracing 1%", "dflash-gateway (tracing 1%)", ("dflash-gateway",), 1.10),
    ("tracing 100%", "dflash-gateway (tracing 100%)", ("dflash-gateway",), 1.35),
    ("capture, another process", "dflash-gateway (capture)", ("dflash-gateway",), None),
    # Against both uncaptured tenants: two arms of the same base halve its variance (their
    # A/A read 0.95-1.16x each other per unary request in single runs, 2026-12-01).
    ("capture", TENANT_ON, (TENANT_OFF, TENANT_OFF_TOO), 1.10),
    ("capture, against one tenant", TENANT_ON, (TENANT_OFF,), None),
    ("capture's A/A", TENANT_OFF_TOO, (TENANT_OFF,), None),
)


def cost_over_plain(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """CPU per unary request and per stream of each gateway variant (tracing, capture) over
    the gateway without it (the mean of its arms), measured in the same rounds."""
    by = {r["proxy"]: r for r in rows}
    out: dict[str, Any] = {}
    for name, variant_name, base_names, goal in COST_READINGS:
        variant, arms = by.get(variant_name), [by.get(arm) for arm in base_names]
        if variant is None or any(arm is None for arm in arms):
            continue
        base = {
            key: sum(arm[key] for arm in arms if arm is not None) / len(arms)
            for key in ("unary_cpu_us_per_request", "stream_cpu_us_per_stream")
        }
        ratios = {
            key: round(variant[key] / base[key], 3) if base[key] else None
            for key in ("unary_cpu_us_per_request", "stream_cpu_us_per_stream")
        }
        out[name] = ratios
        if goal is not None:
            met = all(r is not None and r <= goal for r in ratios.values())
            out[name] = {**ratios, "goal": goal, "met": met}
        writer = writer_share(variant, base)
        if writer is not None:
            out[name]["by_the_writer_alone"] = writer
    return out


def writer_share(variant: dict[str, Any], base: dict[str, Any]) -> dict[str, float] | None:
    """The base's CPU plus the variant's capture writer thread's, over the base's, per unary
    request and per stream: capture's cost as the writer's own CPU reads it (to the
    nanosecond, without the phases' noise), leaving out the event loop's part (a record and
    a queue append a request)."""
    shares = {}
    for key, writer_key in (
        ("unary_cpu_us_per_request", "unary_writer_cpu_us_per_request"),
        ("stream_cpu_us_per_stream", "stream_writer_cpu_us_per_stream"),
    ):
        writer_us = variant.get(writer_key)
        if writer_us is None or not base[key]:
            return None
        shares[key] = round(1 + writer_us / base[key], 3)
    return shares


# Limits no bench run reaches: every check runs, nothing is refused.
NO_REACH = {
    "requests_per_minute": 10**12,
    "tokens_per_minute": 10**15,
    "concurrent_requests": 10**6,
    "tokens_per_month": 10**18,
}


def canary_pools(upstream: int) -> list[dict[str, Any]]:
    """The stub's model split 90/10 between two pools (the same stub under two URLs), and a
    second model's pool: routing by model, then by weight, on every request."""
    return [
        {
            "name": "main",
            "model": "stub",
            "weight": 90,
            "workers": [f"http://127.0.0.1:{upstream}"],
        },
        {
            "name": "canary",
            "model": "stub",
            "weight": 10,
            "workers": [f"http://localhost:{upstream}"],
        },
        {"name": "other", "model": "other", "workers": [f"http://127.0.0.1:{upstream}/v2"]},
    ]


def start_litellm(args: argparse.Namespace, upstream: int, workdir: Path) -> Peer:
    port = free_port()
    conf = workdir / "litellm.yaml"
    conf.write_text(LITELLM_CONF.format(upstream=upstream))
    env = {
        **os.environ,
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # offline: no price-map download at start
        # No master key: the bench's clients send none, as they do to the other peers.
        "LITELLM_DANGEROUSLY_PERMIT_WEAK_OR_UNSET_MASTER_KEY": "true",
    }
    argv = [str(LITELLM), "--config", str(conf), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--num_workers", "1"]
    process = subprocess.Popen(
        pinned(args.proxy_cpu, argv), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    return Peer("litellm", port, process, "/health/liveliness")


async def burst(port: int, count: int, payload: bytes, key: str = BENCH_KEY) -> Sample:
    """`count` streams at once, each on a new connection: time to first byte of each."""
    sample = Sample()

    async def one() -> None:
        client = RawClient(port, key)
        start = time.perf_counter()
        first: list[float] = []

        def on_chunk(_: bytes) -> None:
            if not first:
                first.append(time.perf_counter())

        try:
            status = await client.post("/v1/chat/completions", payload, on_chunk)
        except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
            sample.error(type(exc).__name__)
            return
        finally:
            client.close()
        if status != 200 or not first:
            sample.error(f"HTTP {status}")
            return
        sample.completed += 1
        sample.latencies_s.append(first[0] - start)

    start = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(count)))
    sample.elapsed_s = time.perf_counter() - start
    return sample


def merge(into: Sample, part: Sample) -> None:
    into.latencies_s += part.latencies_s
    into.errors += part.errors
    for kind, count in part.error_kinds.items():
        into.error_kinds[kind] = into.error_kinds.get(kind, 0) + count
    into.completed += part.completed
    into.elapsed_s += part.elapsed_s


async def one_round(
    args: argparse.Namespace, peers: list[Peer], results: dict[str, PeerResult], stub: int
) -> None:
    unary, stream = body(False), body(True, args.stream_gap_ms)
    for peer in peers:
        result = results[peer.name]
        before, writer_before = cpu_seconds(peer.process.pid), phase_writer_s(peer)
        unary_loop = closed_loop(peer.port, unary, args.concurrency, args.duration, False, peer.key)
        part = await without_collector(unary_loop)
        await asyncio.sleep(peer.settle_s)
        result.unary_writer_s += phase_writer_s(peer) - writer_before
        result.unary_cpu_s += cpu_seconds(peer.process.pid) - before
        merge(result.unary, part)
        before, writer_before = cpu_seconds(peer.process.pid), phase_writer_s(peer)
        stream_loop = closed_loop(
            peer.port, stream, args.concurrency, args.duration, True, peer.key
        )
        part = await without_collector(stream_loop)
        await asyncio.sleep(peer.settle_s)
        result.stream_writer_s += phase_writer_s(peer) - writer_before
        result.stream_cpu_s += cpu_seconds(peer.process.pid) - before
        merge(result.stream, part)
    await bursts(args, peers, results, stub, first=False)
    for peer in peers:
        results[peer.name].rss_mb_by_round.append(rss_mib(peer.process.pid))


def phase_writer_s(peer: Peer) -> float:
    """The writer's CPU so far, read inside the phase's CPU reading (so all three tenants'
    phases hold one render of /metrics each side); 0 where it is not read."""
    return (writer_cpu_s(peer.port) or 0.0) if peer.reads_writer else 0.0


async def bursts(
    args: argparse.Namespace,
    peers: list[Peer],
    results: dict[str, PeerResult],
    stub: int,
    *,
    first: bool,
) -> None:
    """Each proxy's burst right after one sent to the stub directly."""
    burst_body = body(True, args.burst_gap_ms)
    for peer in peers:
        peer_result, direct_result = results[peer.name], results[f"direct:{peer.name}"]
        direct = await without_collector(burst(stub, args.burst, burst_body))
        merge(direct_result.first_burst if first else direct_result.burst, direct)
        await asyncio.sleep(0.2)  # let a burst's connections close before the next
        part = await without_collector(burst(peer.port, args.burst, burst_body, peer.key))
        merge(peer_result.first_burst if first else peer_result.burst, part)
        await asyncio.sleep(0.2)


def ms(values: list[float], q: float) -> float | None:
    value = percentile(values, q)
    return None if value is None else round(value * 1000, 2)


def quantiles_ms(sample: Sample) -> dict[str, float | None]:
    return {"p50": ms(sample.latencies_s, 50), "p99": ms(sample.latencies_s, 99)}


def added_ms(through: Sample, direct: Sample) -> dict[str, float | None]:
    """Time to first byte through the proxy minus straight to the stub, at p50 and p99."""
    added: dict[str, float | None] = {}
    for name, q in (("p50", 50), ("p99", 99)):
        a, b = ms(through.latencies_s, q), ms(direct.latencies_s, q)
        added[name] = None if a is None or b is None else round(a - b, 2)
    return added


def row(
    name: str, result: PeerResult, direct: PeerResult, events: int, reads_writer: bool
) -> dict[str, Any]:
    unary_us = result.unary_cpu_s / result.unary.completed * 1e6 if result.unary.completed else 0
    stream_us = (
        result.stream_cpu_s / result.stream.completed * 1e6 if result.stream.completed else 0
    )

    def writer_us(cpu_s: float, sample: Sample) -> float | None:
        """Of which the capture writer thread (a gateway whose writer is read)."""
        return (
            round(cpu_s / sample.completed * 1e6, 2) if reads_writer and sample.completed else None
        )

    return {
        "proxy": name,
        "unary_cpu_us_per_request": round(unary_us, 1),
        "unary_writer_cpu_us_per_request": writer_us(result.unary_writer_s, result.unary),
        "stream_writer_cpu_us_per_stream": writer_us(result.stream_writer_s, result.stream),
        "unary_requests_per_s": round(result.unary.completed / result.unary.elapsed_s, 1)
        if result.unary.elapsed_s
        else 0,
        "unary_errors": result.unary.errors,
        "stream_cpu_us_per_stream": round(stream_us, 1),
        "stream_cpu_us_per_event": round(stream_us / events, 2),
        "streams_per_s": round(result.stream.completed / result.stream.elapsed_s, 1)
        if result.stream.elapsed_s
        else 0,
        "stream_errors": result.stream.errors,
        "burst_ttft_ms": quantiles_ms(result.burst),
        "burst_direct_ttft_ms": quantiles_ms(direct.burst),
        "burst_added_ttft_ms": added_ms(result.burst, direct.burst),
        "first_burst_ttft_ms": quantiles_ms(result.first_burst),
        "first_burst_direct_ttft_ms": quantiles_ms(direct.first_burst),
        "first_burst_added_ttft_ms": added_ms(result.first_burst, direct.first_burst),
        "burst_errors": result.burst.errors + result.first_burst.errors,
        # every request answered 200, the warm-up's too (what a capturing gateway captured)
        "requests_served": sum(
            sample.completed
            for sample in (
                result.unary,
                result.stream,
                result.burst,
                result.first_burst,
                result.warmup,
            )
        ),
        "error_kinds": {
            phase: sample.error_kinds
            for phase, sample in (
                ("unary", result.unary),
                ("stream", result.stream),
                ("burst", result.burst),
                ("first_burst", result.first_burst),
            )
            if sample.error_kinds
        },
        "rss_mb": result.rss_mb,
        "rss_mb_by_round": result.rss_mb_by_round,
        "store_errors": result.store_errors,
    }


def table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    head = (
        "proxy",
        "CPU µs/unary",
        f"req/s c={args.concurrency}",
        "CPU µs/stream",
        "CPU µs/event",
        "streams/s",
        f"burst {args.burst} added TTFT p50/p99 ms",
        "first burst added TTFT p50/p99 ms",
        "RSS MB by round",
        "errors",
        "store errors",
    )
    lines = [head]
    for r in rows:
        added, first = r["burst_added_ttft_ms"], r["first_burst_added_ttft_ms"]
        errors = r["unary_errors"] + r["stream_errors"] + r["burst_errors"]
        lines.append(
            (
                r["proxy"],
                str(r["unary_cpu_us_per_request"]),
                str(r["unary_requests_per_s"]),
                str(r["stream_cpu_us_per_stream"]),
                str(r["stream_cpu_us_per_event"]),
                str(r["streams_per_s"]),
                f"{added['p50']} / {added['p99']}",
                f"{first['p50']} / {first['p99']}",
                " / ".join(str(mb) for mb in r["rss_mb_by_round"] or [r["rss_mb"]]),
                str(errors),
                "-" if r["store_errors"] is None else str(int(r["store_errors"])),
            )
        )
    return aligned(lines, " | ")


@contextlib.contextmanager
def stub_process(events: int, cpus: str | None, reply_chars: int = 0) -> Iterator[int]:
    """The stub upstream (SSE streams of `events` events; JSON replies of `reply_chars` of
    prose, or `events` x's), pinned to `cpus` when given."""
    port = free_port()
    argv = [sys.executable, "-m", "loadtest.stub_upstream", "--port", str(port)]
    argv += ["--events", str(events), "--reply-chars", str(reply_chars)]
    process = subprocess.Popen(pinned(cpus, argv), cwd=ROOT)
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", process, 30.0, interval=0.1)
        yield port
    finally:
        stop(process)


async def run(args: argparse.Namespace, stub: int, peers: list[Peer]) -> list[dict[str, Any]]:
    results = {peer.name: PeerResult() for peer in peers}
    results.update({f"direct:{peer.name}": PeerResult() for peer in peers})
    for peer in peers:  # warm-up: connections, caches, lazy imports
        for stream in (False, True):
            part = await closed_loop(peer.port, body(stream), 8, args.warmup, stream, peer.key)
            merge(results[peer.name].warmup, part)
    await bursts(args, peers, results, stub, first=True)
    for number in range(args.rounds):
        # The proxies' order changes each round (`round_order`): what a proxy's place in
        # the round does to it (the machine's drift, the proxy before it) falls on all.
        await one_round(args, round_order(peers, number), results, stub)
    for peer in peers:
        results[peer.name].rss_mb = rss_mib(peer.process.pid)
        if peer.name.startswith("dflash-gateway"):
            results[peer.name].store_errors = store_errors(peer.port)
    return [
        row(
            peer.name,
            results[peer.name],
            results[f"direct:{peer.name}"],
            args.events,
            peer.reads_writer,
        )
        for peer in peers
    ]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dflash-bench gateway --peers", description=__doc__.split("\n")[0], allow_abbrev=False
    )
    p.add_argument("--peers", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--duration", type=float, default=3.0, help="seconds per phase, proxy, round")
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--events", type=int, default=64, help="SSE events per stream")
    p.add_argument(
        "--reply-chars",
        type=int,
        default=0,
        help="each unary reply N characters of prose, new each request (default: 64 x's)",
    )
    p.add_argument("--stream-gap-ms", type=float, default=0.0, help="event gap of the stream phase")
    p.add_argument("--burst", type=int, default=200, help="streams opened at once")
    p.add_argument("--burst-gap-ms", type=float, default=20.0, help="event gap in burst streams")
    p.add_argument("--proxy-cpu", default="1", help="core(s) every proxy is pinned to")
    p.add_argument("--aux-cpus", default="0", help="cores of the stub and the load generator")
    p.add_argument("--baseline-src", type=Path, help="also run the gateway from this tree")
    p.add_argument(
        "--pools",
        action="store_true",
        help="also the gateway with pools (two of the stub's model at 90/10, and another model)",
    )
    p.add_argument(
        "--limits",
        action="store_true",
        help="also the gateway with keys, and with tenants' limits (in the process, in Redis)",
    )
    p.add_argument(
        "--litellm", action="store_true", help="also LiteLLM's proxy (~7 ms of CPU per request)"
    )
    p.add_argument(
        "--tracing",
        action="store_true",
        help="also the gateway tracing 1%% and 100%% of requests into a local OTLP sink",
    )
    p.add_argument(
        "--capture",
        action="store_true",
        help="also the gateway capturing every request into a local folder (docs/capture.md)",
    )
    p.add_argument(
        "--capture-only",
        action="store_true",
        help="only the gateway capturing by tenant (the capture goal's reading and its A/A)",
    )
    p.add_argument("--out", type=Path, default=Path("bench-results/gateway-peers.json"))
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    missing = missing_peers(args)
    if shutil.which("taskset") and args.aux_cpus:
        os.sched_setaffinity(0, {int(c) for c in args.aux_cpus.split(",")})
    stub_upstream = stub_process(args.events, args.aux_cpus, args.reply_chars)
    with tempfile.TemporaryDirectory(prefix="dflash-peers-") as tmp, stub_upstream as stub:
        peers = start_peers(args, stub, Path(tmp), missing)
        try:
            for peer in peers:
                wait_healthy(
                    f"http://127.0.0.1:{peer.port}{peer.ready_path}", peer.process, 60, interval=0.1
                )
            rows = asyncio.run(run(args, stub, peers))
            versions = peer_versions(peers)
            served = {r["proxy"]: r["requests_served"] for r in rows}
            captured = {
                p.name: settled_outcomes(p.port, served[p.name]) for p in peers if p.captures
            }
            writer_us = {
                p.name: writer_us_per_sample(p.port, captured[p.name].get("written", 0))
                for p in peers
                if p.captures
            }
        finally:
            for peer in peers:
                for process in (peer.process, *peer.companions):
                    stop(process)  # a process some peers share: stopped once, waited on again
    print(table(rows, args))
    costs = cost_over_plain(rows)
    if costs:
        print(f"cost (x of the gateway's CPU without it): {json.dumps(costs)}")
    for name, outcomes in captured.items():
        print(f"{name}: samples {json.dumps(outcomes)}, writer µs a sample {writer_us[name]}")
    for name, why in missing.items():
        print(f"missing {name}: {why}")
    write_report(
        "gateway-peers",
        args,
        versions=versions,
        missing=missing,
        results=rows,
        costs=costs,
        capture=captured,
        capture_writer_us_per_sample=writer_us,
    )
    return 0
