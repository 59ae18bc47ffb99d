"""The one place that runs a weight in its stored format: packed int4/int8 linear layers and
the packed embedding, each choosing a kernel per ISA and batch size from a measured table.

    PackedLinear(pw)(x [..., K]) -> [..., N]      x float32 or bfloat16; y in x's dtype
    PackedEmbedding(pw, dtype)(ids [T]) -> [T, K] gather the packed rows, dequantize only them

Kernels (``CANDIDATES``; each says for which weights it applies):

    cpp        torch.ops.fitserve.int4_linear / int8_linear, act_quant=False (dequantize in
               registers, fp32 FMA; exact up to fp32 sums)           [fitserve/kernels/cpu]
    cpp-aq     the same ops with act_quant=True (x quantized to int8 per 32 columns, integer
               dot products; llama.cpp's Q8 activations)
    aten-int8  torch.ops.aten._weight_int8pack_mm, per-channel int8 only (scales cast to x's
               dtype: a bf16 scale is the f16 one rounded to 8 bits)
    aten-int4  torch.ops.aten._weight_int4pack_mm_for_cpu (needs its own weight layout, built
               on first use and cached: a second copy, so it is never in the table below)
    torch      dequantize (float32 math) in row chunks to x's dtype + F.linear: always correct

The choice is ``RULES[(isa, layout, shape class, dtype)]``: an ordered preference list, the
first candidate that is available and applies is used (``torch`` ends every list). Shape
classes by rows M of x: "m1" (decode of one sequence), "m<=16", "m<=256" and "prefill"
(more).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fitserve.quant.held import DenseWeight
from fitserve.quant.packed import CODES, PackedCodes, PackedWeight, dequantize_rows, gather_rows

# Rows of the weight dequantized at once by the pure-torch path: bounds its scratch to
# ~1M elements (4 MiB of fp32) whatever the layer (the tied lm_head is 49152 x 576).
_TORCH_CHUNK_ELEMENTS = 1 << 20


def shape_class(m: int) -> str:
    """"m1", "m<=16", "m<=256" or "prefill": the rows of x the kernel table is keyed by.

    NOTE: a fourth class past 256 rows: the measured crossover where dequantizing to bf16 and
    torch's AMX GEMM overtakes the packed kernels lies between M = 128 and M = 512.
    """
    if m == 1:
        return "m1"
    return "m<=16" if m <= 16 else ("m<=256" if m <= 256 else "prefill")


def layout_key(pw: PackedWeight) -> str:
    """"int4-asym", "int4-sym", "int8-group" or "int8-channel"."""
    if pw.kind == "int4":
        return "int4-sym" if pw.symmetric else "int4-asym"
    return "int8-channel" if pw.per_channel else "int8-group"


# -- candidates ------------------------------------------------------------------------------
@functools.cache
def cpp_ops_available() -> bool:
    """Whether fitserve's C++ int4/int8 linear ops are built and loaded."""
    try:
        from fitserve.kernels.cpu import qlinear
    except ImportError:
        return False
    try:
        return bool(qlinear.qlinear_ops_available())
    except Exception:  # a broken build counts as absent: the pure-torch path runs
        return False


def _pad(x: torch.Tensor, width: int) -> torch.Tensor:
    return x if x.shape[1] == width else F.pad(x, (0, width - x.shape[1]))


