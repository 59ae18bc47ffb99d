"""gpt-oss vs transformers on the same random tiny weights.

GptOssConfig with odd shapes (hidden 96, 6 query heads / 2 KV heads of 16, 6 experts of
width 64, top-2, 3 layers sliding / full / sliding with a window of 5 under the 23-token
prompt), nonzero attention sinks, YaRN active (factor 4 over an original context of 16,
truncate False as gpt-oss ships), biases everywhere transformers has them. Greedy tokens equal
transformers' for 32 tokens and every top-5 logprob is within the derived tolerance: alone,
batched with chunked prefill (chunk 7, block 4), preempted, with n-gram speculation, from
GGUF and HF MXFP4 experts, and at --tp 2 on the MXFP4 checkpoint; in bf16 the pooled top-5
logprob error stays within transformers' own bf16 spread.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from fitserve.loading import load_model
from fitserve.model.attention.gather import EagerGather
from fitserve.sampling import SamplingParams

from .conftest import hf_greedy
from .test_moe_vs_transformers import NUM_TOKENS, Family, check, make
from .test_new_families_vs_transformers import derived_tolerance, run

transformers = pytest.importorskip("transformers")

PROMPT_LENGTHS = (1, 6, 23)
WINDOW = 5
YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
        "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16}


def gpt_oss_config(**overrides: Any) -> Any:
    fields: dict[str, Any] = dict(
        vocab_size=320, hidden_size=96, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=6, num_key_value_heads=2, head_dim=16, num_local_experts=6,
        num_experts_per_tok=2, sliding_window=WINDOW, max_position_embeddings=256,
        rope_parameters=dict(YARN), tie_word_embeddings=False)
    return transformers.GptOssConfig(**{**fields, **overrides})


@torch.no_grad()
def build_gpt_oss(folder: Path, tokenizer_dir: Path | None, seed: int = 39, **overrides: Any) -> Any:
    """A random tiny gpt-oss saved as an HF folder (weights scaled so logits are far from ties,
    sinks in [-1, 2]: some heads give the sink most of the weight, some little); ``overrides``
    set config fields."""
    torch.manual_seed(seed)
    config = gpt_oss_config(**overrides)
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for name, p in model.named_parameters():
        if name.endswith("sinks"):
            p.uniform_(-1.0, 2.0)
        elif "bias" in name:
            p.normal_(0.0, 0.1)
        elif p.dim() >= 2:
            p.normal_(0.0, 0.25 if "embed" in name or "lm_head" in name else 0.12)
        else:
            p.uniform_(0.6, 1.4)
    model.save_pretrained(folder)
    for f in tokenizer_dir.iterdir() if tokenizer_dir is not None else ():
        (folder / f.name).write_bytes(f.read_bytes())
    return model.eval()


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: Any, smollm2_tokenizer_dir: Path) -> Family:
    folder = tmp_path_factory.mktemp("tiny-gpt-oss")
    ref = build_gpt_oss(folder, smollm2_tokenizer_dir)
    loaded = load_model(folder, dtype=torch.float32)
    rng = random.Random("gpt_oss")
    prompts = [[rng.randrange(3, 320) for _ in range(n)] for n in PROMPT_LENGTHS]
    want = [hf_greedy(ref, p, NUM_TOKENS) for p in prompts]
    return Family("gpt_oss", ref, loaded, prompts, want, derived_tolerance(ref, prompts[-1]))


def test_spec(gpt_oss: Family) -> None:
    """The config read as transformers reads it: experts, window per layer, YaRN."""
    spec = gpt_oss.loaded.spec
    assert (spec.num_experts, spec.num_experts_per_token, spec.expert_intermediate_size) == (
        6, 2, 64)
    assert spec.layer_types == ("sliding", "full", "sliding") and spec.sliding_window == WINDOW
    rs = spec.rope_scaling
    assert rs is not None and rs.kind == "yarn" and not rs.truncate
    rotary = gpt_oss.ref.model.rotary_emb
    assert rs.attention_factor == pytest.approx(rotary.attention_scaling, rel=1e-12)


def test_yarn_table_is_transformers(gpt_oss: Family) -> None:
    """The engine's fp32 cos/sin rows are transformers' GptOssRotaryEmbedding's, bit for bit."""
    from fitserve.model.layers import RotaryEmbedding

    ours = RotaryEmbedding(gpt_oss.loaded.spec, 64)
    pos = torch.arange(64).unsqueeze(0)
    cos, sin = gpt_oss.ref.model.rotary_emb(torch.zeros(1, dtype=torch.float32), pos)
    assert torch.equal(ours.cos, cos[0]) and torch.equal(ours.sin, sin[0])


