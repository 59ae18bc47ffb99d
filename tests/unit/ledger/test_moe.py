"""Mixture-of-experts accounting (fitserve.ledger.moe, moe_parallel), derived by hand from the
configs in catalog/models.json, and checked against brute-force enumeration of routings.

gpt-oss-20b: H = 2880, 24 layers, 64 q heads / 8 KV heads of 64, E = 32 experts, k = 4, expert
intermediate 2880, vocab 201,088, untied; weights "gpt-oss-mxfp4": experts MXFP4 (32 e2m1
codes of 4 bits + one e8m0 scale byte = 17 B per 32 weights = 4.25 bits), the rest bf16.
Qwen3-30B-A3B: H = 2048, 48 layers, 32 q heads / 4 KV heads of 128, E = 128, k = 8, expert
intermediate 768, vocab 151,936, untied, bf16.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest

from fitserve.ledger.errors import PlanError
from fitserve.ledger.formats import weight_bytes
from fitserve.ledger.hardware import get_hardware
from fitserve.ledger.moe import (
    active_bytes,
    batch_for_active_share,
    expected_experts_touched,
    moe_step_weight_read,
)
from fitserve.ledger.moe_parallel import (
    expected_busiest_rank_experts,
    moe_tp_schemes,
    touched_distribution,
)
from fitserve.ledger.step_time import roofline_step_model
from fitserve.ledger.weights import model_weight_bytes
from fitserve.tools.planner.model_source import catalog_entry

OSS = catalog_entry("gpt-oss-20b").spec
QWEN = catalog_entry("Qwen3-30B-A3B").spec

# gpt-oss-20b, bytes one token reads (tp=1), part by part:
#   lm_head 201,088 x 2880 x 2 B
#   attention per layer: q 4096 x 2880 + k, v 2 x 512 x 2880 + o 2880 x 4096 = 26,542,080
#     weights + biases 4096 + 2 x 512 + 2880 + sinks 64 = 26,550,144 params x 2 B x 24
#   router (32 x 2880 + 32 bias) x 2 B x 24;  norms (2 x 2880 x 24 + 2880) x 2 B
#   one expert: 3 x 2880^2 = 24,883,200 weights / 32 x 17 B = 13,219,200 B MXFP4 + biases
#     (2 x 2880 + 2880) x 2 B = 17,280 B -> 13,236,480 B; 4 of them x 24 layers
OSS_LM_HEAD = 201_088 * 2880 * 2
OSS_ATTN = 26_550_144 * 2 * 24
OSS_ROUTER = (32 * 2880 + 32) * 2 * 24
OSS_NORMS = (2 * 2880 * 24 + 2880) * 2
OSS_EXPERT = 24_883_200 // 32 * 17 + 17_280
OSS_NON_EXPERT = OSS_LM_HEAD + OSS_ATTN + OSS_ROUTER + OSS_NORMS
OSS_ACTIVE = OSS_NON_EXPERT + 4 * 24 * OSS_EXPERT
OSS_EXPERTS_ALL = 32 * 24 * OSS_EXPERT
OSS_EMBEDDING = 201_088 * 2880 * 2  # untied: a lookup table, not part of the active bytes


def test_gpt_oss_20b_active_bytes_by_hand() -> None:
    assert OSS_EXPERT == 13_236_480 and OSS_ACTIVE == 3_708_083_328
    assert weight_bytes(32, "mxfp4") * 8 / 32 == 4.25  # bits per weight of the experts
    wb = model_weight_bytes(OSS, "gpt-oss-mxfp4")
    ab = active_bytes(OSS, wb)
    assert dict(ab.parts) == {"lm_head": OSS_LM_HEAD, "attention": OSS_ATTN,
                              "router": OSS_ROUTER, "norms": OSS_NORMS,
                              "routed experts": 4 * 24 * OSS_EXPERT}
    assert ab.per_token == OSS_ACTIVE and ab.expert_bytes_all == OSS_EXPERTS_ALL
    # the whole model adds the embedding (a lookup, not read whole per token): 201,088 x 2880 x 2
    assert wb.total == OSS_NON_EXPERT + OSS_EXPERTS_ALL + OSS_EMBEDDING == 13_761_264_768


def test_qwen3_30b_a3b_active_bytes_by_hand() -> None:
    # per layer: attention 2048 x 4096 + 2 x 2048 x 512 + 4096 x 2048 = 18,874,368 + q/k norms
    # 2 x 128; router 128 x 2048; 8 of 128 experts x 3 x 2048 x 768; all bf16 (2 B)
    attn = (18_874_368 + 256) * 2 * 48
    router = 128 * 2048 * 2 * 48
    experts = 8 * 3 * 2048 * 768 * 2 * 48
    lm_head = 151_936 * 2048 * 2
    norms = (2 * 2048 * 48 + 2048) * 2
    ab = active_bytes(QWEN, model_weight_bytes(QWEN, "bf16"))
    assert dict(ab.parts) == {"lm_head": lm_head, "attention": attn, "router": router,
                              "norms": norms, "routed experts": experts}
    assert ab.per_token == 6_083_735_552
    # = 2 B x (active matmul 3,041,656,832 + norm weights 210,944): the model card's "3.3B
    # activated" counts the 311M-parameter embedding too
    assert ab.per_token == 2 * (3_041_656_832 + 210_944)
    # per GPU at tp=2: every split tensor halves; router and norms are replicated
    ab2 = active_bytes(QWEN, model_weight_bytes(QWEN, "bf16", tp=2))
    assert ab2.per_token == lm_head // 2 + (18_874_368 // 2 + 256) * 2 * 48 + router + norms \
        + experts // 2


def _enumerate_touched(e: int, k: int, b: int) -> Counter[int]:
    """Every routing of b tokens, each picking k of e experts: how many distinct experts."""
    picks = list(itertools.combinations(range(e), k))
    return Counter(len(set().union(*r)) for r in itertools.product(picks, repeat=b))


def test_expected_experts_touched() -> None:
    # E = 128, k = 8: 128 (1 - (15/16)^B)
    assert expected_experts_touched(128, 8, 1) == pytest.approx(8)
    assert expected_experts_touched(128, 8, 4) == pytest.approx(14911 / 512)  # 29.123
    assert expected_experts_touched(128, 8, 64) == pytest.approx(
        128 * (1 - (15 / 16) ** 64)) and 125.9 < expected_experts_touched(128, 8, 64) < 126
    assert expected_experts_touched(32, 4, 0) == 0
    # against enumeration of every routing (E = 8, k = 2, B = 3: 28^3 routings) and the exact
    # distribution touched_distribution builds token by token (E = 128: its mean)
    c = _enumerate_touched(8, 2, 3)
    n = sum(c.values())
    assert expected_experts_touched(8, 2, 3) == pytest.approx(sum(d * m for d, m in c.items()) / n)
    assert touched_distribution(8, 2, 3) == pytest.approx([c[d] / n for d in range(9)])
    for b in (1, 4, 64):
        dist = touched_distribution(128, 8, b)
        assert sum(d * p for d, p in enumerate(dist)) == pytest.approx(
            expected_experts_touched(128, 8, b), rel=1e-9)
    with pytest.raises(PlanError, match="k <= E"):
        expected_experts_touched(8, 9, 1)


def test_batch_at_which_most_experts_are_active() -> None:
    # 1 - (1 - k/E)^B >= 0.9  <=>  B >= ln 0.1 / ln(1 - k/E)
    assert batch_for_active_share(128, 8) == 36  # 2.302585 / 0.0645385 = 35.68
    assert expected_experts_touched(128, 8, 35) < 0.9 * 128 <= expected_experts_touched(128, 8, 36)
    assert batch_for_active_share(32, 4) == 18  # gpt-oss-20b: 2.302585 / 0.133531 = 17.24
    assert batch_for_active_share(8, 2) == 9  # Mixtral: 2.302585 / 0.287682 = 8.0039
    assert batch_for_active_share(8, 8) == 1
    with pytest.raises(PlanError, match="share"):
        batch_for_active_share(8, 2, 1.0)


def test_roofline_reads_the_mix_and_only_the_touched_experts() -> None:
    """Before: roofline_step_model raised "unknown weight format 'gpt-oss-mxfp4'"."""
    h100 = get_hardware("h100")
    one = roofline_step_model(OSS, "h100", weight_fmt="gpt-oss-mxfp4", step_tokens=1)
    many = roofline_step_model(OSS, "h100", weight_fmt="gpt-oss-mxfp4", step_tokens=256)
    # batch 1 reads the 4 active experts; batch 256 all but 32 x (7/8)^256 of them; the
    # rooflines count the embedding table as read every step (as for dense models)
    assert one.a == pytest.approx((OSS_ACTIVE + OSS_EMBEDDING) / 3.35e12, rel=1e-12)
    read_256 = OSS_NON_EXPERT + OSS_EMBEDDING + OSS_EXPERTS_ALL * (1 - (7 / 8) ** 256)
    assert many.a == pytest.approx(read_256 / h100.mem_bytes_per_s, rel=1e-12)
    # 4,866,350,208 B at batch 1 -> 13,761,264,768 B (every expert) at batch 256
    assert (OSS_ACTIVE + OSS_EMBEDDING, round(read_256)) == (4_866_350_208, 13_761_264_768)
    wb = model_weight_bytes(OSS, "gpt-oss-mxfp4")
    assert moe_step_weight_read(OSS, wb, 1) == pytest.approx(OSS_ACTIVE + OSS_EMBEDDING)
    assert active_bytes(OSS, wb).step_read(256) == pytest.approx(read_256)
    # a dense model reads everything whatever the batch
    l8 = catalog_entry("Llama-3.1-8B").spec
    dense = model_weight_bytes(l8, "bf16").total
    assert moe_step_weight_read(l8, model_weight_bytes(l8, "bf16"), 7) == dense
    assert roofline_step_model(l8, "h100", step_tokens=64).a == pytest.approx(dense / 3.35e12)


def _brute_busiest(e: int, k: int, b: int, tp: int) -> float:
    g, picks = e // tp, list(itertools.combinations(range(e), k))
    total = count = 0
    for routing in itertools.product(picks, repeat=b):
        per_rank = Counter(x // g for x in set().union(*routing))
        total += max(per_rank.values())
        count += 1
    return total / count


@pytest.mark.parametrize(("e", "k", "b", "tp"), [(8, 2, 1, 2), (8, 2, 2, 2), (8, 2, 3, 4),
                                                 (6, 3, 2, 3)])
def test_busiest_rank_against_every_routing(e: int, k: int, b: int, tp: int) -> None:
    assert expected_busiest_rank_experts(e, k, b, tp) == pytest.approx(_brute_busiest(e, k, b, tp))


def test_expert_parallel_vs_megatron_collectives() -> None:
    # Qwen3-30B-A3B at tp=4, bf16 activations: H x b = 4096 B per token
    hb, tp, k, L = 4096, 4, 8, 48
    mega, ep = moe_tp_schemes(QWEN, model_weight_bytes(QWEN, "bf16", tp=4),
                              model_weight_bytes(QWEN, "bf16"), batch=1, act_dtype_bytes=2)
    assert ep is not None and mega.implemented and not ep.implemented
    # Megatron: 2 all-reduces a layer; ring: each rank sends 2 (tp-1)/tp x 4096, the group
    # 2 (tp-1) x 4096 per token per all-reduce
    assert mega.calls_per_step == 2 * L
    assert mega.group_bytes_per_token == pytest.approx(L * 2 * 2 * (tp - 1) * hb)  # 2,359,296
    assert mega.rank_bytes_per_token == pytest.approx(L * 2 * 1.5 * hb)
    # expert parallel: reduce-scatter + all-gather (one all-reduce's bytes) + all-to-all
    # dispatch + combine, H b k 2 (tp-1)/tp per token = 4096 x 8 x 2 x 3/4 = 49,152
    a2a = hb * k * 2 * (tp - 1) / tp
    assert a2a == 49_152
    assert ep.calls_per_step == 4 * L
    assert ep.group_bytes_per_token == pytest.approx(L * (2 * (tp - 1) * hb + a2a))  # 3,538,944
    assert ep.rank_bytes_per_token == pytest.approx(L * (1.5 * hb + a2a / tp))  # 884,736
    # weights at batch 1: Megatron reads 8/4 = 2 experts' worth per rank; EP the busiest rank's
    # whole experts: 8 of 128 over 4 ranks of 32 -> E[max] > 2
    assert mega.busiest_rank_experts == pytest.approx(2.0)
    assert ep.busiest_rank_experts > 2.5
    one_expert = 3 * 2048 * 768 * 2  # B, bf16
    assert ep.weight_read_per_rank - mega.weight_read_per_rank == pytest.approx(
        (ep.busiest_rank_experts - 2.0) * one_expert * L)


def test_gpt_oss_20b_tp4_schemes_and_refusals() -> None:
    # k = 4 = tp: the all-to-all moves what Megatron's second all-reduce moves
    mega, ep = moe_tp_schemes(OSS, model_weight_bytes(OSS, "gpt-oss-mxfp4", tp=4),
                              model_weight_bytes(OSS, "gpt-oss-mxfp4"), batch=64,
                              act_dtype_bytes=2)
    assert ep is not None
    assert mega.group_bytes_per_token == ep.group_bytes_per_token == 24 * 2 * 6 * 5760
    l8 = catalog_entry("Llama-3.1-8B").spec
    with pytest.raises(PlanError, match="no routed experts"):
        moe_tp_schemes(l8, model_weight_bytes(l8, "bf16", tp=2), model_weight_bytes(l8, "bf16"),
                       batch=1, act_dtype_bytes=2)
    # 32 experts over 3 ranks: expert parallelism is not priced
    _, none = moe_tp_schemes(OSS, model_weight_bytes(OSS, "gpt-oss-mxfp4", tp=3),
                             model_weight_bytes(OSS, "gpt-oss-mxfp4"), batch=1, act_dtype_bytes=2)
    assert none is None
    assert math.isclose(expected_busiest_rank_experts(32, 4, 1000, 4), 8.0)
