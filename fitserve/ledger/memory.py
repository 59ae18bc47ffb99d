"""The engine's memory budget, line by line, in the order the engine reserves it.

    total memory (one rank)
    - weights                          (loaded first)
    - activation peak                  (one forward over the step token budget)
    - logits                           (f32 logits for every running sequence)
    - workspace / CUDA-graph reserve
    - headroom = total - floor(total x memory_utilization)   (left unused on purpose)
    = KV pool  -> num_kv_blocks = floor(KV pool / kv_block_bytes)

This is vLLM's reading of ``gpu_memory_utilization``: the engine may use ``total x utilization``
in all, and the KV pool gets what the other lines leave of it.

On a CPU the rule is the other way round (``cpu_engine_memory_plan``): the KV pool is a fixed
budget (``kv_cache_memory_bytes``, default ``DEFAULT_CPU_KV_BYTES``, as
VLLM_CPU_KVCACHE_SPACE fixes one for vLLM's CPU backend; without it vLLM 0.32's CPU backend gives
the KV what ``gpu_memory_utilization`` x RAM leaves, which fitserve does with
--gpu-memory-utilization on CPU) and the ledger adds the lines up to the process's peak resident set:

    runtime baseline (python + torch + engine modules, measured)
    + weights (as the engine holds them: packed as stored, or dense in the model dtype)
    + RoPE tables (fp32 cos/sin for max_model_len positions)
    + max(loading transient,  KV pool + step peak)
    = peak RSS

    step peak = attention masks and block tables (alive the whole step)
              + max(attention-phase activations + attention call scratch   one layer's
                      (+ a quantized cache's dequantized K/V),               phases, never
                    MLP-phase activations,                                   at once
                    (each + its widest projection's float32 output staging where the
                     ggml block kernels run: ``scratch.projection_staging_bytes``),
                    final hidden states + logits + sampler copies)
              + allocator retention (the two other phases: glibc's heap keeps their pages
                                     until the engine trims after the step)

The KV pool is backed lazily (``fitserve.runner.lazy_memory``): a block's pages become resident when it
is first written, and the block pool reuses used blocks before fresh ones, so a run holds
``peak_with_kv(touched blocks x block_bytes)``; ``peak_bytes`` is that with every block touched,
the bound a long-running server reaches once its traffic (or its prefix cache) fills the pool.

The phases follow each other within a step (a layer's attention scratch is freed before its
MLP runs, the last layer's before the logits are made), so the peak is their max, not their
sum; ``plan.scratch`` has the attention and sampler terms and how they were measured.
"""

from __future__ import annotations

from dataclasses import dataclass

from fitserve.config import ModelSpec
from fitserve.ledger.errors import PlanError
from fitserve.ledger.formats import kv_format
from fitserve.ledger.kv import kv_block_bytes, kv_bytes_per_token, layer_kinds
from fitserve.ledger.kv_groups import KVGroupPlan, grouped_max_concurrency, windowed_pools
from fitserve.ledger.params import is_mla
from fitserve.ledger.sampler_memory import sampler_chunk_rows
from fitserve.ledger.scratch import (
    AttentionScratch,
    cpp_kernels_disabled,
    cpu_attention_scratch,
    cpu_threads,
    projection_staging_bytes,
    rope_table_bytes,
    sampler_bytes,
)
from fitserve.ledger.units import fmt_bytes

LOGIT_BYTES = 4  # logits are kept in f32 for sampling
# the engine's KV budget on CPU (a fixed budget, as VLLM_CPU_KVCACHE_SPACE sets one for vLLM's CPU
# backend; `fitserve plan --batch-size` says when a batch needs more)
DEFAULT_CPU_KV_BYTES = 1 << 30
DEFAULT_GPU_WORKSPACE_BYTES = 1 << 30  # kernel workspace / CUDA-graph reserve on a GPU


@dataclass(frozen=True)
class MemoryLine:
    """One reservation: ``formula`` names how ``bytes`` was computed, ``note`` says why."""

    name: str
    formula: str
    bytes: int
    note: str = ""


def num_kv_blocks(kv_budget_bytes: int, spec: ModelSpec, block_size: int, kv_dtype: str,
                  tp: int = 1) -> int:
    """Whole KV blocks that fit in ``kv_budget_bytes`` on one rank (floor, never negative)."""
    return max(0, kv_budget_bytes) // kv_block_bytes(spec, block_size, kv_dtype, tp=tp)


