"""Mixture-of-experts families vs transformers on the same random tiny weights.

Mixtral (top-2 of 8, renormalised), Qwen3-MoE (q/k norms per head, norm_topk_prob), OLMoE
(q/k norms over the whole projection, no renormalisation) and Qwen2-MoE (a shared expert
scaled by sigmoid(shared_expert_gate(x)), q/k/v bias, its first layer dense through
mlp_only_layers): hidden 64, 8 experts, top-2, 2 layers. Greedy tokens equal transformers'
for 32 tokens and every top-5 logprob is within the derived tolerance: alone, batched with
chunked prefill (chunk 7, block 4), preempted (Qwen3-MoE), from GGUF files with F16, Q8_0
and Q5_0 experts (3-D ``ffn_*_exps`` as llama.cpp writes them; the reference runs gguf-py's dequantized
experts), and from transformers 5's fused 3-D expert tensors. A batch-1 decode step runs
exactly k experts per sparse layer.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from fitserve.config import EngineConfig
from fitserve.engine.core import Engine
from fitserve.loading import LoadedModel, load_model
from fitserve.model.ggml_linear import GgmlLinear
from fitserve.model.linear import DenseLinear, PackedLinear
from fitserve.model.moe import SparseMoeBlock
from fitserve.sampling import SamplingParams

from .conftest import hf_greedy
from .moe_to_gguf import load_dequantized_experts, write_moe_gguf
from .test_new_families_vs_transformers import derived_tolerance, run  # same GREEDY params

transformers = pytest.importorskip("transformers")

NUM_TOKENS = 32
PROMPT_LENGTHS = (1, 6, 23)
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=5)
_COMMON = dict(vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)


def moe_config(arch: str) -> Any:
    tf = transformers
    if arch == "mixtral":
        return tf.MixtralConfig(**_COMMON, intermediate_size=64, num_local_experts=8,
                                num_experts_per_tok=2)
    if arch == "qwen3_moe":
        return tf.Qwen3MoeConfig(**_COMMON, intermediate_size=96, moe_intermediate_size=64,
                                 head_dim=24, num_experts=8, num_experts_per_tok=2,
                                 norm_topk_prob=True)
    if arch == "olmoe":
        return tf.OlmoeConfig(**_COMMON, intermediate_size=64, num_experts=8,
                              num_experts_per_tok=2, pad_token_id=0, eos_token_id=2)
    return tf.Qwen2MoeConfig(**_COMMON, intermediate_size=96, moe_intermediate_size=64,
                             shared_expert_intermediate_size=80, num_experts=8,
                             num_experts_per_tok=2, mlp_only_layers=[0])


def build_moe(arch: str, folder: Path, tokenizer_dir: Path | None, **overrides: Any) -> Any:
    """A random tiny model saved as an HF folder (weights scaled so logits are far from ties)."""
    torch.manual_seed(sum(map(ord, arch)))
    config = moe_config(arch)
    for key, value in overrides.items():
        setattr(config, key, value)
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.25 if "embed" in name or "lm_head" in name else 0.12)
            elif "bias" in name:
                p.normal_(0.0, 0.1)
            else:
                p.uniform_(0.6, 1.4)
    model.save_pretrained(folder)
    for f in tokenizer_dir.iterdir() if tokenizer_dir is not None else ():
        (folder / f.name).write_bytes(f.read_bytes())
    return model.eval()


@dataclass
class Family:
    arch: str
    ref: Any
    loaded: LoadedModel
    prompts: list[list[int]]
    want: list[tuple[list[int], list[torch.Tensor]]]
    tol: float


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe", "olmoe", "qwen2_moe"])
def family(request: Any, tmp_path_factory: Any, smollm2_tokenizer_dir: Path) -> Family:
    arch = request.param
    folder = tmp_path_factory.mktemp(f"tiny-{arch}")
    ref = build_moe(arch, folder, smollm2_tokenizer_dir)
    loaded = load_model(folder, dtype=torch.float32)
    rng = random.Random(arch)
    prompts = [[rng.randrange(3, 320) for _ in range(n)] for n in PROMPT_LENGTHS]
    want = [hf_greedy(ref, p, NUM_TOKENS) for p in prompts]
    return Family(arch, ref, loaded, prompts, want, derived_tolerance(ref, prompts[-1]))


def make(loaded: LoadedModel, **kw: Any) -> Engine:
    fields: dict[str, Any] = {"model": str(loaded.path), "dtype": "float32", "device": "cpu",
                              "max_model_len": 128, "num_kv_blocks": 96, "block_size": 4}
    return Engine(EngineConfig(**{**fields, **kw}), loaded=loaded)


def check(fam: Family, outs: list[Any], what: str,
          want: list[tuple[list[int], list[torch.Tensor]]] | None = None) -> None:
    for i, (out, (tokens, lps)) in enumerate(zip(outs, want or fam.want, strict=True)):
        assert out.token_ids == tokens, f"{fam.arch} {what}: prompt {i}"
        for ours, ref in zip(out.logprobs, lps, strict=True):
            for tok, lp in ours.top:
                assert abs(lp - float(ref[tok])) < fam.tol, (fam.arch, what, i, tok)


def test_spec(family: Family) -> None:
    """The expert settings read as transformers' config has them."""
    spec, cfg = family.loaded.spec, family.ref.config
    assert spec.num_experts == 8 and spec.num_experts_per_token == 2
    assert spec.norm_topk_prob == (family.arch in ("mixtral", "qwen3_moe"))
    assert spec.qk_norm_scope == ("projection" if family.arch == "olmoe" else "head")
    sparse = [i for i in range(spec.num_layers) if spec.is_moe_layer(i)]
    assert sparse == ([1] if family.arch == "qwen2_moe" else [0, 1])
    assert spec.shared_expert_intermediate_size == getattr(
        cfg, "shared_expert_intermediate_size", 0)


