"""Quotas in Redis: the scripts every gateway runs, so that all of them share one set of counters.

A tenant's limits (``sluice.wire.keys.Limits``) are checked and taken by ONE script over the keys of
the tenant's family (``contract.tenant_tag``: one hash slot, so it is atomic on a Redis Cluster
too), with Redis's own clock (``TIME``), so gateways on different hosts agree:

- requests and tokens per minute are token buckets: a bucket holds at most the limit and refills
  at the limit per minute (a tenant idle for a minute has its whole limit again); a request takes
  one request and its prompt plus ``max_tokens`` tokens, and the tokens it did not use are given
  back when it ends (:data:`RELEASE_SCRIPT`);
- concurrent and queued requests are sorted sets of the requests that hold a place (member: the
  request's id, score: when the place lapses by itself, its deadline plus a margin, so a gateway
  that dies never strands a place). A request leaves the queued set when an engine starts it
  (its first token) and both sets when it ends.

A refusal names the limit and when to retry; every answer carries what OpenAI's
``x-ratelimit-*`` headers need (``gateway.admission`` formats them).

``--max-queue-len`` (the model's queue) is a gate of the same kind (:data:`GATE_SCRIPT`, the
``{mq:<model>}`` family): a place per engine request admitted and not started.
"""

from __future__ import annotations

from dataclasses import dataclass

from sluice.wire import contract

# A place in the concurrent/queued sets outlives its request's deadline by this much (ms).
PLACE_MARGIN_MS = contract.INFLIGHT_MARGIN_S * 1000
# The buckets expire once full again (plus this), so an idle tenant leaves nothing in Redis.
BUCKET_IDLE_MS = 60_000

# What a refusal names.
REQUESTS = "requests"  # requests per minute
TOKENS = "tokens"  # tokens per minute
TOO_LARGE = "tokens_too_large"  # asks more tokens than the limit allows in a minute: can never pass
CONCURRENT = "concurrent"
QUEUED = "queued"

# KEYS: rpm bucket, tpm bucket, active set, queued set.
# ARGV: rpm limit, tpm limit, concurrent limit, queued limit (0: none), tokens asked, member,
#       place TTL (ms).
# Returns {ok, refused limit, retry after (ms), requests remaining, requests reset (ms),
#          tokens remaining, tokens reset (ms)}; a limit of 0 reports -1 for its remaining/reset.
ADMIT_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function level(key, limit)
  local v = redis.call('HMGET', key, 'level', 'at')
  local lv, at = tonumber(v[1]), tonumber(v[2])
  if lv == nil or at == nil then return limit end
  return math.min(limit, lv + math.max(0, now - at) * limit / 60000)
end
local rpm, tpm = tonumber(ARGV[1]), tonumber(ARGV[2])
local conc, queued = tonumber(ARGV[3]), tonumber(ARGV[4])
local cost = tonumber(ARGV[5])
local rlev, tlev = 0, 0
local refused, retry = '', 0
if rpm > 0 then
  rlev = level(KEYS[1], rpm)
  if rlev < 1 then refused, retry = 'requests', math.ceil((1 - rlev) * 60000 / rpm) end
end
if refused == '' and tpm > 0 then
  tlev = level(KEYS[2], tpm)
  if cost > tpm then refused = 'tokens_too_large'
  elseif tlev < cost then refused, retry = 'tokens', math.ceil((cost - tlev) * 60000 / tpm) end
end
if refused == '' and conc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  if redis.call('ZCARD', KEYS[3]) >= conc then refused, retry = 'concurrent', 1000 end
end
if refused == '' and queued > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now)
  if redis.call('ZCARD', KEYS[4]) >= queued then refused, retry = 'queued', 1000 end
end
if refused == '' then
  if rpm > 0 then
    rlev = rlev - 1
    redis.call('HSET', KEYS[1], 'level', tostring(rlev), 'at', now)
    redis.call('PEXPIRE', KEYS[1], math.ceil((rpm - rlev) * 60000 / rpm) + 60000)
  end
  if tpm > 0 then
    tlev = tlev - cost
    redis.call('HSET', KEYS[2], 'level', tostring(tlev), 'at', now)
    redis.call('PEXPIRE', KEYS[2], math.ceil((tpm - tlev) * 60000 / tpm) + 60000)
  end
  local ttl = tonumber(ARGV[7])
  local function place(key)
    redis.call('ZADD', key, now + ttl, ARGV[6])
    if redis.call('PTTL', key) < ttl then redis.call('PEXPIRE', key, ttl) end
  end
  if conc > 0 then place(KEYS[3]) end
  if queued > 0 then place(KEYS[4]) end
