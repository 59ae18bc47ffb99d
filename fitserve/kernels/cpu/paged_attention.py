"""Python side of the fused paged decode attention kernel (``paged_attention.cpp``).

``torch.ops.fitserve.paged_decode_attention`` reads K/V blocks in place through the block table
(no gather copy) with an fp32 online softmax, the G query heads of a KV head together, ragged
lengths and sliding windows; see the C++ source for the work split. It is compiled at first use
by :func:`fitserve.kernels.cpu.build.load_extension`; when that returns None (no compiler, a
failed build, ``FITSERVE_DISABLE_CPP=1``) :func:`paged_attention_available` is False and the
engine keeps its pure-torch gather path.

A fake (meta) implementation is registered with the op, so ``torch.compile`` treats the call as
one opaque node (output [num_seqs, num_heads, head_dim] in q's dtype) and traces around it.
"""

from __future__ import annotations

import threading

import torch

from fitserve.kernels.cpu.build import load_extension

# NOTE: keys per partition. Fixed spans of absolute positions keep the result independent of
# the batch and thread count; 256 keys fill 2 cores at batch 1 from ~300 keys up while the
# merge stays < 1% of the work (benchmarks/bench_kernels.py --partitions compares sizes).
DEFAULT_PARTITION = 256

_lock = threading.Lock()
_state: dict[str, bool] = {}


def paged_attention_available() -> bool:
    """True when the C++ op is loaded (built now if needed, cached in FITSERVE_HOME)."""
    with _lock:
        if "ok" not in _state:
            _state["ok"] = load_extension("paged_attention", "paged_attention.cpp") is not None
            if _state["ok"]:
                _register_fake()
        return _state["ok"]


def _fake(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, window: int, partition_size: int = DEFAULT_PARTITION,
    vectorized: bool = True,
) -> torch.Tensor:
    """Shape/dtype of the op's output for FakeTensor tracing: a fresh [B, Hq, D] like q."""
    return q.new_empty(q.shape)


def _fake_prefill(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
    cached: int, scale: float, window: int, partition_size: int = DEFAULT_PARTITION,
    vectorized: bool = True,
) -> torch.Tensor:
    """Shape/dtype of the prefill op's output: a fresh [T, Hq, D] like q."""
    return q.new_empty(q.shape)


def _register_fake() -> None:
    torch.library.register_fake("fitserve::paged_decode_attention", _fake)
    torch.library.register_fake("fitserve::paged_prefill_attention", _fake_prefill)


def kernel_isa() -> str:
    """"avx512+bf16dot", "avx512", "avx2" or "scalar": what the loaded build vectorises with
    ("" when not loaded)."""
    if not paged_attention_available():
        return ""
    return str(torch.ops.fitserve.paged_attention_isa())


AMX_MODES = ("off", "all", "prefill", "auto")
# NOTE: kAmxMinGroup of paged_attention.cpp (the test of "auto" fails if the two part)
AMX_MIN_GROUP = 8


def amx_mode() -> str:
    """Which ops run the bf16 attention (bf16 q and cache) on AMX-BF16 tiles
    (paged_attention_amx.h): "auto" (the default: decode and prefill for models with at least
    8 query heads per KV head, where the tile is the faster one for both), "all" (decode and
    prefill whatever the group), "prefill" (the prefill only: its rows then differ in the last
    bits from the decode kernel's) or "off". Decode and prefill on the same tile keep every
    prefill row bitwise the decode kernel's. Set by ``FITSERVE_AMX_ATTENTION=auto|1|prefill|0``
    or :func:`set_amx`; "off" where the build or the OS has no AMX-BF16."""
    if not paged_attention_available():
        return "off"
    return AMX_MODES[int(torch.ops.fitserve.paged_attention_amx_mode())]


def set_amx(mode: bool | str) -> str:
    """Sets :func:`amx_mode` for later calls (True = "all", False = "off"); returns the mode it
    got ("off" where the build or the OS has no AMX-BF16)."""
    if not paged_attention_available():
        return "off"
    name = ("all" if mode else "off") if isinstance(mode, bool) else mode
    if name not in AMX_MODES:
        raise ValueError(f"AMX attention mode must be one of {AMX_MODES}, got {mode!r}")
    return AMX_MODES[int(torch.ops.fitserve.paged_attention_set_amx_mode(AMX_MODES.index(name)))]


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    *,
    partition_size: int = DEFAULT_PARTITION,
    vectorized: bool = True,
) -> torch.Tensor:
    """One decode query per sequence over the paged, head-major cache.

    q [B, Hq, D] (head_dim contiguous, any batch/head strides); k_cache, v_cache
    [Hkv, num_blocks, block_size, D] in q's dtype (float32, bfloat16 or float16), or 16-bit
    under a float32 q (the output is then float32: no rounding of the result); block_tables
    [B, max_blocks] int32 (int64 is converted); seq_lens [B] keys per sequence; ``window``
    None or <= 0 for full attention, else the query (position L-1) sees keys j with
    (L-1) - j < window. Returns [B, Hq, D] in q's dtype; a sequence with no key gives zeros.
    ``vectorized=False`` runs the plain C++ tile (tests compare the two).
    Raises RuntimeError when the extension is not available (check
    :func:`paged_attention_available` first).
    """
    if not _state.get("ok") and not paged_attention_available():
        raise RuntimeError("the paged_attention C++ extension is not available")
    out: torch.Tensor = torch.ops.fitserve.paged_decode_attention(
        q, k_cache, v_cache, block_tables, seq_lens, float(scale),
        0 if window is None else int(window), int(partition_size), bool(vectorized),
    )
    return out


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cached: int,
    scale: float,
    window: int | None = None,
    *,
    partition_size: int = DEFAULT_PARTITION,
    vectorized: bool = True,
) -> torch.Tensor:
    """Causal attention of one sequence's chunk of T queries over the paged cache.

    Query i sits at position ``cached + i`` and sees keys j <= cached + i (and, with a
    ``window``, cached + i - j < window); the chunk's own keys must be in the cache already.
    q [T, Hq, D]; the caches as for :func:`paged_decode_attention`; block_table [max_blocks]
    (int32, or int64 converted). Query tiles against K/V tiles read once per tile (flash-style),
    and every row equals, bit for bit, ``paged_decode_attention`` of that token with the same
    ``partition_size`` (the batch-invariant prefill). Returns [T, Hq, D] in q's dtype.
    """
    if not _state.get("ok") and not paged_attention_available():
        raise RuntimeError("the paged_attention C++ extension is not available")
    out: torch.Tensor = torch.ops.fitserve.paged_prefill_attention(
        q, k_cache, v_cache, block_table, int(cached), float(scale),
        0 if window is None else int(window), int(partition_size), bool(vectorized),
    )
    return out