def activation_peak_bytes(spec: ModelSpec, num_tokens: int, act_dtype_bytes: int,
                          tp: int = 1) -> int:
    """Peak live activations of one forward pass over ``num_tokens`` tokens, one rank.

    Formula ``act_peak``: num_tokens x (act_bytes x max(attention, mlp) + 24) where, per token,
      attention = 3H + (q + 2 kv + q) / tp (q/k/v outputs, attn out)
      mlp       = 3H + 3 I / tp (gate, up, and their product); MoE: k experts' 3 x I_e / tp
      3H        = the residual stream, the normed input, and the previous layer's output, which
                  the model's layer loop holds until the layer returns
      24 B      = the step's int64 token ids, positions and KV slots
    MLA uses heads x (qk_nope + qk_rope) for q and heads x (qk_nope + v) for the expanded KV.
    The attention call's own scratch (gathered K/V, score tiles, masks) is not in it: on a CPU
    it is the ledger's "attention scratch" line (``plan.scratch``).
    """
    return max(activation_phase_bytes(spec, num_tokens, act_dtype_bytes, tp))


# NOTE: measured (torch.profiler, tests/numerics/test_attention_scratch.py): one engine step's
# peak beyond the KV cache was what a 2H-per-token formula gave + exactly N x H x act_bytes +
# 24 N bytes: the previous layer's output (``x`` in CausalLM.forward) and the step's int64
# index tensors; with 3H and these 24 B the step peak is the measured one to within 1 KiB.
STEP_INDEX_BYTES = 24


def activation_phase_bytes(spec: ModelSpec, num_tokens: int, act_dtype_bytes: int,
                           tp: int = 1) -> tuple[int, int]:
    """(attention phase, MLP phase) live activations of ``activation_peak_bytes``."""
    h = spec.hidden_size
    if is_mla(spec):
        qk = spec.qk_nope_head_dim + spec.qk_rope_head_dim
        attn = 3 * h + (spec.num_heads * (qk + spec.qk_nope_head_dim + 2 * spec.v_head_dim)) // tp
    else:
        attn = 3 * h + (2 * spec.q_size + 2 * spec.kv_size) // tp
    mlp = 3 * h + 3 * spec.intermediate_size // tp
    if spec.num_experts:
        ei = spec.moe_intermediate_size or spec.intermediate_size
        routed = 3 * ei * (spec.num_experts_per_token + spec.num_shared_experts) // tp
        moe = 3 * h + routed
        mlp = moe if spec.first_k_dense == 0 else max(mlp, moe)
    index = num_tokens * STEP_INDEX_BYTES
    return (num_tokens * act_dtype_bytes * attn + index,
            num_tokens * act_dtype_bytes * mlp + index)


@dataclass(frozen=True)
class Ceiling:
    """An upper bound, never a promise: ``value`` and why real runs land below it."""

    value: int
    limited_by: str
    reasons: tuple[str, ...]

    def __int__(self) -> int:
        return self.value


