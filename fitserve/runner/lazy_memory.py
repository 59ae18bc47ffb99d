"""Zero-filled host tensors whose pages become resident only when first written.

The KV pool is sized up front (``--kv-cache-memory``) but a run rarely fills it. ``torch.zeros``
writes every byte, so the whole pool would be resident from the start; an anonymous private
mapping is zero-filled by the kernel page by page on first touch instead (what vLLM's CPU
backend gets from its untouched ``torch.empty`` pool, but guaranteed zero: a block nobody wrote
reads as 0, never as an allocator's leftover NaN). With ``BlockPool`` handing out used blocks
before fresh ones, the resident part of the pool is the workload's peak (``num_touched_blocks``).

NOTE: transparent huge pages are refused for the mapping (MADV_NOHUGEPAGE): with THP "always",
one first write would make 2 MiB resident, and the per-layer, per-head layout
([kv_heads, num_blocks, block_size, head_dim]) would spread that over every layer and head.
"""

from __future__ import annotations

import math
import mmap

import torch


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``torch.zeros(shape, dtype)``; on the CPU backed by a mapping that costs no memory
    until written. Other devices get plain ``torch.zeros``."""
    numel = math.prod(shape)
    if torch.device(device).type != "cpu" or numel == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                    prot=mmap.PROT_READ | mmap.PROT_WRITE)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        buf.madvise(mmap.MADV_NOHUGEPAGE)
    # frombuffer keeps ``buf`` alive for as long as the tensor (or a view of it) is
    return torch.frombuffer(buf, dtype=dtype, count=numel).view(shape)


def resident_bytes(t: torch.Tensor) -> int | None:
    """Bytes of ``t``'s storage resident in RAM (mincore over its pages), None where the
    platform cannot say."""
    import ctypes
    import ctypes.util

    libc_name = ctypes.util.find_library("c")
    if libc_name is None or t.device.type != "cpu":
        return None
    libc = ctypes.CDLL(libc_name)
    page = mmap.PAGESIZE
    start = t.untyped_storage().data_ptr()
    nbytes = t.untyped_storage().nbytes()
    first = start - start % page
    pages = -(-(start + nbytes - first) // page)
    vec = (ctypes.c_ubyte * pages)()
    if libc.mincore(ctypes.c_void_p(first), ctypes.c_size_t(pages * page), vec) != 0:
        return None
    return sum(v & 1 for v in vec) * page
