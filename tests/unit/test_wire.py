"""The wire layer: generated code is fresh, the SamplingParams codec round-trips, events decode."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice.wire import codec, contract
from sluice.wire.generate import generate
from sluice.wire.messages_pb2 import GenerateRequest
from sluice.wire.messages_pb2 import SamplingParams as ProtoParams

WIRE_DIR = Path(__file__).resolve().parents[2] / "sluice" / "wire"


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    written = generate(tmp_path)
    assert written, "protoc wrote nothing"
    for path in written:
        committed = WIRE_DIR / path.name
        assert committed.is_file(), f"{committed} is missing: run `python -m sluice.wire.generate`"
        assert committed.read_bytes() == path.read_bytes(), (
            f"{committed.name} is stale: run `python -m sluice.wire.generate` and commit the result"
        )


def test_unset_proto_fields_mean_the_defaults() -> None:
    from engine_service.core.sampling_params import SamplingParams

    kwargs = codec.sampling_kwargs_from_proto(ProtoParams())
    params = SamplingParams(**kwargs)
    default = SamplingParams(max_tokens=None)
    for name in ("n", "temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "max_tokens",
                 "min_tokens", "ignore_eos", "logprobs", "prompt_logprobs", "logit_bias", "stop_token_ids"):
        assert getattr(params, name) == getattr(default, name), name


def test_sampling_params_round_trip() -> None:
    from engine_service.core.sampling_params import SamplingParams

    original = SamplingParams(
        n=3, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=1234, presence_penalty=0.5,
        frequency_penalty=-0.25, repetition_penalty=1.1, logit_bias={5: -100.0, 7: 2.5}, max_tokens=33,
        min_tokens=2, stop_token_ids=[2, 9], ignore_eos=True, logprobs=3, prompt_logprobs=0,
    )
    wire = codec.sampling_params_to_proto(original).SerializeToString()
    msg = ProtoParams()
    msg.ParseFromString(wire)
    back = SamplingParams(**codec.sampling_kwargs_from_proto(msg))
    for name in ("n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "logit_bias", "max_tokens", "min_tokens", "stop_token_ids",
                 "ignore_eos", "logprobs", "prompt_logprobs"):
        assert getattr(back, name) == getattr(original, name), name


def test_greedy_survives_the_wire() -> None:
    msg = codec.sampling_params_to_proto({"temperature": 0.0, "max_tokens": 4})
    assert msg.HasField("temperature") and msg.temperature == 0.0
    assert codec.sampling_kwargs_from_proto(msg)["temperature"] == 0.0


def test_make_request_and_entry() -> None:
    req = codec.make_request("r1", "m", [1, 2, 3], {"max_tokens": 5}, deadline=10.0, reply_to="g1")
    fields = codec.encode_request(req)
    back = GenerateRequest()
    back.ParseFromString(fields[contract.REQUEST_FIELD])
    assert back.version == contract.CONTRACT_VERSION
    assert list(back.prompt_token_ids) == [1, 2, 3] and back.params.max_tokens == 5 and back.deadline == 10.0
    assert back.reply_to == "g1"
    with pytest.raises(ValueError, match="reply_to"):
        codec.make_request("r1", "m", [1], None, reply_to="")


def test_event_frames_round_trip() -> None:
    events = [codec.error_event("a", contract.ERR_DEADLINE, "late", "e1"), codec.finished_event("b", 1, "stop", engine_id="e1")]
    assert codec.decode_events(codec.encode_events(events, "e1")) == events


def test_a_frame_carries_each_request_as_the_bytes_its_log_gets() -> None:
    """Encoded once: a request's part of a reply channel frame is byte for byte its log element,
    and both decode to the same events."""
    from sluice.wire import event_log
    from sluice.wire.messages_pb2 import Event

    a = [Event(request_id="a", index=0, token_ids=[5], engine_id="e1"),
         Event(request_id="a", index=1, token_ids=[6, 7], engine_id="e1")]
    b = [codec.finished_event("b", 0, "length", completion_tokens=3, engine_id="e1")]
    element_a = event_log.encode_entry(a)
    frame = codec.decode_frame(codec.encode_frame("e1", [("a", element_a), ("b", event_log.encode_entry(b))]))
    assert frame.engine_id == "e1" and [p.request_id for p in frame.requests] == ["a", "b"]
    assert frame.requests[0].events == element_a
    assert codec.decode_part(frame.requests[0], "e1") == a
    assert event_log.decode_entry(frame.requests[0].events, "a") == [Event(request_id="a", index=e.index,
                                                                           token_ids=e.token_ids) for e in a]
    # interleaved events of two requests: grouped by request, each request's order kept
    mixed = [a[0], b[0], a[1]]
    assert codec.decode_events(codec.encode_events(mixed, "e1")) == [a[0], a[1], b[0]]


def test_position_logprobs_puts_the_chosen_token_first() -> None:
    class LP:
        def __init__(self, logprob: float, rank: int) -> None:
            self.logprob, self.rank = logprob, rank

    msg = codec.position_logprobs(7, {3: LP(-0.1, 1), 7: LP(-2.0, 4), 5: LP(-0.5, 2)})
    assert [e.token_id for e in msg.entries] == [7, 3, 5]
    assert [e.rank for e in msg.entries] == [4, 1, 2]


def test_terminal_events() -> None:
    assert codec.is_terminal(codec.error_event("r", contract.ERR_DEADLINE, "late"))
    ev = codec.finished_event("r", 1, "stop", stop_token_id=2, prompt_tokens=3, completion_tokens=4)
    assert codec.is_terminal(ev) and ev.finished.stop_token_id == 2 and ev.finished.usage.completion_tokens == 4


def test_each_key_family_is_one_hash_slot() -> None:
    """What makes the contract cluster-safe: the keys that one MULTI or ordered pipeline touches
    share a hash tag, so Redis Cluster puts them in one slot (redis-py computes slots as Redis does)."""
    from redis.crc import key_slot

    def slots(*keys: str) -> set[int]:
        return {key_slot(k.encode()) for k in keys}

    for model in ("m", "SmolLM2-135M-Instruct", "org/model:v2", "we}ird{name"):
        for shard in (0, 5):
            assert len(slots(contract.request_stream(model, shard), contract.inflight_key(model, shard, "r1"),
                             contract.inflight_key(model, shard, "r2"))) == 1, (model, shard)
    for reply_to in ("g1", "0123456789abcdef", "wc-x"):
        assert len(slots(contract.events_channel(reply_to), contract.emitted_key(reply_to, "r1"),
                         contract.cancelled_key(reply_to, "r2"))) == 1, reply_to
    for reply_to in ("g1", "0123456789abcdef"):  # the take and the cancel scripts' keys: one slot
        assert len(slots(contract.cancelled_key(reply_to, "r"), contract.emitted_key(reply_to, "r"),
                         contract.owner_key(reply_to, "r"), contract.owner_key(reply_to, "r2"))) == 1
    # each engine's cancel channel in its own slot: cancels spread over a cluster's nodes
    assert len(slots(*(contract.cancel_channel(f"engine-{i}") for i in range(50)))) > 40
    assert len(slots(contract.ENGINES_KEY, contract.MODELS_KEY, contract.engine_key("e"),
                     contract.gateway_key("g"), contract.model_card_key("m"), contract.queue_shards_key("m"))) == 1
    # and the families spread: different models' queues (and gateways' channels) land on many slots
    assert len(slots(*(contract.request_stream(f"model-{i}", 0) for i in range(50)))) > 40
    # and one model's shards spread too: a cluster serves a model's queue from several nodes
    assert len(slots(*contract.request_streams("m", contract.DEFAULT_QUEUE_SHARDS))) == contract.DEFAULT_QUEUE_SHARDS
    assert len(slots(*(contract.events_channel(f"gw-{i}") for i in range(50)))) > 40
    # a request's event log, record and lease share a slot; different requests' logs spread
    for rid in ("chatcmpl-0123", "resp_abc", "cmpl-x-0"):
        assert len(slots(contract.log_key(rid), contract.record_key(rid), contract.lease_key(rid))) == 1, rid
    assert len(slots(*(contract.log_key(f"chatcmpl-{i}") for i in range(50)))) > 40
