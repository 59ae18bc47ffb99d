"""State dict -> modules: the loader of the Llama-family decoder (``fitserve.model.llama``).

``build_model`` takes the weights as loaded (Hugging Face names, each held as the formats table
says), fuses q/k/v and gate/up, swaps in the module that runs each held weight and copies the
dense rest into the model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from fitserve.config import GEMMA_ARCHITECTURES, ModelSpec
from fitserve.loading.support import spec_problems
from fitserve.model.fp8_linear import Fp8Linear
from fitserve.model.gemma import GemmaCausalLM
from fitserve.model.ggml_linear import GgmlEmbedding, GgmlLinear
from fitserve.model.gpt_oss import GptOssCausalLM
from fitserve.model.linear import (
    ConcatLinear,
    DenseLinear,
    PackedEmbedding,
    PackedLinear,
    prepack_linears,
)
from fitserve.model.llama import CausalLM
from fitserve.model.permuted_linear import InputPermutedLinear
from fitserve.quant.fp8 import Fp8Weight
from fitserve.quant.ggml_blocks import GgmlBlockWeight
from fitserve.quant.held import DenseWeight, HeldTensor, HeldWeight, as_held, as_stored
from fitserve.quant.packed import PackedWeight
from fitserve.quant.permuted import InputPermutedWeight


class UnsupportedModelError(ValueError):
    """The spec asks for something this engine does not run."""


def check_supported(spec: ModelSpec) -> None:
    """Raise naming every part of ``spec`` the model code cannot run (loading.support)."""
    problems = spec_problems(spec)
    if problems:
        raise UnsupportedModelError("; ".join(problems))


def model_class(spec: ModelSpec) -> type[CausalLM] | type[GemmaCausalLM]:
    """The decoder module of a family: Gemma 2/3 (fitserve.model.gemma), gpt-oss
    (fitserve.model.gpt_oss), else the Llama-family one (fitserve.model.llama: Llama, Mistral,
    Qwen2/3, and Phi-3, whose fused checkpoint tensors are split at load and whose LongRoPE is
    a rotary table)."""
    if spec.architecture == "gpt_oss":
        return GptOssCausalLM
    return GemmaCausalLM if spec.architecture in GEMMA_ARCHITECTURES else CausalLM


# The module that runs each held format (vLLM's quantize method of a layer): a new format is
# its HeldWeight class (fitserve.quant), its module (fitserve.model) and one entry here.
LINEAR_MODULES: dict[type[HeldWeight], Callable[[Any, torch.Tensor | None, torch.dtype],
                                                nn.Module]] = {
    DenseWeight: DenseLinear.from_held,
    PackedWeight: lambda w, bias, dtype: PackedLinear(w, bias),
    Fp8Weight: lambda w, bias, dtype: Fp8Linear(w, bias),
    GgmlBlockWeight: lambda w, bias, dtype: GgmlLinear(w, bias),
    InputPermutedWeight: lambda w, bias, dtype: InputPermutedLinear(w, bias),
}

# A fused projection's weight: one held weight (a dense one as its tensor), or its parts when
# they cannot be stacked into one tensor of a format (formats or group sizes differ): a
# ConcatLinear then runs them.
FusedWeight = HeldTensor | tuple[HeldWeight, ...]


def _fuse(parts: list[HeldTensor]) -> FusedWeight:
    """Stack q/k/v (gate/up) along the output rows where the format can do it exactly
    (``HeldWeight.fuse``); otherwise keep the parts apart."""
    held = [as_held(p) for p in parts]
    fused = held[0].fuse(held[1:])
    return tuple(held) if fused is None else as_stored(fused)


def fuse_hf_weights(spec: ModelSpec, weights: dict[str, HeldTensor], *,
                    consume: bool = False) -> dict[str, FusedWeight]:
    """Map Hugging Face parameter names onto this module's fused q/k/v and gate/up weights.

    ``consume``: empty ``weights`` (the caller hands them over), so each q/k/v or gate/up part
    is freed as soon as its fused copy exists.

    NOTE: otherwise the caller's dict keeps every part alive until the model is built, and the
    load peaks at the weights plus every fused copy (a 1.7B Q8_0 file: +1.1 GiB, 13% over the
    ledger's bound); consumed, the peak is the weights plus one layer's fused projection."""
    out: dict[str, FusedWeight] = {}
    for name in list(weights):
        tensor = weights.pop(name) if consume else weights[name]
        if name.startswith("model."):
            name = name[len("model.") :]
        out[name] = tensor
    missing: list[str] = []

    def take(key: str) -> HeldTensor:
        if key not in out:
            missing.append(key)
            return torch.empty(0)
        held = out.pop(key)
        assert not isinstance(held, tuple)
        return held

    for i in range(spec.num_layers):
        p = f"layers.{i}."
        a = p + "self_attn."
        out[a + "qkv_proj.weight"] = _fuse([take(a + f"{x}_proj.weight") for x in "qkv"])
        if spec.attention_bias:
            out[a + "qkv_proj.bias"] = _fuse([take(a + f"{x}_proj.bias") for x in "qkv"])
        for m in _gated_mlps(spec, i):
            out[m + "gate_up_proj.weight"] = _fuse([take(m + "gate_proj.weight"),
                                                    take(m + "up_proj.weight")])
            if m + "gate_proj.bias" in out:  # gpt-oss's experts
                out[m + "gate_up_proj.bias"] = _fuse([take(m + "gate_proj.bias"),
                                                      take(m + "up_proj.bias")])
    if spec.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    elif "lm_head.weight" not in out:
        missing.append("lm_head.weight")
    if missing:
        raise UnsupportedModelError(f"model weights are missing tensors: {', '.join(missing[:8])}")
    return out


def _gated_mlps(spec: ModelSpec, layer: int) -> list[str]:
    """The prefixes of layer ``layer``'s SwiGLU MLPs whose gate/up are fused: the dense MLP,
    or each expert (and the shared expert) of a sparse layer."""
    m = f"layers.{layer}.mlp."
    if not spec.is_moe_layer(layer):
        return [m]
    shared = [m + "shared_expert."] if spec.shared_expert_intermediate_size else []
    return [f"{m}experts.{e}." for e in range(spec.num_experts)] + shared


def make_linear(weight: HeldWeight | tuple[HeldWeight, ...], bias: torch.Tensor | None,
                dtype: torch.dtype) -> nn.Module:
    """The module that runs ``weight`` as held (``LINEAR_MODULES``), or a ConcatLinear of its
    parts; ``bias`` is cast to ``dtype``."""
    bias = None if bias is None else bias.to(dtype)
    if isinstance(weight, tuple):
        sizes = [w.out_features for w in weight]
        biases = [None] * len(weight) if bias is None else list(torch.split(bias, sizes))
        return ConcatLinear([make_linear(w, b, dtype) for w, b in zip(weight, biases, strict=True)])
    return LINEAR_MODULES[type(weight)](weight, bias, dtype)


def _install_held(model: CausalLM | GemmaCausalLM, state: dict[str, FusedWeight], dtype: torch.dtype,
                    device: torch.device | str) -> None:
    """Swap in its module for every weight held in another format than a dense tensor (or in
    parts), popping its entries from ``state``; the dense rest stays for load_state_dict."""
    for key in [k for k, v in state.items() if not isinstance(v, torch.Tensor)]:
        path = key.removesuffix(".weight")
        held = state.pop(key)
        assert not isinstance(held, torch.Tensor)
        weight = tuple(p.to(device) for p in held) if isinstance(held, tuple) else held.to(device)
        if path == "embed_tokens":
            assert isinstance(weight, PackedWeight | GgmlBlockWeight)
            emb = (GgmlEmbedding(weight, dtype) if isinstance(weight, GgmlBlockWeight)
                   else PackedEmbedding(weight, dtype))
            model.embed_tokens = emb  # type: ignore[assignment]
            if model.spec.tie_word_embeddings:
                model.lm_head = emb.tied_linear()  # type: ignore[assignment]  # same buffers
            continue
        bias = state.pop(path + ".bias", None)
        assert bias is None or isinstance(bias, torch.Tensor)
        model.set_submodule(path, make_linear(weight, None if bias is None else bias.to(device),
                                              dtype))


_INIT_OPS = ("uniform_", "normal_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_",
             "xavier_uniform_", "xavier_normal_", "constant_", "ones_", "zeros_")


@contextlib.contextmanager
def _no_init_ops() -> Iterator[None]:
    """torch.nn.init's fills as no-ops while the decoder is built on the meta device.

    NOTE: every weight is then replaced by the file's; an init op on a meta tensor still runs
    its Python decomposition (torch._refs), whose first use imports torch._dynamo: ~1 s of
    every start-up (transformers' ``no_init_weights`` skips them the same way).
    """
    saved = {name: getattr(nn.init, name) for name in _INIT_OPS}
    try:
        for name in _INIT_OPS:
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def _materialize(model: nn.Module, dtype: torch.dtype, device: torch.device | str) -> None:
    """Allocate every parameter/buffer still on the meta device (float ones in ``dtype``); a
    tensor shared by two modules (tied weights) stays one tensor."""
    made: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in list(table.items()):
                if t is None or not t.is_meta:
                    continue
                if id(t) not in made:
                    dt = dtype if t.is_floating_point() else t.dtype
                    new = torch.empty(t.shape, dtype=dt, device=device)
                    made[id(t)] = nn.Parameter(new, requires_grad=False) if isinstance(
                        t, nn.Parameter) else new
                table[name] = made[id(t)]  # type: ignore[assignment]


def held_weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights a model holds: parameters and persistent buffers (packed tensors
    are buffers) and the packed linears' prepacked ``panels``, each tensor once (tied ones are
    shared); not the rotary tables."""
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        skip = module._non_persistent_buffers_set - {"panels"}
        named = [*module._parameters.items(),
                 *((n, b) for n, b in module._buffers.items() if n not in skip)]
        for _, t in named:
            if t is not None and id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
    return total


def build_model(
    spec: ModelSpec,
    weights: dict[str, HeldTensor],
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    max_positions: int,
    consume: bool = False,
) -> CausalLM | GemmaCausalLM:
    """Instantiate the decoder on ``device`` without random init, then load ``weights``
    (``consume``: taking them out of the dict as it goes, see ``fuse_hf_weights``).

    Dense tensors are copied into the model (cast to ``dtype``); PackedWeights are not copied:
    their modules (PackedLinear, PackedEmbedding and the tied lm_head over the same buffers)
    take the tensors as they are, only q/k/v and gate/up are stacked (one copy of their rows).
    """
    check_supported(spec)
    with torch.device("meta"), _no_init_ops():
        model = model_class(spec)(spec, max_positions)
    state = fuse_hf_weights(spec, weights, consume=consume)
    expected = {k for k in model.state_dict() if not k.endswith(("rotary.cos", "rotary.sin"))}
    if spec.tie_word_embeddings:
        expected.discard("lm_head.weight")
    unexpected = sorted(set(state) - expected)
    absent = sorted(expected - set(state))
    if absent:
        raise UnsupportedModelError(f"model weights are missing tensors: {', '.join(absent[:8])}")
    if unexpected:
        raise UnsupportedModelError(f"model weights have unexpected tensors: {', '.join(unexpected[:8])}")
    _install_held(model, state, dtype, device)
    _materialize(model, dtype, device)
    model.load_state_dict(state, strict=False)  # copies, casting into the model dtype
    if spec.tie_word_embeddings and isinstance(model.embed_tokens, nn.Embedding):
        model.lm_head.weight = model.embed_tokens.weight
    model.install_rotary(max_positions, device)
    prepack_linears(model)  # the M > 1 layout, once (the ledger counts it: panel_bytes)
    return model.eval().requires_grad_(False)
