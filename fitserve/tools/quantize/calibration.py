"""Calibration statistics for GPTQ / AWQ: what each linear layer sees on a calibration text.

    ids = calibration_token_ids(read_calibration_text("calib.txt"), tokenizer, max_tokens=512)
    stats = collect_linear_stats(model, spec, ids)     # HF weight name -> LinearStats
    stats["model.layers.0.self_attn.q_proj.weight"].hessian     # float64 [K, K] = sum x^T x

The texts run through ``fitserve.runner.teacher_forcing.score_chunks`` (the engine's own paged prefill) with
forward pre-hooks on the dense linear modules; q/k/v read the input of the fused ``qkv_proj``,
so they share one LinearStats object, as gate/up share ``gate_up_proj``'s. The statistics are
of the *unquantized* model, all layers in one pass (non-sequential: see fitserve.tools.quantize.gptq).

``calibration_shift`` runs the experiment "calibrate on one kind of text, serve another": the
KL of RTN / GPTQ / AWQ models against the float model on every (calibration, evaluation) pair::

    loaded = load_model("smollm2-135m", torch.float32)
    kl = calibration_shift(loaded.spec, loaded.weights, loaded.tokenizer,
                           {"code": code_text, "prose": prose_text}, bits=4, group_size=128)
    print(format_shift(kl))       # KL per method x calibration x evaluation, and the ratios
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from fitserve.tools.quantize.stats import LinearStats

if TYPE_CHECKING:
    from fitserve.config import ModelSpec
    from fitserve.model.llama import CausalLM

METHODS = ("rtn", "gptq", "awq")
# the linears of one decoder layer whose inputs are recorded: module path -> HF weight names
_LINEARS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}


class _Accumulator:
    """Running sums of one module's inputs, and the rows at the chosen sample positions."""

    def __init__(self, k: int, sample_at: torch.Tensor) -> None:
        self.hessian = torch.zeros(k, k, dtype=torch.float64)
        self.abs_sum = torch.zeros(k, dtype=torch.float64)
        self.rows = 0
        self.sample_at = sample_at
        self.sample: list[torch.Tensor] = []

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        # NOTE: each chunk's x^T x is a float32 GEMM (a 256-row sum: ~1e-6 relative error, far
        # below GPTQ's 1% dampening) added into the float64 total; a float64 GEMM per chunk
        # would cost as much as the model's forward pass.
        self.hessian += (x.T @ x).double()
        self.abs_sum += x.abs().sum(0).double()
        lo, hi = self.rows, self.rows + x.shape[0]
        at = self.sample_at[(self.sample_at >= lo) & (self.sample_at < hi)] - lo
        if at.numel():
            self.sample.append(x[at].clone())
        self.rows = hi

    def stats(self) -> LinearStats:
        k = self.hessian.shape[0]
        sample = torch.cat(self.sample) if self.sample else torch.zeros(0, k)
        return LinearStats(self.hessian, self.rows, (self.abs_sum / max(self.rows, 1)).float(),
                           sample)


def _dense_modules(model: CausalLM) -> dict[str, nn.Linear]:
    """Module path -> nn.Linear for every recorded linear; ValueError if one is not dense."""
    from fitserve.model.linear import DenseLinear

    found: dict[str, nn.Linear] = {}
    for i, layer in enumerate(model.layers):
        for path in _LINEARS:
            module = layer.get_submodule(path)
            if type(module) not in (nn.Linear, DenseLinear):  # dense weights, any kernel
                raise ValueError(f"calibration needs a dense model: layers.{i}.{path} is a "
                                 f"{type(module).__name__}, not nn.Linear (load the model "
                                 "with float weights)")
            found[f"model.layers.{i}.{path}"] = module
    return found


def sample_positions(total_rows: int, max_sample_rows: int) -> torch.Tensor:
    """Row indices (into all calibration rows, in order) kept for ``LinearStats.sample``:
    evenly spaced over the whole set, all rows when there are no more than ``max_sample_rows``."""
    if total_rows <= max_sample_rows:
        return torch.arange(total_rows)
    return torch.linspace(0, total_rows - 1, max_sample_rows).round().long()


