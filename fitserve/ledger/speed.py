"""Roofline times: a decode step at batch B, a prefill (TTFT floor), and where they turn.

    t_memory  = (weight bytes read + KV bytes read) / memory bandwidth
    t_compute = FLOPs / peak FLOP/s
    t_dequant = a CPU's weight-kernel time (fitserve.ledger.dequant; decode steps only)
    t_overhead = a CPU's fixed cost per step + per layer x layers (Hardware.step_overhead;
                 measured on a tiny model, 0 on a GPU's roofline)
    t_attention = a CPU's decode attention FLOPs / its measured rate (Hardware.attention_flops,
                 KV reads included; then t_memory is the weights alone) + its KV heads' rows
                 and its fixed cost per (sequence, KV head, layer) (decode_attention_seconds),
                 0 on a GPU's roofline
    t_tokens  = a CPU's element-wise work, new tokens x layers x elementwise_elements x its
                 measured cost per element (norms, rotary, KV writes, SwiGLU), + per sampled
                 sequence its measured cost + vocab x the argmax per logit; 0 on a GPU
    step      = max(t_memory, t_compute, t_dequant) + t_attention + t_allreduce + t_overhead
                + t_tokens

On a measured CPU the peak FLOP/s is the rate the engine's own op for the weight format reaches
at the step's row count and the model's hidden size as K (Hardware.peak_flops), not a
spec-sheet peak, and a decode step's
attention FLOPs run at its paged decode attention's measured rate (Hardware.attention_flops). Collectives and the
overhead are not overlapped: the CPU runs the Python and the kernels one after another.

Per rank under tensor parallelism. MoE: a step reads the experts its batch touches, expected
E x (1 - (1 - k/E)^B) of E per layer. Attention reads only the window on sliding layers.
These are floors: real kernels reach some fraction of both peaks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fitserve.config import ModelSpec
from fitserve.ledger.dequant import dequant_seconds
from fitserve.ledger.errors import PlanError
from fitserve.ledger.flops import attention_flops_per_position, flops_per_token, prefill_flops
from fitserve.ledger.hardware import Hardware
from fitserve.ledger.kv import request_kv
from fitserve.ledger.moe import expected_experts_touched, moe_step_weight_read
from fitserve.ledger.parallel import tp_allreduce
from fitserve.ledger.weights import WeightBytes, roofline_weight_bytes
from fitserve.ledger.workload_schedule import ScheduledStep, workload_schedule

MAX_BATCH = 1 << 16


@dataclass(frozen=True)
class StepTime:
    """One forward step on one rank: bytes, FLOPs and the roofline time."""

    batch: int
    context: int
    weight_bytes: float
    kv_bytes: float
    flops: float
    t_memory: float
    t_compute: float
    t_comm: float
    # a CPU's weight kernels (decode + dots, fitserve.ledger.dequant): they overlap the weight
    # stream, so the step takes the larger of the three floors
    t_dequant: float = 0.0
    t_overhead: float = 0.0  # a CPU's fixed cost of the step (Hardware.step_overhead)
    # a CPU's decode attention at its measured rate (its KV reads included): a phase of its own
    t_attention: float = 0.0
    # a CPU's element-wise work per token and its cost per sampled sequence (token_seconds)
    t_tokens: float = 0.0

    @property
    def seconds(self) -> float:
        return (max(self.t_memory, self.t_compute, self.t_dequant) + self.t_attention
                + self.t_comm + self.t_overhead + self.t_tokens)

    @property
    def bound(self) -> str:
        if self.t_overhead > max(self.t_memory, self.t_compute, self.t_dequant):
            return "overhead"
        if self.t_dequant > max(self.t_memory, self.t_compute):
            return "dequant"
        return "compute" if self.t_compute >= self.t_memory else "memory"

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput of the whole TP group: batch tokens per step."""
        return self.batch / self.seconds

    def describe(self) -> str:
        """One line: the roofline with its numbers filled in."""
        dq = f", weight kernels {self.t_dequant * 1e3:.3f} ms" if self.t_dequant else ""
        oh = (f" + attention {self.t_attention * 1e3:.3f} ms" if self.t_attention else "") + (
            f" + overhead {self.t_overhead * 1e3:.3f} ms" if self.t_overhead else "")
        return (f"max(({self.weight_bytes:,.0f} + {self.kv_bytes:,.0f}) B / bandwidth = "
                f"{self.t_memory * 1e3:.3f} ms, {self.flops:.4g} FLOPs / peak = "
                f"{self.t_compute * 1e3:.3f} ms{dq}) + comm {self.t_comm * 1e3:.3f} ms{oh} = "
                f"{self.seconds * 1e3:.3f} ms ({self.bound}-bound)")


