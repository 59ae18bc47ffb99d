"""Layouts ranked by what the workload gets (issue 42, item 1), derived by hand.

A DP replica with no request adds nothing: C requests dealt round-robin over dp replicas, each
running request one token per step of its replica, so

    aggregate = sum over replicas of load / step(load),   per user = 1 / step(busiest load)

The reference for one replica's step is that replica planned alone (TPt x PPp on t x p GPUs
with its own load): the same roofline, with no DP in it. The old ranking used dp x seqs / step,
which for one request on TP2xDP4 counted four replicas where one runs.
"""

from __future__ import annotations

import pytest

from fitserve.ledger.hardware import get_hardware
from fitserve.ledger.weights import model_weight_bytes
from fitserve.tools.planner.layouts import LayoutQuery, recommend_layout, replica_loads
from fitserve.tools.planner.model_source import catalog_entry

L70 = catalog_entry("Llama-3.3-70B").spec
L8 = catalog_entry("Llama-3.1-8B").spec


def _alone(spec: object, gpu: str, gpus: int, load: int, weights: str, kv: str) -> float:
    """Step seconds of one replica of ``gpus`` GPUs (TP ``gpus``) running ``load`` sequences."""
    c = recommend_layout(spec, get_hardware(gpu), LayoutQuery(gpus, 4096, load, weights, kv))  # type: ignore[arg-type]
    tp_only = next(x for x in c.layouts if x.tp == gpus)
    return tp_only.step_seconds


def test_replica_loads_round_robin_and_capped() -> None:
    assert replica_loads(1, 4, 256) == [1, 0, 0, 0]
    assert replica_loads(6, 4, 256) == [2, 2, 1, 1]
    assert replica_loads(1000, 2, 256) == [256, 256]  # 488 wait in the queues


@pytest.mark.parametrize("spec,gpu,n,weights,kv", [
    (L70, "h100", 8, "fp8", "fp8"),
    (L70, "h100", 16, "fp8", "fp8"),
    (L8, "mi300x", 8, "bf16", "bf16"),
])
def test_one_request_gets_one_replica(spec: object, gpu: str, n: int, weights: str,
                                      kv: str) -> None:
    c = recommend_layout(spec, get_hardware(gpu), LayoutQuery(n, 4096, 1, weights, kv))  # type: ignore[arg-type]
    by = {x.name: x for x in c.layouts}
    tp2 = by[f"TP2xDP{n // 2}"]
    # one request: one TP2 replica runs it; its step is TP2 planned alone on 2 GPUs
    step = _alone(spec, gpu, 2, 1, weights, kv)
    assert tp2.step_seconds == pytest.approx(step)
    assert tp2.tokens_per_s == pytest.approx(1 / step)  # old: (n / 2) x 1 / step
    assert tp2.per_user_tokens_per_s == pytest.approx(1 / step)
    assert tp2.busy_replicas == 1
    # the widest TP (every GPU on the one request) wins; no layout beats it for that user
    widest = max((x for x in c.layouts if x.fits and x.pp == 1), key=lambda x: x.tp)
    assert c.recommended is not None and c.recommended.name == widest.name
    assert all(x.tokens_per_s <= widest.tokens_per_s + 1e-9 for x in c.layouts if x.fits)


@pytest.mark.parametrize("tp,per_user", [(2, 81.76), (8, 248.32)])
def test_llama70_fp8_h100_by_hand(tp: int, per_user: float) -> None:
    # Llama-3.3-70B fp8 at 4k, one request, 8 x H100 (3.35e12 B/s, links 8 us + 450e9 B/s).
    # Batch 1 is memory-bound: step = (weights per rank + KV per rank) / bandwidth + 2 x 80
    # all-reduces of 8192 x 2 B, each 8 us + 2 (tp - 1) / tp x 16,384 B / 450e9 B/s.
    #   KV: 4096 tokens x 80 layers x 2 x 8 heads x 128 x 1 B (fp8) = 671,088,640 B, / tp
    #   TP2: (36,329,507,008 + 335,544,320) / 3.35e12 + 160 x 8.036 us = 12.23 ms -> 81.76 tok/s
    #   TP8: ( 9,084,356,800 +  83,886,080) / 3.35e12 + 160 x 8.064 us =  4.03 ms -> 248.3
    # The old ranking printed TP2xDP4 at 4 x 81.76 = 327 (324 with bf16 KV) and chose it.
    hw = get_hardware("h100")
    w = model_weight_bytes(L70, "fp8", tp=tp).total
    kv = 4096 * 80 * 2 * 8 * 128 * 1 // tp
    ar = 8e-6 + 2 * (tp - 1) / tp * 8192 * 2 / 450e9
    step = (w + kv) / 3.35e12 + 2 * 80 * ar
    c = recommend_layout(L70, hw, LayoutQuery(8, 4096, 1, "fp8", "fp8"))
    x = next(x for x in c.layouts if x.tp == tp and x.pp == 1)
    assert x.step_seconds == pytest.approx(step, rel=1e-9)
    assert x.per_user_tokens_per_s == pytest.approx(per_user, abs=0.01)
    assert x.tokens_per_s == pytest.approx(1 / step)  # one request: aggregate = per user
    assert c.recommended is not None and c.recommended.name == "TP8"


def test_uneven_loads_sum_per_replica() -> None:
    # 6 requests on TP2xDP4: loads 2, 2, 1, 1 -> 2 / step(2) x 2 + 1 / step(1) x 2
    hw = get_hardware("h100")
    c = recommend_layout(L70, hw, LayoutQuery(8, 4096, 6, "fp8", "fp8"))
    tp2 = next(x for x in c.layouts if x.name == "TP2xDP4")
    s1, s2 = (_alone(L70, "h100", 2, b, "fp8", "fp8") for b in (1, 2))
    assert tp2.tokens_per_s == pytest.approx(2 * 2 / s2 + 2 * 1 / s1)
    assert tp2.per_user_tokens_per_s == pytest.approx(1 / s2)  # the busier replicas' users
    assert tp2.busy_replicas == 4
    # enough requests to fill every replica: the old dp x seqs / step again
    full = recommend_layout(L70, hw, LayoutQuery(8, 4096, 64, "fp8", "fp8"))
    tp2f = next(x for x in full.layouts if x.name == "TP2xDP4")
    assert tp2f.tokens_per_s == pytest.approx(4 * 16 / tp2f.step_seconds)
