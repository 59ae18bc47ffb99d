"""Run ``fitserve eval``: load a reference and candidates, score one text through each in lockstep.

    ref = ModelChoice("smollm2-135m", weights="float32")
    run = run_eval(ref, [ModelChoice("smollm2-135m", weights="int4")], max_tokens=1024)
    summarize(run.stats[0])                       # fitserve.tools.eval.eval: KL, flip, ppl ... + CIs

Each model is loaded as the engine loads it (``--weights`` / ``--quantization`` / ``--dtype``
resolved by ``plan.formats.resolve_engine_weights``) and scores the text teacher-forced through
its own paged KV cache (``fitserve.runner.teacher_forcing``), so a KV cache format's error is in its logits.
The text is cut into windows of ``window`` tokens, each scored from an empty cache; the models
advance chunk by chunk together, so only one chunk of logits per model is alive at a time.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from fitserve.config import ModelSpec
from fitserve.model.llama import CausalLM
from fitserve.runner.teacher_forcing import score_chunks
from fitserve.tools.eval.eval import TokenStats, token_stats

if TYPE_CHECKING:
    from fitserve.loading.tokenizer import Tokenizer

SHIPPED_TEXTS = {"persuasion": "austen_persuasion.txt", "ecclesiastes": "kjv_ecclesiastes.txt"}
DEFAULT_TEXT = "persuasion"
DEFAULT_WINDOW = 1024
DEFAULT_CHUNK = 256


class EvalError(ValueError):
    """A bad input to ``fitserve eval`` (the CLI exits 2 with this message)."""


@dataclass(frozen=True, slots=True)
class ModelChoice:
    """One model as ``fitserve eval`` runs it: the file plus the engine's format flags."""

    model: str = "smollm2-135m"
    weights: str = "auto"
    quantization: str | None = None
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    kv_cache_scales: str = "auto"
    activation_quant: str = "auto"  # --activation-quant: what packed weights multiply
    label: str = ""

    def name(self) -> str:
        """The label, or the flags that differ from the defaults (``weights=int4 kv=int8``)."""
        if self.label:
            return self.label
        parts = [f"weights={self.quantization or self.weights}"]
        if self.dtype != "auto":
            parts.append(f"dtype={self.dtype}")
        if self.kv_cache_dtype != "auto":
            parts.append(f"kv={self.kv_cache_dtype}")
        if self.kv_cache_scales != "auto":
            parts.append(f"kv-scales={self.kv_cache_scales}")
        if self.activation_quant != "auto":
            parts.append(f"act={self.activation_quant}")
        return " ".join(parts)

    def as_dict(self) -> dict[str, object]:
        """JSON-ready."""
        return {"model": self.model, "weights": self.weights, "quantization": self.quantization,
                "dtype": self.dtype, "kv_cache_dtype": self.kv_cache_dtype,
                "kv_cache_scales": self.kv_cache_scales,
                "activation_quant": self.activation_quant, "name": self.name()}


@dataclass(slots=True)
class Scorer:
    """A loaded model ready to score: module, spec, tokenizer and its KV choice."""

    choice: ModelChoice
    model: CausalLM
    spec: ModelSpec
    tokenizer: Tokenizer
    dtype: torch.dtype
    weights_choice: str
    positions: int  # the rotary tables' length: the longest window this model scores


def check_choice(choice: ModelChoice) -> None:
    """Reject unknown or conflicting format flags before any model is loaded (EvalError)."""
    from fitserve.ledger.formats import resolve_engine_kv_format, resolve_engine_weights

    try:
        resolve_engine_weights(choice.weights, choice.quantization, choice.dtype)
        resolve_engine_kv_format(choice.kv_cache_dtype, choice.kv_cache_scales, "bf16")
    except ValueError as exc:
        raise EvalError(f"{choice.name()}: {exc}") from None


