"""State dict -> modules: the loader of the Llama-family decoder (``fitserve.model.llama``).

``build_model`` takes the weights as loaded (Hugging Face names, each held as the formats table
says), fuses q/k/v and gate/up, swaps in the module that runs each held weight and copies the
dense rest into the model.
"""

from __future__ import annotations

import torch
from torch import nn

from fitserve.config import SUPPORTED_ARCHITECTURES, ModelSpec
from fitserve.model.fp8_linear import Fp8Linear
from fitserve.model.layers import RotaryEmbedding
from fitserve.model.linear import ConcatLinear, DenseLinear, PackedEmbedding, PackedLinear
from fitserve.model.llama import CausalLM
from fitserve.quant.fp8 import Fp8Weight
from fitserve.quant.hold import HeldTensor
from fitserve.quant.packed import PackedWeight, can_fuse, cat_rows


class UnsupportedModelError(ValueError):
    """The spec asks for something this engine does not run."""


def check_supported(spec: ModelSpec) -> None:
    if spec.architecture not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"architecture {spec.architecture!r} is not supported by the engine "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    if spec.num_experts:
        raise UnsupportedModelError("mixture-of-experts models are not supported by the engine")
    if spec.hidden_act != "silu":
        raise UnsupportedModelError(f"activation {spec.hidden_act!r} is not supported (only silu)")
    if spec.num_heads % spec.num_kv_heads:
        raise UnsupportedModelError(
            f"num_heads={spec.num_heads} is not a multiple of num_kv_heads={spec.num_kv_heads}"
        )



# A fused projection's weight: one tensor or PackedWeight, or its parts when they cannot be
# stacked into one packed tensor (formats or group sizes differ): a ConcatLinear then runs them.
FusedWeight = torch.Tensor | PackedWeight | Fp8Weight | tuple[HeldTensor, ...]


def _fuse(parts: list[HeldTensor]) -> FusedWeight:
    """Stack q/k/v (gate/up) along the output rows: dense with torch.cat, packed with cat_rows
    when kind, K, group size and symmetry agree (exact); otherwise keep the parts apart."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(parts)  # type: ignore[arg-type]
    packed = [p for p in parts if isinstance(p, PackedWeight)]
    if len(packed) == len(parts) and can_fuse(packed):
        return cat_rows(packed)
    fp8 = [p for p in parts if isinstance(p, Fp8Weight)]
    if len(fp8) == len(parts) and len({(p.fmt, p.granularity, p.K) for p in fp8}) == 1 and (
            fp8[0].granularity == "channel"):
        f = fp8[0]  # per-row scales: stacking rows is exact
        return Fp8Weight(f.fmt, "channel", sum(p.N for p in fp8), f.K,
                         torch.cat([p.data for p in fp8]), torch.cat([p.scales for p in fp8]))
    return tuple(parts)


def fuse_hf_weights(spec: ModelSpec, weights: dict[str, HeldTensor]) -> dict[str, FusedWeight]:
    """Map Hugging Face parameter names onto this module's fused q/k/v and gate/up weights."""
    out: dict[str, FusedWeight] = {}
    for name, tensor in weights.items():
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
        m = p + "mlp."
        out[m + "gate_up_proj.weight"] = _fuse([take(m + "gate_proj.weight"), take(m + "up_proj.weight")])
    if spec.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    elif "lm_head.weight" not in out:
        missing.append("lm_head.weight")
    if missing:
        raise UnsupportedModelError(f"model weights are missing tensors: {', '.join(missing[:8])}")
    return out