def experts_touched_fraction(spec: ModelSpec, batch: int) -> float:
    """Expected share of routed experts a batch of ``batch`` tokens uses in one layer."""
    if not spec.num_experts:
        return 1.0
    e = spec.num_experts
    return expected_experts_touched(e, spec.num_experts_per_token, batch) / e


def elementwise_elements(spec: ModelSpec, tp: int = 1) -> int:
    """Elements one token's element-wise work touches in one layer on one of ``tp`` ranks:
    2 norms over hidden, rotary on q and k with the k/v cache writes, SwiGLU's gate | up read
    and its output written (an MoE layer: over its k experts' and the shared expert's widths).
    The same count as fitserve.engine.cpu_rates.elementwise_elements, whose probe it scales."""
    inter = (spec.expert_intermediate_size * spec.num_experts_per_token
             + spec.shared_expert_intermediate_size if spec.num_experts else
             spec.intermediate_size)
    return 2 * spec.hidden_size + (spec.q_size + 2 * spec.kv_size + 3 * inter) // tp


def token_seconds(spec: ModelSpec, hw: Hardware, *, new_tokens: int, sampled: int,
                  tp: int = 1) -> float:
    """A CPU's element-wise seconds of a step (``t_tokens``): new_tokens x layers x
    elementwise_elements x Hardware.elementwise_s + sampled x (seq_overhead_s + vocab x
    logit_s); 0 where they were not measured (a GPU's roofline).

    NOTE: one thread's measured costs, not divided over the cores as the matmul rates are:
    these ops are short and the engine runs most of them (and all the Python) on one."""
    ew = new_tokens * spec.num_layers * elementwise_elements(spec, tp) * hw.elementwise_s
    return ew + sampled * (hw.seq_overhead_s + spec.vocab_size * hw.logit_s)


