"""Issue 42, items 5 and 6 on `fitserve plan`: the model's own context is the default context,
no row printed twice, and a plan for a model fitserve's engine cannot run never says
"fits: yes" on --gpu cpu, on any path (GGUF file, HF folder, catalog name)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fitserve.tools.planner.cli import main
from tests.tiny_gguf import TinyGGUF, write_tiny_gguf
from tests.unit.loading.test_engine_support import ARCH, TYPE, write


def run_json(capsys: pytest.CaptureFixture[str], args: list[str]) -> tuple[int, dict[str, Any]]:
    capsys.readouterr()
    rc = main([*args, "--json"])
    out: dict[str, Any] = json.loads(capsys.readouterr().out)
    return rc, out


def fit_line(plan: dict[str, Any]) -> dict[str, Any]:
    sec = next(s for s in plan["sections"] if s["title"].startswith("Fit"))
    line: dict[str, Any] = next(x for x in sec["lines"] if x["name"] == "fits")
    return line


# -- item 6: plans for models the engine cannot run ------------------------------------------

@pytest.mark.parametrize("kwargs,part", [
    (dict(arch=ARCH), f"architecture {ARCH!r}"),
    (dict(qtype=TYPE), f"tensor type {TYPE} (2 tensors"),
])
def test_gguf_the_engine_refuses_never_fits(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                           kwargs: dict[str, Any], part: str) -> None:
    path = write(tmp_path / "m.gguf", **kwargs)
    rc, plan = run_json(capsys, [str(path), "--gpu", "cpu", "--kv-cache-memory", "64M"])
    assert rc == 1 and plan["fits"] is False
    line = fit_line(plan)
    # the tiny file fits in memory many times over; the old Fit line said "yes" here
    assert line["value"] is False
    assert line["shown"].startswith("NO: engine: cannot run (") and part in line["shown"]
    assert "(memory alone: fits)" in line["shown"]


def test_hf_folder_of_a_moe_model_never_fits(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    # (Mixtral, Qwen2/3-MoE and OLMoE run since the MoE engine landed: Phi-MoE does not)
    cfg = {"model_type": "phimoe", "architectures": ["PhimoeForCausalLM"], "vocab_size": 320,
           "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
           "num_local_experts": 4, "num_experts_per_tok": 2, "torch_dtype": "float32"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    rc, plan = run_json(capsys, [str(tmp_path), "--gpu", "cpu", "--kv-cache-memory", "64M"])
    assert rc == 1 and plan["fits"] is False
    assert fit_line(plan)["shown"].startswith("NO: engine: cannot run (architecture")
    assert "'phimoe (PhimoeForCausalLM)'" in plan["engine_cannot_run"]


@pytest.mark.parametrize("name,part", [("DeepSeek-V3", "architecture 'deepseek_v3'")])
def test_catalog_name_the_engine_refuses_on_cpu(name: str, part: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    # (the old plan: no refusal at all for a catalog name; "fits" by memory alone)
    rc, plan = run_json(capsys, [name, "--gpu", "cpu", "--context", "1k", "--kv-cache-memory",
                                 "64M", "--gpu-memory", "2000G"])
    assert rc == 1 and part in plan["engine_cannot_run"]
    assert fit_line(plan)["shown"].startswith("NO: engine: cannot run (")
    # on a GPU the plan is about that GPU's memory, not fitserve's engine
    rc, plan = run_json(capsys, [name, "--gpu", "h200", "--gpus", "8", "--tp", "8",
                                 "--context", "1k", "--weights", "fp8"])
    assert plan["engine_cannot_run"] == ""


def test_a_runnable_gguf_still_fits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path / "ok.gguf")
    rc, plan = run_json(capsys, [str(path), "--gpu", "cpu", "--kv-cache-memory", "64M"])
    assert rc == 0 and fit_line(plan)["shown"] == "yes" and plan["engine_cannot_run"] == ""


# -- item 5: the model's own context, no duplicate rows ---------------------------------------

def test_default_context_is_the_models_own(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    # a GGUF that says 32k (context_length 32,768): planned at 32,768 tokens, not 8,192;
    # KV per request = 2 layers x 2 x 2 KV heads x 16 x 4 B (f32) x 32,768 = 16 MiB
    path = write_tiny_gguf(tmp_path / "ctx.gguf", TinyGGUF(context=32768))
    rc, plan = run_json(capsys, [str(path), "--gpu", "cpu", "--dtype", "float32",
                                 "--kv-cache-memory", "64M"])
    assert "context 32768 (the model's own) = 32,768 tokens" in plan["title"]
    kv = next(s for s in plan["sections"] if s["title"] == "KV cache")
    per_req = next(x for x in kv["lines"] if x["name"].startswith("KV per request"))
    assert per_req["name"] == "KV per request @ 32768 tokens"
    assert per_req["value"] == 2 * 2 * 2 * 16 * 4 * 32768
    # a catalog model: its config's max_position_embeddings (Llama-3.1-8B: 131,072)
    rc, plan = run_json(capsys, ["Llama-3.1-8B", "--gpu", "h200"])
    assert "131,072 tokens" in plan["title"]
    # --context still wins
    rc, plan = run_json(capsys, ["Llama-3.1-8B", "--gpu", "h200", "--context", "8k"])
    assert "context 8k = 8,192 tokens" in plan["title"]


@pytest.mark.parametrize("concurrency", ["1", "4"])
def test_no_row_twice(concurrency: str, capsys: pytest.CaptureFixture[str]) -> None:
    # batch 1 printed "decode, batch 1" and "J/token, batch 1" twice (once as batch 1, once as
    # the asked batch / the best batch); each row now appears once
    rc, plan = run_json(capsys, ["Llama-3.1-8B", "--gpu", "h100", "--context", "8k",
                                 "--concurrency", concurrency, "--kv-cache-memory", "8G"])
    for sec in plan["sections"]:
        names = [x["name"] for x in sec["lines"]]
        assert len(names) == len(set(names)), (sec["title"], names)
    speed = next(s for s in plan["sections"] if s["title"].startswith("Speed"))
    decode = [x["name"] for x in speed["lines"] if x["name"].startswith("decode, batch")]
    assert decode == (["decode, batch 1"] if concurrency == "1"
                      else ["decode, batch 1", "decode, batch 4"])


@pytest.mark.parametrize("name,weights", [("Mixtral-8x7B", "int4"), ("DeepSeek-V3", "int8"),
                                          ("gpt-oss-20b", "int8"), ("Llama-3.1-8B", "int4"),
                                          ("SmolLM2-135M", None)])
def test_weights_per_gpu_over_whole_model_says_why(name: str, weights: str | None,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    # DeepSeek-V3 --weights int8 on cpu: the engine cannot run it, so its RTN-at-load rule
    # does not apply and the per-GPU line is the whole model in bf16, above the ledger's int8
    # count of the whole model: the old plan printed both numbers with no word on why.
    # Mixtral-8x7B --weights int4 (the engine runs it): whole model (ledger, every matrix
    # int4-g32-asym) 29,551,501,312 B; per GPU the engine's own RTN-at-load rule over the
    # tensors it holds (int4-g32-asym, int8-ch packed, the rest bf16) 29,288,043,520 B: below
    # the whole model, so no "MORE than" line.
    args = [name, "--gpu", "cpu", "--context", "1k", "--kv-cache-memory", "64M"]
    _, plan = run_json(capsys, args + (["--weights", weights] if weights else []))
    w = {x["name"]: x for x in next(s for s in plan["sections"]
                                    if s["title"] == "Weights")["lines"]}
    per, whole = w["weights per GPU"], w["weights, whole model"]
    if per["value"] > whole["value"]:
        assert "MORE than the whole model" in per["explain"]
        assert "cannot run" in per["explain"] and plan["engine_cannot_run"]
    else:
        assert "MORE than" not in per["explain"]
    if name == "Mixtral-8x7B":
        assert (whole["value"], per["value"]) == (29_551_501_312, 29_288_043_520)
    if name == "DeepSeek-V3":
        assert "MORE than the whole model" in per["explain"]
