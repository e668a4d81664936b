"""Prefix-cache keys: a chain of 128-bit xxhash digests over full blocks of token ids.

hash(block i) = xxh3_128(hash(block i-1) || token ids of block i || extra keys), so equal
hashes mean equal whole prefixes, not just equal blocks. The chain starts from a root value
that is random per process unless PYTHONHASHSEED pins it (then runs and processes agree).
Only full blocks get a hash. Called by the KVCacheManager, which extends a request's hashes
as its tokens grow, and by the data-parallel client, which keeps its own record of the
prefixes each rank was sent (its keys need not equal the cores': each process has its root).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import xxhash

BlockHash = bytes


def _root_hash() -> BlockHash:
    seed = os.environ.get("PYTHONHASHSEED")
    if seed is None or seed == "random":
        return os.urandom(16)
    return xxhash.xxh3_128_digest(f"tokenmill-root:{seed}".encode())


ROOT_HASH: BlockHash = _root_hash()


def hash_block(
    parent: BlockHash | None, token_ids: Sequence[int], extra_keys: bytes = b""
) -> BlockHash:
    h = xxhash.xxh3_128()
    h.update(ROOT_HASH if parent is None else parent)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    h.update(extra_keys)
    return h.digest()


def extend_block_hashes(
    block_hashes: list[BlockHash], token_ids: Sequence[int], block_size: int, salt: bytes = b""
) -> None:
    """Appends the hashes of blocks that became full since the last call (incremental).
    `salt` goes into the first block's key, so the whole chain: K/V computed otherwise for
    the same tokens (LongRoPE's long frequencies, say) never meet."""
    num_full = len(token_ids) // block_size
    for i in range(len(block_hashes), num_full):
        parent = block_hashes[i - 1] if i else None
        tokens = token_ids[i * block_size : (i + 1) * block_size]
        block_hashes.append(hash_block(parent, tokens, salt if i == 0 else b""))
