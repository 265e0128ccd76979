"""The publisher thread of ``RedisIO`` (a mixin): sends each of the worker's batches (markers,
events, event logs, usage, hand-backs, XACKs) in one round trip, retrying while Redis is away. Apart
from the reader and the housekeeper: it is the only writer of what the clients receive."""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

import redis

from engine_service.service.io_types import Batch, EntryRef, LogSpec
from sluice.wire import codec, contract, event_log, usage
from sluice.wire.connection import TRANSIENT_ERRORS as _REDIS_ERRORS
from sluice.wire.messages_pb2 import Event, GenerateRequest

log = logging.getLogger("sluice.engine.io")


class EventPublisher:
    """The publisher's methods of ``RedisIO``, whose ``__init__`` sets the attributes below; they also
    call its ``_backoff``. ``send`` is the worker's way in."""

    settings: Any
    consumer: str
    streams: list[str]
    redis: Any
    _reply_to: dict[str, str]
    _logs: dict[str, LogSpec]
    _log_started: set[str]
    outbox: queue.Queue[Batch | None]
    _carry_acks: list[bytes]
    _never: threading.Event
    _held: dict[bytes, tuple[str, str]]
    _held_lock: threading.Lock
    stats: dict[str, int]

    def send(self, batch: Batch) -> None:
        if batch:
            self.outbox.put(batch)

    # --- publisher ---
    def _publisher_loop(self) -> None:
        while True:
            batch = self.outbox.get()
            if batch is None:
                return
            # Coalesce whatever else is waiting: still one round trip, fewer of them.
            stop_after = False
            while True:
                try:
                    more = self.outbox.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop_after = True
                    break
                batch.extend(more)
            self._publish(batch)
            if stop_after:
                return

    def _publish(self, batch: Batch) -> None:
        if self._carry_acks:
            batch.acks = self._carry_acks + batch.acks
            self._carry_acks = []
        backoff = self._backoff("publisher")
        give_up = time.monotonic() + self.settings.publish_retry_s
        while True:
            try:
                results = self._send(batch)
                for result in results:
                    if isinstance(result, Exception):
                        log.warning("publish: a command failed: %s", result)
                self.stats["published_batches"] += 1
                if batch.acks:
                    with self._held_lock:
                        for entry_id in batch.acks:
                            rid, _ = self._held.pop(entry_id, ("", ""))
                            self._reply_to.pop(rid, None)
                            self._logs.pop(rid, None)
                            self._log_started.discard(rid)
                        for rid in batch.logs:
                            self._log_started.discard(rid)
                backoff.ok()
                return
            except _REDIS_ERRORS as exc:
                if time.monotonic() >= give_up:
                    # The events are stale (their subscribers lost the subscription with Redis);
                    # the acknowledgements are not: they ride with the next batch.
                    self.stats["dropped_batches"] += 1
                    self._carry_acks += batch.acks
                    log.error("publish: dropping %d events after %ss without Redis: %s", len(batch.events), self.settings.publish_retry_s, exc)
                    return
                self.stats["publish_retries"] += 1
                log.warning("publish: Redis unavailable (%s); retrying", exc)
                backoff.fail(self._never)
            except redis.RedisError as exc:
                log.error("publish: dropping a batch after error %s", exc)
                self.stats["dropped_batches"] += 1
                return

    def _send(self, batch: Batch) -> list[Any]:
        """One step's writes: emitted markers, then each reply_to's events as ONE message on its
        channel, then the XACKs (one pipeline, not a transaction: it spans slot families). With
        hand-backs, their XADDs and the XACKs go in one MULTI of the queue's slot instead."""
        by_request: dict[str, list[Event]] = {}  # each request's events of the batch, in order
        reply_of: dict[str, str] = {}
        with self._held_lock:
            for event in batch.events:
                rid = event.request_id
                reply_to = batch.reply_to.get(rid) or self._reply_to.get(rid)
                if reply_to is None:  # cannot happen for a delivered entry; never guess a channel
                    log.error("publish: no reply_to known for request %s; event dropped", rid)
                    continue
                by_request.setdefault(rid, []).append(event)
                reply_of[rid] = reply_to
            logged = {rid for rid in by_request
                      if (spec := batch.logs.get(rid) or self._logs.get(rid)) and spec.logged}
            replies = {rid: self._reply_to.get(rid) for rid in batch.emitted}
            acks, requeues = self._queue_writes(batch)
            let_go = {rid: self._reply_to.get(rid) for a in batch.acks if (rid := self._held.get(a, ("", ""))[0])}
            let_go.update(batch.released)
            requeued = {request.request_id for request in batch.requeue}  # handed back: not ended
            ended = {self._held[a][0] for a in batch.acks if a in self._held} - requeued
            ended |= set(batch.logs)
            log_specs = {rid: batch.logs.get(rid) or self._logs.get(rid) for rid in logged | ended}
            first_writes = {rid for rid in logged if rid not in self._log_started}
        # Each request's events encoded ONCE: the same bytes go in its part of the reply channel's
        # frame and, when it is logged, in its log.
        encoded = {rid: event_log.encode_entry(events) for rid, events in by_request.items()}
        by_reply: dict[str, list[tuple[str, bytes]]] = {}
        for rid, data in encoded.items():
            by_reply.setdefault(reply_of[rid], []).append((rid, data))
        pipe = self.redis.pipeline(transaction=False)
        for rid, reply_to in replies.items():
            if reply_to:
                pipe.set(contract.emitted_key(reply_to, rid), self.consumer, ex=contract.EMITTED_TTL_S)
        for reply_to, parts in by_reply.items():
            pipe.spublish(contract.events_channel(reply_to), codec.encode_frame(self.consumer, parts))
        self._append_logs(pipe, {rid: encoded[rid] for rid in logged}, log_specs, first_writes, ended)
        for rid, reply_to in let_go.items():  # acknowledged (ended or handed back): no longer ours
            if reply_to:
                pipe.delete(contract.owner_key(reply_to, rid))
        usage.record(pipe, batch.usage)
        for stream, ids in acks.items():
            if stream not in requeues:
                pipe.xack(stream, contract.CONSUMER_GROUP, *ids)
        results = pipe.execute(raise_on_error=False) if len(pipe) else []
        for stream, requests in requeues.items():  # one MULTI per shard: both in its slot
            multi = self.redis.pipeline(transaction=True)
            for request in requests:
                multi.xadd(stream, codec.encode_request(request))
            if acks.get(stream):
                multi.xack(stream, contract.CONSUMER_GROUP, *acks[stream])
            results += multi.execute(raise_on_error=False)
        return results

    def _queue_writes(self, batch: Batch) -> tuple[dict[str, list[bytes]], dict[str, list[GenerateRequest]]]:
        """The batch's XACKs by shard stream, and its hand-backs by the shard they came from (a
        hand-back goes back to ITS shard, with its XACK; call with ``_held_lock`` held)."""
        acks: dict[str, list[bytes]] = {}
        shard_of_request: dict[str, str] = {}
        for ref in batch.acks:
            stream, entry_id = (ref.stream, ref.id) if isinstance(ref, EntryRef) else (self.streams[0], ref)
            acks.setdefault(stream, []).append(entry_id)
            rid = self._held.get(ref, ("", ""))[0]
            if rid:
                shard_of_request[rid] = stream
        requeues: dict[str, list[GenerateRequest]] = {}
        for request in batch.requeue:
            stream = shard_of_request.get(request.request_id, self.streams[0])
            requeues.setdefault(stream, []).append(request)
        return acks, requeues

    def _append_logs(self, pipe: Any, by_log: dict[str, bytes], specs: dict[str, LogSpec | None],
                     first_writes: set[str], ended: set[str]) -> None:
        """The event-log part of a step's pipeline (``sluice.wire.event_log``): one RPUSH per logged
        request with events in this step (the bytes of its part of the frame); an EXPIRE to
        (deadline + window) with its first write, and to the window alone for log and record when
        the request ends here. No extra round trip."""
        for rid, element in by_log.items():
            pipe.rpush(contract.log_key(rid), element)
            spec = specs[rid]
            if rid in first_writes and rid not in ended and spec is not None:
                pipe.expire(contract.log_key(rid), event_log.ttl_until_end(spec.deadline, spec.ttl_s))
        for rid in ended:
            spec = specs.get(rid)
            if spec is not None and spec.logged:
                pipe.expire(contract.log_key(rid), spec.ttl_s)
                pipe.expire(contract.record_key(rid), spec.ttl_s)
        self._log_started.update(first_writes - ended)
