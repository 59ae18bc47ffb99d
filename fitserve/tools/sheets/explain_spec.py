"""`plan explain medusa-vs-eagle`: two speculative drafters head to head on the roofline.

A Medusa-style drafter puts k extra heads on the target's last hidden state; head i guesses
position t + i blind (it never sees heads 1..i-1's guesses). Head i's top-1 is right with
marginal probability a_i, and a chain of guesses is accepted up to the first wrong one:

    P(first j accepted) = a_1 x a_2 x ... x a_j         (heads taken as independent)

An EAGLE-style drafter is one decoder layer that runs k times, each step fed the previous
draft token and feature: its acceptance alpha is conditioned on the previous draft being right,

    P(first j accepted) = alpha^j

Either way a verification of k drafts yields E = 1 + sum_j P(first j accepted) tokens. One
round costs the verification of k + 1 positions (``planner.speculative.verify_step``, the
ledger's roofline) plus the drafts:

    Medusa: one pass over the k heads (each a residual block h x h and its own h x V head)
    EAGLE : k sequential passes over [FC 2h -> h, one decoder layer, the shared lm_head]
    t_draft pass = max(bytes / bandwidth, B x 2 x params / bf16 peak), sharded over --tp

and per-sequence speed is E / t_round against plain decode's 1 / t_decode.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

from fitserve.config import ModelSpec
from fitserve.ledger.errors import PlanError
from fitserve.ledger.hardware import Hardware
from fitserve.ledger.kv import kv_bytes_per_token, request_kv
from fitserve.ledger.speed import decode_step, smallest_batch
from fitserve.ledger.units import fmt_bytes, fmt_seconds
from fitserve.ledger.weights import roofline_weight_bytes
from fitserve.tools.planner.report import Line, Section
from fitserve.tools.planner.speculative import verify_step
from fitserve.tools.sheets.explain_common import (
    hardware,
    line,
    model,
    model_name,
    opt_float,
    opt_int,
    opt_str,
    opt_tokens,
)
from fitserve.tools.sheets.sheet import Sheet

FLAGS = ("gpu", "model", "weights", "context", "tp", "heads_accept", "draft_accept", "draft_k")
DRAFT_BYTES = 2  # drafters are held in bf16
# NOTE: ASSUMED defaults, in the range the papers report for chat models: Medusa's heads'
# top-1 accuracy falls with the position they guess (~0.6 for head 1); EAGLE reports an
# acceptance rate of ~0.7-0.8 per drafted token conditioned on the previous one.
DEFAULT_HEADS_ACCEPT = "0.6,0.45,0.35,0.25"
DEFAULT_DRAFT_ACCEPT = 0.75
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
EAGLE3 = (
    "EAGLE-3 change 1, multi-layer feature fusion: the drafter reads the target's low, middle "
    "and high layer features (3h concatenated, FC 3h -> h), not only the top layer's",
    "EAGLE-3 change 2, no feature-prediction loss: the drafter is trained on the token loss "
    "alone, so it need not reproduce the target's top-layer feature",
    "EAGLE-3 change 3, training-time test: during training the drafter is unrolled on its own "
    "outputs for several steps (as at inference), so later positions see drafted inputs",
)


@dataclass(frozen=True)
class Drafter:
    name: str
    k: int
    accept_prefix: tuple[float, ...]  # P(first j drafts accepted), j = 1..k
    params_per_pass: int
    passes: int  # sequential draft passes per round
    kv_per_token: int  # draft KV bytes per context token (EAGLE's one layer)

    @property
    def expected(self) -> float:
        return 1.0 + sum(self.accept_prefix)


def parse_accepts(text: str) -> tuple[float, ...]:
    """ "0.6,0.45" -> (0.6, 0.45); each in (0, 1]."""
    try:
        vals = tuple(float(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise PlanError(f"--heads-accept: cannot read {text!r}; write per-head acceptance "
                        f"probabilities separated by commas (e.g. 0.6,0.45,0.35)") from None
    if not vals or any(not 0.0 < v <= 1.0 for v in vals):
        raise PlanError(f"--heads-accept: each value must be in (0, 1], got {text!r}")
    return vals


def medusa(spec: ModelSpec, accepts: tuple[float, ...]) -> Drafter:
    """k heads, each a residual block (h x h) and its own h x V output layer, one pass."""
    h, v = spec.hidden_size, spec.vocab_size
    prefix, p = [], 1.0
    for a in accepts:
        p *= a
        prefix.append(p)
    return Drafter("Medusa", len(accepts), tuple(prefix), len(accepts) * (h * h + h * v), 1, 0)


def eagle_layer_params(spec: ModelSpec) -> int:
    """One decoder layer of the target's shape: q, o (h x heads d), k, v (h x kv d), MLP 3 h I."""
    h, d = spec.hidden_size, spec.head_dim
    attn = 2 * h * spec.num_heads * d + 2 * h * spec.num_kv_heads * d
    return attn + 3 * h * spec.intermediate_size


