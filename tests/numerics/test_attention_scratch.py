"""The ledger's attention scratch, activations and sampler bytes against what torch allocates.

Peaks are measured with torch.profiler's memory events (every allocation and free through
torch's CPU allocator, in order): the largest running sum during the call is the call's peak
beyond what existed before it. The engine's own code runs (the backends' ``prefill`` and
``decode``, ``ModelRunner.execute``, ``Sampler``) on random tensors and a random
2-layer model with SmolLM2's attention geometry (9 query heads, 3 KV heads, head_dim 64), in
bf16 and fp32, and the formulas of fitserve.ledger.scratch / memory must equal the measurement,
or exceed it by exactly the term torch skipped (stated per test). Plain C++ allocations
(``new``) are invisible to the profiler: the fused decode kernel's partials are checked apart.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch

from fitserve.config import ModelSpec
from fitserve.kernels.cpu.paged_attention import DEFAULT_PARTITION, paged_attention_available
from fitserve.ledger import sampler_memory
from fitserve.ledger import scratch as S
from fitserve.ledger.memory import cpu_engine_memory_plan, cpu_step_bytes
from fitserve.model.attention.backend import AttentionBackend
from fitserve.model.attention.cpu_paged import CPU_PAGED_DECODE
from fitserve.model.attention.dispatch import choose_attention_backend, classify
from fitserve.model.attention.gather import EAGER_GATHER, TORCH_SDPA
from fitserve.model.layers import RotaryEmbedding
from fitserve.model.llama import CausalLM
from fitserve.runner.model_runner import ModelRunner
from fitserve.sampling import SamplingParams
from fitserve.sampling.sampler import RequestSamplingState, Sampler
from fitserve.types import ScheduledChunk, SchedulerOutput
from tests.memory_events import peak_extra

SPEC = ModelSpec(architecture="llama", vocab_size=1024, hidden_size=576, intermediate_size=1536,
                 num_layers=2, num_heads=9, num_kv_heads=3, head_dim=64,
                 max_position_embeddings=4096, name="random 2-layer, SmolLM2 attention")
ODD = ModelSpec(architecture="llama", vocab_size=301, hidden_size=96, intermediate_size=160,
                num_layers=1, num_heads=4, num_kv_heads=1, head_dim=24,
                max_position_embeddings=2048, name="head_dim 24, one KV head")
DTYPES = [torch.bfloat16, torch.float32]
BS = 16
CPU = torch.device("cpu")




def act_bytes(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits // 8


def paged_cache(spec: ModelSpec, seqs: int, keys: int, dtype: torch.dtype,
                ) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    """K/V caches [Hkv, NB, BS, D] of random values and one shuffled block table per sequence."""
    per_seq = -(-keys // BS)
    gen = torch.Generator().manual_seed(keys * 31 + seqs)
    shape = (spec.num_kv_heads, seqs * per_seq + 1, BS, spec.head_dim)
    k, v = torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype)
    order = (torch.randperm(seqs * per_seq, generator=gen) + 1).tolist()
    return k, v, [order[i * per_seq:(i + 1) * per_seq] for i in range(seqs)]


def repack_bytes(spec: ModelSpec, q_len: int, keys: int, a: int, threads: int) -> int:
    """What the ledger counts for torch's bf16 K/V repacking (0 in fp32)."""
    if a == 4:
        return 0
    ks = min(S.FLASH_KV_SPLIT, keys)
    return threads * ks * spec.head_dim * a + 2 * spec.num_kv_heads * keys * spec.head_dim * a


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f32"])
@pytest.mark.parametrize(("spec", "cached", "new"), [
    (SPEC, 0, 512),  # a first chunk: plain causal, no mask
    (SPEC, 768, 256),  # a chunk after cached tokens: the runner's bool mask
    (SPEC, 1000, 1048),  # 2048 keys, not a whole number of SDPA key tiles
    (SPEC, 0, 16), (SPEC, 2000, 16),  # few queries: torch does not repack K/V in bf16
    (ODD, 300, 200),  # head_dim 24, one KV head, a ragged last block
], ids=["causal-512", "256-after-768", "1048-after-1000", "causal-16", "16-after-2000", "odd"])
def test_prefill_chunk_scratch_is_what_sdpa_allocates(spec: ModelSpec, cached: int, new: int,
                                                      dtype: torch.dtype) -> None:
    keys, a, threads = cached + new, act_bytes(dtype), torch.get_num_threads()
    # (without the C++ kernel: with it a chunk runs one paged decode row per query, whose
    # scratch - int32 tables and lengths - the SDPA formula bounds from above)
    assert choose_attention_backend(classify("cpu", [new], [keys], cpp=False)) is TORCH_SDPA
    kc, vc, (table,) = paged_cache(spec, 1, keys, dtype)
    seq = TORCH_SDPA.build_prefill(0, cached, new, table, block_size=BS, window=None, device=CPU)
    q = torch.randn(new, spec.num_heads, spec.head_dim).to(dtype)
    measured = peak_extra(lambda: TORCH_SDPA.prefill(q, kc, vc, seq, spec.head_dim ** -0.5))
    masked = seq.mask is not None
    assert masked == (cached > 0)
    formula = S.prefill_chunk_bytes(spec, new, keys, block_size=BS, act_bytes=a, kv_bytes=a,
                                    threads=threads, masked=masked)
    # NOTE: exact where torch repacks K/V for its bf16 GEMM (or runs fp32); where it skips the
    # repack (few queries) the ledger is above by exactly that term, never below.
    assert formula - measured in (0, repack_bytes(spec, new, keys, a, threads)), (
        f"measured {measured:,} B, formula {formula:,} B")


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f32"])
@pytest.mark.parametrize(("backend", "seqs", "keys"), [
    (EAGER_GATHER, 8, 1000), (EAGER_GATHER, 16, 4096), (TORCH_SDPA, 4, 6000)], ids=repr)
