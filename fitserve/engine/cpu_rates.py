"""What the engine's own kernels reach on this CPU, for the planner's step-time model.

The planner and the ledger import no torch, so they take these figures as numbers: the ledger
runs ``python -m fitserve.engine.cpu_rates`` once per CPU (fitserve.ledger.hardware caches the
JSON it prints beside the copy bandwidth). Measured, each the median of the undisturbed runs
(within 1.25 x the best, as the copy bandwidth):

    matmul FLOP/s per path   x [M, K] @ W.T, W [N, K], N = 2048, at K = 576 and 2048 (a small
                             model's hidden and a 1-2B one's: the planner reads the rate at the
                             model's own hidden size) and M = 32 rows (a batched decode step)
                             and 512 (a prefill chunk), each call on another copy of W (96 MiB
                             of them: the weights stream from DRAM as a model's do), on the
                             engine's ops:
                             "int8act" = int4_linear with activations quantized per row to int8
                             (W4A8: the default as-stored Q4_0/Q4_1 path; int8 weights run the
                             same VNNI dot products), "bf16" = F.linear in bf16 (oneDNN),
                             "f32" = F.linear in float32
    attention FLOP/s         the engine's paged decode attention, bf16 cache, 32 sequences of
                             64 and of 256 keys, blocks interleaved as a batch's sequences
                             that grow together get them (one partition: a partition's merge
                             cost would read as per-key work) with 8 query / 2 KV heads of 64,
                             and of 256 keys with 2 / 2, each call on another layer's cache (96 MiB
                             of them, as a model's KV streams): per sequence t = Hkv x item + L
                             x (Hkv x c_kv + Hq x c_q). The query heads' part as FLOP/s (4
                             FLOPs per query head, key and dimension: q.k and p.v), the KV
                             heads' part (loading and converting each K / V row: SmolLM2's 3
                             query heads per KV head measured 1.2x the FLOP rate's time) per
                             KV head, key and dimension, the intercept per (sequence, KV head)
                             (its work item's setup, table walk and merge); the time includes
                             its KV reads, so the ledger adds it to the step rather than
                             overlapping it
    attention on AMX tiles   where the engine runs the decode attention on the AMX-BF16 tile
                             (``FITSERVE_AMX_ATTENTION=auto``: models with >= 8 query heads per
                             KV head), the same two parts measured on the tile at 256 keys with
                             16 and 32 query heads over 2 KV heads: the tile's cost per query
                             head is a fraction of the vector tile's, so the probes above
                             (2 and 8 query heads) would overstate it for those models
    step overhead            a decode step of the engine on a tiny random-weight Llama
                             (hidden 64) with 2 and with 8 layers: the per-layer cost is the
                             slope, the per-step cost (scheduler, sampler, lm_head call, Python)
                             the intercept; the tiny matmuls cost next to nothing, so what is
                             left is what every step of a real model pays besides its bytes and
                             FLOPs
    element-wise per token   the engine's fused element-wise ops of one decoder layer on 32 rows
                             of a SmolLM2-shaped layer (hidden 576, 9 / 3 heads of 64, MLP 1536):
                             two add_rms_norm_, rope_write_kv_ into a paged cache, silu_and_mul;
                             seconds per element of ``ledger.speed.elementwise_elements`` (what
                             the ledger multiplies by a model's widths, tokens and layers)
    weight stream at M = 1   bytes of weight per second the engine's one-row linears reach on
                             weights cycled past the LLC (a W1 step's linears), at K = 576 and
                             2048 (N = 8192): "int8act" = int4_linear with int8 activations,
                             "bf16" = the one-row bf16 linear (fitserve_dense::bf16_gemv where
                             the engine prefers it, else F.linear), "fp8" = the e4m3
                             per-channel fp8_linear (--weights fp8). A kernel whose own work per
                             byte is slower than the memory, or that does not overlap the two,
                             reads below the copy bandwidth: the planner's W1 floor is then
                             this rate, not the bandwidth. Timed on all the engine's threads
                             at once by the wall clock, as the copy bandwidth (a stream is
                             the memory system's rate, not one core's x threads)
    per sequence             the tiny model's decode step with 8 sequences against 1 (the slope:
                             scheduler, input building, sampling and output per sequence), plus
                             the greedy argmax over the vocabulary per logit (the engine's C++
                             argmax on [32, 49152] fp32 logits)

NOTE: timed as one thread's CPU time (``time.thread_time``, torch at 1 thread), the matmul rates
then multiplied by the engine's thread count (the weight stream excepted, see above): on the
shared 2-core host this was written on, wall-clock figures of the 2-thread ops under load 15-20
came out 5-50x low and moved 10x between runs (a descheduled thread stalls every OpenMP
barrier), while one thread's CPU time does not count the other processes. It assumes the GEMMs
scale over the cores (compute-bound ones do) and leaves out the thread pool's fork/join per op
(a few us each).
"""

