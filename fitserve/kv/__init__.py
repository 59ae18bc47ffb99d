"""Paged KV cache bookkeeping: block pool, reference counts, block tables. Torch-free."""

from fitserve.kv.block_pool import BlockPool, NoFreeBlocksError
from fitserve.kv.manager import KVCacheManager, KVStats

__all__ = ["BlockPool", "KVCacheManager", "KVStats", "NoFreeBlocksError"]
