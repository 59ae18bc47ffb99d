"""The CPU engine's ledger: a fixed KV budget, lines summed to the peak RSS; the engine knobs of
`fitserve plan` and their defaults; the W1 roofline function."""

from __future__ import annotations

import argparse
import json
from typing import Any

import pytest

from fitserve.config import EngineConfig
from fitserve.ledger import runtime
from fitserve.ledger.errors import PlanError
from fitserve.ledger.hardware import Hardware
from fitserve.ledger.memory import (
    DEFAULT_CPU_KV_BYTES,
    cpu_engine_memory_plan,
    engine_load_transient_bytes,
    engine_memory_plan,
)
from fitserve.ledger.scratch import paged_prefill_bytes
from fitserve.ledger.speed import decode_step_roofline
from fitserve.ledger.units import parse_bytes
from fitserve.tools.planner.cli import _add_arguments, main
from fitserve.tools.planner.model_source import catalog_entry

SMOL = catalog_entry("SmolLM2-135M").spec
MIB, GIB = 1 << 20, 1 << 30
W_BF16 = 134_515_008 * 2  # SmolLM2 parameters (tied embedding once) x 2 B


def _cpu(**kw: Any) -> Any:
    args: dict[str, Any] = dict(weight_bytes=W_BF16, max_num_batched_tokens=2048, max_num_seqs=64,
                                block_size=16, kv_dtype="bf16", act_dtype_bytes=2,
                                max_model_len=8192, threads=2, fused_decode=True)
    args.update(kw)
    return cpu_engine_memory_plan(SMOL, **args)


def test_cpu_plan_by_hand() -> None:
    p = _cpu(runtime_bytes=400 * MIB, load_transient_bytes=390 * MIB)
    assert [m.name for m in p.lines] == ["runtime baseline", "weights", "rope tables",
                                         "loading transient", "activation peak",
                                         "attention scratch", "logits", "sampler",
                                         "allocator retention", "KV pool"]
    # 1 GiB // (16 tokens x 23,040 B) = 2,912 blocks; allocated 2,912 x 368,640 B
    assert p.kv_pool_bytes == DEFAULT_CPU_KV_BYTES == GIB
    assert (p.num_kv_blocks, p.block_bytes) == (2912, 368_640)
    assert p.kv_allocated_bytes == p.line("KV pool").bytes == 1_073_479_680
    by = {m.name: m.bytes for m in p.lines}
    # RoPE: 2 tables x 8192 positions x 32 (head_dim 64 / 2) x 4 B
    assert by["rope tables"] == 2 * 8192 * 32 * 4 == 2_097_152
    # activations: 2048 tokens x (2 B x mlp 3 x 576 + 3 x 1536 = 6336, + 24 B of indices)
    act, logits = 2048 * 2 * 6336 + 2048 * 24, 64 * 49152 * 4
    assert (by["activation peak"], by["logits"]) == (26_001_408, logits) and act == 26_001_408
    # the prefill chunk through the flash-style op (scratch.paged_prefill_bytes), 2048 queries
    # at 8192 keys in the backend's slices of 110 rows: torch 2048 x 1152 + 2 x 110 x 1152 +
    # 512 x 4 = 2,614,784; C++ 1,760 + 16 x 16 + 2 threads x (256 + 811,008 + 82,224) =
    # 1,788,992: 4,403,776, below the fused decode of 64 x 8192 keys (73,728 + 64 x 76,032 =
    # 4,939,776), which is then the worst attention call
    prefill = sum(paged_prefill_bytes(SMOL, 2048, 8192, block_size=16, act_bytes=2,
                                      threads=2))
    assert prefill == 2_614_784 + 1_788_992 < 4_939_776
    assert by["attention scratch"] == 16_777_216 + 262_144 + 4_939_776
    # the sampler's copy of the logits (64 rows) + two buffers of a 21-row chunk + 3 rows'
    # nuclei sorted in full, 6 rows each (fitserve.ledger.sampler_memory)
    assert by["sampler"] == (64 + 2 * 21 + 6 * 3) * 49152 * 4 == 24_379_392
    # phases: attention 2048 x (2 x 3264 + 24) + 4,939,776 = 18,358,272, mlp 26,001,408,
    # sampling 2048 x 576 x 2 + logits + sampler = 39,321,600 (sets the live peak); the heap
    # keeps the other two: 44,359,680
    assert by["allocator retention"] == 18_358_272 + 26_001_408
    assert (p.step_bytes, p.step_phase) == (17_039_360 + 39_321_600 + 44_359_680, "sampling")
    assert p.peak_bytes == (400 * MIB + W_BF16 + 2_097_152 + 1_073_479_680
                            + 17_039_360 + 39_321_600 + 44_359_680)
    assert p.peak_with_kv(p.kv_allocated_bytes) == p.peak_bytes
    assert "sets the peak" not in p.line("loading transient").note


