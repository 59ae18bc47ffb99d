"""Where a W1 step's native layer loop goes, stage by stage, wall clock on the calling thread.

    .venv/bin/python benchmarks/profile_decode_stages.py [MODEL] [--seconds 15] [--threads 2]

MODEL: the default model (smollm2-135m) or a GGUF path (bench_moe.py's files, as stored).
Copies this tree's ``fitserve`` into a temporary folder, adds steady-clock timers around each
stage of ``decode_layers``' layer loop (fitserve/kernels/cpu/decode_step.cpp; the timers are
inserted at fixed lines of the loop and the script stops if one is not found), and runs
128-token greedy requests on the copy for ``--seconds``. Prints ms per step for each stage
(summed over layers) beside the whole ``engine.step()``: the input norm, the qkv linear, the
q/k norms and views, RoPE + the KV write + attention, the o-proj + the post-attention norm, the
MLP or MoE block, the whole loop; what is left of the step is the lm_head and Python. The copy
builds its own decode_step extension (a different source, so another cache entry) once.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

STAGES = ("input norm", "qkv", "q/k norm + views", "RoPE + KV write + attention",
          "o-proj + norm", "MLP / MoE block", "decode_layers (all)")

# (anchor, code inserted after it) in decode_layers' loop; each anchor must occur once
TIMERS = (
    ("  for (int64_t l = 0; l < layers; ++l) {\n",
     "    double st0 = stage_now();\n"),
    ("    const int64_t li = l * kLinearsPerLayer;\n",
     "    double st1 = stage_now(); g_stages.add(0, st1 - st0);\n"),
    ("    const at::Tensor qkv = linear(h, linears, li);\n",
     "    double st2 = stage_now(); g_stages.add(1, st2 - st1);\n"),
    ("    at::Tensor out;\n",
     "    double st3 = stage_now(); g_stages.add(2, st3 - st2);\n"),
)
BEFORE = (
    ("    h = add_rms_norm_(residual, linear(out.reshape",
     "    double st4 = stage_now(); g_stages.add(3, st4 - st3);\n"),
    ("    if (ex != nullptr && !ex->moe.empty() && ex->moe[l].is_moe)",
     "    double st5 = stage_now(); g_stages.add(4, st5 - st4);\n"),
    ("  }\n  return {residual, x};",
     "    g_stages.add(5, stage_now() - st5);\n"),
)
HEADER = """#include <chrono>
#include <cstdio>
namespace {
double stage_now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
struct StageTimes {
  double s[7] = {};
  long steps = 0;
  void add(int i, double v) { s[i] += v; }
  ~StageTimes() {
    if (steps == 0) return;
    std::fprintf(stderr, "STAGES %ld", steps);
    for (double v : s) std::fprintf(stderr, " %.6f", v / steps);
    std::fprintf(stderr, "\\n");
  }
} g_stages;
}  // namespace
"""

WORKER = """
import sys, time, torch
from fitserve.config import EngineConfig
from fitserve.engine.core import Engine
from fitserve.sampling import SamplingParams
torch.set_num_threads(int(sys.argv[3]))
engine = Engine(EngineConfig(model=sys.argv[1], dtype="bfloat16", weights="as-stored",
                             device="cpu", max_model_len=1024))
greedy = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
def request():
    engine.add_request(list(range(100, 132)), greedy)
    steps, t = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return steps, time.perf_counter() - t
request()  # warm-up: builds, plans
done, spent, end = 0, 0.0, time.time() + float(sys.argv[2])
while time.time() < end:
    n, s = request()
    done, spent = done + n, spent + s
print(f"STEP {spent / done:.6f}", flush=True)
"""


def instrumented_copy(dest: Path) -> None:
    """This tree's fitserve in dest, with decode_layers' stage timers (see the module doc)."""
    src = Path(__file__).resolve().parent.parent / "fitserve"
    shutil.copytree(src, dest / "fitserve", ignore=shutil.ignore_patterns("__pycache__"))
    path = dest / "fitserve/kernels/cpu/decode_step.cpp"
    text = path.read_text()
    for anchor, code in TIMERS:
        if text.count(anchor) != 1:
            sys.exit(f"decode_step.cpp changed: anchor {anchor.strip()!r} not found once")
        text = text.replace(anchor, anchor + code)
    for anchor, code in BEFORE:
        if text.count(anchor) != 1:
            sys.exit(f"decode_step.cpp changed: anchor {anchor.strip()!r} not found once")
        text = text.replace(anchor, code + anchor)
    loop = "  for (int64_t l = 0; l < layers; ++l) {\n"
    text = text.replace(loop, "  const double st_all = stage_now();\n" + loop)
    text = text.replace("  return {residual, x};",
                        "  g_stages.add(6, stage_now() - st_all);\n  ++g_stages.steps;\n"
                        "  return {residual, x};")
    text = text.replace('#include "kvq_prefetch.h"', '#include "kvq_prefetch.h"\n' + HEADER, 1)
    path.write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        instrumented_copy(Path(tmp))
        # NOTE: cwd = the copy: `python -c` puts the working directory first on sys.path
        env = {**os.environ, "PYTHONPATH": tmp}
        proc = subprocess.run([sys.executable, "-c", WORKER, args.model, str(args.seconds),
                               str(args.threads)], env=env, cwd=tmp, capture_output=True,
                              text=True, check=False)
    step = re.search(r"STEP ([0-9.]+)", proc.stdout)
    stages = re.search(r"STAGES (\d+)((?: [0-9.]+)+)", proc.stderr)
    if proc.returncode != 0 or not step or not stages:
        sys.exit(f"the worker failed (exit {proc.returncode}): {proc.stdout[-500:]}"
                 f"{proc.stderr[-2000:]}")
    step_ms = float(step.group(1)) * 1e3
    per = [float(v) * 1e3 for v in stages.group(2).split()]
    print(f"{args.model}: W1, {args.threads} thread(s), {stages.group(1)} decode_layers calls; "
          f"engine.step() {step_ms:.2f} ms; load {' '.join(f'{v:.1f}' for v in os.getloadavg())}")
    print(f"    {'stage':<30}{'ms/step':>9}{'of step':>9}")
    for name, ms in zip(STAGES, per, strict=True):
        print(f"    {name:<30}{ms:9.3f}{ms / step_ms:9.0%}")
    rest = step_ms - per[-1]
    print(f"    {'rest (lm_head, Python, ...)':<30}{rest:9.3f}{rest / step_ms:9.0%}")


if __name__ == "__main__":
    main()