def run_torch(pw: PackedWeight, x: torch.Tensor, cache: dict[str, torch.Tensor]) -> torch.Tensor:
    """Dequantize row chunks (float32 math) to x's dtype and F.linear: the reference path."""
    rows = max(1, _TORCH_CHUNK_ELEMENTS // pw.K_padded)
    outs = []
    for r0 in range(0, pw.N, rows):
        r1 = min(pw.N, r0 + rows)
        codes = pw.codes
        mins = None if pw.mins is None else pw.mins[r0:r1]
        w = codes.dequantize(codes.unpack(pw.qweight[r0:r1], pw.group_size), pw.scales[r0:r1],
                             mins, pw.group_size)
        outs.append(F.linear(x, w[:, : pw.K].to(x.dtype)))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def _run_cpp(act_quant: bool, invariant: bool = False
             ) -> Callable[[PackedWeight, torch.Tensor, dict[str, torch.Tensor]], torch.Tensor]:
    def run(pw: PackedWeight, x: torch.Tensor, cache: dict[str, torch.Tensor]) -> torch.Tensor:
        from fitserve.kernels.cpu import qlinear

        xp = _pad(x.contiguous(), pw.K_padded)
        if pw.codes.bits == 4:  # the int4 op takes the f16 mins (None: symmetric)
            out: torch.Tensor = qlinear.int4_linear(xp, pw.qweight, pw.scales, pw.mins,
                                                    pw.group_size, act_quant, invariant)
        else:
            out = qlinear.int8_linear(xp, pw.qweight, pw.scales, pw.group_size, act_quant,
                                      invariant)
        return out

    return run


def run_aten_int8(pw: PackedWeight, x: torch.Tensor, cache: dict[str, torch.Tensor]) -> torch.Tensor:
    """torch's weight-only int8 GEMM (per output channel)."""
    key = f"aten-int8-scales-{x.dtype}"
    if key not in cache:  # N values: the f16 scales in x's dtype (tiny, kept)
        cache[key] = pw.scales.reshape(-1).to(x.dtype)
    xp = _pad(x.contiguous(), pw.K_padded)
    out: torch.Tensor = torch.ops.aten._weight_int8pack_mm(xp, pw.qweight, cache[key])
    return out


def run_aten_int4(pw: PackedWeight, x: torch.Tensor, cache: dict[str, torch.Tensor]) -> torch.Tensor:
    """torch's int4 GEMM for CPU: w = (q - 8) * scale + zero, zero = min + 8 * scale."""
    if "aten-int4-weight" not in cache:
        codes = pw.codes.unpack(pw.qweight, pw.group_size).to(torch.int32)
        cache["aten-int4-weight"] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
    key = f"aten-int4-sz-{x.dtype}"
    if key not in cache:
        s = pw.scales.to(torch.float32)
        zero = torch.zeros_like(s) if pw.mins is None else pw.mins.to(torch.float32) + 8 * s
        cache[key] = torch.stack((s.t(), zero.t()), dim=-1).to(x.dtype).contiguous()
    xp = _pad(x.contiguous(), pw.K_padded)
    out: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(
        xp, cache["aten-int4-weight"], pw.group_size, cache[key])
    return out


@dataclass(frozen=True, slots=True)
class Candidate:
    """A kernel: ``applies(pw, dtype)`` says whether it can run this weight for x of dtype."""

    name: str
    run: Callable[[PackedWeight, torch.Tensor, dict[str, torch.Tensor]], torch.Tensor]
    applies: Callable[[PackedWeight, torch.dtype], bool]


def _float_x(dtype: torch.dtype) -> bool:
    return dtype in (torch.float32, torch.bfloat16)


CANDIDATES: dict[str, Candidate] = {
    c.name: c
    for c in (
        Candidate("cpp", _run_cpp(False), lambda pw, dt: _float_x(dt) and cpp_ops_available()),
        Candidate("cpp-aq", _run_cpp(True), lambda pw, dt: _float_x(dt) and cpp_ops_available()),
        Candidate("aten-int8", run_aten_int8,
                  lambda pw, dt: _float_x(dt) and pw.per_channel and pw.K_padded % 32 == 0),
        Candidate("aten-int4", run_aten_int4,
                  lambda pw, dt: _float_x(dt) and pw.codes.bits == 4 and pw.N % 16 == 0
                  and pw.group_size in (32, 64, 128, 256)),
        Candidate("torch", run_torch, lambda pw, dt: True),
    )
}


def bind(cand: Candidate, pw: PackedWeight, cache: dict[str, torch.Tensor],
         invariant: bool = False) -> Callable[[torch.Tensor], torch.Tensor]:
    """``cand`` on ``pw`` as a call on x alone. The C++ kernels become a direct op call (no
    Python wrapper, no checks the op repeats itself) when x needs no column padding.
    ``invariant``: the weight-only op keeps one summation order for every M (batch_invariant)."""
    inv = invariant and cand.name == "cpp"
    if cand.name in ("cpp", "cpp-aq") and pw.K_padded == pw.K and cpp_ops_available():
        aq = cand.name == "cpp-aq"
        q, s, mn, g = pw.qweight, pw.scales, pw.mins, pw.group_size
        if pw.codes.bits == 4:
            op4 = torch.ops.fitserve.int4_linear.default
            return lambda x: op4(x.contiguous(), q, s, mn, g, aq, inv)
        op8 = torch.ops.fitserve.int8_linear.default
        return lambda x: op8(x.contiguous(), q, s, g, aq, inv)
    run = _run_cpp(False, True) if inv else cand.run
    return lambda x: run(pw, x, cache)

# -- the measured table ----------------------------------------------------------------------
# NOTE: measured with benchmarks/bench_linear.py; the runs behind each table:
# docs/benchmarks.md, section 'Packed linear kernel table'.
_ANY = "*"
_Table = dict[str, tuple[str, ...]]  # shape class -> preference (before the closing "torch")
BF16_TABLES: dict[str, dict[str, _Table]] = {  # ISA key -> layout -> table
    "avx512_vnni+amx": {
        "int4": {"m1": ("cpp-aq", "aten-int4", "cpp"), "m<=16": ("cpp-aq", "aten-int4", "cpp"),
                 "m<=256": ("cpp-aq", "cpp"), "prefill": ("cpp-aq", "torch", "cpp")},
        "int8-channel": {"m1": ("cpp-aq", "aten-int8", "cpp"),
                         "m<=16": ("cpp-aq", "aten-int8", "cpp"),
                         "m<=256": ("cpp-aq", "torch", "cpp"), "prefill": ("torch", "cpp-aq")},
        "int8-group": {"m1": ("cpp-aq", "cpp"), "m<=16": ("cpp-aq", "cpp"),
                       "m<=256": ("cpp-aq", "torch", "cpp"), "prefill": ("torch", "cpp-aq")},
    },
    "avx512_vnni": {
        "int4": {"m1": ("cpp-aq", "aten-int4", "cpp"), "m<=16": ("cpp-aq", "aten-int4", "cpp"),
                 "m<=256": ("cpp-aq", "aten-int4", "cpp"), "prefill": ("cpp-aq", "torch", "cpp")},
        "int8-channel": {"m1": ("cpp-aq", "aten-int8", "cpp"),
                         "m<=16": ("cpp-aq", "aten-int8", "cpp"),
                         "m<=256": ("cpp-aq", "torch", "cpp"), "prefill": ("torch", "cpp-aq")},
        "int8-group": {"m1": ("cpp-aq", "cpp"), "m<=16": ("cpp-aq", "cpp"),
                       "m<=256": ("cpp-aq", "torch", "cpp"), "prefill": ("cpp-aq", "torch")},
    },
    "avx2": {
        "int4": {"m1": ("cpp-aq", "cpp", "aten-int4"), "m<=16": ("cpp-aq", "aten-int4", "cpp"),
                 "m<=256": ("cpp-aq", "cpp"), "prefill": ("cpp-aq", "cpp")},
        "int8-channel": {"m1": ("cpp-aq", "cpp", "aten-int8"),
                         "m<=16": ("cpp-aq", "aten-int8", "cpp"),
                         "m<=256": ("cpp-aq", "cpp"), "prefill": ("cpp-aq", "cpp")},
        "int8-group": {"m1": ("cpp-aq", "cpp"), "m<=16": ("cpp-aq", "cpp"),
                       "m<=256": ("cpp-aq", "cpp"), "prefill": ("cpp-aq", "cpp")},
    },
}
_LAYOUT_TABLE = {"int4-asym": "int4", "int4-sym": "int4", "int8-channel": "int8-channel",
                 "int8-group": "int8-group"}
RULES: dict[tuple[str, str, str, str], tuple[str, ...]] = {
    (_ANY, _ANY, _ANY, _ANY): ("cpp", "torch"),
    **{(isa, layout, m, "bf16"): (*prefs, "torch")
       for isa, tables in BF16_TABLES.items()
       for layout, table_name in _LAYOUT_TABLE.items()
       for m, prefs in tables[table_name].items()},
}


def isa_key() -> str:
    """The ISA the table is keyed by: the C++ kernel tier, plus "+amx" where bf16 AMX exists."""
    from fitserve.kernels.cpu.isa import build_tier, detect_isa

    isa = detect_isa()  # the tier the kernels were compiled for (FITSERVE_CPU_TIER may lower it)
    return build_tier(isa) + ("+amx" if isa.amx_bf16 else "")


def dtype_key(dtype: torch.dtype) -> str:
    return {torch.float32: "f32", torch.bfloat16: "bf16"}.get(dtype, str(dtype))


def preference(isa: str, layout: str, m_class: str, dtype: str) -> tuple[str, ...]:
    """The table's preference list, most specific match first (exact beats "*")."""
    best: tuple[int, tuple[str, ...]] = (-1, ("torch",))
    for (ri, rl, rm, rd), prefs in RULES.items():
        keys = ((ri, isa), (rl, layout), (rm, m_class), (rd, dtype))
        if all(r in (_ANY, v) for r, v in keys):
            score = sum(r != _ANY for r, _ in keys)
            if score > best[0]:
                best = (score, prefs)
    return best[1]


def choose(pw: PackedWeight, m: int, dtype: torch.dtype, isa: str | None = None,
           act_quant: bool | None = None) -> Candidate:
    """The kernel the table picks for this weight and x of ``m`` rows and ``dtype``.

    ``act_quant`` (--activation-quant): None = the table as measured; True = the int8-activation
    kernel for every M ("cpp-aq"), False = the weight-only one ("cpp"). NOTE: one kernel for
    every M is what keeps a row's result independent of the batch (qlinear_rows.h); the
    pure-torch path stays the fallback where the C++ ops are unavailable.
    """
    if act_quant is not None:
        prefs: tuple[str, ...] = ("cpp-aq",) if act_quant else ("cpp",)
    else:
        prefs = preference(isa or isa_key(), layout_key(pw), shape_class(m), dtype_key(dtype))
    for name in (*prefs, "torch"):
        cand = CANDIDATES[name]
        if cand.applies(pw, dtype):
            return cand
    raise AssertionError("unreachable: the torch path always applies")


# -- modules ---------------------------------------------------------------------------------
_GEMV_PREFERRED: list[bool] = []  # set once (a plain list: torch.compile traces through it)


def bf16_gemv_preferred() -> bool:
    """Whether one-row bf16 dense linears run fitserve_dense::bf16_gemv on this CPU."""
    if not _GEMV_PREFERRED:  # (FITSERVE_DISABLE_CPP: the extension does not load -> False)
        from fitserve.kernels.cpu.dense_gemv import bf16_gemv_preferred as preferred

        _GEMV_PREFERRED.append(preferred())
    return _GEMV_PREFERRED[0]


class DenseLinear(nn.Linear):
    """nn.Linear whose one-row bf16 calls on CPU run fitserve_dense::bf16_gemv where that is
    the faster kernel (fitserve/kernels/cpu/dense_gemv.py); every other call is F.linear."""

    def gemv_applies(self, rows: int, dtype: torch.dtype) -> bool:
        w, b = self.weight, self.bias
        return (rows == 1 and dtype == torch.bfloat16 and w.dtype == torch.bfloat16
                and w.device.type == "cpu" and w.dim() == 2 and w.is_contiguous()
                and (b is None or (b.dtype == torch.bfloat16 and b.is_contiguous()))
                and bf16_gemv_preferred())

    @classmethod
    def from_held(cls, w: DenseWeight, bias: torch.Tensor | None, dtype: torch.dtype
                  ) -> DenseLinear:
        """A linear over ``w`` cast to ``dtype`` (no copy when it already is), no random init."""
        with torch.device("meta"):
            lin = cls(w.in_features, w.out_features, bias=bias is not None)
        lin.weight = nn.Parameter(w.tensor.to(dtype), requires_grad=False)
        if bias is not None:
            lin.bias = nn.Parameter(bias.to(dtype), requires_grad=False)
        return lin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and self.gemv_applies(x.shape[0], x.dtype):
            out: torch.Tensor = torch.ops.fitserve_dense.bf16_gemv.default(x, self.weight, self.bias)
            return out
        return F.linear(x, self.weight, self.bias)


class PackedLinear(nn.Module):
    """``y = x @ W.T (+ bias)`` with W held packed (buffers ``qweight``, ``scales``, ``mins``).

    The kernel is chosen per call from the measured table (cached per M class and dtype).
    ``prepack()`` (the loader calls it for the projections) adds buffer ``panels``: the same
    weight laid out once for the M > 1 panel kernels (fitserve.kernels.cpu.qlinear.prepack):
    the codes again + fp32 scales (int4: + fp32 offsets), which the ledger counts
    (``fitserve.ledger.weights.panel_bytes``).
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    panels: torch.Tensor | None

    def __init__(self, pw: PackedWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.kind, self.group_size = pw.kind, pw.group_size
        self.in_features, self.out_features, self.k_padded = pw.K, pw.N, pw.K_padded
        self.register_buffer("qweight", pw.qweight)
        self.register_buffer("scales", pw.scales)
        self.register_buffer("mins", pw.mins)
        # derived from the three above, so not in the state dict
        self.register_buffer("panels", None, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self._cache: dict[str, torch.Tensor] = {}
        self._chosen: dict[tuple[str, torch.dtype], Candidate] = {}
        # (shape class, dtype) -> x2 [M, K] -> y [M, N]: the chosen kernel with this weight's
        # tensors bound, so a decode step pays one lookup and the op call per linear
        self._runs: dict[tuple[str, torch.dtype], Callable[[torch.Tensor], torch.Tensor]] = {}
        self._force: str | None = None
        self._act_quant: bool | None = None
        # the buffers hold the weight as panels (hold_panels), and this records its row shape
        self._held_shape: PackedWeight | None = None

    @property
    def act_quant(self) -> bool | None:
        """int8 activations (True), weight-only (False), or None: the measured table."""
        return self._act_quant

    @act_quant.setter
    def act_quant(self, value: bool | None) -> None:
        if value is not True and self.held_panels:
            self.hold_rows()  # only the int8-activation kernels read the panels
        self._act_quant = value
        self._chosen.clear()
        self._runs.clear()

    @property
    def held_panels(self) -> bool:
        """Whether the buffers hold the weight as panels (``hold_panels``), not row-major."""
        return self._held_shape is not None

    def hold_panels(self) -> bool:
        """Hold the weight in the panel kernels' layout instead of row-major (the same bytes,
        one copy: fitserve.kernels.cpu.qlinear.hold), so every M reads it as it is and the
        batch-1 GEMV streams it in order. Only where the int8-activation op runs every call
        (``act_quant`` True), on the CPU, with N a multiple of the panel rows; False otherwise.
        The results are the same bits as from the row-major weight."""
        if (self.held_panels or self._act_quant is not True or self.qweight.device.type != "cpu"
                or not cpp_ops_available()):
            return False
        from fitserve.kernels.cpu import qlinear

        if self.out_features % qlinear.held_layout().lanes:
            return False
        shape = self.packed
        q, s, mn = qlinear.hold(self.qweight, self.scales, self.mins, self.group_size)
        self._held_shape = PackedWeight(shape.kind, shape.N, shape.K, shape.K_padded,
                                        shape.group_size, shape.qweight.to("meta"),
                                        shape.scales.to("meta"),
                                        None if shape.mins is None else shape.mins.to("meta"))
        self.qweight, self.scales, self.mins, self.panels = q, s, mn, None
        self._chosen.clear()
        self._runs.clear()
        return True

    def hold_rows(self) -> None:
        """Back to the row-major buffers (undoes ``hold_panels``)."""
        if not self.held_panels:
            return
        from fitserve.kernels.cpu import qlinear

        self.qweight, self.scales, self.mins = qlinear.rows_of_held(self.qweight, self.scales,
                                                                    self.mins)
        self._held_shape = None
        self._chosen.clear()
        self._runs.clear()

    @property
    def force(self) -> str | None:
        """Run one candidate by name whatever the table says (tests, benchmarks); None: the table."""
        return self._force

    @force.setter
    def force(self, name: str | None) -> None:
        self._force = name
        self._runs.clear()

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> PackedLinear:
        self._runs.clear()  # .to(device) swaps the buffers the bound calls hold
        self._cache.clear()
        had_panels = self.panels is not None
        out: PackedLinear = super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        if self.held_panels and self.qweight.device.type != "cpu":
            self.hold_rows()  # the panels are the CPU kernels' layout
        if had_panels:  # made again for the tensors now held (or dropped off the CPU)
            self.panels = None
            self.prepack()
        return out

    def prepack(self) -> bool:
        """Lay the weight out once for the M > 1 panel kernels (buffer ``panels``); False
        where they do not run (no C++ ops, not on the CPU)."""
        if self.held_panels or self.qweight.device.type != "cpu" or not cpp_ops_available():
            return False
        from fitserve.kernels.cpu import qlinear

        self.panels = qlinear.prepack(self.qweight, self.scales, self.mins, self.group_size)
        return True

    @property
    def codes(self) -> PackedCodes:
        """The codes' packing (int4 or int8)."""
        return CODES[self.kind]

    @property
    def packed(self) -> PackedWeight:
        """The weight as a row-major PackedWeight over this module's buffers (no copy; a weight
        held as panels: a row-major copy, for the paths that are not a decode step)."""
        if self.held_panels:
            from fitserve.kernels.cpu import qlinear

            q, s, mn = qlinear.rows_of_held(self.qweight, self.scales, self.mins)
            return PackedWeight(self.kind, self.out_features, self.in_features, self.k_padded,
                                self.group_size, q, s, mn)
        return PackedWeight(self.kind, self.out_features, self.in_features, self.k_padded,
                            self.group_size, self.qweight, self.scales, self.mins)

    def kernel(self, m: int, dtype: torch.dtype) -> Candidate:
        """The candidate a call with ``m`` rows of ``dtype`` runs."""
        if self._force is not None:
            return CANDIDATES[self._force]
        key = (shape_class(m), dtype)
        if key not in self._chosen:
            shape = self._held_shape or self.packed  # (the table reads only the shape)
            self._chosen[key] = choose(shape, m, dtype, act_quant=self._act_quant)
        return self._chosen[key]

    def bound_run(self, m: int, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
        """The kernel for ``m`` rows of ``dtype`` as a call on x2 [M, K] alone (made once)."""
        key = (shape_class(m), dtype)
        run = self._runs.get(key)
        if run is None:
            cand = self.kernel(m, dtype)
            if self.held_panels and cand.name == "cpp-aq":
                run = self._runs[key] = bind_held(self)
            else:
                # NOTE: an explicit --activation-quant asks for one kernel and one order for
                # every M (a weight held as panels runs any other kernel on a row-major copy)
                run = self._runs[key] = bind(cand, self.packed, self._cache,
                                             invariant=self._act_quant is not None)
        return run

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        y = self.bound_run(x2.shape[0], x2.dtype)(x2)
        if self.bias is not None:
            y = y + self.bias
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        shape = self._held_shape or self.packed
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"format={shape.format}, bias={self.bias is not None}"
                + (", held as panels" if self.held_panels else ""))


