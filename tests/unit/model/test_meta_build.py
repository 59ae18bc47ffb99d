"""Start-up: building the decoder on the meta device imports no torch._dynamo (issue 40 item 6).

torch.nn.init's fills and the rotary tables' arange on meta tensors run their Python
decompositions (torch._refs), whose first use imports torch._dynamo: ~1 s and ~140 MiB of RSS
of every start-up, and the ledger's runtime baseline (fitserve.ledger.runtime) no longer counts
it. A fresh process, since the test process may have imported it already.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

CHILD = """
import sys, torch
from fitserve.model.loader import _no_init_ops, model_class
from fitserve.tools.planner.model_source import catalog_entry
for name in ("SmolLM2-135M", "Gemma-2-9B"):
    spec = catalog_entry(name).spec
    with torch.device("meta"), _no_init_ops():
        model = model_class(spec)(spec, 4096)
    assert next(model.parameters()).is_meta
    assert torch.nn.init.normal_.__module__ == "torch.nn.init"  # the fills are restored
print("torch._dynamo" in sys.modules)
"""


def test_meta_build_does_not_import_dynamo() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120, check=True)
    assert out.stdout.split() == ["False"], out.stdout + out.stderr