def collect_linear_stats(model: CausalLM, spec: ModelSpec, token_ids: list[list[int]], *,
                         max_sample_rows: int = 512, chunk_size: int = 256
                         ) -> dict[str, LinearStats]:
    """Run ``token_ids`` (texts, each within the model's positions) through the dense model and
    return every decoder linear's input statistics keyed by HF weight name
    (``model.layers.{i}.self_attn.q_proj.weight`` ...; q/k/v share one object, gate/up too).

    Raises ValueError for a model with packed linears or an empty calibration set.
    """
    from fitserve.runner.teacher_forcing import score_chunks

    if not token_ids or not any(token_ids):
        raise ValueError("the calibration set has no tokens")
    modules = _dense_modules(model)
    at = sample_positions(sum(len(t) for t in token_ids), max_sample_rows)
    accs = {path: _Accumulator(m.in_features, at) for path, m in modules.items()}
    hooks = [m.register_forward_pre_hook(lambda _m, args, acc=accs[p]: acc.add(args[0]))
             for p, m in modules.items()]
    try:
        for ids in token_ids:
            if ids:
                for _ in score_chunks(model, spec, ids, chunk_size=chunk_size):
                    pass
    finally:
        for h in hooks:
            h.remove()
    out: dict[str, LinearStats] = {}
    for path, acc in accs.items():
        stats = acc.stats()
        layer, _, sub = path.rpartition(".layers.")[2].partition(".")
        for name in _LINEARS[sub]:
            out[f"model.layers.{layer}.{name}.weight"] = stats
    return out


def read_calibration_text(path: str | Path) -> str:
    """The UTF-8 text of a calibration file; ValueError if it is empty."""
    text = Path(path).read_text(encoding="utf-8")
    if not text.strip():
        raise ValueError(f"{path}: the calibration text is empty")
    return text


class _Encoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


def calibration_token_ids(text: str, tokenizer: _Encoder, *, max_tokens: int = 512,
                          max_pieces: int | None = None, min_tokens: int = 16
                          ) -> list[list[int]]:
    """Split ``text`` into consecutive pieces of at most ``max_tokens`` token ids, each starting
    with the tokenizer's BOS when it uses one (each piece runs as its own sequence).

    At most ``max_pieces`` pieces (the first ones); a last piece shorter than ``min_tokens`` is
    dropped unless it is the only one.
    """
    prefix = tokenizer.encode("", add_special_tokens=True)
    body = tokenizer.encode(text, add_special_tokens=False)
    step = max_tokens - len(prefix)
    if step <= 0:
        raise ValueError(f"max_tokens={max_tokens} leaves no room for text")
    pieces = [prefix + body[i:i + step] for i in range(0, len(body), step)]
    if len(pieces) > 1 and len(pieces[-1]) < min_tokens:
        pieces.pop()
    if not pieces:
        raise ValueError("the calibration text has no tokens")
    return pieces[:max_pieces] if max_pieces is not None else pieces


def linear_weight_names(spec: ModelSpec) -> list[str]:
    """HF names of the decoder linears that calibration covers (what the methods quantize)."""
    return [f"model.layers.{i}.{name}.weight" for i in range(spec.num_layers)
            for names in _LINEARS.values() for name in names]