from __future__ import annotations

import functools
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

GOOD_RUN_SLACK = 1.25
RATE_KS, RATE_N = (576, 2048), 2048  # as GEMV_K: a small model's hidden and a 1-2B one's
RATE_ROWS = (32, 512)  # a batched decode step, a prefill chunk
ATTENTION_KEYS = (64, 256)  # the attention probe's two key counts (slope and intercept)
ATTENTION_KV_HEADS = 2  # of 8 query heads of 64
CYCLE_BYTES = 96 << 20  # operands cycled through per op: past the last-level caches seen here
TINY_LAYERS = (2, 8)
GEMV_K = (576, 2048)  # a small model's hidden (SmolLM2-135M) and a 1-2B one's
# NOTE: 8192 rows (2.6-32 MB a call): at 2048 a K = 576 call (0.66 MB) spent ~7 of its ~37 us
# in the Python call and the thread pool's fork / join, which the engine's decode step does not
# pay per linear (its per-layer cost is measured apart: measure_step_overhead)
GEMV_N = 8192


def _good_median(seconds: list[float]) -> float:
    best = min(seconds)
    return statistics.median(s for s in seconds if s <= best * GOOD_RUN_SLACK)


def _time_call(fn: Callable[[], object], *, repeats: int, inner: int,
               clock: Callable[[], float] = time.thread_time) -> float:
    """Seconds per call by ``clock`` (this thread's CPU time unless told): the median of the
    undisturbed of ``repeats`` timings of ``inner`` calls."""
    fn()
    out = []
    for _ in range(repeats):
        t0 = clock()
        for _ in range(inner):
            fn()
        out.append((clock() - t0) / inner)
    return _good_median(out)


def _cycle(calls: list[Callable[[], object]]) -> Callable[[], object]:
    """One call after another, round and round: each call finds its operands out of cache."""
    state = [0]

    def call() -> object:
        state[0] = (state[0] + 1) % len(calls)
        return calls[state[0]]()
    return call


