"""The sharded queue's three rules, pure functions both sides share: which shard a request goes to
(the gateway), which engine owns a shard (every engine, from the registry), how long an entry has
waited (its stream id).

Shard choice. A prompt's shard is a stable hash (blake2b, never Python's salted ``hash``) of its
first ``prefix_blocks`` FULL KV blocks of token ids, after the chat template: the blocks the prefix
cache would share. Requests with the same system prompt (or RAG document) share a shard, so the
engine that owns it holds their blocks once. Only whole blocks count and never more than
``prefix_blocks`` of them, so a conversation's later turns (longer prompts that start with the
earlier turn's) hash the same blocks once the first turn reached ``prefix_blocks`` full blocks; a
conversation that starts shorter moves once, when it crosses that length. A prompt whose hashed
blocks lie inside the chat template's common header (``header_tokens``: what every conversation
starts with, e.g. a default system prompt) or that has no full block is spread by its request id:
the header alone must not send every tenant to one shard.

Ownership. Rendezvous (highest-random-weight) hashing of the shard over the live engines of the
model, bounded by load (``balanced_owners``): every engine computes the same owners from the
registry with no round trip. Each engine publishes the prompt tokens it recently took from each
shard (a decayed sum) and the shards it owns; shards are placed heaviest first, each kept by its
current owner while that owner's share of the recent prompt tokens stays within ``1 + 2 * slack``
times its fair share (by KV capacity), else on the first engine in its hash order that stays within
``1 + slack``: one engine cannot be handed several busy shards while another idles, and a shard
does not move for noise. Without load figures (a new queue)
it is plain rendezvous hashing, where an engine that joins or leaves moves about 1/N of the shards.

Age. A stream entry id is ``<ms>-<seq>``, the ms being Redis's clock at the XADD: an entry's wait
is known without reading it.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Mapping, Sequence

from sluice.wire import contract


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def prefix_tokens(num_tokens: int, *, block_size: int, prefix_blocks: int) -> int:
    """How many leading tokens choose the shard: whole blocks only, at most ``prefix_blocks``."""
    if block_size <= 0 or prefix_blocks <= 0:
        return 0
    return min(num_tokens // block_size, prefix_blocks) * block_size


def choose_shard(prompt_token_ids: Sequence[int], *, shards: int, block_size: int, prefix_blocks: int,
                 request_id: str, header_tokens: int = 0) -> int:
    """The shard (0 .. shards-1) of a request (see the module's doc)."""
    if shards <= 1:
        return 0
    n = prefix_tokens(len(prompt_token_ids), block_size=block_size, prefix_blocks=prefix_blocks)
    if n == 0 or n <= header_tokens:
        return _digest(b"rid\0" + request_id.encode()) % shards
    return _digest(array("q", prompt_token_ids[:n]).tobytes()) % shards


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Tokens two prompts start with (the chat template's header, from two unrelated conversations)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def weight(shard: int, engine_id: str) -> int:
    return _digest(f"{engine_id}\0{int(shard)}".encode())


def owner(shard: int, engines: Iterable[str]) -> str | None:
    """The engine that owns ``shard`` among ``engines`` (None: no engine)."""
    best: tuple[int, str] | None = None
    for engine_id in engines:
        w = (weight(shard, engine_id), engine_id)
        if best is None or w > best:
            best = w
    return best[1] if best is not None else None


def owners(shards: int, engines: Iterable[str]) -> list[str | None]:
    """The owner of each shard 0 .. shards-1."""
    live = sorted(set(engines))
    return [owner(s, live) for s in range(shards)]


def owned(shards: int, engines: Iterable[str], engine_id: str) -> list[int]:
    """The shards ``engine_id`` owns when ``engines`` (which should include it) are live."""
    live = set(engines) | {engine_id}
    return [s for s, o in enumerate(owners(shards, live)) if o == engine_id]


class ShardLoad:
    """The prompt tokens an engine took from each shard, as a sum decayed with ``half_life_s``
    (what it publishes for ``balanced_owners``). Not thread-safe: its owner locks."""

    def __init__(self, half_life_s: float) -> None:
        self.half_life_s = max(1e-3, float(half_life_s))
        self._values: dict[int, float] = {}
        self._at = 0.0

    def _decay(self, now: float) -> None:
        if now > self._at:
            factor = 0.5 ** ((now - self._at) / self.half_life_s)
            self._values = {s: v * factor for s, v in self._values.items() if v * factor >= 0.5}
            self._at = now

    def add(self, shard: int, tokens: int, now: float) -> None:
        self._decay(now)
        self._values[shard] = self._values.get(shard, 0.0) + max(0, int(tokens))

    def snapshot(self, now: float) -> dict[int, float]:
        """Each shard's decayed tokens at ``now`` (shards under half a token left out)."""
        self._decay(now)
        return dict(self._values)


LOAD_STEPS = 64  # balanced_owners' resolution: a shard's load in 1/64 of all shards' load


def balanced_owners(shards: int, capacity: Mapping[str, float], loads: Mapping[int, float], slack: float,
                    current: Mapping[int, str] | None = None) -> list[str | None]:
    """The owner of each shard 0 .. shards-1 by bounded-load rendezvous hashing.

    ``capacity``: the live engines and their KV capacity (a weight: an engine's fair share of the
    load is its part of the total capacity; 0 or less counts as 1 block). ``loads``: each shard's
    recent prompt tokens (absent: none). ``current``: the owner each engine says it has now (the
    registry's). Shards with load are placed heaviest first (ties: lower shard first): a shard stays
    with its current owner while that owner's share stays within ``1 + 2 * slack`` times its fair
    share (a moved shard costs its prefix-cache blocks, so ownership holds still against the loads'
    noise), else it goes to the first engine of its rendezvous order (``weight``) that stays within
    ``1 + slack``; a shard no engine has room for goes to the engine left least loaded relative to
    its capacity. Shards without load keep their rendezvous owner. A pure function of its
    arguments: every engine that read the same registry computes the same owners. A large
    ``slack`` gives plain rendezvous ownership."""
    live = sorted(capacity)
    base = [owner(s, live) for s in range(shards)]
    raw = {s: float(v) for s, v in loads.items() if 0 <= s < shards and v > 0}
    raw_total = sum(raw.values())
    if len(live) < 2 or raw_total <= 0:
        return base
    # Loads in whole 1/LOAD_STEPS of their total: engines read the registry a beat apart, and loads
    # decayed at slightly different instants must still give the same order and the same owners
    # (near-equal loads tie, and the tie goes to the lower shard)
    load = {s: round(v * LOAD_STEPS / raw_total) for s, v in raw.items()}
    load = {s: v for s, v in load.items() if v > 0}
    total = sum(load.values())
    if total <= 0:
        return base
    weights = {e: float(capacity[e]) if capacity[e] > 0 else 1.0 for e in live}
    all_weight = sum(weights.values())
    slack = max(0.0, slack)
    bound = {e: (1.0 + slack) * total * weights[e] / all_weight for e in live}
    keep = {e: (1.0 + 2 * slack) * total * weights[e] / all_weight for e in live}
    current = current or {}
    taken = dict.fromkeys(live, 0.0)
    out = list(base)
    for s in sorted(load, key=lambda s: (-load[s], s)):
        held = current.get(s)
        if held in taken and taken[held] + load[s] <= keep[held]:
            chosen = held
        else:
            order = sorted(live, key=lambda e: (weight(s, e), e), reverse=True)
            chosen = next((e for e in order if taken[e] + load[s] <= bound[e]), None)
            if chosen is None:
                chosen = min(order, key=lambda e: (taken[e] + load[s]) / weights[e])
        taken[chosen] += load[s]
        out[s] = chosen
    return out


def current_owners(claims: Mapping[str, Iterable[int]], shards: int) -> dict[int, str]:
    """Each shard's current owner from the shards each live engine says it owns (``claims``); a
    shard two engines claim (a hand-over between their views) goes to the one first in its
    rendezvous order."""
    out: dict[int, str] = {}
    for engine_id in sorted(claims):
        for s in claims[engine_id]:
            if 0 <= s < shards and (s not in out or (weight(s, engine_id), engine_id) > (weight(s, out[s]), out[s])):
                out[s] = engine_id
    return out


def entry_ms(entry_id: bytes | str) -> int:
    """The enqueue time (ms since the epoch, Redis's clock) an entry id carries."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(text.partition("-")[0])


def shard_count(published: Iterable[bytes | str | int], own: int = 1) -> int:
    """How many shards an engine serves: the largest count any engine of the model published (and
    its own), so entries on shards beyond a smaller count are never stranded."""
    best = max(1, int(own))
    for value in published:
        try:
            best = max(best, int(value.decode() if isinstance(value, bytes) else value))
        except (TypeError, ValueError):
            continue
    return min(best, contract.MAX_QUEUE_SHARDS)
