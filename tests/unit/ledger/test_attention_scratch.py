"""The CPU engine's attention scratch, RoPE tables and sampler copies, in exact bytes.

Every number is worked out by hand in the comments from the formulas of fitserve.ledger.scratch
(what torch 2.13's CPU SDPA and the engine's own code allocate; the measurements are repeated
against torch in tests/numerics/test_attention_scratch.py).
"""

from __future__ import annotations

import dataclasses

import pytest

from fitserve.ledger import scratch
from fitserve.ledger.scratch import (
    ScratchKind,
    cpu_attention_scratch,
    cpu_sdpa_bytes,
    flash_q_split,
    gather_decode_bytes,
    paged_decode_bytes,
    paged_partials_bytes_per_row,
    paged_prefill_bytes,
    paged_prefill_rows,
    prefill_chunk_bytes,
    rope_table_bytes,
    sampler_bytes,
)
from fitserve.tools.planner.model_source import catalog_entry

SMOL = catalog_entry("SmolLM2-135M").spec  # 9 query heads, 3 KV heads, head_dim 64, V 49,152


def test_flash_query_tiles() -> None:
    assert [flash_q_split(t) for t in (1, 7, 32, 191, 192, 767, 768, 4096)] == [
        1, 7, 32, 32, 64, 64, 256, 256]


def test_prefill_chunk_smollm2_bf16_default_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    # without AMX torch's flash attention never repacks K/V (measured on Zen 4): 2 x 3 x 8192
    # x 64 x 2 + 2 x 512 x 64 x 2 fewer bytes
    unpacked = cpu_sdpa_bytes(num_heads=9, num_kv_heads=3, head_dim=64, q_len=2048,
                              kv_len=8192, act_bytes=2, threads=2, masked=True, packed=False)
    assert unpacked == 2_359_296 + 73_728 + 1_183_744 + 524_288 + 33_554_432
    # the figures below are a CPU with AMX bf16 (a Xeon), where it repacks
    monkeypatch.setattr("fitserve.ledger.scratch.cpu_has_amx_bf16", lambda: True)
    # T = 2048 queries x L = 8192 keys, bf16, 2 threads, block 16:
    #   K, V copies     2 x 3 x 8192 x 64 x 2        =  6,291,456
    #   SDPA output     9 x 2048 x 64 x 2            =  2,359,296
    #   logsumexp       9 x 2048 x 4                 =     73,728
    #   fp32 tiles      2 x (256 x 512 + 512 + 256 x 64) x 4 = 1,183,744
    #   bf16 tile       2 x 256 x 512 x 2            =    524,288
    #   K transpose     2 x 512 x 64 x 2             =    131,072
    #   repacked K, V   2 x 3 x 8192 x 64 x 2        =  6,291,456
    #   float mask      2048 x 8192 x 2              = 33,554,432
    sdpa = cpu_sdpa_bytes(num_heads=9, num_kv_heads=3, head_dim=64, q_len=2048, kv_len=8192,
                          act_bytes=2, threads=2, masked=True)
    assert sdpa == 2_359_296 + 73_728 + 1_183_744 + 524_288 + 131_072 + 6_291_456 + 33_554_432
    chunk = prefill_chunk_bytes(SMOL, 2048, 8192, block_size=16, act_bytes=2, kv_bytes=2,
                                threads=2, masked=True)
    assert chunk == 6_291_456 + sdpa == 50_409_472
    # prefill chunks through SDPA (a quantized KV cache: see test_paged_prefill_chunk for the
    # fused kernel's rows)
    s = cpu_attention_scratch(SMOL, max_num_batched_tokens=2048, max_model_len=8192,
                              max_num_seqs=64, block_size=16, act_bytes=2, kv_bytes=2, threads=2,
                              paged_prefill=False)
    assert (s.prefill_queries, s.keys, s.prefill_bytes) == (2048, 8192, 50_409_472)
    # the runner's bool masks, 2048 x 8192, and 64 block tables of 512 int64 ids
    assert s.step_tensor_bytes == 16_777_216 + 262_144
    # fused decode, 64 sequences x 8192 keys: output 64 x 9 x 64 x 2 = 73,728; partials
    # 64 seqs x 3 KV heads x 32 partitions x G 3 x (64 + 2) floats x 4 B = 4,866,048
    assert s.decode_bytes == 73_728 + 4_866_048
    assert s.kernel_bytes == 50_409_472 and s.total_bytes == 67_448_832


