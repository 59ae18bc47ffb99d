"""The dispatch rule: classification, and for every shape class a backend that exists on that
device and gives the float64 answer through the engine's attention entry point, with the fused
C++ kernel loaded and without it."""

from __future__ import annotations

import itertools

import pytest
import torch

from fitserve.kernels.cpu.paged_attention import paged_attention_available
from fitserve.model.attention.cpu_paged import CPU_PAGED_DECODE, CPU_PAGED_DECODE_KVQ
from fitserve.model.attention.dispatch import (
    BACKENDS,
    ShapeClass,
    choose_attention_backend,
    classify,
)
from fitserve.model.attention.gather import EAGER_GATHER, TORCH_SDPA
from fitserve.model.attention.paged import AttentionBatch, paged_attention, write_kv
from fitserve.model.attention.triton_attn import TRITON_DECODE, TRITON_PREFILL

BS, HQ, HKV, D = 16, 4, 2, 16
BATCH = {"1": 1, "2-8": 3, "9+": 9}
# (new tokens, cached tokens) of the longest sequence per length bucket
DECODE_LEN = {"<=512": 100, "<=4096": 600, ">4096": 4100}
CHUNK = {"<=512": (5, 10), "<=4096": (3, 600), ">4096": (2, 4100)}


def test_classify() -> None:
    assert classify("cpu", [1, 1], [100, 5000]) == ShapeClass("cpu", "decode", "2-8", ">4096")
    assert classify("cpu", [7], [7]) == ShapeClass("cpu", "prefill", "1", "<=512")
    assert classify("cuda", [1] * 32, [600] * 32, triton=True).batch_bucket == "9+"
    assert classify("cpu", [1], [10], cpp=True).cpp


def test_cpu_rule() -> None:
    # numbers behind each line: docs/benchmarks.md, 'Attention backend rule' (bench_kernels.py)
    for t, s in ((128, 0), (256, 0), (1024, 0), (256, 1792), (512, 7680)):
        assert choose_attention_backend(classify("cpu", [t], [s + t])) is TORCH_SDPA
        # the fused kernel takes prefill too, one decode row per query (batch invariance)
        assert (choose_attention_backend(classify("cpu", [t], [s + t], cpp=True))
                is CPU_PAGED_DECODE)
    assert choose_attention_backend(classify("cpu", [1] * 32, [2048] * 32)) is EAGER_GATHER
    assert choose_attention_backend(classify("cpu", [1], [8192])) is TORCH_SDPA
    for lens in ([10], [8192], [300] * 32, [5000] * 4):  # the fused kernel takes every decode
        assert (choose_attention_backend(classify("cpu", [1] * len(lens), lens, cpp=True))
                is CPU_PAGED_DECODE)


def test_quantized_cache_decode_reads_codes_in_place() -> None:
    """A decode-only step over a quantized cache runs the quantized kernel (every batch and
    length); prefill chunks keep their backend (they read a dequantized copy)."""
    for lens in ([10], [8192], [300] * 32):
        pick = choose_attention_backend(classify("cpu", [1] * len(lens), lens, cpp=True,
                                                 kv_quant=True))
        assert pick is CPU_PAGED_DECODE_KVQ and pick.reads_quantized_kv
    assert not CPU_PAGED_DECODE.reads_quantized_kv
    assert choose_attention_backend(classify("cpu", [7], [7], cpp=True, kv_quant=True)) is TORCH_SDPA


def test_cuda_uses_triton_when_available() -> None:
    assert choose_attention_backend(classify("cuda", [1], [8192], triton=True)) is TRITON_DECODE
    assert choose_attention_backend(classify("cuda", [64], [8192], triton=True)) is TRITON_PREFILL
    assert choose_attention_backend(classify("cuda", [64], [8192], triton=False)) is TORCH_SDPA
    assert choose_attention_backend(classify("cuda", [1], [100], cpp=True)) is not CPU_PAGED_DECODE


def _shape(phase: str, batch: str, length: str) -> tuple[list[int], list[int]]:
    """(new tokens, cached tokens) per sequence: a ragged batch of this shape class."""
    n = BATCH[batch]
    if phase == "decode":
        longest = DECODE_LEN[length]
        return [1] * n, [longest - 1] + [(37 * i) % longest for i in range(1, n)]
    t, s = CHUNK[length]
    return [t] * n, [s] + [(29 * i) % (s + 1) for i in range(1, n)]


