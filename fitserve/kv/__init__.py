"""Paged KV cache bookkeeping: block pool, reference counts, block tables, prefix-cache hashes.
Torch-free."""

from fitserve.kv.block_pool import BlockPool, NoFreeBlocksError
from fitserve.kv.group import NULL_BLOCK, KVGroup
from fitserve.kv.manager import KVCacheManager, KVStats
from fitserve.kv.prefix_hash import BlockHash, hash_block

__all__ = ["NULL_BLOCK", "BlockHash", "BlockPool", "KVCacheManager", "KVGroup", "KVStats", "NoFreeBlocksError",
           "hash_block"]