def test_alone(gpt_oss: Family) -> None:
    """The 23-token prompt alone (its window of 5 slides over the prompt and the decode)."""
    engine = make(gpt_oss.loaded, block_size=16)
    alone = Family(gpt_oss.arch, gpt_oss.ref, gpt_oss.loaded, gpt_oss.prompts[2:],
                   gpt_oss.want[2:], gpt_oss.tol)
    check(alone, run(engine, alone.prompts, together=False), "alone")


def test_batched_chunked(gpt_oss: Family) -> None:
    """Three prompts at once, chunks of 7 over blocks of 4: the sliding layers' group frees
    blocks behind the window while the full layers keep theirs; EagerGather applies the sinks."""
    engine = make(gpt_oss.loaded, long_prefill_token_threshold=7)
    runner = engine.runner
    assert runner.sinks and set(runner.group_windows) == {None, WINDOW}
    assert isinstance(runner._backend([1], [9]), EagerGather)
    check(gpt_oss, run(engine, gpt_oss.prompts, together=True), "batched, chunk 7")


def test_sinks_matter(gpt_oss: Family) -> None:
    """Not vacuous: the same engine with the sinks at -inf (no sink, plain softmax) is far
    from transformers' logprobs."""
    engine = make(gpt_oss.loaded, block_size=16)
    for layer in engine.runner.model.layers:
        layer.self_attn.sinks.fill_(-1e30)
    outs = run(engine, gpt_oss.prompts[2:], together=False)
    tokens, lps = gpt_oss.want[2]
    worst = max(abs(lp - float(ref[tok])) for ours, ref in zip(outs[0].logprobs, lps, strict=False)
                for tok, lp in ours.top)
    assert worst > 10 * gpt_oss.tol


def test_preempted(gpt_oss: Family) -> None:
    """A pool too small for two sequences at once (20 blocks of 4; they end at 38 and 55
    tokens): one is preempted and recomputed, every token and logprob transformers'."""
    engine = make(gpt_oss.loaded, num_kv_blocks=20, max_model_len=64)
    fam = Family(gpt_oss.arch, gpt_oss.ref, gpt_oss.loaded, gpt_oss.prompts[1:],
                 gpt_oss.want[1:], gpt_oss.tol)
    check(fam, run(engine, fam.prompts, together=True), "preempted")
    assert engine.scheduler.total_preemptions > 0, "vacuous: nothing was preempted"


def test_ngram_speculative_decoding(gpt_oss: Family) -> None:
    """n-gram drafts verified over the sliding and full layers: greedy tokens unchanged
    (transformers'), and drafts were proposed and some accepted (logprobs off: a request
    asking for them does not speculate)."""
    plain = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    engine = make(gpt_oss.loaded, speculative_config={"method": "ngram",
                                                      "num_speculative_tokens": 3})
    ids = [engine.add_request(p, plain) for p in gpt_oss.prompts[1:]]
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    assert [done[i] for i in ids] == [tokens for tokens, _ in gpt_oss.want[1:]]
    st = engine.spec_stats
    assert st is not None and st.num_drafts > 0 and st.num_accepted_tokens > 0


