"""The workload section of a plan: single-stream and batched throughput of one workload shape,
``fitserve plan ... --input-len P --output-len O --batch-size B`` (vllm bench throughput's
names), from the step-time model run step by step (fitserve.ledger.speed.workload_speed).

The defaults are ``benchmarks/bench_engine.py``'s W2 (32 requests x 128 prompt x 128 new
tokens), so the plan's two lines sit beside that script's W1 / W2 columns; bench_engine prints
the same prediction at its own shapes (W1: a 32-token prompt) beside what it measures.
"""

from __future__ import annotations

from fitserve.ledger.memory import EngineMemoryPlan
from fitserve.ledger.speed import StepTime, WorkloadSpeed, workload_speed
from fitserve.ledger.units import fmt_bytes, fmt_seconds
from fitserve.tools.planner.report import Line, Resolved, Section, speed_weights


def step_terms(st: StepTime, bandwidth: float, flops_rate: float) -> str:
    """One step's terms with the rates it divides by, and what they add up to."""
    return (f"max(({st.weight_bytes:,.0f} + {st.kv_bytes:,.0f}) B / {bandwidth:.3g} B/s = "
            f"{fmt_seconds(st.t_memory)}, {st.flops:.4g} FLOPs / {flops_rate:.3g} FLOP/s = "
            f"{fmt_seconds(st.t_compute)}, weight kernels {fmt_seconds(st.t_dequant)}) + "
            f"overhead {fmt_seconds(st.t_overhead)} = {fmt_seconds(st.seconds)} "
            f"({st.bound}-bound)")


def run_workload(r: Resolved, batch: int) -> WorkloadSpeed:
    """The plan's workload (--input-len / --output-len) at ``batch`` requests."""
    q, s = r.req, r.entry.spec
    wb = speed_weights(r)
    return workload_speed(s, r.hw, wb, input_len=q.input_len, output_len=q.output_len,
                          batch_size=batch, kv_dtype=r.kv_dtype, weights_fmt=r.weights,
                          max_num_batched_tokens=q.max_num_batched_tokens,
                          act_dtype_bytes=r.act_bytes)


