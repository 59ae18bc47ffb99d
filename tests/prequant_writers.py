"""Pre-quantized checkpoints of a tiny random Llama, for the loader tests.

- compressed-tensors pack-quantized: written by compressed-tensors itself (its QuantizationScheme,
  apply_quantization_config, calculate_qparams and ModelCompressor.compress_model: what
  llm-compressor calls after calibration), decompressed by its own compressor;
- GPTQ and AWQ: written here from the format spec (AutoGPTQ's ``QuantLinear.pack`` and AutoAWQ's
  ``WQLinear_GEMM.from_linear``: the bit layout is spelled out below), with the integer codes,
  scales and zero points kept so the float64 reference ``s * (q - z)`` needs no unpacking.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tiny_llama(dtype: torch.dtype) -> Any:
    """The tests' tiny random Llama (hidden 64, intermediate 96, 2 layers) in ``dtype``."""
    import transformers as tf

    from tests.conftest import tiny_hf_config

    torch.manual_seed(1234)
    return tf.AutoModelForCausalLM.from_config(tiny_hf_config("llama"), dtype=dtype).eval()


def linear_names(model: Any) -> list[str]:
    return [n for n, m in model.named_modules() if n.endswith(QUANTIZED)]


def _finish(folder: Path, tokenizer_dir: Path, quant: dict[str, Any] | None = None) -> Path:
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, folder / f.name)
    if quant is not None:
        cfg = json.loads((folder / "config.json").read_text())
        cfg["quantization_config"] = quant
        (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    return folder


# -- compressed-tensors ---------------------------------------------------------------------
def write_compressed_tensors(folder: Path, tokenizer_dir: Path, *, bits: int, strategy: str,
                             group: int | None, symmetric: bool, model: Any = None
                             ) -> tuple[Path, dict[str, Any]]:
    """A pack-quantized checkpoint of ``model`` (a bf16 transformers model; default the tiny
    Llama) written by compressed-tensors, and compressed-tensors' own decompression of each
    quantized weight (HF name -> bf16 tensor)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    model = tiny_llama(torch.bfloat16) if model is None else model
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy=strategy,
                            group_size=group)
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(
        targets=["Linear"], weights=args)}, ignore=["lm_head"], format="pack-quantized")
    apply_quantization_config(model, config)
    for name in linear_names(model):  # min-max calibration, as llm-compressor's observer
        m = model.get_submodule(name)
        w = m.weight.data
        g = w.reshape(w.shape[0], -1, group) if group else w.unsqueeze(1)
        scale, zero = calculate_qparams(g.amin(-1), g.amax(-1), args)
        m.weight_scale.data.copy_(scale.reshape(m.weight_scale.shape))
        if not symmetric:
            m.weight_zero_point.data.copy_(zero.reshape(m.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(folder)
    compressor.update_config(str(folder))
    return _finish(folder, tokenizer_dir), ct_decompress(folder, args)


def ct_decompress(folder: Path, args: Any) -> dict[str, torch.Tensor]:
    """compressed-tensors' PackedQuantizationCompressor.decompress of every quantized weight."""
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from safetensors.torch import load_file

    tensors = load_file(str(folder / "model.safetensors"))
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    out = {}
    for key in [k for k in tensors if k.endswith(".weight_packed")]:
        prefix = key.removesuffix(".weight_packed")
        parts = {k.removeprefix(prefix + "."): v for k, v in tensors.items()
                 if k.startswith(prefix + ".weight_")}
        out[prefix + ".weight"] = PackedQuantizationCompressor.decompress(parts, scheme)["weight"]
    return out


# -- GPTQ / AWQ from the spec -----------------------------------------------------------------
@dataclass
class Quantized:
    """One weight's integer codes ``q [N, K]``, zero points and f16 scales ``[N, groups]`` and
    the group of each input column: ``w = s[:, g_idx] * (q - z[:, g_idx])``."""

    q: torch.Tensor
    z: torch.Tensor
    s: torch.Tensor
    g_idx: torch.Tensor

    def reference(self) -> torch.Tensor:
        """The float64 dequantization, straight from the definition."""
        return self.s.double()[:, self.g_idx] * (self.q - self.z[:, self.g_idx]).double()


def quantize_minmax(w: torch.Tensor, g_idx: torch.Tensor, bits: int, sym: bool,
                    coarse: bool) -> Quantized:
    """GPTQ's / AWQ's min-max grid per group (``Quantizer.find_params``), round to nearest.
    ``coarse``: scales kept to 7 significant bits, so that every ``-s * z`` fits an f16."""
    maxq = (1 << bits) - 1
    groups = int(g_idx.max()) + 1
    n = w.shape[0]
    s = torch.empty(n, groups, dtype=torch.float16)
    z = torch.empty(n, groups, dtype=torch.int64)
    for g in range(groups):
        cols = w[:, g_idx == g].double()
        lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
        if sym:
            hi = torch.maximum(lo.abs(), hi)
            lo = -hi
        scale = ((hi - lo) / maxq).clamp(min=1e-5)
        if coarse:
            mant, exp = torch.frexp(scale)
            scale = torch.ldexp(torch.round(mant * 128) / 128, exp)
        s[:, g] = scale.to(torch.float16)
        z[:, g] = (maxq + 1) // 2 if sym else torch.round(-lo / s[:, g].double()).clamp(0, maxq)
    q = torch.round(w.double() / s.double()[:, g_idx]) + z[:, g_idx]
    return Quantized(q.clamp(0, maxq).to(torch.int64), z, s, g_idx)


def pack_fields(values: torch.Tensor, bits: int, order: tuple[int, ...] | None = None
                ) -> torch.Tensor:
    """Pack unsigned ``values [R, C]`` along C, 32/bits per int32, field i at bits i*bits;
    ``order``: field i holds column order[i] of each word's columns (AWQ)."""
    per = 32 // bits
    r, c = values.shape
    v = values.to(torch.int64).reshape(r, c // per, per)
    if order is not None:
        v = v[..., list(order)]
    word = (v << (torch.arange(per) * bits)).sum(-1)
    return torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)


def write_gptq(folder: Path, tokenizer_dir: Path, *, bits: int, group: int, sym: bool,
               act_order: bool, coarse: bool = True, model: Any = None
               ) -> tuple[Path, dict[str, Quantized]]:
    """A GPTQ (v1) checkpoint of ``model`` (default the f32 tiny Llama) and each weight's codes,
    zero points and scales (``Quantized.reference()``: its float64 dequantization)."""
    model = tiny_llama(torch.float32) if model is None else model
    tensors = {k: v for k, v in model.state_dict().items()}
    refs = {}
    gen = torch.Generator().manual_seed(11)
    for name in linear_names(model):
        w = tensors.pop(name + ".weight")
        k = w.shape[1]
        g = group if group > 0 else k
        order = torch.randperm(k, generator=gen) if act_order else torch.arange(k)
        g_idx = torch.empty(k, dtype=torch.int64)
        g_idx[order] = torch.arange(k) // g  # GPTQ: the i-th column quantized is in group i // G
        qz = quantize_minmax(w, g_idx, bits, sym, coarse)
        refs[name + ".weight"] = qz
        tensors[name + ".qweight"] = _pack_rows(qz.q.T, bits)
        tensors[name + ".qzeros"] = pack_fields(qz.z.T - 1, bits)  # v1: zero minus 1
        tensors[name + ".scales"] = qz.s.T.contiguous()
        tensors[name + ".g_idx"] = g_idx.to(torch.int32)
    return _save(folder, tokenizer_dir, model, tensors, {
        "quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order,
        "sym": sym, "checkpoint_format": "gptq"}), refs


def _pack_rows(intweight: torch.Tensor, bits: int) -> torch.Tensor:
    """GPTQ qweight: ``intweight [K, N]`` packed along K (input rows), [K * bits / 32, N]."""
    return pack_fields(intweight.T.contiguous(), bits).T.contiguous()


def write_awq(folder: Path, tokenizer_dir: Path, *, group: int, coarse: bool, model: Any = None
              ) -> tuple[Path, dict[str, Quantized]]:
    """An AWQ GEMM checkpoint of ``model`` (default the f32 tiny Llama) and each weight's codes,
    zero points and scales."""
    awq_order = (0, 2, 4, 6, 1, 3, 5, 7)
    model = tiny_llama(torch.float32) if model is None else model
    tensors = {k: v for k, v in model.state_dict().items()}
    refs = {}
    for name in linear_names(model):
        w = tensors.pop(name + ".weight")
        qz = quantize_minmax(w, torch.arange(w.shape[1]) // group, 4, False, coarse)
        refs[name + ".weight"] = qz
        tensors[name + ".qweight"] = pack_fields(qz.q.T.contiguous(), 4, awq_order)
        tensors[name + ".qzeros"] = pack_fields(qz.z.T.contiguous(), 4, awq_order)
        tensors[name + ".scales"] = qz.s.T.contiguous()
    return _save(folder, tokenizer_dir, model, tensors, {
        "quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
        "version": "gemm"}), refs


def _save(folder: Path, tokenizer_dir: Path, model: Any, tensors: dict[str, torch.Tensor],
          quant: dict[str, Any]) -> Path:
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    model.config.save_pretrained(folder)
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # one storage with the embedding
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    return _finish(folder, tokenizer_dir, quant)


def reference_model(folder: Path, refs: dict[str, torch.Tensor]) -> Any:
    """transformers' tiny Llama in float32 holding the folder's dense tensors and, for each
    quantized weight, its reference dequantization ``refs`` (cast to float32)."""
    from safetensors.torch import load_file

    model = tiny_llama(torch.float32)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, t in {**load_file(str(folder / "model.safetensors")), **refs}.items():
            if name in params:
                params[name].copy_(t.to(torch.float32))
    return model