@torch.no_grad()
def test_bf16_within_transformers_bf16_spread(gpt_oss: Family) -> None:
    """bf16 weights and activations: along the engine's own greedy path, its top-5 logprobs
    differ from transformers' fp32 by no more than transformers' bf16 does (mean and median
    over every entry, x1.5), and its tokens are fp32's argmax as often (within 2 of 96).
    NOTE: pooled statistics, not a per-entry bound: bf16 flips a near-tied expert choice
    now and then (transformers' own bf16 moves single entries by up to ~2.6 nats here); a
    wrong rule moves the mean by ~1 nat (the sinks dropped: 10-20x the bound)."""
    loaded = load_model(gpt_oss.loaded.path, dtype=torch.bfloat16)
    outs = run(make(loaded, dtype="bfloat16"), gpt_oss.prompts, together=True)
    ref16 = copy.deepcopy(gpt_oss.ref).to(torch.bfloat16)
    ours, theirs, agree = [], [], [0, 0]
    for prompt, out in zip(gpt_oss.prompts, outs, strict=True):
        seq = torch.tensor([prompt + out.token_ids])
        lp32, lp16 = (m(seq).logits[0, len(prompt) - 1 : -1].double().log_softmax(-1)
                      for m in (gpt_oss.ref, ref16))
        for step, top in enumerate(out.logprobs):
            for tok, lp in top.top:
                ours.append(abs(lp - float(lp32[step, tok])))
                theirs.append(abs(float(lp16[step, tok] - lp32[step, tok])))
        best = lp32.argmax(-1).tolist()
        agree[0] += sum(a == b for a, b in zip(best, out.token_ids, strict=True))
        agree[1] += sum(a == b for a, b in zip(best, lp16.argmax(-1).tolist(), strict=True))
    a, b = torch.tensor(ours), torch.tensor(theirs)
    print(f"bf16 |ours - fp32| mean {a.mean():.4f} median {a.median():.4f}; transformers bf16 "
          f"mean {b.mean():.4f} median {b.median():.4f}; argmax agreement {agree}")
    assert a.mean() <= 1.5 * b.mean() and a.median() <= 1.5 * b.median()
    assert agree[0] >= agree[1] - 2


def reference_with_llama_cpp_yarn(ref: Any) -> None:
    """transformers' model, its YaRN ramp truncated as llama.cpp's ggml_rope_yarn_corr_dims
    always does (a GGUF file runs as llama.cpp runs it)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    ref.config.rope_parameters = {**ref.config.rope_parameters, "truncate": True}
    ref.model.rotary_emb = GptOssRotaryEmbedding(ref.config)


def test_gguf_mxfp4_experts(gpt_oss: Family, tmp_path: Path,
                            capsys: pytest.CaptureFixture[str]) -> None:
    """gpt-oss as llama.cpp writes it (arch "gpt-oss", attn_sinks.weight, ffn_gate_inp with a
    bias, 3-D ffn_{gate,up,down}_exps in MXFP4 with 2-D biases, yarn metadata): the support
    check runs it, the experts are held as the file's MXFP4 blocks (GgmlLinear, 4.25 bits),
    `fitserve plan FILE --gpu cpu` counts the very bytes the engine holds, and the engine
    equals transformers running gguf-py's dequantization of the same blocks."""
    from gguf import GGMLQuantizationType as Q

    from fitserve.loading.gguf_spec import read_gguf_header
    from fitserve.loading.support import gguf_support
    from fitserve.model.ggml_linear import GgmlLinear

    from .moe_to_gguf import load_dequantized_experts, write_moe_gguf
    from .test_plan_engine_agree import held_by_model
    from .test_plan_engine_packed import plan_weights

    path = write_moe_gguf(gpt_oss.ref, tmp_path / "gpt-oss.gguf", Q.MXFP4)
    assert gguf_support(read_gguf_header(path)).missing == ()
    loaded = load_model(path, dtype=torch.float32, weights="as-stored")
    spec = loaded.spec
    assert spec.architecture == "gpt_oss" and spec.layer_types == ("sliding", "full", "sliding")
    assert spec.rope_scaling is not None and spec.rope_scaling.truncate
    assert loaded.stored_formats["model.layers.2.mlp.experts.5.down_proj.weight"] == "MXFP4"
    ref = build_gpt_oss(tmp_path / "hf", None)
    reference_with_llama_cpp_yarn(ref)
    load_dequantized_experts(ref, path)
    prompts = gpt_oss.prompts[1:]
    want = [hf_greedy(ref, p, NUM_TOKENS) for p in prompts]
    engine = make(loaded, long_prefill_token_threshold=7)
    expert = engine.runner.model.layers[2].mlp.experts[5]
    assert isinstance(expert.down_proj, GgmlLinear) and expert.down_proj.ggml_type == "MXFP4"
    assert expert.down_proj.blocks.numel() * 8 == 96 * 64 * 4.25  # 4.25 bits per weight
    assert plan_weights(capsys, path, "as-stored")["weight_bytes"] == held_by_model(engine)[0]
    fam = Family(gpt_oss.arch, ref, loaded, prompts, want, gpt_oss.tol)
    check(fam, run(engine, prompts, together=True), "gguf MXFP4")


