"""When a request counts as lost, and what happens then: the rules, written once.

The engine side (:func:`lost_on_delivery`): a live engine reclaims the pending entries of a dead
one; one that emitted tokens, or that was delivered more than ``contract.MAX_ATTEMPTS`` times, is
answered with an ``engine_lost`` error (no engine can continue a half-generated completion; a
poison request must not take every engine down in turn); the others restart transparently. Both
the Redis I/O thread (reclaimed entries, answered at once) and the step loop use this function.

The gateway, which hears nothing while no engine is alive, decides with :func:`engine_lost`:

- some engine for the model is alive: keep waiting (it reclaims a dead peer's work, or the
  request is queued behind others; the deadline bounds the wait);
- none is alive and the request has emitted tokens: lost now (no engine can continue a
  half-generated completion; a later one would only confirm it);
- none is alive and nothing was emitted (queued, handed back by a drain, or running on an engine
  that died before its first token): wait up to ``NO_ENGINE_WAIT_S`` for an engine to (re)appear —
  a restarted or replacement engine takes the entry from the queue (or reclaims it) and serves it.
"""

from __future__ import annotations

from sluice.wire import contract

NO_ENGINE_WAIT_S = 30.0  # how long untouched work waits for an engine to come (back)
LIVENESS_CHECK_S = 5.0  # with no event for this long, the gateway looks at the registry
RETRY_AFTER_S = 1  # the Retry-After of a 503 that says "lost, try again"


def engine_lost(*, live_engines: int, emitted: bool, no_engine_for_s: float,
                wait_s: float = NO_ENGINE_WAIT_S) -> bool:
    """True when the client should be told now that its request was lost (503, retryable)."""
    if live_engines > 0:
        return False
    if emitted:
        return True
    return no_engine_for_s >= wait_s


def lost_on_delivery(*, emitted: bool, deliveries: int, attempt: int) -> str | None:
    """Why a delivered entry must be answered ``engine_lost`` instead of run, or None to run it.
    ``deliveries``: Redis's delivery count of the entry; ``attempt``: the request's own count of
    hand-backs (``GenerateRequest.attempt``)."""
    if emitted:
        return "the engine running this request was lost after it had emitted tokens"
    if max(deliveries, attempt + 1) > contract.MAX_ATTEMPTS:
        return f"the request was lost by {contract.MAX_ATTEMPTS} engines; not retrying"
    return None
