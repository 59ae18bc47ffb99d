"""``x @ W.T`` on a GGUF tensor's raw ggml blocks (ggml_blocks.cpp), without dequantizing W.

The weight is what the file stores, byte for byte: uint8 ``[N, (K // block_size) * type_size]``,
row n = the blocks of output feature n back to back (the contract of
fitserve/quant/ggml_blocks.py's ``GgmlBlockWeight``). ``x`` is quantized per row to int8 the way
llama.cpp does for the same types (per 256 columns for the K-quants and IQ4_XS, llama.cpp's
Q8_K; per 32 for Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / IQ4_NL / MXFP4, its Q8_0), the dots run in integers (AVX2 maddubs, AVX512-VNNI vpdpwssd /
vpdpbusd, or scalar C++ on a CPU without AVX2) and are combined in fp32. The error against the
exact product is bounded by ``sum over activation blocks of (d_b / 2) * sum |w|`` over the
block's columns (d_b = absmax / 127 of the block), plus fp32 rounding.

Without the C++ build (no compiler, a failed build, ``FITSERVE_DISABLE_CPP=1``)
:func:`ggml_kernel_available` is False and the caller runs its pure-torch path.
"""

from __future__ import annotations

import functools

import torch

from fitserve.kernels.cpu.build import load_extension

__all__ = ["GGML_KERNEL_TYPES", "amx_active", "ggml_blocks_tier", "ggml_dequant_rows",
           "ggml_kernel_available", "ggml_matmul", "set_amx"]

# NOTE: the types ggml_blocks.cpp implements, on every ISA tier (scalar included); whether the
# build exists on this machine is ggml_kernel_available's question (building it is not an import
# side effect). A test checks this tuple against the compiled list.
GGML_KERNEL_TYPES: tuple[str, ...] = ("Q4_K", "Q5_K", "Q6_K", "Q4_0", "Q4_1", "Q8_0", "Q5_0",
                                      "Q5_1", "IQ4_NL", "IQ4_XS", "MXFP4")

# (block_size, type_size) of each type, from gguf.GGML_QUANT_SIZES (checked by the tests)
_BLOCK = {"Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210), "Q4_0": (32, 18),
          "Q4_1": (32, 20), "Q8_0": (32, 34), "Q5_0": (32, 22),
          "Q5_1": (32, 24), "IQ4_NL": (32, 18), "IQ4_XS": (256, 136), "MXFP4": (32, 17)}


@functools.cache
def _ops_loaded() -> bool:
    if load_extension("ggml_blocks", "ggml_blocks.cpp") is None:
        return False
    torch.library.register_fake("fitserve::ggml_matmul", _ggml_matmul_fake)
    torch.library.register_fake("fitserve::ggml_dequant_rows", _ggml_dequant_rows_fake)
    return True


def _ggml_matmul_fake(x: torch.Tensor, blocks: torch.Tensor, ggml_type: str, n: int,
                      k: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], n, dtype=torch.float32)


def _ggml_dequant_rows_fake(blocks: torch.Tensor, ids: torch.Tensor, ggml_type: str, k: int,
                            dtype: torch.dtype) -> torch.Tensor:
    return blocks.new_empty(*ids.shape, k, dtype=dtype)


def ggml_dequant_rows(blocks: torch.Tensor, ids: torch.Tensor, ggml_type: str, k: int,
                      dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` of ``blocks`` (uint8 ``[N, K / block * bytes]``) dequantized: ``[*ids.shape,
    K]`` of ``dtype`` (float32, bfloat16, float16), the values of
    fitserve.quant.ggml_blocks.dequantize_blocks (gguf-py's) rounded once to ``dtype`` -- a token
    embedding's lookup in one call. An id outside ``[0, N)`` raises IndexError."""
    if not _ops_loaded():
        raise RuntimeError("the ggml_blocks C++ kernels are unavailable (see the log for why); "
                           "use the pure-torch path")
    out: torch.Tensor = torch.ops.fitserve.ggml_dequant_rows(blocks, ids.long(), ggml_type, k,
                                                             dtype)
    return out


def ggml_kernel_available(ggml_type: str) -> bool:
    """True when this build has a C++ kernel for ``ggml_type`` (gguf's type name, e.g. "Q4_K")."""
    return ggml_type in GGML_KERNEL_TYPES and _ops_loaded()


def ggml_blocks_tier() -> str:
    """The ISA tier the loaded kernels were built for ("avx512_vnni", ..., "scalar")."""
    if not _ops_loaded():
        raise RuntimeError("the ggml_blocks C++ kernels are unavailable (see the log for why)")
    return str(torch.ops.fitserve.ggml_blocks_tier())


def amx_active() -> bool:
    """Whether the M > 1 calls run on AMX-INT8 tiles (the K-quant panels, ggml_blocks_kqamx.h;
    the 32-column types from 16 rows, ggml_blocks_lanes_amx.h): compiled for this CPU, granted
    by the OS, not turned off (``FITSERVE_AMX=0`` or :func:`set_amx`)."""
    return _ops_loaded() and bool(torch.ops.fitserve.ggml_blocks_amx_active())


def set_amx(on: bool) -> bool:
    """Turns the AMX tiles on or off for later calls (the bits are the same either way); returns
    whether they are on."""
    return _ops_loaded() and bool(torch.ops.fitserve.ggml_blocks_set_amx(on))


def ggml_matmul(x: torch.Tensor, blocks: torch.Tensor, ggml_type: str, n: int,
                k: int) -> torch.Tensor:
    """float32 ``[M, N]`` = ``x @ W.T``, W [N, K] the dequantization of ``blocks`` (ggml_type).

    ``x``: float32 or bfloat16 ``[M, K]``. Raises ValueError for a type without a kernel, a K
    that is not a multiple of the type's block size, or shapes that do not fit.
    """
    if ggml_type not in GGML_KERNEL_TYPES:
        raise ValueError(f"ggml_matmul: no kernel for GGML type {ggml_type!r} "
                         f"(kernels: {', '.join(GGML_KERNEL_TYPES)})")
    if not _ops_loaded():
        raise RuntimeError("the ggml_blocks C++ kernels are unavailable (see the log for why); "
                           "use the pure-torch path")
    block, size = _BLOCK[ggml_type]
    if k <= 0 or k % block:
        raise ValueError(f"ggml_matmul: K={k} is not a positive multiple of {ggml_type}'s "
                         f"block size {block}")
    if x.dim() != 2 or x.shape[1] != k or x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"ggml_matmul: x must be float32 / bfloat16 [M, {k}], got "
                         f"{x.dtype} {list(x.shape)}")
    if blocks.dtype != torch.uint8 or tuple(blocks.shape) != (n, k // block * size):
        raise ValueError(f"ggml_matmul: blocks must be uint8 [{n}, {k // block * size}] for "
                         f"{ggml_type} with K={k}, got {blocks.dtype} {list(blocks.shape)}")
    y: torch.Tensor = torch.ops.fitserve.ggml_matmul(x.contiguous(), blocks.contiguous(),
                                                     ggml_type, n, k)
    return y
