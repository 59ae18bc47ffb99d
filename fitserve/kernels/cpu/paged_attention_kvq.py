"""Python side of the fused paged decode kernel over a quantized KV cache
(``paged_attention_kvq.cpp``).

``torch.ops.fitserve.paged_decode_attention_kvq`` reads a :class:`~fitserve.quant.kv_cache.
QuantizedKVCache`'s int8 / fp8 codes and float32 scales in place through the block table (no
dequantized copy), folding the scales into the products: per-token key scales multiply each
score, per-channel key scales multiply q once per block, per-token value scales multiply each
softmax weight. Built at first use like the dense kernel; where it is not available
:func:`paged_attention_kvq_available` is False and the engine keeps its dequantize path.
"""

from __future__ import annotations

import threading

import torch

from fitserve.kernels.cpu.build import load_extension
from fitserve.kernels.cpu.paged_attention import DEFAULT_PARTITION

# the kernel's codec ids (kv_codes.h), by fitserve.quant.kv_cache.CODECS name
CODEC_IDS = {"int8": 0, "fp8_e4m3": 1, "fp8_e5m2": 2}

_lock = threading.Lock()
_state: dict[str, bool] = {}
_write_state: list[bool] = []


def paged_attention_kvq_available() -> bool:
    """True when the C++ op is loaded (built now if needed, cached in FITSERVE_HOME)."""
    with _lock:
        if "ok" not in _state:
            ok = load_extension("paged_attention_kvq", "paged_attention_kvq.cpp") is not None
            if ok:
                torch.library.register_fake("fitserve::paged_decode_attention_kvq", _fake)
            _state["ok"] = ok
        return _state["ok"]


def kvq_write_available() -> bool:
    """True when ``torch.ops.fitserve.rope_write_kvq_`` (kvq_write.cpp) is loaded: the fused
    rotation + quantized cache write, bit-equal to RotaryEmbedding then QuantizedKVCache.write."""
    with _lock:
        if not _write_state:
            _write_state.append(load_extension("kvq_write", "kvq_write.cpp") is not None)
        return _write_state[0]


def _fake(q: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    """Shape/dtype of the op's output for FakeTensor tracing: a fresh [B, Hq, D] like q."""
    return q.new_empty(q.shape)


def kernel_kvq_isa() -> str:
    """"avx512", "avx2" or "scalar": what the loaded build vectorises with ("" if not loaded)."""
    if not paged_attention_kvq_available():
        return ""
    return str(torch.ops.fitserve.paged_attention_kvq_isa())


def paged_decode_attention_kvq(
    q: torch.Tensor,
    k_codes: torch.Tensor,
    v_codes: torch.Tensor,
    k_scales: torch.Tensor,
    v_scales: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    *,
    codec: str,
    channel_keys: bool,
    partition_size: int = DEFAULT_PARTITION,
    vectorized: bool = True,
) -> torch.Tensor:
    """One decode query per sequence over a quantized paged cache.

    q [B, Hq, D] float32/bfloat16/float16; codes [Hkv, num_blocks, block_size, D] (int8 for
    ``codec="int8"``, the fp8 bits as uint8 otherwise); v_scales [Hkv, num_blocks, block_size];
    k_scales the same (per token) or [Hkv, num_blocks, D] with ``channel_keys`` (per block and
    channel). Tables, lengths and ``window`` as in
    :func:`fitserve.kernels.cpu.paged_attention.paged_decode_attention`. Returns [B, Hq, D] in
    q's dtype. Raises RuntimeError when the extension is not available.
    """
    if codec not in CODEC_IDS:
        raise ValueError(f"unknown KV codec {codec!r}; known: {', '.join(CODEC_IDS)}")
    if not _state.get("ok") and not paged_attention_kvq_available():
        raise RuntimeError("the paged_attention_kvq C++ extension is not available")
    out: torch.Tensor = torch.ops.fitserve.paged_decode_attention_kvq(
        q, k_codes, v_codes, k_scales, v_scales, block_tables, seq_lens, float(scale),
        0 if window is None else int(window), CODEC_IDS[codec], bool(channel_keys),
        int(partition_size), bool(vectorized),
    )
    return out