def test_alone(family: Family) -> None:
    check(family, run(make(family.loaded, block_size=16), family.prompts, together=False),
          "alone")


def test_batched_chunked(family: Family) -> None:
    engine = make(family.loaded, long_prefill_token_threshold=7)
    check(family, run(engine, family.prompts, together=True), "batched, chunk 7")


def test_batch1_decode_runs_k_experts(family: Family) -> None:
    """A decode step of one sequence calls exactly top-k expert modules per sparse layer
    (the others' weights are not read); prefill of 6 tokens calls each active one once."""
    engine = make(family.loaded)
    model = engine.runner.model
    calls: list[int] = []
    hooks = []
    for layer in model.layers:
        if isinstance(layer.mlp, SparseMoeBlock):
            for e, expert in enumerate(layer.mlp.experts):
                hooks.append(expert.register_forward_hook(
                    lambda m, i, o, e=e: calls.append(e)))
    sparse = sum(isinstance(layer.mlp, SparseMoeBlock) for layer in model.layers)
    engine.add_request(family.prompts[1], GREEDY, request_id="0")
    engine.step()  # the prompt
    prefill = len(calls)
    assert sparse <= prefill <= sparse * 8
    calls.clear()
    engine.step()  # one decode token
    assert len(calls) == 2 * sparse, calls
    for h in hooks:
        h.remove()


@pytest.mark.parametrize("family", ["qwen3_moe"], indirect=True)
def test_qwen3_preempted(family: Family) -> None:
    """A pool too small for all three sequences at once: some are preempted and recomputed,
    their tokens still transformers'."""
    # 33 blocks of 4 for the three finished sequences (1/6/23 + 32 tokens), 20 in the pool
    engine = make(family.loaded, num_kv_blocks=20, max_model_len=64)
    check(family, run(engine, family.prompts, together=True), "preempted")
    assert engine.scheduler.total_preemptions > 0, "vacuous: nothing was preempted"


@pytest.mark.parametrize("family", ["qwen3_moe"], indirect=True)
@pytest.mark.parametrize("expert_type", [Q.F16, Q.Q8_0, Q.Q5_0], ids=["F16", "Q8_0", "Q5_0"])
def test_gguf_round_trip(family: Family, expert_type: Q, tmp_path: Path) -> None:
    gguf_round_trip(family, expert_type, tmp_path)


@pytest.mark.parametrize("family", ["mixtral"], indirect=True)
def test_gguf_round_trip_mixtral(family: Family, tmp_path: Path) -> None:
    gguf_round_trip(family, Q.Q8_0, tmp_path)


@pytest.mark.parametrize("family", ["olmoe"], indirect=True)
@pytest.mark.parametrize("flat_gates", [False, True], ids=["converter", "quantizer"])
def test_gguf_round_trip_qwen2_moe_shared_expert(family: Family, flat_gates: bool,
                                                 tmp_path: Path) -> None:
    """Qwen2-MoE as llama.cpp writes it (every layer sparse: its graph has no dense layers):
    ffn_{gate,up,down}_shexp and ffn_gate_inp_shexp load as the shared expert and its gate,
    the gate [1, hidden] as the converter writes it or 1-D as the quantizer rewrites it."""
    ref = build_moe("qwen2_moe", tmp_path / "hf", None, mlp_only_layers=[])
    path = write_moe_gguf(ref, tmp_path / "q2.gguf", Q.F16, flat_gates=flat_gates)
    loaded = load_model(path, dtype=torch.float32)
    assert loaded.spec.shared_expert_intermediate_size == 80
    load_dequantized_experts(ref, path)  # the routed experts as the file holds them (F16)
    prompts = family.prompts[1:]
    want = [hf_greedy(ref, p, NUM_TOKENS) for p in prompts]
    fam = Family("qwen2_moe", ref, loaded, prompts, want, derived_tolerance(ref, prompts[-1]))
    check(fam, run(make(loaded), prompts, together=True), "gguf shared expert")


