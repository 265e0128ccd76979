"""A small synchronous client of the Redis contract: enqueue, listen, cancel, read a model card.

No torch, no engine import: tests and tools can use it, on one Redis or a Redis Cluster (the URL
says which, ``sluice.wire.connection``). It follows the contract's rules: each request handle has
a reply id of its own, whose sharded channel it subscribes to *before* enqueueing (pub/sub keeps
nothing), and a cancel (``codec.cancel``) sets the queued-request marker and sends a Cancel to the
engine that holds the request, if one does.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import redis

from sluice.wire import card as wire_card
from sluice.wire import codec, contract, registry, shards
from sluice.wire.card import ModelCard
from sluice.wire.connection import TRANSIENT_ERRORS, connect, read_shard_message
from sluice.wire.messages_pb2 import Event
from sluice.wire.registry import EngineEntry


@dataclass
class Completion:
    index: int
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_token_id: int | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


@dataclass
class Result:
    request_id: str
    completions: dict[int, Completion]
    events: list[Event]
    error_code: int | None = None  # contract.ERR_*
    error_message: str | None = None
    timed_out: bool = False

    @property
    def token_ids(self) -> list[int]:
        """Index 0's tokens (the common n=1 case)."""
        return self.completions[0].token_ids if 0 in self.completions else []

    @property
    def finish_reason(self) -> str | None:
        return self.completions[0].finish_reason if 0 in self.completions else None


class RequestHandle:
    """One enqueued request: iterate its events until every completion ended (or an error)."""

    def __init__(self, client: WireClient, request_id: str, n: int, pubsub: Any, reply_to: str) -> None:
        self.client = client
        self.request_id = request_id
        self.n = n
        self.reply_to = reply_to
        self.entry_id: bytes | None = None
        self.shard = 0  # the queue shard it was enqueued on
        self._pubsub = pubsub
        self._buffered: list[Event] = []  # the rest of a batch already read
        self._open = set(range(n))
        self.done = False
        self.lost = False

    def events(self, timeout: float = 60.0, idle_timeout: float | None = None) -> Iterator[Event]:
        """Yield events until the request ended; stop silently at ``timeout`` (check ``done``)."""
        end = time.monotonic() + timeout
        last = time.monotonic()
        while not self.done:
            now = time.monotonic()
            if now >= end or (idle_timeout is not None and now - last >= idle_timeout):
                return
            if not self._buffered:
                try:
                    self._buffered = self._read(min(0.5, end - now))
                except TRANSIENT_ERRORS:
                    self.lost = True  # Redis went away: pub/sub dropped the subscription (and its events)
                    return
                if not self._buffered:
                    continue
            last = time.monotonic()
            event = self._buffered.pop(0)
            if event.HasField("error"):
                self._open.clear()
            elif event.HasField("finished"):
                self._open.discard(event.index)
            if not self._open:
                self.done = True
            yield event

    def collect(self, timeout: float = 60.0) -> Result:
        result = Result(self.request_id, {i: Completion(i) for i in range(self.n)}, [])
        for event in self.events(timeout):
            result.events.append(event)
            comp = result.completions.setdefault(event.index, Completion(event.index))
            comp.token_ids.extend(event.token_ids)
            if event.HasField("error"):
                result.error_code, result.error_message = event.error.code, event.error.message  # contract.ERR_*
            elif event.HasField("finished"):
                fin = event.finished
                comp.finish_reason = codec.finish_reason_name(fin.finish_reason)
                comp.stop_token_id = fin.stop_token_id if fin.HasField("stop_token_id") else None
                comp.prompt_tokens = fin.usage.prompt_tokens
                comp.completion_tokens = fin.usage.completion_tokens
                comp.cached_tokens = fin.usage.cached_tokens
        result.timed_out = not self.done
        return result

    def _read(self, timeout: float) -> list[Event]:
        """This request's events of the next message on the reply channel (none: timeout)."""
        message = read_shard_message(self._pubsub, timeout)
        if message is None or message.get("type") not in (b"smessage", "smessage"):
            return []
        return [e for e in codec.decode_events(message["data"]) if e.request_id == self.request_id]

    def extra_events(self, wait: float = 0.5) -> list[Event]:
        """Events that arrive within ``wait`` seconds after the request ended (should be none)."""
        out, self._buffered = list(self._buffered), []
        end = time.monotonic() + wait
        while (left := end - time.monotonic()) > 0:
            out += self._read(left)
        return out

    def cancel(self) -> None:
        self.client.cancel([self.request_id], reply_to=self.reply_to)

    def close(self) -> None:
        try:
            self._pubsub.close()
        except redis.RedisError:
            pass


