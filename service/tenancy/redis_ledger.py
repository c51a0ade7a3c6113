"""The usage ledger in Redis, shared by every gateway process and replica: one script call
admits (or refuses) a request, one charges it when it ends. The scripts apply
`ledger.refusal`'s rule atomically on Redis's own clock, so replicas agree on windows.

Keys of a tenant share the hash tag `{dflash:<tenant>}` (one cluster slot):
  r:<window> / t:<window>  requests admitted / tokens charged in a window (expire after two)
  mr:<month> / mt:<month>  requests / tokens of a calendar month (UTC; kept 40 days)
  c                        a sorted set of concurrency leases, scored by their expiry time
A lease expires by itself after `lease_s` (the gateway's request timeout and a margin), so a
gateway that dies with requests in flight does not hold its tenants' concurrency for ever.
"""

from __future__ import annotations

import time

from service.tenancy.ledger import Refusal, TenantUsage, Verdict, month_of
from service.tenancy.redis_client import RedisClient, Script
from service.tenancy.tenants import Limits, Tenant

MONTH_TTL_S = 40 * 24 * 3600
NO_LIMIT = -1

# ARGV: window_ms, month, lease_ms, lease, rpm, tpm, month quota, concurrency cap (-1: none).
# Returns {refused ("" when admitted), requests, tokens, month requests, month tokens,
# concurrent, ms until the window ends}.
ADMIT = Script(
    """
local p = KEYS[1]
local window_ms, month, lease_ms = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3])
local rpm, tpm, quota, cap = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7]),
  tonumber(ARGV[8])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local w = math.floor(now / window_ms)
local rk, tk = p .. 'r:' .. w, p .. 't:' .. w
local mrk, mtk, ck = p .. 'mr:' .. month, p .. 'mt:' .. month, p .. 'c'
local requests = tonumber(redis.call('GET', rk) or '0')
local tokens = tonumber(redis.call('GET', tk) or '0')
local month_requests = tonumber(redis.call('GET', mrk) or '0')
local month_tokens = tonumber(redis.call('GET', mtk) or '0')
redis.call('ZREMRANGEBYSCORE', ck, '-inf', now)
local concurrent = redis.call('ZCARD', ck)
local refused = ''
if rpm >= 0 and requests >= rpm then refused = 'requests'
elseif tpm >= 0 and tokens >= tpm then refused = 'tokens'
elseif quota >= 0 and month_tokens >= quota then refused = 'quota'
elseif cap >= 0 and concurrent >= cap then refused = 'concurrency' end
if refused == '' then
  requests = redis.call('INCR', rk)
  redis.call('PEXPIRE', rk, window_ms * 2)
  month_requests = redis.call('INCR', mrk)
  redis.call('EXPIRE', mrk, MONTH_TTL)
  if cap >= 0 then
    redis.call('ZADD', ck, now + lease_ms, ARGV[4])
    redis.call('PEXPIRE', ck, lease_ms)
    concurrent = concurrent + 1
  end
end
return {refused, requests, tokens, month_requests, month_tokens, concurrent,
  (w + 1) * window_ms - now}
""".replace("MONTH_TTL", str(MONTH_TTL_S))
)

# ARGV: window_ms, month, tokens, lease.
SETTLE = Script(
    """
local p = KEYS[1]
local window_ms, month, tokens = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local w = math.floor(now / window_ms)
if tokens > 0 then
  local tk, mtk = p .. 't:' .. w, p .. 'mt:' .. month
  redis.call('INCRBY', tk, tokens)
  redis.call('PEXPIRE', tk, window_ms * 2)
  redis.call('INCRBY', mtk, tokens)
  redis.call('EXPIRE', mtk, MONTH_TTL)
end
redis.call('ZREM', p .. 'c', ARGV[4])
return 1
""".replace("MONTH_TTL", str(MONTH_TTL_S))
)


def prefix(tenant: Tenant) -> str:
    return f"{{dflash:{tenant.name}}}:"


def limit_args(limits: Limits) -> list[int]:
    return [
        NO_LIMIT if value is None else value
        for value in (
            limits.requests_per_minute,
            limits.tokens_per_minute,
            limits.tokens_per_month,
            limits.concurrent_requests,
        )
    ]


def usage_of(reply: list[object], month: str) -> tuple[Refusal | None, TenantUsage]:
    refused, requests, tokens, month_requests, month_tokens, concurrent, reset_ms = reply
    assert isinstance(refused, bytes)
    usage = TenantUsage(
        requests=int(requests),  # type: ignore[call-overload]
        tokens=int(tokens),  # type: ignore[call-overload]
        month_requests=int(month_requests),  # type: ignore[call-overload]
        month_tokens=int(month_tokens),  # type: ignore[call-overload]
        concurrent=int(concurrent),  # type: ignore[call-overload]
        reset_s=int(reset_ms) / 1000,  # type: ignore[call-overload]
        month=month,
    )
    return (refused.decode() or None), usage  # type: ignore[return-value]


class RedisLedger:
    def __init__(self, client: RedisClient, window_s: float, lease_s: float) -> None:
        self.client = client
        self.window_ms = max(1, round(window_s * 1000))
        self.lease_ms = max(1, round(lease_s * 1000))

    async def admit(self, tenant: Tenant, lease: str) -> Verdict:
        month = month_of(time.time())
        args = [self.window_ms, month, self.lease_ms, lease, *limit_args(tenant.limits)]
        reply = await self.client.evalsha(ADMIT, [prefix(tenant)], args)
        refused, usage = usage_of(reply, month)
        return Verdict(refused, usage)

    async def settle(self, tenant: Tenant, lease: str, tokens: int) -> None:
        month = month_of(time.time())
        args = [self.window_ms, month, tokens, lease]
        await self.client.evalsha(SETTLE, [prefix(tenant)], args)

    async def usage(self, tenant: Tenant) -> TenantUsage:
        """The counts without admitting anything: the admission script with every limit at
        zero refuses before it counts."""
        month = month_of(time.time())
        args = [self.window_ms, month, self.lease_ms, "", 0, NO_LIMIT, NO_LIMIT, NO_LIMIT]
        reply = await self.client.evalsha(ADMIT, [prefix(tenant)], args)
        return usage_of(reply, month)[1]

    async def close(self) -> None:
        await self.client.close()