def test_gather_decode_scratch(backend: AttentionBackend, seqs: int, keys: int,
                               dtype: torch.dtype) -> None:
    a, threads = act_bytes(dtype), torch.get_num_threads()
    assert choose_attention_backend(classify("cpu", [1] * seqs, [keys], cpp=False)) is backend
    kc, vc, tables = paged_cache(SPEC, seqs, keys, dtype)
    lens = [keys - (i % 3) for i in range(seqs)]
    d = backend.build_decode(tables, lens, block_size=BS, window=None, device=CPU)
    q = torch.randn(seqs, SPEC.num_heads, SPEC.head_dim).to(dtype)
    measured = peak_extra(lambda: backend.decode(q, kc, vc, d, 0.125))
    kind = backend.ledger_kind  # the mapping backend -> scratch formula lives on the backend
    formula = S.gather_decode_bytes(SPEC, seqs, keys, kind,  # type: ignore[arg-type]
                                    block_size=BS, act_bytes=a, kv_bytes=a, threads=threads)
    # NOTE: bf16 eager peaks while the fp32 probabilities are cast back, before q x scale's
    # output and its reshaped copy exist: the ledger counts those 2 x B x Hq x D too
    slack = 2 * seqs * SPEC.num_heads * SPEC.head_dim * a if (backend, a) == (EAGER_GATHER, 2) else 0
    assert formula - measured == slack, f"measured {measured:,} B, formula {formula:,} B"


@pytest.mark.skipif(not paged_attention_available(), reason="the C++ decode kernel is not built")
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f32"])
def test_fused_decode_allocates_its_output_only_through_torch(dtype: torch.dtype) -> None:
    seqs, keys, a = 16, 3000, act_bytes(dtype)
    kc, vc, tables = paged_cache(SPEC, seqs, keys, dtype)
    d = CPU_PAGED_DECODE.build_decode(tables, [keys] * seqs, block_size=BS, window=None,
                                      device=CPU)
    q = torch.randn(seqs, SPEC.num_heads, SPEC.head_dim).to(dtype)
    measured = peak_extra(lambda: CPU_PAGED_DECODE.decode(q, kc, vc, d, 0.125))
    out = seqs * SPEC.num_heads * SPEC.head_dim * a
    assert measured == out
    # the partials (``new float[]`` in paged_attention.cpp, not seen by the profiler):
    # 16 seqs x 3 KV heads x ceil(3000 / 256) = 12 partitions x G 3 x (64 + 2) floats x 4 B
    assert S.paged_decode_bytes(SPEC, seqs, keys, a) - out == 16 * 3 * 12 * 3 * 66 * 4


def random_model(dtype: torch.dtype, max_len: int) -> CausalLM:
    torch.manual_seed(0)
    model = CausalLM(SPEC, max_len).to(dtype)
    model.rotary = RotaryEmbedding(SPEC, max_len)  # fp32 tables, as build_model makes them
    for layer in model.layers:
        layer.self_attn.rotary = model.rotary  # type: ignore[union-attr]
    return model.eval().requires_grad_(False)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f32"])
