"""Tensor-parallel arithmetic without processes: who holds what, the step message, exact
weight shards (packed included), the watchdog's diagnosis, the ring, the collectives model."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from fitserve.config import ModelSpec
from fitserve.dist.layout import TPLayoutError, check_tp_layout, rank_slice, rank_spec
from fitserve.dist.ring import chunk_bounds, ring_allreduce, ring_bytes_per_rank
from fitserve.dist.shard import row_parallel_groups, shard_weights
from fitserve.dist.step_message import decode_step, encode_step
from fitserve.dist.watchdog import RankReport, diagnose
from fitserve.ledger.collectives import allreduce_cost, best_allreduce, crossover_bytes
from fitserve.ledger.kv import kv_bytes_per_token
from fitserve.ledger.parallel import tp_step_collectives
from fitserve.quant.packed import PackedWeight, dequantize
from fitserve.quant.rtn import quantize as quantize_rtn
from fitserve.types import ScheduledChunk, SchedulerOutput

# SmolLM2-135M's shape: 9 query heads, 3 KV heads, head_dim 64, MLP 1536, vocab 49152
SMOL = ModelSpec("llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                 num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, name="SmolLM2")
TINY = ModelSpec("llama", vocab_size=386, hidden_size=64, intermediate_size=160, num_layers=2,
                 num_heads=4, num_kv_heads=2, head_dim=16, name="tiny")


def test_rank_slices_smollm2_tp3() -> None:
    # 9 / 3 = 3 query heads and 3 / 3 = 1 KV head each; 1536 / 3 = 512 MLP rows; 49152 / 3
    s = [rank_slice(SMOL, 3, r) for r in range(3)]
    assert [x.q_heads for x in s] == [(0, 3), (3, 6), (6, 9)]
    assert [x.kv_heads for x in s] == [(0, 1), (1, 2), (2, 3)]
    assert [x.intermediate for x in s] == [(0, 512), (512, 1024), (1024, 1536)]
    assert [x.vocab for x in s] == [(0, 16384), (16384, 32768), (32768, 49152)]
    spec = rank_spec(SMOL, 3, 1)
    assert (spec.num_heads, spec.num_kv_heads, spec.intermediate_size, spec.vocab_size) == (
        3, 1, 512, 16384)
    # the KV a rank holds is the ledger's per-rank KV: 30 layers x 2 x 1 head x 64 x 4 B
    assert kv_bytes_per_token(spec, "f32") == kv_bytes_per_token(SMOL, "f32", tp=3) == 15360


def test_kv_heads_replicated_past_their_count() -> None:
    # 4 query heads, 2 KV heads, tp 4: query head h uses KV head h // 2, so ranks 0,1 hold KV
    # head 0 and ranks 2,3 hold KV head 1 (each replicated twice)
    s = [rank_slice(TINY, 4, r) for r in range(4)]
    assert [x.q_heads for x in s] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert [x.kv_heads for x in s] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    # an uneven vocabulary: 386 = 97 + 97 + 96 + 96, the gather pads to 97 columns
    assert [x.vocab for x in s] == [(0, 97), (97, 194), (194, 290), (290, 386)]
    assert {x.vocab_shard for x in s} == {97}


@pytest.mark.parametrize(("changes", "tp", "message"), [
    ({"num_heads": 9, "num_kv_heads": 3}, 2, "num_heads=9 is not divisible by tensor_parallel_size=2"),
    ({"num_heads": 12, "num_kv_heads": 3}, 4, "num_kv_heads=3 and tensor_parallel_size=4"),
    ({"num_heads": 6, "num_kv_heads": 6, "intermediate_size": 160}, 6,
     "intermediate_size=160 is not divisible by tensor_parallel_size=6"),
    ({}, 0, "tensor_parallel_size must be >= 1"),
])
def test_layouts_that_do_not_divide(changes: dict[str, int], tp: int, message: str) -> None:
    with pytest.raises(TPLayoutError, match=message):
        check_tp_layout(dataclasses.replace(TINY, **changes), tp)


def test_packed_groups_must_split_at_group_bounds() -> None:
    # 9 heads x 64 = 576 columns of o_proj; / 3 = 192 = 6 groups of 32, but 1.5 groups of 128
    check_tp_layout(SMOL, 3, group_sizes=(32,))
    with pytest.raises(TPLayoutError, match="not a whole number of the packed weights' groups of 128"):
        check_tp_layout(SMOL, 3, group_sizes=(128,))


def _weights(spec: ModelSpec, fmt: str | None) -> dict[str, torch.Tensor | PackedWeight]:
    g = torch.Generator().manual_seed(0)
    h, hd, i = spec.hidden_size, spec.head_dim, spec.intermediate_size
    shapes = {"model.embed_tokens.weight": (spec.vocab_size, h), "lm_head.weight": (spec.vocab_size, h),
              "model.layers.0.self_attn.q_proj.weight": (spec.num_heads * hd, h),
              "model.layers.0.self_attn.k_proj.weight": (spec.num_kv_heads * hd, h),
              "model.layers.0.self_attn.v_proj.weight": (spec.num_kv_heads * hd, h),
              "model.layers.0.self_attn.o_proj.weight": (h, spec.num_heads * hd),
              "model.layers.0.mlp.gate_proj.weight": (i, h), "model.layers.0.mlp.up_proj.weight": (i, h),
              "model.layers.0.mlp.down_proj.weight": (h, i),
              "model.layers.0.input_layernorm.weight": (h,)}
    out: dict[str, torch.Tensor | PackedWeight] = {}
    for name, shape in shapes.items():
        w = torch.randn(shape, generator=g)
        out[name] = quantize_rtn(w, fmt) if fmt and w.dim() == 2 else w
    return out


def _dense(w: torch.Tensor | PackedWeight) -> torch.Tensor:
    return dequantize(w) if isinstance(w, PackedWeight) else w


@pytest.mark.parametrize("fmt", [None, "int4-g32-asym", "int4-g32-sym", "int8-g32", "int8-ch"])
def test_shards_are_exact_slices(fmt: str | None) -> None:
    spec = dataclasses.replace(TINY, hidden_size=64, intermediate_size=192, num_heads=4,
                               num_kv_heads=2, head_dim=32)  # row-parallel K: 128/2, 192/2
    weights = _weights(spec, fmt)
    check_tp_layout(spec, 2, group_sizes=row_parallel_groups(weights))
    for rank in range(2):
        s = rank_slice(spec, 2, rank)
        shard = shard_weights(spec, weights, s)
        full = {k: _dense(v) for k, v in weights.items()}
        got = {k: _dense(v) for k, v in shard.items()}
        q0, q1 = s.q_heads[0] * 32, s.q_heads[1] * 32
        k0, k1 = s.kv_heads[0] * 32, s.kv_heads[1] * 32
        i0, i1 = s.intermediate
        v0, v1 = s.vocab
        a, m = "model.layers.0.self_attn.", "model.layers.0.mlp."
        expect = {a + "q_proj.weight": full[a + "q_proj.weight"][q0:q1],
                  a + "k_proj.weight": full[a + "k_proj.weight"][k0:k1],
                  a + "o_proj.weight": full[a + "o_proj.weight"][:, q0:q1],
                  m + "up_proj.weight": full[m + "up_proj.weight"][i0:i1],
                  m + "down_proj.weight": full[m + "down_proj.weight"][:, i0:i1],
                  "model.embed_tokens.weight": full["model.embed_tokens.weight"][v0:v1],
                  "model.layers.0.input_layernorm.weight": full["model.layers.0.input_layernorm.weight"]}
        for name, want in expect.items():
            assert torch.equal(got[name][:, : want.shape[-1]] if want.dim() == 2 else got[name], want), name


def test_step_message_round_trip() -> None:
    chunks = [ScheduledChunk("a", [5, 6, 7], 0, [3, 4], sample=True, fanout=["a#1", "a#2"]),
              ScheduledChunk("b", [9], 40, [1, 2, 8], sample=True),
              ScheduledChunk("c", [1, 2], 16, [0, 7], sample=False)]
    out = SchedulerOutput(chunks, 6, block_copies=[(4, 11), (2, 12)])
    plan = decode_step(encode_step(out))
    assert plan.block_copies == [(4, 11), (2, 12)]
    for got, want in zip(plan.chunks, chunks, strict=True):
        assert (got.token_ids, got.start_pos, got.block_table, got.sample, len(got.fanout)) == (
            want.token_ids, want.start_pos, want.block_table, want.sample, len(want.fanout))
        assert got.request_id == ""  # no client data crosses


def _report(rank: int, seq: int, in_flight: bool, stack: str = "") -> RankReport:
    return RankReport(rank, 100 + rank, "host", seq, "layer all_reduce", in_flight, False, 5.0, stack)


def test_diagnosis_names_the_rank_behind() -> None:
    reports = {0: _report(0, 42, True), 1: _report(1, 42, True),
               2: _report(2, 41, False, 'File "worker.py", line 30, in _stall\n')}
    text = diagnose(reports, 3)
    assert text.startswith("rank 2 is behind")
    assert "in _stall" in text and "pid 102" in text
    assert diagnose({0: _report(0, 7, True)}, 2).startswith("rank(s) 1 sent no report")


@pytest.mark.parametrize(("n", "p"), [(12, 3), (10, 3), (7, 4), (3, 5), (1000, 8), (0, 2), (5, 1)])
def test_ring_allreduce_equals_the_direct_sum(n: int, p: int) -> None:
    rnd = random.Random(n * 31 + p)
    vectors = [[rnd.randint(-1000, 1000) for _ in range(n)] for _ in range(p)]
    total = [sum(col) for col in zip(*vectors, strict=True)] if n else []
    res = ring_allreduce(vectors)  # integers: exact whatever the order of the additions
    assert all(v == total for v in res.vectors)
    sizes = [hi - lo for lo, hi in chunk_bounds(n, p)]
    assert sum(sizes) == n and max(sizes) - min(sizes) <= (1 if n else 0)
    # every chunk but (r+1) mod p, then every chunk but (r+2) mod p
    assert res.sent == [2 * n - sizes[(r + 1) % p] - sizes[(r + 2) % p] if p > 1 else 0
                        for r in range(p)]
    if p > 1 and n % p == 0:
        assert all(x == ring_bytes_per_rank(n, p) == 2 * (p - 1) / p * n for x in res.sent)
    assert res.steps == 2 * (p - 1)


def test_small_messages_avoid_the_ring() -> None:
    # 8 ranks, 450 GB/s, 8 us per call, 1 us per hop. Crossover one-shot vs ring:
    # one-shot 1 us + 7 n / B = ring 14 us + 1.75 n / B  ->  n = 13 us x B / 5.25 = 1.114 MB
    bw = 450e9
    n_star = crossover_bytes("one-shot", "ring", 8, bandwidth=bw)
    assert n_star == pytest.approx(13e-6 * bw / 5.25)
    assert best_allreduce(n_star * 0.9, 8, bandwidth=bw, call_latency_s=8e-6).algorithm == "one-shot"
    assert best_allreduce(n_star * 1.1, 8, bandwidth=bw, call_latency_s=8e-6).algorithm == "ring"
    assert allreduce_cost("tree", 0, 8, bandwidth=bw, call_latency_s=0).seconds == pytest.approx(6e-6)


def test_step_collectives_ledger() -> None:
    # SmolLM2 fp32 at tp 3, a decode step of 4 sequences: 60 layer all-reduces and 1 for the
    # embedding, each 4 x 576 x 4 B; one gather of 4 rows x 16384 logits x 4 B
    lines = {x.kind: x for x in tp_step_collectives(SMOL, tp=3, tokens=4, logits_rows=4,
                                                    act_dtype_bytes=4)}
    assert (lines["layer all_reduce"].calls, lines["layer all_reduce"].bytes_per_call) == (60, 9216)
    assert (lines["embedding all_reduce"].calls, lines["embedding all_reduce"].bytes_per_call) == (1, 9216)
    assert lines["logits gather"].bytes_per_call == 4 * 16384 * 4
    assert tp_step_collectives(SMOL, tp=1, tokens=4, logits_rows=4, act_dtype_bytes=4) == ()