def test_cpu_plan_sdpa_prefill_without_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    # no C++ kernel: prefill chunks gather K/V and run SDPA; on a CPU with AMX bf16 torch's
    # SDPA repacks K/V (fitserve.ledger.scratch.cpu_sdpa_bytes)
    monkeypatch.setattr("fitserve.ledger.scratch.cpu_has_amx_bf16", lambda: True)
    p = _cpu(fused_decode=False, max_num_seqs=1)
    # masks 2048 x 8192 bools + the gather decode's 2 x 8192 + a block table of 512 x 8 B +
    # the chunk (tests/unit/ledger/test_attention_scratch.py)
    assert p.line("attention scratch").bytes == 16_777_216 + 16_384 + 4096 + 50_409_472


def test_cpu_plan_at_long_context() -> None:
    # 4 sequences, a 2048-token budget and 32k context: the runner's bool masks grow with the
    # context, the fused kernel's chunk scratch does not (its rows run in slices)
    p = _cpu(max_num_seqs=4, max_model_len=32768, runtime_bytes=0, load_transient_bytes=0)
    tables = 2048 * 32768 + 4 * 2048 * 8  # masks and 4 block tables of 2048 blocks
    # a row of 32768 keys: 128 partitions x 3 x 3 x 66 x 4 = 304,128 B, slices of 27 rows;
    # torch 2048 x 1152 + 2 x 27 x 1152 + 2048 x 4; C++ 2 x 27 x 8 + 4 items x 16, + 2 threads
    # x (256 + a 27-row tile of 128 partitions 27 x 128 x 198 x 4 + row states 82,224)
    chunk = 2_359_296 + 62_208 + 8_192 + 432 + 64 + 2 * (256 + 2_737_152 + 82_224)
    assert p.line("attention scratch").bytes == tables + chunk == tables + 8_069_456
    # live: attention 2048 x 6552 + chunk = 21,487,952 < mlp 26,001,408 > sampling
    # 2048 x 576 x 2 + logits 4 x 49,152 x 4 + sampler 3,538,944 = 6,684,672; the heap keeps
    # the attention and sampling phases' pages too
    assert p.step_phase == "mlp"
    assert p.line("allocator retention").bytes == 21_487_952 + 6_684_672
    assert p.step_bytes == tables + 26_001_408 + 21_487_952 + 6_684_672


def test_cpu_plan_loading_sets_the_peak_with_a_small_pool() -> None:
    p = _cpu(kv_cache_memory_bytes=64 * MIB, runtime_bytes=0, load_transient_bytes=390 * MIB)
    assert p.num_kv_blocks == 64 * MIB // 368_640 == 182
    assert p.peak_bytes == W_BF16 + 2_097_152 + 390 * MIB
    assert "sets the peak" in p.line("loading transient").note


def test_cpu_plan_fixed_blocks_and_errors() -> None:
    assert _cpu(kv_blocks=100, kv_cache_memory_bytes=GIB).num_kv_blocks == 100  # blocks win
    with pytest.raises(PlanError, match="kv-cache-memory"):
        _cpu(kv_cache_memory_bytes=1000)
    with pytest.raises(PlanError, match="num_kv_blocks"):
        _cpu(kv_blocks=0)


def test_load_transient_by_hand() -> None:
    # loader copy (W) + fused: 30 layers x (576 q + 2 x 192 kv + 2 x 1536) x 576 x 2 B
    assert engine_load_transient_bytes(SMOL, W_BF16, 2) == W_BF16 + 30 * 4032 * 576 * 2


def test_gpu_plan_honours_given_pool_and_in_use() -> None:
    base = dict(weight_bytes=W_BF16, total_memory_bytes=80 * GIB, memory_utilization=0.9,
                max_num_batched_tokens=2048, max_num_seqs=64, block_size=16, kv_dtype="bf16",
                act_dtype_bytes=2, workspace_bytes=GIB)
    free = engine_memory_plan(SMOL, **base)  # type: ignore[arg-type]
    used = engine_memory_plan(SMOL, **base, in_use_bytes=500 * MIB)  # type: ignore[arg-type]
    assert free.kv_pool_bytes - used.kv_pool_bytes == 500 * MIB
    assert used.line("in use before start").bytes == 500 * MIB
    fixed = engine_memory_plan(SMOL, **base, kv_cache_memory_bytes=GIB)  # type: ignore[arg-type]
    assert fixed.num_kv_blocks == 2912 and fixed.kv_pool_bytes == GIB


def test_parse_bytes_like_the_engine_cli() -> None:
    assert parse_bytes("512M") == 512 * MIB and parse_bytes("2G") == 2 * GIB
    assert parse_bytes("1.5GiB") == 3 * GIB // 2 and parse_bytes("1024") == 1024
    with pytest.raises(PlanError):
        parse_bytes("lots")


def test_engine_knob_defaults_are_the_engines() -> None:
    p = argparse.ArgumentParser()
    _add_arguments(p)
    a = p.parse_args(["smollm2"])
    e = EngineConfig()
    assert (a.dtype, a.block_size, int(a.max_num_batched_tokens), a.num_kv_blocks) == (
        e.dtype, e.cache.block_size, e.scheduler.max_num_batched_tokens, e.cache.num_kv_blocks)
    assert a.kv_cache_memory is None and e.cache.kv_cache_memory_bytes is None
    assert a.memory_utilization == e.cache.gpu_memory_utilization


