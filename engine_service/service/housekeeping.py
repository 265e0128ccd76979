"""The housekeeper thread of ``RedisIO`` (a mixin): heartbeat and model card, the shard view, the
lost-gateway check, the reclaim of dead engines' and orphaned entries, the streams' trim
(``trim_stream``), and the pruning of idle lanes, dead engines' registry entries and consumers.
Apart from the reader and the publisher, on a thread of its own: a slow chore never delays a read
or a publish."""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import redis

from engine_service.service.io_types import CancelNote, EntryRef, LogSpec, ShardView, _str, parse_entry
from engine_service.service.metrics import NullMetrics
from sluice.wire import contract, registry, shards
from sluice.wire.connection import TRANSIENT_ERRORS as _REDIS_ERRORS

log = logging.getLogger("sluice.engine.io")

# How many heartbeats an engine takes the entries of a shard it stopped owning without waiting for
# the steal bound: peers refresh their views a beat apart, and the shard must not wait in between.
SHARD_HANDOVER_BEATS = 2


def next_id(entry_id: str) -> str:
    """The smallest stream id greater than ``entry_id`` ("ms-seq")."""
    ms, _, seq = entry_id.partition("-")
    return f"{ms}-{int(seq or 0) + 1}"


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def trim_stream(client: redis.Redis, stream: str) -> tuple[str | None, int]:
    """Drop the stream's acknowledged entries and only those: ``XTRIM MINID`` at the oldest entry
    some group still needs — its oldest pending entry, or the first it has not read yet.

    Order makes it safe without a lock: the groups' read positions are taken first (they only move
    forward, so anything read later lies above them), their pending lists after (an entry only
    becomes pending by being read, i.e. above the position already taken, or by a claim of an
    entry that was pending already). A stream without a group is left alone (nobody has read it).
    Returns (the MINID used or None, entries removed).
    """
    try:
        groups = client.xinfo_groups(stream)
    except redis.ResponseError:  # no such stream
        return None, 0
    if not groups:
        return None, 0
    floor: str | None = None
    for group in groups:
        bound = next_id(_str(group["last-delivered-id"]))
        if int(group.get("pending", 0) or 0):
            summary = client.xpending(stream, _str(group["name"]))
            if summary.get("pending") and summary.get("min"):
                oldest = _str(summary["min"])
                bound = min(bound, oldest, key=_id_key)
        floor = bound if floor is None else min(floor, bound, key=_id_key)
    if floor is None:
        return None, 0
    removed = client.xtrim(stream, minid=floor, approximate=False)
    return floor, int(removed or 0)


