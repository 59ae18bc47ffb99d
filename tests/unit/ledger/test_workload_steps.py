"""The W2 step shapes as the scheduler runs them (ledger.workload_schedule) and the CPU's
element-wise and per-sequence terms of a step (ledger.speed.token_seconds, scheduled_step,
step_time.roofline_step_model), each against a hand computation."""

from __future__ import annotations

import dataclasses

import pytest

from fitserve.ledger.flops import flops_per_token, prefill_flops
from fitserve.ledger.hardware import Hardware
from fitserve.ledger.kv import request_kv
from fitserve.ledger.speed import (
    decode_step,
    elementwise_elements,
    scheduled_step,
    token_seconds,
    workload_speed,
)
from fitserve.ledger.step_time import roofline_step_model
from fitserve.ledger.weights import model_weight_bytes
from fitserve.ledger.workload_schedule import ScheduledStep, workload_schedule
from fitserve.tools.planner.model_source import catalog_entry

SMOL = catalog_entry("SmolLM2-135M").spec  # 30 layers, hidden 576, q 576, kv 192, MLP 1536
CPU = Hardware("cpu", 1 << 34, 20e9, 100e9, None, None, "none", 0.0, 0.0, "test", cores=0,
               matmul_rows=(32, 512), matmul_rates=(("bf16", (200e9, 400e9)),),
               attention_flops=40e9, step_overhead_s=1e-4, layer_overhead_s=2e-5,
               elementwise_s=4e-10, seq_overhead_s=3e-5, logit_s=1e-10)


def test_schedule_decodes_first_then_prompt_chunks() -> None:
    # 3 prompts of 4, 3 new tokens each, a budget of 6 tokens (by hand, step by step)
    got = workload_schedule(batch=3, input_len=4, output_len=3, max_num_batched_tokens=6,
                            max_num_seqs=64)
    assert got == [ScheduledStep((), ((0, 4), (0, 2)), 1),      # r0 whole, r1 half
                   ScheduledStep((5,), ((2, 2), (0, 3)), 2),    # r0 decodes; r1 ends; r2
                   ScheduledStep((6, 5), ((3, 1),), 3),         # r2's last token
                   ScheduledStep((6, 5), (), 2),                # r0 done after step 3
                   ScheduledStep((6,), (), 1)]
    # W2's shape: 16 whole prompts, then 16 decodes beside 15 prompts and 112 tokens
    w2 = workload_schedule(batch=32, input_len=128, output_len=128,
                           max_num_batched_tokens=2048, max_num_seqs=64)
    assert [(s.new_tokens, s.seqs, s.sampled) for s in w2[:3]] == [
        (2048, 16, 16), (2048, 32, 31), (47, 32, 32)]
    assert len(w2) == 130 and sum(s.sampled for s in w2) == 32 * 128


def test_token_seconds_by_hand() -> None:
    e = 2 * 576 + 576 + 2 * 192 + 3 * 1536
    assert elementwise_elements(SMOL) == e == 6720
    want = 32 * 30 * e * 4e-10 + 32 * (3e-5 + 49152 * 1e-10)
    assert token_seconds(SMOL, CPU, new_tokens=32, sampled=32) == pytest.approx(want, rel=1e-12)
    # a decode step carries it; a GPU's roofline (no figures) does not
    base = dataclasses.replace(CPU, elementwise_s=0.0, seq_overhead_s=0.0, logit_s=0.0)
    wb = model_weight_bytes(SMOL, "bf16")
    with_t, without = (decode_step(SMOL, hw, wb, batch=32, context=200, kv_dtype="bf16",
                                   weights_fmt="bf16").seconds for hw in (CPU, base))
    assert with_t - without == pytest.approx(want, rel=1e-9)
    m, m0 = (roofline_step_model(SMOL, hw, weight_fmt="bf16") for hw in (CPU, base))
    assert m.b - m0.b == pytest.approx(30 * e * 4e-10, rel=1e-9)
    assert m.c == pytest.approx(3e-5 + 49152 * 1e-10, rel=1e-12) and m0.c == 0.0