def attention_fixed_seconds(spec: ModelSpec, hw: Hardware, seqs: int, tp: int = 1) -> float:
    """A CPU's decode attention cost besides its FLOPs: ``seqs`` x layers x KV heads per rank
    x Hardware.attention_seq_s (each (sequence, KV head) is a work item of the paged kernel:
    its setup, block table walk and merge; 0 where not measured)."""
    return seqs * spec.num_layers * max(1, spec.num_kv_heads // tp) * hw.attention_seq_s


def decode_attention_seconds(spec: ModelSpec, hw: Hardware, attn: float, seqs: int,
                             tp: int = 1) -> float:
    """A CPU's decode attention of ``seqs`` sequences whose attention FLOPs on one of ``tp``
    ranks are ``attn``: the query heads' FLOPs at Hardware.attention_flops + the KV heads' rows
    (layer-keys x KV heads per rank x head_dim) x Hardware.attention_kv_s + the fixed cost
    per (sequence, KV head, layer) (``attention_fixed_seconds``); 0 without FLOPs or rate."""
    if not attn or not hw.attention_flops:
        return 0.0
    flops, kv_s = hw.attention_flops, hw.attention_kv_s
    if runs_attention_tile(spec, hw):  # the AMX tile's own rates (cost nearly flat in G)
        flops, kv_s = hw.attention_tile_flops, hw.attention_tile_kv_s
    layer_keys = attn * tp / attention_flops_per_position(spec)
    kv = layer_keys * max(1, spec.num_kv_heads // tp) * spec.head_dim * kv_s
    return attn / flops + kv + attention_fixed_seconds(spec, hw, seqs, tp)


def runs_attention_tile(spec: ModelSpec, hw: Hardware) -> bool:
    """Whether this CPU's engine runs ``spec``'s decode attention on the AMX-BF16 tile: it has
    the tile's measured rates and the model at least attention_tile_min_group query heads per
    KV head (``FITSERVE_AMX_ATTENTION=auto``'s rule, measured as the engine runs it)."""
    group = spec.num_heads // max(1, spec.num_kv_heads)
    return bool(hw.attention_tile_min_group and hw.attention_tile_flops
                and group >= hw.attention_tile_min_group)


def prefill_attention_seconds(hw: Hardware, attn: float) -> float:
    """A CPU's prompt-chunk attention of ``attn`` FLOPs: at the decode attention's query-head
    rate (Hardware.attention_flops; 0 where not measured: then those FLOPs run at the matmul
    rate, as on a GPU's roofline).

    NOTE: the flash-style prefill op runs the decode kernel's own tile function for every row
    (bitwise the decode row), so a query head's keys cost what a decode's do; each K / V tile
    is loaded once for 32 rows, so the KV heads' rows (attention_kv_s) and the per-item cost
    are left out. Measured on SmolLM2 (16 prompts of 128, one thread): the op took ~70 ms of
    a 1.3 s step, 9.1 GFLOP at ~150 GFLOP/s, where the int8 matmul rate had said 22 ms."""
    return attn / hw.attention_flops if attn and hw.attention_flops else 0.0


def weight_bytes_read(spec: ModelSpec, wb: WeightBytes, batch: int) -> float:
    """Weight bytes a step of ``batch`` tokens reads on one rank (``moe_step_weight_read``)."""
    return moe_step_weight_read(spec, wb, batch)


def weight_kernel_seconds(spec: ModelSpec, hw: Hardware, wb: WeightBytes, w: float, *,
                          rows: int) -> float:
    """A CPU's floor for the step's weight kernels (``StepTime.t_dequant``) reading ``w`` of
    wb's bytes for ``rows`` rows of x: the per-weight kernel cost (fitserve.ledger.dequant), and
    where this CPU's one-row linears were measured, each weight line's bytes at its kernel's
    stream rate (Hardware.weight_stream_rate at K = hidden size), the larger.

    NOTE: the one-row rate is a floor at every batch (a step reads its weights at least once,
    no faster than a one-row GEMV streams them); it is what bounds W1 where a kernel's own work
    per byte, or its overlap with the memory, keeps it below the copy bandwidth (measured on
    the Zen 5 this was written on: SmolLM2-135M's int4 rows at ~30-36 GB/s against an 80 GB/s
    copy). Lines whose kernel was not timed add nothing to it."""
    read_fraction = w / wb.total if wb.total else 1.0
    dq = dequant_seconds(wb, rows=rows, cores=hw.cores, read_fraction=read_fraction)
    floor = 0.0
    for line in wb.lines:
        rate = hw.weight_stream_rate(line.fmt, spec.hidden_size)
        floor += line.bytes / rate if rate else 0.0
    return max(dq, floor * read_fraction)


def decode_step(spec: ModelSpec, hw: Hardware, wb: WeightBytes, *, batch: int, context: int,
                kv_dtype: str, weights_fmt: str, act_dtype_bytes: int = 2) -> StepTime:
    """A decode step of ``batch`` sequences each at ``context`` tokens, on one of wb.tp ranks."""
    tp = wb.tp
    w = weight_bytes_read(spec, wb, batch)
    kv = batch * request_kv(spec, context, kv_dtype, tp=tp).bytes_reclaimed
    tf = flops_per_token(spec, context)
    flops = batch * tf.total / tp
    # NOTE: where the CPU's decode attention was measured (its rate includes its KV reads,
    # caches past the LLC), attention is its own phase after the linears: its FLOPs at that
    # rate are added, and the memory floor is the weights alone
    attn = batch * tf.attention / tp if hw.attention_flops else 0.0
    t_attention = decode_attention_seconds(spec, hw, attn, batch, tp)
    t_memory = (w + (0.0 if attn else kv)) / hw.mem_bytes_per_s
    t_compute = (flops - attn) / hw.peak_flops(weights_fmt, batch, spec.hidden_size)
    comm = tp_allreduce(spec, hw, tp=tp, tokens=batch, act_dtype_bytes=act_dtype_bytes)
    dq = weight_kernel_seconds(spec, hw, wb, w, rows=batch)
    return StepTime(batch, context, w, kv, flops, t_memory, t_compute, comm.seconds_per_step,
                    dq, hw.step_overhead(spec.num_layers), t_attention,
                    token_seconds(spec, hw, new_tokens=batch, sampled=batch, tp=tp))


def decode_step_roofline(spec: ModelSpec, hw: Hardware, *, batch: int, context: int,
                         weight_fmt: str, kv_dtype: str, tp: int = 1,
                         act_dtype_bytes: int = 2) -> StepTime:
    """The roofline floor of one decode step: ``batch`` sequences, each ``context`` tokens in.

        t_memory  = (weight bytes read + batch x KV bytes of ``context`` tokens) / hw bandwidth
        t_compute = batch x flops_per_token(context) / hw.peak_flops(weight_fmt)
        seconds   = max(t_memory, t_compute) + TP all-reduce time

    ``weight_fmt``: a plain dtype ("bf16", "f32") means every tensor in it, as fitserve's engine
    holds them; a quantized format ("int4-g128", "Q4_K_M", ...) keeps embedding, lm_head and
    vectors in bf16. The W1 benchmark calls it with ``hw = cpu_hardware()``; read ``.seconds``,
    ``.t_memory``, ``.t_compute``, ``.weight_bytes``, ``.kv_bytes``, ``.flops``, ``.bound``.
    """
    wb = roofline_weight_bytes(spec, weight_fmt, tp=tp)
    return decode_step(spec, hw, wb, batch=batch, context=context, kv_dtype=kv_dtype,
                       weights_fmt=weight_fmt, act_dtype_bytes=act_dtype_bytes)


def prefill_time(spec: ModelSpec, hw: Hardware, wb: WeightBytes, *, prompt_len: int,
                 kv_dtype: str, weights_fmt: str, act_dtype_bytes: int = 2) -> StepTime:
    """The TTFT floor: one prefill of ``prompt_len`` tokens (weights read once, KV written)."""
    tp = wb.tp
    kv = request_kv(spec, prompt_len, kv_dtype, tp=tp).bytes_reclaimed
    w = weight_bytes_read(spec, wb, prompt_len)
    pf = prefill_flops(spec, prompt_len)
    flops = pf.total / tp
    attn = pf.attention / tp if hw.attention_flops else 0.0  # at its own rate where measured
    comm = tp_allreduce(spec, hw, tp=tp, tokens=prompt_len, act_dtype_bytes=act_dtype_bytes)
    return StepTime(1, prompt_len, w, kv, flops, (w + kv) / hw.mem_bytes_per_s,
                    (flops - attn) / hw.peak_flops(weights_fmt, prompt_len, spec.hidden_size),
                    comm.seconds_per_step,
                    t_overhead=hw.step_overhead(spec.num_layers),
                    t_attention=prefill_attention_seconds(hw, attn),
                    t_tokens=token_seconds(spec, hw, new_tokens=prompt_len, sampled=1, tp=tp))


def compute_bound_batch(spec: ModelSpec, hw: Hardware, wb: WeightBytes, *, context: int,
                        kv_dtype: str, weights_fmt: str) -> int | None:
    """Smallest batch whose decode step is compute-bound (None: KV reads keep it memory-bound)."""
    def bound(b: int) -> bool:
        s = decode_step(spec, hw, wb, batch=b, context=context, kv_dtype=kv_dtype,
                        weights_fmt=weights_fmt)
        return s.t_compute >= s.t_memory

    return smallest_batch(bound, MAX_BATCH)


def smallest_batch(holds: Callable[[int], bool], max_batch: int) -> int | None:
    """The smallest batch in [1, max_batch] where ``holds`` (monotone: once true, true for
    larger batches) is true, None if it never is: doubling from 1, then bisecting."""
    lo, hi = 0, 1  # invariant once found: not holds(lo) (or lo == 0), holds(hi)
    while not holds(hi):
        if hi >= max_batch:
            return None
        lo, hi = hi, min(2 * hi, max_batch)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if holds(mid) else (mid, hi)
    return hi


@dataclass(frozen=True)
class Crossover:
    """Weight-only quantized vs reference weights: speedup per batch and where it stops."""

    quant_fmt: str
    ref_fmt: str
    speedups: tuple[tuple[int, float], ...]  # (batch, t_ref / t_quant)
    stops_paying_at: int | None  # smallest batch with speedup < 1 + threshold


def quant_crossover(spec: ModelSpec, hw: Hardware, quant: WeightBytes, ref: WeightBytes, *,
                    context: int, kv_dtype: str, threshold: float = 0.05) -> Crossover:
    """Where weight-only int4 (W4A16) stops beating bf16: both run at the bf16 peak, so once
    both steps are compute-bound the bandwidth saving buys nothing."""
    speedups: list[tuple[int, float]] = []
    stop: int | None = None
    b = 1
    while b <= MAX_BATCH:
        t_ref = decode_step(spec, hw, ref, batch=b, context=context, kv_dtype=kv_dtype,
                            weights_fmt="bf16").seconds
        t_quant = decode_step(spec, hw, quant, batch=b, context=context, kv_dtype=kv_dtype,
                              weights_fmt="bf16").seconds
        s = t_ref / t_quant
        speedups.append((b, s))
        if stop is None and s < 1 + threshold:
            stop = b
            break
        b *= 2
    return Crossover(quant.mix, ref.mix, tuple(speedups), stop)


@dataclass(frozen=True)
class WorkloadSpeed:
    """``batch_size`` requests of ``input_len`` prompt tokens, each generating ``output_len``
    (vllm bench throughput's --input-len / --output-len / --num-prompts, all at once): the
    prompts prefilled first in steps of the token budget, the last of which samples every
    request's first token, then ``output_len - 1`` decode steps of the whole batch."""

    input_len: int
    output_len: int
    batch_size: int
    prefill_steps: tuple[StepTime, ...]
    decode_steps: tuple[StepTime, ...]

    @property
    def prefill_s(self) -> float:
        return sum(s.seconds for s in self.prefill_steps)

    @property
    def decode_s(self) -> float:
        return sum(s.seconds for s in self.decode_steps)

    @property
    def decode_tokens_per_s(self) -> float:
        """Decode tokens per second per request, first token excluded (W1's tok/s at batch 1)."""
        return (self.output_len - 1) / self.decode_s if self.decode_steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens of the whole batch over the whole run, prefill included (W2's)."""
        return self.batch_size * self.output_len / (self.prefill_s + self.decode_s)


def scheduled_step(spec: ModelSpec, hw: Hardware, wb: WeightBytes, step: ScheduledStep, *,
                   kv_dtype: str, weights_fmt: str, act_dtype_bytes: int = 2) -> StepTime:
    """One step of ``workload_schedule`` on one of wb.tp ranks: the weights read once for its
    new tokens (the matmuls at that many rows), each decode's attention over its context (at
    the CPU's decode-attention rate where measured, as ``decode_step``), each prompt chunk's
    FLOPs (prefill_flops of its end less its start) and KV written, the element-wise work of
    every new token and the cost of every sampled sequence (``token_seconds``)."""
    tp, n = wb.tp, step.new_tokens
    w = weight_bytes_read(spec, wb, n)
    flops = attn = kv = 0.0
    for c in step.decode_contexts:
        tf = flops_per_token(spec, c)
        flops += tf.total / tp
        attn += tf.attention / tp if hw.attention_flops else 0.0
        kv += 0.0 if hw.attention_flops else request_kv(spec, c, kv_dtype, tp=tp).bytes_reclaimed
    chunk_attn = 0.0
    for start, count in step.chunks:
        before = prefill_flops(spec, start, logit_positions=0) if start else None
        after = prefill_flops(spec, start + count, logit_positions=0)
        flops += (after.total - (before.total if before else 0)) / tp
        if hw.attention_flops:
            chunk_attn += (after.attention - (before.attention if before else 0)) / tp
        kv += request_kv(spec, count, kv_dtype, tp=tp).bytes_reclaimed
    # the lm_head of each prompt that ends this step (its first token sampled)
    ended = step.sampled - len(step.decode_contexts)
    flops += ended * 2 * spec.vocab_size * spec.hidden_size / tp
    comm = tp_allreduce(spec, hw, tp=tp, tokens=n, act_dtype_bytes=act_dtype_bytes)
    dq = weight_kernel_seconds(spec, hw, wb, w, rows=n)
    return StepTime(step.seqs, max((*step.decode_contexts, *(s + c for s, c in step.chunks))),
                    w, kv, flops, (w + kv) / hw.mem_bytes_per_s,
                    (flops - attn - chunk_attn) / hw.peak_flops(weights_fmt, n, spec.hidden_size),
                    comm.seconds_per_step, dq, hw.step_overhead(spec.num_layers),
                    decode_attention_seconds(spec, hw, attn, len(step.decode_contexts), tp)
                    + prefill_attention_seconds(hw, chunk_attn),
                    token_seconds(spec, hw, new_tokens=n, sampled=step.sampled, tp=tp))


def workload_speed(spec: ModelSpec, hw: Hardware, wb: WeightBytes, *, input_len: int,
                   output_len: int, batch_size: int, kv_dtype: str, weights_fmt: str,
                   max_num_batched_tokens: int = 2048, act_dtype_bytes: int = 2,
                   max_num_seqs: int = 64) -> WorkloadSpeed:
    """The step-time model run over a whole workload (see WorkloadSpeed) as the scheduler
    runs it (``workload_schedule``: decodes first, then prompt chunks within the token
    budget, so W2's later prompts share steps with the first ones' decodes): a step with a
    prompt chunk counts as a prefill step, the rest as decode steps (``scheduled_step``).
    PlanError for counts < 1."""
    for flag, n in (("--input-len", input_len), ("--output-len", output_len),
                    ("--batch-size", batch_size),
                    ("--max-num-batched-tokens", max_num_batched_tokens)):
        if n < 1:
            raise PlanError(f"{flag} must be >= 1, got {n}")
    plan = workload_schedule(batch=batch_size, input_len=input_len, output_len=output_len,
                             max_num_batched_tokens=max_num_batched_tokens,
                             max_num_seqs=max_num_seqs)
    steps = [(st.chunks, scheduled_step(spec, hw, wb, st, kv_dtype=kv_dtype,
                                        weights_fmt=weights_fmt,
                                        act_dtype_bytes=act_dtype_bytes)) for st in plan]
    return WorkloadSpeed(input_len, output_len, batch_size,
                         tuple(t for chunks, t in steps if chunks),
                         tuple(t for chunks, t in steps if not chunks))