def test_prefill_chunk_fp32_ragged_blocks() -> None:
    # budget 512 < max_model_len 1000 (63 blocks of 16 = 1008 key rows gathered), fp32, 1 thread
    #   K, V copies  2 x 3 x 1008 x 64 x 4  = 1,548,288
    #   output       9 x 512 x 64 x 4       = 1,179,648
    #   logsumexp    9 x 512 x 4            =    18,432
    #   fp32 tiles   (64 x 512 + 128 + 64 x 64) x 4 = 147,968 (512 queries: tiles of 64)
    #   float mask   512 x 1000 x 4         = 2,048,000   (no bf16 terms in fp32)
    s = cpu_attention_scratch(SMOL, max_num_batched_tokens=512, max_model_len=1000,
                              max_num_seqs=16, block_size=16, act_bytes=4, kv_bytes=4, threads=1,
                              paged_prefill=False)
    assert s.prefill_bytes == 1_548_288 + 1_179_648 + 18_432 + 147_968 + 2_048_000 == 4_942_336
    assert s.step_tensor_bytes == 512 * 1000 + 16 * 63 * 8  # masks + 16 tables of 63 blocks
    # decode: 16 x 9 x 64 x 4 = 36,864 + 16 x 3 x 4 partitions x 3 x 66 x 4 = 152,064
    assert s.decode_bytes == paged_decode_bytes(SMOL, 16, 1000, 4) == 36_864 + 152_064
    assert s.total_bytes == 512_000 + 8_064 + 4_942_336


def test_paged_prefill_chunk() -> None:
    # the fused kernel, one decode row per query: a row of 1000 keys spans 4 partitions of
    # 256, 3 KV heads x 4 x G 3 x (64 + 2) x 4 B = 9,504 B of fp32 partials; 8 MiB // 9,504
    # = 882 rows a call, more than the chunk's 512
    assert paged_partials_bytes_per_row(9, 3, 64, 1000) == 9_504
    assert paged_prefill_rows(9, 3, 64, 1000) == 882
    assert paged_partials_bytes_per_row(9, 3, 64, 256) == 0  # one partition: none
    # 512 queries after 488 cached (489..1000 keys), fp32, block 16 (63 blocks), 1 thread,
    # one call (R = 512):
    #   torch  q copy + op output 2 x 512 x 9 x 64 x 4 = 2,359,296 + int32 ids 63 x 4 = 252
    #   C++    per call: first_part / num_parts 2 x 512 x 8 = 8,192, 16 tiles x 3 heads = 48
    #          items (capacity 64) x 16 = 1,024, acc 64 x 4 = 256
    #          per thread: partials of a 32-row tile whose last row reads 1000 keys (4
    #          partitions): 32 x 4 x 3 x 66 x 4 = 101,376; row states, the larger of
    #          PrefillRow 32 x (2 x 3 x 64 x 4 + 2 x 3 x 4 + 3 x 96 x 2) = 68,352 and DotRows
    #          (rh 96, q pairs of 48): 24,576 + 768 + 24,576 + 18,432 + 12,288 + 128 x 12
    #          + 4 x 12 = 82,224
    assert scratch.paged_prefill_thread_bytes(3, 64) == 82_224
    torch_b, cpp = paged_prefill_bytes(SMOL, 512, 1000, block_size=16, act_bytes=4)
    assert (torch_b, cpp) == (2_359_296 + 252, 8_192 + 1_024 + 256 + 101_376 + 82_224)
    s = cpu_attention_scratch(SMOL, max_num_batched_tokens=512, max_model_len=1000,
                              max_num_seqs=16, block_size=16, act_bytes=4, kv_bytes=4, threads=2)
    two = paged_prefill_bytes(SMOL, 512, 1000, block_size=16, act_bytes=4, threads=2)
    assert two == (torch_b, cpp + 256 + 101_376 + 82_224)  # each thread's own
    assert s.paged_prefill and s.prefill_bytes == sum(two)
    # 2048 queries after 6144 cached (8192 keys): 32 partitions, 76,032 B a row of the old
    # decode-row partials, so the backend's slices of 110 rows (19: 18 x 110 + 68); bf16, 512
    # blocks. torch: the chunk's output 2048 x 1152 + 2 x 110 x 1152 + 512 x 4. The largest
    # item: a 32-row tile of slice 18 (rows 1980..2011, last reads 8156 keys: 32 partitions)
    # 32 x 32 x 198 x 4 = 811,008; per call 2 x 110 x 8 + (4 tiles x 3 = 12 -> 16) x 16
    assert paged_prefill_rows(9, 3, 64, 8192) == 110
    assert paged_prefill_bytes(SMOL, 2048, 8192, block_size=16, act_bytes=2) == (
        2048 * 1152 + 2 * 110 * 1152 + 512 * 4, 1_760 + 256 + 256 + 811_008 + 82_224)


