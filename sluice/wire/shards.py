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
model: every engine computes the same owner from the registry with no round trip, and an engine
that joins or leaves moves about 1/N of the shards (only those it wins or held).

Age. A stream entry id is ``<ms>-<seq>``, the ms being Redis's clock at the XADD: an entry's wait
is known without reading it.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Sequence

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
