"""Chained hashes of full KV blocks, the keys of the prefix cache. Torch-free.

Block ``i`` of a sequence is keyed by the hash of (block ``i-1``'s hash, block ``i``'s token
ids, extra keys), so equal hashes mean equal *prefixes*, not just equal blocks: the K/V of a
block depends on every token before it. Only full blocks get a hash::

    block_size = 4, tokens t0 .. t9
    blocks   [t0 t1 t2 t3] [t4 t5 t6 t7] [t8 t9 . .]
    hashes   h0 = H(ROOT, t0..t3, x)
             h1 = H(h0,   t4..t7, x)        (the partial last block has none)

``x`` (extra keys) is whatever else changes a block's K/V for the same tokens: an adapter
(LoRA) name, a cache salt, later a multimodal input's id. Requests with different extra keys
never share blocks.

NOTE: the hash is SHA-256 over a fixed byte layout, not Python's ``hash()``. A collision would
silently hand a request another prefix's K/V (wrong outputs, or one tenant's prompt leaking into
another's), and a 64-bit non-cryptographic hash can be collided on purpose by a client that
chooses token ids; SHA-256 cannot. It is also stable across processes and machines (no
PYTHONHASHSEED, fixed endianness), so hashes can be logged and compared. It costs ~1 us per
16-token block, nothing beside a forward pass.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes
"""A 32-byte SHA-256 digest."""

ExtraKeys = tuple[str | int, ...]
"""Hashed into every block of a request besides its tokens (see the module docstring)."""

ROOT_HASH: BlockHash = hashlib.sha256(b"fitserve prefix cache v1").digest()
"""The parent hash of a sequence's first block."""


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra_keys: ExtraKeys = ()) -> BlockHash:
    """The hash of one full block given its parent's hash.

    Byte layout: parent (32 bytes) | token count (uint32 LE) | token ids (int64 LE each) |
    ``repr(extra_keys)`` in UTF-8. The parent has a fixed length and the count fixes the token
    bytes, so the extra keys are whatever remains: no two inputs share a layout.
    """
    n = len(token_ids)
    h = hashlib.sha256(parent)
    h.update(struct.pack(f"<I{n}q", n, *token_ids))
    if extra_keys:
        h.update(repr(extra_keys).encode("utf-8"))
    return h.digest()


def extend_block_hashes(
    hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    num_blocks: int,
    extra_keys: ExtraKeys = (),
) -> None:
    """Append to ``hashes`` (the chain so far of ``token_ids``) until it covers ``num_blocks``
    full blocks; blocks already hashed are kept, so calling it each step costs only new blocks.

    ``token_ids`` must hold at least ``num_blocks * block_size`` tokens.
    """
    if num_blocks * block_size > len(token_ids):
        raise ValueError(
            f"{num_blocks} blocks of {block_size} need {num_blocks * block_size} tokens, "
            f"got {len(token_ids)}"
        )
    parent = hashes[-1] if hashes else ROOT_HASH
    for i in range(len(hashes), num_blocks):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], extra_keys)
        hashes.append(parent)
