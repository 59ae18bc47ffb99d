"""The Hugging Face weight names (and shapes) the engine holds for a spec: the tensors the weight
ledger (``fitserve.ledger.weights``) counts and the loaders check a file against
(``fitserve.loading.weight_names.check_weights``)."""

from __future__ import annotations

from fitserve.config import GEMMA_ARCHITECTURES, ModelSpec


def expected_weight_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every Hugging Face parameter name (and shape) the engine holds for ``spec``.

    ``lm_head.weight`` appears only when embeddings are untied; biases only with
    ``attention_bias``; ``q_norm``/``k_norm`` only with ``qk_norm``; Gemma 2/3 add a norm before
    and after the MLP (``post_attention_layernorm`` is then the attention output's norm). Phi-3's
    fused ``qkv_proj`` / ``gate_up_proj`` are split into these names as they are read
    (fitserve.loading.fused_weights).
    """
    h, q, kv, dim = spec.hidden_size, spec.q_size, spec.kv_size, spec.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (spec.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, h)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if spec.architecture in GEMMA_ARCHITECTURES:
            shapes[p + "pre_feedforward_layernorm.weight"] = (h,)
            shapes[p + "post_feedforward_layernorm.weight"] = (h,)
        for name, rows in (("q", q), ("k", kv), ("v", kv)):
            shapes[f"{p}self_attn.{name}_proj.weight"] = (rows, h)
            if spec.attention_bias:
                shapes[f"{p}self_attn.{name}_proj.bias"] = (rows,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        if spec.architecture == "gpt_oss":  # o_proj bias and one sink logit per head
            shapes[p + "self_attn.o_proj.bias"] = (h,)
            shapes[p + "self_attn.sinks"] = (spec.num_heads,)
        if spec.qk_norm:  # OLMoE normalises the whole projection, the others each head
            whole = spec.qk_norm_scope == "projection"
            shapes[p + "self_attn.q_norm.weight"] = (q if whole else dim,)
            shapes[p + "self_attn.k_norm.weight"] = (kv if whole else dim,)
        if spec.num_experts and spec.is_moe_layer(i):
            shapes.update(_moe_mlp(spec, p + "mlp."))
        else:
            shapes.update(_mlp(p + "mlp.", h, spec.intermediate_size))
    return shapes


def _mlp(prefix: str, hidden: int, inter: int) -> dict[str, tuple[int, ...]]:
    return {prefix + "gate_proj.weight": (inter, hidden), prefix + "up_proj.weight": (inter, hidden),
            prefix + "down_proj.weight": (hidden, inter)}


def _moe_mlp(spec: ModelSpec, prefix: str) -> dict[str, tuple[int, ...]]:
    """A sparse layer: the router, each expert apart (as the engine holds them: only the
    active ones are read), and Qwen2-MoE's shared expert with its gate."""
    h, e, inter = spec.hidden_size, spec.num_experts, spec.expert_intermediate_size
    out: dict[str, tuple[int, ...]] = {prefix + "gate.weight": (e, h)}
    biased = spec.architecture == "gpt_oss"  # router and expert biases
    if biased:
        out[prefix + "gate.bias"] = (e,)
    for x in range(e):
        out.update(_mlp(f"{prefix}experts.{x}.", h, inter))
        if biased:
            out.update({f"{prefix}experts.{x}.{n}.bias": (r,) for n, r in (
                ("gate_proj", inter), ("up_proj", inter), ("down_proj", h))})
    if spec.shared_expert_intermediate_size:
        out.update(_mlp(prefix + "shared_expert.", h, spec.shared_expert_intermediate_size))
        out[prefix + "shared_expert_gate.weight"] = (1, h)
    return out