def bind_held(mod: PackedLinear) -> Callable[[torch.Tensor], torch.Tensor]:
    """The int8-activation op on a weight held as panels, as a call on x2 [M, K] alone."""
    q, s, mn, g, kp = mod.qweight, mod.scales, mod.mins, mod.group_size, mod.k_padded
    pad = kp != mod.in_features
    if mod.kind == "int4":
        op4 = torch.ops.fitserve.int4_linear.default
        return lambda x: op4(_pad(x, kp).contiguous() if pad else x.contiguous(), q, s, mn, g,
                             True, False)
    op8 = torch.ops.fitserve.int8_linear.default
    return lambda x: op8(_pad(x, kp).contiguous() if pad else x.contiguous(), q, s, g, True,
                         False)


def panels_apply(name: str) -> bool:
    """Whether the PackedLinear at module path ``name`` is prepacked: the projections, not the
    lm_head (one row per sequence at a time) nor the experts (the grouped expert kernels read
    their own layout). The ledger applies the same rule to tensor names."""
    return name.split(".")[-1] != "lm_head" and ".experts." not in f".{name}."


def holds_panels(model: nn.Module) -> bool:
    """Whether any PackedLinear of ``model`` holds prepacked panels (the ledger's ``panels``)."""
    return any(type(m) is PackedLinear and m.panels is not None for m in model.modules())