def write_mxfp4_folder(ref: Any, src: Path, dst: Path) -> dict[str, torch.Tensor]:
    """``ref`` saved as gpt-oss checkpoints ship: experts as MXFP4 ``*_blocks`` / ``*_scales``
    (rows quantized by gguf-py, moved into transformers' nibble order), quant_method mxfp4;
    the rest as ``src`` has it. Returns the checkpoint's MXFP4 tensors."""
    import json

    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quantize
    from safetensors.torch import save_file

    from tests.unit.quant.test_mxfp4 import ggml_to_hf

    state = {k: v.contiguous() for k, v in ref.state_dict().items()}
    mx: dict[str, torch.Tensor] = {}
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        rows = state.pop(name).transpose(1, 2).contiguous().numpy()  # [E, out, in]
        blocks, scales = ggml_to_hf(quantize(rows, Q.MXFP4))
        mx[f"{name}_blocks"], mx[f"{name}_scales"] = map(torch.from_numpy, (blocks, scales))
    save_file({**state, **mx}, str(dst / "model.safetensors"))
    for f in src.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            (dst / f.name).write_bytes(f.read_bytes())
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (dst / "config.json").write_text(json.dumps(config))
    return mx


@dataclass
class Mxfp4Folder:
    """The tiny gpt-oss as an MXFP4 checkpoint, and transformers' tokens on it (its experts
    its own dequantization of the same blocks and scales)."""

    path: Path
    loaded: Any
    fam: Family


@pytest.fixture(scope="module")
def mxfp4(gpt_oss: Family, tmp_path_factory: Any) -> Mxfp4Folder:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    folder = tmp_path_factory.mktemp("tiny-gpt-oss-mxfp4")
    mx = write_mxfp4_folder(gpt_oss.ref, gpt_oss.loaded.path, folder)
    ref = build_gpt_oss(folder / "ref", None)
    with torch.no_grad():
        for i, layer in enumerate(ref.model.layers):
            for proj in ("gate_up_proj", "down_proj"):
                stem = f"model.layers.{i}.mlp.experts.{proj}"
                getattr(layer.mlp.experts, proj).copy_(convert_moe_packed_tensors(
                    mx[f"{stem}_blocks"], mx[f"{stem}_scales"], dtype=torch.float32))
    prompts = gpt_oss.prompts[1:]
    want = [hf_greedy(ref, p, NUM_TOKENS) for p in prompts]
    loaded = load_model(folder, dtype=torch.float32, weights="as-stored")
    return Mxfp4Folder(folder, loaded, Family(gpt_oss.arch, ref, loaded, prompts, want, gpt_oss.tol))


def test_hf_mxfp4_checkpoint(mxfp4: Mxfp4Folder, capsys: pytest.CaptureFixture[str]) -> None:
    """An HF folder with MXFP4 experts (quant_method mxfp4): held as MXFP4 blocks (the bytes
    `fitserve plan FOLDER --gpu cpu` counts), the engine equals transformers whose experts are
    its own dequantization of the same blocks and scales
    (integrations.mxfp4.convert_moe_packed_tensors, on the CPU)."""
    from fitserve.loading.support import hf_support
    from fitserve.model.ggml_linear import GgmlLinear

    from .test_plan_engine_agree import held_by_model
    from .test_plan_engine_packed import plan_weights

    assert hf_support(mxfp4.path / "config.json").runnable
    loaded = mxfp4.loaded
    assert loaded.stored_formats["model.layers.1.mlp.experts.3.up_proj.weight"] == "MXFP4"
    engine = make(loaded, long_prefill_token_threshold=7)
    assert isinstance(engine.runner.model.layers[1].mlp.experts[3].gate_up_proj, GgmlLinear)
    assert plan_weights(capsys, mxfp4.path, "as-stored")["weight_bytes"] == held_by_model(engine)[0]
    check(mxfp4.fam, run(engine, mxfp4.fam.prompts, together=True), "hf MXFP4")


