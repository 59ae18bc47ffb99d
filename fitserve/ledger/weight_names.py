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
        if spec.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (dim,)
            shapes[p + "self_attn.k_norm.weight"] = (dim,)
        shapes[p + "mlp.gate_proj.weight"] = (spec.intermediate_size, h)
        shapes[p + "mlp.up_proj.weight"] = (spec.intermediate_size, h)
        shapes[p + "mlp.down_proj.weight"] = (h, spec.intermediate_size)
    return shapes
