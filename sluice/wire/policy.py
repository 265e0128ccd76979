"""When a waiting client is told that its request was lost: the rule, written once.

The engine side of "lost" is in the worker and ``redis_io``: a live engine reclaims the pending
entries of a dead one, restarts those that emitted nothing and errors the others with
``engine_lost`` (``contract.MAX_ATTEMPTS`` bounds the restarts). The gateway, which hears nothing
while no engine is alive, decides with :func:`engine_lost`:

- some engine for the model is alive: keep waiting (it reclaims a dead peer's work, or the
  request is queued behind others; the deadline bounds the wait);
- none is alive and the request has emitted tokens: lost now (no engine can continue a
  half-generated completion; a later one would only confirm it);
- none is alive and nothing was emitted (queued, handed back by a drain, or running on an engine
  that died before its first token): wait up to ``NO_ENGINE_WAIT_S`` for an engine to (re)appear —
  a restarted or replacement engine takes the entry from the queue (or reclaims it) and serves it.
"""

from __future__ import annotations

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
