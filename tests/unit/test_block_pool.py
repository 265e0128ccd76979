"""The KV block pool: reference counts, the free queue, the prefix cache and its LRU eviction."""

from __future__ import annotations

import pytest

from engine_service.core.block_pool import (
    ROOT_HASH,
    BlockPool,
    NoFreeBlocksError,
    blocks_for_length,
    hash_block_tokens,
)


def test_blocks_for_length():
    assert [blocks_for_length(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_allocate_and_free_keep_counts():
    pool = BlockPool(4, 2)
    assert (pool.num_total_blocks, pool.num_free_blocks, pool.num_used_blocks) == (4, 4, 0)
    a = pool.allocate(3)
    assert len(set(a)) == 3 and all(pool.ref_count(b) == 1 for b in a)
    assert pool.num_free_blocks == 1
    pool.check_invariants([a])
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(2)
    pool.free(reversed(a))
    assert pool.num_free_blocks == 4
    pool.check_invariants([])


def test_double_free_is_caught():
    pool = BlockPool(2, 2)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(AssertionError):
        pool.free([b])


def test_chained_hash_depends_on_predecessor():
    h1 = hash_block_tokens(ROOT_HASH, [1, 2])
    assert hash_block_tokens(ROOT_HASH, [1, 2]) == h1
    assert hash_block_tokens(h1, [3, 4]) != hash_block_tokens(ROOT_HASH, [3, 4])
    assert hash_block_tokens(ROOT_HASH, [1, 3]) != h1


def test_prefix_cache_hit_shares_a_block_with_a_reference():
    pool = BlockPool(4, 2)
    h1 = hash_block_tokens(ROOT_HASH, [1, 2])
    h2 = hash_block_tokens(h1, [3, 4])
    a = pool.allocate(2)
    assert pool.cache_block(a[0], h1) and pool.cache_block(a[1], h2)
    hit = pool.lookup([h1, h2, 12345])
    assert hit == a
    assert pool.lookup([h1, h2], max_blocks=1) == a[:1]
    assert pool.lookup([999, h1]) == []  # a prefix, not any block
    pool.touch(hit)
    assert [pool.ref_count(b) for b in a] == [2, 2]
    pool.check_invariants([a, hit])
    pool.free(reversed(a))
    pool.free(reversed(hit))
    assert pool.num_free_blocks == 4 and pool.num_cached_blocks == 2 and pool.num_free_cached_blocks == 2
    pool.check_invariants([])
    # a free cached block is found again and taken out of the free queue by touch
    again = pool.lookup([h1, h2])
    assert again == a and pool.num_unreferenced(again) == 2
    pool.touch(again)
    assert pool.num_free_blocks == 2
    pool.check_invariants([again])


def test_duplicate_content_keeps_the_first_copy():
    pool = BlockPool(3, 2)
    h = hash_block_tokens(ROOT_HASH, [7, 7])
    a, b = pool.allocate(2)
    assert pool.cache_block(a, h)
    assert not pool.cache_block(b, h)
    assert not pool.cache_block(a, h + 1)  # a block carries one content
    assert pool.lookup([h]) == [a] and pool.block_hash(b) is None


def test_plain_free_blocks_go_before_cached_and_cached_evict_lru():
    pool = BlockPool(4, 1)
    blocks = pool.allocate(4)
    hashes = [hash_block_tokens(ROOT_HASH, [i]) for i in range(4)]
    for b, h in zip(blocks[:3], hashes[:3], strict=True):
        pool.cache_block(b, h)
    # free in order: blocks[2] (cached) first, then [0], then [3] (plain), then [1]
    pool.free([blocks[2]])
    pool.free([blocks[0]])
    pool.free([blocks[3]])
    pool.free([blocks[1]])
    pool.check_invariants([])
    assert pool.allocate(1) == [blocks[3]]  # the plain one first; nothing evicted
    assert pool.num_evictions == 0
    assert pool.allocate(1) == [blocks[2]]  # then the least recently freed cached block
    assert pool.num_evictions == 1 and pool.lookup([hashes[2]]) == []
    assert pool.lookup([hashes[0]]) == [blocks[0]]  # the others keep their content
    pool.check_invariants([[blocks[3]], [blocks[2]]])


def test_touch_refreshes_lru_position():
    pool = BlockPool(2, 1)
    a, b = pool.allocate(2)
    ha, hb = hash_block_tokens(ROOT_HASH, [1]), hash_block_tokens(ROOT_HASH, [2])
    pool.cache_block(a, ha)
    pool.cache_block(b, hb)
    pool.free([a])
    pool.free([b])
    pool.touch([a])  # a is used again...
    pool.free([a])  # ...and freed after b, so b is now the older one
    assert pool.allocate(1) == [b]
    assert pool.lookup([ha]) == [a]


def test_caching_disabled_never_caches():
    pool = BlockPool(2, 2, enable_prefix_caching=False)
    (a,) = pool.allocate(1)
    h = hash_block_tokens(ROOT_HASH, [1, 2])
    assert not pool.cache_block(a, h)
    assert pool.lookup([h]) == []


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(2, 1)
    (a,) = pool.allocate(1)
    pool.cache_block(a, 42)
    assert not pool.reset_prefix_cache()
    pool.free([a])
    assert pool.reset_prefix_cache()
    assert pool.num_cached_blocks == 0 and pool.lookup([42]) == []
    pool.check_invariants([])


def test_invariants_catch_a_leak_and_an_unshared_block():
    pool = BlockPool(3, 2)
    a = pool.allocate(2)
    with pytest.raises(AssertionError, match="ref count"):
        pool.check_invariants([a[:1]])  # a[1] referenced by nobody: leaked
    with pytest.raises(AssertionError):
        pool.check_invariants([a, a[:1]])  # a[0] in two tables with one reference
    pool.touch([a[0]])
    with pytest.raises(AssertionError, match="not shared through the prefix cache"):
        pool.check_invariants([a, a[:1]])
