"""Every catalog model plans end to end; the plan package never imports torch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fitserve.config import ModelSpec
from fitserve.ledger.errors import PlanError
from fitserve.ledger.tp_split import check_tp_split
from fitserve.tools.planner.model_source import catalog_entry, load_catalog, resolve_model
from fitserve.tools.planner.report import PlanRequest
from fitserve.tools.planner.sections_run import build_plan


@pytest.fixture(scope="module")
def smol_gguf() -> Path:
    """The pulled default model, found as tests/conftest.py finds it (FITSERVE_HOME, pull()).

    Missing and not pullable: a failure in CI (``CI=true``), a skip elsewhere.
    """
    from fitserve.loading.errors import ModelLoadError  # lazily: fitserve.loading imports torch
    from fitserve.loading.pull import pull

    try:
        return pull("smollm2-135m", progress=False)
    except ModelLoadError as exc:
        if os.environ.get("CI", "").strip().lower() in ("true", "1"):
            pytest.fail(f"the default model is missing in CI and could not be pulled: {exc}")
        pytest.skip(f"the default model is not pulled here and could not be pulled: {exc}")


@pytest.mark.parametrize("name", [m["name"] for m in load_catalog()])
def test_every_catalog_model_plans(name: str) -> None:
    e = catalog_entry(name)
    # the largest of 8, 2, 1 the model splits over in its own weights: 1 for SmolLM2 (9 heads)
    # and Qwen2.5-7B (28 heads), 2 for gpt-oss (MXFP4 experts: 2880 / 8 = 11.25 blocks of 32)
    tp = next(t for t in (8, 2, 1) if _splits(e.spec, t, e.native_weights))
    plan = build_plan(PlanRequest(model=name, gpu="mi300x", gpus=8, tp=tp, context=4096,
                                  concurrency=8))
    titles = [s.title for s in plan.sections]
    assert titles[0].startswith("Model") and titles[-1].startswith("Layouts")
    assert plan.recommended_layout is not None


def _splits(spec: ModelSpec, tp: int, fmt: str) -> bool:
    try:
        check_tp_split(spec, tp, fmt)
    except PlanError:
        return False
    return True


def test_no_torch_import() -> None:
    code = ("import sys, fitserve.tools.planner.cli, fitserve.ledger.memory, fitserve.ledger.kv; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.slow
def test_real_smollm2_gguf(smol_gguf: Path) -> None:
    e = resolve_model(str(smol_gguf))
    assert (e.spec.num_layers, e.spec.num_heads, e.spec.num_kv_heads) == (30, 9, 3)
    assert e.spec.vocab_size == 49152 and e.spec.tie_word_embeddings
    assert e.file_weight_bytes is not None and 50e6 < e.file_weight_bytes < 150e6
    assert e.native_weights.startswith("gguf-file:")
