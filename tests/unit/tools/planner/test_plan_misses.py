"""Plans that do not fit still print every line, say by how much they miss, and exit 1;
contexts past the trained maximum are planned with a warning; impossible input exits 2.

Every number is derived by hand below from the model configs in catalog/models.json:
  Llama-3.3-70B (same shapes as Llama-3.1-70B): hidden 8192, intermediate 28672, 80 layers,
    64 heads, 8 KV heads, head_dim 128, vocab 128256, untied embeddings;
  Llama-3.1-8B: hidden 4096, intermediate 14336, 32 layers, 32 heads, 8 KV heads, head_dim 128,
    vocab 128256, untied;
  SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64 (KV per token in bf16 = 23,040 B).
Engine defaults (EngineConfig): block_size 16, max_num_batched_tokens 2048, max_num_seqs 64,
gpu_memory_utilization 0.9; a GPU reserves a 1 GiB workspace.
"""

from __future__ import annotations

import json
import shlex
from typing import Any

import pytest

from fitserve.ledger import runtime
from fitserve.tools.planner.cli import main

GIB = 1 << 30
MIB = 1 << 20
WORKSPACE = GIB
# Llama-3.3-70B parameters: per layer q 8192^2 + k, v 2 x 8192 x 1024 + o 8192^2
# + MLP 3 x 8192 x 28672 + 2 norms x 8192 = 855,654,400; x 80 layers = 68,452,352,000;
# + embedding and lm_head 2 x 128256 x 8192 = 2,101,346,304; + final norm 8192.
P70 = 80 * (2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672 + 2 * 8192) \
    + 2 * 128256 * 8192 + 8192
assert P70 == 70_553_706_496
# Llama-3.1-8B: 32 x (2 x 4096^2 + 2 x 4096 x 1024 + 3 x 4096 x 14336 + 2 x 4096)
# + 2 x 128256 x 4096 + 4096
P8 = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096) \
    + 2 * 128256 * 4096 + 4096
assert P8 == 8_030_261_248


def run_json(capsys: pytest.CaptureFixture[str], args: list[str]) -> tuple[int, dict[str, Any]]:
    """`fitserve plan ARGS --json`: exit status and the parsed JSON."""
    capsys.readouterr()
    rc = main([*args, "--json"])
    out = capsys.readouterr().out
    return rc, json.loads(out)


def section(plan: dict[str, Any], prefix: str) -> dict[str, dict[str, Any]]:
    """The lines (by name) of the first section whose title starts with ``prefix``."""
    sec = next(s for s in plan["sections"] if s["title"].startswith(prefix))
    return {line["name"]: line for line in sec["lines"]}


def with_flags(args: list[str], flags: str) -> list[str]:
    """``args`` with the options in ``flags`` ("--tp 8 --gpus 8") set (replaced or added)."""
    out = list(args)
    new = shlex.split(flags)
    for opt, value in zip(new[::2], new[1::2], strict=True):
        if opt in out:
            out[out.index(opt) + 1] = value
        else:
            out += [opt, value]
    return out


# ---- 1. a 70B model in bf16 on one 24 GB GPU -------------------------------------------------

ARGS_70B_24GB = ["Llama-3.3-70B", "--gpu", "h100", "--gpu-memory", "24e9", "--context", "8k"]
W70 = 2 * P70  # bf16: 141,107,412,992 B
# tokens x (2 B x max(attn 3 x 8192 + 2 x 8192 + 2 x 1024 = 43,008, mlp 110,592) + 24 B)
ACT70 = 2048 * (2 * (3 * 8192 + 3 * 28672) + 24)
LOGITS70 = 64 * 128256 * 4  # max_num_seqs x vocab x f32
HEADROOM24 = 24_000_000_000 - int(24_000_000_000 * 0.9)  # 2,400,000,000
POOL70 = 24_000_000_000 - W70 - ACT70 - LOGITS70 - WORKSPACE - HEADROOM24
KV70_TOKEN = 80 * 8 * 128 * 2 * 2  # layers x kv_heads x head_dim x (K, V) x 2 B = 327,680 B
NEED70 = 1 * 8192 * KV70_TOKEN  # one sequence of the default 8k context (512 whole blocks)


