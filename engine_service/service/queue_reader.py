"""The reader and canceller threads of ``RedisIO`` (a mixin): everything that reaches the worker's
inbox from Redis. The reader takes entries of the queue's shards and lanes within the worker's credit
(``RedisIO``'s docstring tells how) and sets their owner markers; the canceller hears the cancels that
those owner markers route to this engine. Apart from the publisher and the housekeeper: only these
threads read what the gateways send."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Any

import redis

from engine_service.core.fair_share import FairView
from engine_service.service.io_types import (
    Batch,
    CancelNote,
    Entry,
    EntryRef,
    LogSpec,
    ShardView,
    _str,
    parse_entry,
)
from engine_service.service.metrics import NullMetrics
from sluice.wire import codec, contract, policy, shards, tenants
from sluice.wire.connection import TRANSIENT_ERRORS as _REDIS_ERRORS
from sluice.wire.connection import read_shard_message, refresh_topology
from sluice.wire.messages_pb2 import Cancel

log = logging.getLogger("sluice.engine.io")

# How often the reader looks up the shards' lanes (a tenant's first entry in a new lane waits this
# long at most, beyond the read); the housekeeper also does at each heartbeat.
LANE_REFRESH_S = 0.1
# Errors of a read naming a lane that was just removed (it holds nothing): look the lanes up again.
_GONE_LANE = ("NOGROUP", "UNBLOCKED")


def owner_ttl_s(deadline: float, now: float | None = None) -> int:
    """The owner marker's TTL: past the request's deadline by the in-flight margin (a dead engine's
    markers expire on their own); an hour without a deadline."""
    if not deadline:
        return contract.EMITTED_TTL_S
    now = time.time() if now is None else now
    return max(1, int(deadline - now) + contract.INFLIGHT_MARGIN_S)


class QueueReader:
    """The reader's and the canceller's methods of ``RedisIO``, whose ``__init__`` sets the attributes
    below; they also call its ``_backoff``, ``_credit`` and ``_read_ahead``. The housekeeper uses
    ``_deliver`` (reclaimed entries), ``_set_view``, ``refresh_lanes``, ``all_streams``,
    ``_positions`` and ``_redis_ms``."""

    settings: Any
    model: str
    consumer: str
    view: ShardView
    streams: list[str]
    lanes: dict[int, tuple[str, ...]]
    _shard_of: dict[str, int]
    _tenant_of: dict[str, str]
    _lanes_due: float
    _grouped: set[str]
    _rotation: int
    _next_probe: float
    _room_shown: bool | None
    _shard_load: shards.ShardLoad
    _shard_load_lock: threading.Lock
    inbox: queue.SimpleQueue
    redis: Any
    _take_sha: str
    _can_block: bool
    _reply_to: dict[str, str]
    _logs: dict[str, LogSpec]
    outbox: queue.Queue[Batch | None]
    _stop: threading.Event
    _credit_lock: threading.Condition
    _read_lock: threading.Lock
    _delivered: int
    _fair: FairView
    _inflight_tenants: deque[str]
    _next_read_ahead: float
    _held: dict[bytes, tuple[str, str]]
    _held_lock: threading.Lock
    _gateways_lost: dict[str, float]
    _gateways_lock: threading.Lock
    reading: bool
    connected: threading.Event
    own_reclaimed: threading.Event
    stats: dict[str, int]
    metrics: NullMetrics

    # --- reader ---
    def _ensure_groups(self, streams: list[str]) -> None:
        for stream in streams:
            if stream in self._grouped:
                continue
            try:
                self.redis.xgroup_create(stream, contract.CONSUMER_GROUP, id="0", mkstream=True)
                log.debug("created consumer group %s on %s", contract.CONSUMER_GROUP, stream)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
            self._grouped.add(stream)

    def _set_view(self, view: ShardView) -> None:
        """Adopt a new view (housekeeper): more shards than before extend the streams served."""
        if view.count > len(self.streams):
            log.info("serving %d queue shards (an engine of the model published that many)", view.count)
            self.streams = contract.request_streams(self.model, view.count)
            self._set_lanes(self.lanes)
        self.view = view

    # --- lanes ---
    def shard_lanes(self, shard: int) -> list[tuple[str, str]]:
        """(tenant, stream) of each lane of a shard: the default tenant's (the shard's stream) first."""
        lanes = [("", self.streams[shard])]
        lanes += [(t, contract.lane_stream(self.model, shard, t)) for t in self.lanes.get(shard, ())]
        return lanes

    def all_streams(self) -> list[str]:
        """Every lane's stream of every shard served."""
        return [stream for shard in range(len(self.streams)) for _, stream in self.shard_lanes(shard)]

    def refresh_lanes(self) -> dict[int, tuple[str, ...]]:
        """Look up each shard's lanes set (one pipelined round trip). A member that is not a valid
        tenant id is ignored: the engine trusts nothing it reads."""
        count = len(self.streams)
        pipe = self.redis.pipeline(transaction=False)
        for shard in range(count):
            pipe.smembers(contract.lanes_key(self.model, shard))
        lanes: dict[int, tuple[str, ...]] = {}
        for shard, members in enumerate(pipe.execute(raise_on_error=False)):
            if isinstance(members, Exception):  # that node is away: keep what we knew
                if shard in self.lanes:
                    lanes[shard] = self.lanes[shard]
                continue
            names = sorted({t for t in map(_str, members) if t and tenants.check_tenant_id(t) is None})
            if names:
                lanes[shard] = tuple(names)
        if lanes != self.lanes:
            self._set_lanes(lanes)
        return lanes

    def _set_lanes(self, lanes: dict[int, tuple[str, ...]]) -> None:
        shard_of = {stream: i for i, stream in enumerate(self.streams)}
        tenant_of = {}
        for shard, names in lanes.items():
            for name in names:
                stream = contract.lane_stream(self.model, shard, name)
                shard_of[stream], tenant_of[stream] = shard, name
        # each attribute swapped whole: the other threads read one or the other, never a half
        self._shard_of, self._tenant_of, self.lanes = shard_of, tenant_of, lanes

    def _reader_loop(self) -> None:
        backoff = self._backoff("reader")
        idle_s = 0.001
        while not self._stop.is_set():
            if not self.own_reclaimed.is_set():
                self.own_reclaimed.wait(0.1)
                continue
            with self._credit_lock:
                credit = self._credit()
                ahead = self._read_ahead()
            if (credit > 0) != self._room_shown:
                self._show_room(credit > 0)
            if credit <= 0 and ahead <= 0:
                with self._credit_lock:
                    if self._credit() <= 0 and self._read_ahead() <= 0:
                        self._credit_lock.wait(0.1)
                continue
            if credit <= 0 and not self._can_block:  # a cluster: look for takers every steal_probe_ms
                wait = self._next_read_ahead - time.monotonic()
                if wait > 0:
                    self._stop.wait(wait)
                    continue
                self._next_read_ahead = time.monotonic() + self.settings.steal_probe_ms / 1000
            self._read_lock.acquire()
            try:
                if not self.reading:  # stopped since the credit was read
                    continue
                if credit <= 0:  # one Redis server: wait on the takers' lanes for steal_probe_ms
                    entries = self._wait_for_takers(ahead)
                else:
                    entries = self.read(min(credit, self.settings.max_read_batch), ahead)
                if not entries and credit > 0 and self._can_block:
                    entries = self._wait_for_entries()
                backoff.ok()
                self.connected.set()
                if entries:
                    self._deliver(entries)
            except _REDIS_ERRORS as exc:
                log.warning("reader: Redis unavailable (%s); retrying", exc)
                self._grouped.clear()
                backoff.fail(self._stop)
                continue
            except redis.ResponseError as exc:
                self._grouped.clear()
                if any(word in str(exc) for word in _GONE_LANE):
                    # Redis lost a stream (restart without persistence), or a lane read was removed
                    self._lanes_due = 0.0
                    continue
                log.error("XREADGROUP failed: %s", exc)
                backoff.fail(self._stop)
                continue
            finally:
                self._read_lock.release()
            if entries:
                idle_s = 0.001
            elif not self._can_block:  # an idle queue on a cluster: pause a little, longer each time
                self._stop.wait(idle_s)
                idle_s = min(idle_s * 2, self.settings.read_idle_ms / 1000)

    def _wait_for_entries(self) -> list[Entry]:
        """One Redis server: after an empty read, BLOCK on the owned shards' streams in ONE
        XREADGROUP (COUNT 1 each) until an entry comes, or until the next look at other shards is
        due (``steal_probe_ms``; ``read_block_ms`` when there are none). An idle engine so costs
        nothing and a new entry is read at once. Only an entry that lands between the empty read
        and this one can make the read return more than one (one per shard at most)."""
        view = self.view
        owned = [stream for i in view.owned if i < len(self.streams) for _, stream in self.shard_lanes(i)]
        others = view.count > len([i for i in view.owned if i < len(self.streams)])
        if not owned:
            self._stop.wait(self.settings.steal_probe_ms / 1000)
            return []
        reply = self.redis.xreadgroup(contract.CONSUMER_GROUP, self.consumer, {s: ">" for s in owned}, count=1,
                                      block=self.settings.steal_probe_ms if others else self.settings.read_block_ms)
        entries = []
        for name, messages in reply or []:
            stream = _str(name)
            for eid, fields in messages:
                entry = parse_entry(EntryRef(stream, eid), fields)
                entry.shard = self._shard_of.get(stream, 0)
                entries.append(entry)
        return entries

    def _wait_for_takers(self, ahead: int) -> list[Entry]:
        """One Redis server, no credit, a read-ahead allowed: BLOCK (up to ``steal_probe_ms``, so
        that credit coming back waits no longer) on the lanes of the owned shards of up to ``ahead``
        tenants that could take a slot (``FairView.may_take_slot``) and have nothing on their way
        (least virtual time first, equal ones in turn), COUNT 1 each: such a tenant's request is read
        the moment it lands instead of at the next look. On a cluster the reader looks every
        ``steal_probe_ms`` instead (``read``)."""
        self._refresh_lanes_when_due()
        with self._credit_lock:
            fair, on_the_way = self._fair, set(self._inflight_tenants)
        owned = [shard for shard in self.view.owned if shard < len(self.streams)]
        lanes = [(shard, tenant, stream) for shard in owned for tenant, stream in self.shard_lanes(shard)
                 if tenant not in on_the_way and fair.may_take_slot(tenant)]
        names = sorted({tenant for _, tenant, _ in lanes})
        if names:
            k = self._rotation % len(names)
            self._rotation += 1
            chosen = set(sorted(names[k:] + names[:k], key=fair.priority)[:ahead])
            lanes = [lane for lane in lanes if lane[1] in chosen]
        streams = {stream: shard for shard, _, stream in lanes}
        if not streams:
            with self._credit_lock:
                self._credit_lock.wait(self.settings.steal_probe_ms / 1000)
            return []
        reply = self.redis.xreadgroup(contract.CONSUMER_GROUP, self.consumer, dict.fromkeys(streams, ">"), count=1,
                                      block=self.settings.steal_probe_ms)
        entries = []
        for name, messages in reply or []:
            stream = _str(name)
            for eid, fields in messages:
                entry = parse_entry(EntryRef(stream, eid), fields)
                entry.shard = streams.get(stream, 0)
                entries.append(entry)
        return entries

    def _refresh_lanes_when_due(self) -> None:
        now = time.monotonic()
        if now >= self._lanes_due:
            self._lanes_due = now + LANE_REFRESH_S
            self.refresh_lanes()

    def _show_room(self, room: bool) -> None:
        """Tell peers at once whether this engine can take more (``contract.room_key``): while it
        cannot, they take its shards' entries without waiting for the steal bound."""
        try:
            self.redis.set(contract.room_key(self.consumer), b"1" if room else b"0",
                           px=int(self.settings.heartbeat_ttl_s * 1000))
            self._room_shown = room
        except _REDIS_ERRORS + (redis.RedisError,) as exc:
            log.debug("reader: could not publish room (%s)", exc)

    def read(self, count: int, ahead: int = 0) -> list[Entry]:
        """At most ``count`` new entries: own shards first, then what may be stolen; and with
        tenants' lanes, up to ``ahead`` more, one per tenant absent from the engine."""
        view = self.view
        streams = self.streams
        self._ensure_groups(streams)
        self._refresh_lanes_when_due()
        now = time.monotonic()
        owned = [i for i in view.owned if i < len(streams)]
        if self.lanes:
            entries = self._read_fair(owned, count, ahead)
        else:  # one lane a shard (no tenants): the shards' credit split
            entries = self._read_shards(owned, count) if owned else []
        room = count - len(entries)
        if room > 0 and now >= self._next_probe:
            self._next_probe = now + self.settings.steal_probe_ms / 1000
            stolen = self._read_stolen(self.steal_candidates(view, streams), room)
            if stolen:
                self.stats["stolen"] += len(stolen)
                log.debug("took %d entries of shards this engine does not own", len(stolen))
            entries += stolen
        return entries

    def _read_shards(self, shard_ids: list[int], count: int) -> list[Entry]:
        """The own shards' default lanes, the credit split so that the total never exceeds
        ``count``: a credit shorter than the shards goes to those with unread entries, a rotating
        subset when they are still more."""
        if not shard_ids or count <= 0:
            return []
        if count < len(shard_ids):
            # Less credit than shards: look first which hold unread entries (one more pipelined
            # round trip), so that the credit goes to those rather than to empty ones.
            positions = self._positions([self.streams[i] for i in shard_ids])
            shard_ids = [i for i, (last, lag) in zip(shard_ids, positions, strict=True) if last is None or lag != 0]
            if not shard_ids:
                return []
        k = self._rotation % len(shard_ids)
        shard_ids = shard_ids[k:] + shard_ids[:k]
        self._rotation += 1
        shard_ids = shard_ids[:count]
        base, extra = divmod(count, len(shard_ids))
        return self._xread([(shard, self.streams[shard], base + (1 if i < extra else 0))
                            for i, shard in enumerate(shard_ids)])

    def _read_stolen(self, targets: list[tuple[int, str]], count: int) -> list[Entry]:
        """Other shards' lanes, in the order given (``steal_candidates``), the credit split."""
        targets = targets[:count]
        if not targets or count <= 0:
            return []
        base, extra = divmod(count, len(targets))
        return self._xread([(shard, stream, base + (1 if i < extra else 0))
                            for i, (shard, stream) in enumerate(targets)], stolen=True)

    def _read_fair(self, shard_ids: list[int], count: int, ahead: int) -> list[Entry]:
        """The own shards' lanes in fair-share order: the lanes' unread entries first (one
        pipelined round trip), then ``count`` entries dealt one at a time to the tenants in order
        of least virtual time (``FairView.priority``; an absent tenant's is the least), round after
        round while they have entries; then ``ahead`` more, one per tenant that could take a slot
        (``FairView.may_take_slot``) and has nothing on its way. A tenant's entries come from its
        lanes in rotating order."""
        if not shard_ids or count + ahead <= 0:
            return []
        with self._credit_lock:
            fair, on_the_way = self._fair, set(self._inflight_tenants)
        lanes = [(shard, tenant, stream) for shard in shard_ids for tenant, stream in self.shard_lanes(shard)]
        if count <= 0:  # a look for takers only (every steal_probe_ms while saturated): their lanes alone
            lanes = [lane for lane in lanes if lane[1] not in on_the_way and fair.may_take_slot(lane[1])]
            if not lanes:
                return []
        positions = self._positions([stream for _, _, stream in lanes])
        by_tenant: dict[str, list[list]] = {}  # tenant -> [[shard, stream, unread], ...]
        for (shard, tenant, stream), (last, lag) in zip(lanes, positions, strict=True):
            if tenant and last is None:
                continue  # a lane without its group: removed meanwhile
            if lag is None:
                lag = count + ahead  # unknown (no group yet on a default lane, or Redis cannot tell)
            if lag > 0:
                by_tenant.setdefault(tenant, []).append([shard, stream, lag])
        if not by_tenant:
            return []
        names = sorted(by_tenant)
        k = self._rotation % len(names)
        self._rotation += 1
        order = sorted(names[k:] + names[:k], key=fair.priority)  # stable: equal priorities rotate
        unread = {t: sum(lane[2] for lane in by_tenant[t]) for t in order}
        dealt = dict.fromkeys(order, 0)
        left = count
        while left > 0 and any(dealt[t] < unread[t] for t in order):
            for t in order:
                if left > 0 and dealt[t] < unread[t]:
                    dealt[t] += 1
                    left -= 1
        for t in order:
            if ahead <= 0:
                break
            if not dealt[t] and t not in on_the_way and fair.may_take_slot(t):
                dealt[t] = 1
                ahead -= 1
        alloc: list[tuple[int, str, int]] = []
        for t in order:
            tenant_lanes = by_tenant[t]
            j = self._rotation % len(tenant_lanes)
            tenant_lanes = tenant_lanes[j:] + tenant_lanes[:j]
            n = dealt[t]
            while n > 0:
                for lane in tenant_lanes:
                    if n > 0 and lane[2] > 0:
                        take = 1 if len(tenant_lanes) > 1 else min(n, lane[2])
                        lane[2] -= take
                        n -= take
                        alloc.append((lane[0], lane[1], take))
        merged: dict[tuple[int, str], int] = {}
        for shard, stream, n in alloc:
            merged[(shard, stream)] = merged.get((shard, stream), 0) + n
        return self._xread([(shard, stream, n) for (shard, stream), n in merged.items()])

    def _xread(self, alloc: list[tuple[int, str, int]], stolen: bool = False) -> list[Entry]:
        """One pipelined, non-blocking XREADGROUP per (shard, stream, count) (a cluster pipeline
        sends each node its part)."""
        if not alloc:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for _, stream, n in alloc:
            pipe.xreadgroup(contract.CONSUMER_GROUP, self.consumer, {stream: ">"}, count=n)
        # A failing node (a cluster failover) must not hide what the others delivered: those
        # entries are ours now, pending; dropping them would leave them to the orphan check.
        replies = pipe.execute(raise_on_error=False)
        entries = []
        failed: list[Exception] = []
        for (shard, stream, _), reply in zip(alloc, replies, strict=True):
            if isinstance(reply, Exception):
                failed.append(reply)
                self._grouped.discard(stream)
                continue
            for _, messages in reply or []:
                for eid, fields in messages:
                    entry = parse_entry(EntryRef(stream, eid), fields)
                    entry.shard, entry.stolen = shard, stolen
                    entries.append(entry)
        if failed and not entries:
            raise failed[0]
        if failed:
            log.warning("reader: %d of %d lane reads failed (%s)", len(failed), len(alloc), failed[0])
        return entries

    def steal_candidates(self, view: ShardView, streams: list[str]) -> list[tuple[int, str]]:
        """The other shards' lanes whose oldest undelivered entry may be taken now, as (shard,
        stream): it waited ``steal_after_ms``, or its shard has no live owner, or the owner is
        saturated; oldest first, and with tenants' lanes in fair-share order first. Two pipelined
        round trips: each group's read position (and lag), then the first entry after it (its id
        is its enqueue time)."""
        owned = set(view.owned)
        others = [(i, tenant, stream) for i in range(len(streams)) if i not in owned
                  for tenant, stream in self.shard_lanes(i)]
        if not others:
            return []
        positions = self._positions([stream for _, _, stream in others])
        looked = [(i, tenant, stream, last) for (i, tenant, stream), (last, lag) in zip(others, positions, strict=True)
                  if last is not None and lag != 0]
        if not looked:
            return []
        owners = sorted({o for i, *_ in looked if (o := view.owners[i] if i < len(view.owners) else None)})
        pipe = self.redis.pipeline(transaction=False)
        for _, _, stream, last in looked:
            pipe.xrange(stream, min="(" + last, count=1)
        for o in owners:
            pipe.get(contract.room_key(o))
        replies = pipe.execute(raise_on_error=False)
        firsts, rooms = replies[:len(looked)], dict(zip(owners, replies[len(looked):], strict=True))
        # no room: its reader's credit is spent (or it has not said so: hung, dying)
        full = {o for o, room in rooms.items() if room in (b"0", "0", None)} | set(view.saturated)
        now_ms = self._redis_ms()
        fair = self._fair
        ready: list[tuple[tuple[float, float], int, int, str]] = []
        for (i, tenant, stream, _), first in zip(looked, firsts, strict=True):
            if isinstance(first, Exception) or not first:
                continue
            age = now_ms - shards.entry_ms(first[0][0])
            owner = view.owners[i] if i < len(view.owners) else None
            if age >= self.settings.steal_after_ms or owner is None or owner in full or i in view.handed_over:
                ready.append((fair.priority(tenant) if self.lanes else (0.0, 0.0), -age, i, stream))
        return [(i, stream) for _, _, i, stream in sorted(ready)]

    def _positions(self, streams: list[str]) -> list[tuple[str | None, int | None]]:
        """Per stream: the group's last-delivered id and lag (None where unknown); (None, None)
        for a stream without the group."""
        pipe = self.redis.pipeline(transaction=False)
        for stream in streams:
            pipe.xinfo_groups(stream)
        out: list[tuple[str | None, int | None]] = []
        for groups in pipe.execute(raise_on_error=False):
            found: tuple[str | None, int | None] = (None, None)
            if not isinstance(groups, Exception):
                for g in groups:
                    if _str(g.get("name", b"")) == contract.CONSUMER_GROUP:
                        lag = g.get("lag")
                        found = (_str(g.get("last-delivered-id", b"0-0")), None if lag is None else int(lag))
            out.append(found)
        return out

    def _redis_ms(self) -> int:
        """Now, by this host's clock, in ms (entry ids carry Redis's clock; the two agree on one
        host, and across hosts within NTP's error, small beside ``steal_after_ms``)."""
        return int(time.time() * 1000)

    def _deliver(self, entries: list[Entry]) -> None:
        """Check markers in one round trip, then hand the entries to the worker."""
        known = [e for e in entries if e.request is not None]
        if known:
            try:
                for e, (cancelled, emitted) in zip(known, self._take(known), strict=True):
                    e.cancelled = bool(cancelled)
                    e.emitted = bool(emitted) and (e.reclaimed or e.request.attempt > 0)
            except _REDIS_ERRORS + (redis.RedisError,) as exc:
                # The entries are ours now (pending), but no owner marker names us: a cancel of one
                # of them only leaves its marker, which a reclaim or hand-back would see.
                log.warning("could not check markers: %s", exc)
        entries = self._answer_lost(entries)
        with self._gateways_lock:
            if self._gateways_lost:
                for e in entries:
                    if e.request is not None and e.request.gateway_id in self._gateways_lost and not e.request.detached:
                        e.gateway_lost = True
        with self._held_lock:
            for e in entries:
                rid, gid = (e.request.request_id, e.request.gateway_id) if e.request is not None else ("", "")
                self._held[e.entry_id] = (rid, gid)
                if e.request is not None:
                    self._reply_to[rid] = e.request.reply_to
                    if (spec := LogSpec.of(e.request)) is not None:
                        self._logs[rid] = spec
        now = time.monotonic()
        with self._shard_load_lock:
            for e in entries:
                if e.request is not None and not e.reclaimed:
                    self._shard_load.add(e.shard, len(e.request.prompt_token_ids), now)
        with self._credit_lock:
            self._delivered += len(entries)
            self._inflight_tenants.extend(e.request.tenant if e.request is not None else "" for e in entries)
        for e in entries:
            self.inbox.put(e)

    def _take(self, entries: list[Entry]) -> list[Any]:
        """``contract.TAKE_SCRIPT`` for each entry, pipelined (one round trip; a cluster pipeline
        sends each node its part): its (cancelled, emitted) flags, and the owner marker naming this
        engine, so that cancels of these requests come here. EVALSHA; a Redis that lost the script
        (a restart, a failover to a node that never saw it) gets it loaded, and the round trip is
        made again (the script is idempotent)."""
        for attempt in (0, 1):
            pipe = self.redis.pipeline(transaction=False)
            for e in entries:
                rid, reply_to = e.request.request_id, e.request.reply_to
                pipe.evalsha(self._take_sha, 3, contract.cancelled_key(reply_to, rid),
                             contract.emitted_key(reply_to, rid), contract.owner_key(reply_to, rid),
                             self.consumer, owner_ttl_s(e.request.deadline))
            replies = pipe.execute(raise_on_error=False)
            if attempt == 0 and any(isinstance(r, redis.exceptions.NoScriptError) for r in replies):
                self.redis.script_load(contract.TAKE_SCRIPT)
                continue
            for reply in replies:
                if isinstance(reply, Exception):
                    raise reply
            return replies
        raise AssertionError("unreachable")

    def _answer_lost(self, entries: list[Entry]) -> list[Entry]:
        """Reclaimed entries whose request already emitted tokens (or that were delivered too
        often) need no model: answer them here, at once (error event + XACK in one round trip),
        instead of waiting for the step loop's next iteration."""
        reasons = {
            id(e): reason
            for e in entries
            if e.request is not None and e.reclaimed and not e.cancelled
            and (reason := policy.lost_on_delivery(emitted=e.emitted, deliveries=e.deliveries,
                                                   attempt=e.request.attempt)) is not None
        }
        lost = [e for e in entries if id(e) in reasons]
        if not lost:
            return entries
        batch = Batch()
        for e in lost:
            reason = reasons[id(e)]
            batch.events.append(codec.error_event(e.request.request_id, contract.ERR_ENGINE_LOST, reason, self.consumer))
            batch.reply_to[e.request.request_id] = e.request.reply_to
            batch.released[e.request.request_id] = e.request.reply_to
            if (spec := LogSpec.of(e.request)) is not None:
                batch.logs[e.request.request_id] = spec
            batch.acks.append(e.entry_id)
            log.warning("reclaimed %s: %s", e.request.request_id, reason)
        self.metrics.events(batch.events)
        self.outbox.put(batch)  # the publisher sends it now (it is idle between steps' batches)
        lost_ids = {id(e) for e in lost}
        return [e for e in entries if id(e) not in lost_ids]

    # --- canceller ---
    def _cancel_loop(self) -> None:
        backoff = self._backoff("canceller")
        while not self._stop.is_set():
            pubsub = self.redis.pubsub()
            try:
                pubsub.ssubscribe(contract.cancel_channel(self.consumer))  # the cancels of our requests
                backoff.ok()
                while not self._stop.is_set():
                    message = read_shard_message(pubsub, 0.2)
                    if not message or message.get("type") not in (b"smessage", "smessage"):
                        continue
                    cancel = Cancel()
                    try:
                        cancel.ParseFromString(message["data"])
                    except Exception as exc:
                        log.warning("ignoring an undecodable Cancel: %s", exc)
                        continue
                    if cancel.request_ids:
                        self.inbox.put(CancelNote(list(cancel.request_ids)))
            except _REDIS_ERRORS + (redis.RedisError,) as exc:
                log.warning("canceller: Redis unavailable (%s); resubscribing", exc)
                backoff.fail(self._stop)
                try:  # a cluster's channel may now be served by a promoted replica
                    refresh_topology(self.redis)
                except _REDIS_ERRORS + (redis.RedisError,):
                    pass
            finally:
                try:
                    pubsub.close()
                except Exception:
                    pass
