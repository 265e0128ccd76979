"""Fair share between tenants with real ``sluice engine`` processes on the real model, fed through
Redis: with few slots, a flood tenant's backlog waits in its own lanes and a light tenant's requests
are served ahead of it (docs/fair-share.md). The property is an order, not a timing: at each light
request's first token, most of the flood requests queued before it have not started, which first
come, first served (the same requests in one tenant) can never give. The queue is one shard, so that
every request shares one queue (with several shards, requests that hash to different shards are
interleaved by the shards' rotation with or without tenants; one shared shard is the worst case)."""

from __future__ import annotations

import threading
import time

import pytest

from sluice.wire import codec
from sluice.wire.client import WireClient
from sluice.wire.connection import read_shard_message
from tests.integration.test_engine_service_processes import MODEL, EngineProcess

pytestmark = [pytest.mark.model, pytest.mark.docker, pytest.mark.redis]

FLOOD_REQUESTS = 24
LIGHT_REQUESTS = 3


class FirstTokens:
    """The time of each request's first token on one reply channel."""

    def __init__(self, client: WireClient, reply: str) -> None:
        self.pubsub = client.subscribe(reply)
        self.prefix = f"{reply}-"
        self.first: dict[str, float] = {}
        self.ended: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            message = read_shard_message(self.pubsub, 0.2)
            if not message or message.get("type") not in (b"smessage", "smessage"):
                continue
            now = time.monotonic()
            for ev in codec.decode_events(message["data"]):
                rid = ev.request_id.removeprefix(self.prefix)  # the run's own ids, by their short name
                if ev.token_ids:
                    self.first.setdefault(rid, now)
                if codec.is_terminal(ev):
                    self.ended.add(rid)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.pubsub.close()


def flood_then_light(client: WireClient, flood_tenant: str, light_tenant: str) -> tuple[dict, dict, FirstTokens]:
    """The flood (24 requests of 24 tokens), then, once it holds the slots, 3 light requests half a
    second apart: (when each request was sent, which flood requests had not started at each light
    request's sending, the listener). Request ids are the run's own: an engine remembers a cancel
    of an id it has not seen, and the first run's cancels must not end the second's requests."""
    reply = client.new_reply_id()
    tokens = FirstTokens(client, reply)
    sent: dict[str, float] = {}
    unstarted_at_send: dict[str, set[str]] = {}

    def send(rid: str, tenant: str, prompt: list[int], max_tokens: int) -> None:
        request = codec.make_request(f"{reply}-{rid}", MODEL, prompt, {"temperature": 0.0, "max_tokens": max_tokens,
                                                          "ignore_eos": True}, reply_to=reply, tenant=tenant)
        sent[rid] = time.monotonic()
        client.enqueue(request)

    for i in range(FLOOD_REQUESTS):
        send(f"flood-{i}", flood_tenant, [1, 504 + i, 3458, 314, 260 + 3 * i, 2767], 24)
    end = time.monotonic() + 120
    while sum(1 for r in tokens.first if r.startswith("flood-")) < 2 and time.monotonic() < end:
        time.sleep(0.05)
    for k in range(LIGHT_REQUESTS):
        flood = {r for r in sent if r.startswith("flood-")}
        unstarted_at_send[f"light-{k}"] = flood - set(tokens.first)
        send(f"light-{k}", light_tenant, [1, 9000 + k, 3458, 11, 7], 4)
        time.sleep(0.5)
    lights = [r for r in sent if r.startswith("light-")]
    end = time.monotonic() + 240
    while not all(r in tokens.first for r in lights) and time.monotonic() < end:
        time.sleep(0.1)
    time.sleep(0.5)  # the flood requests that started with the last light one have their first token too
    client.cancel([f"{reply}-{r}" for r in sent if r not in tokens.ended], reply_to=reply)  # the flood's rest
    while len(tokens.ended) < len(sent) and time.monotonic() < end:
        time.sleep(0.1)
    return sent, unstarted_at_send, tokens


@pytest.mark.parametrize("num_engines", [1, 2])
def test_a_light_tenant_is_served_ahead_of_a_floods_backlog(model_dir, clean_redis, redis_client, tmp_path,
                                                            num_engines):
    client = WireClient(redis_client)
    procs = [EngineProcess(model_dir, clean_redis, tmp_path, "--max-num-seqs", "2", "--queue-shards", "1",
                           "--log-level", "INFO") for _ in range(num_engines)]
    try:
        for p in procs:
            p.wait_ready(client)
        time.sleep(1.5)  # every engine has read the registry: the shards are split
        runs = {}
        for name, flood_tenant, light_tenant in (("fair", "flood", "light"), ("fifo", "", "")):
            sent, unstarted, tokens = flood_then_light(client, flood_tenant, light_tenant)
            tokens.close()
            assert len(tokens.ended) == len(sent), f"{name}: not every request ended:\n{procs[0].logs()}"
            runs[name] = (unstarted, tokens.first)
        for k in range(LIGHT_REQUESTS):
            light = f"light-{k}"
            unstarted, first = runs["fair"]
            behind = unstarted[light]
            assert len(behind) >= FLOOD_REQUESTS // 2, f"the flood's backlog was short already: {sorted(behind)}"
            still_waiting = {r for r in behind if first.get(r, float("inf")) > first[light]}
            # fair: the light request went ahead of (nearly) the whole backlog queued before it
            assert len(still_waiting) >= len(behind) - 2 * num_engines, (light, sorted(behind - still_waiting))
            # one tenant: it started after the flood requests queued before it (with two engines
            # reading one stream, a request read just before it may start just after it)
            unstarted, first = runs["fifo"]
            late = {r for r in unstarted[light] if first.get(r, float("inf")) > first[light]}
            assert len(late) <= num_engines - 1, (light, sorted(late))
    finally:
        for p in procs:
            p.stop()
