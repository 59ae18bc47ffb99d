"""`fitserve plan voice MODEL --gpu G`: the first-audio budget of a cascaded voice agent, line by
line, and the LLM tier it leaves room for.

    first audio = endpointing + ASR final + network up + LLM TTFT + LLM first clause
                  + TTS first chunk + network down

The stages run one after another (a streaming cascade: each starts on the previous one's first
output). The non-LLM stages are stated assumptions (flags, defaults below); the LLM stages come
from the planner's roofline (``plan.speed``) at batch B, every conversation holding P prompt
tokens and speaking an N-token first clause:

    TTFT(B)   = one engine step: the new turn's prefill of P tokens beside one decode token for
                each of the other B - 1 conversations (weights read once):
                max((weights + KV(P) + (B-1) KV(P+N)) / bandwidth,
                    (prefill_flops(P) + (B-1) flops_per_token(P+N)) / peak) + TP comm
    clause(B) = (N - 1) x TPOT(B): token 1 comes out of the prefill step, tokens 2..N take one
                decode step each; TPOT(B) = decode_step(B sequences at P + N tokens), the
                clause's last (longest) step, an upper bound for the others
    tier      = the largest B with TTFT(B) + clause(B) <= budget - fixed stages, whose
                B x KV(P + N) fits the engine's KV pool on that GPU

One turn arrives per step; turns that arrive together queue behind each other's prefill (the
"each colliding turn adds" line). With a prefix-cache hit only the new tokens are prefilled:
pass them as --prompt-tokens.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from fitserve.ledger.errors import PlanError
from fitserve.ledger.flops import flops_per_token, prefill_flops
from fitserve.ledger.hardware import Hardware, gpu_names
from fitserve.ledger.kv import request_kv
from fitserve.ledger.parallel import tp_allreduce
from fitserve.ledger.speed import (
    MAX_BATCH,
    StepTime,
    decode_step,
    smallest_batch,
    weight_bytes_read,
)
from fitserve.ledger.weights import WeightBytes, model_weight_bytes
from fitserve.tools.planner.fit import memory_plan
from fitserve.tools.planner.model_source import load_catalog
from fitserve.tools.planner.report import (
    ENGINE_DEFAULTS,
    Line,
    PlanRequest,
    Resolved,
    Section,
    resolve,
)
from fitserve.tools.sheets.sheet import Sheet

# NOTE: defaults of the non-LLM stages, stated as assumptions (each is a flag):
#  - endpointing 100 ms: the silence a VAD waits before it calls the turn over (plain VAD
#    setups use 200-500 ms; a turn-detection model gets near 100 ms);
#  - ASR final 30 ms: a streaming recognizer finalizing its last partial after the endpoint;
#  - network 20 ms one way (counted twice: audio up, audio down), a client near its region;
#  - TTS first chunk 50 ms: a streaming synthesizer's first audio after the first clause;
#  - first clause 8 tokens ("Sure, I can help with that."), prompt 1024 tokens.
BUDGET_MS = 300.0
ENDPOINTING_MS = 100.0
ASR_MS = 30.0
NETWORK_MS = 20.0
TTS_MS = 50.0
FIRST_CLAUSE_TOKENS = 8
PROMPT_TOKENS = 1024


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="catalog name, a config.json (or its folder), or a .gguf file")
    p.add_argument("--gpu", default="h100", help="accelerator from the catalog")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size of the LLM engine")
    p.add_argument("--weights", default=None, help="weight format (default: the checkpoint's)")
    p.add_argument("--kv", default=None, help="KV format (default: the model dtype)")
    p.add_argument("--budget-ms", type=float, default=BUDGET_MS,
                   help=f"end of speech to first audio (default {BUDGET_MS:g})")
    p.add_argument("--endpointing-ms", type=float, default=ENDPOINTING_MS,
                   help=f"VAD silence tail before end of turn (assumption, {ENDPOINTING_MS:g})")
    p.add_argument("--asr-ms", type=float, default=ASR_MS,
                   help=f"ASR final transcript after the endpoint (assumption, {ASR_MS:g})")
    p.add_argument("--network-ms", type=float, default=NETWORK_MS,
                   help=f"network one way, counted up and down (assumption, {NETWORK_MS:g})")
    p.add_argument("--tts-first-chunk-ms", type=float, default=TTS_MS,
                   help=f"TTS first audio chunk after its text (assumption, {TTS_MS:g})")
    p.add_argument("--first-clause-tokens", type=int, default=FIRST_CLAUSE_TOKENS,
                   help=f"tokens TTS needs before it starts, token 1 included "
                        f"(default {FIRST_CLAUSE_TOKENS})")
    p.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS,
                   help=f"tokens prefilled per turn (default {PROMPT_TOKENS})")
    p.add_argument("--concurrency", type=int, default=1,
                   help="conversations batched on one engine (the budget lines' batch)")
    p.add_argument("--streams", type=int, default=None,
                   help="conversations in all: sizes the replicas of the tier")


@dataclass(frozen=True)
class Stages:
    """The fixed (non-LLM) stages in seconds."""

    endpointing: float
    asr: float
    network_one_way: float
    tts: float

    @property
    def total(self) -> float:
        return self.endpointing + self.asr + 2 * self.network_one_way + self.tts


@dataclass(frozen=True)
class LLMTurn:
    """The LLM's share of one turn at batch ``batch``: the prefill step and the decode steps."""

    batch: int
    clause_tokens: int
    ttft: StepTime
    tpot: StepTime

    @property
    def clause(self) -> float:
        return (self.clause_tokens - 1) * self.tpot.seconds

    @property
    def seconds(self) -> float:
        return self.ttft.seconds + self.clause