def load_scorer(choice: ModelChoice, device: torch.device, max_positions: int) -> Scorer:
    """Load ``choice`` as the engine would (weights held in their chosen format)."""
    from fitserve.ledger.formats import resolve_engine_weights
    from fitserve.loading import load_model
    from fitserve.model.linear import set_activation_quant
    from fitserve.model.loader import build_model, check_supported
    from fitserve.runner.placement import resolve_dtype

    try:
        weights, dtype_arg = resolve_engine_weights(choice.weights, choice.quantization,
                                                    choice.dtype)
    except ValueError as exc:
        raise EvalError(f"{choice.name()}: {exc}") from None
    dtype = resolve_dtype(dtype_arg, device)
    loaded = load_model(choice.model, dtype=dtype, weights=weights)
    check_supported(loaded.spec)
    positions = min(max_positions, loaded.spec.max_position_embeddings)
    model = build_model(loaded.spec, loaded.weights, dtype=dtype, device=device,
                        max_positions=positions)
    if choice.activation_quant not in ("auto", "int8", "none"):
        raise EvalError(f"{choice.name()}: activation-quant must be auto, int8 or none")
    set_activation_quant(model, choice.activation_quant, dtype)
    loaded.weights = {}
    return Scorer(choice, model, loaded.spec, loaded.tokenizer, dtype, weights, positions)


def read_text(text: str | None) -> tuple[str, str]:
    """``(contents, name)`` of a shipped text's name (None: the default) or a file's path."""
    key = DEFAULT_TEXT if text is None else text
    if key in SHIPPED_TEXTS:
        body = resources.files("fitserve.tools.eval").joinpath("data", SHIPPED_TEXTS[key]).read_text(
            encoding="utf-8")
        return body, f"{key} (shipped: fitserve/tools/eval/data/{SHIPPED_TEXTS[key]})"
    path = Path(key).expanduser()
    if not path.is_file():
        raise EvalError(f"--text {key}: no such file (and not a shipped text: "
                        f"{', '.join(SHIPPED_TEXTS)})")
    try:
        body = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise EvalError(f"--text {key}: not UTF-8 text ({exc.reason})") from None
    if not body.strip():
        raise EvalError(f"--text {key}: the file is empty")
    return body, str(path)


def encode_text(text: str, scorers: list[Scorer], max_tokens: int | None) -> list[int]:
    """The text's token ids, the same for every model (else EvalError naming the two that
    differ), cut to ``max_tokens`` (at least 2: one to read, one to predict)."""
    first = scorers[0]
    for other in scorers[1:]:
        if other.spec.vocab_size != first.spec.vocab_size:
            raise EvalError(f"vocabularies differ: {first.choice.model} has "
                            f"{first.spec.vocab_size} tokens, {other.choice.model} has "
                            f"{other.spec.vocab_size}; KL needs one vocabulary")
    ids = first.tokenizer.encode(text)
    for other in scorers[1:]:
        if other.tokenizer.encode(text) != ids:
            raise EvalError(f"tokenizers differ: {first.choice.model} and {other.choice.model} "
                            "split the text into different tokens")
    if max_tokens is not None:
        ids = ids[:max_tokens]
    if len(ids) < 2:
        raise EvalError(f"the text has {len(ids)} token(s); at least 2 are needed")
    if max(ids) >= first.spec.vocab_size:
        raise EvalError(f"token id {max(ids)} is outside the model's {first.spec.vocab_size}-"
                        "token vocabulary (tokenizer and model do not belong together)")
    return ids


def iter_logits(model: CausalLM, spec: ModelSpec, tokens: list[int], *, window: int,
                chunk_size: int = DEFAULT_CHUNK, kv_cache_dtype: str = "auto",
                kv_cache_scales: str = "auto") -> Iterator[tuple[int, torch.Tensor]]:
    """``(offset, logits)`` chunks: rows predict ``tokens[offset + 1 ...]``; windows of
    ``window`` tokens, each from an empty cache; the very last row (past the text) is dropped,
    so the rows in all number ``len(tokens) - 1``."""
    for w0 in range(0, len(tokens) - 1, window):
        off = w0
        for logits in score_chunks(model, spec, tokens[w0:w0 + window], chunk_size=chunk_size,
                                   kv_cache_dtype=kv_cache_dtype,
                                   kv_cache_scales=kv_cache_scales):
            rows = min(logits.shape[0], len(tokens) - 1 - off)
            if rows > 0:
                yield off, logits[:rows]
            off += logits.shape[0]


