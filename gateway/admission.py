"""Admission: a request's tenant quotas and the model's queue limit, taken before it is queued and
given back when it ends (``sluice.wire.quota`` holds the scripts and their rules).

:func:`admit` runs the tenant's script and, with ``--max-queue-len``, the model's gate, each one
atomic in Redis (two families, two slots: never one transaction), and returns a :class:`Ticket`.
When one refuses after the other took its share, the taken share is given back at once. Nothing
runs, and nothing is asked of Redis, for a tenant without limits on a gateway without
``--max-queue-len``.

The ticket lives with the request's :class:`~gateway.generation.Generation`: its first token frees
its queued places (:meth:`Ticket.started`), its end frees the rest and gives back the tokens it
reserved and did not use (:meth:`Ticket.release`). Both are idempotent and never raise: a place a
gateway could not free (it died, Redis was away) lapses with the request's deadline.

The ``x-ratelimit-*`` headers OpenAI sends (:func:`headers`) come from the verdict.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import RedisError

from gateway import errors
from gateway.errors import OpenAIError
from gateway.keyring import Principal
from gateway.metrics import METRICS
from sluice.wire import contract, quota
from sluice.wire.error_codes import Code
from sluice.wire.keys import Limits

log = logging.getLogger("sluice.gateway.admission")


def duration(ms: int) -> str:
    """OpenAI's reset format, Go's durations: milliseconds below a second, else hours, minutes and
    seconds (tests/unit/test_keys.py has examples)."""
    if ms < 1000:
        return f"{max(0, ms)}ms"
    seconds = ms / 1000
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    text = f"{secs:.3f}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{int(hours)}h{int(minutes)}m{text}"
    if minutes:
        return f"{int(minutes)}m{text}"
    return text


def headers(limits: Limits, verdict: quota.Verdict) -> dict[str, str]:
    """OpenAI's ``x-ratelimit-*`` headers for the limits that are set."""
    out: dict[str, str] = {}
    if limits.requests_per_minute and verdict.requests_remaining is not None:
        out["x-ratelimit-limit-requests"] = str(limits.requests_per_minute)
        out["x-ratelimit-remaining-requests"] = str(verdict.requests_remaining)
        out["x-ratelimit-reset-requests"] = duration(verdict.requests_reset_ms or 0)
    if limits.tokens_per_minute and verdict.tokens_remaining is not None:
        out["x-ratelimit-limit-tokens"] = str(limits.tokens_per_minute)
        out["x-ratelimit-remaining-tokens"] = str(verdict.tokens_remaining)
        out["x-ratelimit-reset-tokens"] = duration(verdict.tokens_reset_ms or 0)
    return out


class Scripts:
    """The quota scripts registered on one Redis client (one per broker)."""

    def __init__(self, redis: Any) -> None:
        self.redis = redis
        self.admit = redis.register_script(quota.ADMIT_SCRIPT)
        self.release = redis.register_script(quota.RELEASE_SCRIPT)
        self.peek = redis.register_script(quota.PEEK_SCRIPT)
        self.gate = redis.register_script(quota.GATE_SCRIPT)


def scripts_of(broker: Any) -> Scripts:
    scripts = getattr(broker, "_quota_scripts", None)
    if scripts is None or scripts.redis is not broker.redis:
        scripts = broker._quota_scripts = Scripts(broker.redis)
    return scripts


@dataclass
class Ticket:
    """What one admitted request holds, to be given back."""

    broker: Any
    principal: Principal
    member: str  # the tenant sets' member: the request's id
    reserved_tokens: int
    model: str
    gate_members: list[str] = field(default_factory=list)  # one per engine request (--max-queue-len)
    verdict: quota.Verdict | None = None
    _started: set[int] = field(default_factory=set)
    _released: bool = False

    @property
    def limited(self) -> bool:
        return self.principal.limits.any

    def started(self, index: int) -> None:
        """The ``index``-th engine request has its first token: it no longer waits in the queue."""
        if self._released or index in self._started:
            return
        first = not self._started
        self._started.add(index)
        pipe_keys: list[tuple[str, str]] = []
        if first and self.principal.limits.max_queued:
            pipe_keys.append((contract.tenant_queued_key(self.principal.tenant), self.member))
        if index < len(self.gate_members):
            pipe_keys.append((contract.model_queued_key(self.model), self.gate_members[index]))
        if pipe_keys:
            self.broker.spawn(self._zrem(pipe_keys))

    async def _zrem(self, pairs: list[tuple[str, str]]) -> None:
        try:
            pipe = self.broker.redis.pipeline(transaction=False)
            for key, member in pairs:
                pipe.zrem(key, member)
            await pipe.execute()
        except (RedisError, OSError) as exc:  # the place lapses at the deadline
            log.debug("could not free a queue place (%s)", exc)

    def release(self, used_tokens: int | None = None, *, refused: bool = False) -> None:
        """The request ended (``used_tokens``: what it used, None: unknown, nothing given back), or
        was ``refused`` after admission (everything given back, the request too)."""
        if self._released:
            return
        self._released = True
        self.broker.spawn(self._release(used_tokens, refused))

    async def _release(self, used_tokens: int | None, refused: bool) -> None:
        limits = self.principal.limits
        try:
            if limits.any:
                refund = self.reserved_tokens if refused else (
                    max(0, self.reserved_tokens - used_tokens) if used_tokens is not None else 0)
                await scripts_of(self.broker).release(
                    keys=quota.tenant_keys(self.principal.tenant),
                    args=[self.member, limits.requests_per_minute or 0, 1 if refused else 0,
                          limits.tokens_per_minute or 0, refund])
            if self.gate_members:
                await self.broker.redis.zrem(contract.model_queued_key(self.model), *self.gate_members)
        except (RedisError, OSError) as exc:  # the places lapse at the deadline
            log.debug("could not release an admission (%s)", exc)