class WireClient:
    def __init__(self, r: Any) -> None:
        self.redis = r
        self._reply_of: dict[str, str] = {}  # request id -> reply id, for cancel()
        self.last_shard = 0  # the queue shard of the last enqueue
        self._enqueue_script: Any = None  # contract.ENQUEUE_SCRIPT, registered at the first tenant's enqueue

    @classmethod
    def from_url(cls, url: str) -> WireClient:
        return cls(connect(url))

    def subscribe(self, reply_to: str) -> Any:
        """A pub/sub subscribed to ``reply_to``'s channel, once Redis confirmed it."""
        pubsub = self.redis.pubsub()
        pubsub.ssubscribe(contract.events_channel(reply_to))
        # Wait for the confirmation, so the subscription is in place before anything is enqueued.
        end = time.monotonic() + 5
        while time.monotonic() < end:
            message = read_shard_message(pubsub, 0.5)
            if message and message.get("type") in (b"ssubscribe", "ssubscribe"):
                return pubsub
        pubsub.close()
        raise TimeoutError("Redis did not confirm the subscription within 5 s")

    def submit(
        self,
        model: str,
        prompt_token_ids: Iterable[int],
        params: Any = None,
        *,
        request_id: str | None = None,
        deadline: float = 0.0,
        gateway_id: str = "",
        reply_to: str | None = None,
        shard: int | None = None,
        tenant: str = "",
        tenant_weight: int = 0,
    ) -> RequestHandle:
        """Enqueue a request and subscribe to its events. With ``gateway_id`` the engines abort it
        once that gateway's liveness key (``heartbeat_gateway``) stays gone. ``reply_to``: the
        reply id (default: a new one). ``shard``: the queue shard (default: as a gateway chooses).
        ``tenant`` / ``tenant_weight``: who it is for (its lane of the shard) and its fair share."""
        request_id = request_id or f"req-{uuid.uuid4().hex}"
        request = codec.make_request(request_id, model, prompt_token_ids, params, deadline=deadline,
                                     reply_to=reply_to or self.new_reply_id(), gateway_id=gateway_id,
                                     tenant=tenant, tenant_weight=tenant_weight)
        handle = self.listen(request)
        handle.entry_id = self.enqueue(request, shard)
        handle.shard = self.last_shard
        return handle

    @staticmethod
    def new_reply_id() -> str:
        return f"wc-{uuid.uuid4().hex}"

    def listen(self, request: Any) -> RequestHandle:
        """A handle on ``request``'s events, subscribed now, for a request enqueued by other means
        (a raw entry, a hand-back, a test's own XADD). Subscribe before it can be answered."""
        n = request.params.n if request.params.HasField("n") else 1
        self._reply_of[request.request_id] = request.reply_to
        return RequestHandle(self, request.request_id, max(1, n), self.subscribe(request.reply_to), request.reply_to)

    def shard_of(self, request: Any) -> int:
        """The queue shard a gateway would choose for ``request`` (``sluice.wire.shards``, with the
        model card's settings; shard 0 while there is no card). No chat-template header is skipped:
        the client sends token ids."""
        raw = self.redis.hmget(contract.model_card_key(request.model),
                               [wire_card.F_QUEUE_SHARDS, wire_card.F_BLOCK_SIZE, wire_card.F_SHARD_PREFIX_BLOCKS])
        try:
            count, block, blocks = (int(v) for v in raw)
        except (TypeError, ValueError):
            return 0
        return shards.choose_shard(request.prompt_token_ids, shards=count, block_size=block,
                                   prefix_blocks=blocks, request_id=request.request_id)

    def enqueue(self, request: Any, shard: int | None = None) -> bytes:
        """XADD ``request`` to its shard (``shard_of``, unless ``shard`` is given): to the shard's
        stream for the default tenant, else to the tenant's lane (created as a gateway's enqueue
        creates it, ``contract.ENQUEUE_SCRIPT``, without the gateway's in-flight marker)."""
        self._reply_of[request.request_id] = request.reply_to
        shard = self.shard_of(request) if shard is None else shard
        self.last_shard = shard
        if not request.tenant:
            return self.redis.xadd(contract.request_stream(request.model, shard), codec.encode_request(request))
        if self._enqueue_script is None:
            self._enqueue_script = self.redis.register_script(contract.ENQUEUE_SCRIPT)
        return self._enqueue_script(
            keys=[contract.lane_stream(request.model, shard, request.tenant),
                  contract.inflight_key(request.model, shard, request.request_id),
                  contract.lanes_key(request.model, shard)],
            args=[request.SerializeToString(), 0, contract.REQUEST_FIELD, request.tenant, contract.CONSUMER_GROUP])

    def enqueue_raw(self, model: str, fields: dict, shard: int = 0) -> bytes:
        """Add an arbitrary entry (tests of malformed input)."""
        return self.redis.xadd(contract.request_stream(model, shard), fields)

    def heartbeat_gateway(self, gateway_id: str, ttl_s: float = contract.GATEWAY_HEARTBEAT_TTL_S) -> None:
        """Set (or refresh) a gateway's liveness key, as a gateway's broker does every second."""
        self.redis.set(contract.gateway_key(gateway_id), b"1", px=int(ttl_s * 1000))

    def cancel(self, request_ids: Iterable[str], reply_to: str | None = None) -> None:
        """Cancel requests this client enqueued (or, with ``reply_to``, anyone's of that reply id)."""
        by_reply: dict[str, list[str]] = {}
        for rid in request_ids:
            owner = reply_to or self._reply_of.get(rid)
            if owner is None:
                raise KeyError(f"request {rid!r} was not enqueued by this client: pass its reply_to")
            by_reply.setdefault(owner, []).append(rid)
        for owner, ids in by_reply.items():
            codec.cancel(self.redis, owner, ids)

    def model_card(self, model: str) -> ModelCard | None:
        raw = self.redis.hgetall(contract.model_card_key(model))
        return ModelCard.decode(raw) if raw else None

    def engines(self) -> dict[str, EngineEntry]:
        """The registry, limited to engines whose liveness key is present."""
        raw = self.redis.hgetall(contract.ENGINES_KEY)
        out = {}
        for engine_id, blob in raw.items():
            entry = registry.decode(blob)
            if entry is not None and self.redis.exists(contract.engine_key(engine_id.decode())):
                out[entry.engine_id] = entry
        return out

    def wait_for_engine(self, model: str, timeout: float = 120.0) -> EngineEntry:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for entry in self.engines().values():
                if entry.model == model and not entry.draining:
                    return entry
            time.sleep(0.2)
        raise TimeoutError(f"no live engine for {model!r} within {timeout}s")

    def close(self) -> None:
        self.redis.close()
