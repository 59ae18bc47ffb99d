"""Transient bytes of one CPU engine step beyond the activations: attention and sampling.

What fitserve's engine allocates on a CPU while a step runs, as functions of the step token
budget (``max_num_batched_tokens``), the context (``max_model_len``) and the batch
(``max_num_seqs``), read off the engine's code (fitserve/model/attention/paged.py, runner.py,
sampling/sampler.py, kernels/cpu/paged_attention.cpp) and measured with torch.profiler's
memory events on torch 2.13.0 (tests/numerics/test_attention_scratch.py repeats the check).

Prefill chunks run one sequence at a time (``TorchSDPA.prefill``), T queries against L = S + T
keys; the worst is T = min(budget, max_model_len) queries against L = max_model_len keys::

    gathered K, V copies      2 x Hkv x ceil(L / block) x block x D x kv_bytes  (whole blocks)
    bool mask [T, L]          built by the runner for a chunk after cached tokens (or a
                              window shorter than it), alive the whole step: budget x L x 1 B,
                              with the block tables (int64: seqs x ceil(L / block) x 8 B)
    SDPA (CPU flash kernel)   see ``cpu_sdpa_bytes``: output, logsumexp, per-thread tiles,
                              the bool mask as an additive float mask [T, L] in the model dtype,
                              and in bf16/f16 a repacked copy of K and V

Decode on the CPU runs the fused C++ kernel (``ScratchKind.FUSED_DECODE``): no gather, no
score matrix, only its output and, for sequences longer than one 256-key partition, fp32
partial results per (sequence, KV head, partition). Without the kernel (no compiler,
``FITSERVE_DISABLE_CPP=1``) decode gathers every sequence's blocks (``gather_decode_bytes``):
the dispatch rule runs the eager gather path up to 4096 keys (``GATHER_EAGER``: fp32 scores
[Hq, B, L] and probabilities) and SDPA beyond (``GATHER_SDPA``). Each attention backend
(fitserve.model.attention) names its kind as ``ledger_kind``.

Scratch lives inside one layer's attention call and is freed before the next layer, so it
coexists with that layer's attention-phase activations, never with its MLP (see
``memory.cpu_step_bytes``); the bool masks live for the whole step.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import StrEnum

from fitserve import envs
from fitserve.config import ModelSpec
from fitserve.ledger import sampler_memory
from fitserve.ledger.hardware import cpu_has_amx_bf16

# NOTE: torch 2.13's CPU flash attention (aten/native/cpu/FlashAttentionKernel.cpp) tiles the
# queries by 256 from 768 queries up, by 64 from 192, else by 32, and the keys by 512.
FLASH_KV_SPLIT = 512
# NOTE: the fused decode kernel's partition (fitserve.kernels.cpu.paged_attention
# DEFAULT_PARTITION) and its fp32 lane padding of head_dim (kLanes in paged_attention.cpp).
PAGED_PARTITION = 256
PAGED_LANES = 16
# NOTE: the gather decode path's switch from eager to SDPA (fitserve.model.attention.dispatch:
# length bucket "<=4096"); tests/numerics/test_attention_scratch.py pins both constants.
GATHER_EAGER_MAX_KEYS = 4096

# NOTE: the ggml block kernels (fitserve.kernels.cpu.ggml_blocks) write float32 [M, N]; a
# GgmlLinear with 16-bit activations runs them on at most output_staging_rows(N) rows at a time
# and casts each piece into its output, so the float32 staging is at most this many floats
# (16 MiB) whatever the step's token count (a 2,048-token prefill of SmolLM2-1.7B's gate/up
# held 128 MiB of it at once, +96 MiB over the ledger and as much again left in glibc's heap).
OUTPUT_STAGING_FLOATS = 1 << 22


class ScratchKind(StrEnum):
    """What one attention call allocates, as this ledger counts it (each CPU attention backend
    of fitserve.model.attention names its kind as ``ledger_kind``)."""

    FUSED_DECODE = "fused_decode"  # reads K/V in place: ``paged_decode_bytes``
    GATHER_EAGER = "gather_eager"  # gathered K/V + fp32 scores and probabilities
    GATHER_SDPA = "gather_sdpa"  # gathered K/V + ``cpu_sdpa_bytes``


def cpu_threads() -> int:
    """Threads torch's CPU kernels use at most: OMP_NUM_THREADS when set, else every logical
    CPU (torch defaults to the physical cores, never more), so a bound of per-thread tiles."""
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    return max(1, os.cpu_count() or 1)


def cpp_kernels_disabled() -> bool:
    """True when FITSERVE_DISABLE_CPP forces the pure-torch paths (the planner's view of
    whether the fused decode kernel runs; fitserve.kernels.cpu.build reads the same variable)."""
    return envs.FITSERVE_DISABLE_CPP()


def flash_q_split(q_len: int) -> int:
    """Queries per tile of torch's CPU flash attention for ``q_len`` queries."""
    split = 256 if q_len >= 768 else 64 if q_len >= 192 else 32
    return min(split, q_len)