def score_lockstep(reference: Scorer, candidates: list[Scorer], tokens: list[int], *,
                   window: int = DEFAULT_WINDOW, chunk_size: int = DEFAULT_CHUNK
                   ) -> list[TokenStats]:
    """Each candidate's per-position stats against the reference on ``tokens``."""
    gens = [iter_logits(s.model, s.spec, tokens, window=window, chunk_size=chunk_size,
                        kv_cache_dtype=s.choice.kv_cache_dtype,
                        kv_cache_scales=s.choice.kv_cache_scales)
            for s in [reference, *candidates]]
    parts: list[list[TokenStats]] = [[] for _ in candidates]
    for (off, ref), *cands in zip(*gens, strict=True):
        targets = torch.tensor(tokens[off + 1:off + 1 + ref.shape[0]])
        for i, (_, logits) in enumerate(cands):
            parts[i].append(token_stats(ref, logits, targets))
    return [TokenStats.cat(p) for p in parts]


@dataclass(slots=True)
class EvalRun:
    """What one ``fitserve eval`` scored: the models, the text and each candidate's stats."""

    reference: ModelChoice
    candidates: list[ModelChoice]
    text_name: str
    num_tokens: int  # tokens read (the stats have num_tokens - 1 positions)
    window: int
    stats: list[TokenStats] = field(default_factory=list)


def resolve_window(window: int, scorers: list[Scorer]) -> int:
    """``window`` capped at the smallest model's positions."""
    if window < 2:
        raise EvalError(f"--window must be at least 2, got {window}")
    return min(window, *(s.positions for s in scorers))


def run_eval(reference: ModelChoice, candidates: list[ModelChoice], *, text: str | None = None,
             max_tokens: int | None = 1024, window: int = DEFAULT_WINDOW,
             chunk_size: int = DEFAULT_CHUNK, device: str = "auto") -> EvalRun:
    """Load every model, check they share one tokenizer, score the text in lockstep."""
    from fitserve.runner.placement import resolve_device

    if not candidates:
        raise EvalError("no candidate to evaluate")
    if max_tokens is not None and max_tokens < 2:
        raise EvalError(f"--max-tokens must be at least 2, got {max_tokens}")
    for choice in [reference, *candidates]:
        check_choice(choice)
    body, text_name = read_text(text)
    dev = resolve_device(device)
    scorers = [load_scorer(c, dev, window) for c in [reference, *candidates]]
    tokens = encode_text(body, scorers, max_tokens)
    win = resolve_window(window, scorers)
    stats = score_lockstep(scorers[0], scorers[1:], tokens, window=win, chunk_size=chunk_size)
    return EvalRun(reference, candidates, text_name, len(tokens), win, stats)


def derive(base: ModelChoice, spec: str) -> ModelChoice:
    """A candidate from ``--compare SPEC``: ``int8`` (a --weights choice) or comma-separated
    ``key=value`` (keys: model, weights, quantization, dtype, kv-cache-dtype, kv-cache-scales,
    activation-quant, label); keys not given are the primary candidate's. A weights or quantization key replaces
    both (so ``--quantization int4 --compare int8`` does not conflict), and a dense weights
    choice (bf16, float32, float16) without a dtype key sets dtype to auto (it is the dtype)."""
    if "=" not in spec:
        spec = f"weights={spec}"
    keys = {"model": "model", "weights": "weights", "quantization": "quantization",
            "dtype": "dtype", "kv-cache-dtype": "kv_cache_dtype",
            "kv-cache-scales": "kv_cache_scales", "activation-quant": "activation_quant",
            "label": "label"}
    changes: dict[str, object] = {"label": ""}
    for item in spec.split(","):
        key, sep, value = item.partition("=")
        key = key.strip().replace("_", "-")
        if not sep or key not in keys or not value.strip():
            raise EvalError(f"--compare {spec!r}: {item!r} is not KEY=VALUE with KEY one of "
                            f"{', '.join(keys)}")
        changes[keys[key]] = value.strip()
    if "weights" in changes and "quantization" not in changes:
        changes["quantization"] = None
        if changes["weights"] in ("bf16", "float32", "float16") and "dtype" not in changes:
            changes["dtype"] = "auto"  # a dense --weights is the model dtype (no conflict)
    if "quantization" in changes and "weights" not in changes:
        changes["weights"] = "auto"
    return replace(base, **changes)  # type: ignore[arg-type]
