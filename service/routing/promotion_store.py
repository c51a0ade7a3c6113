"""Promotion shared by every gateway replica and process through Redis (`redis_url`).

Each process counts its requests' evidence locally (`Promotions.pending`) and, every
`interval_s`, hands it over and reads the rollout back in one script call: the stage, the
status, the evidence every replica has added, the last decisions. It then decides on that
shared evidence; a decision is taken by one replica only (a compare-and-set on the rollout's
epoch: a replica that lost the race drops its decision and adopts the winner's on its next
sync). The evidence of a stage lives under its epoch, so a late hand-over from an old stage
is dropped, never mixed into the new one. Pins live in Redis too: every replica routes by the
same weights.

Keys (one Redis Cluster hash slot per rollout: the braces):
    dflash:promotion:{MODEL|CANARY|SPEC}          hash: epoch, stage, status
    dflash:promotion:{MODEL|CANARY|SPEC}:e<N>     hash: the stage's summed evidence
    dflash:promotion:{MODEL|CANARY|SPEC}:decisions list: the last decisions (JSON)
    dflash:promotion:pins                          hash: pool -> pinned weight
SPEC is a digest of the promotion's settings: changing them starts a new rollout.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import math
import time
from typing import Any, cast

from service.routing.promotion import Promotions, Rollout, Status, Tally, decide
from service.tenancy.limits import WARN_EVERY_S
from service.tenancy.redis_client import RedisClient, RedisUnavailable, ReplyError, Script

log = logging.getLogger("dflash.gateway.promotion")

PINS_KEY = "dflash:promotion:pins"
# In the scripts: a stage's evidence expires after 7 days (604800 s); 20 decisions are kept.

# KEYS[1] the rollout's state; ARGV[1] the epoch the hand-over was counted in, then field,
# increment pairs. Returns epoch, stage, status, the epoch's evidence, the last decisions.
SYNC = Script(
    """
local state = KEYS[1]
redis.call('HSETNX', state, 'epoch', 0)
redis.call('HSETNX', state, 'stage', 0)
redis.call('HSETNX', state, 'status', 'testing')
local epoch = tonumber(redis.call('HGET', state, 'epoch'))
local evidence = state .. ':e' .. epoch
if tonumber(ARGV[1]) == epoch and #ARGV > 1 then
  for i = 2, #ARGV, 2 do
    redis.call('HINCRBYFLOAT', evidence, ARGV[i], ARGV[i + 1])
  end
  redis.call('EXPIRE', evidence, 604800)
end
return {epoch, redis.call('HGET', state, 'stage'), redis.call('HGET', state, 'status'),
        redis.call('HGETALL', evidence), redis.call('LRANGE', state .. ':decisions', 0, 19)}
"""
)

# KEYS[1] the rollout's state; ARGV: the epoch decided on, the new stage, status, the record.
# 1 when this replica took the decision, 0 when another one moved the rollout first.
DECIDE = Script(
    """
if tonumber(redis.call('HGET', KEYS[1], 'epoch')) ~= tonumber(ARGV[1]) then
  return 0
end
redis.call('HSET', KEYS[1], 'epoch', tonumber(ARGV[1]) + 1, 'stage', ARGV[2], 'status', ARGV[3])
redis.call('LPUSH', KEYS[1] .. ':decisions', ARGV[4])
redis.call('LTRIM', KEYS[1] .. ':decisions', 0, 19)
return 1
"""
)


def state_key(rollout: Rollout) -> str:
    spec = json.dumps(rollout.spec.model_dump(mode="json"), sort_keys=True)
    digest = hashlib.sha256(f"{rollout.baseline}\0{spec}".encode()).hexdigest()[:12]
    return f"dflash:promotion:{{{rollout.model}|{rollout.canary}|{digest}}}"


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class SharedPromotions:
    """Keeps one process's Promotions in step with every other's through Redis."""

    def __init__(self, promotions: Promotions, client: RedisClient, interval_s: float) -> None:
        self.promotions, self.client, self.interval_s = promotions, client, interval_s
        promotions.pending = {}
        promotions.share_pin = self.share_pin
        self._epochs: dict[str, int] = {}  # canary -> the epoch last read (-1: none yet)
        self._task: asyncio.Task[None] | None = None
        self._failing_since: float | None = None  # the first failed sync of a spell
        self._warned_at = -math.inf

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(RedisUnavailable, ReplyError):
            await self.sync()  # the last hand-over
        await self.client.close()

    async def _run(self) -> None:
        while True:
            try:
                await self.sync()
            except (RedisUnavailable, ReplyError) as exc:
                # Routing goes on by the last weights read; the evidence waits for Redis.
                # Logged once per WARN_EVERY_S, not every sync (twice a second).
                now = time.monotonic()
                self._failing_since = self._failing_since or now
                if now - self._warned_at >= WARN_EVERY_S:
                    self._warned_at = now
                    log.warning(
                        "promotion: Redis sync failing for %.0f s: %s",
                        now - self._failing_since,
                        exc,
                    )
            else:
                if self._failing_since is not None:
                    log.warning("promotion: Redis sync works again")
                self._failing_since, self._warned_at = None, -math.inf
            await asyncio.sleep(self.interval_s)

    async def sync(self) -> None:
        await self._sync_pins()
        for rollout in self.promotions.rollouts.values():
            await self._sync(rollout)

    async def _sync_pins(self) -> None:
        reply = cast(list[Any], await self.client.call(b"HGETALL", PINS_KEY))
        pins = {text(k): float(text(v)) for k, v in zip(reply[::2], reply[1::2], strict=True)}
        known = self.promotions.pins
        for pool in set(pins) | set(known):
            if pins.get(pool) != known.get(pool):
                self.promotions.pin(pool, pins.get(pool))

    async def share_pin(self, pool: str, weight: float | None) -> None:
        if weight is None:
            await self.client.call(b"HDEL", PINS_KEY, pool)
        else:
            await self.client.call(b"HSET", PINS_KEY, pool, repr(weight))

    async def _sync(self, rollout: Rollout) -> None:
        pending = self.promotions.pending or {}
        handed = pending.pop(rollout.canary, Tally())
        fields = [item for name, value in handed.fields().items() for item in (name, repr(value))]
        epoch_read = self._epochs.get(rollout.canary, -1)
        key = state_key(rollout)
        reply = cast(list[Any], await self.client.evalsha(SYNC, [key], [epoch_read, *fields]))
        epoch, stage, status = int(reply[0]), int(text(reply[1])), cast(Status, text(reply[2]))
        flat = {text(k): float(text(v)) for k, v in zip(reply[3][::2], reply[3][1::2], strict=True)}
        self._epochs[rollout.canary] = epoch
        self.promotions.adopt(rollout, stage, status)
        rollout.tally = Tally.from_fields(flat)
        rollout.decisions = [json.loads(text(item)) for item in reversed(reply[4])]
        if rollout.status != "testing":
            return
        decision, evidence = decide(rollout, self.promotions.healthy(rollout.canary))
        if decision == "hold":
            return
        new_stage, new_status = rollout.moved(decision)
        record = self.promotions.record(rollout, decision, evidence, new_stage, new_status)
        taken = await self.client.evalsha(
            DECIDE, [key], [epoch, new_stage, new_status, json.dumps(record)]
        )
        if taken == 1:
            self._epochs[rollout.canary] = epoch + 1
            self.promotions.move(rollout, decision, evidence, new_stage, new_status, record)
