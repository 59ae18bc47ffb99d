"""The fused C++ paged decode attention kernel vs a float64 reference.

Reference: each sequence's blocks gathered by hand in float64 from the same (possibly 16-bit)
cache values, plain softmax over the visible keys. Tolerances:

- fp32 cache, or a 16-bit cache under an fp32 q (fp32 output): atol = rtol = 1e-5; the kernel
  only adds fp32 accumulation error (~1e-7 here) to inputs both sides read identically;
- 16-bit q and output: the kernel's fp32 result is rounded once to the output dtype, so
  |out - ref| <= half an ulp of ref (2^-8 relative for bf16, 2^-11 for fp16) + 1e-5, and
  nearly every element equals ref correctly rounded.

Every shape uses shuffled block tables, lengths that are not multiples of the block size, and
a cache filled with NaN everywhere the sequence's visible keys are not, so a read outside them
(padding, other blocks, keys left of a sliding window) turns the output NaN.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys

import pytest
import torch

from fitserve.kernels.cpu.build import cpp_disabled
from fitserve.kernels.cpu.paged_attention import (
    DEFAULT_PARTITION,
    kernel_isa,
    paged_attention_available,
    paged_decode_attention,
)
from fitserve.model.attention.cpu_paged import CPU_PAGED_DECODE
from fitserve.model.attention.gather import EAGER_GATHER, TORCH_SDPA
from fitserve.model.attention.paged import AttentionBatch, paged_attention, write_kv
from tests.conftest import asked_tier, run_tests_at_tier, torch_threads


def _expect_available() -> bool:
    return shutil.which(os.environ.get("CXX", "c++")) is not None and not cpp_disabled()


def test_builds_where_a_compiler_is_present() -> None:
    """A failed build must fail here, not turn every other test into a skip."""
    if not _expect_available():
        pytest.skip("no C++ compiler / FITSERVE_DISABLE_CPP set: the pure-torch path runs")
    assert paged_attention_available()
    assert kernel_isa() in ("avx512+bf16dot", "avx512", "avx2", "scalar")


pytestmark_cpp = pytest.mark.skipif(
    not _expect_available(), reason="no C++ compiler or FITSERVE_DISABLE_CPP=1"
)


class Paged:
    """A paged cache holding ragged sequences in shuffled blocks, NaN everywhere else."""

    def __init__(self, lens: list[int], *, hkv: int, d: int, bs: int, dtype: torch.dtype,
                 window: int | None, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        n_blocks = [-(-n // bs) for n in lens]
        total = sum(n_blocks) + 3
        order = torch.randperm(total, generator=gen).tolist()
        self.tables: list[list[int]] = []
        used = 0
        for n in n_blocks:
            self.tables.append(order[used : used + n])
            used += n
        self.k_cache = torch.full((hkv, total, bs, d), float("nan"), dtype=dtype)
        self.v_cache = torch.full((hkv, total, bs, d), float("nan"), dtype=dtype)
        self.lens, self.bs, self.window = lens, bs, window
        for table, n in zip(self.tables, lens, strict=True):
            lo = max(0, n - window) if window else 0  # keys a query at n-1 can see
            pos = torch.arange(lo, n)
            slots = torch.tensor([table[p // bs] * bs + p % bs for p in pos.tolist()],
                                 dtype=torch.long)
            k = torch.randn(len(pos), hkv, d, generator=gen).to(dtype)
            v = torch.randn(len(pos), hkv, d, generator=gen).to(dtype)
            write_kv(k, v, self.k_cache, self.v_cache, slots)

    def table_tensor(self) -> torch.Tensor:
        width = max(len(t) for t in self.tables)
        return torch.tensor([t + [0] * (width - len(t)) for t in self.tables], dtype=torch.int32)

    def reference(self, q: torch.Tensor, scale: float) -> torch.Tensor:
        """float64 [B, Hq, D]: gather by hand, plain softmax over the visible keys."""
        b_, hq, d = q.shape
        hkv = self.k_cache.shape[0]
        out = torch.zeros(b_, hq, d, dtype=torch.float64)
        for b, (table, n) in enumerate(zip(self.tables, self.lens, strict=True)):
            lo = max(0, n - self.window) if self.window else 0
            if n == 0:
                continue
            k = self.k_cache[:, table].double().reshape(hkv, -1, d)[:, lo:n]
            v = self.v_cache[:, table].double().reshape(hkv, -1, d)[:, lo:n]
            qg = q[b].double().view(hkv, hq // hkv, d)
            p = (torch.einsum("hgd,hld->hgl", qg, k) * scale).softmax(-1)
            out[b] = torch.einsum("hgl,hld->hgd", p, v).reshape(hq, d)
        return out


def _check(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert torch.isfinite(out).all(), "read a slot outside the visible keys (NaN leaked)"
    if out.dtype == torch.float32:
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
        return
    half_ulp = 2.0**-8 if out.dtype == torch.bfloat16 else 2.0**-11
    err = (out.double() - ref).abs()
    bound = ref.abs() * half_ulp + 1e-5
    assert (err <= bound).all(), f"max excess {(err - bound).max().item():.2e}"
    same = (out == ref.to(out.dtype)).double().mean().item()
    assert same > 0.99, f"only {same:.3f} of the outputs equal the correctly rounded reference"


# (batch, max_len, block_size, head_dim, num_kv, group, window)
SHAPES = [
    (1, 1, 16, 64, 3, 3, None),
    (1, 700, 16, 64, 3, 3, None),
    (2, 513, 8, 64, 3, 3, None),
    (5, 300, 32, 128, 2, 4, None),
    (7, 650, 16, 80, 2, 8, None),
    (33, 260, 16, 64, 3, 3, None),
    (4, 700, 16, 64, 1, 1, 100),
    (6, 400, 8, 128, 2, 4, 37),
    (3, 90, 32, 24, 2, 2, 1),
    (9, 500, 16, 64, 3, 3, 600),
    (3, 200, 16, 200, 2, 2, None),
    (3, 150, 16, 64, 1, 7, None),  # AVX-512 bf16 P @ V: heads in blocks of 4 + 3
]


@pytestmark_cpp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}L{}bs{}d{}h{}g{}w{}".format(*s))
def test_matches_float64_reference(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    b, max_len, bs, d, hkv, g, window = shape
    gen = torch.Generator().manual_seed(b * 1000 + max_len)
    lens = [max_len] + torch.randint(1, max_len + 1, (b - 1,), generator=gen).tolist()
    cache = Paged(lens, hkv=hkv, d=d, bs=bs, dtype=dtype, window=window, seed=b + d)
    scale = d**-0.5
    q = torch.randn(b, hkv * g, d, generator=gen).to(dtype)
    ref = cache.reference(q, scale)
    tables, seq_lens = cache.table_tensor(), torch.tensor(lens, dtype=torch.int32)
    for vectorized in (True, False):
        for partition in (DEFAULT_PARTITION, 48):
            out = paged_decode_attention(q, cache.k_cache, cache.v_cache, tables, seq_lens, scale,
                                         window, partition_size=partition, vectorized=vectorized)
            assert out.dtype == dtype and out.shape == q.shape
            _check(out, ref)
    if dtype != torch.float32:  # fp32 q over the 16-bit cache: the fp32 result itself
        out = paged_decode_attention(q.float(), cache.k_cache, cache.v_cache, tables, seq_lens,
                                     scale, window, partition_size=48)
        assert out.dtype == torch.float32
        _check(out, ref)


@pytestmark_cpp
def test_partition_merge_is_exact_and_batch_invariant() -> None:
    """The same sequence alone, in a batch, on 1 or 2 threads: bitwise the same output."""
    lens = [611, 5, 333, 1, 700, 64]
    cache = Paged(lens, hkv=3, d=64, bs=16, dtype=torch.bfloat16, window=None, seed=3)
    q = torch.randn(len(lens), 9, 64).bfloat16()
    tables, seq_lens = cache.table_tensor(), torch.tensor(lens, dtype=torch.int32)
    with torch_threads(2):
        together = paged_decode_attention(q, cache.k_cache, cache.v_cache, tables, seq_lens, 0.125)
    with torch_threads(1):
        for b in range(len(lens)):
            alone = paged_decode_attention(q[b : b + 1], cache.k_cache, cache.v_cache,
                                           tables[b : b + 1], seq_lens[b : b + 1], 0.125)
            assert torch.equal(alone[0], together[b])
    # and a split really happened: one partition per sequence gives different last bits
    unsplit = paged_decode_attention(q.float(), cache.k_cache, cache.v_cache, tables, seq_lens,
                                     0.125, partition_size=1 << 20)
    split = paged_decode_attention(q.float(), cache.k_cache, cache.v_cache, tables, seq_lens,
                                   0.125, partition_size=32)
    torch.testing.assert_close(split, unsplit, atol=1e-5, rtol=1e-5)
    assert not torch.equal(split, unsplit)


@pytestmark_cpp
def test_strided_q_int64_tables_and_empty_sequences() -> None:
    lens = [0, 17, 40]
    cache = Paged(lens, hkv=2, d=64, bs=16, dtype=torch.float32, window=None, seed=5)
    qk = torch.randn(3, 8 + 2, 64)
    q = qk[:, :8]  # the model's q: a strided slice of the fused projection
    assert not q.is_contiguous()
    tables = torch.tensor([[0, 0, 0], [*cache.tables[1], 0], cache.tables[2]], dtype=torch.long)
    out = paged_decode_attention(q, cache.k_cache, cache.v_cache, tables, torch.tensor(lens), 0.125)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    _check(out, cache.reference(q, 0.125))
    empty = paged_decode_attention(q[:0], cache.k_cache, cache.v_cache, tables[:0],
                                   torch.tensor([], dtype=torch.int32), 0.125)
    assert empty.shape == (0, 8, 64)


@pytestmark_cpp
def test_rejects_inputs_that_would_read_outside_the_cache() -> None:
    kc = torch.zeros(2, 4, 16, 64)
    q = torch.zeros(1, 4, 64)
    ok = torch.tensor([[1, 2]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="not a block of the cache"):
        paged_decode_attention(q, kc, kc, torch.tensor([[1, 4]], dtype=torch.int32),
                               torch.tensor([20]), 0.1)
    with pytest.raises(RuntimeError, match="exceeds its block table"):
        paged_decode_attention(q, kc, kc, ok, torch.tensor([33]), 0.1)
    with pytest.raises(RuntimeError, match="dtype"):
        paged_decode_attention(q.bfloat16(), kc.half(), kc.half(), ok, torch.tensor([3]), 0.1)
    with pytest.raises(RuntimeError, match="multiple"):
        paged_decode_attention(torch.zeros(1, 3, 64), kc, kc, ok, torch.tensor([3]), 0.1)


def _engine_reference(q: torch.Tensor, cache: Paged, q_lens: list[int], scale: float
                      ) -> torch.Tensor:
    """float64, bottom-right causal chunks: token i of a T-token chunk sits at L - T + i."""
    outs, offset = [], 0
    hkv, d = cache.k_cache.shape[0], cache.k_cache.shape[3]
    for t, n, table in zip(q_lens, cache.lens, cache.tables, strict=True):
        k = cache.k_cache[:, table].double().reshape(hkv, -1, d)[:, :n]
        v = cache.v_cache[:, table].double().reshape(hkv, -1, d)[:, :n]
        qg = q[offset : offset + t].double().view(t, hkv, -1, d)
        s = torch.einsum("thgd,hld->hgtl", qg, k) * scale
        keep = torch.arange(n)[None, :] <= (n - t + torch.arange(t))[:, None]
        p = s.masked_fill(~keep, float("-inf")).softmax(-1)
        outs.append(torch.einsum("hgtl,hld->thgd", p, v).reshape(t, -1, d))
        offset += t
    return torch.cat(outs)


@pytestmark_cpp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_backend_mixed_step(dtype: torch.dtype) -> None:
    """paged_attention with the backends' builders: 4 decodes (CpuPagedDecode) then 2 chunks."""
    dev = torch.device("cpu")
    q_lens = [1, 1, 1, 1, 7, 20]
    lens = [45, 1, 300, 17, 30, 20]
    cache = Paged(lens, hkv=3, d=64, bs=16, dtype=dtype, window=None, seed=11)
    q = torch.randn(sum(q_lens), 9, 64).to(dtype)
    decode = CPU_PAGED_DECODE.build_decode(cache.tables[:4], lens[:4], block_size=16,
                                           window=None, device=dev)
    assert decode.block_tables.dtype == torch.int32 and decode.visible is None
    prefills = [TORCH_SDPA.build_prefill(4, 23, 7, cache.tables[4], block_size=16, window=None,
                                         device=dev),
                EAGER_GATHER.build_prefill(11, 0, 20, cache.tables[5], block_size=16,
                                           window=None, device=dev)]
    batch = AttentionBatch(torch.empty(0, dtype=torch.long), decode, prefills)
    out = paged_attention(q, cache.k_cache, cache.v_cache, batch, 0.125)
    ref = _engine_reference(q, cache, q_lens, 0.125)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    # the gather path on the same decodes agrees (it reads the padding: finite garbage there)
    kc, vc = cache.k_cache.nan_to_num(0.5), cache.v_cache.nan_to_num(-0.5)
    eager = EAGER_GATHER.build_decode(cache.tables[:4], lens[:4], block_size=16, window=None,
                                      device=dev)
    only = AttentionBatch(torch.empty(0, dtype=torch.long), eager)
    fused = AttentionBatch(torch.empty(0, dtype=torch.long), decode)
    a = paged_attention(q[:4], kc, vc, only, 0.125)
    b = paged_attention(q[:4], kc, vc, fused, 0.125)
    torch.testing.assert_close(a.double(), b.double(), atol=tol, rtol=tol)


