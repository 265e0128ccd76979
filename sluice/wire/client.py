"""A small synchronous client of the Redis contract: enqueue, listen, cancel, read a model card.

No torch, no engine import: tests and tools (and the gateway, if it likes) can use it. It follows
the contract's rules: subscribe to the request's channel *before* enqueueing (pub/sub keeps
nothing), and a cancel both sets the queued-request marker and publishes on the cancel channel.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import redis

from sluice.wire import codec, contract
from sluice.wire.card import ModelCard
from sluice.wire.messages_pb2 import Event


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

    def __init__(self, client: WireClient, request_id: str, n: int, pubsub: Any) -> None:
        self.client = client
        self.request_id = request_id
        self.n = n
        self.entry_id: bytes | None = None
        self._pubsub = pubsub
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
            try:
                message = self._pubsub.get_message(ignore_subscribe_messages=True, timeout=min(0.5, end - now))
            except (redis.ConnectionError, redis.TimeoutError, OSError):
                self.lost = True  # Redis went away: pub/sub dropped the subscription (and its events)
                return
            if message is None or message.get("type") != "message":
                continue
            last = time.monotonic()
            event = Event()
            event.ParseFromString(message["data"])
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

    def extra_events(self, wait: float = 0.5) -> list[Event]:
        """Events that arrive within ``wait`` seconds after the request ended (should be none)."""
        out = []
        end = time.monotonic() + wait
        while (left := end - time.monotonic()) > 0:
            message = self._pubsub.get_message(ignore_subscribe_messages=True, timeout=left)
            if message and message.get("type") == "message":
                event = Event()
                event.ParseFromString(message["data"])
                out.append(event)
        return out

    def cancel(self) -> None:
        self.client.cancel([self.request_id])

    def close(self) -> None:
        try:
            self._pubsub.close()
        except redis.RedisError:
            pass


class WireClient:
    def __init__(self, r: redis.Redis) -> None:
        self.redis = r

    @classmethod
    def from_url(cls, url: str) -> WireClient:
        return cls(redis.Redis.from_url(url))

    def subscribe(self, request_id: str) -> Any:
        pubsub = self.redis.pubsub()
        pubsub.subscribe(contract.output_channel(request_id))
        # Wait for the confirmation, so the subscription is in place before anything is enqueued.
        end = time.monotonic() + 5
        while time.monotonic() < end:
            message = pubsub.get_message(timeout=0.5)
            if message and message.get("type") == "subscribe":
                break
        return pubsub

    def submit(
        self,
        model: str,
        prompt_token_ids: Iterable[int],
        params: Any = None,
        *,
        request_id: str | None = None,
        deadline: float = 0.0,
        gateway_id: str = "",
    ) -> RequestHandle:
        """Enqueue a request and subscribe to its events. With ``gateway_id`` the engines abort it
        once that gateway's liveness key (``heartbeat_gateway``) stays gone."""
        request_id = request_id or f"req-{uuid.uuid4().hex}"
        request = codec.make_request(request_id, model, prompt_token_ids, params, deadline=deadline,
                                     gateway_id=gateway_id)
        n = request.params.n if request.params.HasField("n") else 1
        handle = RequestHandle(self, request_id, max(1, n), self.subscribe(request_id))
        handle.entry_id = self.enqueue(request)
        return handle

    def enqueue(self, request: Any) -> bytes:
        return self.redis.xadd(contract.request_stream(request.model), codec.encode_request(request))

    def enqueue_raw(self, model: str, fields: dict) -> bytes:
        """Add an arbitrary entry (tests of malformed input)."""
        return self.redis.xadd(contract.request_stream(model), fields)

    def heartbeat_gateway(self, gateway_id: str, ttl_s: float = contract.GATEWAY_HEARTBEAT_TTL_S) -> None:
        """Set (or refresh) a gateway's liveness key, as a gateway's broker does every second."""
        self.redis.set(contract.gateway_key(gateway_id), b"1", px=int(ttl_s * 1000))

    def cancel(self, request_ids: Iterable[str]) -> None:
        codec.cancel(self.redis.pipeline(transaction=False), request_ids).execute()

    def model_card(self, model: str) -> ModelCard | None:
        raw = self.redis.hgetall(contract.model_card_key(model))
        return ModelCard.decode(raw) if raw else None

    def engines(self) -> dict[str, dict[str, Any]]:
        """The registry, limited to engines whose liveness key is present."""
        raw = self.redis.hgetall(contract.ENGINES_KEY)
        out = {}
        for engine_id, blob in raw.items():
            eid = engine_id.decode()
            if self.redis.exists(contract.engine_key(eid)):
                out[eid] = json.loads(blob)
        return out

    def wait_for_engine(self, model: str, timeout: float = 120.0) -> dict[str, Any]:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for info in self.engines().values():
                if info.get("model") == model and not info.get("draining"):
                    return info
            time.sleep(0.2)
        raise TimeoutError(f"no live engine for {model!r} within {timeout}s")
