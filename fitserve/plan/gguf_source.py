"""A ModelSpec from a GGUF file's header: metadata and tensor sizes, no tensor data read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fitserve.config import ModelSpec
from fitserve.plan.errors import PlanError
from fitserve.plan.model_source import ModelEntry


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_entry(path: Path) -> ModelEntry:
    """Read the architecture facts and the file's weight bytes from a GGUF header."""
    from gguf import GGUFReader  # the gguf package's reader maps the file; we read no tensor

    if not path.is_file():
        raise PlanError(f"no such GGUF file: {path}")
    try:
        reader = GGUFReader(str(path), "r")
    except Exception as e:  # the reader raises bare ValueError/struct errors on bad files
        raise PlanError(f"cannot read GGUF header of {path}: {e}") from e
    arch = str(_field(reader, "general.architecture", "llama"))

    def a(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    hidden, heads = int(a("embedding_length")), int(a("attention.head_count"))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = a("vocab_size") or (len(tokens.data) if tokens is not None else 0)
    names = {t.name for t in reader.tensors}
    spec = ModelSpec(
        architecture=arch, vocab_size=int(vocab), hidden_size=hidden,
        intermediate_size=int(a("feed_forward_length")), num_layers=int(a("block_count")),
        num_heads=heads, num_kv_heads=int(a("attention.head_count_kv", heads)),
        head_dim=int(a("attention.key_length", hidden // heads)),
        max_position_embeddings=int(a("context_length", 2048)),
        rms_norm_eps=float(a("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(a("rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in names,
        sliding_window=a("attention.sliding_window"),
        name=str(_field(reader, "general.name", path.stem)),
        num_experts=int(a("expert_count", 0)), num_experts_per_token=int(a("expert_used_count", 0)),
    )
    file_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    by_type: dict[str, int] = {}
    for t in reader.tensors:
        by_type[t.tensor_type.name] = by_type.get(t.tensor_type.name, 0) + int(t.n_bytes)
    main = max(by_type, key=lambda k: by_type[k]) if by_type else "F32"
    types = ", ".join(f"{k} {v:,} B" for k, v in sorted(by_type.items(), key=lambda kv: -kv[1]))
    # NOTE: the weights line uses the file's own bytes; main_type only names the format.
    return ModelEntry(spec, f"gguf-file:{main}", "f32", f"{path} (tensors: {types})",
                      file_weight_bytes=file_bytes)
