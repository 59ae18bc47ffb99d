"""Context (sequence) parallelism for one long request: pure functions, no I/O.

Ring attention over a CP group of c GPUs: the N prompt tokens are split into c shards; each GPU
keeps its shard's KV and its shard's queries. In each of the c - 1 ring steps of a layer a GPU
computes attention of its queries against the KV block it holds, while it sends that block to
the next GPU and receives the previous GPU's block (one link direction each way).

Causal balance. A query at position q attends to q + 1 keys, so a contiguous split gives the
last rank the most work. Counting (query, key) pairs exactly, for shards of n = N / c tokens:

    rank i (contiguous): i x n^2 (earlier shards, whole) + n (n + 1) / 2 (its own diagonal)
    max / mean = ((2c - 1) n + 1) / (c n + 1)  -> (2c - 1) / c as n grows

Zigzag: split into 2c chunks of m = N / 2c; rank i takes chunks i and 2c - 1 - i:

    chunks 0 1 2 3 4 5 6 7   (c = 4)
    rank   0 1 2 3 3 2 1 0   work(i) = (i + 2c - 1 - i) m^2 + m (m + 1) = the same for all i

and every off-diagonal ring step costs each rank exactly 2 of its 4 m x m sub-blocks, i.e.
half of an (2m) x (2m) block: that half block is the compute that must hide one transfer.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

from fitserve.config import ModelSpec
from fitserve.ledger.errors import PlanError
from fitserve.ledger.flops import attention_flops_per_position
from fitserve.ledger.formats import kv_format
from fitserve.ledger.hardware import Hardware
from fitserve.ledger.kv import check_tp, kv_layer_bytes_per_token, layer_kinds, request_kv
from fitserve.ledger.memory import activation_peak_bytes
from fitserve.ledger.params import is_mla
from fitserve.ledger.units import fmt_bytes
from fitserve.ledger.weights import model_weight_bytes

Span = tuple[int, int]  # token positions [start, stop)


def causal_pairs(start: int, stop: int) -> int:
    """(query, key) pairs of causal attention for queries [start, stop): sum of (q + 1)."""
    return (stop * (stop + 1) - start * (start + 1)) // 2


def contiguous_shards(tokens: int, cp: int) -> tuple[tuple[Span, ...], ...]:
    """Rank i holds [floor(i N / c), floor((i + 1) N / c))."""
    return tuple(((i * tokens // cp, (i + 1) * tokens // cp),) for i in range(cp))


def zigzag_shards(tokens: int, cp: int) -> tuple[tuple[Span, ...], ...]:
    """2c chunks at floor(k N / 2c); rank i holds chunks i and 2c - 1 - i."""
    bounds = [k * tokens // (2 * cp) for k in range(2 * cp + 1)]
    return tuple(((bounds[i], bounds[i + 1]), (bounds[2 * cp - 1 - i], bounds[2 * cp - i]))
                 for i in range(cp))


def rank_work(shards: Sequence[Sequence[Span]]) -> tuple[int, ...]:
    """Causal (query, key) pairs each rank computes for its query spans."""
    return tuple(sum(causal_pairs(a, b) for a, b in spans) for spans in shards)


def imbalance(work: Sequence[int]) -> Fraction:
    """max / mean of the ranks' work, exactly (1 = balanced)."""
    return Fraction(max(work) * len(work), sum(work))


@dataclass(frozen=True)
class RingStep:
    """One ring step of one full-attention layer on one GPU of a CP x TP group."""

    cp: int
    tp: int
    shard_tokens: int  # ceil(N / c): the KV block a GPU holds and passes on
    bytes_per_token: int  # one layer's KV per token on one TP rank
    block_bytes: int  # shard_tokens x bytes_per_token: sent (and received) per step
    transfer_s: float  # link latency + block_bytes / link bandwidth
    pairs: int  # causal pairs of an off-diagonal zigzag step: shard^2 / 2
    flops: float  # pairs x attention FLOPs per position / tp
    peak_flops: float
    compute_s: float
    min_hiding_shard: int  # smallest shard whose step compute covers its transfer
    full_layers: int

    @property
    def hides(self) -> bool:
        return self.compute_s >= self.transfer_s

    @property
    def ratio(self) -> float:
        """compute / transfer: >= 1 means the ring's traffic hides behind attention."""
        return self.compute_s / self.transfer_s if self.transfer_s else math.inf


