"""The pool of KV blocks: ids, reference counts and an LRU queue of free blocks.

Owned by the KVCacheManager. Block 0 is the null block: never handed out, it is what padded
block-table entries point at (and the places of blocks freed behind a sliding window); taking,
dropping or caching it changes nothing. Free blocks wait in a doubly-linked queue so that a
block in the middle (a prefix-cache hit on a freed block) leaves it in O(1); new blocks come
from the head, which holds the least recently freed ones. A freed block without a hash (a
partial block, which can never be a prefix hit) goes to the head instead, so that it is reused
before any cached prefix is evicted. The prefix cache maps a block hash to every block holding
those tokens: two requests that computed the same block each leave a copy, and evicting one
keeps the other.
"""

from __future__ import annotations

from collections.abc import Iterable


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Set once the block is full and hashed (prefix caching); kept after it is freed so
        # that a later request can reuse its contents until the block is re-allocated.
        self.block_hash: bytes | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt})"


class FreeBlockQueue:
    """Doubly-linked list of free blocks with sentinels; every operation is O(1)."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"{block} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def appendleft(self, block: KVCacheBlock) -> None:
        first = self._head.next_free
        assert first is not None
        self._head.next_free = block
        block.prev_free = self._head
        block.next_free = first
        first.prev_free = block
        self.num_free_blocks += 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def __iter__(self):
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be at least 2 (one is the null block), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1  # never freed, never handed out
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        # Prefix cache: hash of a full block -> the blocks holding those tokens, by id.
        self.cached_blocks: dict[bytes, dict[int, KVCacheBlock]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    def usage(self) -> float:
        usable = self.num_blocks - 1
        return 1.0 - self.num_free_blocks / usable

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, only {self.num_free_blocks} are free")
        blocks = []
        for _ in range(n):
            block = self.free_queue.popleft()
            self._evict_hash(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Takes a reference on cached blocks, pulling free ones out of the free queue."""
        for block in blocks:
            if block is self.null_block:
                continue
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drops one reference from each block; blocks must be given in eviction order.
        Blocks without a hash go to the head of the free queue (reused first)."""
        for block in blocks:
            if block is self.null_block:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise AssertionError(f"{block} freed more often than it was allocated")
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        copies = self.cached_blocks.get(block_hash)
        return None if copies is None else next(iter(copies.values()))

    def cache_full_block(self, block: KVCacheBlock, block_hash: bytes) -> None:
        """Registers a full block under its prefix hash, next to any other block that holds
        the same tokens (two requests computed them in different steps)."""
        if block.block_hash is not None or block is self.null_block:
            return
        self.cached_blocks.setdefault(block_hash, {})[block.block_id] = block
        block.block_hash = block_hash

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix, only while no block is in use (a running request's
        blocks would otherwise lose their hashes under it, as vLLM refuses too). False, with
        nothing cleared, if some are."""
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        for copies in self.cached_blocks.values():
            for block in copies.values():
                block.block_hash = None
        self.cached_blocks.clear()
        # The queue starts over in the order of a new pool. No block holds anything worth
        # keeping now, and the blocks handed out since start-up (from the lowest ids up) come
        # first again: their memory is already in use (on the CPU a first touch of a KV page
        # costs a page fault, milliseconds for a huge page on a VM).
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        return True

    def _evict_hash(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        copies = self.cached_blocks.get(block.block_hash)
        if copies is not None:
            copies.pop(block.block_id, None)
            if not copies:
                del self.cached_blocks[block.block_hash]
        block.block_hash = None
