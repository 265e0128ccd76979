"""The KV block pool: reference counts, a free queue, and a prefix cache.

A block is a fixed-size run of KV slots (``block_size`` tokens). A request holds its blocks in
order in ``Request.block_ids``; the slot of position ``pos`` is
``block_ids[pos // block_size] * block_size + pos % block_size``.

Prefix cache: a *full* block whose KV has been (or, this step, is being) written is identified by a
hash chained over its tokens and its predecessor's hash (``hash_block_tokens``). A new request
reuses the blocks of its longest cached prefix by taking a reference on them. A block whose
reference count drops to zero is free, but if it holds cached content it keeps that content (and
its hash) until it is needed for something else: free cached blocks are evicted least-recently-used,
and only after the free blocks that hold nothing worth keeping.

The pool never looks at requests; the scheduler decides what to allocate, share, cache and free.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence

# The predecessor "hash" of a request's first block.
ROOT_HASH = 0


def hash_block_tokens(parent_hash: int, tokens: Sequence[int]) -> int:
    """The prefix-cache identity of a full block: its tokens chained to its predecessor's hash.

    Python's hash of a tuple of ints is deterministic across processes (no hash randomisation for
    ints) and 64 bits wide; a collision would need two different prefixes with the same chained
    64-bit hash, which we accept, as vLLM's default builtin hash does.
    """
    return hash((parent_hash, tuple(tokens)))


def blocks_for_length(num_tokens: int, block_size: int) -> int:
    """ceil(num_tokens / block_size)."""
    return -(-num_tokens // block_size)


class NoFreeBlocksError(RuntimeError):
    """``allocate`` was asked for more blocks than are free (a scheduler bug, never a load condition)."""


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._num_blocks = num_blocks
        self._ref_cnt: list[int] = [0] * num_blocks
        # block id -> its prefix-cache hash, or None when it holds no cached content
        self._block_hash: list[int | None] = [None] * num_blocks
        # hash -> block id (exactly the blocks whose _block_hash is set)
        self._cached: dict[int, int] = {}
        # Free blocks with nothing cached: handed out first, FIFO.
        self._free_plain: deque[int] = deque(range(num_blocks))
        # Free blocks still holding cached content, least recently used first.
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        # Counters
        self.num_evictions = 0  # cached contents dropped to reuse their block

    # --- sizes ---
    @property
    def num_total_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no reference, including those still holding evictable cached content."""
        return len(self._free_plain) + len(self._free_cached)

    @property
    def num_used_blocks(self) -> int:
        return self._num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks that hold prefix-cache content (referenced or not)."""
        return len(self._cached)

    @property
    def num_free_cached_blocks(self) -> int:
        return len(self._free_cached)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self._num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_cnt[block_id]

    def block_hash(self, block_id: int) -> int | None:
        return self._block_hash[block_id]

    # --- allocation ---
    def allocate(self, n: int) -> list[int]:
        """``n`` fresh blocks, each with one reference; plain free blocks first, then the least
        recently used free cached blocks (whose cached content is evicted)."""
        if n > self.num_free_blocks:
            raise NoFreeBlocksError(f"asked for {n} blocks, {self.num_free_blocks} free")
        out: list[int] = []
        plain = self._free_plain
        ref = self._ref_cnt
        while plain and len(out) < n:
            b = plain.popleft()
            ref[b] = 1
            out.append(b)
        if len(out) < n:
            lru = self._free_cached
            hashes = self._block_hash
            cached = self._cached
            while len(out) < n:
                b, _ = lru.popitem(last=False)
                h = hashes[b]
                if h is not None:
                    if cached.get(h) == b:
                        del cached[h]
                    hashes[b] = None
                    self.num_evictions += 1
                ref[b] = 1
                out.append(b)
        return out

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference on each block. Pass a request's table tail-first (``reversed``) so that
        its later blocks, the least likely to be shared, are evicted first."""
        ref = self._ref_cnt
        hashes = self._block_hash
        for b in block_ids:
            c = ref[b] - 1
            if c < 0:
                raise AssertionError(f"block {b} freed more often than it was referenced")
            ref[b] = c
            if c == 0:
                if hashes[b] is not None:
                    self._free_cached[b] = None
                else:
                    self._free_plain.append(b)

    # --- prefix cache ---
    def lookup(self, block_hashes: Sequence[int], max_blocks: int | None = None) -> list[int]:
        """The blocks of the longest cached prefix of ``block_hashes`` (at most ``max_blocks``).
        No side effects: take references with ``touch``."""
        if not self.enable_prefix_caching:
            return []
        limit = len(block_hashes) if max_blocks is None else min(max_blocks, len(block_hashes))
        cached = self._cached
        out: list[int] = []
        for i in range(limit):
            b = cached.get(block_hashes[i])
            if b is None:
                break
            out.append(b)
        return out

    def num_unreferenced(self, block_ids: Iterable[int]) -> int:
        """How many of ``block_ids`` are free now (touching them would take them out of the free pool)."""
        ref = self._ref_cnt
        return sum(1 for b in block_ids if ref[b] == 0)

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one reference on each (cached) block, taking free ones out of the free queue."""
        ref = self._ref_cnt
        for b in block_ids:
            if ref[b] == 0:
                del self._free_cached[b]
            ref[b] += 1

    def cache_block(self, block_id: int, block_hash: int) -> bool:
        """Register a full, referenced block under ``block_hash``. Returns False (and changes nothing)
        when caching is off, the block already has content registered, or another block already
        holds that content (the first one stays the cached copy)."""
        if not self.enable_prefix_caching or self._block_hash[block_id] is not None:
            return False
        if block_hash in self._cached:
            return False
        self._cached[block_hash] = block_id
        self._block_hash[block_id] = block_hash
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every cached content; only possible when no block is referenced. Returns success."""
        if self.num_used_blocks:
            return False
        self._cached.clear()
        self._block_hash = [None] * self._num_blocks
        self._free_plain.extend(self._free_cached.keys())
        self._free_cached.clear()
        return True

    # --- checks ---
    def check_invariants(self, tables: Iterable[Sequence[int]]) -> None:
        """Assert the pool's bookkeeping against the block tables that hold references."""
        n = self._num_blocks
        counts = [0] * n
        owners = [0] * n
        for table in tables:
            seen: set[int] = set()
            for b in table:
                assert 0 <= b < n, f"block id {b} out of range [0, {n})"
                assert b not in seen, f"block {b} appears twice in one table {list(table)}"
                seen.add(b)
                counts[b] += 1
                owners[b] += 1
        plain = set(self._free_plain)
        lru = set(self._free_cached)
        assert len(plain) == len(self._free_plain), "a block is twice in the plain free queue"
        assert not (plain & lru), f"blocks in both free queues: {sorted(plain & lru)}"
        used = 0
        for b in range(n):
            r = self._ref_cnt[b]
            assert r == counts[b], f"block {b}: ref count {r} but referenced by {counts[b]} tables"
            if r > 0:
                used += 1
                assert b not in plain and b not in lru, f"block {b} is referenced ({r}) yet in a free queue"
                if owners[b] > 1:
                    assert self._block_hash[b] is not None, (
                        f"block {b} is in {owners[b]} tables but not shared through the prefix cache"
                    )
            else:
                in_plain, in_lru = b in plain, b in lru
                assert in_plain or in_lru, f"block {b} is unreferenced but in no free queue (leaked)"
                if in_lru:
                    assert self._block_hash[b] is not None, f"free block {b} in the cached queue has no hash"
                else:
                    assert self._block_hash[b] is None, f"free block {b} in the plain queue still has a hash"
        assert used + self.num_free_blocks == n, f"used {used} + free {self.num_free_blocks} != total {n}"
        for h, b in self._cached.items():
            assert self._block_hash[b] == h, f"cache maps a hash to block {b}, whose hash differs"
        assert sum(1 for h in self._block_hash if h is not None) == len(self._cached), (
            "a block carries a hash the cache does not map to it"
        )