def cpu_sdpa_bytes(*, num_heads: int, num_kv_heads: int, head_dim: int, q_len: int,
                   kv_len: int, act_bytes: int, threads: int, masked: bool, batch: int = 1,
                   packed: bool | None = None) -> int:
    """Bytes ``F.scaled_dot_product_attention`` allocates on a CPU (torch 2.13: the flash
    kernel for every call the engine makes, GQA without expanding K/V), q [batch, Hq, T, D]
    against K/V [batch, Hkv, L, D]::

        output          batch x Hq x T x D x act_bytes
        logsumexp       batch x Hq x T x 4
        per thread      (qs x ks + 2 qs + qs x D) x 4      qs = flash_q_split(T), ks = min(512, L)
        bf16 / f16      + per thread qs x ks x act_bytes   (the reduced copy of the tile)
          ``packed``    + per thread ks x D x act_bytes + 2 x batch x Hkv x L x D x act_bytes
                          (K and V repacked for the bf16 GEMM; torch skips it for small T,
                          e.g. T = 16 against 3000 keys, and always at T = 1: counted unless
                          ``packed=False``, an upper bound there)
        ``masked``      + batch x T x L x act_bytes        (the bool mask as a float mask)

    ``packed`` None: as torch does on this CPU, which repacks only where it has AMX bf16
    (``cpu_has_amx_bf16``).

    Measured with torch.profiler memory events, torch 2.13.0, 1 and 2 threads, bf16 and fp32,
    (Hq, Hkv, D) = (9, 3, 64), (4, 1, 24), (8, 2, 32), T x L from 7 x 7 to 2048 x 4096: equal
    to the byte in fp32; in bf16 on a Xeon with AMX equal wherever torch repacks, above it by
    the repacked K/V where it does not; on a Zen 4 (AVX512-BF16, no AMX) torch never repacks
    and the count without packing is equal to the byte (T x L = 64 x 512 to 1024 x 4096).
    """
    if packed is None:
        packed = cpu_has_amx_bf16()
    qs, ks = flash_q_split(q_len), min(FLASH_KV_SPLIT, kv_len)
    out = batch * num_heads * q_len * head_dim * act_bytes
    lse = batch * num_heads * q_len * 4
    tiles = threads * (qs * ks + 2 * qs + qs * head_dim) * 4
    if act_bytes < 4:
        tiles += threads * qs * ks * act_bytes
        if packed:
            tiles += threads * ks * head_dim * act_bytes
            tiles += 2 * batch * num_kv_heads * kv_len * head_dim * act_bytes
    mask = batch * q_len * kv_len * act_bytes if masked else 0
    return out + lse + tiles + mask


