"""The event log's codecs (sluice.wire.event_log): event ids, the record, log entries, TTLs."""

from __future__ import annotations

import pytest

from sluice.wire import codec, contract, event_log
from sluice.wire.event_log import StreamRecord
from sluice.wire.messages_pb2 import Event


def test_event_ids_round_trip_and_malformed_ones_are_refused() -> None:
    eid = event_log.event_id("chatcmpl-0a1b", 17)
    assert eid == "chatcmpl-0a1b:17" and event_log.parse_event_id(eid) == ("chatcmpl-0a1b", 17)
    assert event_log.parse_event_id(" resp_1:0 ") == ("resp_1", 0)
    for bad in ("", "chatcmpl-0a1b", "chatcmpl-0a1b:", ":3", "x:-1", "x:1.5", "x:abc", "a{b}:3", "a b:1",
                "é:1", "x:" + "9" * 13, "x" * 201 + ":1"):
        with pytest.raises(ValueError):
            event_log.parse_event_id(bad)


def test_record_round_trip_and_unknown_versions() -> None:
    record = StreamRecord(id="chatcmpl-1", endpoint="chat", model="m", created=5, reply_to="gw", request_ids=["chatcmpl-1"],
                          prompt_ids=[[1, 2, 3]], prompt_tokens=[3], deadline=12.5, detached=True, render={"opts": {"stop": ["x"]}})
    assert StreamRecord.decode(record.encode()) == record
    for raw in (b"not json", b"[]", b'{"version": 99}', b'{"version": 1, "id": "x"}'):
        with pytest.raises(ValueError):
            StreamRecord.decode(raw)


def test_log_entries_drop_the_ids_the_key_already_names() -> None:
    events = [Event(request_id="chatcmpl-1", index=0, token_ids=[42], engine_id="engine-7"),
              codec.finished_event("chatcmpl-1", 0, "length", prompt_tokens=3, completion_tokens=1, engine_id="e")]
    raw = event_log.encode_entry(events)
    assert b"chatcmpl-1" not in raw and b"engine-7" not in raw
    back = event_log.decode_entry(raw, "chatcmpl-1")
    assert [e.request_id for e in back] == ["chatcmpl-1"] * 2
    assert back[0].token_ids == [42] and back[1].finished.usage.completion_tokens == 1
    assert events[0].engine_id == "engine-7"  # the published events are left as they were


def test_ttl_runs_to_the_deadline_plus_the_window() -> None:
    assert event_log.ttl_until_end(1000.0, 30, now=900.0) == 131
    assert event_log.ttl_until_end(800.0, 30, now=900.0) == 31  # past its deadline: the window
    assert event_log.ttl_until_end(0.0, 0, now=900.0) == event_log.NO_DEADLINE_RUN_S + 1 + contract.DEFAULT_LOG_TTL_S