def eagle(spec: ModelSpec, alpha: float, k: int) -> Drafter:
    """FC 2h -> h + one decoder layer (its own params) + the target's lm_head (shared, read)."""
    h = spec.hidden_size
    own = 2 * h * h + eagle_layer_params(spec)
    per_pass = own + h * spec.vocab_size
    kv = 2 * spec.num_kv_heads * spec.head_dim * DRAFT_BYTES
    return Drafter("EAGLE", k, tuple(alpha ** j for j in range(1, k + 1)), per_pass, k, kv)


@dataclass(frozen=True)
class Setup:
    spec: ModelSpec
    hw: Hardware
    fmt: str
    context: int
    tp: int


def draft_pass_seconds(s: Setup, d: Drafter, batch: int) -> float:
    """One draft pass at ``batch``: max(bytes / bw, B x 2 x params / bf16 peak) per rank."""
    nbytes = (d.params_per_pass * DRAFT_BYTES + batch * s.context * d.kv_per_token) / s.tp
    flops = batch * 2 * d.params_per_pass / s.tp
    return max(nbytes / s.hw.mem_bytes_per_s, flops / s.hw.bf16_flops)


def decode_seconds(s: Setup, batch: int) -> float:
    wb = roofline_weight_bytes(s.spec, s.fmt, tp=s.tp)
    return decode_step(s.spec, s.hw, wb, batch=batch, context=s.context, kv_dtype="bf16",
                       weights_fmt=s.fmt).seconds


def round_seconds(s: Setup, d: Drafter, batch: int) -> float:
    wb = roofline_weight_bytes(s.spec, s.fmt, tp=s.tp)
    ver = verify_step(s.spec, s.hw, wb, batch=batch, k=d.k, context=s.context, kv_dtype="bf16",
                      weights_fmt=s.fmt).seconds
    return ver + d.passes * draft_pass_seconds(s, d, batch)


def per_seq_rate(s: Setup, d: Drafter | None, batch: int) -> float:
    """Tokens per second one sequence gets (plain decode for ``d`` None)."""
    if d is None:
        return 1.0 / decode_seconds(s, batch)
    return d.expected / round_seconds(s, d, batch)


def winner(s: Setup, ds: tuple[Drafter, Drafter], batch: int, *, plain: bool = True) -> str:
    """The fastest per sequence at ``batch`` (among the two drafters alone: plain=False)."""
    rates = {"plain decode": per_seq_rate(s, None, batch)} if plain else {}
    rates.update({d.name: per_seq_rate(s, d, batch) for d in ds})
    return max(rates, key=lambda n: rates[n])