def gathered_kv_bytes(spec: ModelSpec, batch: int, kv_len: int, block_size: int,
                      kv_bytes: int) -> int:
    """K and V copies of ``batch`` sequences' blocks (``gather_blocks``: whole blocks)."""
    blocks = -(-kv_len // block_size)
    return 2 * spec.num_kv_heads * batch * blocks * block_size * spec.head_dim * kv_bytes


def prefill_chunk_bytes(spec: ModelSpec, q_len: int, kv_len: int, *, block_size: int,
                        act_bytes: int, kv_bytes: int, threads: int, masked: bool) -> int:
    """One prefill chunk's attention call, beyond the runner's bool mask: the gathered K/V
    copies plus what SDPA allocates (``cpu_sdpa_bytes``)."""
    return gathered_kv_bytes(spec, 1, kv_len, block_size, kv_bytes) + cpu_sdpa_bytes(
        num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
        q_len=q_len, kv_len=kv_len, act_bytes=act_bytes, threads=threads, masked=masked)


def paged_decode_bytes(spec: ModelSpec, batch: int, kv_len: int, act_bytes: int) -> int:
    """The fused C++ decode kernel over ``batch`` sequences of ``kv_len`` keys: its output
    [B, Hq, D] and, when a sequence spans several partitions, the fp32 partials of every
    (sequence, KV head, partition): G x (dpad + 2) floats each (accumulators, max, sum).

    NOTE: the partials are a plain C++ allocation (``new float[]``), invisible to torch's
    profiler: counted from paged_attention.cpp, not measured.
    """
    out = batch * spec.num_heads * spec.head_dim * act_bytes
    parts = -(-kv_len // PAGED_PARTITION)
    if parts <= 1:
        return out
    group = spec.num_heads // max(1, spec.num_kv_heads)
    dpad = -(-spec.head_dim // PAGED_LANES) * PAGED_LANES
    return out + batch * spec.num_kv_heads * parts * group * (dpad + 2) * 4


# NOTE: the first fused prefill ran a chunk as one decode row per query, with fp32 partials
# per (row, KV head, partition) in one buffer (58 MiB a layer for 2,048 queries after 2,048
# cached tokens), so the backend (CpuPagedDecode.prefill) runs the rows in slices whose
# per-row partials stay under this cap. The flash-style op (paged_prefill.h) keeps partials
# per 32-row tile and thread only (``paged_prefill_bytes``); the slices remain.
PAGED_PREFILL_PARTIALS_BYTES = 8 << 20


def paged_partials_bytes_per_row(num_heads: int, num_kv_heads: int, head_dim: int,
                                 kv_len: int) -> int:
    """fp32 partials of one decode row of ``kv_len`` keys (0 within one partition): Hkv x
    ceil(L / 256) items of G x (dpad + 2) floats (paged_attention.cpp ``part_stride``)."""
    parts = -(-kv_len // PAGED_PARTITION)
    if parts <= 1:
        return 0
    group = num_heads // max(1, num_kv_heads)
    dpad = -(-head_dim // PAGED_LANES) * PAGED_LANES
    return num_kv_heads * parts * group * (dpad + 2) * 4


def paged_prefill_rows(num_heads: int, num_kv_heads: int, head_dim: int, kv_len: int) -> int:
    """Query rows per fused-kernel call for a prefill chunk whose longest row reads ``kv_len``
    keys: as many as keep the call's partials within PAGED_PREFILL_PARTIALS_BYTES."""
    per_row = paged_partials_bytes_per_row(num_heads, num_kv_heads, head_dim, kv_len)
    return max(1, PAGED_PREFILL_PARTIALS_BYTES // per_row) if per_row else 1 << 30


# NOTE: the flash-style prefill op's constants (paged_prefill.h kPrefillRows: query rows per
# work item; paged_attention_simd.h kTile: keys per online-softmax step)
PAGED_PREFILL_TILE_ROWS = 32
PAGED_TILE_KEYS = 64


def _pushed_capacity(n: int) -> int:
    """Capacity of a std::vector filled by n push_backs from empty (libstdc++ doubles it)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def paged_prefill_thread_bytes(group: int, dpad: int) -> int:
    """The larger of the prefill op's two per-thread row states (thread_local, kept between
    calls): ``PrefillRow`` x kPrefillRows (q, acc: G x dpad fp32; m, l: G fp32; qb: G x (dpad
    + 32) bf16) where its rows run one tile call each, or the blocked bf16 item's ``DotRows``
    (paged_prefill_dot.h) over rh = kPrefillRows x G row-heads: acc rh x dpad, m, l rh,
    s rh x kTile fp32, q pairs rh x (dpad + 32) / 2 and the K tile (dpad + 32) / 2 x kTile
    uint32, and its row-head lists (int64 + int, pushed: rh of full rows, G of own)."""
    rows, tile = PAGED_PREFILL_TILE_ROWS, PAGED_TILE_KEYS
    per_row = 2 * group * dpad * 4 + 2 * group * 4 + group * (dpad + 2 * PAGED_LANES) * 2
    rh, qstride = rows * group, (dpad + 2 * PAGED_LANES) // 2
    dot = (rh * dpad * 4 + 2 * rh * 4 + rh * tile * 4 + rh * qstride * 4 + qstride * tile * 4
           + _pushed_capacity(rh) * 12 + _pushed_capacity(group) * 12)
    return max(rows * per_row, dot)


def paged_prefill_bytes(spec: ModelSpec, q_len: int, kv_len: int, *, block_size: int,
                        act_bytes: int, threads: int = 1) -> tuple[int, int]:
    """(torch, C++) bytes of one prefill chunk through the flash-style op
    (``CpuPagedDecode.prefill`` -> paged_prefill.h), T = ``q_len`` queries whose last reads
    L = ``kv_len`` keys (cached S = L - T), the backend's slices of R = min(T,
    ``paged_prefill_rows(L)``) rows, on ``threads`` threads::

        torch   2 x R x Hq x D x act      the slice's contiguous q (q is a view of qkv) and
                                          the op's output
                + T x Hq x D x act        the chunk's output where it runs in slices (R < T)
                + ceil(L / block) x 4     the block ids as int32
        C++     per call of R rows: first_part / num_parts 2 x R x 8, the work items
                (ceil(R / 32) x Hkv, pushed) x 16, each thread's acc dpad x 4
                per thread (thread_local): the partials of its largest item, rows of the tile
                x the partitions of its last row x G x (dpad + 2) x 4 (every tile of every
                slice: the 32-row tiles start at each slice's first row), and the row states
                (``paged_prefill_thread_bytes``)

    NOTE: the decode kernel's own thread Scratch (shared with decode, kTile x dpad rows) is
    not counted here; the partials are per tile, no longer per row of the chunk."""
    hq, hkv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    rows = min(q_len, paged_prefill_rows(hq, hkv, d, kv_len))
    out = hq * d * act_bytes
    torch_bytes = 2 * rows * out + (q_len * out if rows < q_len else 0) + (
        -(-kv_len // block_size) * 4)
    group = hq // max(1, hkv)
    dpad = -(-d // PAGED_LANES) * PAGED_LANES
    cached, tile = kv_len - q_len, PAGED_PREFILL_TILE_ROWS
    partial = 0
    for lo in range(0, q_len, rows):  # the backend's slices, each tiled from its first row
        n = min(rows, q_len - lo)
        for r0 in range(0, n, tile):
            r1 = min(n, r0 + tile)
            parts = -(-(cached + lo + r1) // PAGED_PARTITION)  # of the tile's last row
            partial = max(partial, (r1 - r0) * parts * group * (dpad + 2) * 4)
    per_call = 2 * rows * 8 + _pushed_capacity(-(-rows // tile) * hkv) * 16
    cpp = per_call + threads * (dpad * 4 + partial + paged_prefill_thread_bytes(group, dpad))
    return torch_bytes, cpp


def gather_decode_bytes(spec: ModelSpec, batch: int, kv_len: int, kind: ScratchKind, *,
                        block_size: int, act_bytes: int, kv_bytes: int, threads: int) -> int:
    """Decode without the fused kernel (the gather backends' ``decode``), ``kind`` GATHER_EAGER
    or GATHER_SDPA.

    GATHER_EAGER (the rule's pick up to GATHER_EAGER_MAX_KEYS keys): gathered K/V + scores and
    probabilities over Lw = whole blocks of keys, Hq x B x Lw x (4 fp32 scores + 4 fp32
    probabilities + act_bytes for the model-dtype scores, or the probabilities cast back, in
    bf16) + q x scale, the output and its reshaped copy (3 x B x Hq x D x act_bytes).
    GATHER_SDPA (beyond): gathered K/V + SDPA with one query per sequence and a [B, 1, 1, Lw]
    mask (``cpu_sdpa_bytes``, nothing repacked). Measured (profiler, torch 2.13.0, B x L =
    8 x 1000, 32 x 4096, 4 x 6000): equal in fp32 and for GATHER_SDPA, 2 x B x Hq x D x 2 B
    above GATHER_EAGER in bf16.
    """
    if kind is ScratchKind.FUSED_DECODE:
        raise ValueError("the fused decode kernel gathers nothing: see paged_decode_bytes")
    lw = -(-kv_len // block_size) * block_size
    gathered = gathered_kv_bytes(spec, batch, kv_len, block_size, kv_bytes)
    if kind is ScratchKind.GATHER_EAGER:
        per_score = 8 + (act_bytes if act_bytes < 4 else 0)
        return (gathered + spec.num_heads * batch * lw * per_score
                + 3 * batch * spec.num_heads * spec.head_dim * act_bytes)
    return gathered + cpu_sdpa_bytes(
        num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
        q_len=1, kv_len=lw, act_bytes=act_bytes, threads=threads, masked=True, batch=batch,
        packed=False)


@dataclass(frozen=True)
class AttentionScratch:
    """The attention scratch of one engine step at its worst, on a CPU.

    ``kernel_bytes`` is per layer (the worst prefill chunk or the worst decode batch, which run
    one after the other); ``step_tensor_bytes`` (the runner's masks and block tables) lives for
    the whole step.
    """

    prefill_queries: int  # T of the worst chunk
    keys: int  # L = max_model_len
    prefill_bytes: int  # its gathered K/V + SDPA (float mask included)
    decode_batch: int
    decode_bytes: int
    step_tensor_bytes: int  # the runner's bool masks (+ visible/hidden of gather decode), tables
    fused_decode: bool
    threads: int
    paged_prefill: bool = False  # prefill chunks through the fused kernel (else SDPA)

    @property
    def kernel_bytes(self) -> int:
        return max(self.prefill_bytes, self.decode_bytes)

    @property
    def total_bytes(self) -> int:
        """The ledger line: masks + the worst attention call."""
        return self.step_tensor_bytes + self.kernel_bytes


def cpu_attention_scratch(spec: ModelSpec, *, max_num_batched_tokens: int, max_model_len: int,
                          max_num_seqs: int, block_size: int, act_bytes: int, kv_bytes: int,
                          threads: int, fused_decode: bool = True,
                          paged_prefill: bool | None = None) -> AttentionScratch:
    """The worst attention scratch of a step (see the module docstring for each term).

    Prefill: T = min(budget, max_model_len) queries against max_model_len keys, masked (a
    chunk after cached tokens; a plain causal first chunk needs less): the fused kernel's rows
    (``paged_prefill_bytes``) where it runs (``paged_prefill``, None: with the fused decode
    kernel), else gathered K/V + SDPA. Decode: min(max_num_seqs,
    budget) sequences of max_model_len keys (the gather path: its worst of GATHER_EAGER at up
    to GATHER_EAGER_MAX_KEYS keys and GATHER_SDPA beyond). Step tensors: prefill chunks' T_i x L_i bool masks sum to at
    most budget x max_model_len bytes; the gather decode path adds 2 x B x Lw bools; every
    sequence's block table (int64 ids, at most max_num_seqs x ceil(max_model_len / block)).
    """
    t = max(1, min(max_num_batched_tokens, max_model_len))
    keys = max(1, max_model_len)
    batch = max(1, min(max_num_seqs, max_num_batched_tokens))
    paged = fused_decode if paged_prefill is None else paged_prefill
    if paged:
        # the C++ kernel runs prefill chunks too, one decode row per query (not over a
        # quantized cache: those chunks read a dequantized copy through SDPA)
        prefill = sum(paged_prefill_bytes(spec, t, keys, block_size=block_size,
                                          act_bytes=act_bytes, threads=threads))
    else:
        prefill = prefill_chunk_bytes(spec, t, keys, block_size=block_size, act_bytes=act_bytes,
                                      kv_bytes=kv_bytes, threads=threads, masked=True)
    blocks = -(-keys // block_size)
    masks = max_num_batched_tokens * keys + max_num_seqs * blocks * 8
    if fused_decode:
        decode = paged_decode_bytes(spec, batch, keys, act_bytes)
    else:
        kw = dict(block_size=block_size, act_bytes=act_bytes, kv_bytes=kv_bytes,
                  threads=threads)
        decode = gather_decode_bytes(spec, batch, min(keys, GATHER_EAGER_MAX_KEYS),
                                     ScratchKind.GATHER_EAGER, **kw)
        if keys > GATHER_EAGER_MAX_KEYS:
            decode = max(decode, gather_decode_bytes(spec, batch, keys, ScratchKind.GATHER_SDPA,
                                                     **kw))
        masks += 2 * batch * blocks * block_size
    return AttentionScratch(t, keys, prefill, batch, decode, masks, fused_decode, threads, paged)


def rope_table_bytes(spec: ModelSpec, max_model_len: int) -> int:
    """The model's fp32 RoPE cos and sin tables: 2 x max_model_len x ceil(D / 2) x 4 B."""
    return 2 * max_model_len * ((spec.head_dim + 1) // 2) * 4


def sampler_bytes(spec: ModelSpec, max_num_seqs: int) -> int:
    """The sampler's working buffers at their worst (fitserve.ledger.sampler_memory)."""
    return sampler_memory.sampler_bytes(spec.vocab_size, max_num_seqs)


def output_staging_rows(out_features: int) -> int:
    """Rows of x per ggml kernel call of a GgmlLinear with ``out_features`` outputs and 16-bit
    activations: the float32 staging [rows, N] stays within OUTPUT_STAGING_FLOATS."""
    return max(1, OUTPUT_STAGING_FLOATS // max(1, out_features))


def output_staging_bytes(num_tokens: int, out_features: tuple[int, ...], act_bytes: int) -> int:
    """float32 bytes of the widest of these projections' staging over ``num_tokens`` rows:
    max over N of min(num_tokens, output_staging_rows(N)) x N x 4 (0 with float32
    activations: the kernel's output is the activation itself)."""
    if act_bytes >= 4 or num_tokens <= 0:
        return 0
    return max((min(num_tokens, output_staging_rows(n)) * n * 4 for n in out_features), default=0)


def projection_staging_bytes(spec: ModelSpec, num_tokens: int, act_bytes: int) -> tuple[int, int]:
    """(attention phase, MLP phase) float32 staging of a step of ``num_tokens`` tokens: the
    fused q/k/v and o_proj; gate/up (or each routed expert's) and down_proj."""
    h = spec.hidden_size
    inter = spec.intermediate_size
    if spec.num_experts:
        inter = max(inter if spec.first_k_dense else 0, spec.moe_intermediate_size or inter)
    return (output_staging_bytes(num_tokens, (spec.q_size + 2 * spec.kv_size, h), act_bytes),
            output_staging_bytes(num_tokens, (2 * inter, h), act_bytes))