def _engine_layout(q: torch.Tensor, s: torch.Tensor, mins: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The int4 weight as the engine holds it: as panels (FITSERVE_HOLD_PANELS, the default),
    else row-major."""
    from fitserve import envs
    from fitserve.kernels.cpu.qlinear import hold

    return hold(q, s, mins, 32) if envs.FITSERVE_HOLD_PANELS() else (q, s, mins)


def _path_calls(m: int, k: int, n: int) -> dict[str, Callable[[], object]]:
    """Each path's op on x [m, k] and weights of n rows, cycling over copies of the weight
    that together pass CYCLE_BYTES (a model's weights stream from DRAM; one matrix called
    again and again would sit in the cache)."""
    from fitserve.kernels.cpu.qlinear import int4_linear, qlinear_ops_available

    g = torch.Generator().manual_seed(0)
    x32 = torch.randn(m, k, generator=g)
    xb = x32.bfloat16()

    def copies(nbytes: int) -> int:
        return max(2, CYCLE_BYTES // nbytes)

    # NOTE: copies of one random matrix (the kernels' speed does not depend on the values;
    # drawing 96 MiB of random numbers per path took longer than timing them)
    w1 = torch.randn(n, k, generator=g) * 0.02
    w32 = [w1.clone() for _ in range(copies(n * k * 4))]
    wb = [w1.bfloat16() for _ in range(copies(n * k * 2))]
    calls: dict[str, Callable[[], object]] = {
        "bf16": _cycle([functools.partial(F.linear, xb, w) for w in wb]),
        "f32": _cycle([functools.partial(F.linear, x32, w) for w in w32])}
    if qlinear_ops_available():
        s = (torch.rand(n, k // 32, generator=g) * 0.01).half()
        mins = (torch.rand(n, k // 32, generator=g) * -0.08).half()
        q1 = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
        qs = [q1.clone() for _ in range(copies(n * k // 2))]
        calls["int8act"] = _cycle([functools.partial(int4_linear, xb, *_engine_layout(q, s, mins),
                                                     32, True) for q in qs])
    return calls


def measure_matmul_rates(threads: int, repeats: int = 15) -> dict[str, list[float]]:
    """path -> [FLOP/s at each K of RATE_KS, at each of RATE_ROWS rows] (K-major) of the
    engine's ops on ``threads`` cores: one thread's rate x threads (see the module doc).

    NOTE: many short timings (~1-10 ms each) rather than a few long ones: on a shared host the
    undisturbed ones are then the many, and the median of those is the figure."""
    rates: dict[str, list[float]] = {}
    for k in RATE_KS:
        for m in RATE_ROWS:
            for path, fn in _path_calls(m, k, RATE_N).items():
                inner = max(1, 128 * 1024 // (m * k))
                sec = _time_call(fn, repeats=repeats, inner=inner)
                rates.setdefault(path, []).append(threads * 2 * m * k * RATE_N / sec)
    return rates


def _gemv_calls(k: int, cycle_bytes: int = CYCLE_BYTES) -> dict[str, Callable[[], object]]:
    """Each path's one-row linear (as the engine's W1 step calls it) on weights of GEMV_N x k,
    cycling over copies of ``cycle_bytes`` in all (``gemv_weight_bytes`` per call)."""
    from fitserve.kernels.cpu.fp8_gemv import fp8_gemv_available, fp8_linear
    from fitserve.kernels.cpu.qlinear import int4_linear, qlinear_ops_available
    from fitserve.model.linear import bf16_gemv_preferred
    from fitserve.quant.fp8 import quantize_fp8

    n, g = GEMV_N, torch.Generator().manual_seed(0)
    xb = torch.randn(1, k, generator=g).bfloat16()
    w1 = (torch.randn(n, k, generator=g) * 0.02).bfloat16()
    wb = [w1.clone() for _ in range(max(2, cycle_bytes // (n * k * 2)))]
    if bf16_gemv_preferred():
        gemv = torch.ops.fitserve_dense.bf16_gemv.default
        calls: dict[str, Callable[[], object]] = {
            "bf16": _cycle([functools.partial(gemv, xb, w, None) for w in wb])}
    else:
        calls = {"bf16": _cycle([functools.partial(F.linear, xb, w) for w in wb])}
    if qlinear_ops_available():
        s = (torch.rand(n, k // 32, generator=g) * 0.01).half()
        mins = (torch.rand(n, k // 32, generator=g) * -0.08).half()
        q1 = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
        qs = [q1.clone() for _ in range(max(2, cycle_bytes // (n * k // 2)))]
        calls["int8act"] = _cycle([functools.partial(int4_linear, xb, *_engine_layout(q, s, mins),
                                                     32, True) for q in qs])
    if fp8_gemv_available():  # --weights fp8: e4m3 codes, a float32 scale per output channel
        fw = quantize_fp8(w1.float(), "e4m3", "channel")
        codes = fw.data.view(torch.uint8)
        cs = [codes.clone() for _ in range(max(2, cycle_bytes // (n * k)))]
        calls["fp8"] = _cycle([functools.partial(fp8_linear, xb, c, fw.scales, "e4m3", "channel",
                                                 fw.block, None) for c in cs])
    return calls


def gemv_weight_bytes(path: str, k: int) -> int:
    """Bytes of weight one call of ``path``'s one-row linear reads (codes + fp16 scales and
    mins per group of 32 for int4; codes + a float32 scale per row for fp8)."""
    n = GEMV_N
    if path == "fp8":
        return n * k + 4 * n
    return n * k * 2 if path == "bf16" else n * k // 2 + 2 * 2 * n * (k // 32)


def measure_gemv_rates(threads: int, repeats: int = 15) -> dict[str, list[float]]:
    """path -> [weight bytes/s at each of GEMV_K] of the engine's one-row linears on
    ``threads`` cores, timed as the copy bandwidth is: all ``threads`` at once, wall clock, the
    median of the undisturbed runs.
    NOTE: not one thread's CPU time x threads as the matmul rates: a stream's rate is the
    memory system's, and one core streams more than 1 / threads of it (on the Xeon with AMX,
    one thread x 2 read 22-24 GB/s where the engine's W1 streamed its int4 rows at ~29, and the
    planner's W1 came out 1.50x low; 2 threads' wall clock at N = 8192: 36-43 GB/s there, its
    480 MiB LLC holding part of the 96 MiB cycle, so the copy bandwidth bounds W1 instead)."""
    rates: dict[str, list[float]] = {}
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for k in GEMV_K:
            for path, fn in _gemv_calls(k).items():
                # the copy bandwidth's rule: all threads at once, wall clock, undisturbed runs
                sec = _time_call(fn, repeats=repeats, inner=16, clock=time.perf_counter)
                rates.setdefault(path, []).append(gemv_weight_bytes(path, k) / sec)
    finally:
        torch.set_num_threads(before)
    return rates


def _attention_seconds(keys: int, repeats: int, batch: int, hq: int = 8) -> float:
    """CPU seconds of one call of the paged decode attention, ``batch`` sequences of ``keys``
    keys, ``hq`` query heads over ATTENTION_KV_HEADS, each call on another layer's cache."""
    from fitserve.kernels.cpu.paged_attention import (
        paged_attention_available,
        paged_decode_attention,
    )

    if not paged_attention_available():
        raise RuntimeError("the paged_attention C++ extension is not available")
    hkv, d, block = ATTENTION_KV_HEADS, 64, 16
    nblk = keys // block
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, hq, d, generator=g).bfloat16()
    # NOTE: the blocks as sequences that grow together get them (block j of sequence s is the
    # (j x batch + s)-th allocated), not in pool order: SmolLM2's W2 decode attention at 255
    # keys took 16.4 ms this way against 14.4 with each sequence's blocks adjacent
    tables = torch.arange(batch * nblk, dtype=torch.int32).reshape(nblk, batch).T.contiguous()
    lens = torch.full((batch,), keys, dtype=torch.int32)
    layers = max(2, CYCLE_BYTES // (2 * hkv * batch * keys * d * 2))  # a model's KV: past the LLC
    kv1 = torch.randn(hkv, batch * nblk, block, d, generator=g).bfloat16()
    caches = [(kv1.clone(), kv1.clone()) for _ in range(layers)]
    call = _cycle([functools.partial(paged_decode_attention, q, k, v, tables, lens, d ** -0.5)
                   for k, v in caches])
    return _time_call(call, repeats=repeats, inner=4)


def measure_attention_rate(threads: int, repeats: int = 15,
                           batch: int = 32) -> tuple[float, float, float]:
    """(FLOP/s of the query heads' work, seconds per KV head, key and dimension, seconds per
    (sequence, KV head)) of the engine's paged decode attention (see the module doc) on
    ``threads`` cores: one thread's rates x threads, its costs / threads (the work items spread
    over the cores). Per sequence t(Hq, L) = Hkv x item + L x (Hkv x c_kv + Hq x c_q): 8 query
    heads at 64 and 256 keys give the slope and intercept, 2 at 256 keys split the slope."""
    lo, hi = ATTENTION_KEYS
    hkv, d = ATTENTION_KV_HEADS, 64
    t_lo, t_hi = (_attention_seconds(n, repeats, batch) / batch for n in ATTENTION_KEYS)
    t_g1 = _attention_seconds(hi, repeats, batch, hq=hkv) / batch
    slope = max(1e-15, (t_hi - t_lo) / (hi - lo))  # Hkv x c_kv + 8 x c_q
    # NOTE: floored at a tenth of the slope: a loaded host's noise must not make the query
    # heads' work free (or negative)
    c_q = max(slope / 80, (t_hi - t_g1) / (hi * (8 - hkv)))
    c_kv = max(0.0, slope - 8 * c_q) / hkv
    item = max(0.0, t_lo - lo * slope) / hkv
    return threads * 4 * d / c_q, c_kv / d / threads, item / threads


def measure_attention_tile_rate(threads: int, item_s: float, repeats: int = 15,
                                batch: int = 32) -> tuple[float, float, int]:
    """(FLOP/s of the query heads' work, seconds per KV head, key and dimension, the fewest query
    heads per KV head it runs for) of the decode attention on the AMX-BF16 tile where the
    engine runs it (``paged_attention.amx_mode()``: "auto" from AMX_MIN_GROUP query heads per KV
    head, "all" for every group); (0, 0, 0) where it does not. The same model as
    ``measure_attention_rate``'s, from 256 keys at G = AMX_MIN_GROUP and 2 x AMX_MIN_GROUP query
    heads per KV head (the tile's cost per head is far below the vector tile's and not linear
    from G = 1), with ``item_s`` (that probe's per-item cost, one thread's) as the intercept."""
    from fitserve.kernels.cpu.paged_attention import AMX_MIN_GROUP, amx_mode

    mode = amx_mode()
    if mode not in ("auto", "all"):
        return 0.0, 0.0, 0
    hkv, d, keys = ATTENTION_KV_HEADS, 64, ATTENTION_KEYS[1]
    g1, g2 = AMX_MIN_GROUP, 2 * AMX_MIN_GROUP
    t1, t2 = (_attention_seconds(keys, repeats, batch, hq=hkv * g) / batch for g in (g1, g2))
    # NOTE: floored as the vector probe's: noise must not make the query heads' work free
    c_q = max(t1 / (keys * hkv * g1) / 10, (t2 - t1) / (keys * hkv * (g2 - g1)))
    c_kv = max(0.0, (t1 - hkv * item_s) / keys - hkv * g1 * c_q) / hkv
    return threads * 4 * d / c_q, c_kv / d / threads, g1 if mode == "auto" else 1


def _tiny_engine(layers: int) -> object:
    """An engine over a random-weight Llama of ``layers`` layers (hidden 64, bf16), in memory."""
    import tokenizers

    from fitserve.config import EngineConfig, ModelSpec
    from fitserve.engine.core import Engine
    from fitserve.loading import LoadedModel
    from fitserve.loading.tokenizer import Tokenizer

    vocab, hidden, inter, heads, kv_heads, head_dim = 256, 64, 128, 4, 2, 16
    spec = ModelSpec(architecture="llama", vocab_size=vocab, hidden_size=hidden,
                     intermediate_size=inter, num_layers=layers, num_heads=heads,
                     num_kv_heads=kv_heads, head_dim=head_dim, max_position_embeddings=512,
                     tie_word_embeddings=True)
    g = torch.Generator().manual_seed(0)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.05

    weights = {"model.embed_tokens.weight": w(vocab, hidden), "model.norm.weight": torch.ones(hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        weights |= {p + "input_layernorm.weight": torch.ones(hidden),
                    p + "post_attention_layernorm.weight": torch.ones(hidden),
                    p + "self_attn.q_proj.weight": w(heads * head_dim, hidden),
                    p + "self_attn.k_proj.weight": w(kv_heads * head_dim, hidden),
                    p + "self_attn.v_proj.weight": w(kv_heads * head_dim, hidden),
                    p + "self_attn.o_proj.weight": w(hidden, heads * head_dim),
                    p + "mlp.gate_proj.weight": w(inter, hidden),
                    p + "mlp.up_proj.weight": w(inter, hidden),
                    p + "mlp.down_proj.weight": w(hidden, inter)}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    from pathlib import Path

    loaded = LoadedModel(spec, weights, Tokenizer(backend), Path("tiny-random-llama"),
                         "safetensors", "f32")
    return Engine(EngineConfig(model="tiny-random-llama", dtype="bfloat16", device="cpu",
                               max_model_len=512, kv_cache_memory_bytes=16 << 20),
                  loaded=loaded)


def _decode_step_seconds(engine: object, steps: int = 32) -> float:
    """CPU seconds of this thread per decode step of one request over ``steps`` tokens (the
    first token, which the prefill samples, left out)."""
    from fitserve.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    times = [time.thread_time() for _o in engine.stream(list(range(1, 17)), params)]  # type: ignore[attr-defined]
    return (times[-1] - times[0]) / (len(times) - 1)


def measure_step_overhead(repeats: int = 7) -> tuple[float, float]:
    """(seconds per step, seconds per layer) of the engine's decode step besides its bytes and
    FLOPs: a tiny model's step time at two layer counts, intercept and slope. The two engines
    run in turn (a shared host's slow period falls on both alike), each the median of its
    undisturbed runs."""
    lo, hi = TINY_LAYERS
    engines = {n: _tiny_engine(n) for n in TINY_LAYERS}
    runs: dict[int, list[float]] = {n: [] for n in TINY_LAYERS}
    for i in range(repeats + 1):
        for n, engine in engines.items():
            t = _decode_step_seconds(engine)
            if i:  # the first run of each warms up
                runs[n].append(t)
    t_lo, t_hi = _good_median(runs[lo]), _good_median(runs[hi])
    per_layer = max(0.0, (t_hi - t_lo) / (hi - lo))
    return max(0.0, t_lo - lo * per_layer), per_layer


# the reference layer of the element-wise probe (SmolLM2-135M's widths)
EW_ROWS, EW_HIDDEN, EW_HEADS, EW_KV_HEADS, EW_HEAD_DIM, EW_INTER = 32, 576, 9, 3, 64, 1536


def elementwise_elements(hidden: int, q_size: int, kv_size: int, inter: int) -> int:
    """Elements one token's element-wise work of one layer touches (``ledger.speed``'s
    ``elementwise_elements``, repeated here: this module must not import the ledger's
    step model): 2 norms over hidden, rotary on q and k and the k/v cache writes, SwiGLU's
    gate | up read and its output written."""
    return 2 * hidden + q_size + 2 * kv_size + 3 * inter


def measure_elementwise(repeats: int = 15) -> float:
    """Seconds per element (``elementwise_elements``) of one layer's element-wise ops on
    EW_ROWS tokens, on the engine's fused C++ ops (0.0 where they are not built)."""
    from fitserve.kernels.cpu.fused import (
        add_rms_norm_,
        fused_ops_available,
        rope_write_kv_,
        silu_and_mul,
    )

    if not fused_ops_available():
        return 0.0
    m, h, hq, hkv, d, inter = EW_ROWS, EW_HIDDEN, EW_HEADS, EW_KV_HEADS, EW_HEAD_DIM, EW_INTER
    g = torch.Generator().manual_seed(0)
    res, x = torch.randn(m, h, generator=g).bfloat16(), torch.randn(m, h, generator=g).bfloat16()
    w = torch.ones(h, dtype=torch.bfloat16)
    qk = torch.randn(m, hq + hkv, d, generator=g).bfloat16()
    v = torch.randn(m, hkv, d, generator=g).bfloat16()
    ang = torch.rand(4096, d // 2, generator=g)
    cos, sin = ang.cos(), ang.sin()
    blocks = 4096 // 16
    k_cache = torch.zeros(hkv, blocks, 16, d, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    positions = torch.arange(m) * 64 % 4096  # spread over the cache, as a batch's rows are
    slots = positions.clone()
    gate_up = torch.randn(m, 2 * inter, generator=g).bfloat16()

    def layer() -> None:
        add_rms_norm_(res, x, w, 1e-5)
        rope_write_kv_(qk, v, positions, cos, sin, k_cache, v_cache, slots, hq, False)
        add_rms_norm_(res, x, w, 1e-5)
        silu_and_mul(gate_up)

    sec = _time_call(layer, repeats=repeats, inner=16)
    return sec / (m * elementwise_elements(h, hq * d, hkv * d, inter))


def _batched_step_seconds(engine: object, seqs: int, steps: int = 24) -> float:
    """CPU seconds of this thread per decode step of ``seqs`` requests at once (the steps
    where all of them decode: the prefill step left out)."""
    from fitserve.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    for i in range(seqs):
        engine.add_request(list(range(1 + i, 17 + i)), params)  # type: ignore[attr-defined]
    times = []
    while engine.has_unfinished_requests():  # type: ignore[attr-defined]
        t0 = time.thread_time()
        engine.step()  # type: ignore[attr-defined]
        times.append(time.thread_time() - t0)
    return statistics.median(times[1:-1])


def measure_seq_overhead(repeats: int = 5, many: int = 8) -> tuple[float, float]:
    """(seconds per sequence of a decode step besides its bytes and FLOPs, seconds per logit
    of the greedy argmax): the tiny model's step at ``many`` sequences against 1, alternated
    (the slope), and the engine's argmax on [32, 49152] fp32 logits."""
    from fitserve.kernels.cpu.fused import argmax

    engine = _tiny_engine(TINY_LAYERS[0])
    runs: dict[int, list[float]] = {1: [], many: []}
    for i in range(repeats + 1):
        for n in runs:
            t = _batched_step_seconds(engine, n)
            if i:
                runs[n].append(t)
    per_seq = max(0.0, (_good_median(runs[many]) - _good_median(runs[1])) / (many - 1))
    logits = torch.randn(32, 49152, generator=torch.Generator().manual_seed(0))
    per_logit = _time_call(lambda: argmax(logits), repeats=15, inner=8) / logits.numel()
    return per_seq, per_logit


def measure(threads: int) -> dict[str, object]:
    """Every figure this module measures for an engine on ``threads`` cores, as the JSON the
    ledger caches (measured on one thread, see the module doc)."""
    torch.set_num_threads(1)
    per_step, per_layer = measure_step_overhead()
    per_seq, per_logit = measure_seq_overhead()
    attention_flops, attention_kv_s, attention_seq_s = measure_attention_rate(threads)
    tile_flops, tile_kv_s, tile_group = measure_attention_tile_rate(
        threads, attention_seq_s * threads)
    return {"matmul_rows": list(RATE_ROWS), "matmul_k": list(RATE_KS),
            "matmul_flops": measure_matmul_rates(threads),
            "attention_flops": attention_flops, "attention_seq_s": attention_seq_s,
            "attention_kv_s": attention_kv_s, "attention_tile_flops": tile_flops,
            "attention_tile_kv_s": tile_kv_s, "attention_tile_min_group": tile_group,
            "step_overhead_s": per_step, "layer_overhead_s": per_layer, "threads": threads,
            "elementwise_s": measure_elementwise(), "seq_overhead_s": per_seq,
            "logit_s": per_logit, "gemv_k": list(GEMV_K),
            "gemv_bytes_per_s": measure_gemv_rates(threads)}


if __name__ == "__main__":
    import logging

    logging.disable(logging.WARNING)
    print(json.dumps(measure(int(sys.argv[1]) if len(sys.argv) > 1 else torch.get_num_threads())))