@dataclass(frozen=True)
class EngineMemoryPlan:
    """The reservation lines (in order), the KV pool and its block count, for one rank."""

    spec: ModelSpec
    lines: tuple[MemoryLine, ...]
    kv_pool_bytes: int
    num_kv_blocks: int
    block_size: int
    block_bytes: int
    kv_bytes_per_token: int
    max_num_seqs: int
    kv_dtype: str
    tp: int
    device: str = "gpu"  # "gpu": the pool is what is left; "cpu": the pool is a fixed budget
    peak_bytes: int = 0  # the ledger's total: what the process holds at its peak
    # cpu: peak = resident + max(loading transient, KV + step peak), see ``peak_with_kv``
    resident_bytes: int = 0  # runtime baseline + weights + RoPE tables
    load_bytes: int = 0  # the loading transient
    step_bytes: int = 0  # the step peak: masks + max(attention, MLP, sampling phase)
    step_phase: str = ""  # the phase that sets the step peak
    # a model with sliding-window layers: the pool of each KV layer group (fitserve.ledger.
    # kv_groups); a hybrid model's num_kv_blocks / block_bytes are its full group's
    kv_groups: tuple[KVGroupPlan, ...] = ()

    def peak_with_kv(self, kv_bytes: int) -> int:
        """The cpu peak RSS with ``kv_bytes`` of KV in place of the pool (``plan.fit``)."""
        return self.resident_bytes + max(self.load_bytes, kv_bytes + self.step_bytes)

    @property
    def kv_allocated_bytes(self) -> int:
        """Bytes of KV tensors the engine allocates: num_kv_blocks x block_bytes (whole blocks
        only, so up to one block less than the budget); every group's pool for a hybrid model."""
        if len(self.kv_groups) > 1:
            return sum(g.pool_bytes for g in self.kv_groups)
        return self.num_kv_blocks * self.block_bytes

    def line(self, name: str) -> MemoryLine:
        """The reservation line called ``name`` (KeyError if this plan has none)."""
        for m in self.lines:
            if m.name == name:
                return m
        raise KeyError(name)

    @property
    def kv_tokens(self) -> int:
        """Token slots in the pool: num_kv_blocks x block_size."""
        return self.num_kv_blocks * self.block_size

    def max_concurrent_sequences(self, context_len: int) -> Ceiling:
        """Sequences that can each hold ``context_len`` tokens at once: a CEILING.

        ``min(num_kv_blocks // ceil(context_len / block_size), max_num_seqs)``.
        """
        if context_len < 1:
            raise PlanError(f"context length must be >= 1, got {context_len}")
        per_seq = -(-context_len // self.block_size)
        by_kv = self.num_kv_blocks // per_seq
        if self.kv_groups:  # windowed groups hold only their window: the tightest group
            by_kv = grouped_max_concurrency(self.kv_groups, self.block_size, context_len)
        value, limit = (by_kv, "kv_pool") if by_kv <= self.max_num_seqs else (
            self.max_num_seqs, "max_num_seqs")
        reasons = [
            f"every sequence is assumed to hold all {context_len} tokens at once "
            f"({per_seq} blocks of {self.block_size}); shorter ones leave room for more",
            "no prefix sharing is counted; shared prompt blocks would raise it",
            "the pool is assumed free of fragmentation and of blocks held by preempted requests",
            "admission is also bounded by the step token budget and by latency targets",
        ]
        if limit == "max_num_seqs":
            reasons.insert(0, f"capped by max_num_seqs = {self.max_num_seqs} "
                              f"(the KV pool alone would allow {by_kv})")
        if "sliding" in layer_kinds(self.spec):
            reasons.append("sliding-window layers hold only the blocks their window reads "
                           "(reclaimed as a sequence moves on), in a pool of their own")
        return Ceiling(value, limit, tuple(reasons))


def _fixed_pool(spec: ModelSpec, block_size: int, kv_dtype: str, tp: int,
                kv_cache_memory_bytes: int | None, kv_blocks: int | None) -> tuple[int, str] | None:
    """A KV pool fixed by the caller: ``kv_blocks`` blocks, else ``kv_cache_memory_bytes``."""
    if kv_blocks is not None:
        if kv_blocks < 1:
            raise PlanError(f"num_kv_blocks must be >= 1, got {kv_blocks}")
        return kv_blocks * kv_block_bytes(spec, block_size, kv_dtype, tp=tp), "num_kv_blocks given"
    if kv_cache_memory_bytes is not None:
        if kv_cache_memory_bytes < 0:
            raise PlanError(f"kv_cache_memory must be >= 0 bytes, got {kv_cache_memory_bytes}")
        return kv_cache_memory_bytes, "kv_cache_memory given"
    return None


def engine_memory_plan(spec: ModelSpec, *, weight_bytes: int, total_memory_bytes: int,
                       memory_utilization: float, max_num_batched_tokens: int,
                       max_num_seqs: int, block_size: int, kv_dtype: str, act_dtype_bytes: int,
                       workspace_bytes: int = 0, tp: int = 1,
                       kv_cache_memory_bytes: int | None = None, kv_blocks: int | None = None,
                       in_use_bytes: int = 0, strict: bool = True) -> EngineMemoryPlan:
    """Reserve one GPU's memory in engine order and size the KV pool (see module docstring).

    ``in_use_bytes``: memory already taken on the device by anything but these weights (the
    CUDA context, other processes); the engine measures it, a plan assumes 0. A given
    ``kv_blocks`` or ``kv_cache_memory_bytes`` fixes the pool instead of taking what is left.
    Raises PlanError when not even one KV block fits, naming the line that used the memory up;
    with ``strict=False`` (the planner) it returns the plan anyway, with 0 blocks and the KV
    pool line at what is left (negative when the lines above overflow), for ``plan.fit`` to
    measure by how much it misses.
    """
    if not 0.0 < memory_utilization <= 1.0:
        raise PlanError(f"memory utilization must be in (0, 1], got {memory_utilization}")
    usable = int(total_memory_bytes * memory_utilization)
    block = kv_block_bytes(spec, block_size, kv_dtype, tp=tp)
    lines = [
        MemoryLine("weights", "weight_bytes", weight_bytes, f"per rank, tp={tp}"),
        MemoryLine("activation peak", "act_peak",
                   activation_peak_bytes(spec, max_num_batched_tokens, act_dtype_bytes, tp),
                   f"one forward over max_num_batched_tokens={max_num_batched_tokens}"),
        _logits_line(spec, max_num_seqs),
        MemoryLine("workspace / graphs", "workspace_bytes", workspace_bytes,
                   "kernel workspace and CUDA-graph reserve"),
    ]
    if in_use_bytes > 0:
        lines.append(MemoryLine("in use before start", "total - free - weights (measured)",
                                in_use_bytes, "CUDA context and other processes on the device"))
    lines.append(MemoryLine("headroom", "total - floor(total x utilization)",
                            total_memory_bytes - usable, f"memory_utilization={memory_utilization}"))
    fixed = _fixed_pool(spec, block_size, kv_dtype, tp, kv_cache_memory_bytes, kv_blocks)
    pool = total_memory_bytes - sum(line.bytes for line in lines) if fixed is None else fixed[0]
    blocks = num_kv_blocks(pool, spec, block_size, kv_dtype, tp)
    if blocks < 1 and strict:
        raise PlanError(_no_block_message(tuple(lines), total_memory_bytes, pool, block))
    groups = windowed_pools(spec, max(0, pool), block_size, kv_dtype, max_num_seqs=max_num_seqs,
                            max_num_batched_tokens=max_num_batched_tokens, tp=tp)
    blocks, block, kv_bytes = _group_blocks(groups, blocks, block)
    kv_line = MemoryLine("KV pool", "total - lines above" if fixed is None else fixed[1], pool,
                         f"{blocks} blocks x {fmt_bytes(block)} (block_size={block_size})"
                         + _groups_note(groups))
    peak = sum(line.bytes for line in lines[:-1]) + kv_bytes
    return EngineMemoryPlan(spec, (*lines, kv_line), pool, blocks, block_size, block,
                            kv_bytes_per_token(spec, kv_dtype, tp=tp), max_num_seqs,
                            kv_dtype, tp, "gpu", peak, kv_groups=groups)


def _group_blocks(groups: tuple[KVGroupPlan, ...], blocks: int, block: int) -> tuple[int, int, int]:
    """(num_kv_blocks, block_bytes, KV bytes allocated): a hybrid model's are its full group's
    blocks and every group's bytes."""
    if len(groups) > 1:
        return groups[0].num_blocks, groups[0].block_bytes, sum(g.pool_bytes for g in groups)
    return blocks, block, blocks * block


def _groups_note(groups: tuple[KVGroupPlan, ...]) -> str:
    """The KV pool line's account of the layer groups' pools."""
    if not groups:
        return ""
    parts = [f"{g.kind} x{len(g.layers)} layers" + (f" (window {g.window}, 1 null block)" if g.window else "")
             + f": {g.num_blocks} blocks x {fmt_bytes(g.block_bytes)}" for g in groups]
    return "; " + "; ".join(parts)


def _logits_line(spec: ModelSpec, max_num_seqs: int) -> MemoryLine:
    return MemoryLine("logits", "max_num_seqs x vocab x 4", max_num_seqs * spec.vocab_size
                      * LOGIT_BYTES, f"f32 logits for max_num_seqs={max_num_seqs} sequences")


def engine_load_transient_bytes(spec: ModelSpec, weight_bytes: int, dtype_bytes: int) -> int:
    """Bytes the engine holds beyond its weights while it loads them, one rank, no TP.

    Formula ``load_transient``: the loader's copy of every weight (``weight_bytes`` again, alive
    until the model has copied it) + the fused q/k/v and gate/up tensors built from it:
    layers x (q + 2 kv + 2 intermediate) x hidden x dtype_bytes (+ the q/k/v biases).
    """
    per_layer = (spec.q_size + 2 * spec.kv_size) * (spec.hidden_size + int(spec.attention_bias))
    per_layer += 2 * spec.intermediate_size * spec.hidden_size
    return weight_bytes + spec.num_layers * per_layer * dtype_bytes


def cpu_engine_memory_plan(spec: ModelSpec, *, weight_bytes: int, max_num_batched_tokens: int,
                           max_num_seqs: int, block_size: int, kv_dtype: str,
                           act_dtype_bytes: int, kv_cache_memory_bytes: int | None = None,
                           kv_blocks: int | None = None, runtime_bytes: int = 0,
                           load_transient_bytes: int = 0, weights_note: str = "",
                           runtime_note: str = "", strict: bool = True,
                           max_model_len: int | None = None, threads: int | None = None,
                           fused_decode: bool | None = None,
                           output_staging: bool = False) -> EngineMemoryPlan:
    """The engine's host-memory ledger on a CPU: a fixed KV budget, lines summed to the peak.

    The KV pool is ``kv_blocks`` blocks if given, else ``kv_cache_memory_bytes``, else
    ``DEFAULT_CPU_KV_BYTES``; ``num_kv_blocks = floor(pool / block_bytes)``, and the engine
    allocates exactly ``num_kv_blocks x block_bytes``. Peak (``peak_bytes``, module docstring):
    ``runtime + weights + RoPE + max(load_transient, KV allocated + step peak)``: the loading
    transient is freed before the KV pool is allocated. ``max_model_len`` (None: the model's
    max_position_embeddings, as the engine) sizes the RoPE tables and the attention scratch;
    ``threads`` (None: ``scratch.cpu_threads()``) the SDPA tiles; ``fused_decode`` (None: unless
    FITSERVE_DISABLE_CPP is set) whether decode runs the C++ kernel or gathers K/V;
    ``output_staging`` whether projections held as ggml blocks run the ggml kernels (their
    float32 rows before the cast: ``scratch.projection_staging_bytes``). A budget
    that holds no block raises PlanError, unless ``strict=False`` (the planner: 0 blocks).
    """
    block = kv_block_bytes(spec, block_size, kv_dtype)
    fixed = _fixed_pool(spec, block_size, kv_dtype, 1, kv_cache_memory_bytes, kv_blocks)
    pool, how = fixed if fixed is not None else (DEFAULT_CPU_KV_BYTES, "DEFAULT_CPU_KV_BYTES")
    blocks = num_kv_blocks(pool, spec, block_size, kv_dtype)
    if blocks < 1 and strict:
        raise PlanError(f"a KV budget of {fmt_bytes(pool)} holds no block of {fmt_bytes(block)} "
                        f"(block_size={block_size}): raise --kv-cache-memory")
    groups = windowed_pools(spec, pool, block_size, kv_dtype, max_num_seqs=max_num_seqs,
                            max_num_batched_tokens=max_num_batched_tokens)
    blocks, block, kv_bytes = _group_blocks(groups, blocks, block)
    mml = spec.max_position_embeddings if max_model_len is None else max_model_len
    budget = max_num_batched_tokens
    fused = not cpp_kernels_disabled() if fused_decode is None else fused_decode
    scratch = cpu_attention_scratch(
        spec, max_num_batched_tokens=budget, max_model_len=mml, max_num_seqs=max_num_seqs,
        block_size=block_size, act_bytes=act_dtype_bytes,
        kv_bytes=kv_format(kv_dtype).element_bytes,
        threads=cpu_threads() if threads is None else threads,
        fused_decode=fused,
        paged_prefill=fused and not kv_format(kv_dtype).codec)
    logits = _logits_line(spec, max_num_seqs)
    sampler = sampler_bytes(spec, max_num_seqs)
    dequant = kv_dequant_scratch_bytes(spec, kv_dtype, blocks, block_size, max_num_seqs, mml,
                                       act_dtype_bytes)
    step, phase = cpu_step_bytes(spec, budget, act_dtype_bytes, scratch, logits.bytes + sampler,
                                 dequant, output_staging)
    retained = heap_retention_bytes(cpu_step_phases(spec, budget, act_dtype_bytes, scratch,
                                                    logits.bytes + sampler, dequant,
                                                    output_staging))
    staging = max(projection_staging_bytes(spec, budget, act_dtype_bytes)) if output_staging else 0
    step += retained
    running = kv_bytes + step
    rope = rope_table_bytes(spec, mml)
    lines = (
        MemoryLine("runtime baseline", "measured VmRSS", runtime_bytes,
                   runtime_note or "python + torch + engine modules (runtime_baseline_bytes)"),
        MemoryLine("weights", "weight_bytes", weight_bytes, weights_note),
        MemoryLine("rope tables", "2 x max_model_len x head_dim/2 x 4", rope,
                   f"fp32 cos/sin for max_model_len={mml} positions, built with the model"),
        MemoryLine("loading transient", "load_transient", load_transient_bytes,
                   "loader copy + fused qkv/gate_up copies, freed before the KV pool"
                   + (" (sets the peak)" if load_transient_bytes > running else "")),
        MemoryLine("activation peak", "act_peak", max(activation_phase_bytes(
                   spec, budget, act_dtype_bytes)),
                   f"one forward over max_num_batched_tokens={budget}"),
        *([MemoryLine("output staging", "min(tokens, 4Mi / N) x N x 4", staging,
                      "float32 rows of the ggml block kernels before the cast to the model "
                      "dtype, of the widest projection (N) of a phase, at most 4Mi floats a "
                      "call (GgmlLinear)")] if staging else []),
        MemoryLine("attention scratch", "masks + max(prefill chunk, decode)", scratch.total_bytes,
                   _scratch_note(scratch, block_size)),
        logits,
        MemoryLine("sampler", "4 x (seqs V + 2 c V + max(6 g V, 4 c 256))", sampler,
                   f"the sampler's fp32 copy of the logits + its chunk of c = "
                   f"{min(max_num_seqs, sampler_chunk_rows(spec.vocab_size))} rows at the worst "
                   "(top-p over a top-k distribution, g = c // 6 nuclei sorted in full); greedy rows "
                   "take the copy only, plain greedy nothing"),
        MemoryLine("allocator retention", "sum of the step's phases - their max", retained,
                   "glibc keeps the heap pages a step's freed buffers used until the engine "
                   "trims after the step; the attention, MLP and sampling phases land at their "
                   "own addresses, so a step holds their sum (heap_retention_bytes)"),
        *([MemoryLine("KV dequant scratch", "kv_dequant_scratch_bytes", dequant,
                      "a quantized cache: one layer's K and V of the blocks a step reads "
                      "(at most min(num_kv_blocks, max_num_seqs x ceil(max_model_len / "
                      "block_size))), dense in the model dtype plus their f32 decode")]
          if dequant else []),
        MemoryLine("KV pool", "num_kv_blocks x block_bytes", kv_bytes,
                   f"{how} = {pool:,} B -> {blocks} blocks x {block:,} B "
                   f"(block_size={block_size}); resident as blocks are first written, "
                   f"all of it once the run has held or cached that many at once"
                   + _groups_note(groups)),
    )
    resident = runtime_bytes + weight_bytes + rope
    peak = resident + max(load_transient_bytes, running)
    return EngineMemoryPlan(spec, lines, pool, blocks, block_size, block,
                            kv_bytes_per_token(spec, kv_dtype), max_num_seqs, kv_dtype, 1,
                            "cpu", peak, resident, load_transient_bytes, step, phase, groups)


def kv_dequant_scratch_bytes(spec: ModelSpec, kv_dtype: str, num_blocks: int, block_size: int,
                             max_num_seqs: int, max_model_len: int, act_dtype_bytes: int) -> int:
    """Transient bytes of reading a quantized KV cache (``fitserve.quant.kv_cache``): each layer
    dequantizes the blocks its step reads into dense K and V in the model dtype, through a
    float32 decode of each (0 for a dense cache).

    Blocks read <= min(num_blocks, max_num_seqs x ceil(max_model_len / block_size)); per K/V
    element pair: 2 x act_dtype_bytes (the dense K and V) + 2 x 4 (the f32 decode of one, alive
    while it is cast, and the other's scales-times-codes product).
    """
    if not kv_format(kv_dtype).codec:
        return 0
    read = min(num_blocks, max_num_seqs * -(-max_model_len // block_size))
    elements = read * block_size * spec.num_kv_heads * spec.head_dim
    return elements * (2 * act_dtype_bytes + 8)


def cpu_step_phases(spec: ModelSpec, num_tokens: int, act_dtype_bytes: int,
                    scratch: AttentionScratch, logits_bytes: int,
                    kv_dequant_bytes: int = 0, output_staging: bool = False) -> dict[str, int]:
    """The transient bytes of each phase of a step (``cpu_step_bytes``), masks apart.

    attention: the attention-phase activations + the attention call's scratch (one layer) +
    a quantized cache's dequantized K/V (``kv_dequant_bytes``, one layer's, freed with its
    attention); mlp: the MLP-phase activations; sampling: the final hidden states [N, H] + the
    logits and the sampler's copies (``logits_bytes``). ``output_staging``: + each phase's
    widest projection's float32 kernel output (``scratch.projection_staging_bytes``: weights
    held as ggml blocks; other formats write the model dtype directly).
    """
    attn, mlp = activation_phase_bytes(spec, num_tokens, act_dtype_bytes)
    if output_staging:
        staged = projection_staging_bytes(spec, num_tokens, act_dtype_bytes)
        attn, mlp = attn + staged[0], mlp + staged[1]
    return {"attention": attn + scratch.kernel_bytes + kv_dequant_bytes, "mlp": mlp,
            "sampling": num_tokens * spec.hidden_size * act_dtype_bytes + logits_bytes}


def cpu_step_bytes(spec: ModelSpec, num_tokens: int, act_dtype_bytes: int,
                   scratch: AttentionScratch, logits_bytes: int,
                   kv_dequant_bytes: int = 0, output_staging: bool = False) -> tuple[int, str]:
    """(live step peak, the phase that sets it): the masks + the largest of the three phases
    of ``cpu_step_phases``. Each layer frees its attention scratch before its MLP runs, and the
    last layer's activations before the logits are made."""
    phases = cpu_step_phases(spec, num_tokens, act_dtype_bytes, scratch, logits_bytes,
                             kv_dequant_bytes, output_staging)
    name = max(phases, key=lambda k: phases[k])
    return scratch.step_tensor_bytes + phases[name], name


def heap_retention_bytes(phases: dict[str, int]) -> int:
    """Bytes glibc's heap keeps resident within a step beyond its live peak: the phases other
    than the largest (``cpu_step_phases``), as the step holds their sum, not their max.

    NOTE: glibc returns a freed heap chunk's pages only when the engine trims after a prefill
    step (``release_freed_host_memory``), and each phase's buffers land at their own heap
    addresses: measured (glibc 2.36, torch 2.13, the default model, layer 1 of a 1,952-token
    chunk after 2,048 cached tokens) its torch allocations were 37.6 MiB in all, 19.3 MiB live
    at once, at distinct addresses covering 33.3 MiB; the process's RSS rose by 63-69 MiB over
    the step's first layer, the sum of the phases, where their max is 25 MiB.
    """
    return sum(phases.values()) - max(phases.values(), default=0)


def _scratch_note(s: AttentionScratch, block_size: int) -> str:
    decode = ("fused C++ decode (cpu_paged_decode): output + fp32 partials" if s.fused_decode else
              "gather decode (no C++ kernel): K/V copies + fp32 scores")
    return (f"masks + block tables {s.step_tensor_bytes:,} B (the whole step) + max(prefill "
            f"chunk of "
            f"{s.prefill_queries} queries x {s.keys} keys: "
            f"{'fused C++ tiles: q, output, table + per-thread partials' if s.paged_prefill else 'K/V copies + SDPA'} "
            f"{s.prefill_bytes:,} B, {decode} of {s.decode_batch} sequences "
            f"{s.decode_bytes:,} B); {s.threads} threads, per layer, freed before the MLP")


def _no_block_message(lines: tuple[MemoryLine, ...], total: int, pool: int, block: int) -> str:
    """Name the first line after which less than one block is left of total x utilization."""
    usable = total - lines[-1].bytes  # the last line is the utilization headroom
    running, culprit = 0, max(lines[:-1], key=lambda line: line.bytes)
    for line in lines[:-1]:
        running += line.bytes
        if running + block > usable:
            culprit = line
            break
    table = "; ".join(f"{line.name} {fmt_bytes(line.bytes)}" for line in lines)
    return (f"no room for even one KV block ({fmt_bytes(block)}): {culprit.name} "
            f"({fmt_bytes(culprit.bytes)}) uses up the {fmt_bytes(usable)} usable "
            f"(total {fmt_bytes(total)} x utilization; left for KV: {fmt_bytes(pool)}). "
            f"Lines: {table}")