end
local rrem, rreset, trem, treset = -1, -1, -1, -1
if rpm > 0 then rrem, rreset = math.floor(rlev), math.ceil((rpm - rlev) * 60000 / rpm) end
if tpm > 0 then trem, treset = math.floor(math.max(0, tlev)), math.ceil((tpm - tlev) * 60000 / tpm) end
return {refused == '' and 1 or 0, refused, retry, rrem, rreset, trem, treset}
"""

# KEYS: rpm bucket, tpm bucket, active set, queued set.
# ARGV: member, rpm limit, requests given back (0 or 1: a request refused after admission),
#       tpm limit, tokens given back.
# Gives back what an admitted request did not use and frees its places. Idempotent for the places;
# the caller gives tokens back once.
RELEASE_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function refund(key, limit, amount)
  if limit <= 0 or amount <= 0 then return end
  local v = redis.call('HMGET', key, 'level', 'at')
  local lv, at = tonumber(v[1]), tonumber(v[2])
  if lv == nil or at == nil then return end
  lv = math.min(limit, lv + math.max(0, now - at) * limit / 60000 + amount)
  redis.call('HSET', key, 'level', tostring(lv), 'at', now)
end
refund(KEYS[1], tonumber(ARGV[2]), tonumber(ARGV[3]))
refund(KEYS[2], tonumber(ARGV[4]), tonumber(ARGV[5]))
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('ZREM', KEYS[4], ARGV[1])
return 1
"""

# KEYS: rpm bucket, tpm bucket. ARGV: rpm limit, tpm limit.
# What the headers say when nothing is taken: {requests remaining, reset (ms), tokens remaining, reset (ms)}.
PEEK_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function level(key, limit)
  local v = redis.call('HMGET', key, 'level', 'at')
  local lv, at = tonumber(v[1]), tonumber(v[2])
  if lv == nil or at == nil then return limit end
  return math.min(limit, lv + math.max(0, now - at) * limit / 60000)
end
local rpm, tpm = tonumber(ARGV[1]), tonumber(ARGV[2])
local rrem, rreset, trem, treset = -1, -1, -1, -1
if rpm > 0 then local l = level(KEYS[1], rpm); rrem, rreset = math.floor(l), math.ceil((rpm - l) * 60000 / rpm) end
if tpm > 0 then local l = level(KEYS[2], tpm); trem, treset = math.floor(math.max(0, l)), math.ceil((tpm - l) * 60000 / tpm) end
return {rrem, rreset, trem, treset}
"""

# KEYS: the model's gate (contract.model_queued_key). ARGV: limit, place TTL (ms), members...
# Takes a place per member unless the places would exceed the limit; returns 1 taken, 0 refused.
GATE_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local n = #ARGV - 2
if redis.call('ZCARD', KEYS[1]) + n > tonumber(ARGV[1]) then return 0 end
local ttl = tonumber(ARGV[2])
for i = 3, #ARGV do redis.call('ZADD', KEYS[1], now + ttl, ARGV[i]) end
if redis.call('PTTL', KEYS[1]) < ttl then redis.call('PEXPIRE', KEYS[1], ttl) end
return 1
"""


def tenant_keys(tenant: str) -> list[str]:
    """The KEYS of ADMIT / RELEASE, in their order."""
    return [contract.rpm_key(tenant), contract.tpm_key(tenant), contract.active_key(tenant),
            contract.tenant_queued_key(tenant)]


@dataclass(frozen=True)
class Verdict:
    """ADMIT's answer. ``remaining``/``reset_ms`` of a limit that is not set are None."""

    ok: bool
    refused: str  # "" when ok, else REQUESTS | TOKENS | TOO_LARGE | CONCURRENT | QUEUED
    retry_after_ms: int
    requests_remaining: int | None
    requests_reset_ms: int | None
    tokens_remaining: int | None
    tokens_reset_ms: int | None

    @classmethod
    def decode(cls, reply: list) -> Verdict:
        def opt(v) -> int | None:
            v = int(v)
            return None if v < 0 else v

        ok, refused, retry, rrem, rreset, trem, treset = reply
        refused = refused.decode() if isinstance(refused, bytes) else str(refused)
        return cls(bool(int(ok)), refused, int(retry), opt(rrem), opt(rreset), opt(trem), opt(treset))

    @classmethod
    def decode_peek(cls, reply: list) -> Verdict:
        return cls.decode([1, "", 0, *reply])