def mean_token_kl(ref_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """Mean over positions of KL(ref || other) of the next-token distributions (nats)."""
    ref = torch.log_softmax(ref_logits.double(), -1)
    other = torch.log_softmax(logits.double(), -1)
    return float((ref.exp() * (ref - other)).sum(-1).mean())


def quantized_weights(method: str, weights: dict[str, torch.Tensor], spec: ModelSpec,
                      stats: dict[str, LinearStats] | None, *, bits: int,
                      group_size: int | None, symmetric: bool) -> dict[str, torch.Tensor]:
    """All of ``weights`` with the decoder linears replaced by their dequantized (float32)
    quantization by ``method`` ("rtn", "gptq" or "awq"; the last two need ``stats``).

    NOTE: dequantized, not packed: the model then runs the same float kernels as the reference,
    so a KL difference is the weights' and not a kernel's (e.g. int8 activations).
    """
    from fitserve.quant.packed import dequantize
    from fitserve.quant.rtn import quantize_int4, quantize_int8
    from fitserve.tools.quantize.awq import awq_transform
    from fitserve.tools.quantize.gptq import gptq_quantize_weights

    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if method != "rtn" and stats is None:
        raise ValueError(f"{method} needs calibration statistics")
    names = linear_weight_names(spec)
    out = dict(weights)
    if method == "gptq":
        assert stats is not None
        packed = gptq_quantize_weights({n: weights[n] for n in names}, stats, bits=bits,
                                       group_size=group_size, symmetric=symmetric)
        out.update({n: dequantize(p) for n, p in packed.items()})
        return out
    if method == "awq":
        assert stats is not None
        out = awq_transform(weights, spec, stats, bits=bits, group_size=group_size,
                            symmetric=symmetric)
    for n in names:
        w = out[n]
        pw = quantize_int4(w, group_size or 0, symmetric=symmetric) if bits == 4 else (
            quantize_int8(w, group_size))
        out[n] = dequantize(pw)
    return out


def _halves(text: str, tokenizer: _Encoder, max_tokens: int, pieces: int
            ) -> tuple[list[list[int]], list[list[int]]]:
    """(calibration pieces, held-out pieces) of one text: its first ``pieces`` pieces of
    ``max_tokens`` tokens calibrate, the next ``pieces`` are held out."""
    ids = calibration_token_ids(text, tokenizer, max_tokens=max_tokens, max_pieces=2 * pieces)
    if len(ids) < 2 * pieces:
        raise ValueError(f"a text of {len(ids)} pieces of {max_tokens} tokens cannot give "
                         f"{pieces} to calibrate and {pieces} to hold out")
    return ids[:pieces], ids[pieces:]


def calibration_shift(spec: ModelSpec, weights: dict[str, torch.Tensor], tokenizer: _Encoder,
                      texts: dict[str, str], *, bits: int = 4, group_size: int | None = 128,
                      symmetric: bool = False, max_tokens: int = 512, pieces: int = 1,
                      methods: tuple[str, ...] = METHODS) -> dict[str, dict[str, dict[str, float]]]:
    """The calibration-shift experiment: ``kl[method][calibrated on][evaluated on]``, the mean
    per-token KL(float || quantized) on held-out pieces of each text, for every method
    calibrated on every text (RTN needs none: its one row is keyed "-").

    Each text of ``texts`` (name -> text, e.g. {"code": ..., "prose": ...}) gives ``pieces``
    calibration pieces of ``max_tokens`` tokens and the next ``pieces`` as its held-out set, so
    the diagonal (calibrated and evaluated on the same kind of text) never sees its own tokens.
    ``weights`` are float HF-named tensors (``load_model(..., torch.float32).weights``).
    """
    from fitserve.model.loader import build_model
    from fitserve.runner.teacher_forcing import score_logits

    split = {name: _halves(t, tokenizer, max_tokens, pieces) for name, t in texts.items()}
    positions = max_tokens + 1

    def evaluate(w: dict[str, Any]) -> dict[str, list[torch.Tensor]]:
        model = build_model(spec, w, dtype=torch.float32, device="cpu", max_positions=positions)
        return {name: [score_logits(model, spec, ids) for ids in held]
                for name, (_, held) in split.items()}

    ref_model = build_model(spec, dict[str, Any](weights), dtype=torch.float32, device="cpu",
                            max_positions=positions)
    stats = {name: collect_linear_stats(ref_model, spec, calib)
             for name, (calib, _) in split.items()}
    del ref_model
    ref = evaluate(weights)
    out: dict[str, dict[str, dict[str, float]]] = {}
    for method in methods:
        rows = ["-"] if method == "rtn" else list(texts)
        out[method] = {}
        for calib_name in rows:
            w = quantized_weights(method, weights, spec, stats.get(calib_name), bits=bits,
                                  group_size=group_size, symmetric=symmetric)
            got = evaluate(w)
            out[method][calib_name] = {
                name: sum(mean_token_kl(r, g) for r, g in zip(ref[name], got[name], strict=True))
                / len(ref[name]) for name in texts}
    return out


def format_shift(kl: dict[str, dict[str, dict[str, float]]]) -> str:
    """A table of :func:`calibration_shift`'s result: KL per (method, calibration) row and
    evaluation column, and each off-diagonal KL as a multiple of the same method's in-
    distribution KL on that evaluation text (how much the method degrades under shift)."""
    evals = list(next(iter(next(iter(kl.values())).values())))
    lines = [f"{'method':<6} {'calibrated on':<14}" + "".join(f"{e:>14}" for e in evals)]
    for method, rows in kl.items():
        for calib, cols in rows.items():
            cells = []
            for e in evals:
                cell = f"{cols[e]:.4f}"
                if calib in rows and calib != e and e in rows:
                    cell += f" x{cols[e] / rows[e][e]:.2f}"
                cells.append(f"{cell:>14}")
            lines.append(f"{method:<6} {calib:<14}" + "".join(cells))
    return "\n".join(lines)