def fit_batch(s: Setup, ds: tuple[Drafter, Drafter]) -> int:
    """Sequences whose KV fits beside the weights and both drafters on one rank:
    floor((memory - weights - drafters' bytes) / KV per sequence), all per rank."""
    # NOTE: an upper bound: no runtime reserve, activations or fragmentation are taken off.
    wb = roofline_weight_bytes(s.spec, s.fmt, tp=s.tp)
    draft = sum(_own_params(s.spec, d) for d in ds) * DRAFT_BYTES / s.tp
    free = s.hw.memory_bytes - wb.total - draft
    per_seq = request_kv(s.spec, s.context, "bf16", tp=s.tp).bytes_reclaimed + sum(
        s.context * d.kv_per_token for d in ds) / s.tp
    return max(0, int(free // per_seq))


def _own_params(spec: ModelSpec, d: Drafter) -> int:
    """Params a drafter adds to memory (EAGLE reads the target's lm_head, not a copy)."""
    return d.params_per_pass - (spec.hidden_size * spec.vocab_size if d.name == "EAGLE" else 0)


def stops_paying(s: Setup, d: Drafter) -> int | None:
    """Smallest batch where the drafter's per-sequence rate falls below plain decode."""
    return smallest_batch(lambda b: per_seq_rate(s, d, b) < per_seq_rate(s, None, b),
                          BATCHES[-1])


def flips(s: Setup, ds: tuple[Drafter, Drafter], *, plain: bool = True
          ) -> list[tuple[int, str, str]]:
    """(first batch, old winner, new winner) wherever the winner changes, bisected exactly
    between the listed batches."""
    def pick(b: int) -> str:
        return winner(s, ds, b, plain=plain)

    out = []
    for lo, hi in zip(BATCHES, BATCHES[1:], strict=False):
        w_lo, w_hi = pick(lo), pick(hi)
        if w_lo == w_hi:
            continue
        a, b = lo, hi
        while b - a > 1:
            mid = (a + b) // 2
            a, b = (mid, b) if pick(mid) == w_lo else (a, mid)
        out.append((b, w_lo, pick(b)))
    return out


def build(args: argparse.Namespace) -> Sheet:
    hw = hardware(args)
    entry = model(args, "Llama-3.3-70B")
    spec = entry.spec
    s = Setup(spec, hw, opt_str(args, "weights", "fp8"), opt_tokens(args, "context", 4096),
              opt_int(args, "tp", 2, hi=64))
    med = medusa(spec, parse_accepts(opt_str(args, "heads_accept", DEFAULT_HEADS_ACCEPT)))
    eag = eagle(spec, opt_float(args, "draft_accept", DEFAULT_DRAFT_ACCEPT, max_value=1.0),
                opt_int(args, "draft_k", med.k, hi=16))
    ds = (med, eag)
    draft_sec = Section(f"The drafters on {model_name(entry)} (h {spec.hidden_size}, V "
                        f"{spec.vocab_size:,})", (*_drafter_lines(s, med), *_drafter_lines(s, eag)),
                        EAGLE3)
    fit = fit_batch(s, ds)
    rows = [_batch_line(s, ds, b, fit) for b in BATCHES]
    fl = flips(s, ds)
    fl_lines = [line(f"winner flips at batch {b}", "first B where the best per-sequence rate "
                     "changes", b, f"{old} -> {new}" + (" (beyond memory)" if b > fit else ""),
                     f"bisected between the listed batches: B {b - 1} {old}, B {b} {new}")
                for b, old, new in fl]
    stop_lines = [_stop_line(s, d) for d in ds]
    duel = flips(s, ds, plain=False)
    stop_lines += [line(f"between the drafters alone: flips at batch {b}", "first B where the "
                        "faster drafter changes", b, f"{old} -> {new}",
                        f"B {b - 1} {old}, B {b} {new} (plain decode left out)")
                   for b, old, new in duel]
    stop_lines += [line(f"{d.name}: tokens per verified position", "E / (k + 1)",
                        d.expected / (d.k + 1), f"{d.expected / (d.k + 1):.3f}",
                        f"{d.expected:.4f} / {d.k + 1}: once verification is compute-bound "
                        f"the round costs ~(k + 1) decode steps, so the larger wins")
                   for d in ds]
    sec = Section(f"Per-sequence tokens/s on {s.tp} x {hw.name}, {s.fmt} weights, context "
                  f"{s.context:,}", (_fit_line(s, ds, fit), *rows, *fl_lines, *stop_lines),
                  ("round = verify k + 1 positions (ledger roofline) + draft passes; "
                   "the drafters in bf16, sharded over the TP ranks like the target",))
    flip_txt = "; ".join(f"B >= {b}: {new}" + (" (beyond memory)" if b > fit else "")
                         for b, _, new in fl) or f"no flip up to B {BATCHES[-1]}"
    verdict = (f"E: Medusa {med.expected:.3f} vs EAGLE {eag.expected:.3f} tokens per round; "
               f"winner at B=1: {winner(s, ds, 1)}; {flip_txt}; {fit} sequences fit")
    warns = (f"{hw.name} has no fp8 tensor cores: {s.fmt} is priced as weight-only (fp8 "
             f"bytes read, GEMMs at the bf16 peak, as Marlin's fp8 kernels run on Ampere)",
             ) if s.fmt.startswith("fp8") and not hw.fp8_flops else ()
    return Sheet(f"Medusa vs EAGLE on {model_name(entry)}, {s.tp} x {hw.name}",
                 (draft_sec, sec), warns, verdict,
                 data={"flips": [list(f) for f in fl], "fit_batch": fit,
                       "drafter_flips": [list(f) for f in duel],
                       "stops_paying": {d.name: stops_paying(s, d) for d in ds}, "medusa_expected": med.expected,
                       "eagle_expected": eag.expected})


def _drafter_lines(s: Setup, d: Drafter) -> list[Line]:
    acc = ", ".join(f"{p:.4f}" for p in d.accept_prefix)
    how = ("product of the blind heads' a_i" if d.name == "Medusa"
           else "alpha^j, each draft conditioned on the previous")
    nb = d.params_per_pass * DRAFT_BYTES
    t1 = draft_pass_seconds(s, d, 1)
    out = [
        line(f"{d.name}: P(first j accepted), j=1..{d.k}", how, d.accept_prefix[-1], acc,
             f"{how}: {acc}"),
        line(f"{d.name}: expected tokens per round", "1 + sum_j P(first j accepted)", d.expected,
             f"{d.expected:.3f}", f"1 + {' + '.join(f'{p:.4f}' for p in d.accept_prefix)} = "
                                  f"{d.expected:.4f}"),
        line(f"{d.name}: params read per draft pass", _param_formula(d), d.params_per_pass,
             f"{d.params_per_pass / 1e9:.3f} B = {fmt_bytes(nb)}", _param_explain(s.spec, d)),
        line(f"{d.name}: draft time per round at B=1", "passes x max(bytes/bw, flops/peak) / tp",
             d.passes * t1, fmt_seconds(d.passes * t1),
             f"{d.passes} x ({nb:,} B + {s.context:,} x {d.kv_per_token:,} B KV) / {s.tp} / "
             f"{s.hw.mem_bytes_per_s:.4g} B/s = {fmt_seconds(d.passes * t1)}"),
    ]
    if d.kv_per_token:
        kv_t = kv_bytes_per_token(s.spec, "bf16")
        out.append(line(f"{d.name}: draft KV per token", "2 x kv_heads x head_dim x 2 B",
                        d.kv_per_token, f"{d.kv_per_token:,} B",
                        f"2 x {s.spec.num_kv_heads} x {s.spec.head_dim} x 2 = "
                        f"{d.kv_per_token:,} B vs the target's {kv_t:,} B "
                        f"({d.kv_per_token / kv_t:.2%})"))
    return out


def _param_formula(d: Drafter) -> str:
    return ("k x (h^2 + h V)" if d.name == "Medusa"
            else "2h^2 + layer (2 h H d + 2 h KV d + 3 h I) + h V (lm_head, shared)")


def _param_explain(spec: ModelSpec, d: Drafter) -> str:
    h, v = spec.hidden_size, spec.vocab_size
    if d.name == "Medusa":
        return f"{d.k} x ({h}^2 + {h} x {v}) = {d.params_per_pass:,}"
    layer = eagle_layer_params(spec)
    return (f"FC 2 x {h}^2 = {2 * h * h:,} + layer {layer:,} (own, "
            f"{(2 * h * h + layer) * DRAFT_BYTES / 1e9:.3f} GB) + lm_head {h * v:,} = "
            f"{d.params_per_pass:,}")


def _fit_line(s: Setup, ds: tuple[Drafter, Drafter], fit: int) -> Line:
    kv = request_kv(s.spec, s.context, "bf16", tp=s.tp).bytes_reclaimed
    return line("sequences that fit (per rank)", "(memory - weights - drafters) / KV per seq",
                fit, f"{fit:,}", f"({s.hw.memory_bytes:,} - {roofline_weight_bytes(s.spec, s.fmt, tp=s.tp).total:,} - "
                f"{sum(_own_params(s.spec, d) for d in ds) * DRAFT_BYTES / s.tp:,.0f}) B / "
                f"({kv:,} + drafter KV) B = {fit:,}; rows past it are marked")


def _stop_line(s: Setup, d: Drafter) -> Line:
    b = stops_paying(s, d)
    shown = "pays at every listed batch" if b is None else f"B >= {b}"
    return line(f"{d.name} stops paying", "smallest B with E / t_round < 1 / t_decode",
                b if b is not None else "never", shown,
                "doubling from 1 then bisecting on the per-sequence rates above")


def _batch_line(s: Setup, ds: tuple[Drafter, Drafter], b: int, fit: int) -> Line:
    plain = per_seq_rate(s, None, b)
    rates = {d.name: per_seq_rate(s, d, b) for d in ds}
    best: Callable[[str], float] = lambda n: rates.get(n, plain)  # noqa: E731
    w = winner(s, ds, b)
    parts = ", ".join(f"{n} {r:,.1f} ({r / plain:.2f}x)" for n, r in rates.items())
    return line(f"batch {b}", "E / (t_verify + passes x t_draft) vs 1 / t_decode", best(w),
                f"{w}: {best(w):,.1f} tok/s" + (" (beyond memory)" if b > fit else ""),
                f"plain {plain:,.1f} tok/s; {parts}")