ALL = list(itertools.product(("cpu", "cuda"), ("decode", "prefill"), BATCH, DECODE_LEN,
                             (False, True), (False, True)))


@pytest.mark.parametrize("device,phase,batch,length,triton,cpp", ALL)
def test_every_shape_class_picks_a_backend_its_device_has(
    device: str, phase: str, batch: str, length: str, triton: bool, cpp: bool
) -> None:
    q_lens, cached = _shape(phase, batch, length)
    k_lens = [c + t for c, t in zip(cached, q_lens, strict=True)]
    sc = classify(device, q_lens, k_lens, triton=triton, cpp=cpp)
    assert sc == ShapeClass(device, phase, batch, length, triton, cpp)  # type: ignore[arg-type]
    backend = choose_attention_backend(sc)
    assert backend in BACKENDS
    if backend is CPU_PAGED_DECODE:
        assert device == "cpu" and cpp  # decode, and prefill one row per query
    if backend in (TRITON_DECODE, TRITON_PREFILL):
        assert device == "cuda" and triton
        assert backend is (TRITON_DECODE if phase == "decode" else TRITON_PREFILL)


def _reference(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, tables: list[list[int]],
               q_lens: list[int], k_lens: list[int]) -> torch.Tensor:
    outs, off = [], 0
    for t, n, table in zip(q_lens, k_lens, tables, strict=True):
        k = kc[:, table].double().reshape(HKV, -1, D)[:, :n]
        v = vc[:, table].double().reshape(HKV, -1, D)[:, :n]
        qg = q[off : off + t].double().view(t, HKV, HQ // HKV, D)
        s = torch.einsum("thgd,hld->hgtl", qg, k) * D**-0.5
        keep = torch.arange(n)[None, :] <= (n - t + torch.arange(t))[:, None]
        p = s.masked_fill(~keep, float("-inf")).softmax(-1)
        outs.append(torch.einsum("hgtl,hld->thgd", p, v).reshape(t, HQ, D))
        off += t
    return torch.cat(outs)


CPU = [(p, b, n, c) for p, b, n in itertools.product(("decode", "prefill"), BATCH, DECODE_LEN)
       for c in (False, True)]


@pytest.mark.parametrize("phase,batch,length,cpp", CPU)
def test_cpu_pick_runs_and_is_correct(phase: str, batch: str, length: str, cpp: bool) -> None:
    """The picked backend through its own builders and paged_attention == float64."""
    if cpp and not paged_attention_available():
        pytest.skip("the C++ extension is unavailable here (the cpp=False rows cover this)")
    dev = torch.device("cpu")
    q_lens, cached = _shape(phase, batch, length)
    k_lens = [c + t for c, t in zip(cached, q_lens, strict=True)]
    backend = choose_attention_backend(classify("cpu", q_lens, k_lens, cpp=cpp))
    gen = torch.Generator().manual_seed(len(q_lens) * 7 + max(k_lens))
    n_blocks = [-(-n // BS) for n in k_lens]
    order = torch.randperm(sum(n_blocks) + 2, generator=gen).tolist()
    tables, used = [], 0
    for nb in n_blocks:
        tables.append(order[used : used + nb])
        used += nb
    kc = torch.zeros(HKV, len(order), BS, D)  # the engine's caches start zeroed
    vc = torch.zeros_like(kc)
    for table, n in zip(tables, k_lens, strict=True):
        slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(n)])
        write_kv(torch.randn(n, HKV, D, generator=gen), torch.randn(n, HKV, D, generator=gen),
                 kc, vc, slots)
    q = torch.randn(sum(q_lens), HQ, D, generator=gen)
    slots_none = torch.empty(0, dtype=torch.long)
    if phase == "decode":
        batch_ = AttentionBatch(slots_none, backend.build_decode(
            tables, k_lens, block_size=BS, window=None, device=dev))
    else:
        offs = [sum(q_lens[:i]) for i in range(len(q_lens))]
        batch_ = AttentionBatch(slots_none, None, [
            backend.build_prefill(o, c, t, table, block_size=BS, window=None, device=dev)
            for o, c, t, table in zip(offs, cached, q_lens, tables, strict=True)])
    out = paged_attention(q, kc, vc, batch_, D**-0.5)
    ref = _reference(q, kc, vc, tables, q_lens, k_lens)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
