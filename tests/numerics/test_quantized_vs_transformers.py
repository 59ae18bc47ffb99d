"""Weights held packed, against transformers running the same (dequantized) weights in fp32.

1. SmolLM2-135M Q4_1 held as stored (int4-g32-asym blocks, Q8_0 token_embd / tied lm_head),
   fp32 activations, vs transformers' own GGUF loader (it dequantizes with gguf.quants: the
   very weights our kernels read, exactly). Run twice: with the table's kernels (exact weight
   dequantization in fp32) and with every layer forced onto the act_quant kernel (activations
   quantized to int8 per 32 columns, llama.cpp's Q8 activations).
2. RTN int4 / int8 at load of tiny random HF models (llama; qwen2: tied embedding, qkv bias;
   phi3) vs
   transformers with its weights replaced by our RTN's float64-exact dequantization.

"Match" (DESIGN.md): greedy tokens identical for NUM_TOKENS on at least MIN_IDENTICAL of the
prompts (ACT_QUANT_MIN_IDENTICAL for the act_quant kernels, see there); where a prompt
diverges, each side's token is in the other's top-5 at that step; and up to the divergence
every one of our top-5 logprobs is within the tolerance of the reference's logprob of the
same token.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from fitserve.config import EngineConfig
from fitserve.engine.core import Engine
from fitserve.loading import LoadedModel, load_model
from fitserve.model.linear import CANDIDATES, PackedLinear
from fitserve.quant import dequantize, quantize
from fitserve.quant.convert import held_format
from fitserve.sampling import SamplingParams

from .conftest import hf_greedy

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived",
    "List three prime numbers and explain why each one is prime:",
    "Water boils at",
    "The three laws of robotics are",
]
NUM_TOKENS = 32
MIN_IDENTICAL = 4  # of 6: "most" (measured: 6 of 6 on the exact path, int4/int8 RTN 6 of 6)
# NOTE: exact path. Both sides hold bit-identical fp32 weights (torch.equal, see
# tests/unit/quant/test_quant_gguf.py) and run fp32 activations; they differ only in summation order
# (the packed kernel's fp32 FMA order, fused q/k/v, paged attention vs SDPA). Each op is then
# off by ~K * 2^-24 relative (~3e-5 for K = 576), compounding over 30 layers: the largest gap
# measured on these prompts is 2.7e-5 nats. 1e-3 nats leaves room for other summation orders
# (other CPUs, thread counts) and stays far below a wrong scale, min, nibble or row (> 0.1).
EXACT_TOL = 1e-3
# NOTE: act_quant path. Each 32 activations share an int8 scale absmax / 127: the rounding is
# <= absmax / 254 per element, a bf16 rounding (2^-9 relative) for the block's largest value
# and coarser for the smaller ones. The yardstick is therefore measured, not assumed:
# transformers itself in bf16 vs fp32 on the same prompts along the same greedy path (measured
# 0.49 nats worst); act_quant must stay within ACT_QUANT_FACTOR x that (measured 0.42-0.47
# nats) and below ACT_QUANT_CAP. Greedy identity is weaker than bf16's: measured 3 of 6
# prompts identical for 32 tokens (transformers bf16: 5 of 6), every divergence a top-5 near
# tie; "most" does not hold for act_quant: 1 to 3 of 6 identical across runs of the same code
# (kernel sum order is thread-split dependent), so no count floor is asserted; every step's
# top-5 gap bound and the top-5 membership of both tokens at each divergence are.
ACT_QUANT_FACTOR = 2.0
ACT_QUANT_CAP = 1.0
ACT_QUANT_MIN_IDENTICAL = 0


def compare(engine: Engine, hf: Any, prompt_ids: list[list[int]], tol: float,
            min_identical: int = MIN_IDENTICAL) -> dict[str, Any]:
    """Run every prompt on both sides; return per-prompt divergence steps and the worst gap."""
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=5)
    diverged: list[int] = []
    worst = 0.0
    for ids in prompt_ids:
        ref_tokens, ref_logprobs = hf_greedy(hf, ids, NUM_TOKENS)
        out = list(engine.stream(ids, params))[-1]
        assert out.logprobs is not None and len(out.token_ids) == NUM_TOKENS
        d = next((i for i, (a, b) in enumerate(zip(out.token_ids, ref_tokens, strict=True))
                  if a != b), NUM_TOKENS)
        for step in range(min(d + 1, NUM_TOKENS)):
            ours, ref = out.logprobs[step], ref_logprobs[step]
            ref_top5 = ref.topk(5).indices.tolist()
            if step == d:  # the divergence: a near tie, each token in the other's top-5
                assert out.token_ids[d] in ref_top5, (ids[:4], d)
                assert ref_tokens[d] in [t for t, _ in ours.top], (ids[:4], d)
            for token_id, lp in ours.top:
                gap = abs(lp - float(ref[token_id]))
                worst = max(worst, gap)
                assert gap < tol, (ids[:4], step, token_id, gap)
        diverged.append(d)
    identical = sum(d == NUM_TOKENS for d in diverged)
    assert identical >= min_identical, f"only {identical} of {len(diverged)} prompts identical"
    return {"diverged": diverged, "worst": worst, "identical": identical}


@pytest.fixture(scope="module")
def as_stored(smollm2_gguf: Path) -> LoadedModel:
    return load_model(smollm2_gguf, dtype=torch.float32, weights="as-stored")


def stored_engine(loaded: LoadedModel) -> Engine:
    return Engine(EngineConfig(model=str(loaded.path), dtype="float32", device="cpu",
                               max_model_len=512, num_kv_blocks=64), loaded=loaded)


def packed_layers(engine: Engine) -> list[PackedLinear]:
    return [m for m in engine.runner.model.modules() if isinstance(m, PackedLinear)]


@pytest.mark.slow
def test_q4_1_as_stored_matches_transformers(as_stored: LoadedModel, hf_smollm2: Any) -> None:
    engine = stored_engine(as_stored)
    layers = packed_layers(engine)
    assert len(layers) == 30 * 4 + 1  # q/k/v, o, gate/up, down per layer + the tied lm_head
    assert {m.packed.format for m in layers} == {"int4-g32-asym", "int8-g32"}
    ids = [engine.tokenizer.encode(p) for p in PROMPTS]
    result = compare(engine, hf_smollm2, ids, EXACT_TOL)
    print(f"as stored, exact kernels: {result}")
    # the kernels the table chose for fp32 activations never quantize them
    assert all("aq" not in m.kernel(1, torch.float32).name for m in layers)


@pytest.fixture(scope="module")
def hf_smollm2_bf16(hf_smollm2: Any) -> Any:
    # NOTE: what from_pretrained(..., dtype=bfloat16) builds (its logits are bit-equal): the fp32
    # model's parameters rounded to bf16, its buffers (the rotary inv_freq) left fp32, without
    # transformers' ~15 s GGUF read again. Module.to(bfloat16) would round inv_freq too.
    model = copy.deepcopy(hf_smollm2)
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    return model.eval()


@torch.inference_mode()
def bf16_spread(hf32: Any, hf16: Any, prompt_ids: list[list[int]]) -> float:
    """Largest |logprob(bf16) - logprob(fp32)| of transformers over the fp32 top-5 tokens,
    along the fp32 greedy path of each prompt: the yardstick for activation rounding."""
    worst = 0.0
    for ids in prompt_ids:
        tokens, ref = hf_greedy(hf32, ids, NUM_TOKENS)
        logits = hf16(torch.tensor([ids + tokens])).logits[0, len(ids) - 1 : -1]
        lp = logits.double().log_softmax(-1)
        for step in range(NUM_TOKENS):
            top = ref[step].topk(5).indices
            worst = max(worst, float((lp[step, top] - ref[step][top]).abs().max()))
    return worst


@pytest.mark.slow
def test_q4_1_act_quant_kernels_within_bf16_spread(as_stored: LoadedModel, hf_smollm2: Any,
                                                   hf_smollm2_bf16: Any) -> None:
    engine = stored_engine(as_stored)
    layers = packed_layers(engine)
    if not CANDIDATES["cpp-aq"].applies(layers[0].packed, torch.float32):
        pytest.skip("fitserve's C++ qlinear ops are not built here (no act_quant kernel)")
    for m in layers:
        m.force = "cpp-aq"
    ids = [engine.tokenizer.encode(p) for p in PROMPTS]
    spread = bf16_spread(hf_smollm2, hf_smollm2_bf16, ids)
    tol = min(ACT_QUANT_CAP, ACT_QUANT_FACTOR * spread)
    result = compare(engine, hf_smollm2, ids, tol, ACT_QUANT_MIN_IDENTICAL)
    print(f"act_quant: {result}, transformers bf16 spread {spread:.3g}, tolerance {tol:.3g}")
    assert result["worst"] > 1e-4  # not vacuous: activations really were quantized


def rtn_reference(hf_model: Any, choice: str) -> Any:
    """transformers' model with each weight replaced by our RTN's dequantization (the format
    the engine's rule picks for it), computed from the original fp32 weight."""
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            fmt = held_format(choice, name, p.dim(), "f32", torch.float32)
            if fmt != "f32":
                p.copy_(dequantize(quantize(p.detach(), fmt)))
    return hf_model


@pytest.mark.slow
@pytest.mark.parametrize("choice", ["int4", "int8"])
# phi3: its fused qkv / gate_up split before RTN (row-local formats: the same as quantizing
# the fused tensor); gemma3: (1 + w) norms and q/k norms stay f32, its 2 layers all slide
@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3", "gemma3"])
def test_rtn_tiny_model_matches_transformers_on_dequantized_weights(
        tiny_hf_model_dir: Any, arch: str, choice: str) -> None:
    folder, hf_model = tiny_hf_model_dir(arch, return_model=True)
    engine = Engine(EngineConfig(model=str(folder), dtype="float32", device="cpu",
                                 max_model_len=128, num_kv_blocks=32, weights=choice))
    layers = packed_layers(engine)
    want = {"int4": {"int4-g32-asym", "int8-ch"}, "int8": {"int8-ch"}}[choice]
    assert {m.packed.format for m in layers} == want
    original = copy.deepcopy(hf_model)
    ref = rtn_reference(hf_model, choice)
    gen = torch.Generator().manual_seed(7)
    ids = [torch.randint(3, 300, (n,), generator=gen).tolist() for n in (5, 9, 17, 3, 12, 30)]
    result = compare(engine, ref, ids, EXACT_TOL)
    # not vacuous: the RTN weights move the unquantized model's logprobs past EXACT_TOL and
    # 100x past the engine's gap to the reference (int8 moves them least: ~6e-3)
    with torch.inference_mode():
        x = torch.tensor([ids[-1]])
        moved = (ref(x).logits.log_softmax(-1) - original(x).logits.log_softmax(-1)).abs().max()
    assert float(moved) > max(EXACT_TOL, 100 * result["worst"])
    print(f"{arch} {choice}: {result}; RTN moved logprobs by up to {float(moved):.3g}")
