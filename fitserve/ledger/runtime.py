"""The host-memory baseline of an engine process: Python + torch + fitserve's engine modules.

Measured once per machine and Python environment, the way ``cpu_hardware`` measures bandwidth:
a child process imports what the engine imports, warms the paths the engine takes before its
first step, and reports its resident set (VmRSS). Cached in $FITSERVE_HOME/runtime-cpu.json.
The planner itself never imports torch; only the child does.
"""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata

from fitserve.envs import fitserve_home
from fitserve.ledger.hardware import machine_key

RUNTIME_CACHE_VERSION = 2

# NOTE: the child mirrors the engine process before its model is loaded: ``import fitserve.engine.core``
# (torch, tokenizers, gguf, numpy), then a small bf16 matmul and attention call (oneDNN /
# thread-pool start-up). The tensors are a few KiB, so VmRSS is the runtime itself. No tensor op
# on the meta device: the engine builds its model there without one (loader._no_init_ops), and
# the first op that decomposes through torch._refs imports torch._dynamo (~140 MiB of RSS, ~1 s),
# which version 1 of this probe counted and the engine no longer loads.
_PROBE = """
import torch, fitserve.engine.core
x = torch.ones(64, 64, dtype=torch.bfloat16)
(x @ x).float().sum()
q = torch.ones(1, 2, 16, 8)
torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
for line in open("/proc/self/status"):
    if line.startswith("VmRSS:"):
        print(int(line.split()[1]) * 1024)
"""


def _env_key() -> str:
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "none"
    return f"{machine_key()}|v1|{sys.executable}|torch {torch_version}|r{RUNTIME_CACHE_VERSION}"


def measure_runtime_baseline(timeout_s: float = 120.0) -> int | None:
    """VmRSS in bytes of a fresh child process that imported and warmed the engine's runtime;
    None where that fails (no torch here, no /proc)."""
    try:
        out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                             timeout=timeout_s, check=True)
        return int(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def runtime_baseline_bytes(*, refresh: bool = False) -> int | None:
    """The engine process's runtime baseline on this machine (measured once, then cached)."""
    path = fitserve_home() / "runtime-cpu.json"
    key = _env_key()
    if not refresh and path.is_file():
        try:
            data = json.loads(path.read_text())
            if data.get("key") == key and isinstance(data.get("rss_bytes"), int):
                return int(data["rss_bytes"])
        except (OSError, ValueError):
            pass  # a bad cache is measured again
    rss = measure_runtime_baseline()
    if rss is None:
        return None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"key": key, "rss_bytes": rss,
                                    "how": "VmRSS of a child that imported fitserve.engine.core and "
                                           "warmed torch (bf16 matmul, attention)"},
                                   indent=1))
    except OSError:
        pass
    return rss