def test_cpu_plan_json(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(runtime, "runtime_baseline_bytes", lambda **_: 300 * MIB)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # what scratch.cpu_threads() reads
    monkeypatch.delenv("FITSERVE_DISABLE_CPP", raising=False)
    assert main(["smollm2-135m", "--gpu", "cpu", "--dtype", "float32", "--weights", "float32",
                 "--block-size", "32",
                 "--kv-cache-memory", "512M", "--max-num-seqs", "16", "--json"]) == 0
    e = json.loads(capsys.readouterr().out)["engine"]
    assert (e["device"], e["dtype"], e["weights"], e["kv_dtype"]) == ("cpu", "f32", "f32", "f32")
    # 512 MiB // (32 x 46,080 B) = 364 blocks; all weights in f32 (embedding too)
    assert (e["num_kv_blocks"], e["block_bytes"], e["kv_bytes_per_token"]) == (364, 1_474_560,
                                                                               46_080)
    assert e["weight_bytes"] == 134_515_008 * 4 and e["max_num_seqs"] == 16
    lines = e["lines"]
    assert lines["runtime baseline"] == 300 * MIB
    # the default context 8192 is the max_model_len: 2 x 8192 x 32 x 4 B
    assert lines["rope tables"] == 2_097_152
    # fp32, T = 2048 queries x L = 8192 keys through the flash-style op (slices of 110 rows,
    # as in test_cpu_plan_by_hand): masks 2048 x 8192 + 16 block tables x 256 blocks of 32 x
    # 8 B + torch 2048 x 9 x 64 x 4 + 2 x 110 x 2304 + 256 x 4 + C++ 1,788,992 (2 threads)
    assert lines["attention scratch"] == (16_777_216 + 32_768 + 4_718_592 + 506_880 + 1_024
                                          + 1_788_992) == 23_825_472
    # 16 sequences: logits 16 x 49,152 x 4 = 3 MiB; sampler: its copy of them, two buffers of
    # one 16-row chunk and 2 rows' full nucleus sorts, 6 rows each (sampler_memory)
    assert (lines["logits"], lines["sampler"]) == (3 * MIB, (16 + 2 * 16 + 12) * 49_152 * 4)
    # phases: attention 2048 x (4 x 3264 + 24) + 7,015,488 = 33,803,328, mlp 2048 x (4 x 6336
    # + 24) = 51,953,664 (the live peak), sampling 2048 x 576 x 4 + 3 MiB + 60 rows = 19,660,800
    assert lines["allocator retention"] == 33_803_328 + 19_660_800
    step = 16_777_216 + 32_768 + 51_953_664 + 33_803_328 + 19_660_800
    assert e["step_bytes"] == step
    assert e["peak_bytes"] == 300 * MIB + e["weight_bytes"] + lines["rope tables"] + max(
        lines["loading transient"], e["kv_allocated_bytes"] + step)


def test_cpu_plan_warns_when_not_what_the_engine_does(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(runtime, "runtime_baseline_bytes", lambda **_: None)
    # mxfp4 weights and a per-layer-scale fp8 KV: formats the engine cannot hold (int8/int4/fp8
    # weights it can: quantized at load; fp8_e4m3 / int8 KV with per-token or per-channel scales)
    assert main(["smollm2-135m", "--gpu", "cpu", "--dtype", "bfloat16", "--weights", "mxfp4",
                 "--kv", "fp8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert sum("HYPOTHETICAL for fitserve on cpu" in w for w in out["warnings"]) == 2
    assert out["engine"]["lines"]["runtime baseline"] == 0
    assert main(["smollm2-135m", "--gpu", "cpu", "--dtype", "bfloat16", "--weights", "fp8",
                 "--kv", "int8-kc", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert not any("HYPOTHETICAL" in w for w in out["warnings"])


def test_decode_step_roofline_by_hand() -> None:
    hw = Hardware("test", 0, 100e9, 1e12, None, None, "none", 0.0, 0.0, "test")
    st = decode_step_roofline(SMOL, hw, batch=1, context=100, weight_fmt="bf16", kv_dtype="bf16")
    # weights 269,030,016 B + KV 100 tokens x 23,040 B, over 100 GB/s
    assert st.weight_bytes == W_BF16 and st.kv_bytes == 100 * 23_040
    assert st.t_memory == pytest.approx((W_BF16 + 2_304_000) / 100e9)
    assert st.seconds == max(st.t_memory, st.t_compute) and st.bound == "memory"
    f32 = decode_step_roofline(SMOL, hw, batch=1, context=100, weight_fmt="f32", kv_dtype="f32")
    assert f32.weight_bytes == 2 * W_BF16  # every tensor in f32, as the engine holds them
    big = decode_step_roofline(SMOL, hw, batch=4096, context=100, weight_fmt="bf16",
                               kv_dtype="bf16")
    assert big.bound == "compute" and big.seconds == big.t_compute