def _dense_linear(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> DenseLinear:
    with torch.device("meta"):
        lin = DenseLinear(weight.shape[1], weight.shape[0], bias=bias is not None)
    lin.weight = nn.Parameter(weight.to(dtype), requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias.to(dtype), requires_grad=False)
    return lin


def _held_linear(weight: FusedWeight, bias: torch.Tensor | None, dtype: torch.dtype) -> nn.Module:
    """The module that runs ``weight`` as held: PackedLinear, nn.Linear, or a ConcatLinear."""
    if isinstance(weight, PackedWeight):
        return PackedLinear(weight, None if bias is None else bias.to(dtype))
    if isinstance(weight, Fp8Weight):
        return Fp8Linear(weight, None if bias is None else bias.to(dtype))
    if isinstance(weight, torch.Tensor):
        return _dense_linear(weight, bias, dtype)
    sizes = [w.shape[0] for w in weight]
    biases = [None] * len(weight) if bias is None else list(torch.split(bias, sizes))
    return ConcatLinear([_held_linear(w, b, dtype) for w, b in zip(weight, biases, strict=True)])


def _on_device(w: FusedWeight, device: torch.device | str) -> FusedWeight:
    if isinstance(w, tuple):
        return tuple(_on_device(p, device) for p in w)  # type: ignore[misc]
    if isinstance(w, PackedWeight):
        return PackedWeight(w.kind, w.N, w.K, w.K_padded, w.group_size, w.qweight.to(device),
                            w.scales.to(device), None if w.mins is None else w.mins.to(device))
    if isinstance(w, Fp8Weight):
        return Fp8Weight(w.fmt, w.granularity, w.N, w.K, w.data.to(device), w.scales.to(device),
                         w.block)
    return w.to(device)


def _install_packed(model: CausalLM, state: dict[str, FusedWeight], dtype: torch.dtype,
                    device: torch.device | str) -> None:
    """Swap in a packed module for every weight held packed (or in parts), popping its entries
    from ``state``; the dense rest stays for load_state_dict."""
    for key in [k for k, v in state.items() if not isinstance(v, torch.Tensor)]:
        path = key.removesuffix(".weight")
        weight = _on_device(state.pop(key), device)
        if path == "embed_tokens":
            assert isinstance(weight, PackedWeight)
            emb = PackedEmbedding(weight, dtype)
            model.embed_tokens = emb  # type: ignore[assignment]
            if model.spec.tie_word_embeddings:
                model.lm_head = emb.tied_linear()  # type: ignore[assignment]  # same buffers
            continue
        bias = state.pop(path + ".bias", None)
        assert bias is None or isinstance(bias, torch.Tensor)
        model.set_submodule(path, _held_linear(weight, None if bias is None else bias.to(device),
                                               dtype))


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
    are buffers), each tensor once (tied ones are shared); not the rotary tables."""
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        skip = module._non_persistent_buffers_set
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
) -> CausalLM:
    """Instantiate the decoder on ``device`` without random init, then load ``weights``.

    Dense tensors are copied into the model (cast to ``dtype``); PackedWeights are not copied:
    their modules (PackedLinear, PackedEmbedding and the tied lm_head over the same buffers)
    take the tensors as they are, only q/k/v and gate/up are stacked (one copy of their rows).
    """
    check_supported(spec)
    with torch.device("meta"):
        model = CausalLM(spec, max_positions)
    state = fuse_hf_weights(spec, weights)
    expected = {k for k in model.state_dict() if not k.endswith(("rotary.cos", "rotary.sin"))}
    if spec.tie_word_embeddings:
        expected.discard("lm_head.weight")
    unexpected = sorted(set(state) - expected)
    absent = sorted(expected - set(state))
    if absent:
        raise UnsupportedModelError(f"model weights are missing tensors: {', '.join(absent[:8])}")
    if unexpected:
        raise UnsupportedModelError(f"model weights have unexpected tensors: {', '.join(unexpected[:8])}")
    _install_packed(model, state, dtype, device)
    _materialize(model, dtype, device)
    model.load_state_dict(state, strict=False)  # copies, casting into the model dtype
    if spec.tie_word_embeddings and isinstance(model.embed_tokens, nn.Embedding):
        model.lm_head.weight = model.embed_tokens.weight
    # The rotary tables stay fp32 whatever the model dtype (angles at long positions).
    model.rotary = RotaryEmbedding(spec, max_positions).to(device)
    for layer in model.layers:
        layer.self_attn.rotary = model.rotary
    return model.eval().requires_grad_(False)