def hold_linears_as_panels(model: nn.Module) -> str:
    """``hold_panels()`` every PackedLinear of ``model`` that runs int8 activations, except the
    experts (their own kernels); a tied lm_head's embedding then gathers its rows from the same
    panels (one copy). Returns a one-line summary (FITSERVE_HOLD_PANELS=0: none)."""
    from fitserve import envs

    if not envs.FITSERVE_HOLD_PANELS():
        return "packed weights: row-major (FITSERVE_HOLD_PANELS=0)"
    tied = {m.qweight.data_ptr(): m for m in model.modules() if isinstance(m, PackedEmbedding)}
    mods = [(name, m) for name, m in model.named_modules() if type(m) is PackedLinear]
    n = 0
    for name, mod in mods:
        emb = tied.get(mod.qweight.data_ptr())
        if ".experts." in f".{name}." or not mod.hold_panels():
            continue
        n += 1
        if emb is not None:  # the tied lm_head: its embedding gathers rows from the panels
            emb.share_held(mod)
    tiles = ""
    if n:
        from fitserve.kernels.cpu.qlinear import amx_active

        tiles = "; AMX-INT8 tiles from 32 rows of x" if amx_active() else ""
    return f"packed weights: {n} of {len(mods)} packed linears held as panels (one copy){tiles}"


