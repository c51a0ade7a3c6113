"""`dflash-gateway` with redis-py's asyncio client in place of the lean one, for the record:
`dflash-bench gateway --peers --limits` runs it beside the gateway itself, so that a number
keeps justifying the hand-written client (service/tenancy/redis_client.py). Bench only: the gateway
never imports this.

    python -m loadtest.redispy_gateway <dflash-gateway arguments>
"""

from __future__ import annotations

import asyncio
import os
import ssl
import sys
from typing import Any

import redis.asyncio as aioredis
import redis.exceptions

import service.app
from service.cli import main as gateway_main
from service.tenancy.redis_client import RedisUnavailable, ReplyError, Script

POOL_SIZE = 64  # the bench's closed loop: one connection per client at most


class RedisPyClient:
    """What RedisLedger calls (evalsha, call, discard, close), on redis-py: its connection
    pool, its parser, its NOSCRIPT handling left to us as the lean client does it."""

    def __init__(
        self,
        url: str,
        *,
        deadline_s: float,
        retry_after_s: float = 1.0,
        password: str | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        options: dict[str, Any] = {"socket_timeout": deadline_s}
        if password is not None:
            options["password"] = password
        if tls is not None:  # redis-py takes files, not a context: the same CA, names checked
            options["ssl_ca_certs"] = os.environ.get("DFLASH_GATEWAY_REDIS_TLS_CA_FILE")
            options |= {"ssl_cert_reqs": "required", "ssl_check_hostname": True}
        # A bounded pool that waits for a free connection, as redis-py advises under
        # concurrency: its default pool refuses (MaxConnectionsError) past its size, and one
        # command holds one connection until its reply (no pipelining across callers).
        pool = aioredis.BlockingConnectionPool.from_url(
            url, max_connections=POOL_SIZE, timeout=deadline_s, **options
        )
        self.redis = aioredis.Redis(connection_pool=pool)
        self.deadline_s = deadline_s

    async def call(self, *args: Any) -> Any:
        try:
            command = self.redis.execute_command(*args)  # type: ignore[no-untyped-call]
            reply = await asyncio.wait_for(command, self.deadline_s)
        except redis.exceptions.ResponseError as exc:
            raise ReplyError(str(exc)) from None
        except (redis.exceptions.RedisError, OSError, TimeoutError) as exc:
            raise RedisUnavailable(repr(exc)) from None
        # redis-py reads HGETALL into a dict; the lean client returns RESP's flat list, which
        # the gateway's callers read (the promotion store's pins).
        if isinstance(reply, dict):
            return [item for pair in reply.items() for item in pair]
        return reply

    async def evalsha(self, script: Script, keys: list[str], args: list[Any]) -> Any:
        try:
            return await self.call(b"EVALSHA", script.sha, len(keys), *keys, *args)
        except ReplyError as exc:
            if not str(exc).startswith("No matching script"):
                raise
            await self.call(b"SCRIPT", b"LOAD", script.source)
            return await self.call(b"EVALSHA", script.sha, len(keys), *keys, *args)

    def discard(self, reason: BaseException) -> None:
        return None

    async def close(self) -> None:
        await self.redis.aclose()


def main() -> None:
    # The one name service.app builds the ledger's client with (service.app.ledger).
    setattr(service.app, "RedisClient", RedisPyClient)  # noqa: B010
    sys.exit(gateway_main(sys.argv[1:]))


if __name__ == "__main__":
    main()
