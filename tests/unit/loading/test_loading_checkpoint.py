"""The `fitserve quantize` checkpoint (fitserve.loading.checkpoint / methods): written then loaded
bit for bit, config.json written from a spec read back to the same spec, and every corrupt or
inconsistent folder refused with a ModelLoadError naming the tensor and the problem."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file, save_file

from fitserve.config import ModelSpec, RopeScaling
from fitserve.loading import ModelLoadError, load_model
from fitserve.loading.checkpoint import config_from_spec, prepare_output, write_checkpoint
from fitserve.loading.hf_config import spec_from_hf_config
from fitserve.quant.packed import PackedWeight, dequantize
from fitserve.quant.rtn import quantize
from fitserve.tools.quantize import cli as cli_quantize
from fitserve.tools.quantize.methods import (
    CALIBRATED,
    METHODS,
    quantize_loaded,
    target_formats,
)
from tests.tiny_gguf import TinyGGUF, write_tiny_gguf

Q_PROJ = "model.layers.0.self_attn.q_proj.weight"
DOWN = "model.layers.1.mlp.down_proj.weight"  # K = 96: padded to 128 by g64 / g128


def write(tmp_path: Path, source: Path, name: str = "ckpt", **how: Any) -> Path:
    """Quantize ``source`` (rtn unless told) and write the checkpoint to tmp_path / name."""
    loaded = load_model(source, dtype=torch.float32, weights="as-stored")
    result = quantize_loaded(loaded, **{"method": "rtn", "bits": 4, "group_size": 32, **how})
    out = tmp_path / name
    prepare_output(out, force=False)
    return write_checkpoint(out, spec=result.spec, weights=result.weights,
                            quantization_config=result.metadata, tokenizer=loaded.tokenizer,
                            source=loaded.path, generation_defaults=loaded.generation_defaults)


@pytest.fixture()
def tiny(tmp_path: Path) -> Path:
    return write_tiny_gguf(tmp_path / "tiny.gguf", TinyGGUF(vocab=301))


def packed_equal(a: PackedWeight, b: PackedWeight) -> bool:
    ta, tb = a.tensors(), b.tensors()
    return (a.format, a.shape) == (b.format, b.shape) and ta.keys() == tb.keys() and all(
        torch.equal(ta[k], tb[k]) for k in ta)


@pytest.mark.parametrize(("bits", "group", "sym", "fmt"), [
    (4, 32, False, "int4-g32-asym"), (4, 64, True, "int4-g64-sym"),
    (4, 128, False, "int4-g128-asym"), (8, None, False, "int8-ch"), (8, 32, False, "int8-g32"),
])
def test_round_trip_is_bit_identical(tmp_path: Path, tiny: Path, bits: int, group: int | None,
                                     sym: bool, fmt: str) -> None:
    out = write(tmp_path, tiny, bits=bits, group_size=group, symmetric=sym)
    source = load_model(tiny, dtype=torch.float32)
    back = load_model(out, dtype=torch.float32, weights="as-stored")
    assert back.spec == source.spec and set(back.weights) == set(source.weights)
    formats = json.loads((out / "config.json").read_text())["quantization_config"]["formats"]
    for name, w in source.weights.items():
        got = back.weights[name]
        if w.dim() == 1:
            assert torch.equal(got, w), name  # norms: dense float32 as they were
            continue
        want = fmt if name != "model.embed_tokens.weight" and name != "lm_head.weight" else (
            "int8-ch")
        assert isinstance(got, PackedWeight) and packed_equal(got, quantize(w, want)), name
        assert formats[name] == back.stored_formats[name] == want
    assert back.weight_format == fmt
    text = "the cat <|im_end|> the"
    assert back.tokenizer.encode(text) == source.tokenizer.encode(text)
    assert back.tokenizer.eos_token_ids == source.tokenizer.eos_token_ids
    assert (out / "model.safetensors").stat().st_mode & 0o044  # readable by others too


def test_dense_and_other_choices_dequantize_exactly(tmp_path: Path, tiny: Path) -> None:
    out = write(tmp_path, tiny, bits=8, group_size=None)  # int8-ch everywhere
    packed = load_model(out, weights="as-stored").weights[DOWN]
    dense = load_model(out, dtype=torch.float32).weights[DOWN]  # no --weights: dense
    assert isinstance(packed, PackedWeight) and torch.equal(dense, dequantize(packed))
    bf16 = load_model(out, dtype=torch.bfloat16, weights="bf16").weights[DOWN]
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, dequantize(packed, torch.bfloat16))
    # --weights int4 on an int8-ch checkpoint: RTN of the dequantized weight, per the rule
    as_int4 = load_model(out, weights="int4")
    assert packed_equal(as_int4.weights[DOWN], quantize(dequantize(packed), "int4-g32-asym"))
    assert as_int4.stored_formats[DOWN] == "int8-ch"


def test_rtn_keeps_gguf_blocks_already_in_the_target_layout(tmp_path: Path) -> None:
    src = write_tiny_gguf(tmp_path / "q41.gguf", TinyGGUF(qtype=Q.Q4_1, embd_qtype=Q.Q8_0))
    back = load_model(write(tmp_path, src), weights="as-stored")
    at_load = load_model(src, weights="int4")  # the engine's RTN at load
    for name, w in at_load.weights.items():
        if isinstance(w, PackedWeight):
            assert packed_equal(back.weights[name], w), name


SPECS = [
    ModelSpec("llama", 320, 64, 96, 2, 4, 2, 16, max_position_embeddings=4096, rms_norm_eps=1e-6,
              rope_theta=5e5, rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 64),
              bos_token_id=1, eos_token_ids=(2, 7), name="tiny-llama"),
    ModelSpec("mistral", 320, 64, 96, 2, 4, 2, 32, sliding_window=16, eos_token_ids=(2,),
              name="m"),
    ModelSpec("qwen2", 320, 64, 96, 2, 4, 2, 16, tie_word_embeddings=True, attention_bias=True,
              rope_scaling=RopeScaling("linear", 2.0), name="q2"),
    ModelSpec("qwen3", 320, 64, 96, 2, 4, 2, 24, qk_norm=True, sliding_window=32,
              hidden_act="silu", name="q3"),
]


@pytest.mark.parametrize("spec", SPECS, ids=[s.architecture for s in SPECS])
def test_config_from_spec_reads_back_the_same_spec(spec: ModelSpec) -> None:
    cfg = json.loads(json.dumps(config_from_spec(spec)))
    assert spec_from_hf_config(cfg) == spec
    with pytest.raises(ValueError, match="interleaved"):
        config_from_spec(replace(spec, rope_interleaved=True))


def _edit(out: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(str(out / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(out / "model.safetensors"))


def _edit_config(out: Path, change: Callable[[dict[str, Any]], None]) -> None:
    cfg = json.loads((out / "config.json").read_text())
    change(cfg["quantization_config"])
    (out / "config.json").write_text(json.dumps(cfg))


P = Q_PROJ.removesuffix(".weight")
CORRUPT: dict[str, tuple[Callable[[Path], None], str]] = {
    "missing scales": (lambda o: _edit(o, lambda t: t.pop(f"{P}.scales")),
                       rf"{Q_PROJ}.*{P}\.scales, absent"),
    "missing mins": (lambda o: _edit(o, lambda t: t.pop(f"{P}.mins")), rf"{P}\.mins, absent"),
    "scales shape": (lambda o: _edit(o, lambda t: t.update({f"{P}.scales": t[f"{P}.scales"][:, :1]
                                                            .contiguous()})),
                     rf"{Q_PROJ}.*scales must be torch.float16 \[64, 2\]"),
    "qweight dtype": (lambda o: _edit(o, lambda t: t.update({f"{P}.qweight": t[f"{P}.qweight"]
                                                             .to(torch.int8)})),
                      rf"{Q_PROJ}.*qweight must be torch.uint8"),
    "mins on sym": (lambda o: _edit_config(o, lambda q: q["formats"].update(
        {Q_PROJ: "int4-g32-sym"})), rf"{P}\.mins present, but int4-g32-sym"),
    "unknown format": (lambda o: _edit_config(o, lambda q: q["formats"].update(
        {Q_PROJ: "int3-g32"})), rf"{Q_PROJ}.*unknown packed format 'int3-g32'"),
    "not packed": (lambda o: _edit_config(o, lambda q: q["formats"].update({Q_PROJ: "bf16"})),
                   rf"{Q_PROJ}.*unknown packed format 'bf16'"),
    "bnb method": (lambda o: _edit_config(o, lambda q: q.update({"quant_method": "bitsandbytes"})),
                   r"quantized checkpoints \(bitsandbytes\) are not supported"),
    "no formats": (lambda o: _edit_config(o, lambda q: q.pop("formats")), r"no 'formats'"),
    "not a matrix": (lambda o: _edit_config(o, lambda q: q["formats"].update(
        {"model.norm.weight": "int8-ch"})), r"'model.norm.weight'.*not a weight matrix"),
    "orphan part": (lambda o: _edit_config(o, lambda q: q["formats"].pop(Q_PROJ)),
                    rf"'{P}\.(qweight|scales|mins)' is a packed part.*does not name {Q_PROJ}"),
    "dense and packed": (lambda o: _edit(o, lambda t: t.update({Q_PROJ: torch.zeros(64, 64)})),
                         rf"{Q_PROJ}.*both dense and packed"),
}


@pytest.mark.parametrize("case", list(CORRUPT))
def test_corrupt_checkpoint_is_refused_naming_the_tensor(tmp_path: Path, tiny: Path,
                                                         case: str) -> None:
    out = write(tmp_path, tiny)  # int4-g32-asym: qweight, scales and mins
    breaker, message = CORRUPT[case]
    breaker(out)
    with pytest.raises(ModelLoadError, match=message):
        load_model(out, weights="as-stored")


def test_target_formats_and_their_errors() -> None:
    assert target_formats(4, 128, True) == ("int4-g128-sym", "int8-ch")
    assert target_formats(8, None, False) == ("int8-ch", "int8-ch")
    assert target_formats(8, 64, False) == ("int8-g64", "int8-ch")
    for bits, group, match in [(4, None, "32, 64 or 128"), (4, 48, "got 48"), (8, 16, "got 16"),
                               (3, 32, "4 or 8")]:
        with pytest.raises(ValueError, match=match):
            target_formats(bits, group, False)
    assert (METHODS, CALIBRATED) == (cli_quantize.METHODS, cli_quantize.CALIBRATED)


def test_calibrated_method_needs_text_and_unknown_method_is_refused(tiny: Path) -> None:
    loaded = load_model(tiny, weights="as-stored")
    with pytest.raises(ValueError, match="--calib"):
        quantize_loaded(loaded, method="gptq", bits=4, group_size=32)
    with pytest.raises(ValueError, match="unknown method 'hqq'"):
        quantize_loaded(loaded, method="hqq", bits=4, group_size=32)


def test_force_replaces_only_checkpoint_files(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    (out / "model-00002-of-00002.safetensors").write_bytes(b"stale")
    with pytest.raises(ValueError, match="not empty.*--force"):
        prepare_output(out, force=False)
    prepare_output(out, force=True)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_hf_source_keeps_its_config_and_tokenizer_files(
        tmp_path: Path, tiny_hf_model_dir: Callable[..., Any]) -> None:
    source = tiny_hf_model_dir("qwen2")  # tied embeddings, q/k/v biases
    out = write(tmp_path, source, bits=4, group_size=64, symmetric=True)
    original = json.loads((source / "config.json").read_text())
    written = json.loads((out / "config.json").read_text())
    assert {k: v for k, v in written.items() if k != "quantization_config"} == original
    for f in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / f).read_bytes() == (source / f).read_bytes()
    a, b = load_model(source), load_model(out, weights="as-stored")
    assert replace(a.spec, name="") == replace(b.spec, name="")  # named after their folders
    bias = "model.layers.0.self_attn.q_proj.bias"
    assert torch.equal(b.weights[bias], a.weights[bias])  # dense, as they were
    assert packed_equal(b.weights[Q_PROJ], quantize(a.weights[Q_PROJ], "int4-g64-sym"))
    assert "lm_head.weight" not in b.weights