@pytest.mark.slow
def test_tensor_parallel_2_mxfp4(mxfp4: Mxfp4Folder) -> None:
    """--tp 2 (two gloo processes) on the MXFP4 checkpoint: each rank holds 3 of the 6 query
    heads and their sinks, every expert's gate/up rows and down columns [32 r, 32 r + 32) as
    whole MXFP4 blocks, the router whole, o_proj's and the experts' down biases on rank 0 only;
    sliding and full KV groups on both ranks (the step message carries every group's table).
    Greedy tokens and top-5 logprobs are transformers', and the all-reduces are the ledger's
    (2 per layer + 1 per step)."""
    from fitserve.model.ggml_linear import GgmlLinear

    engine = make(mxfp4.loaded, long_prefill_token_threshold=7, tensor_parallel_size=2,
                  weights="as-stored")
    try:
        layer = engine.runner.model.model.layers[1]
        assert layer.self_attn.sinks.shape == (3,) and engine.runner.sinks
        down = layer.mlp.inner.experts[4].down_proj
        assert isinstance(down, GgmlLinear) and down.ggml_type == "MXFP4"
        assert (down.out_features, down.in_features) == (96, 32)
        assert not layer.self_attn.o_proj.inner.bias.eq(0).all()  # rank 0 adds the bias
        check(mxfp4.fam, run(engine, mxfp4.fam.prompts, together=True), "tp 2 MXFP4")
        measured = engine.tp_group.comm.counts  # type: ignore[union-attr]
        for kind, led in engine.runner.ledger.items():  # type: ignore[attr-defined]
            assert (measured[kind].calls, measured[kind].bytes) == (led.calls, led.bytes), kind
        steps = measured["embedding all_reduce"].calls
        assert measured["layer all_reduce"].calls == 2 * 3 * steps > 0
    finally:
        engine.shutdown()


def test_int8_kv_cache_on_sliding_and_full_groups(gpt_oss: Family) -> None:
    """int8 KV with its default per-channel key scales over the sliding and full layer groups:
    the engine builds (the builder refuses a cache that holds other bytes than the ledger's
    groups, which once left out the groups' per-block key scales) and decodes close to
    transformers (int8 KV moves logprobs by far less than the sinks do)."""
    engine = make(gpt_oss.loaded, block_size=16, kv_cache_dtype="int8")
    assert engine.runner.kv_cache_bytes > 0
    (out,) = run(engine, gpt_oss.prompts[2:], together=False)
    assert out.token_ids[:4] == gpt_oss.want[2][0][:4]


@pytest.mark.slow
def test_tensor_parallel_2_gguf_mxfp4(gpt_oss: Family, tmp_path: Path) -> None:
    """--tp 2 (two gloo processes) on gpt-oss written as llama.cpp writes it (3-D MXFP4
    ``ffn_*_exps``): each rank's experts hold down_proj columns [32 r, 32 r + 32) as whole
    MXFP4 blocks of the file, and greedy tokens and top-5 logprobs are transformers' on
    gguf-py's dequantization of the same blocks (as test_gguf_mxfp4_experts at --tp 1)."""
    from gguf import GGMLQuantizationType as Q

    from fitserve.model.ggml_linear import GgmlLinear

    from .moe_to_gguf import load_dequantized_experts, write_moe_gguf

    path = write_moe_gguf(gpt_oss.ref, tmp_path / "gpt-oss.gguf", Q.MXFP4)
    loaded = load_model(path, dtype=torch.float32, weights="as-stored")
    ref = build_gpt_oss(tmp_path / "hf", None)
    reference_with_llama_cpp_yarn(ref)
    load_dequantized_experts(ref, path)
    prompts = gpt_oss.prompts[1:]
    fam = Family(gpt_oss.arch, ref, loaded, prompts,
                 [hf_greedy(ref, p, NUM_TOKENS) for p in prompts], gpt_oss.tol)
    engine = make(loaded, long_prefill_token_threshold=7, tensor_parallel_size=2,
                  weights="as-stored")
    try:
        down = engine.runner.model.model.layers[2].mlp.inner.experts[5].down_proj
        assert isinstance(down, GgmlLinear) and down.ggml_type == "MXFP4"
        assert (down.out_features, down.in_features) == (96, 32)
        check(fam, run(engine, prompts, together=True), "tp 2 GGUF MXFP4")
    finally:
        engine.shutdown()