def test_budget_above_context_and_short_decode() -> None:
    # budget 8192 > max_model_len 256: one chunk has at most 256 queries; masks still bound
    # every chunk of the step (8192 queries x 256 keys); 256 keys are one decode partition
    s = cpu_attention_scratch(SMOL, max_num_batched_tokens=8192, max_model_len=256,
                              max_num_seqs=8, block_size=16, act_bytes=4, kv_bytes=4, threads=1)
    assert (s.prefill_queries, s.keys, s.step_tensor_bytes) == (256, 256, 8192 * 256 + 8 * 16 * 8)
    assert s.decode_bytes == 8 * 9 * 64 * 4  # the output only: no partials


def test_gather_decode_without_the_cpp_kernel() -> None:
    # bf16, 32 sequences, max_model_len 6000, 2 threads: eager at 4096 keys
    #   K, V copies 2 x 3 x 32 x 4096 x 64 x 2 = 100,663,296; scores 9 x 32 x 4096 x (4 + 4 + 2)
    #   = 11,796,480; q x scale, output, reshaped output 3 x 32 x 9 x 64 x 2 = 110,592
    eager = gather_decode_bytes(SMOL, 32, 4096, ScratchKind.GATHER_EAGER, block_size=16,
                                act_bytes=2, kv_bytes=2, threads=2)
    assert eager == 100_663_296 + 11_796_480 + 110_592
    # SDPA at 6000 keys (375 blocks): copies 2 x 3 x 32 x 6000 x 64 x 2 = 147,456,000; SDPA
    # output 32 x 9 x 64 x 2 = 36,864, logsumexp 32 x 9 x 4 = 1,152, tiles 2 x (512 + 2 + 64)
    # x 4 = 4,624, bf16 tile 2 x 512 x 2 = 2,048, float mask 32 x 6000 x 2 = 384,000
    sdpa = gather_decode_bytes(SMOL, 32, 6000, ScratchKind.GATHER_SDPA, block_size=16,
                               act_bytes=2, kv_bytes=2, threads=2)
    assert sdpa == 147_456_000 + 36_864 + 1_152 + 4_624 + 2_048 + 384_000
    s = cpu_attention_scratch(SMOL, max_num_batched_tokens=2048, max_model_len=6000,
                              max_num_seqs=32, block_size=16, act_bytes=2, kv_bytes=2, threads=2,
                              fused_decode=False)
    assert s.decode_bytes == max(eager, sdpa) == sdpa
    # masks: 2048 x 6000 prefill bools + visible and hidden [32, 6000] bools for decode; 32
    # block tables of 375 int64 ids
    assert s.step_tensor_bytes == 12_288_000 + 384_000 + 96_000


def test_rope_tables_and_sampler() -> None:
    assert rope_table_bytes(SMOL, 8192) == 2 * 8192 * 32 * 4 == 2 * 1024 * 1024
    assert rope_table_bytes(SMOL, 4096) == 1024 * 1024
    # 8 rows in one chunk: the copy (8 rows) + probs and the renormalised top-k (2 x 8) + one
    # row's nucleus sorted in full (its x and probs rows, values, int64 indices, sums: 6), fp32
    assert sampler_bytes(SMOL, 8) == (8 + 16 + 6) * 49152 * 4 == 5_898_240
    # a 256k vocabulary at 64 sequences: chunks of 4 rows; 78 MiB where 15 copies were 960
    gemma = dataclasses.replace(SMOL, vocab_size=262_144)
    assert sampler_bytes(gemma, 64) == (64 + 8 + 6) * 262_144 * 4 == 78 * 2**20


def test_threads_and_cpp_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert scratch.cpu_threads() == 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert scratch.cpu_threads() >= 1
    monkeypatch.setenv("FITSERVE_DISABLE_CPP", "1")
    assert scratch.cpp_kernels_disabled()
    monkeypatch.setenv("FITSERVE_DISABLE_CPP", "0")
    assert not scratch.cpp_kernels_disabled()
