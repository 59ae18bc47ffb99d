"""FLOPs per token: 2 x matmul parameters plus the attention term, and where attention wins.

Attention per generated token, attending to c earlier tokens (itself included), per layer:

    QK^T: 2 x heads x d_qk x c     PV: 2 x heads x d_v x c     -> 2 x heads x (d_qk + d_v) x c

(GQA: d_qk = d_v = head_dim, so 4 x heads x head_dim x c; MLA counted in its naive, non-absorbed
form: d_qk = qk_nope + qk_rope, d_v = v_head_dim.) Sliding layers attend to min(c, window).
"""

from __future__ import annotations

from dataclasses import dataclass

from fitserve.config import ModelSpec
from fitserve.ledger.kv import layer_kinds
from fitserve.ledger.params import count_params, is_mla


def attention_flops_per_position(spec: ModelSpec) -> int:
    """FLOPs per layer per attended position: 2 x heads x (d_qk + d_v)."""
    if is_mla(spec):
        d_qk = spec.qk_nope_head_dim + spec.qk_rope_head_dim
        return 2 * spec.num_heads * (d_qk + spec.v_head_dim)
    return 4 * spec.num_heads * spec.head_dim


def _layer_split(spec: ModelSpec) -> tuple[int, int]:
    kinds = layer_kinds(spec)
    sliding = sum(k == "sliding" for k in kinds)
    return len(kinds) - sliding, sliding


def attention_flops(spec: ModelSpec, context: int) -> int:
    """Attention FLOPs for one token that attends to ``context`` positions (all layers)."""
    full, sliding = _layer_split(spec)
    capped = min(context, spec.sliding_window or context)
    return attention_flops_per_position(spec) * (full * context + sliding * capped)


@dataclass(frozen=True)
class TokenFlops:
    context: int
    matmul: int  # 2 x active matmul params
    attention: int

    @property
    def total(self) -> int:
        return self.matmul + self.attention

    @property
    def attention_share(self) -> float:
        return self.attention / self.total


def flops_per_token(spec: ModelSpec, context: int) -> TokenFlops:
    """FLOPs of one decode token at ``context``: 2 x active matmul params + attention."""
    return TokenFlops(context, 2 * count_params(spec).active_matmul, attention_flops(spec, context))


def attention_crossover_context(spec: ModelSpec) -> int | None:
    """Smallest context where attention FLOPs >= 2 x matmul params (None: windows cap it)."""
    n2 = 2 * count_params(spec).active_matmul
    a = attention_flops_per_position(spec)
    full, sliding = _layer_split(spec)
    per_ctx = a * (full + sliding)  # slope while context <= window
    ctx = -(-n2 // per_ctx)
    w = spec.sliding_window
    if not sliding or w is None or ctx <= w:
        return ctx
    if full == 0:
        return None
    return -(-(n2 - a * sliding * w) // (a * full))


def _sum_min(p: int, w: int) -> int:
    """sum_{i=1..p} min(i, w)."""
    if p <= w:
        return p * (p + 1) // 2
    return w * (w + 1) // 2 + (p - w) * w


def prefill_flops(spec: ModelSpec, prompt_len: int, *, logit_positions: int = 1) -> TokenFlops:
    """FLOPs to prefill ``prompt_len`` tokens; the lm_head runs on ``logit_positions`` only.

    matmul = 2 x (active matmul - lm_head) x P + 2 x lm_head x logit_positions
    attention = per-position FLOPs x sum over tokens i = 1..P of the positions i sees (causal).
    """
    lm_head = spec.vocab_size * spec.hidden_size
    body = count_params(spec).active_matmul - lm_head
    full, sliding = _layer_split(spec)
    w = spec.sliding_window or prompt_len
    positions = full * _sum_min(prompt_len, prompt_len) + sliding * _sum_min(prompt_len, w)
    return TokenFlops(prompt_len, 2 * body * prompt_len + 2 * lm_head * logit_positions,
                      attention_flops_per_position(spec) * positions)
