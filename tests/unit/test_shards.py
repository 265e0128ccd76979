"""sluice.wire.shards: the shard a request goes to, the engine that owns a shard, an entry's age."""

from __future__ import annotations

import random

from sluice.wire import contract, shards

BLOCK = 16
K = 8  # prefix blocks


def choose(tokens, rid="r", header=0, count=16):
    return shards.choose_shard(tokens, shards=count, block_size=BLOCK, prefix_blocks=K, request_id=rid,
                               header_tokens=header)


def test_requests_sharing_a_system_prompt_share_a_shard_and_tenants_spread():
    rng = random.Random(1)
    tenants = [[rng.randrange(50_000) for _ in range(512)] for _ in range(48)]
    for system in tenants[:8]:
        turns = {choose(system + [rng.randrange(50_000) for _ in range(32)], rid=f"r{i}") for i in range(20)}
        assert len(turns) == 1, "distinct user turns after one system prompt must share its shard"
    used = {choose(t + [1, 2, 3]) for t in tenants}
    assert len(used) >= 12, f"48 tenants over 16 shards landed on only {len(used)}"


def test_a_conversations_later_turns_stay_on_its_shard():
    rng = random.Random(2)
    turn1 = [rng.randrange(50_000) for _ in range(K * BLOCK + 5)]
    history = list(turn1)
    shard = choose(turn1, rid="t1")
    for turn in range(2, 8):  # each turn: the previous prompt, the answer, a new user message
        history += [rng.randrange(50_000) for _ in range(rng.randrange(1, 200))]
        assert choose(history, rid=f"t{turn}") == shard


def test_only_whole_blocks_count():
    rng = random.Random(3)
    base = [rng.randrange(50_000) for _ in range(3 * BLOCK)]
    # tokens past the last whole block do not change the key
    assert choose(base + [7] * (BLOCK - 1), rid="a") == choose(base + [9] * (BLOCK - 1), rid="b")


def test_prompts_shorter_than_a_block_spread_by_request_id():
    short = [1, 2, 3]
    seen = {choose(short, rid=f"req-{i}") for i in range(200)}
    assert len(seen) == 16
    assert choose(short, rid="same") == choose(short, rid="same")


def test_the_template_header_alone_does_not_pick_the_shard():
    header = list(range(100, 100 + 2 * BLOCK))  # every prompt starts with these 32 tokens
    # a prompt whose whole blocks are all header: spread by request id, not all on one shard
    seen = {choose(header + [5, 6], rid=f"q{i}", header=len(header)) for i in range(200)}
    assert len(seen) == 16
    # past the header, the content decides again: same content, same shard
    body = list(range(900, 900 + 2 * BLOCK))
    assert len({choose(header + body, rid=f"q{i}", header=len(header)) for i in range(20)}) == 1


def test_one_shard_is_always_shard_zero_and_hashing_is_stable():
    assert choose(list(range(500)), count=1) == 0
    # blake2b, not Python's salted hash: a fixed input has a fixed shard in every process
    assert choose(list(range(K * BLOCK))) == choose(list(range(K * BLOCK)))
    assert shards.weight(3, "engine-a") == shards.weight(3, "engine-a")


def test_rendezvous_owners_are_stable_balanced_and_move_about_one_nth():
    count = 512
    engines = [f"engine-{i}" for i in range(4)]
    before = shards.owners(count, engines)
    assert before == shards.owners(count, list(reversed(engines))), "order of the registry must not matter"
    per = {e: before.count(e) for e in engines}
    assert all(count / 4 * 0.7 < n < count / 4 * 1.3 for n in per.values()), per
    # one joins: only shards the newcomer wins move, about 1/5 of them
    after = shards.owners(count, [*engines, "engine-new"])
    moved = [s for s in range(count) if after[s] != before[s]]
    assert all(after[s] == "engine-new" for s in moved)
    assert 0.12 < len(moved) / count < 0.28, len(moved)
    # one leaves: only its shards move, spread over the others
    gone = shards.owners(count, engines[1:])
    moved = [s for s in range(count) if gone[s] != before[s]]
    assert moved and all(before[s] == "engine-0" for s in moved)
    assert len({gone[s] for s in moved}) == 3
    # every engine computes the same ownership: owned() partitions the shards
    owned = [set(shards.owned(count, engines, e)) for e in engines]
    assert sum(len(o) for o in owned) == count and set().union(*owned) == set(range(count))
    assert shards.owner(0, []) is None


def test_entry_age_and_served_shard_count():
    assert shards.entry_ms(b"1700000000123-4") == 1700000000123
    assert shards.entry_ms("5-0") == 5
    # engines serve the largest count any engine published, their own included; junk is ignored
    assert shards.shard_count([b"4", b"16", b"x"], own=8) == 16
    assert shards.shard_count([], own=8) == 8
    assert shards.shard_count([b"100000"], own=1) == contract.MAX_QUEUE_SHARDS


def test_engine_flags_refuse_a_bad_shard_count(capsys):
    import argparse

    import pytest

    from engine_service.service.main import add_arguments, settings_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--queue-shards", "4", "--steal-after-ms", "50", "--shard-prefix-blocks", "2"])
    settings = settings_from_args(args)
    assert (settings.queue_shards, settings.steal_after_ms, settings.shard_prefix_blocks) == (4, 50, 2)
    for bad in (["--queue-shards", "0"], ["--queue-shards", "many"], ["--steal-after-ms", "-1"],
                ["--queue-shards", str(contract.MAX_QUEUE_SHARDS + 1)]):
        with pytest.raises(SystemExit) as exc:
            parser.parse_args(bad)
        assert exc.value.code == 2
        assert bad[0] in capsys.readouterr().err