def turn_prefill_step(r: Resolved, wb: WeightBytes, *, batch: int, prompt: int,
                      context: int) -> StepTime:
    """One step holding a new turn's prefill of ``prompt`` tokens and one decode token for each
    of the other ``batch - 1`` sequences at ``context`` tokens (``speed.prefill_time`` when
    ``batch`` is 1)."""
    s, hw, tp, others = r.entry.spec, r.hw, r.req.tp, batch - 1
    tokens = prompt + others
    w = weight_bytes_read(s, wb, tokens)
    kv = (request_kv(s, prompt, r.kv_dtype, tp=tp).bytes_reclaimed
          + others * request_kv(s, context, r.kv_dtype, tp=tp).bytes_reclaimed)
    flops = (prefill_flops(s, prompt).total + others * flops_per_token(s, context).total) / tp
    comm = tp_allreduce(s, hw, tp=tp, tokens=tokens, act_dtype_bytes=r.act_bytes)
    return StepTime(batch, prompt, w, kv, flops, (w + kv) / hw.mem_bytes_per_s,
                    flops / hw.peak_flops(r.weights), comm.seconds_per_step)


def llm_turn(r: Resolved, wb: WeightBytes, batch: int, prompt: int, clause: int) -> LLMTurn:
    ctx = prompt + clause
    tpot = decode_step(r.entry.spec, r.hw, wb, batch=batch, context=ctx, kv_dtype=r.kv_dtype,
                       weights_fmt=r.weights, act_dtype_bytes=r.act_bytes)
    return LLMTurn(batch, clause, turn_prefill_step(r, wb, batch=batch, prompt=prompt,
                                                    context=ctx), tpot)


@dataclass(frozen=True)
class Tier:
    """The largest batch one engine runs within the LLM budget, and what limits it."""

    by_latency: int  # 0: not even batch 1 fits the budget
    by_kv: int  # sequences of P + N tokens the KV pool holds (0: the weights leave no room)
    blocks_per_seq: int
    num_kv_blocks: int

    @property
    def batch(self) -> int:
        return min(self.by_latency, self.by_kv)

    @property
    def limited_by(self) -> str:
        if self.by_latency == 0 and self.by_kv == 0:
            return "latency and KV memory"
        return "latency" if self.by_latency <= self.by_kv else "KV memory"


