"""Parameter counts from a ModelSpec, tensor by tensor.

Every weight of the model is listed once as a :class:`Tensor` (shape, how many copies, how
tensor parallelism splits it, whether a token uses it); counts, weight bytes and FLOPs are all
sums over that one list.

How parameters are split (``ParamCount``):
- ``matmul``: every weight that multiplies an activation: projections, MLP/expert matrices,
  routers and the lm_head. NOTE: with tied embeddings the one V x H matrix is both the input
  lookup table and the output matmul; it is counted once, as a matmul parameter, because the
  lm_head matmul costs 2 x V x H FLOPs per token whether or not the storage is shared.
- ``lookup``: the input embedding when it is its own matrix (untied): read by index, 0 FLOPs.
- ``other``: norms, biases, attention sinks: vectors with no matmul FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass

from fitserve.config import ModelSpec
from fitserve.ledger.errors import PlanError

SPLITS = ("col", "row", "kv", "vocab", "replicated")


@dataclass(frozen=True)
class Tensor:
    """``per_layer`` copies of a rows x cols weight in each of ``layers`` layers.

    ``active_per_layer``: copies one token multiplies by (experts: k of E).
    ``split``: how tensor parallelism divides it ("col": rows, "row": cols, "kv": KV heads,
    replicated past the KV-head count, "vocab": rows padded up, "replicated").
    """

    name: str
    kind: str  # "matmul" | "lookup" | "other"
    rows: int
    cols: int
    layers: int = 1
    per_layer: int = 1
    split: str = "replicated"
    active_per_layer: int = -1  # -1: all copies active

    @property
    def elements(self) -> int:
        return self.rows * self.cols

    @property
    def count(self) -> int:
        return self.layers * self.per_layer

    @property
    def active_count(self) -> int:
        per = self.per_layer if self.active_per_layer < 0 else self.active_per_layer
        return self.layers * per


def is_mla(spec: ModelSpec) -> bool:
    return spec.kv_lora_rank > 0


def norms_per_layer(spec: ModelSpec) -> int:
    """RMSNorms per decoder layer: 2 (pre-attention, pre-MLP); Gemma 2/3 have 4."""
    return int(spec.extra.get("norms_per_layer", 2))


def _attention(spec: ModelSpec) -> list[Tensor]:
    h, n, L = spec.hidden_size, spec.num_layers, spec.num_layers
    if is_mla(spec):
        qk = spec.qk_nope_head_dim + spec.qk_rope_head_dim
        out: list[Tensor] = []
        if spec.q_lora_rank:
            out += [Tensor("q_a_proj", "matmul", spec.q_lora_rank, h, L),
                    Tensor("q_a_norm", "other", spec.q_lora_rank, 1, L),
                    Tensor("q_b_proj", "matmul", spec.num_heads * qk, spec.q_lora_rank, L, split="col")]
        else:
            out.append(Tensor("q_proj", "matmul", spec.num_heads * qk, h, L, split="col"))
        out += [
            Tensor("kv_a_proj", "matmul", spec.kv_lora_rank + spec.qk_rope_head_dim, h, L),
            Tensor("kv_a_norm", "other", spec.kv_lora_rank, 1, L),
            Tensor("kv_b_proj", "matmul",
                   spec.num_heads * (spec.qk_nope_head_dim + spec.v_head_dim), spec.kv_lora_rank, L,
                   split="col"),
            Tensor("attn_o", "matmul", h, spec.num_heads * spec.v_head_dim, L, split="row"),
        ]
        return out
    out = [
        Tensor("attn_q", "matmul", spec.q_size, h, n, split="col"),
        Tensor("attn_k", "matmul", spec.kv_size, h, n, split="kv"),
        Tensor("attn_v", "matmul", spec.kv_size, h, n, split="kv"),
        Tensor("attn_o", "matmul", h, spec.q_size, n, split="row"),
    ]
    if spec.attention_bias:
        out += [Tensor("attn_q_bias", "other", spec.q_size, 1, n, split="col"),
                Tensor("attn_k_bias", "other", spec.kv_size, 1, n, split="kv"),
                Tensor("attn_v_bias", "other", spec.kv_size, 1, n, split="kv")]
    if spec.extra.get("o_proj_bias"):
        out.append(Tensor("attn_o_bias", "other", h, 1, n))
    if spec.qk_norm:
        out += [Tensor("q_norm", "other", spec.head_dim, 1, n),
                Tensor("k_norm", "other", spec.head_dim, 1, n)]
    if spec.extra.get("attention_sinks"):
        out.append(Tensor("attn_sinks", "other", spec.num_heads, 1, n, split="col"))
    return out


def _mlp(spec: ModelSpec) -> list[Tensor]:
    h = spec.hidden_size
    if spec.num_experts == 0:
        i, n = spec.intermediate_size, spec.num_layers
        return [Tensor("ffn_gate", "matmul", i, h, n, split="col"),
                Tensor("ffn_up", "matmul", i, h, n, split="col"),
                Tensor("ffn_down", "matmul", h, i, n, split="row")]
    dense, moe = spec.first_k_dense, spec.num_layers - spec.first_k_dense
    if moe <= 0:
        raise PlanError(f"first_k_dense={dense} leaves no MoE layer of {spec.num_layers}")
    out: list[Tensor] = []
    if dense:
        i = spec.intermediate_size
        out += [Tensor("ffn_gate", "matmul", i, h, dense, split="col"),
                Tensor("ffn_up", "matmul", i, h, dense, split="col"),
                Tensor("ffn_down", "matmul", h, i, dense, split="row")]
    e, k = spec.num_experts, spec.num_experts_per_token
    ei = spec.moe_intermediate_size or spec.intermediate_size
    out += [
        Tensor("router", "matmul", e, h, moe),
        Tensor("expert_gate", "matmul", ei, h, moe, e, "col", k),
        Tensor("expert_up", "matmul", ei, h, moe, e, "col", k),
        Tensor("expert_down", "matmul", h, ei, moe, e, "row", k),
    ]
    if spec.extra.get("router_bias"):
        out.append(Tensor("router_bias", "other", e, 1, moe))
    if spec.extra.get("moe_bias"):
        out += [Tensor("expert_gate_up_bias", "other", 2 * ei, 1, moe, e, "col", k),
                Tensor("expert_down_bias", "other", h, 1, moe, e, "replicated", k)]
    if spec.num_shared_experts:
        si = ei * spec.num_shared_experts
        out += [Tensor("shared_gate", "matmul", si, h, moe, split="col"),
                Tensor("shared_up", "matmul", si, h, moe, split="col"),
                Tensor("shared_down", "matmul", h, si, moe, split="row")]
    return out


def tensors(spec: ModelSpec) -> tuple[Tensor, ...]:
    """Every weight tensor of the model (decoder only; vision towers and MTP heads excluded)."""
    v, h = spec.vocab_size, spec.hidden_size
    out = [
        Tensor("lm_head", "matmul", v, h, split="vocab"),
        *_attention(spec),
        *_mlp(spec),
        Tensor("norms", "other", h, 1, spec.num_layers, norms_per_layer(spec)),
        Tensor("final_norm", "other", h, 1),
    ]
    if not spec.tie_word_embeddings:
        out.insert(0, Tensor("embedding", "lookup", v, h, split="vocab"))
    return tuple(out)


def rank_elements(t: Tensor, spec: ModelSpec, tp: int) -> int:
    """Elements of ONE copy of ``t`` held by each of ``tp`` tensor-parallel ranks."""
    if t.split == "replicated" or tp == 1:
        return t.elements
    if t.split == "col":
        return -(-t.rows // tp) * t.cols
    if t.split == "row":
        return t.rows * -(-t.cols // tp)
    if t.split == "vocab":
        return -(-t.rows // tp) * t.cols
    if t.split == "kv":
        # NOTE: past tp == num_kv_heads each rank still needs one whole KV head: replicated.
        heads = -(-spec.num_kv_heads // tp)
        return heads * spec.head_dim * t.cols
    raise PlanError(f"unknown split {t.split!r} for {t.name}")


@dataclass(frozen=True)
class ParamCount:
    """Parameter counts; ``total = matmul + lookup + other``. ``active_*`` per token (MoE)."""

    matmul: int
    lookup: int
    other: int
    active_matmul: int
    expert: int  # routed-expert matmul parameters (0 for dense models)

    @property
    def total(self) -> int:
        return self.matmul + self.lookup + self.other

    @property
    def active_total(self) -> int:
        return self.total - self.matmul + self.active_matmul


def count_params(spec: ModelSpec) -> ParamCount:
    """Count parameters from the config (see the module docstring for the split)."""
    ts = tensors(spec)
    by_kind = {k: sum(t.elements * t.count for t in ts if t.kind == k)
               for k in ("matmul", "lookup", "other")}
    active = sum(t.elements * t.active_count for t in ts if t.kind == "matmul")
    expert = sum(t.elements * t.count for t in ts if t.name.startswith("expert_") and t.kind == "matmul")
    return ParamCount(by_kind["matmul"], by_kind["lookup"], by_kind["other"], active, expert)
