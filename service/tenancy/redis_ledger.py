"""The usage ledger in Redis, shared by every gateway process and replica: one script call
admits (or refuses) a request, one charges it when it ends. The scripts apply
`ledger.refusal`'s rule atomically on Redis's own clock, so replicas agree on windows.

Keys of a tenant share the hash tag `{dflash:<tenant>}` (one cluster slot):
  r:<window> / t:<window>  requests admitted / tokens charged in a window (expire after two)
  mr:<month> / mt:<month>  requests / tokens of a calendar month (UTC; kept 40 days)
  c                        a sorted set of the leases of requests in flight, scored by their
                           expiry time (every admitted request has one: it makes a settlement
                           idempotent, and counts toward the concurrency cap where there is one)
  o:<lease>                a request admitted while Redis did not answer (fail-open), settled
                           (kept for `lease_s`: its settlement is then counted once)
A lease expires by itself after `lease_s` (the gateway's request timeout and a margin), so a
gateway that dies with requests in flight does not hold its tenants' concurrency for ever.

A settlement is idempotent by its lease, because the gateway retries one whose reply it did
not get (service.tenancy.ledger_backlog) and the first try may have landed: it charges only when it
removes the lease, or when the lease could have expired (a settlement later than `lease_s`
after admission: charged rather than lost). A request admitted open has no lease (or one that
a late admission added): its settlement counts the request too, once (the `o:` marker), and
an admission that reaches Redis after that settlement is ignored.
"""

from __future__ import annotations

import time
from typing import get_args

from service.tenancy.ledger import Charge, Refusal, TenantUsage, Verdict, month_of
from service.tenancy.redis_client import ProtocolError, RedisClient, RedisUnavailable, Script
from service.tenancy.tenants import Limits, Tenant

MONTH_TTL_S = 40 * 24 * 3600
NO_LIMIT = -1
REFUSALS: tuple[Refusal | None, ...] = (None, *get_args(Refusal))

# ARGV: window_ms, month, lease_ms, lease, rpm, tpm, month quota, concurrency cap (-1: none).
# Returns {refused ("" when admitted), requests, tokens, month requests, month tokens,
# concurrent, ms until the window ends, Redis's clock in ms}.
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
if redis.call('EXISTS', p .. 'o:' .. ARGV[4]) == 1 then refused = 'settled'
elseif rpm >= 0 and requests >= rpm then refused = 'requests'
elseif tpm >= 0 and tokens >= tpm then refused = 'tokens'
elseif quota >= 0 and month_tokens >= quota then refused = 'quota'
elseif cap >= 0 and concurrent >= cap then refused = 'concurrency' end
if refused == '' then
  requests = redis.call('INCR', rk)
  redis.call('PEXPIRE', rk, window_ms * 2)
  month_requests = redis.call('INCR', mrk)
  redis.call('EXPIRE', mrk, MONTH_TTL)
  redis.call('ZADD', ck, now + lease_ms, ARGV[4])
  redis.call('PEXPIRE', ck, lease_ms)
  concurrent = concurrent + 1
end
return {refused, requests, tokens, month_requests, month_tokens, concurrent,
  (w + 1) * window_ms - now, now}
""".replace("MONTH_TTL", str(MONTH_TTL_S))
)

# ARGV: window_ms, month, tokens, lease, admitted at (Redis ms; -1: admitted open), lease_ms.
# Returns 1 when it charged, 0 when the settlement had landed already.
SETTLE = Script(
    """
local p = KEYS[1]
local window_ms, month, tokens = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3])
local lease, admitted, lease_ms = ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local w = math.floor(now / window_ms)
local held = redis.call('ZREM', p .. 'c', lease)
if admitted < 0 then
  if not redis.call('SET', p .. 'o:' .. lease, '1', 'NX', 'PX', lease_ms) then return 0 end
  if held == 0 then
    local rk, mrk = p .. 'r:' .. w, p .. 'mr:' .. month
    redis.call('INCR', rk)
    redis.call('PEXPIRE', rk, window_ms * 2)
    redis.call('INCR', mrk)
    redis.call('EXPIRE', mrk, MONTH_TTL)
  end
elseif held == 0 and now < admitted + lease_ms then
  return 0
end
if tokens > 0 then
  local tk, mtk = p .. 't:' .. w, p .. 'mt:' .. month
  redis.call('INCRBY', tk, tokens)
  redis.call('PEXPIRE', tk, window_ms * 2)
  redis.call('INCRBY', mtk, tokens)
  redis.call('EXPIRE', mtk, MONTH_TTL)
end
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


def usage_of(reply: object, month: str) -> tuple[str | None, TenantUsage, int]:
    """The admission script's answer; ProtocolError when it is not shaped like one."""
    if not (
        isinstance(reply, list)
        and len(reply) == 8
        and isinstance(reply[0], bytes)
        and all(isinstance(value, int) for value in reply[1:])
    ):
        raise ProtocolError(f"not an admission script's reply: {reply!r:.100}")
    refused, requests, tokens, month_requests, month_tokens, concurrent, reset_ms, now = reply
    usage = TenantUsage(
        requests=requests,
        tokens=tokens,
        month_requests=month_requests,
        month_tokens=month_tokens,
        concurrent=concurrent,
        reset_s=reset_ms / 1000,
        month=month,
    )
    return refused.decode(errors="replace") or None, usage, now


class RedisLedger:
    def __init__(self, client: RedisClient, window_s: float, lease_s: float) -> None:
        self.client = client
        self.window_ms = max(1, round(window_s * 1000))
        self.lease_ms = max(1, round(lease_s * 1000))

    async def admit(self, tenant: Tenant, lease: str) -> Verdict:
        month = month_of(time.time())
        args = [self.window_ms, month, self.lease_ms, lease, *limit_args(tenant.limits)]
        reply = await self.client.evalsha(ADMIT, [prefix(tenant)], args)
        try:
            refused, usage, now = usage_of(reply, month)
        except ProtocolError as exc:
            self.client.drop_connection(exc)
            raise
        if refused == "settled":  # only a caller that gave up on it could have sent it
            raise RedisUnavailable(f"lease {lease} was settled before its admission arrived")
        if refused not in REFUSALS:
            self.client.drop_connection(
                ProtocolError(f"the admission script refused for {refused!r}")
            )
            raise ProtocolError(f"the admission script refused for {refused!r}")
        return Verdict(refused, usage, now)

    async def settle(self, tenant: Tenant, lease: str, charge: Charge) -> None:
        admitted = NO_LIMIT if charge.admitted_ms is None else charge.admitted_ms
        args = [self.window_ms, charge.month, charge.tokens, lease, admitted, self.lease_ms]
        await self.client.evalsha(SETTLE, [prefix(tenant)], args)

    async def usage(self, tenant: Tenant) -> TenantUsage:
        """The counts without admitting anything: the admission script with every limit at
        zero refuses before it counts."""
        month = month_of(time.time())
        args = [self.window_ms, month, self.lease_ms, "", 0, NO_LIMIT, NO_LIMIT, NO_LIMIT]
        reply = await self.client.evalsha(ADMIT, [prefix(tenant)], args)
        try:
            return usage_of(reply, month)[1]
        except ProtocolError as exc:
            self.client.drop_connection(exc)
            raise

    async def close(self) -> None:
        await self.client.close()
