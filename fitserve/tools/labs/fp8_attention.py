"""FP8 attention, simulated: ``O = softmax(Q K^T / sqrt(d)) V`` with FP8 (or a low-precision
accumulator) at each of its three quantization points, each against a float64 reference.

    Q [Tq, d] --+                      (a) Q, K cast to fp8         S = Q K^T / sqrt(d)
                +-- S --softmax-- P    (b) P cast to fp8            O = P V
    K [Tk, d] --+                 |    (c) the accumulators of Q K^T (over d) and P V (over Tk)
    V [Tk, d] --------------------+--> O

(a) Q/K with outlier channels. FP8 is floating point: a per-tensor scale does NOT crush the
    small channels the way int8's does (e4m3 keeps 3 mantissa bits down to 2^-6 of its max,
    2^14.8 of dynamic range; in the seeded case < 0.2% of K's entries fall below it). The error
    is the outliers' own: each fp8 product carries ~2^-4 relative error, and the outlier
    channels' products are the big ones, so the logits' noise scales with the outliers.
    Per-channel K / per-token Q scales leave that unchanged in fp8 (they fix int8, shown for
    contrast). The fixes: smooth K by its channel mean over the keys (exact for softmax:
    ``q . mean_k`` is one constant per query row; SageAttention), and a Hadamard rotation of Q
    and K (``(QH)(KH)^T = QK^T``, H orthonormal) that spreads what is left over all channels.
(b) P near zero. Softmax rows over thousands of keys are ~1/Tk each (2^-11 at 2k keys), below
    e4m3's smallest subnormal (2^-9): cast as is, most probabilities flush to 0 or to a
    coarse subnormal, and the mass lost biases O. Fix: scale each row by 448 / rowmax before
    the cast and undo it after the PV product (FlashAttention-3's P in [0, 1] times 448), or
    keep P in bf16/f16.
(c) The accumulators. A sum rounded to m significant bits after every addition drifts with
    the number of terms (and stagnates once terms fall below half an ulp of the running sum).
    Fixes: fp32 accumulators, or promotion every N_c = 128 terms of the low-precision partial
    sum into an fp32 accumulator (DeepSeek-V3; its H800 fp8 tensor cores keep ~14 bits).
    With d <= 128 the QK^T sum is one promotion interval, so promotion changes PV only.

Errors are relative Frobenius norms ``||O - O_ref|| / ||O_ref||`` with ``O_ref`` the float64
reference. ``report()`` prints the table for a seeded synthetic case.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from fitserve.quant.fp8 import FORMATS, fp8_max

QK_MODES = ("none", "tensor", "channel", "smooth", "hadamard", "smooth+hadamard")
QK_FORMATS = ("e4m3", "e5m2", "int8")
P_MODES = ("none", "raw", "row", "bf16", "f16")
POINTS = ("qk", "p", "acc")


@dataclass(frozen=True, slots=True)
class AttentionQuant:
    """Where the simulation quantizes. The default quantizes nothing (equals ``reference``).

    ``qk``: how Q and K are cast (QK_MODES); ``qk_format``: to what (QK_FORMATS).
    ``p``: how P is cast (P_MODES; "raw" and "row" are e4m3). ``qk_acc_bits`` /
    ``pv_acc_bits``: significant bits of the QK^T (over d) / PV (over Tk) accumulator, rounded
    to nearest after every addition (8 bf16, 11 f16, 14 H800 fp8 tensor core, 24 fp32; 0 =
    an exact float64 GEMM). ``promote_every``: N_c, add the low-precision partial sum into an
    fp32 accumulator every N_c terms and restart it (0 = never); both GEMMs.
    """

    qk: str = "none"
    qk_format: str = "e4m3"
    p: str = "none"
    qk_acc_bits: int = 0
    pv_acc_bits: int = 0
    promote_every: int = 0

    def __post_init__(self) -> None:
        if self.qk not in QK_MODES or self.qk_format not in QK_FORMATS or self.p not in P_MODES:
            raise ValueError(f"bad AttentionQuant {self}")
        bits_ok = all(0 <= b <= 52 for b in (self.qk_acc_bits, self.pv_acc_bits))
        if not bits_ok or self.promote_every < 0:
            raise ValueError(f"accumulator bits must be in [0, 52], promote_every >= 0: {self}")


@dataclass(frozen=True, slots=True)
class SimResult:
    """A simulated output (float64 ``[Tq, d]``) and its relative error vs the reference."""

    out: torch.Tensor
    error: float


@dataclass(frozen=True, slots=True)
class ReportRow:
    """One line of ``report()``: a problem and a fix, each error vs the float64 reference."""

    point: str
    problem: str
    fix: str
    error_without: float
    error_with: float

    @property
    def factor(self) -> float:
        """How many times smaller the error is with the fix."""
        return self.error_without / max(self.error_with, 1e-300)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """float64 ``softmax(q k^T / sqrt(d)) v``."""
    q, k, v = (t.to(torch.float64) for t in (q, k, v))
    p = torch.softmax(q @ k.T / math.sqrt(q.shape[-1]), dim=-1)
    return p @ v


def round_bits(x: torch.Tensor, bits: int) -> torch.Tensor:
    """float64 ``x`` rounded to nearest-even at ``bits`` significant bits (exponent range
    unbounded: no overflow or subnormals are modelled).

    NOTE: done on the float64 bit pattern (add half an ulp minus one plus the kept lsb, mask):
    equal to a cast for bits 8/11/24 (bf16/f16/f32) and ~100x faster than frexp/ldexp.
    """
    if bits <= 0 or bits >= 53:
        return x
    drop = 53 - bits
    ix = x.contiguous().view(torch.int64)
    lsb = (ix >> drop) & 1
    ix = (ix + ((1 << (drop - 1)) - 1) + lsb) & ~((1 << drop) - 1)
    return ix.view(torch.float64)


def hadamard(d: int) -> torch.Tensor:
    """The orthonormal Sylvester-Hadamard matrix ``H / sqrt(d)`` (float64), d a power of 2."""
    if d <= 0 or d & (d - 1):
        raise ValueError(f"a Sylvester Hadamard matrix needs a power of 2, got {d}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h / math.sqrt(d)


def fake_quant(x: torch.Tensor, fmt: str, scale: torch.Tensor) -> torch.Tensor:
    """``x`` quantized with ``scale`` (broadcast) and dequantized, float64: fp8 round-to-nearest
    (clamped to the format's max) or symmetric int8 (codes -127..127)."""
    x = x.to(torch.float64)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    if fmt == "int8":
        return torch.round(x / safe).clamp(-127, 127) * safe
    top = fp8_max(fmt)
    return (x / safe).clamp(-top, top).to(FORMATS[fmt]).to(torch.float64) * safe


def _top(fmt: str) -> float:
    return 127.0 if fmt == "int8" else fp8_max(fmt)


def quantize_qk(q: torch.Tensor, k: torch.Tensor, mode: str, fmt: str
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Q and K as ``mode`` casts them (dequantized float64); QK^T's softmax is unchanged by
    the transforms (rotation: exactly QK^T; K mean: a constant per row of S)."""
    if mode == "none":
        return q.to(torch.float64), k.to(torch.float64)
    q, k = q.to(torch.float64), k.to(torch.float64)
    if "smooth" in mode:
        k = k - k.mean(dim=0, keepdim=True)
    if "hadamard" in mode:
        h = hadamard(q.shape[-1])
        q, k = q @ h, k @ h
    top = _top(fmt)
    if mode == "channel":  # per-token Q (rows), per-channel K (columns)
        sq, sk = q.abs().amax(1, keepdim=True) / top, k.abs().amax(0, keepdim=True) / top
    else:
        sq, sk = q.abs().amax() / top, k.abs().amax() / top
    return fake_quant(q, fmt, sq), fake_quant(k, fmt, sk)


def quantize_p(p: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(P as cast, the per-row factor to multiply P V by afterwards), float64."""
    one = torch.ones(p.shape[0], 1, dtype=torch.float64)
    if mode == "none":
        return p, one
    if mode in ("bf16", "f16"):
        return p.to(torch.bfloat16 if mode == "bf16" else torch.float16).to(torch.float64), one
    if mode == "raw":
        return fake_quant(p, "e4m3", torch.ones(())), one
    rowmax = p.amax(dim=1, keepdim=True)
    up = fp8_max("e4m3") / rowmax
    return fake_quant(p * up, "e4m3", torch.ones(())), 1.0 / up


def accumulate_matmul(a: torch.Tensor, b: torch.Tensor, bits: int, promote_every: int = 0
                      ) -> torch.Tensor:
    """``a [M, T] @ b [T, N]`` summed term by term over T, the running sum rounded to ``bits``
    after every addition (products exact in float64); with ``promote_every`` = N_c the partial
    sum is added into an fp32 (24-bit) accumulator every N_c terms and restarted."""
    if bits == 0:
        return a @ b
    acc = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float64)
    high = torch.zeros_like(acc)
    for t in range(a.shape[1]):
        acc = round_bits(acc + a[:, t : t + 1] * b[t], bits)
        if promote_every and (t + 1) % promote_every == 0:
            high, acc = round_bits(high + acc, 24), torch.zeros_like(acc)
    return round_bits(high + acc, 24) if promote_every else acc


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: AttentionQuant
              ) -> torch.Tensor:
    """The simulated ``softmax(Q K^T / sqrt d) V`` (float64 ``[Tq, d]``) under ``cfg``.

    The softmax itself is exact (float64); V is not quantized (not one of the three points).
    """
    qq, kq = quantize_qk(q, k, cfg.qk, cfg.qk_format)
    s = accumulate_matmul(qq, kq.T, cfg.qk_acc_bits, cfg.promote_every) / math.sqrt(q.shape[-1])
    p, undo = quantize_p(torch.softmax(s, dim=-1), cfg.p)
    pv = accumulate_matmul(p, v.to(torch.float64), cfg.pv_acc_bits, cfg.promote_every)
    return pv * undo


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref||_F / ||ref||_F``."""
    return float((out - ref).norm() / ref.norm())


# (without fix, with fix) per point: the headline problem and its fix.
CASES: dict[str, tuple[AttentionQuant, AttentionQuant]] = {
    "qk": (AttentionQuant(qk="tensor"), AttentionQuant(qk="smooth+hadamard")),
    "p": (AttentionQuant(p="raw"), AttentionQuant(p="row")),
    "acc": (AttentionQuant(pv_acc_bits=8), AttentionQuant(pv_acc_bits=24)),
}


def simulate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, point: str, fix: bool
             ) -> SimResult:
    """One quantization point (``"qk"``, ``"p"`` or ``"acc"``) alone, without or with its fix
    (``CASES``); the error is vs the float64 reference."""
    if point not in CASES:
        raise ValueError(f"point must be one of {POINTS}, got {point!r}")
    out = attention(q, k, v, CASES[point][int(fix)])
    return SimResult(out, relative_error(out, reference(q, k, v)))


def synthetic_case(seed: int = 0, tq: int = 64, tk: int = 2048, d: int = 128,
                   outliers: tuple[int, ...] = (3, 17, 70, 101), q_outlier: float = 3.0,
                   k_offset: float = 30.0, k_noise: float = 2.0
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Seeded float64 (q [tq, d], k [tk, d], v [tk, d]), N(0, 1) entries, except K's outlier
    channels: ``k_offset`` (a sign per channel) + ``k_noise`` N(0, 1), as LLM keys' massive
    channels (a large, steady offset); Q's same channels times ``q_outlier``."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(tq, d, generator=g, dtype=torch.float64)
    k = torch.randn(tk, d, generator=g, dtype=torch.float64)
    v = torch.randn(tk, d, generator=g, dtype=torch.float64)
    idx = [c for c in outliers if c < d]
    signs = torch.where(torch.rand(len(idx), generator=g) < 0.5, -1.0, 1.0).to(torch.float64)
    q[:, idx] *= q_outlier
    k[:, idx] = k[:, idx] * k_noise + k_offset * signs
    return q, k, v


_QK = "Q/K, per-tensor scales, K outlier channels"
_REPORT: tuple[tuple[str, str, str, AttentionQuant, AttentionQuant], ...] = (
    ("qk", f"e4m3 {_QK}", "per-token Q, per-channel K scales",
     AttentionQuant(qk="tensor"), AttentionQuant(qk="channel")),
    ("qk", f"e4m3 {_QK}", "K minus its channel mean (softmax-exact)",
     AttentionQuant(qk="tensor"), AttentionQuant(qk="smooth")),
    ("qk", f"e4m3 {_QK}", "Hadamard rotation of Q and K",
     AttentionQuant(qk="tensor"), AttentionQuant(qk="hadamard")),
    ("qk", f"e4m3 {_QK}", "K mean + Hadamard rotation",
     AttentionQuant(qk="tensor"), AttentionQuant(qk="smooth+hadamard")),
    ("qk", "int8 Q/K, per-tensor scales (contrast)", "per-token Q, per-channel K scales",
     AttentionQuant(qk="tensor", qk_format="int8"), AttentionQuant(qk="channel", qk_format="int8")),
    ("p", "P cast to e4m3 as is", "rows scaled by 448 / rowmax, undone after PV",
     AttentionQuant(p="raw"), AttentionQuant(p="row")),
    ("p", "P cast to e4m3 as is", "P kept in bf16",
     AttentionQuant(p="raw"), AttentionQuant(p="bf16")),
    ("acc", "QK^T in bf16 accumulators (8 bits, per add)", "fp32 accumulators",
     AttentionQuant(qk_acc_bits=8), AttentionQuant(qk_acc_bits=24)),
    ("acc", "PV in bf16 accumulators (8 bits, per add)", "fp32 accumulators",
     AttentionQuant(pv_acc_bits=8), AttentionQuant(pv_acc_bits=24)),
    ("acc", "PV in bf16 accumulators (8 bits, per add)", "promote to fp32 every 128",
     AttentionQuant(pv_acc_bits=8), AttentionQuant(pv_acc_bits=8, promote_every=128)),
    ("acc", "PV in 14-bit accumulators (H800 fp8 MMA)", "promote to fp32 every 128 (DS-V3)",
     AttentionQuant(pv_acc_bits=14), AttentionQuant(pv_acc_bits=14, promote_every=128)),
)


def report(seed: int = 0, tq: int = 64, tk: int = 2048, d: int = 128) -> list[ReportRow]:
    """The table of (point, problem, fix, error without, error with) on ``synthetic_case``."""
    q, k, v = synthetic_case(seed, tq, tk, d)
    ref = reference(q, k, v)
    errors: dict[AttentionQuant, float] = {}

    def err(cfg: AttentionQuant) -> float:
        if cfg not in errors:
            errors[cfg] = relative_error(attention(q, k, v, cfg), ref)
        return errors[cfg]

    return [ReportRow(point, problem, fix, err(a), err(b))
            for point, problem, fix, a, b in _REPORT]


def accumulator_drift(tks: tuple[int, ...] = (256, 1024, 4096), bits: int = 8, seed: int = 0,
                      tq: int = 8, d: int = 64) -> list[tuple[int, float, float]]:
    """(Tk, error with a ``bits``-bit PV accumulator, error with promotion every 128) per
    length: the low-precision error grows with the sequence, the promoted one much less."""
    out = []
    for tk in tks:
        q, k, v = synthetic_case(seed, tq, tk, d)
        ref = reference(q, k, v)
        low = attention(q, k, v, AttentionQuant(pv_acc_bits=bits))
        prom = attention(q, k, v, replace(AttentionQuant(pv_acc_bits=bits), promote_every=128))
        out.append((tk, relative_error(low, ref), relative_error(prom, ref)))
    return out


def format_report(rows: list[ReportRow]) -> str:
    """The report as a fixed-width text table."""
    head = f"{'point':<5} {'problem':<48} {'fix':<46} {'without':>9} {'with':>9} {'x':>7}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.point:<5} {r.problem:<48} {r.fix:<46} {r.error_without:>9.2e} "
                     f"{r.error_with:>9.2e} {r.factor:>7.1f}")
    return "\n".join(lines)