def _refusal(principal: Principal, verdict: quota.Verdict, tokens: int) -> OpenAIError:
    limits, tenant = principal.limits, principal.label
    retry_s = max(1, math.ceil(verdict.retry_after_ms / 1000))
    if verdict.refused == quota.TOO_LARGE:
        exc = errors.error(Code.RATE_LIMIT_EXCEEDED,
                           f"Request too large for tenant {tenant}: it asks {tokens} tokens (prompt plus "
                           f"max_tokens), more than its limit of {limits.tokens_per_minute} tokens per minute. "
                           "Lower max_tokens or shorten the prompt.")
        exc.type, exc.headers = "tokens", None  # retrying cannot help: no Retry-After
        return exc
    what = {
        quota.REQUESTS: ("requests", f"requests per minute: limit {limits.requests_per_minute}"),
        quota.TOKENS: ("tokens", f"tokens per minute: limit {limits.tokens_per_minute}, requested {tokens}"),
        quota.CONCURRENT: ("requests", f"concurrent requests: limit {limits.max_concurrent}"),
        quota.QUEUED: ("requests", f"queued requests: limit {limits.max_queued}"),
    }[verdict.refused]
    exc = errors.error(Code.RATE_LIMIT_EXCEEDED,
                       f"Rate limit reached for tenant {tenant} on {what[1]}. Please try again in "
                       f"{duration(verdict.retry_after_ms)}.", retry_after_s=retry_s)
    exc.type = what[0]
    exc.headers = {**(exc.headers or {}), "retry-after-ms": str(verdict.retry_after_ms)}
    return exc


async def admit(broker: Any, principal: Principal, *, member: str, model: str, tokens: int,
                num_requests: int, max_queue_len: int | None, place_ttl_s: float,
                retry_after_s: int) -> Ticket | None:
    """Take the tenant's quotas and a place in the model's queue, or raise the 429 that says which
    limit refused (503 ``redis_unavailable`` when Redis cannot be asked: closed, never open)."""
    limits = principal.limits
    if not limits.any and max_queue_len is None:
        return None
    ticket = Ticket(broker, principal, member, tokens, model)
    ttl_ms = int(place_ttl_s * 1000) + quota.PLACE_MARGIN_MS
    scripts = scripts_of(broker)
    try:
        if limits.any:
            ticket.verdict = quota.Verdict.decode(await scripts.admit(
                keys=quota.tenant_keys(principal.tenant),
                args=[limits.requests_per_minute or 0, limits.tokens_per_minute or 0, limits.max_concurrent or 0,
                      limits.max_queued or 0, tokens, member, ttl_ms]))
            if not ticket.verdict.ok:
                METRICS.rate_limited.labels(tenant=METRICS.tenant_label(principal.tenant),
                                            limit=ticket.verdict.refused).inc()
                raise _refusal(principal, ticket.verdict, tokens)
        if max_queue_len is not None:
            members = [member] if num_requests == 1 else [f"{member}#{i}" for i in range(num_requests)]
            taken = await scripts.gate(keys=[contract.model_queued_key(model)],
                                       args=[max_queue_len, ttl_ms, *members])
            if not taken:
                if limits.any:
                    ticket.release(refused=True)
                raise errors.queue_full(model, retry_after_s)
            ticket.gate_members = members
    except (RedisError, OSError) as exc:
        if ticket.verdict is not None and ticket.verdict.ok:
            ticket.release(refused=True)
        raise errors.redis_down(exc) from exc
    return ticket


async def peek_headers(broker: Any, principal: Principal) -> dict[str, str]:
    """The ``x-ratelimit-*`` headers of a response that takes nothing (best effort: {} on failure)."""
    limits = principal.limits
    if not (limits.requests_per_minute or limits.tokens_per_minute):
        return {}
    try:
        async with asyncio.timeout(0.5):
            reply = await scripts_of(broker).peek(
                keys=quota.tenant_keys(principal.tenant)[:2],
                args=[limits.requests_per_minute or 0, limits.tokens_per_minute or 0])
    except (RedisError, OSError, TimeoutError):
        return {}
    return headers(limits, quota.Verdict.decode_peek(reply))


def deadline_ttl(deadline: float) -> float:
    """Seconds from now to ``deadline`` (unix s): how long a place may be held."""
    return max(1.0, deadline - time.time())
