"""A batched prefill of a model held as ggml blocks stays within the ledger (issue 37's "peak
RSS within 10% of the file size plus the ledger's KV and runtime lines", at a test's size).

The model: one layer of a Q4_K file, hidden 256 and ff 8192, so that its gate/up is as wide as
SmolLM2-1.7B's (16,384 outputs) and a 2,048-token prefill chunk (16 prompts of 128 tokens, one
step) is what sets the process's peak, not the runtime. `fitserve plan` on the file prints the
engine's own lines ("output staging" included); the peak RSS of the run in a fresh process is
within 10% of the plan's total with the KV blocks the run touched. Before GgmlLinear cast its
float32 rows piece by piece (ledger.scratch.output_staging_rows), the kernel's whole [2048,
16384] float32 output lived beside its bf16 copy: +112 MiB at once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as Q

from tests.numerics.test_plan_consistency import fresh_runtime_baseline, peak_with_kv, plan_json
from tests.tiny_gguf import TinyGGUF, write_tiny_gguf

REPO = Path(__file__).resolve().parents[2]
MIB = 1 << 20
WIDE_FF = TinyGGUF(layers=1, hidden=256, ff=8192, heads=4, kv_heads=2, vocab=320, context=512,
                   qtype=Q.Q4_K, embd_qtype=Q.Q6_K, tied=True)
CFG = dict(dtype="bfloat16", max_model_len=512, kv_cache_memory_bytes=64 * MIB, max_num_seqs=16)
PLAN_ARGS = ["--dtype", "bfloat16", "--context", "512", "--kv-cache-memory", "64M",
             "--max-num-seqs", "16"]
CHILD = textwrap.dedent("""
    import json, sys
    from fitserve.config import EngineConfig
    from fitserve.engine.core import Engine
    from fitserve.sampling import SamplingParams

    engine = Engine(EngineConfig(model=sys.argv[1], device="cpu", **json.loads(sys.argv[2])))
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    for i in range(16):  # 16 x 128 prompt tokens: one 2,048-token prefill step
        engine.add_request([(i * 31 + j * 7) % 300 + 10 for j in range(128)], params)
    tokens = 0
    while engine.has_unfinished_requests():
        tokens += sum(len(o.delta_token_ids) for o in engine.step())
    hwm = next(int(ln.split()[1]) * 1024 for ln in open("/proc/self/status")
               if ln.startswith("VmHWM:"))
    plan = engine.pool.memory_plan
    print(json.dumps({"tokens": tokens, "vm_hwm": hwm,
                      "touched_blocks": engine.kv.stats().touched_blocks,
                      "engine_lines": {m.name: m.bytes for m in plan.lines}}))
""")


@pytest.mark.peak_rss
def test_batched_prefill_peak_rss_within_10_percent_of_plan(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_tiny_gguf(tmp_path / "wide-ff-q4_k.gguf", WIDE_FF)
    fresh_runtime_baseline()
    plan = plan_json(capsys, str(path), PLAN_ARGS)
    lines = plan["lines"]
    # the widest projection, gate/up (16,384 outputs): 256 rows a call, 16 MiB of float32
    assert lines["output staging"] == 256 * 16384 * 4
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", CHILD, str(path), json.dumps(CFG)], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=600, check=True)
    run = json.loads(out.stdout.strip().splitlines()[-1])
    assert run["tokens"] == 16 * 2
    # the engine sized itself with the plan's lines (it measures neither its runtime baseline
    # nor its loading transient)
    apart = ("runtime baseline", "loading transient")
    assert {k: v for k, v in run["engine_lines"].items() if k not in apart} == {
        k: v for k, v in lines.items() if k not in apart}
    expected = peak_with_kv(plan, run["touched_blocks"] * plan["block_bytes"])
    ratio = run["vm_hwm"] / expected
    report = (f"peak RSS {run['vm_hwm'] / MIB:.1f} MiB vs ledger {expected / MIB:.1f} MiB "
              f"(x{ratio:.3f}); lines MiB: "
              + ", ".join(f"{k} {v / MIB:.1f}" for k, v in lines.items()))
    print(report)
    assert 0.9 <= ratio <= 1.1, report