@pytestmark_cpp
def test_opcheck_and_torch_compile_fullgraph() -> None:
    """The fake kernel lets torch.compile trace the op as one opaque node (no graph break)."""
    cache = Paged([37, 100], hkv=2, d=64, bs=16, dtype=torch.float32, window=None, seed=2)
    tables, seq_lens = cache.table_tensor(), torch.tensor([37, 100], dtype=torch.int32)
    q = torch.randn(2, 6, 64)
    op = torch.ops.fitserve.paged_decode_attention.default
    torch.library.opcheck(op, (q, cache.k_cache, cache.v_cache, tables, seq_lens, 0.125, 0),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))

    def step(x: torch.Tensor) -> torch.Tensor:
        o = paged_decode_attention(x * 1.0, cache.k_cache, cache.v_cache, tables, seq_lens, 0.125)
        return o.sum(-1)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q), step(q))


def test_disable_cpp_env_forces_the_fallback() -> None:
    code = ("from fitserve.kernels.cpu.paged_attention import paged_attention_available as a;"
            "print(a())")
    env = {**os.environ, "FITSERVE_DISABLE_CPP": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "False"


def test_scale_is_applied_once() -> None:
    """A guard on the test's own reference: scale enters the softmax exactly once."""
    if not paged_attention_available():
        pytest.skip("extension unavailable")
    cache = Paged([50], hkv=1, d=64, bs=16, dtype=torch.float32, window=None, seed=9)
    q = torch.randn(1, 1, 64) * 4
    tables, seq_lens = cache.table_tensor(), torch.tensor([50])
    out = paged_decode_attention(q, cache.k_cache, cache.v_cache, tables, seq_lens, 1 / math.sqrt(64))
    wrong = cache.reference(q, 1.0)  # unscaled scores: a clearly different answer
    _check(out, cache.reference(q, 1 / math.sqrt(64)))
    assert (out.double() - wrong).abs().max() > 1e-2


@pytestmark_cpp
def test_tier_is_the_one_asked_for() -> None:
    assert asked_tier() == kernel_isa()


@pytestmark_cpp
@pytest.mark.slow
@pytest.mark.parametrize("tier", ["avx2", "avx512"])
def test_lower_tier_build_passes_the_reference(tier: str) -> None:
    """The AVX2 tile, and the AVX-512 one without AVX512-BF16 (Skylake-X's and Cascade Lake's
    fp32 tile), built with FITSERVE_CPU_TIER on a CPU whose own build runs the bf16-dot tiles,
    pass the same float64 checks."""
    run_tests_at_tier(__file__, tier, "tier_is or matches_float64 or batch_invariant")