def ring_step(spec: ModelSpec, hw: Hardware, *, context: int, cp: int, tp: int,
              kv_dtype: str) -> RingStep:
    """The transfer vs compute of one ring step (see the module docstring).

    Compute at ``hw.peak_flops(kv_dtype)``: fp8 KV runs attention at the fp8 peak (as FA3 does),
    which makes the compute shorter and hiding harder; others at the bf16 peak.
    """
    shard = -(-context // cp)
    per_tok = kv_layer_bytes_per_token(spec, kv_dtype, tp=tp)
    block = shard * per_tok
    transfer = hw.link_latency_s + block / hw.link_bytes_per_s
    f_pos = attention_flops_per_position(spec)
    pairs = shard * shard // 2
    peak = hw.peak_flops(kv_dtype)
    flops = pairs * f_pos / tp
    return RingStep(cp, tp, shard, per_tok, block, transfer, pairs, flops, peak, flops / peak,
                    min_hiding_shard(f_pos / tp, peak, per_tok, hw),
                    sum(k == "full" for k in layer_kinds(spec)))


def min_hiding_shard(flops_per_pair: float, peak: float, bytes_per_token: int,
                     hw: Hardware) -> int:
    """Smallest n with (n^2 / 2) F / P >= latency + n b / B: the positive root, rounded up.

        a n^2 - (b / B) n - latency >= 0,  a = F / (2 P)
        n* = (b / B + sqrt((b / B)^2 + 4 a latency)) / (2 a)
    """
    a = flops_per_pair / (2 * peak)
    slope = bytes_per_token / hw.link_bytes_per_s
    root = (slope + math.sqrt(slope * slope + 4 * a * hw.link_latency_s)) / (2 * a)
    n = max(1, math.ceil(root - 1e-9))
    while (n * n // 2) * flops_per_pair / peak < hw.link_latency_s + n * slope:
        n += 1  # the integer half block n^2 // 2 can fall just short of the real root
    return n


# -- fitting one request on TP x CP GPUs -----------------------------------------------------


@dataclass(frozen=True)
class CPQuery:
    """What one long request needs: the model's formats and the engine's reserves."""

    context: int
    weights_fmt: str
    kv_dtype: str
    usable_bytes: int  # per GPU: memory x memory utilization
    act_dtype_bytes: int = 2
    chunk_tokens: int = 2048  # prefill tokens per GPU per forward step (activation reserve)
    workspace_bytes: int = 1 << 30
    reclaim_windows: bool = True  # sliding layers keep only their window (reclaiming allocator)
    base_dtype: str = "bf16"


@dataclass(frozen=True)
class CPLayout:
    """One request on tp x cp GPUs: what each GPU holds."""

    tp: int
    cp: int
    shard_tokens: int
    weight_bytes: int  # the TP shard of the weights: every CP rank holds one
    kv_bytes: int  # request_kv of the GPU's shard, on its TP rank
    reserve_bytes: int  # activations of one chunk + workspace
    usable_bytes: int

    @property
    def gpus(self) -> int:
        return self.tp * self.cp

    @property
    def need_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.reserve_bytes

    @property
    def fits(self) -> bool:
        return self.need_bytes <= self.usable_bytes

    @property
    def name(self) -> str:
        return f"TP{self.tp} x CP{self.cp}"


def shard_kv_bytes(spec: ModelSpec, q: CPQuery, tokens: int, tp: int) -> int:
    """KV one GPU holds for ``tokens`` of the request (kv.request_kv on its TP rank)."""
    r = request_kv(spec, tokens, q.kv_dtype, tp=tp)
    return r.bytes_reclaimed if q.reclaim_windows else r.bytes_all_layers


def cp_layout(spec: ModelSpec, q: CPQuery, *, tp: int, cp: int) -> CPLayout:
    """Per-GPU bytes of the request on a TP x CP group (raises PlanError for an invalid tp)."""
    shard = -(-q.context // cp)
    weights = model_weight_bytes(spec, q.weights_fmt, tp=tp, base_dtype=q.base_dtype).total
    reserve = activation_peak_bytes(spec, min(q.chunk_tokens, shard), q.act_dtype_bytes, tp)
    return CPLayout(tp, cp, shard, weights, shard_kv_bytes(spec, q, shard, tp),
                    reserve + q.workspace_bytes, q.usable_bytes)


def tp_choices(spec: ModelSpec, gpus: int) -> tuple[int, ...]:
    """TP degrees that divide ``gpus`` and the model's heads (kv.check_tp), ascending."""
    out = []
    for tp in range(1, gpus + 1):
        if gpus % tp:
            continue
        try:
            check_tp(spec, tp)
        except PlanError:
            continue
        out.append(tp)
    return tuple(out)


def cp_layouts(spec: ModelSpec, q: CPQuery, gpus: int) -> tuple[CPLayout, ...]:
    """Every TP x CP split of ``gpus`` (gpus = tp x cp), smallest TP first."""
    return tuple(cp_layout(spec, q, tp=tp, cp=gpus // tp) for tp in tp_choices(spec, gpus))


def choose_layout(layouts: Sequence[CPLayout]) -> CPLayout | None:
    """The fitting split with the smallest TP (the rest context parallel), None if none fits.

    NOTE: at long context CP's ring traffic (a KV block per step, hidden behind attention) is
    smaller than TP's per-layer all-reduces of every token's hidden state, so TP is taken only
    as far as the weights and KV need it.
    """
    return next((x for x in layouts if x.fits), None)


def max_context(spec: ModelSpec, q: CPQuery, layout: CPLayout) -> int | None:
    """The longest request the layout holds (bisection over the ledger's KV bytes); None:
    no length fills it (every layer windowed, windows reclaimed)."""
    free = layout.usable_bytes - layout.weight_bytes - layout.reserve_bytes
    if free < 0:
        return 0

    def holds(ctx: int) -> bool:
        return shard_kv_bytes(spec, q, -(-ctx // layout.cp), layout.tp) <= free

    lo, hi = 0, 1
    while holds(hi):
        lo, hi = hi, hi * 2
        if hi > 1 << 50:
            return None  # windows cap the KV: no context fills the GPUs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if holds(mid) else (lo, mid)
    return lo


# -- what breaks a layout, and what replaces it ------------------------------------------------

GQA_KV_HEADS = 8  # "MLA -> GQA": 8 KV heads, as Llama 3 70B/405B use
MAX_GPU_MULTIPLE = 64  # replacements look up to 64x the GPUs
Option = tuple[str, CPLayout | None]


def single_changes(spec: ModelSpec, q: CPQuery) -> list[tuple[str, ModelSpec, CPQuery]]:
    """Single changes to the model or the input, each applied alone: context x2 and x4, KV
    heads x2 and MHA (GQA), MLA -> GQA, no sliding window, bf16 KV for a 1-byte KV format."""
    out = [("context x2", spec, dataclasses.replace(q, context=2 * q.context)),
           ("context x4", spec, dataclasses.replace(q, context=4 * q.context))]
    if not is_mla(spec):
        kv2 = 2 * spec.num_kv_heads
        if kv2 <= spec.num_heads and spec.num_heads % kv2 == 0:
            out.append((f"KV heads x2 ({spec.num_kv_heads} -> {kv2})",
                        dataclasses.replace(spec, num_kv_heads=kv2), q))
        if kv2 < spec.num_heads:
            out.append((f"GQA -> MHA ({spec.num_heads} KV heads)",
                        dataclasses.replace(spec, num_kv_heads=spec.num_heads), q))
    else:
        d = spec.qk_nope_head_dim + spec.qk_rope_head_dim
        out.append((f"MLA -> GQA ({GQA_KV_HEADS} KV heads of {d})", dataclasses.replace(
            spec, kv_lora_rank=0, num_kv_heads=GQA_KV_HEADS, head_dim=d), q))
    if spec.sliding_window and q.reclaim_windows:
        out.append(("no sliding window", dataclasses.replace(
            spec, sliding_window=None, layer_types=None), q))
    if kv_format(q.kv_dtype).element_bytes == 1:
        out.append((f"bf16 KV instead of {q.kv_dtype}", spec,
                    dataclasses.replace(q, kv_dtype="bf16")))
    return out


def _more_gpus(spec: ModelSpec, q: CPQuery, gpus: int) -> CPLayout | None:
    k = 2
    while k <= MAX_GPU_MULTIPLE:
        found = choose_layout(cp_layouts(spec, q, gpus * k))
        if found is not None:
            return found
        k *= 2
    return None


def replacements(spec: ModelSpec, q: CPQuery, gpus: int, lay: CPLayout) -> list[Option]:
    """Options in the order tried: fp8 KV on the same split (for a wider KV format), another
    split of the same GPUs, then 2x, 4x ... the GPUs (a larger CP degree: same KV format, then
    fp8). None: no layout of that kind fits."""
    wide = kv_format(q.kv_dtype).element_bytes > 1
    q8 = dataclasses.replace(q, kv_dtype="fp8")
    out: list[Option] = []
    if wide:
        out.append(("fp8 KV, same split", cp_layout(spec, q8, tp=lay.tp, cp=lay.cp)))
    out.append((f"another split of the {gpus} GPUs",
                choose_layout([x for x in cp_layouts(spec, q, gpus) if x.tp != lay.tp])))
    more = _more_gpus(spec, q, gpus)
    out.append(("more GPUs (larger CP)", more))
    if more is None and wide:
        out.append(("fp8 KV and more GPUs", _more_gpus(spec, q8, gpus)))
    return out


def first_fit(options: Sequence[Option], gpus: int) -> str:
    """The first option that fits, in words."""
    for how, x in options:
        if x is not None and x.fits:
            where = "" if x.gpus == gpus else f" on {x.gpus} GPUs"
            return f"{how}: {x.name}{where} ({fmt_bytes(x.need_bytes)} per GPU)"
    return f"nothing up to {gpus * MAX_GPU_MULTIPLE} GPUs"