def test_70b_bf16_on_24gb_misses_by_exact_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    rc, plan = run_json(capsys, ARGS_70B_24GB)
    assert rc == 1
    assert (W70, ACT70, LOGITS70) == (141_107_412_992, 453_033_984, 32_833_536)
    assert POOL70 == -121_067_022_336  # the lines above overflow the GPU: a negative pool
    assert NEED70 == 2_684_354_560
    # shortfall = KV needed - KV pool = 2,684,354,560 + 121,067,022,336
    assert plan["fits"] is False
    assert plan["shortfall_bytes"] == NEED70 - POOL70 == 123_751_376_896
    assert plan["shortfall_gib"] == round(123_751_376_896 / GIB, 2) == 115.25
    # every memory line is still computed, in reservation order
    assert plan["engine"]["lines"] == {
        "weights": W70, "activation peak": ACT70, "logits": LOGITS70,
        "workspace / graphs": WORKSPACE, "headroom": HEADROOM24, "KV pool": POOL70}
    misses = {m["line"]: m for m in plan["misses"]}
    assert list(misses) == ["weights", "KV pool"]
    usable = int(24_000_000_000 * 0.9)  # 21,600,000,000
    assert misses["weights"]["need"] == W70 and misses["weights"]["have"] == usable
    assert misses["weights"]["shortfall_bytes"] == W70 - usable == 119_507_412_992
    assert (misses["KV pool"]["need"], misses["KV pool"]["have"]) == (NEED70, POOL70)
    # the failing lines are marked, the others are not
    mem = section(plan, "Engine memory")
    assert [name for name, line in mem.items() if line["miss"]] == [
        "weights", "KV pool", "max concurrent @ 8192 (ceiling)"]
    assert "exceed the usable" in mem["weights"]["miss"]
    assert mem["KV blocks"]["value"] == 0


def test_70b_alternatives_fit_and_are_the_fewest_gpus(capsys: pytest.CaptureFixture[str]) -> None:
    _, plan = run_json(capsys, ARGS_70B_24GB)
    alts = {a["option"]: a for a in plan["alternatives"]}
    # bf16 over TP 4: the weights alone are >= 141.1e9 / 4 = 35.3e9 B > 21.6e9 B usable
    assert alts["tp"]["flags"] == "--tp 8 --gpus 8"
    assert alts["weights"]["flags"] == "--weights fp8 --tp 4 --gpus 4"
    assert "context" not in alts and "concurrency" not in alts  # the weights alone overflow
    for a in plan["alternatives"]:  # each one, planned again, fits
        rc, again = run_json(capsys, with_flags(ARGS_70B_24GB, a["flags"]))
        assert (rc, again["fits"], again["shortfall_bytes"]) == (0, True, 0), a
    rc, tp4 = run_json(capsys, with_flags(ARGS_70B_24GB, "--tp 4 --gpus 4"))
    assert rc == 1 and tp4["misses"][0]["line"] == "weights"


def test_70b_table_prints_every_line_and_the_shortfall(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "300")
    assert main(ARGS_70B_24GB) == 1
    cap = capsys.readouterr()
    for name in ("weights", "activation peak", "logits", "workspace / graphs", "headroom",
                 "KV pool", "KV blocks", "Speed", "Layouts"):
        assert name in cap.out
    assert "MISS 131.42 GiB" in cap.out  # W70 / 2^30 = 131.416...
    assert "DOES NOT FIT" in cap.out and "115.25 GiB (123,751,376,896 B)" in cap.out
    assert "does not fit: short by 115.25 GiB (123,751,376,896 B) per GPU" in cap.err
    assert "--tp 8 --gpus 8" in cap.err


# ---- 2. a context and concurrency that leave no KV room --------------------------------------

ARGS_8B_128K = ["Llama-3.1-8B", "--gpu", "h100", "--context", "128k", "--concurrency", "64"]


