"""The host's block allocator: reference-counted KV pages, shared by content hash (prefix
caching), one pool per data shard (``ShardedAllocator``). Block 0 of each pool is the null block
(``cache.NULL_BLOCK``): never handed out, padding rows write there."""

from __future__ import annotations

import collections
import hashlib

import numpy as np


def hash_blocks(tokens, block_size: int, hashes: list[bytes], lookahead: int = 0) -> None:
    """Extends ``hashes`` with the content hash of every full block of ``tokens`` not yet hashed
    (and followed by ``lookahead`` known tokens).

    Block i's hash is SHA-256 over block i-1's hash and block i's tokens, so it names the whole
    prefix: a block's K/V depends on every token before it, and nothing else (row invariance).
    With ``lookahead`` it also covers the next ``lookahead`` tokens: an EAGLE head's K/V at a
    position depends on the token after it too (``sfjax.spec.eagle``).
    """
    for i in range(len(hashes), (len(tokens) - lookahead) // block_size):
        chunk = np.asarray(tokens[i * block_size:(i + 1) * block_size + lookahead], np.int64)
        parent = hashes[i - 1] if i else b""
        hashes.append(hashlib.sha256(parent + chunk.tobytes()).digest())


class BlockAllocator:
    """Reference-counted pages (block 0 excluded); the host owns all scheduling of pages.

    With ``prefix_caching``, a full block whose K/V is computed is registered under its content
    hash (:func:`hash_blocks`); requests with the same prefix share it. A registered block whose
    last reference goes stays cached, evictable in least-recently-freed order, and still counts
    as free: ``allocate`` takes never-used blocks first, then evicts the oldest cached ones.
    """

    def __init__(self, num_blocks: int, *, prefix_caching: bool = False):
        if num_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.prefix_caching = prefix_caching
        self._free = list(range(num_blocks - 1, 0, -1))   # pop() hands out low ids first
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}
        self._by_hash: dict[bytes, int] = {}
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.query_tokens = 0                             # prefix-cache lookups, in tokens
        self.hit_tokens = 0

    @property
    def num_free(self) -> int:
        """Blocks ``allocate`` can hand out: never used or cached with no reference."""
        return len(self._free) + len(self._evictable)

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise MemoryError(f"asked for {n} KV blocks, {self.num_free} free")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.pop()
            else:
                b, _ = self._evictable.popitem(last=False)
                del self._by_hash[self._hash_of.pop(b)]
            self._refs[b] = 1
            out.append(b)
        return out

    def free(self, blocks: list[int]) -> None:
        """Drops one reference to each block; the tail goes first, so it is evicted first."""
        for b in reversed(blocks):
            self._refs[b] -= 1
            if self._refs[b] < 0:
                raise RuntimeError(f"KV block {b} freed more often than it was taken")
            if self._refs[b] == 0:
                if b in self._hash_of:
                    self._evictable[b] = None
                else:
                    self._free.append(b)

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of ``hashes`` (takes no reference)."""
        out = []
        for h in hashes:
            b = self._by_hash.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def num_evictable(self, blocks: list[int]) -> int:
        """How many of ``blocks`` are cached with no reference (taking them uses free capacity)."""
        return sum(b in self._evictable for b in blocks)

    def acquire(self, blocks: list[int]) -> None:
        """Takes a reference to each cached block (a prefix-cache hit)."""
        for b in blocks:
            self._evictable.pop(b, None)
            self._refs[b] += 1

    def register(self, block: int, h: bytes) -> None:
        """Offers a computed full block to the prefix cache under its content hash."""
        if self.prefix_caching and h not in self._by_hash and block not in self._hash_of:
            self._by_hash[h] = block
            self._hash_of[block] = h

    def reset_prefix_cache(self) -> None:
        """Forgets every cached block; unreferenced ones become plain free blocks."""
        for b in self._evictable:
            self._free.append(b)
        self._evictable.clear()
        self._hash_of.clear()
        self._by_hash.clear()

    def refs(self, block: int) -> int:
        return self._refs[block]

    def free_ids(self) -> set[int]:
        """Blocks with no reference (never used or cached)."""
        return set(self._free) | set(self._evictable)

    def cached_ids(self) -> set[int]:
        return set(self._hash_of)


class ShardedAllocator:
    """One ``BlockAllocator`` per data shard, over num_blocks / dp local pages each (local page 0
    the shard's null block). The scheduler takes a slot's pages from its shard's allocator
    (``shards[shard]``); this class only holds them and sums their counters."""

    @staticmethod
    def check(num_blocks: int, num_shards: int) -> None:
        if num_blocks % num_shards or num_blocks // num_shards < 2:
            raise ValueError(f"num_kv_blocks ({num_blocks}) must be a multiple of "
                             f"data_parallel_size ({num_shards}) with >= 2 blocks per data shard "
                             "(each shard's block 0 is reserved)")

    def __init__(self, num_blocks: int, num_shards: int, *, prefix_caching: bool = False):
        self.check(num_blocks, num_shards)
        per = num_blocks // num_shards
        self.num_blocks = num_blocks
        self.prefix_caching = prefix_caching
        self.shards = [BlockAllocator(per, prefix_caching=prefix_caching)
                       for _ in range(num_shards)]

    @property
    def num_free(self) -> int:
        return sum(a.num_free for a in self.shards)

    @property
    def query_tokens(self) -> int:
        return sum(a.query_tokens for a in self.shards)

    @property
    def hit_tokens(self) -> int:
        return sum(a.hit_tokens for a in self.shards)

    def reset_prefix_cache(self) -> None:
        for a in self.shards:
            a.reset_prefix_cache()