def test_one_step_peak_is_the_ledgers(dtype: torch.dtype) -> None:
    """A whole engine step (runner.execute: inputs, masks, every layer, logits, sampling) over a
    random model: its peak beyond the KV cache is the ledger's step peak for the step's shape,
    and below the ledger's bound for the engine's budget and context."""
    a, threads, max_len, budget = act_bytes(dtype), torch.get_num_threads(), 4096, 1024
    model = random_model(dtype, max_len)
    runner = ModelRunner(model, SPEC, num_blocks=300, block_size=BS, kv_dtype=dtype, device=CPU)
    ids = [(i * 7) % 1000 for i in range(max_len)]
    states = {"r": RequestSamplingState(SamplingParams(temperature=0.0), ids, [])}
    table = list(range(1, 1 + max_len // BS))
    bound = cpu_engine_memory_plan(
        SPEC, weight_bytes=0, max_num_batched_tokens=budget, max_num_seqs=1, block_size=BS,
        kv_dtype={2: "bf16", 4: "f32"}[a], act_dtype_bytes=a, kv_blocks=300,
        max_model_len=max_len, threads=threads, fused_decode=True).step_bytes
    for cached, new in ((0, 1024), (1024, 1024), (3072, 1024)):
        keys = cached + new
        step = SchedulerOutput([ScheduledChunk("r", ids[cached:keys], cached,
                                               table[:keys // BS], True)], new)
        runner.execute(step, states)  # warm-up (and the cache holds this chunk for the next)
        measured = peak_extra(partial(runner.execute, step, states))
        if runner.use_cpp:  # one decode row per query: the profiler sees the torch part
            kernel = S.paged_prefill_bytes(SPEC, new, keys, block_size=BS, act_bytes=a)[0]
        else:
            kernel = S.prefill_chunk_bytes(SPEC, new, keys, block_size=BS, act_bytes=a,
                                           kv_bytes=a, threads=threads, masked=cached > 0)
        tensors = (new * keys if cached else 0) + (keys // BS) * 8  # mask, block ids
        sc = S.AttentionScratch(new, keys, kernel, 0, 0, tensors, True, threads)
        sampler = S.sampler_bytes(SPEC, 1)
        logits = SPEC.vocab_size * 4 + sampler  # one row sampled
        formula, _ = cpu_step_bytes(SPEC, new, a, sc, logits)
        # NOTE: the ledger counts the sampler's worst path; a plain greedy row takes none of it
        # NOTE: with the C++ kernel a prefill chunk runs one paged decode row per query
        # (batch invariance): its fp32 partials are a C++ allocation the profiler does not
        # see (counted from paged_attention.cpp: scratch.paged_prefill_bytes' second term)
        slack = sampler
        assert 0 <= formula - measured <= slack, (
            f"step ({cached}, {new}): measured {measured:,} B, formula {formula:,} B")
        assert measured <= bound


def test_sampler_within_its_bound() -> None:
    rows, vocab = 16, 4096
    hidden = torch.randn(rows, 64, dtype=torch.bfloat16)
    weight = torch.randn(vocab, 64, dtype=torch.bfloat16) * 0.05
    sampler, unit = Sampler(), rows * vocab * 4
    wide = dict(temperature=5.0, top_p=0.999)  # a nucleus wider than 256 and 4096 candidates
    cases: dict[str, list[dict[str, Any]]] = {
        "greedy": [dict(temperature=0.0)] * rows,
        "temperature": [dict(temperature=0.8)] * rows,
        "worst found": [dict(temperature=0.0, logprobs=1)]
                       + [dict(wide, top_k=vocab - 1, min_p=1e-9, logprobs=20)] * (rows - 1),
    }
    peaks = {}
    for name, params in cases.items():
        states = [RequestSamplingState(SamplingParams(**p), [1, 2], [3]) for p in params]
        def sample(states: list[RequestSamplingState] = states) -> Any:
            return sampler((hidden @ weight.T).float(), states)

        peaks[name] = peak_extra(sample) / unit
    # plain greedy takes the argmax of the logits themselves (no private copy): the peak is the
    # f32 logits made from the bf16 product (1 + 0.5), not the sampler
    assert 1.5 <= peaks["greedy"] < 1.51
    assert peaks["temperature"] < 5.01  # + the exponential race: probs, draws, q
    # the f32 logits + the sampler's worst path (tests/unit/sampling/test_sampler_memory.py
    # checks each path's formula exactly)
    assert peaks["worst found"] <= 1.5 + sampler_memory.sampler_bytes(vocab, rows) / unit, peaks


def test_ledger_constants_are_the_engines() -> None:
    assert DEFAULT_PARTITION == S.PAGED_PARTITION
    # prefill chunks take SDPA on a CPU without the C++ kernel, the kernel (one decode row per
    # query) with it; gather decode switches after 4096 keys
    for q_len, keys in ((2, 2), (512, 512), (2048, 8192), (16, 100_000)):
        assert choose_attention_backend(classify("cpu", [q_len], [keys])) is TORCH_SDPA
        assert (choose_attention_backend(classify("cpu", [q_len], [keys], cpp=True))
                is CPU_PAGED_DECODE)
    limit = S.GATHER_EAGER_MAX_KEYS
    assert choose_attention_backend(classify("cpu", [1] * 8, [limit], cpp=False)) is EAGER_GATHER
    assert choose_attention_backend(classify("cpu", [1] * 8, [limit + 1], cpp=False)) is TORCH_SDPA
    assert (choose_attention_backend(classify("cpu", [1] * 8, [limit + 1], cpp=True))
            is CPU_PAGED_DECODE)
    rope = RotaryEmbedding(SPEC, 1000)
    cos, sin = rope.cos, rope.sin
    assert isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor)
    assert cos.nbytes + sin.nbytes == S.rope_table_bytes(SPEC, 1000)
