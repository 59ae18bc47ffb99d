"""Paged KV cache bookkeeping: block pool, reference counts, block tables, prefix-cache hashes.
Torch-free."""

from fitserve.kv.block_pool import BlockPool, NoFreeBlocksError
from fitserve.kv.manager import KVCacheManager, KVStats
from fitserve.kv.prefix_hash import BlockHash, hash_block

__all__ = ["BlockHash", "BlockPool", "KVCacheManager", "KVStats", "NoFreeBlocksError", "hash_block"]
