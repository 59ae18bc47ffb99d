"""gpt-oss under tensor parallelism without processes: the shard of every tensor kind it has
(sinks per query head, q/k/v and o_proj biases, the replicated router, expert biases, MXFP4
experts split at whole 32-weight blocks) checked against the plain unshared layer in float64
(the ranks' partial products summed = the whole projection, each bias added once), the
divisibility error, and the step / start-up messages of a hybrid (sliding + full) model."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from fitserve.config import ModelSpec
from fitserve.dist.layout import TPLayoutError, check_tp_layout, rank_slice
from fitserve.dist.shard import row_parallel_groups, shard_weights
from fitserve.dist.step_message import decode_startup, decode_step, encode_startup, encode_step
from fitserve.kv.group import KVGroup
from fitserve.quant.ggml_blocks import GgmlBlockWeight
from fitserve.quant.held import HeldTensor
from fitserve.types import ScheduledChunk, SchedulerOutput

# 4 query heads / 2 KV heads of 16, hidden 96 (3 MXFP4 blocks), 2 experts of width 64
SPEC = ModelSpec("gpt_oss", vocab_size=100, hidden_size=96, intermediate_size=64, num_layers=1,
                 num_heads=4, num_kv_heads=2, head_dim=16, num_experts=2,
                 num_experts_per_token=1, name="tiny-gpt-oss")
A, M = "model.layers.0.self_attn.", "model.layers.0.mlp."


def mxfp4(w: torch.Tensor) -> tuple[GgmlBlockWeight, torch.Tensor]:
    """``w`` quantized by gguf-py, and gguf-py's float64 dequantization of it."""
    raw = gguf_quantize(w.numpy().astype(np.float32), Q.MXFP4)
    dense = torch.from_numpy(np.asarray(gguf_dequantize(raw, Q.MXFP4), np.float64))
    return GgmlBlockWeight("MXFP4", w.shape[0], w.shape[1], torch.from_numpy(raw)), dense


def gpt_oss_weights() -> tuple[dict[str, HeldTensor], dict[str, torch.Tensor]]:
    """The loader's tensors of one gpt-oss layer (held) and their float64 values (whole)."""
    g = torch.Generator().manual_seed(7)
    h, q, kv, i = 96, 64, 32, 64
    shapes = {A + "q_proj.weight": (q, h), A + "k_proj.weight": (kv, h), A + "v_proj.weight": (kv, h),
              A + "o_proj.weight": (h, q), A + "q_proj.bias": (q,), A + "k_proj.bias": (kv,),
              A + "v_proj.bias": (kv,), A + "o_proj.bias": (h,), A + "sinks": (4,),
              M + "gate.weight": (2, h), M + "gate.bias": (2,)}
    for e in range(2):
        x = f"{M}experts.{e}."
        shapes |= {x + "gate_proj.bias": (i,), x + "up_proj.bias": (i,), x + "down_proj.bias": (h,)}
    held: dict[str, HeldTensor] = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    whole = {n: t.double() for n, t in held.items() if isinstance(t, torch.Tensor)}
    for e in range(2):
        for part, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
            name = f"{M}experts.{e}.{part}.weight"
            held[name], whole[name] = mxfp4(torch.randn(shape, generator=g))
    return held, whole


def dense(w: HeldTensor) -> torch.Tensor:
    return w.dequantize(torch.float64) if isinstance(w, GgmlBlockWeight) else w.double()


def test_gpt_oss_shards_sum_to_the_unshared_layer() -> None:
    held, whole = gpt_oss_weights()
    check_tp_layout(SPEC, 2, group_sizes=row_parallel_groups(held),
                    expert_group_sizes=row_parallel_groups(held, routed_experts=True))
    assert row_parallel_groups(held, routed_experts=True) == (32,)
    assert row_parallel_groups(held) == ()  # o_proj is dense: the heads need no block check
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    shards = [shard_weights(SPEC, held, rank_slice(SPEC, 2, r)) for r in range(2)]
    for r, shard in enumerate(shards):
        s = rank_slice(SPEC, 2, r)
        assert torch.equal(shard[A + "sinks"].double(), whole[A + "sinks"][s.q_heads[0]:s.q_heads[1]])
        assert torch.equal(shard[M + "gate.bias"].double(), whole[M + "gate.bias"])  # router whole
        down = shard[f"{M}experts.1.down_proj.weight"]
        assert isinstance(down, GgmlBlockWeight) and down.shape == (96, 32)
        assert torch.equal(dense(down), whole[f"{M}experts.1.down_proj.weight"][:, 32 * r:32 * (r + 1)])
    # row-parallel outputs: sum over ranks of (x_r @ W_r^T + b_r) = x @ W^T + b, the bias once
    for proj, inp in ((A + "o_proj", x[:, :64]), (f"{M}experts.0.down_proj", x[:, :64])):
        total = sum(xs @ dense(sh[proj + ".weight"]).T + dense(sh[proj + ".bias"])
                    for sh, xs in zip(shards, (inp[:, :32], inp[:, 32:]), strict=True))
        want = inp @ whole[proj + ".weight"].T + whole[proj + ".bias"]
        assert torch.allclose(total, want, rtol=1e-12, atol=1e-12), proj
    # column-parallel outputs (with their biases): the ranks' rows side by side are the whole
    for proj in (A + "q_proj", f"{M}experts.1.gate_proj", f"{M}experts.1.up_proj"):
        cat = torch.cat([x @ dense(sh[proj + ".weight"]).T + dense(sh[proj + ".bias"])
                         for sh in shards], dim=1)
        want = x @ whole[proj + ".weight"].T + whole[proj + ".bias"]
        assert torch.allclose(cat, want, rtol=1e-12, atol=1e-12), proj


def test_mxfp4_experts_must_split_at_whole_blocks() -> None:
    held, _ = gpt_oss_weights()
    groups = row_parallel_groups(held, routed_experts=True)
    with pytest.raises(TPLayoutError, match=r"expert intermediate size=64 / tensor_parallel_size=4"
                       r" = 16 columns per rank is not a whole number of the packed weights' "
                       r"groups of 32"):
        check_tp_layout(dataclasses.replace(SPEC, num_heads=8, num_kv_heads=4), 4,
                        expert_group_sizes=groups)


def test_hybrid_step_and_startup_messages_round_trip() -> None:
    """Every KV group's table per chunk and its block copies, and the groups rank 0 sized."""
    chunks = [ScheduledChunk("a", [5, 6, 7], 0, [3, 4], sample=True,
                             group_tables=[[3, 4], [0, 9]]),
              ScheduledChunk("b", [9], 40, [1, 2, 8], sample=True,
                             group_tables=[[1, 2, 8], [0, 0, 11]])]
    out = SchedulerOutput(chunks, 4, block_copies=[(4, 12)],
                          group_block_copies=[[(4, 12)], [(9, 13), (11, 14)]])
    plan = decode_step(encode_step(out))
    assert [c.group_tables for c in plan.chunks] == [c.group_tables for c in chunks]
    assert plan.group_block_copies == out.group_block_copies
    assert [c.block_table for c in plan.chunks] == [[3, 4], [1, 2, 8]]
    groups = [KVGroup("sliding", 20, 5, (0, 2)), KVGroup("full", 31, None, (1,))]
    assert decode_startup(encode_startup(57, groups)) == (57, groups)
    assert decode_startup(encode_startup(57, [])) == (57, [])