def batch_room(r: Resolved, mp: EngineMemoryPlan) -> tuple[Line | None, str | None]:
    """Whether the engine holds --batch-size sequences of input + output tokens at once (the
    step-time model assumes it does): if not, a line of what the batch needs beside what the
    pool holds, and a note of what the engine does instead (preempts and recomputes, or keeps
    the rest waiting) and what would hold it."""
    q = r.req
    total = q.input_len + q.output_len
    ceil = mp.max_concurrent_sequences(total)
    if q.batch_size <= ceil.value:
        return None, None
    per_seq = -(-total // mp.block_size)
    need = q.batch_size * per_seq
    if ceil.limited_by == "max_num_seqs":
        line = Line(f"sequences at once ({q.batch_size} asked)", "max_num_seqs", mp.max_num_seqs,
                    f"{mp.max_num_seqs} < {q.batch_size}", "max_num_seqs caps the running batch")
        note = (f"--batch-size {q.batch_size} > max_num_seqs {mp.max_num_seqs}: the engine runs "
                f"{mp.max_num_seqs} at once and the rest wait, which the batch line above does "
                f"not model (it runs all {q.batch_size} together)")
        return line, note
    if mp.kv_groups:  # sliding-window groups: their pools and windows, not whole blocks
        line = Line(f"sequences the KV holds at {total:,} tokens", "max_concurrent_sequences",
                    ceil.value, f"{ceil.value} < {q.batch_size}", "; ".join(ceil.reasons))
        return line, (f"the KV pools hold {ceil.value} of the {q.batch_size} sequences at their "
                      f"full {total:,} tokens: the engine preempts (recompute) as they fill, "
                      f"which the batch line above does not count, so it is too high")
    line = Line(f"KV at the batch's end ({q.batch_size} x {total:,} tokens)",
                "batch x ceil((input + output) / block_size) blocks", need,
                f"{need:,} blocks > {mp.num_kv_blocks:,} in the pool",
                f"{q.batch_size} x {per_seq} blocks of {mp.block_size}; the pool holds "
                f"{ceil.value} such sequences at once")
    note = (f"the KV pool holds {ceil.value} of the {q.batch_size} sequences at their full "
            f"{total:,} tokens: the engine preempts (recompute, as vLLM does) as the pool "
            f"fills and prefills those requests again, which the batch line above does not "
            f"count, so it is too high; --num-kv-blocks {need} (--kv-cache-memory "
            f"{-(-need * mp.block_bytes // 2**20)}M = {fmt_bytes(need * mp.block_bytes)}) "
            f"holds the whole batch")
    return line, note


def workload_section(r: Resolved, mp: EngineMemoryPlan) -> Section:
    """W1 (one request) and W2 (--batch-size requests at once) of the plan's workload, and
    whether the engine (memory plan ``mp``) holds that batch at once (batch_room)."""
    q, hw = r.req, r.hw
    one, many = run_workload(r, 1), run_workload(r, q.batch_size)
    shape = f"{q.input_len:,} in, {q.output_len:,} out"

    def first_last(w: WorkloadSpeed) -> str:
        if not w.decode_steps:
            return "no decode steps (--output-len 1)"
        a, b = w.decode_steps[0], w.decode_steps[-1]
        return (f"decode step 1: {step_terms(a, hw.mem_bytes_per_s, hw.peak_flops(r.weights, a.batch))}"
                f"; last: {fmt_seconds(b.seconds)}")

    pf = many.prefill_steps
    lines = [
        Line(f"single stream ({shape})", "workload_speed(batch 1).decode_tokens_per_s",
             one.decode_tokens_per_s,
             f"{one.decode_tokens_per_s:,.1f} tok/s decode, TTFT {fmt_seconds(one.prefill_s)}",
             f"{q.output_len - 1} decode steps in {fmt_seconds(one.decode_s)}; "
             + first_last(one)),
        Line(f"batch of {q.batch_size} ({shape})", "workload_speed.tokens_per_s",
             many.tokens_per_s,
             f"{many.tokens_per_s:,.1f} tok/s generated, {fmt_seconds(many.prefill_s + many.decode_s)}",
             f"{q.batch_size} x {q.output_len} tokens / ({len(pf)} prefill steps "
             f"{fmt_seconds(many.prefill_s)} (the first: "
             f"{step_terms(pf[0], hw.mem_bytes_per_s, hw.peak_flops(r.weights, pf[0].context))}) "
             f"+ {q.output_len - 1} decode steps {fmt_seconds(many.decode_s)}); "
             + first_last(many)),
    ]
    room_line, room_note = batch_room(r, mp)
    if room_line is not None:
        lines.append(room_line)
    notes = [f"vllm bench throughput's shape: --input-len {q.input_len} --output-len "
             f"{q.output_len} --batch-size {q.batch_size} (defaults: bench_engine.py's W2); "
             f"prompts prefilled in steps of --max-num-batched-tokens "
             f"{q.max_num_batched_tokens:,}, then one decode step per token after the first"]
    if hw.step_overhead_s or hw.layer_overhead_s:
        notes.append(f"each step adds the engine's measured fixed cost: "
                     f"{fmt_seconds(hw.step_overhead_s)} per step + "
                     f"{fmt_seconds(hw.layer_overhead_s)} x {r.entry.spec.num_layers} layers = "
                     f"{fmt_seconds(hw.step_overhead(r.entry.spec.num_layers))} "
                     f"(a tiny model's decode step; not overlapped with the kernels)")
    if room_note is not None:
        notes.insert(0, room_note)
    return Section(f"Workload on {hw.name} (step-time model, step by step)", tuple(lines),
                   tuple(notes))
