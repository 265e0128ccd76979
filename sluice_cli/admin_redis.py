"""The one knob of the admin commands (``sluice keys``, ``sluice usage``): the deployment's Redis,
a secret like everywhere else (``--redis-url``, ``--redis-url-file``, ``$SLUICE_REDIS_URL`` or a
``--config`` file)."""

from __future__ import annotations

from dataclasses import dataclass

from sluice.config import KnobSet, shared


@dataclass
class AdminRedis:
    knob_title = "redis"

    redis_url: str = shared.redis_url()


def knob_set(command: str) -> KnobSet:
    return KnobSet(command, [AdminRedis])