class Housekeeping:
    """The housekeeper's methods of ``RedisIO``, whose ``__init__`` sets the attributes below; they
    also call its ``_backoff`` and ``_credit``, and the reader's ``_deliver`` (reclaimed entries go
    to the worker as read ones do), ``_set_view``, ``refresh_lanes``, ``all_streams``,
    ``_positions`` and ``_redis_ms`` (``QueueReader``)."""

    settings: Any
    model: str
    consumer: str
    view: ShardView
    streams: list[str]
    lanes: dict[int, tuple[str, ...]]
    _shard_of: dict[str, int]
    _lane_remove: Any
    _room_shown: bool | None
    shard_depth: dict[int, int]
    _shard_load: shards.ShardLoad
    _shard_load_lock: threading.Lock
    _handed_over: dict[int, float]
    _viewed: bool
    _claimed: tuple[int, ...]
    inbox: queue.SimpleQueue
    card: dict[str, str]
    load: Callable[[], dict[str, Any]]
    redis: Any
    _logs: dict[str, LogSpec]
    _stop: threading.Event
    _credit_lock: threading.Condition
    _held: dict[bytes, tuple[str, str]]
    _held_lock: threading.Lock
    _gateway_missing: dict[str, float]
    _gateways_lost: dict[str, float]
    _gateways_lock: threading.Lock
    reading: bool
    connected: threading.Event
    own_reclaimed: threading.Event
    stats: dict[str, int]
    metrics: NullMetrics

    # --- housekeeper: heartbeat, model card, reclaim ---
    def publish_card(self) -> None:
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(contract.model_card_key(self.model), mapping=self.card)
        pipe.sadd(contract.MODELS_KEY, self.model)
        pipe.sadd(contract.queue_shards_key(self.model), self.settings.queue_shards)
        pipe.set(contract.served_key(self.model), self.consumer, px=int(self.settings.model_grace_s * 1000))
        pipe.execute()

    def heartbeat(self) -> None:
        # The card first: if Redis lost its data (a restart without persistence; the healing client
        # may have hidden the outage from us), the card is back before the liveness key says
        # "this engine serves", so a gateway that sees the engine also finds its card.
        if not self.redis.exists(contract.model_card_key(self.model)):
            self.publish_card()
        load = dict(self.load())
        with self._credit_lock:
            load["free_slots"] = max(0, self._credit())  # 0 while draining: its shards are others' now
        with self._shard_load_lock:
            load["shard_load"] = {s: round(v, 1) for s, v in self._shard_load.snapshot(time.monotonic()).items()}
        load["owned_shards"] = list(self._claimed) if self.reading else []
        entry = registry.EngineEntry.from_load(self.consumer, self.model, time.time(), load)
        pipe = self.redis.pipeline(transaction=True)  # both in the registry's slot
        pipe.set(contract.engine_key(self.consumer), json.dumps({"model": self.model}), px=int(self.settings.heartbeat_ttl_s * 1000))
        pipe.set(contract.room_key(self.consumer), b"1" if load["free_slots"] > 0 else b"0",
                 px=int(self.settings.heartbeat_ttl_s * 1000))
        pipe.hset(contract.ENGINES_KEY, self.consumer, entry.encode())
        # the model is served: its keys stay (a draining engine still serves what it holds)
        pipe.set(contract.served_key(self.model), self.consumer, px=int(self.settings.model_grace_s * 1000))
        pipe.execute()
        # What the room key says now: the reader compares its credit with this, so a "0" written
        # here at an instant without credit is put right as soon as credit is back (not a beat later).
        self._room_shown = load["free_slots"] > 0

    def _housekeeper_loop(self) -> None:
        backoff = self._backoff("housekeeper")
        need_card = True
        next_beat = next_reclaim = 0.0
        next_prune = time.monotonic() + 30.0
        next_tidy = time.monotonic() + self.settings.trim_interval_s
        next_orphans = time.monotonic() + self.settings.orphan_check_s
        next_gateways = time.monotonic() + self.settings.gateway_check_s
        while not self._stop.is_set():
            now = time.monotonic()
            try:
                if need_card:
                    self.publish_card()
                    need_card = False
                if now >= next_beat:
                    self.heartbeat()
                    self.refresh_view()
                    next_beat = now + self.settings.heartbeat_interval_s
                if not self.own_reclaimed.is_set():
                    # Before the reader's first read: our own entries of a previous life only.
                    if self.reading:
                        self.reclaim(include_self=True)
                    self.own_reclaimed.set()
                    next_reclaim = now + self.settings.reclaim_interval_s
                if now >= next_reclaim and self.reading:
                    self.reclaim()
                    next_reclaim = now + self.settings.reclaim_interval_s
                if now >= next_orphans and self.reading:
                    self.reclaim_orphans()
                    next_orphans = now + self.settings.orphan_check_s
                if now >= next_gateways:
                    self.check_gateways()
                    next_gateways = now + self.settings.gateway_check_s
                if now >= next_tidy:
                    self.tidy()
                    next_tidy = now + self.settings.trim_interval_s
                if now >= next_prune:
                    self.prune_consumers()
                    next_prune = now + 30.0
                backoff.ok()
                self.connected.set()
            except _REDIS_ERRORS as exc:
                log.warning("housekeeper: Redis unavailable (%s); retrying", exc)
                need_card = True  # Redis may come back empty
                next_beat = 0.0
                backoff.fail(self._stop)
                continue
            except redis.RedisError as exc:
                log.error("housekeeper: %s", exc)
                backoff.fail(self._stop)
                continue
            except Exception:  # a bug in one chore must not stop the heartbeat (and so the engine)
                log.exception("housekeeper: unexpected error")
                backoff.fail(self._stop)
                continue
            self._stop.wait(min(next_beat, next_reclaim, next_gateways) - time.monotonic() if self.reading else 0.2)

    def refresh_view(self) -> ShardView:
        """Read the registry: the live engines of this model (liveness key present, not draining;
        this engine while it reads), the shard counts published, the shard loads and KV capacity
        the live engines published; compute every shard's owner by bounded-load rendezvous hashing
        (``shards.balanced_owners``), and each shard's depth (for the metrics). A shard this
        engine owned until now is taken without waiting for the steal bound for
        ``SHARD_HANDOVER_BEATS`` heartbeats (``_handover``): engines adopt a moved owner a beat
        apart, and an entry landing between must not wait for the bound."""
        pipe = self.redis.pipeline(transaction=False)  # both in the registry's slot
        pipe.hgetall(contract.ENGINES_KEY)
        pipe.smembers(contract.queue_shards_key(self.model))
        raw, counts = pipe.execute()
        peers = {}
        mine = None
        for value in raw.values():
            entry = registry.decode(value)
            if entry is None or entry.model != self.model or entry.draining:
                continue
            if entry.engine_id == self.consumer:
                mine = entry
            else:
                peers[entry.engine_id] = entry
        ids = list(peers)
        if ids:
            pipe = self.redis.pipeline(transaction=False)
            for engine_id in ids:
                pipe.exists(contract.engine_key(engine_id))
            alive = pipe.execute()
            peers = {e: peers[e] for e, ok in zip(ids, alive, strict=True) if ok}
        live = set(peers) | ({self.consumer} if self.reading else set())
        count = max(shards.shard_count(counts, self.settings.queue_shards), len(self.streams))
        published = {**peers, **({self.consumer: mine} if mine is not None and self.reading else {})}
        loads: dict[int, float] = {}
        for entry in published.values():
            for shard, value in entry.shard_load.items():
                loads[shard] = loads.get(shard, 0.0) + value
        capacity = {e: float(published[e].total_blocks) if e in published else 0.0 for e in live}
        current = shards.current_owners({e: entry.owned_shards for e, entry in published.items()}, count)
        owners = tuple(shards.balanced_owners(count, capacity, loads, self.settings.shard_load_slack, current))
        # One shard is one shared queue, as before sharding: every engine reads it as its own.
        owned = tuple(range(count)) if count == 1 and self.reading else \
            tuple(i for i, o in enumerate(owners) if o == self.consumer)
        self._claimed = owned if count > 1 else ()
        view = ShardView(count, owned, owners, frozenset(e for e, entry in peers.items() if entry.saturated),
                         self._handover(owned, count))
        if view.owned != self.view.owned:
            self.stats["ownership_changes"] += 1
            log.info("owning queue shards %s of %d (%d live engines)", list(view.owned), count, len(live))
        self._set_view(view)
        self.refresh_lanes()
        streams = self.all_streams()
        depth: dict[int, int] = {}
        for stream, (_, lag) in zip(streams, self._positions(streams), strict=True):
            if lag is not None:
                shard = self._shard_of.get(stream, 0)
                depth[shard] = depth.get(shard, 0) + lag
        self.shard_depth.update(depth)
        return view

    def _handover(self, owned: tuple[int, ...], count: int) -> frozenset[int]:
        """The shards this engine owned and lost less than ``SHARD_HANDOVER_BEATS`` heartbeats ago
        (none while draining): peers adopt a moved owner a beat apart, so until the new owner
        reads the shard, this engine takes its entries without waiting for the steal bound."""
        now = time.monotonic()
        if not self.reading or not self._viewed:  # the start's view (alone, owning all) hands nothing over
            self._viewed = self.reading
            self._handed_over.clear()
            return frozenset()
        for shard in set(self.view.owned) - set(owned):
            self._handed_over.setdefault(shard, now + SHARD_HANDOVER_BEATS * self.settings.heartbeat_interval_s)
        self._handed_over = {s: t for s, t in self._handed_over.items() if t > now and s not in owned and s < count}
        return frozenset(self._handed_over)

    def check_gateways(self, now: float | None = None) -> list[str]:
        """Abort the requests of gateways that are gone; return the ids of those found lost now.

        A gateway's key must be found missing at every check for ``gateway_lost_after_s``: Redis
        restarted without its data loses every live gateway's key as well, and those gateways put it
        back within a heartbeat of reconnecting. A check that fails (Redis away) resets the count.
        Requests of a lost gateway still held at a later check (delivered while it was being
        declared lost) are aborted then; a second abort of the same request does nothing.
        """
        if self.settings.gateway_lost_after_s <= 0:
            return []
        with self._held_lock:
            by_gateway: dict[str, list[str]] = {}
            for rid, gid in self._held.values():
                spec = self._logs.get(rid)
                if gid and rid and not (spec is not None and spec.detached):  # detached: never for gateway loss
                    by_gateway.setdefault(gid, []).append(rid)
        now = time.monotonic() if now is None else now
        with self._gateways_lock:
            for gid, since in list(self._gateways_lost.items()):
                if now - since > contract.CANCEL_MARKER_TTL_S and gid not in by_gateway:
                    del self._gateways_lost[gid]  # nothing of it can be queued any more
            known_lost = set(self._gateways_lost)
        for gid in list(self._gateway_missing):
            if gid not in by_gateway:
                del self._gateway_missing[gid]
        watched = [gid for gid in by_gateway if gid not in known_lost]
        lost: list[str] = []
        if watched:
            pipe = self.redis.pipeline(transaction=False)
            for gid in watched:
                pipe.exists(contract.gateway_key(gid))
            try:
                present = pipe.execute()
            except _REDIS_ERRORS:
                self._gateway_missing.clear()  # Redis may come back empty: every key counts afresh
                raise
            for gid, alive in zip(watched, present, strict=True):
                if alive:
                    self._gateway_missing.pop(gid, None)
                elif now - self._gateway_missing.setdefault(gid, now) >= self.settings.gateway_lost_after_s:
                    lost.append(gid)
        for gid in lost:
            del self._gateway_missing[gid]
            with self._gateways_lock:
                self._gateways_lost[gid] = now
            self.stats["gateways_lost"] += 1
            log.warning("gateway %s is gone (no liveness key for %.1fs): aborting its %d request(s)",
                        gid, self.settings.gateway_lost_after_s, len(by_gateway[gid]))
        orphaned = self._unleased([rid for gid in [*lost, *known_lost] for rid in by_gateway.get(gid, ())])
        if orphaned:
            self.inbox.put(CancelNote(orphaned, cause="gateway_lost"))
        return lost

    def _unleased(self, request_ids: list[str]) -> list[str]:
        """Those of a lost gateway's requests that nobody follows: a logged request whose lease
        (``contract.lease_key``) a resuming gateway holds is spared, while the lease lasts (checked
        again at every check; one pipelined EXISTS per logged request of a lost gateway)."""
        with self._held_lock:
            logged = [rid for rid in request_ids if (spec := self._logs.get(rid)) is not None and spec.logged]
        if not logged:
            return request_ids
        pipe = self.redis.pipeline(transaction=False)
        for rid in logged:
            pipe.exists(contract.lease_key(rid))
        leased = {rid for rid, held in zip(logged, pipe.execute(), strict=True) if held}
        return [rid for rid in request_ids if rid not in leased]

    def reclaim_orphans(self) -> int:
        """Take back our own pending entries that the worker does not hold: their XACK was lost
        (Redis crashed within its last fsync second, after our acknowledgement) or they belong to
        a previous life of this engine id. Left alone they would stay pending forever (no peer
        reclaims a live consumer's entries) and stop the stream's trim. They go through the
        reclaim path: errored (emitted, cancelled, expired) or restarted, and acknowledged."""
        return sum(self._reclaim_orphans(stream) for stream in self.all_streams())

    def _reclaim_orphans(self, stream: str) -> int:
        try:
            pending = self.redis.xpending_range(
                stream, contract.CONSUMER_GROUP, min="-", max="+", count=1000,
                consumername=self.consumer, idle=self.settings.orphan_idle_ms,
            )
        except redis.ResponseError:
            return 0
        with self._held_lock:
            orphans = [p for p in pending if EntryRef(stream, p["message_id"]) not in self._held]
        if not orphans:
            return 0
        ids = [p["message_id"] for p in orphans]
        deliveries = {p["message_id"]: int(p["times_delivered"]) for p in orphans}
        messages = self.redis.xclaim(
            stream, contract.CONSUMER_GROUP, self.consumer, self.settings.orphan_idle_ms, ids
        )
        entries = []
        for entry_id, fields in messages:
            with self._held_lock:
                if EntryRef(stream, entry_id) in self._held:  # delivered meanwhile: ours after all
                    continue
            entry = parse_entry(EntryRef(stream, entry_id), fields)
            entry.shard = self._shard_of.get(stream, 0)
            entry.reclaimed = True
            entry.deliveries = deliveries.get(entry_id, 1)
            entries.append(entry)
        claimed = {e for e, _ in messages}
        gone = [i for i in ids if i not in claimed]  # deleted entries: nothing to run, just forget them
        if gone:
            self.redis.xack(stream, contract.CONSUMER_GROUP, *gone)
        if entries:
            log.warning("took back %d orphaned pending entries of our own (lost acknowledgements?)", len(entries))
            self.stats["orphans"] += len(entries)
            self._deliver(entries)
        return len(entries) + len(gone)

    def tidy(self) -> None:
        """Trim the streams' acknowledged entries, remove the tenants' lanes that stayed empty and
        idle, and forget dead engines' registry entries."""
        for stream in self.all_streams():
            _, removed = trim_stream(self.redis, stream)
            self.stats["trimmed"] += removed
        self.remove_idle_lanes()
        self.stats["pruned_engines"] += self.prune_registry()

    def remove_idle_lanes(self, now_ms: int | None = None) -> int:
        """Remove each tenant's lane that holds nothing and took no entry for
        ``contract.LANE_IDLE_S`` (``contract.LANE_REMOVE_SCRIPT``: the stream and its name in the
        lanes set, in one step); returns how many went."""
        if not self.lanes:
            return 0
        if self._lane_remove is None:
            self._lane_remove = self.redis.register_script(contract.LANE_REMOVE_SCRIPT)
        now_ms = self._redis_ms() if now_ms is None else now_ms
        removed = 0
        for shard, names in list(self.lanes.items()):
            for name in names:
                removed += int(self._lane_remove(
                    keys=[contract.lane_stream(self.model, shard, name), contract.lanes_key(self.model, shard)],
                    args=[name, now_ms, contract.LANE_IDLE_S * 1000]) or 0)
        if removed:
            log.info("removed %d idle tenant lanes", removed)
            self.refresh_lanes()
        return removed

    def prune_registry(self) -> int:
        """Remove registry entries (``sluice:engines``) of engines whose liveness key is gone and
        whose last heartbeat is older than the TTL: a kill -9'd engine never deregisters itself.
        A live engine removed by a race puts itself back with its next heartbeat."""
        entries = self.redis.hgetall(contract.ENGINES_KEY)
        others = [(_str(k), v) for k, v in entries.items() if _str(k) != self.consumer]
        if not others:
            return 0
        pipe = self.redis.pipeline(transaction=False)
        for engine_id, _ in others:
            pipe.exists(contract.engine_key(engine_id))
        alive = pipe.execute()
        now = time.time()
        dead = []
        for (engine_id, raw), ok in zip(others, alive, strict=True):
            if ok:
                continue
            entry = registry.decode(raw)
            beat = entry.heartbeat if entry is not None else 0.0
            if now - beat > self.settings.heartbeat_ttl_s:
                dead.append(engine_id)
        if dead:
            self.redis.hdel(contract.ENGINES_KEY, *dead)
            log.info("removed registry entries of gone engines: %s", ", ".join(dead))
        return len(dead)

    def prune_consumers(self) -> None:
        """Forget consumers (dead engines) that own nothing and whose liveness key is gone, so the
        group does not grow with every engine restart. A live one removed by a race is recreated
        by its next XREADGROUP."""
        for stream in self.all_streams():
            self._prune_consumers(stream)

    def _prune_consumers(self, stream: str) -> None:
        try:
            consumers = self.redis.xinfo_consumers(stream, contract.CONSUMER_GROUP)
        except redis.ResponseError:
            return
        ttl_ms = self.settings.heartbeat_ttl_s * 1000
        for c in consumers:
            name = c["name"].decode() if isinstance(c["name"], bytes) else c["name"]
            if name == self.consumer or c.get("pending", 0) or c.get("idle", 0) < 2 * ttl_ms:
                continue
            if not self.redis.exists(contract.engine_key(name)):
                self.redis.xgroup_delconsumer(stream, contract.CONSUMER_GROUP, name)
                log.info("removed consumer %s of a gone engine", name)

    def reclaim(self, include_self: bool = False) -> int:
        """XCLAIM the pending entries of consumers whose liveness key is gone (and, once at start,
        our own: a restarted engine with a fixed id owns entries of its previous life), shard by
        shard: whoever finds a dead consumer's entries first takes them (XCLAIM's min-idle keeps
        two reclaimers from both winning one), whichever shards they are on."""
        streams = self.all_streams()
        pipe = self.redis.pipeline(transaction=False)
        for stream in streams:
            pipe.xpending(stream, contract.CONSUMER_GROUP)
        summaries = []
        for stream, summary in zip(streams, pipe.execute(raise_on_error=False), strict=True):
            if isinstance(summary, redis.ResponseError):
                if "NOGROUP" in str(summary) or "no such key" in str(summary).lower():
                    continue
                raise summary
            if isinstance(summary, Exception):
                raise summary
            names = [_str(c["name"]) for c in summary.get("consumers") or []]
            if names:
                summaries.append((stream, names))
        others = sorted({c for _, names in summaries for c in names if c != self.consumer})
        alive: dict[str, bool] = {}
        if others:
            pipe = self.redis.pipeline(transaction=False)
            for c in others:
                pipe.exists(contract.engine_key(c))
            alive = dict(zip(others, pipe.execute(), strict=True))
        claimed = 0
        for stream, names in summaries:
            dead = [c for c in names if c != self.consumer and not alive.get(c, True)]
            if include_self and self.consumer in names:
                dead.append(self.consumer)
            for consumer in dead:
                claimed += self._claim(stream, consumer)
        return claimed

    def _claim(self, stream: str, consumer: str) -> int:
        pending = self.redis.xpending_range(
            stream, contract.CONSUMER_GROUP, min="-", max="+", count=1000, consumername=consumer
        )
        ids = [p["message_id"] for p in pending]
        if not ids:
            return 0
        deliveries = {p["message_id"]: int(p["times_delivered"]) for p in pending}
        min_idle = 0 if consumer == self.consumer else self.settings.reclaim_min_idle_ms
        messages = self.redis.xclaim(stream, contract.CONSUMER_GROUP, self.consumer, min_idle, ids)
        entries = []
        for entry_id, fields in messages:
            entry = parse_entry(EntryRef(stream, entry_id), fields)
            entry.reclaimed = True
            entry.deliveries = deliveries.get(entry_id, 1) + 1
            entry.shard = self._shard_of.get(stream, 0)
            entries.append(entry)
        if entries:
            log.warning("reclaimed %d pending entries of dead engine %s on %s", len(entries), consumer, stream)
            self.stats["reclaimed"] += len(entries)
            self.metrics.reclaimed(len(entries))
            self._deliver(entries)
        return len(entries)