def test_a_mixed_step_by_hand() -> None:
    """Step 2 of the 3-prompt schedule: one decode at context 5, r1's tokens 2..3, r2's 0..2."""
    wb = model_weight_bytes(SMOL, "bf16")
    step = ScheduledStep((5,), ((2, 2), (0, 3)), 2)
    got = scheduled_step(SMOL, CPU, wb, step, kv_dtype="bf16", weights_fmt="bf16")
    tf = flops_per_token(SMOL, 5)
    # the chunks' body FLOPs (no lm_head), + the lm_head of r1's prompt, which ends here
    body = [prefill_flops(SMOL, n, logit_positions=0).total for n in (2, 3, 4)]
    flops = tf.total + body[2] - body[0] + body[1] + 2 * 49152 * 576
    # the chunks' attention runs at the decode attention's rate (the prefill op's rows are
    # its rows), not at the matmul rate
    att = [prefill_flops(SMOL, n, logit_positions=0).attention for n in (2, 3, 4)]
    chunk_attn = att[2] - att[0] + att[1]
    kv = request_kv(SMOL, 2, "bf16").bytes_reclaimed + request_kv(SMOL, 3, "bf16").bytes_reclaimed
    want = (max((wb.total + kv) / 20e9, (flops - tf.attention - chunk_attn) / 200e9)  # 6 rows
            + (tf.attention + chunk_attn) / 40e9 + 1e-4 + 30 * 2e-5
            + 6 * 30 * 6720 * 4e-10 + 2 * (3e-5 + 49152 * 1e-10))
    assert got.seconds == pytest.approx(want, rel=1e-12)
    assert (got.batch, got.context, got.flops) == (3, 5, pytest.approx(flops, rel=1e-12))
    w = workload_speed(SMOL, CPU, wb, input_len=4, output_len=3, batch_size=3,
                       kv_dtype="bf16", weights_fmt="bf16", max_num_batched_tokens=6)
    assert len(w.prefill_steps) == 3 and len(w.decode_steps) == 2
    assert w.prefill_steps[1].seconds == pytest.approx(want, rel=1e-12)


def test_a_mixed_step_pays_attention_items_of_its_decodes_only() -> None:
    """The fixed cost per (sequence, KV head, layer) of the decode attention is paid by the
    step's decoding sequences, not by its prompt chunks (they run the prefill op)."""
    wb = model_weight_bytes(SMOL, "bf16")
    step = ScheduledStep((5, 9), ((2, 2),), 2)
    with_items = dataclasses.replace(CPU, attention_seq_s=7e-7)
    a, b = (scheduled_step(SMOL, hw, wb, step, kv_dtype="bf16", weights_fmt="bf16")
            for hw in (with_items, CPU))
    assert a.t_attention - b.t_attention == pytest.approx(2 * 30 * 3 * 7e-7, rel=1e-9)
    assert a.seconds - b.seconds == pytest.approx(2 * 30 * 3 * 7e-7, rel=1e-9)


def test_probe_counts_the_elements_the_ledger_scales_by() -> None:
    """The element-wise probe (fitserve.engine.cpu_rates) divides its time by the same count
    per token and layer that ledger.speed multiplies a model's tokens and layers by."""
    from fitserve.engine import cpu_rates as probe

    ref = dataclasses.replace(SMOL, hidden_size=probe.EW_HIDDEN, num_heads=probe.EW_HEADS,
                              num_kv_heads=probe.EW_KV_HEADS, head_dim=probe.EW_HEAD_DIM,
                              intermediate_size=probe.EW_INTER)
    for spec in (ref, catalog_entry("Llama-3.1-8B").spec):
        assert probe.elementwise_elements(spec.hidden_size, spec.q_size, spec.kv_size,
                                          spec.intermediate_size) == elementwise_elements(spec)


@pytest.mark.parametrize(("mode", "group"), [("auto", 8), ("all", 1), ("off", 0), ("prefill", 0)])
def test_attention_probes_recover_the_costs_they_model(monkeypatch: pytest.MonkeyPatch,
                                                       mode: str, group: int) -> None:
    """The decode attention probes (fitserve.engine.cpu_rates) solve t(Hq, L) = Hkv x item + L x
    (Hkv x c_kv + Hq x c_q) per sequence for its three costs: on timings made from known costs
    (one set for the vector tile, another for the AMX tile from 8 query heads per KV head) they
    give those costs back, as FLOP/s (4 FLOPs per query head, key and dimension) and per-thread
    figures; the tile's figures only where the engine runs the tile ("auto" from 8, "all")."""
    from fitserve.engine import cpu_rates as probe
    from fitserve.kernels.cpu import paged_attention

    item, vec, tile = 3e-7, (2e-10, 5e-10), (1e-10, 4e-11)  # item; (c_kv, c_q) per key

    def seconds(keys: int, repeats: int, batch: int, hq: int = 8) -> float:
        hkv = probe.ATTENTION_KV_HEADS
        c_kv, c_q = tile if hq >= 8 * hkv else vec
        return batch * (hkv * item + keys * (hkv * c_kv + hq * c_q))

    monkeypatch.setattr(probe, "_attention_seconds", seconds)
    monkeypatch.setattr(paged_attention, "amx_mode", lambda: mode)
    threads, d = 2, 64
    flops, kv_s, seq_s = probe.measure_attention_rate(threads)
    assert flops == pytest.approx(threads * 4 * d / vec[1], rel=1e-9)
    assert kv_s == pytest.approx(vec[0] / d / threads, rel=1e-9)
    assert seq_s == pytest.approx(item / threads, rel=1e-6)
    t_flops, t_kv_s, t_group = probe.measure_attention_tile_rate(threads, seq_s * threads)
    assert t_group == group
    if group:
        assert t_flops == pytest.approx(threads * 4 * d / tile[1], rel=1e-9)
        assert t_kv_s == pytest.approx(tile[0] / d / threads, rel=1e-6)
    else:
        assert t_flops == t_kv_s == 0.0
