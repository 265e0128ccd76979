"""API keys and tenants: the key record's codec, limits, the keys file (every refusal names its line),
the gateway's key table, and OpenAI's reset-duration format."""

from __future__ import annotations

import pytest

from gateway.admission import duration, headers
from gateway.keyring import ANONYMOUS, Keyring, flag_records
from gateway.keys_file import KeysFileError, parse_keys
from sluice.wire import quota
from sluice.wire.keys import KeyRecord, Limits, flag_tenant, generate_key, key_hash


def test_record_round_trip_keeps_no_key():
    key = generate_key()
    record = KeyRecord(key_hash=key_hash(key), tenant="team-a", name="ci bot", weight=3,
                       limits=Limits(requests_per_minute=60, max_queued=4), created=1700000000)
    text = record.encode()
    assert key not in text and record.key_hash in text
    back = KeyRecord.decode(text)
    assert back == KeyRecord(**{**record.__dict__, "source": "redis"})


@pytest.mark.parametrize("raw", [b"not json", b'{"version": 9}', b'{"version": 1, "tenant": "a"}', b"[1]"])
def test_unreadable_records_are_refused(raw):
    with pytest.raises(ValueError):
        KeyRecord.decode(raw)


@pytest.mark.parametrize(("values", "needle"), [({"rpm": 0}, "positive"), ({"tpm": -5}, "positive"),
                                                  ({"rpm": 1.5}, "positive integer"), ({"rpm": True}, "positive"),
                                                  ({"per_hour": 3}, "unknown limit"),
                                                  ({"rpm": 1, "requests_per_minute": 2}, "twice")])
def test_limits_refused_naming_the_limit(values, needle):
    with pytest.raises(ValueError, match=needle):
        Limits.parse(values)


def test_limits_over_a_base():
    assert Limits(requests_per_minute=5).over(Limits(requests_per_minute=9, max_concurrent=2)) == Limits(
        requests_per_minute=5, max_concurrent=2)
    assert not Limits().any and Limits(max_queued=1).any


def test_flag_keys_are_tenants_of_their_own_named_the_same_everywhere():
    a, b = flag_records(["k1", "k2", "k1"])  # a repeated key is one tenant
    assert a.tenant != b.tenant and a.tenant == flag_tenant("k1") and "k1" not in a.tenant
    assert a.tenant.startswith("key-") and len(a.tenant) == 16


GOOD = """
tenants:
  team-a:
    name: Team A
    weight: 2
    limits: {rpm: 600, tpm: 200000}
    keys:
      - sk-alpha
      - sha256: SHA
        name: ci-bot
        limits: {rpm: 60, concurrent: 2}
  team-b:
    keys: [sk-beta]
""".replace("SHA", key_hash("sk-gamma"))


def test_keys_file_reads_tenants_weights_and_limits():
    records = {r.key_hash: r for r in parse_keys(GOOD)}
    alpha, gamma, beta = records[key_hash("sk-alpha")], records[key_hash("sk-gamma")], records[key_hash("sk-beta")]
    assert (alpha.tenant, alpha.weight, alpha.name, alpha.source) == ("team-a", 2, "Team A", "file")
    assert alpha.limits == Limits(requests_per_minute=600, tokens_per_minute=200000)
    assert gamma.limits == Limits(requests_per_minute=60, tokens_per_minute=200000, max_concurrent=2)
    assert gamma.name == "ci-bot"
    assert (beta.tenant, beta.weight, beta.limits) == ("team-b", 1, Limits())


@pytest.mark.parametrize(("text", "line", "needle"), [
    ("tenants: [oops", 1, "not valid YAML"),
    ("tenant:\n  a:\n    keys: [k]\n", 1, "unknown field 'tenant'"),
    ("tenants:\n  a:\n    keys: [k]\n    limits: {rpm: 0}\n", 4, "positive"),
    ("tenants:\n  a:\n    keys: [k]\n  b:\n    keys:\n      - k\n", 6, "already given on line 3"),
    ("tenants:\n  a:\n    keys: [k]\n    weight: 0\n", 4, "weight"),
    ("tenants:\n  a b:\n    keys: [k]\n", 2, "tenant id"),
    ("tenants:\n  a:\n    name: x\n", 2, "has no keys"),
    ("tenants:\n  a:\n    keys:\n      - key: k\n        sha256: abc\n", 4, "one of them"),
    ("tenants:\n  a:\n    keys:\n      - sha256: abc\n", 4, "64 hex"),
    ("tenants:\n  a:\n    keys:\n      - key: k\n        colour: red\n", 5, "unknown key field"),
    ("tenants:\n  a:\n    keys: [k]\n  a:\n    keys: [j]\n", 4, "given twice"),
])
def test_keys_file_refusals_name_the_line(text, line, needle):
    with pytest.raises(KeysFileError) as info:
        parse_keys(text, "keys.yaml")
    assert str(info.value).startswith(f"keys.yaml:{line}:"), str(info.value)
    assert needle in str(info.value)


def test_keyring_lookup():
    ring = Keyring(flag_records(["sk-flag"]) + parse_keys(GOOD))
    assert ring.enabled and ring.loaded
    assert ring.lookup(b"sk-flag").tenant == flag_tenant("sk-flag")
    assert ring.lookup("sk-gamma").limits.max_concurrent == 2
    assert ring.lookup(b"sk-nope") is None and ring.lookup(b"\xff\xfe") is None
    assert not Keyring([]).enabled and ANONYMOUS.tenant == "" and ANONYMOUS.label == "default"
    redis_ring = Keyring([], redis_keys=True)
    assert redis_ring.enabled and not redis_ring.loaded


@pytest.mark.parametrize(("ms", "text"), [(0, "0ms"), (20, "20ms"), (1000, "1s"), (1500, "1.5s"),
                                          (360_000, "6m0s"), (3_723_000, "1h2m3s")])
def test_reset_durations_in_openai_format(ms, text):
    assert duration(ms) == text


def test_headers_only_for_the_limits_that_are_set():
    verdict = quota.Verdict(True, "", 0, 9, 6000, None, None)
    assert headers(Limits(requests_per_minute=10), verdict) == {
        "x-ratelimit-limit-requests": "10", "x-ratelimit-remaining-requests": "9",
        "x-ratelimit-reset-requests": "6s"}
    assert headers(Limits(max_concurrent=3), verdict) == {}
