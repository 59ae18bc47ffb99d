"""quantization_config of compressed-tensors / GPTQ / AWQ checkpoints (torch-free): the scheme of
each Linear, the engine format it is held in, and every part the engine cannot hold named by
the support check, the loader and `fitserve plan`."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from fitserve.cli import main as fitserve_main
from fitserve.ledger.formats import weight_bytes, weight_format
from fitserve.loading.errors import ModelLoadError
from fitserve.loading.hf_config import spec_from_hf_folder
from fitserve.loading.hf_quant_config import (
    QuantScheme,
    held_format,
    prequant_formats,
    read_prequant,
)
from fitserve.loading.support import hf_support

BASE = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
        "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 320, "torch_dtype": "bfloat16"}


def ct(weights: dict[str, Any], fmt: str = "pack-quantized", **extra: Any) -> dict[str, Any]:
    return {"quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "format": fmt, **extra}}}


W4_G128_ASYM = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128,
                "symmetric": False}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": True,
        "checkpoint_format": "gptq"}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm"}


def test_schemes_per_module_and_the_format_held() -> None:
    pre = read_prequant({"quantization_config": ct(W4_G128_ASYM)})
    assert pre is not None
    assert pre.scheme_for("model.layers.0.mlp.down_proj") == QuantScheme(
        "compressed-tensors", 4, 128, False)
    assert pre.scheme_for("lm_head") is None  # ignored
    assert pre.scheme_for("model.layers.0.input_layernorm") is None  # not a Linear
    regex = ct({"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True})
    regex["config_groups"]["group_0"]["targets"] = ["re:.*mlp\\..*"]
    pre = read_prequant({"quantization_config": regex})
    assert pre is not None and pre.scheme_for("model.layers.1.self_attn.q_proj") is None
    assert pre.scheme_for("model.layers.1.mlp.up_proj") == QuantScheme("compressed-tensors", 8,
                                                                        0, True)
    gptq = read_prequant({"quantization_config": GPTQ})
    assert gptq is not None and gptq.scheme_for("lm_head") is None
    assert gptq.scheme_for("model.layers.0.self_attn.o_proj") == QuantScheme(
        "gptq", 4, 128, True, act_order=True, zero_offset=1)
    assert gptq.tag == "gptq int4 g128 sym act-order"
    v2 = read_prequant({"quantization_config": {**GPTQ, "checkpoint_format": "gptq_v2",
                                                 "desc_act": False}})
    assert v2 is not None and v2.groups[0][1].zero_offset == 0
    awq = read_prequant({"quantization_config": AWQ})
    assert awq is not None and awq.groups[0][1] == QuantScheme("awq", 4, 64, False)
    assert read_prequant({"quantization_config": {"quant_method": "fitserve"}}) is None


@pytest.mark.parametrize(("scheme", "k", "fmt"), [
    (QuantScheme("gptq", 4, 128, True), 4096, "int4-g128-sym"),
    (QuantScheme("gptq", 4, 128, True, act_order=True), 4096, "int4-g128-sym-perm"),
    (QuantScheme("awq", 4, 128, False), 4096, "int4-g128-asym"),
    (QuantScheme("compressed-tensors", 4, 0, True), 96, "int4-g96-sym"),  # channel: K to 32
    (QuantScheme("compressed-tensors", 4, 0, False), 100, "int4-g128-asym"),
    (QuantScheme("compressed-tensors", 8, 0, True), 4096, "int8-ch"),
    (QuantScheme("gptq", 8, 64, True, act_order=True), 4096, "int8-g64-perm"),
    (QuantScheme("compressed-tensors", 8, 32, False), 4096, "bf16"),  # int8 has no zero point
    (QuantScheme("gptq", 4, 16, True), 4096, "bf16"),  # groups are multiples of 32
])
def test_held_format(scheme: QuantScheme, k: int, fmt: str) -> None:
    assert held_format(scheme, k, "bf16") == fmt


def test_bits_per_weight_of_the_held_formats() -> None:
    # int4-g128 sym: 128 codes + one f16 scale = 528 bits; asym + an f16 min: 544 bits
    assert weight_bytes(4096 * 4096, "int4-g128-sym", rows=4096) * 8 == 4096 * 32 * 528
    assert weight_bytes(4096 * 4096, "int4-g128-asym", rows=4096) * 8 == 4096 * 32 * 544
    # act-order adds the int32 column order: 4 bytes per input column
    assert weight_bytes(4096 * 4096, "int4-g128-sym-perm", rows=4096) == weight_bytes(
        4096 * 4096, "int4-g128-sym", rows=4096) + 4 * 4096
    assert weight_format("int4-g128-sym-perm").packed == weight_format("int4-g128-sym").packed


def test_prequant_formats_name_the_quantized_weights() -> None:
    shapes = {"model.layers.0.mlp.down_proj.weight": (64, 96), "lm_head.weight": (320, 64),
              "model.norm.weight": (64,)}
    assert prequant_formats({"quantization_config": GPTQ}, shapes, "bf16") == {
        "model.layers.0.mlp.down_proj.weight": "int4-g128-sym-perm"}
    w8a = {"num_bits": 8, "type": "int", "strategy": "group", "group_size": 32,
           "symmetric": False}
    assert prequant_formats({"quantization_config": ct(w8a)}, shapes, "bf16") == {}
    assert prequant_formats({"quantization_config": {"quant_method": "fitserve"}}, shapes,
                            "bf16") is None


UNSUPPORTED: dict[str, tuple[dict[str, Any], str]] = {
    "gptq 3-bit": ({**GPTQ, "bits": 3}, r"gptq 3-bit weights"),
    "gptq marlin": ({**GPTQ, "checkpoint_format": "marlin"}, r"checkpoint_format 'marlin'"),
    "gptq is_marlin": ({**GPTQ, "is_marlin_format": True}, r"checkpoint_format 'marlin'"),
    "awq gemv": ({**AWQ, "version": "gemv"}, r"awq version 'gemv'"),
    "awq exllama": ({**AWQ, "version": "exllama"}, r"awq version 'exllama'"),
    "ct fp8": (ct({"num_bits": 8, "type": "float", "strategy": "channel"}, "float-quantized"),
               r"compressed-tensors format 'float-quantized'"),
    "ct nvfp4": (ct({"num_bits": 4, "type": "float", "strategy": "tensor_group",
                     "group_size": 16}, "nvfp4-pack-quantized"),
                 r"format 'nvfp4-pack-quantized'"),
    "ct w4a8": (ct(W4_G128_ASYM, input_activations={"num_bits": 8, "type": "int"}),
                r"activation quantization in group_0"),
    "ct 2-bit": (ct({**W4_G128_ASYM, "num_bits": 2}), r"int 2-bit weights in group_0"),
    "bitsandbytes": ({"quant_method": "bitsandbytes", "load_in_4bit": True},
                     r"bitsandbytes"),
}


def write_config(folder: Path, quant: dict[str, Any]) -> Path:
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**BASE, "quantization_config": quant}))
    return folder


@pytest.mark.parametrize("case", list(UNSUPPORTED))
def test_unsupported_is_refused_naming_it(tmp_path: Path, case: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    quant, message = UNSUPPORTED[case]
    folder = write_config(tmp_path / "m", quant)
    support = hf_support(folder / "config.json")
    assert len(support.missing) >= 1 and all(m.startswith("quantization: ")
                                             for m in support.missing), support.missing
    assert any(re.search(message, m) for m in support.missing), support.missing
    with pytest.raises(ModelLoadError, match=message):
        spec_from_hf_folder(folder)
    capsys.readouterr()
    assert fitserve_main(["plan", str(folder), "--gpu", "cpu"]) == 1
    out = capsys.readouterr()
    assert re.search(message, out.out + out.err)


@pytest.mark.parametrize("quant", [GPTQ, AWQ, ct(W4_G128_ASYM)], ids=["gptq", "awq", "ct"])
def test_plan_shows_the_format(tmp_path: Path, quant: dict[str, Any],
                               capsys: pytest.CaptureFixture[str]) -> None:
    folder = write_config(tmp_path / "m", quant)
    assert hf_support(folder / "config.json").missing == ()
    capsys.readouterr()
    assert fitserve_main(["plan", str(folder), "--gpu", "cpu"]) == 0
    out = capsys.readouterr().out
    pre = read_prequant({"quantization_config": quant})
    assert pre is not None and f"({pre.tag} checkpoint)" in out
    fmt = {"gptq": "int4-g128-sym-perm", "awq": "int4-g64-asym"}.get(quant["quant_method"],
                                                                     "int4-g128-asym")
    assert fmt in out