def prepack_linears(model: nn.Module) -> int:
    """``prepack()`` every PackedLinear of ``model`` that ``panels_apply``; how many were
    (none with FITSERVE_PREPACK_PANELS=0)."""
    from fitserve import envs

    if not envs.FITSERVE_PREPACK_PANELS():
        return 0
    return sum(mod.prepack() for name, mod in model.named_modules()
               if type(mod) is PackedLinear and panels_apply(name))


class PackedEmbedding(nn.Module):
    """Token embedding held packed: gather the rows of ``ids``, then dequantize only them.

    ``tied_linear()`` returns the lm_head over the SAME buffers (no second copy).
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None

    def __init__(self, pw: PackedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.kind, self.group_size = pw.kind, pw.group_size
        self.num_embeddings, self.embedding_dim, self.k_padded = pw.N, pw.K, pw.K_padded
        self.dtype = dtype
        self.register_buffer("qweight", pw.qweight)
        self.register_buffer("scales", pw.scales)
        self.register_buffer("mins", pw.mins)
        self._packed = pw

    @property
    def packed(self) -> PackedWeight:
        # made again only when a buffer was replaced (.to(), load_state_dict): building and
        # checking a PackedWeight per decode step cost more than gathering the token's row
        pw = self._packed
        if pw.qweight is not self.qweight or pw.scales is not self.scales or pw.mins is not self.mins:
            pw = self._packed = PackedWeight(self.kind, self.num_embeddings, self.embedding_dim,
                                             self.k_padded, self.group_size, self.qweight,
                                             self.scales, self.mins)
        return pw

    @property
    def held_panels(self) -> bool:
        """Whether the buffers are its tied lm_head's panels (``share_held``), not row-major."""
        return self.scales.dim() == 3

    def share_held(self, head: PackedLinear) -> None:
        """Take the tied lm_head's buffers after it was held as panels (one copy stays)."""
        self.qweight, self.scales, self.mins = head.qweight, head.scales, head.mins

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        if self.held_panels:
            from fitserve.kernels.cpu import qlinear

            if self.dtype in (torch.float32, torch.bfloat16, torch.float16):
                # NOTE: one C++ call, the same bits as the torch ops below (~54 us a decode
                # step on the default model's tied Q8_0 / Q4_1 panels, a few us there)
                return qlinear.held_rows(self.qweight, self.scales, self.mins, ids,
                                         self.group_size, self.embedding_dim, self.dtype)
            q, s, mn = qlinear.gather_held_rows(self.qweight, self.scales, self.mins, flat)
            # NOTE: the gathered rows dequantized as they are (no index_select copies and no
            # PackedWeight's checks, as gather_rows would: ~25 of ~56 us a decode step)
            w = dequantize_rows(self.kind, self.embedding_dim, self.group_size, q, s, mn,
                                self.dtype)
            return w.reshape(*ids.shape, self.embedding_dim)
        return gather_rows(self.packed, flat, self.dtype).reshape(*ids.shape, self.embedding_dim)

    def tied_linear(self) -> PackedLinear:
        """A PackedLinear (the tied lm_head) whose buffers are this embedding's tensors."""
        return PackedLinear(self.packed)

    def extra_repr(self) -> str:
        if self.held_panels:
            return f"{self.num_embeddings}, {self.embedding_dim}, held as its lm_head's panels"
        return f"{self.num_embeddings}, {self.embedding_dim}, format={self.packed.format}"


class ConcatLinear(nn.Module):
    """Linear layers over one input with their outputs concatenated: a fused projection (q/k/v,
    gate/up) whose parts are held in formats that cannot be stacked into one tensor."""

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


def set_activation_quant(model: nn.Module, choice: str, dtype: torch.dtype) -> str:
    """Apply --activation-quant to every PackedLinear of ``model`` (the tied lm_head included);
    returns the one-line summary of what packed weights compute in."""
    act = {"int8": True, "none": False}.get(choice, dtype == torch.bfloat16)
    n = 0
    for mod in model.modules():
        if isinstance(mod, PackedLinear):
            mod.act_quant = act
            n += 1
    if not n:
        return f"activations: {dtype_key(dtype)} (no packed int4/int8 weights)"
    if act:
        return (f"activations: int8 per 32 columns for the {n} packed int4/int8 linears "
                f"(W4A8/W8A8, --activation-quant int8), {dtype_key(dtype)} elsewhere")
    return (f"activations: {dtype_key(dtype)} for the {n} packed int4/int8 linears (weight-only, "
            f"W4A16/W8A16, --activation-quant none)")