def gguf_round_trip(family: Family, expert_type: Q, tmp_path: Path) -> None:
    """The model as llama.cpp writes it (3-D ffn_*_exps experts; Mixtral as "llama" with Q/K
    permuted): the engine, holding the experts as stored, equals transformers on gguf-py's
    dequantization of the same experts."""
    path = write_moe_gguf(family.ref, tmp_path / f"{family.arch}.gguf", expert_type)
    loaded = load_model(path, dtype=torch.float32, weights="as-stored")
    assert loaded.spec.architecture == family.arch
    assert loaded.stored_formats["model.layers.1.mlp.experts.7.down_proj.weight"] == (
        expert_type.name)
    ref = build_moe(family.arch, tmp_path / "hf", None)
    load_dequantized_experts(ref, path)
    want = [hf_greedy(ref, p, NUM_TOKENS) for p in family.prompts]
    engine = make(loaded, long_prefill_token_threshold=7)
    # each expert held as stored: F16 dequantized, Q8_0 as packed int8, Q5_0 as its ggml blocks
    held = {Q.F16: DenseLinear, Q.Q8_0: PackedLinear, Q.Q5_0: GgmlLinear}[expert_type]
    assert type(engine.runner.model.layers[1].mlp.experts[5].down_proj) is held
    check(family, run(engine, family.prompts, together=True), f"gguf {expert_type.name}", want)


@pytest.mark.parametrize("family", ["olmoe"], indirect=True)
def test_fused_3d_checkpoint(family: Family, tmp_path: Path) -> None:
    """transformers 5's own parameters (experts.gate_up_proj [E, 2I, H], experts.down_proj
    [E, H, I]) saved as they are load into the same per-expert weights."""
    from safetensors.torch import save_file

    folder = family.loaded.path
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if (folder / f).is_file():
            (tmp_path / f).write_bytes((folder / f).read_bytes())
    state = {k: v.contiguous() for k, v in family.ref.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, str(tmp_path / "model.safetensors"))
    fused = load_model(tmp_path, dtype=torch.float32)
    assert fused.weights.keys() == family.loaded.weights.keys()
    for name, w in family.loaded.weights.items():
        assert torch.equal(fused.weights[name], w), name  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2_moe"], indirect=True)
def test_tensor_parallel_2(family: Family) -> None:
    """--tp 2 (two gloo processes): every expert's and the shared expert's gate/up split by
    rows, down by columns, one all-reduce of the block's output; a dense mlp_only layer
    beside. Greedy tokens are transformers', and the collectives are 2 per layer."""
    from fitserve.dist.layout import rank_spec

    engine = Engine(EngineConfig(model=str(family.loaded.path), dtype="float32", device="cpu",
                                 max_model_len=128, num_kv_blocks=96, block_size=4,
                                 tensor_parallel_size=2))
    try:
        shard = rank_spec(family.loaded.spec, 2, 0)
        assert (shard.moe_intermediate_size, shard.shared_expert_intermediate_size) == (32, 40)
        moe = engine.runner.model.model.layers[1].mlp.inner
        assert isinstance(moe, SparseMoeBlock)
        assert moe.experts[3].down_proj.weight.shape == (64, 32)
        outs = run(engine, family.prompts[1:], together=True)
        for out, (tokens, _) in zip(outs, family.want[1:], strict=True):
            assert out.token_ids == tokens
        # the ledger's collectives (dense-layer arithmetic: 2 per layer) are the engine's
        measured = engine.tp_group.comm.counts  # type: ignore[union-attr]
        for kind, led in engine.runner.ledger.items():  # type: ignore[attr-defined]
            assert (measured[kind].calls, measured[kind].bytes) == (led.calls, led.bytes), kind
        steps = measured["embedding all_reduce"].calls
        assert measured["layer all_reduce"].calls == 2 * 2 * steps
    finally:
        engine.shutdown()


@pytest.mark.parametrize("family", ["qwen3_moe"], indirect=True)
def test_draft_model_speculation_and_compile_fallback(family: Family,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """The MoE model drafting for itself: every draft accepted, transformers' tokens (drafts
    and verification rows run through the expert block); --compile runs the MoE decode step
    eager and says why."""
    plain = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    engine = make(family.loaded, speculative_config={
        "method": "draft_model", "model": str(family.loaded.path), "num_speculative_tokens": 3})
    ids = [engine.add_request(p, plain) for p in family.prompts[1:]]
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    assert [done[i] for i in ids] == [tokens for tokens, _ in family.want[1:]]
    st = engine.spec_stats
    assert st is not None and st.num_drafts > 0 and st.num_accepted_tokens == st.num_draft_tokens
    with caplog.at_level("WARNING"):
        assert make(family.loaded, enforce_eager=False).runner.compiled is None
    assert "mixture-of-experts model runs eager" in caplog.text