def test_8b_128k_x64_kv_shortfall_and_largest_fits(capsys: pytest.CaptureFixture[str]) -> None:
    rc, plan = run_json(capsys, ARGS_8B_128K)
    assert rc == 1 and plan["fits"] is False
    w = 2 * P8  # 16,060,522,496 B
    act = 2048 * (2 * (3 * 4096 + 3 * 14336) + 24)  # 226,541,568
    logits = 64 * 128256 * 4
    headroom = 80_000_000_000 - 72_000_000_000  # h100: 80 GB sheet figure, x 0.9
    pool = 80_000_000_000 - w - act - logits - WORKSPACE - headroom
    assert pool == 54_606_360_576
    block = 16 * 32 * 8 * 128 * 2 * 2  # 16 tokens x 131,072 B = 2,097,152 B
    blocks = pool // block
    assert blocks == 26_038 == plan["engine"]["num_kv_blocks"]
    need = 64 * (131072 // 16) * block  # 64 x 8,192 blocks = 1 TiB
    assert need == 1 << 40
    assert plan["shortfall_bytes"] == need - pool == 1_044_905_267_200
    assert [m["line"] for m in plan["misses"]] == ["KV pool"]  # the other lines are fine
    alts = {a["option"]: a["value"] for a in plan["alternatives"]}
    # largest context: 26,038 blocks // 64 sequences = 406 blocks x 16 = 6,496 tokens (the
    # other lines do not depend on context); largest concurrency: 26,038 // 8,192 = 3;
    # engines needed: ceil(64 / 3) = 22
    assert alts == {"context": 406 * 16, "concurrency": 26_038 // 8192, "gpus": 22}
    rc, dp = run_json(capsys, ARGS_8B_128K + ["--gpus", "22"])
    assert rc == 0 and dp["fits"] is True  # ceil(64 / 22) = 3 sequences per engine
    rc, more = run_json(capsys, ARGS_8B_128K[:-1] + ["4"])
    assert rc == 1 and more["shortfall_bytes"] == 4 * 8192 * block - pool


def test_fixed_kv_pool_too_small_names_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    rc, plan = run_json(capsys, ["SmolLM2-135M", "--gpu", "h100", "--kv-cache-memory", "100M",
                                 "--concurrency", "8"])
    assert rc == 1
    block = 16 * 23_040  # 368,640 B
    need = 8 * (8192 // 16) * block  # 1,509,949,440 B
    assert plan["shortfall_bytes"] == need - 100 * MIB == 1_405_091_840
    (miss,) = plan["misses"]
    assert miss["line"] == "KV pool" and "--kv-cache-memory to 1,509,949,440" in miss["reason"]
    alts = {a["option"]: a["value"] for a in plan["alternatives"]}
    # 100 MiB // 368,640 B = 284 blocks; // 8 sequences = 35 blocks = 560 tokens; 284 blocks
    # hold no 8k sequence (512 blocks), so no smaller concurrency fits
    assert alts == {"context": 35 * 16, "kv_cache_memory": need}


def test_fixed_kv_pool_bigger_than_the_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    rc, plan = run_json(capsys, ["SmolLM2-135M", "--gpu", "h100", "--kv-cache-memory", "100G"])
    assert rc == 1
    # weights 134,515,008 params x 2 B; activation 2048 x (2 B x 6336 + 24 B); logits 64 x
    # 49152 x 4; workspace 1 GiB; headroom 80e9 - 72e9; the given pool 100 GiB: their sum
    # exceeds 80e9
    lines = 269_030_016 + 26_001_408 + 12_582_912 + GIB + 8_000_000_000 + 100 * GIB
    assert plan["shortfall_bytes"] == lines - 80_000_000_000 == 36_755_538_560
    (miss,) = plan["misses"]
    assert miss["line"] == "KV pool" and (miss["need"], miss["have"]) == (lines, 80_000_000_000)
    alts = {a["option"]: a["value"] for a in plan["alternatives"]}
    # what one 8k sequence needs; or the same 100 GiB pool on an H200: its lines with a
    # 141e9 x 0.1 headroom, 0.31e9 + 1 GiB + 14.1e9 + 107.4e9 = 122.9e9 <= 141e9
    assert alts == {"kv_cache_memory": 512 * 368_640, "gpu": "h200"}


def test_cpu_kv_budget_too_small(capsys: pytest.CaptureFixture[str],
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runtime, "runtime_baseline_bytes", lambda **_: 300 * MIB)
    rc, plan = run_json(capsys, ["smollm2-135m", "--gpu", "cpu", "--dtype", "bfloat16",
                                 "--kv-cache-memory", "64M", "--concurrency", "4"])
    assert rc == 1
    need = 4 * 512 * 368_640  # 754,974,720 B
    assert plan["shortfall_bytes"] == need - 64 * MIB == 687_865_856
    assert [m["line"] for m in plan["misses"]] == ["KV pool"]
    alts = {a["option"]: a["value"] for a in plan["alternatives"]}
    # 64 MiB // 368,640 = 182 blocks; // 4 = 45 blocks = 720 tokens
    assert alts == {"context": 45 * 16, "kv_cache_memory": need}


def test_max_num_seqs_below_concurrency_is_a_miss(capsys: pytest.CaptureFixture[str]) -> None:
    rc, plan = run_json(capsys, ["SmolLM2-135M", "--gpu", "h100", "--context", "4k",
                                 "--concurrency", "8", "--max-num-seqs", "4"])
    assert rc == 1 and plan["shortfall_bytes"] == 0
    (miss,) = plan["misses"]
    assert (miss["line"], miss["need"], miss["have"], miss["unit"]) == (
        "max_num_seqs", 8, 4, "sequences")
    alts = {a["option"]: a["value"] for a in plan["alternatives"]}
    assert alts == {"concurrency": 4, "gpus": 2, "max_num_seqs": 8}


# ---- 3. a context past the trained maximum ----------------------------------------------------

def test_1m_context_on_8_h100_is_planned_with_a_warning(
        capsys: pytest.CaptureFixture[str]) -> None:
    from fitserve.cli import main as fitserve_main

    capsys.readouterr()
    rc = fitserve_main(["plan", "Llama-3.3-70B", "--gpu", "h100", "--gpus", "8", "--tp", "8",
                        "--context", "1m", "--json"])
    plan = json.loads(capsys.readouterr().out)
    assert rc == 0 and plan["fits"] is True and plan["misses"] == []
    (warning,) = [w for w in plan["warnings"] if "HYPOTHETICAL" in w]
    assert "1,048,576 tokens" in warning and "131,072" in warning and "8x" in warning
    tokens = 1024 * 1024
    kv = section(plan, "KV cache")
    # per GPU: 80 layers x 8/8 = 1 KV head x 128 x 2 (K, V) x 2 B (bf16) x 1,048,576 tokens
    per_gpu = 80 * 1 * 128 * 2 * 2 * tokens
    assert kv[f"KV per request @ {tokens} tokens"]["value"] == per_gpu == 40 * GIB
    # the whole request over 8 GPUs: 80 x 8 KV heads x 128 x 2 x 2 B x 1,048,576 = 320 GiB
    whole = 80 * 8 * 128 * 2 * 2 * tokens
    assert kv[f"KV per request @ {tokens} tokens, all 8 GPUs"]["value"] == whole == 320 * GIB
    e = plan["engine"]
    assert e["kv_budget_bytes"] >= per_gpu and e["num_kv_blocks"] // (tokens // 16) == 1
    fit = section(plan, "Fit")
    assert fit["KV needed"]["value"] == per_gpu


def test_old_flag_still_accepted(capsys: pytest.CaptureFixture[str]) -> None:
    rc, plan = run_json(capsys, ["SmolLM2-135M", "--context", "1m", "--allow-longer-context"])
    assert rc == 0 and any("HYPOTHETICAL" in w for w in plan["warnings"])


# ---- 4. input no machine could plan: still exit 2 --------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["Llama-3.1-8B", "--gpu", "h1000"], "unknown GPU"),
    (["Llama-3.1-8B", "--gpu-bandwidth", "0"], "--gpu-bandwidth must be > 0"),
    (["Llama-3.1-8B", "--gpu-memory", "0"], "--gpu-memory must be > 0"),
    (["Llama-3.1-8B", "--kv-cache-memory=-1G"], "--kv-cache-memory must be >= 0"),
    (["Llama-3.1-8B", "--workspace-gib=-1"], "--workspace-gib must be >= 0"),
    (["Llama-3.1-8B", "--memory-utilization", "0"], "--memory-utilization must be in (0, 1]"),
    (["Llama-3.1-8B", "--concurrency", "0"], "--concurrency must be >= 1"),
])
def test_impossible_input_exits_2(args: list[str], message: str,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert main(args) == 2
    cap = capsys.readouterr()
    assert message in cap.err and cap.out == ""