def size_tier(r: Resolved, wb: WeightBytes, llm_budget: float, prompt: int, clause: int) -> Tier:
    """Largest B with LLM(B) <= ``llm_budget`` (LLM(B) grows with B), and the KV ceiling."""
    first_miss = smallest_batch(
        lambda b: llm_turn(r, wb, b, prompt, clause).seconds > llm_budget, MAX_BATCH)
    by_latency = MAX_BATCH if first_miss is None else first_miss - 1
    mp = memory_plan(r)
    per_seq = -(-(prompt + clause) // mp.block_size)
    return Tier(by_latency, mp.num_kv_blocks // per_seq, per_seq, mp.num_kv_blocks)


def _check(args: argparse.Namespace) -> Stages:
    for flag in ("endpointing_ms", "asr_ms", "network_ms", "tts_first_chunk_ms"):
        v = getattr(args, flag)
        if not 0 <= v < math.inf:
            raise PlanError(f"--{flag.replace('_', '-')} must be >= 0 ms and finite, got {v:g}")
    if not 0 < args.budget_ms < math.inf:
        raise PlanError(f"--budget-ms must be > 0 and finite, got {args.budget_ms:g}")
    for flag in ("first_clause_tokens", "prompt_tokens", "concurrency", "streams"):
        v = getattr(args, flag)
        if v is not None and v < 1:
            raise PlanError(f"--{flag.replace('_', '-')} must be >= 1, got {v}")
    st = Stages(args.endpointing_ms / 1e3, args.asr_ms / 1e3, args.network_ms / 1e3,
                args.tts_first_chunk_ms / 1e3)
    if st.total * 1e3 >= args.budget_ms:
        raise PlanError(f"--budget-ms {args.budget_ms:g} leaves nothing for the LLM: the fixed "
                        f"stages (endpointing + ASR + 2 x network + TTS) already take "
                        f"{st.total * 1e3:g} ms")
    return st


def _resolve(model: str, gpu: str, args: argparse.Namespace) -> Resolved:
    if gpu.strip().lower() == "cpu":
        raise PlanError("--gpu cpu: the voice sheet sizes a GPU tier; pick a catalog GPU")
    return resolve(PlanRequest(model, gpu=gpu, gpus=args.tp, tp=args.tp,
                               context=args.prompt_tokens + args.first_clause_tokens,
                               context_text=str(args.prompt_tokens + args.first_clause_tokens),
                               weights=args.weights, kv=args.kv, concurrency=args.concurrency))


def _weights(r: Resolved) -> WeightBytes:
    return model_weight_bytes(r.entry.spec, r.weights, tp=r.req.tp, base_dtype=r.base_dtype)


def _ms(s: float) -> str:
    return f"{s * 1e3:.3f} ms"


def _step_explain(st: StepTime, hw: Hardware, peak: float, flops_text: str) -> str:
    return (f"max(({st.weight_bytes:,.0f} + {st.kv_bytes:,.0f}) B / {hw.mem_bytes_per_s:.4g} "
            f"B/s = {_ms(st.t_memory)}, {flops_text} = {st.flops:.6g} FLOPs / {peak:.4g} FLOP/s "
            f"= {_ms(st.t_compute)}) + comm {_ms(st.t_comm)} = {_ms(st.seconds)} "
            f"({st.bound}-bound)")


def budget_section(r: Resolved, st: Stages, turn: LLMTurn, args: argparse.Namespace) -> Section:
    s, hw, b = r.entry.spec, r.hw, turn.batch
    p, n, peak = args.prompt_tokens, args.first_clause_tokens, hw.peak_flops(r.weights)
    ctx = p + n
    pf, fpt = prefill_flops(s, p).total, flops_per_token(s, ctx).total
    total = st.total + turn.seconds
    slack = args.budget_ms / 1e3 - total
    lines = [
        Line("endpointing (VAD tail)", "--endpointing-ms (assumption)", st.endpointing * 1e3,
             _ms(st.endpointing), "silence the VAD waits before it calls the turn over"),
        Line("ASR final", "--asr-ms (assumption)", st.asr * 1e3, _ms(st.asr),
             "final transcript after the endpoint (streaming recognizer)"),
        Line("network up + down", "2 x --network-ms (assumption)",
             2 * st.network_one_way * 1e3, _ms(2 * st.network_one_way),
             f"2 x {args.network_ms:g} ms: the user's audio in, the agent's audio out"),
        Line(f"LLM TTFT, prefill {p:,} tokens at batch {b}", "turn_prefill_step (roofline)",
             turn.ttft.seconds * 1e3, _ms(turn.ttft.seconds),
             _step_explain(turn.ttft, hw, peak,
                           f"(prefill {pf:,} + {b - 1} x {fpt:,} decode)" if b > 1
                           else f"prefill_flops({p})")),
        Line(f"LLM first clause, {n} tokens", "(N - 1) x TPOT(batch, P + N)",
             turn.clause * 1e3, _ms(turn.clause),
             f"token 1 from the prefill step, then {n - 1} x TPOT {_ms(turn.tpot.seconds)}; "
             f"TPOT = " + _step_explain(turn.tpot, hw, peak, f"{b} x flops_per_token({ctx})")),
        Line("TTS first chunk", "--tts-first-chunk-ms (assumption)", st.tts * 1e3, _ms(st.tts),
             "first audio chunk once the first clause's text arrives"),
        Line("first audio", "sum of the stages", total * 1e3, _ms(total),
             f"{st.endpointing * 1e3:g} + {st.asr * 1e3:g} + {2 * st.network_one_way * 1e3:g} + "
             f"{turn.ttft.seconds * 1e3:.3f} + {turn.clause * 1e3:.3f} + {st.tts * 1e3:g} = "
             f"{total * 1e3:.3f} ms"),
        Line("slack" if slack >= 0 else "overrun", "budget - first audio", slack * 1e3,
             _ms(slack) if slack >= 0 else f"{_ms(-slack)} over",
             f"{args.budget_ms:g} - {total * 1e3:.3f} = {slack * 1e3:.3f} ms",
             "" if slack >= 0 else f"first audio {_ms(total)} > budget {args.budget_ms:g} ms"),
    ]
    return Section(f"First-audio budget: {s.name} on {hw.name} (tp={r.req.tp}), batch {b}",
                   tuple(lines),
                   ("stages run one after another; the LLM lines are roofline floors "
                    "(kernels reach a fraction of peak)",
                    f"every conversation in the batch holds {p:,} + {n} tokens; one turn "
                    "arrives per step"))


def tier_section(r: Resolved, wb: WeightBytes, st: Stages, tier: Tier,
                 args: argparse.Namespace) -> Section:
    p, n, budget = args.prompt_tokens, args.first_clause_tokens, args.budget_ms / 1e3
    llm = budget - st.total
    lines = [Line("LLM budget", "budget - fixed stages", llm * 1e3, _ms(llm),
                  f"{args.budget_ms:g} - ({st.endpointing * 1e3:g} + {st.asr * 1e3:g} + 2 x "
                  f"{st.network_one_way * 1e3:g} + {st.tts * 1e3:g}) = {llm * 1e3:.3f} ms")]
    bl = tier.by_latency
    if bl >= 1:
        at = llm_turn(r, wb, bl, p, n)
        lines.append(Line(f"LLM at batch {bl}", "TTFT(B) + (N - 1) x TPOT(B)", at.seconds * 1e3,
                          _ms(at.seconds), f"{_ms(at.ttft.seconds)} + {n - 1} x "
                          f"{_ms(at.tpot.seconds)} = {_ms(at.seconds)} <= {_ms(llm)}"))
    if bl < MAX_BATCH:
        nx = llm_turn(r, wb, bl + 1, p, n)
        lines.append(Line(f"LLM at batch {bl + 1}", "TTFT(B) + (N - 1) x TPOT(B)",
                          nx.seconds * 1e3, _ms(nx.seconds), f"{_ms(nx.ttft.seconds)} + {n - 1} x "
                          f"{_ms(nx.tpot.seconds)} = {_ms(nx.seconds)} > {_ms(llm)}"))
    lines += [
        Line("largest batch in budget", "max B: LLM(B) <= LLM budget", bl, f"{bl:,}",
             "LLM(B) grows with B: found by doubling then bisecting",
             "" if bl else "not even batch 1 fits the LLM budget"),
        Line(f"KV ceiling at {p + n:,} tokens", "num_kv_blocks // ceil((P + N) / block)",
             tier.by_kv, f"{tier.by_kv:,}",
             f"{tier.num_kv_blocks:,} blocks // {tier.blocks_per_seq} per conversation",
             "" if tier.by_kv else "not one conversation's KV fits beside the weights"),
        Line("LLM tier per engine", "min(latency, KV ceiling)", tier.batch, f"{tier.batch:,} "
             f"conversations ({tier.limited_by}-bound)", f"min({bl:,}, {tier.by_kv:,})"),
    ]
    pf = turn_prefill_step(r, wb, batch=1, prompt=p, context=p + n).seconds
    lines.append(Line("each colliding turn adds", "turn_prefill_step(batch 1) (roofline)",
                      pf * 1e3, _ms(pf), f"one more prefill of {p:,} tokens in the same step "
                      "(the TTFT line's prefill at batch 1)"))
    if args.streams is not None and tier.batch >= 1:
        reps = -(-args.streams // tier.batch)
        lines.append(Line(f"replicas for {args.streams:,} conversations",
                          "ceil(streams / tier) x tp", reps * r.req.tp,
                          f"{reps:,} x {r.req.tp} GPU = {reps * r.req.tp:,} {r.hw.name}",
                          f"ceil({args.streams:,} / {tier.batch:,}) = {reps:,} engines of tp "
                          f"{r.req.tp}"))
    default = ENGINE_DEFAULTS.scheduler.max_num_seqs
    notes = (f"run the engine with --max-num-seqs >= {tier.batch} (its default is "
             f"{default})",) if tier.batch > default else ()
    return Section(f"LLM tier on {r.hw.name}", tuple(lines), notes)


def _tier_of(model: str, gpu: str, args: argparse.Namespace, llm_budget: float) -> int | None:
    """The tier of ``model`` on ``gpu`` (None: it cannot be planned there, e.g. a TP split)."""
    try:
        r = _resolve(model, gpu, args)
    except PlanError:
        return None
    return size_tier(r, _weights(r), llm_budget, args.prompt_tokens,
                     args.first_clause_tokens).batch


@dataclass(frozen=True)
class Meets:
    model: str
    gpu: str
    tier: int


def alternatives_section(r: Resolved, args: argparse.Namespace,
                         llm_budget: float) -> tuple[Section, list[Meets]]:
    """Catalog GPUs that meet the budget with this model, catalog models that meet it here."""
    need, found = args.concurrency, []
    for gpu in (g for g in gpu_names() if g not in ("cpu", r.hw.name)):
        b = _tier_of(args.model, gpu, args, llm_budget)
        if b is not None and b >= need:
            found.append(Meets(r.entry.spec.name, gpu, b))
    for m in (m["name"] for m in load_catalog() if m["name"] != r.entry.spec.name):
        b = _tier_of(m, r.hw.name, args, llm_budget)
        if b is not None and b >= need:
            found.append(Meets(m, r.hw.name, b))
    lines = tuple(Line(f"{f.model} on {f.gpu}", "size_tier", f.tier,
                       f"up to {f.tier:,} conversations",
                       f"same budget, {args.prompt_tokens:,} + {args.first_clause_tokens} "
                       f"tokens, tp={args.tp}, weights {args.weights or 'native'}")
                  for f in found)
    notes = () if found else ("no catalog GPU with this model, and no catalog model on this "
                              "GPU, meets the budget: a larger budget, a shorter first clause, "
                              "or a smaller weight format (--weights)",)
    return Section(f"Meets the budget at batch {need} instead", lines, notes), found


def build(args: argparse.Namespace) -> Sheet:
    st = _check(args)
    r = _resolve(args.model, args.gpu, args)
    wb = _weights(r)
    p, n, b = args.prompt_tokens, args.first_clause_tokens, args.concurrency
    llm_budget = args.budget_ms / 1e3 - st.total
    turn = llm_turn(r, wb, b, p, n)
    tier = size_tier(r, wb, llm_budget, p, n)
    total = st.total + turn.seconds
    sections = [budget_section(r, st, turn, args), tier_section(r, wb, st, tier, args)]
    fits_time, fits_kv = turn.seconds <= llm_budget, b <= tier.by_kv
    ok = fits_time and fits_kv
    found: list[Meets] = []
    if not ok:
        alt, found = alternatives_section(r, args, llm_budget)
        sections.append(alt)
    where = f"{r.entry.spec.name} on {r.hw.name} (tp={r.req.tp})"
    if ok:
        verdict = (f"meets the {args.budget_ms:g} ms budget at batch {b}: first audio "
                   f"{_ms(total)}, slack {_ms(args.budget_ms / 1e3 - total)}; tier up to "
                   f"{tier.batch:,} conversations per engine ({tier.limited_by}-bound)")
    else:
        whys = ([f"first audio {_ms(total)} > {args.budget_ms:g} ms"] if not fits_time else [])
        if not fits_kv:
            whys.append(f"KV for {b} x {p + n:,} tokens does not fit (ceiling {tier.by_kv})")
        why = " and ".join(whys)
        alts = ", ".join(f"{f.model} on {f.gpu} ({f.tier})" for f in found[:6])
        verdict = (f"{where} does not meet the budget at batch {b}: {why}; "
                   + (f"meets it: {alts}" if alts else "no catalog alternative meets it"))
    data: dict[str, object] = {
        "first_audio_ms": total * 1e3, "slack_ms": (args.budget_ms / 1e3 - total) * 1e3,
        "llm_budget_ms": llm_budget * 1e3, "ttft_ms": turn.ttft.seconds * 1e3,
        "clause_ms": turn.clause * 1e3, "tier": tier.batch, "tier_by_latency": tier.by_latency,
        "tier_by_kv": tier.by_kv,
        "meets_instead": [{"model": f.model, "gpu": f.gpu, "tier": f.tier} for f in found]}
    title = (f"fitserve plan voice: {where}, weights {r.weights}, KV {r.kv_dtype}, "
             f"{args.budget_ms:g} ms to first audio")
    return Sheet(title, tuple(sections), r.warnings, verdict, ok, data)
