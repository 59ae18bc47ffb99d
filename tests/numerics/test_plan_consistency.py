"""One ledger: `fitserve plan MODEL --gpu cpu` reports exactly what the engine does on this CPU.

For the real default model (SmolLM2-135M, the Q4_1 GGUF) and the same options on both sides:
- the engine's block count, block size and KV bytes per token are the plan's;
- the KV tensors the runner allocated are exactly num_kv_blocks x block bytes of the plan;
- the weights the model holds (parameters and packed buffers, the tied embedding once) are
  the plan's weights line: by default the Q4_1 file held as stored (packed), and dense fp32;
- the ledger's other lines (RoPE tables, activations, attention scratch, logits, sampler) are
  the engine's own ledger's, for the same max_model_len;
- the KV pool is resident only for the blocks the engine has handed out (touched_blocks);
- (slow) the peak RSS of a W2 run in a fresh process is within 15% of the plan's total with the
  KV blocks the run touched in place of the whole pool, and so is that of a long-context run
  (3 requests of ~4,000 prompt tokens, max_model_len 4096).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from fitserve.cli import main as fitserve_main
from fitserve.config import EngineConfig
from fitserve.engine.core import Engine
from fitserve.engine.sizing import DEFAULT_CPU_KV_BYTES, size_kv_pool
from fitserve.ledger import memory as plan_memory

REPO = Path(__file__).resolve().parents[2]
MIB = 1 << 20

# (engine config overrides, the same options for `fitserve plan`)
DEFAULT: tuple[dict[str, Any], list[str]] = ({}, [])
# NOTE: weights dense in fp32 here (the default holds the Q4_1 file packed as stored)
FP32_BS32_512M: tuple[dict[str, Any], list[str]] = (
    dict(dtype="float32", block_size=32, kv_cache_memory_bytes=512 * MIB, max_num_seqs=16,
         max_num_batched_tokens=512, weights="float32"),
    ["--dtype", "float32", "--block-size", "32", "--kv-cache-memory", "512M",
     "--max-num-seqs", "16", "--max-num-batched-tokens", "512", "--weights", "float32"],
)


def plan_json(capsys: pytest.CaptureFixture[str], model: str, args: list[str]) -> dict[str, Any]:
    """Run `fitserve plan MODEL --gpu cpu --json ARGS` in-process; return its engine summary."""
    capsys.readouterr()
    assert fitserve_main(["plan", model, "--gpu", "cpu", "--json", *args]) == 0
    out = json.loads(capsys.readouterr().out)
    summary: dict[str, Any] = out["engine"]
    assert summary["device"] == "cpu"
    return summary


def peak_with_kv(plan: dict[str, Any], kv_bytes: int) -> int:
    """The ledger's peak RSS with ``kv_bytes`` of the KV pool resident (the plan's JSON summary;
    EngineMemoryPlan.peak_with_kv)."""
    return int(plan["resident_bytes"] + max(plan["load_bytes"], kv_bytes + plan["step_bytes"]))


def fresh_runtime_baseline() -> None:
    """Measure the ledger's runtime baseline again, just before a peak-RSS run.

    NOTE: both the baseline probe and the measured run count the shared libraries' file pages
    they map, and a file fault maps the neighbouring pages the page cache holds (fault-around).
    What the page cache holds moves with the host (a fresh torch install caches all of
    libtorch; this host's proactive reclaim pages out cold file pages during a long test run):
    measured here, 435 MiB with a warm cache against 385 MiB after dropping it. A baseline
    cached minutes earlier compares two cache states; one measured now compares the engine.
    """
    from fitserve.ledger.runtime import runtime_baseline_bytes

    assert runtime_baseline_bytes(refresh=True), "runtime baseline not measured"


def weight_bytes(engine: Engine) -> int:
    """Bytes of the model's parameters and packed weight buffers (distinct storages: the tied
    embedding/lm_head once), the rotary tables excluded."""
    from tests.numerics.test_plan_engine_agree import held_by_model

    return held_by_model(engine)[0]


@pytest.fixture(scope="module")
def default_engine(smollm2_path: Path) -> Iterator[Engine]:
    engine = Engine(EngineConfig(model=str(smollm2_path), device="cpu"))
    yield engine
    del engine


@pytest.fixture(scope="module")
def fp32_engine(smollm2_path: Path) -> Iterator[Engine]:
    engine = Engine(EngineConfig(model=str(smollm2_path), device="cpu", **FP32_BS32_512M[0]))
    yield engine
    del engine


def check_engine_matches_plan(engine: Engine, plan: dict[str, Any]) -> None:
    pool = engine.pool
    assert engine.config.cache.block_size == pool.block_size == plan["block_size"]
    assert pool.num_blocks == engine.runner.num_blocks == plan["num_kv_blocks"]
    assert pool.bytes_per_token == plan["kv_bytes_per_token"]
    assert pool.block_bytes == plan["block_bytes"] == plan["block_size"] * plan["kv_bytes_per_token"]
    # what the runner actually allocated, to the byte
    assert engine.runner.kv_cache_bytes == plan["kv_allocated_bytes"]
    assert plan["kv_allocated_bytes"] == plan["num_kv_blocks"] * plan["block_bytes"]
    assert plan["lines"]["KV pool"] == plan["kv_allocated_bytes"]
    assert weight_bytes(engine) == plan["weight_bytes"] == plan["lines"]["weights"]
    # the engine's own ledger (fitserve.engine.sizing) has the same lines as the plan
    mp = pool.memory_plan
    assert mp is not None and mp.device == "cpu"
    assert [m.name for m in mp.lines] == list(plan["lines"])
    for name in ("weights", "rope tables", "activation peak", "attention scratch", "logits",
                 "sampler", "KV pool"):
        assert mp.line(name).bytes == plan["lines"][name], name
    # the RoPE tables the model holds are the line's (the plan's context = max_model_len)
    cos, sin = engine.runner.model.rotary.cos, engine.runner.model.rotary.sin
    assert isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor)
    assert cos.nbytes + sin.nbytes == plan["lines"]["rope tables"]


def test_default_options(default_engine: Engine, smollm2_path: Path,
                         capsys: pytest.CaptureFixture[str]) -> None:
    assert default_engine.device.type == "cpu"
    dtype = {torch.bfloat16: "bf16", torch.float32: "f32"}[default_engine.dtype]
    for model in ("smollm2-135m", str(smollm2_path)):  # the catalog entry and the file itself
        plan = plan_json(capsys, model, [])
        assert plan["dtype"] == plan["kv_dtype"] == dtype
        assert plan["weights"] == "int4-g32-asym"  # held as stored: Q4_1 blocks packed
        assert plan["kv_budget_bytes"] == DEFAULT_CPU_KV_BYTES == default_engine.pool.budget_bytes
        check_engine_matches_plan(default_engine, plan)
    if dtype == "bf16":
        # SmolLM2: 30 layers x 2 (K, V) x 3 KV heads x 64 x 2 B = 23,040 B per token;
        # 1 GiB // (16 x 23,040 B) = 2,912 blocks. Weights as stored: 106,168,320 Q4_1
        # weights x 20/32 B + the 28,311,552 Q8_0 token_embd (tied) x 34/32 B + 35,136 norm
        # weights in bf16 x 2 B = 66,355,200 + 30,081,024 + 70,272.
        assert (plan["kv_bytes_per_token"], plan["num_kv_blocks"]) == (23_040, 2_912)
        assert plan["weight_bytes"] == 96_506_496
    assert plan_memory.DEFAULT_CPU_KV_BYTES is DEFAULT_CPU_KV_BYTES  # one constant, the planner's


def test_kv_pool_is_resident_only_for_the_blocks_handed_out(default_engine: Engine) -> None:
    """The runner's cache tensors cost memory only where blocks were written: after requests of
    ragged lengths, the KV tensors' resident pages (mincore) are the touched blocks' bytes."""
    from fitserve.runner.lazy_memory import resident_bytes
    from fitserve.sampling import SamplingParams

    engine = default_engine
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for i, n in enumerate((5, 40, 17, 33)):
        engine.add_request([100 + (i * 977 + j * 131) % 40000 for j in range(n)], params)
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.kv.stats()
    assert stats.used_blocks == 0
    # (5+2, 40+2, 17+2, 33+2 tokens written) -> 1 + 3 + 2 + 3 blocks, all held at once
    assert stats.touched_blocks == 9
    tensors = [t for kv in engine.runner.kv_caches for t in kv]  # type: ignore[union-attr]
    resident = [resident_bytes(t) for t in tensors]
    if any(r is None for r in resident):
        pytest.skip("mincore is not available here")
    touched = stats.touched_blocks * engine.pool.block_bytes
    # pages are 4 KiB: one head's slice of a block (16 x 64 x 2 B = 2 KiB) may share its page
    # with an untouched block, at most one page per (layer, K/V, head)
    slack = len(tensors) * engine.spec.num_kv_heads * 4096
    assert touched <= sum(r for r in resident if r is not None) <= touched + slack


def test_weights_line_names_the_dequantization(capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert fitserve_main(["plan", "smollm2-135m", "--gpu", "cpu", "--dtype", "bfloat16",
                          "--weights", "bf16", "--json"]) == 0
    text = capsys.readouterr().out
    assert "Q4_1 file dequantized to bf16 on load" in text
    assert fitserve_main(["plan", "smollm2-135m", "--gpu", "cpu", "--dtype", "bfloat16",
                          "--json"]) == 0
    text = capsys.readouterr().out
    assert "Q4_1 file held as stored: int4-g32-asym, int8-g32 packed, the rest in bf16" in text


def test_fp32_other_block_size_and_kv_memory(fp32_engine: Engine,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    plan = plan_json(capsys, "smollm2-135m", FP32_BS32_512M[1])
    assert plan["dtype"] == plan["kv_dtype"] == "f32" and fp32_engine.dtype == torch.float32
    # 30 x 2 x 3 x 64 x 4 B = 46,080 B per token; 512 MiB // (32 x 46,080 B) = 364 blocks
    assert (plan["kv_bytes_per_token"], plan["block_size"], plan["num_kv_blocks"]) == (
        46_080, 32, 364)
    assert plan["weight_bytes"] == 134_515_008 * 4
    check_engine_matches_plan(fp32_engine, plan)


@pytest.mark.parametrize(("cfg", "args"), [
    # 200 MiB hold ~4.5k tokens in f32 (the "auto" dtype on a CPU without native bf16), ~9k in
    # bf16: plan a context that fits either way
    (dict(block_size=8, kv_cache_memory_bytes=200 * MIB), ["--block-size", "8",
                                                         "--kv-cache-memory", "200M",
                                                         "--context", "4k"]),
    # 100 blocks hold 1,600 tokens: plan a context that fits (8k would exit 1, not fitting)
    (dict(block_size=16, num_kv_blocks=100), ["--num-kv-blocks", "100", "--context", "1k"]),
    (dict(dtype="float32", kv_cache_memory_bytes=3 * (1 << 30)), ["--dtype", "float32",
                                                                 "--kv-cache-memory", "3G"]),
])
def test_pool_sizing_matches_plan(default_engine: Engine, cfg: dict[str, Any], args: list[str],
                                  capsys: pytest.CaptureFixture[str]) -> None:
    """More options, through the engine's own sizing function (no new engine needed)."""
    config = EngineConfig(device="cpu", **cfg)
    dtype = torch.float32 if config.dtype == "float32" else default_engine.dtype
    params = 134_515_008  # SmolLM2-135M, the tied embedding once
    pool = size_kv_pool(config, default_engine.spec, dtype, torch.device("cpu"),
                        params * (torch.finfo(dtype).bits // 8))
    plan = plan_json(capsys, "smollm2-135m", args)
    assert (pool.num_blocks, pool.block_size, pool.bytes_per_token, pool.block_bytes) == (
        plan["num_kv_blocks"], plan["block_size"], plan["kv_bytes_per_token"], plan["block_bytes"])
    assert pool.allocated_bytes == plan["kv_allocated_bytes"]


W2_CHILD = textwrap.dedent("""
    import json, resource, sys, time
    from fitserve.config import EngineConfig
    from fitserve.engine.core import Engine
    from fitserve.sampling import SamplingParams

    engine = Engine(EngineConfig(model=sys.argv[1], device="cpu"))
    # NOTE: W2's 32 x 128-token prompts with 32 new tokens, not 128: the peak is set by the
    # prefill steps (measured: 1636 MiB with 128 new tokens, 1626 MiB with 24), decode only costs
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    for i in range(32):  # W2's prompts: 32 requests x 128-token prompt
        engine.add_request([100 + (i * 977 + j * 131) % 40000 for j in range(128)], params)
    t0, tokens = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        tokens += len(engine.step())
    seconds = time.perf_counter() - t0
    hwm = 0
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            hwm = int(line.split()[1]) * 1024
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"tokens": tokens, "seconds": seconds, "vm_hwm": hwm, "ru_maxrss": maxrss,
                      "touched_blocks": engine.kv.stats().touched_blocks}))
""")


@pytest.mark.slow
@pytest.mark.peak_rss
def test_w2_peak_rss_within_15_percent_of_plan(smollm2_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    fresh_runtime_baseline()
    plan = plan_json(capsys, "smollm2-135m", [])
    assert plan["lines"]["runtime baseline"] > 0, "runtime baseline not measured"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", W2_CHILD, str(smollm2_path)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=900, check=True)
    run = json.loads(out.stdout.strip().splitlines()[-1])
    assert run["tokens"] == 32 * 32
    # NOTE: VmHWM, not ru_maxrss: Linux carries ru_maxrss across fork+exec, so the child would
    # report the (multi-GiB) pytest parent's high-water mark when it is the larger one.
    peak = run["vm_hwm"]
    kv = run["touched_blocks"] * plan["block_bytes"]
    expected = peak_with_kv(plan, kv)
    ratio = peak / expected
    lines = ", ".join(f"{k} {v / MIB:.1f}" for k, v in plan["lines"].items())
    report = (f"W2 peak RSS {peak / MIB:.1f} MiB vs ledger {expected / MIB:.1f} MiB with the "
              f"{run['touched_blocks']} KV blocks it touched ({kv / MIB:.1f} MiB of the pool's "
              f"{plan['kv_allocated_bytes'] / MIB:.1f}) (x{ratio:.3f}); bound with every block "
              f"touched {plan['peak_bytes'] / MIB:.1f} MiB; lines MiB: {lines}; "
              f"{run['seconds']:.1f} s")
    print(report)
    # 32 x 160 tokens = 320 blocks at the peak, and no more: used blocks are reused first
    assert run["touched_blocks"] == 32 * 10, report
    assert 0.85 <= ratio <= 1.15, report


LONG_CHILD = textwrap.dedent("""
    import json, sys, time
    from fitserve.config import EngineConfig
    from fitserve.engine.core import Engine
    from fitserve.sampling import SamplingParams

    cfg = json.loads(sys.argv[2])
    engine = Engine(EngineConfig(model=sys.argv[1], device="cpu", **cfg))
    plan = engine.pool.memory_plan
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    # NOTE: 3 requests, not max_num_seqs=8: the peak is one step's attention scratch beside the
    # pool, which is allocated whole (measured: 1667 MiB with 3 requests, 1698 MiB with 8)
    for i in range(3):  # requests near max_model_len: 4,000 prompt tokens + 4 new
        engine.add_request([100 + (i * 977 + j * 131) % 40000 for j in range(4000)], params)
    t0, tokens = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        tokens += len(engine.step())
    seconds = time.perf_counter() - t0
    status = {}
    for line in open("/proc/self/status"):
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            status[key] = int(value.split()[0]) * 1024
    print(json.dumps({"tokens": tokens, "seconds": seconds, "status": status,
                      "max_model_len": engine.max_model_len,
                      "touched_blocks": engine.kv.stats().touched_blocks,
                      "engine_lines": {m.name: m.bytes for m in plan.lines},
                      "engine_peak": plan.peak_bytes}))
""")
LONG_CFG: dict[str, Any] = dict(max_model_len=4096, max_num_seqs=8)
LONG_ARGS = ["--context", "4096", "--max-num-seqs", "8"]


def long_context_run(smollm2_path: Path, capsys: pytest.CaptureFixture[str],
                     env: dict[str, str]) -> tuple[float, str]:
    """Plan and run the long-context workload in a fresh process; (VmHWM / plan peak, text)."""
    fresh_runtime_baseline()
    plan = plan_json(capsys, "smollm2-135m", LONG_ARGS)
    assert plan["lines"]["runtime baseline"] > 0, "runtime baseline not measured"
    assert plan["max_num_seqs"] == 8 and plan["max_num_batched_tokens"] == 2048
    env = {**os.environ, "PYTHONPATH": str(REPO), **env}
    out = subprocess.run([sys.executable, "-c", LONG_CHILD, str(smollm2_path),
                          json.dumps(LONG_CFG)], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=900, check=True)
    run = json.loads(out.stdout.strip().splitlines()[-1])
    assert run["tokens"] == 3 * 4 and run["max_model_len"] == 4096
    # the engine sized itself with the plan's own lines (same max_model_len, budget, batch;
    # it measures neither its runtime baseline nor its loading transient)
    lines = plan["lines"]
    measured_apart = ("runtime baseline", "loading transient")
    assert {k: v for k, v in run["engine_lines"].items() if k not in measured_apart} == {
        k: v for k, v in lines.items() if k not in measured_apart}
    assert lines["rope tables"] == 2 * 4096 * 32 * 4
    # 3 x 4,003 tokens written, 251 blocks each; the first request can finish (and free its
    # blocks for reuse) before the last one has allocated its final block
    assert 2 * 251 < run["touched_blocks"] <= 3 * 251
    peak = run["status"]["VmHWM"]  # NOTE: VmHWM, not ru_maxrss (see the W2 test)
    expected = peak_with_kv(plan, run["touched_blocks"] * plan["block_bytes"])
    ratio = peak / expected
    text = ", ".join(f"{k} {v / MIB:.1f}" for k, v in lines.items())
    status = ", ".join(f"{k} {v / MIB:.1f}" for k, v in run["status"].items())
    report = (f"long-context peak RSS {peak / MIB:.1f} MiB vs ledger {expected / MIB:.1f} MiB "
              f"with the {run['touched_blocks']} KV blocks it touched (x{ratio:.3f}; bound "
              f"with every block touched {plan['peak_bytes'] / MIB:.1f} MiB); lines MiB: "
              f"{text}; at exit MiB: {status}; {run['seconds']:.1f} s")
    print(report)
    return ratio, report


# NOTE: glibc's malloc raises its mmap threshold to the size of each mmapped chunk it frees (up
# to 32 MiB), so after the first long prefill step the per-layer transients (K/V copies, SDPA
# output, q/k/v, gate/up: 0.1 to 16 MiB each) come from the heap, and the heap keeps what
# they leave fragmented: without the engine's trim after prefill steps (Engine.step) VmHWM was
# x1.17 the ledger here (+260 MiB) while torch.profiler put every step's allocations within the
# ledger's step peak (tests/numerics/test_attention_scratch.py); with it, x1.10 (x1.03 with the
# mmap threshold fixed at 128 KiB, MALLOC_MMAP_THRESHOLD_=131072, which costs ~5% of W2).
@pytest.mark.slow
@pytest.mark.peak_rss
def test_long_context_peak_rss_within_15_percent_of_plan(smollm2_path: Path,
                                                          capsys: pytest.CaptureFixture[str]
                                                          ) -> None:
    """3 requests of 4,000 prompt tokens at max_model_len 4096: every prompt runs as a causal
    first chunk then a masked chunk after 2,048 cached tokens, the step's attention scratch at
    the ledger's worst (2,048 queries x up to 4,096 keys), 3 x 4,004 tokens of KV written;
    glibc's allocator as it comes (the engine trims after prefill steps)."""
    ratio, report = long_context_run(smollm2_path, capsys, {})
    assert 0.85 <= ratio <= 1.15, report
