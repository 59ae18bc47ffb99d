"""The planner's price of KV sharing (n samples or beams over one prompt), in exact blocks and
bytes: unshared, k x ceil((P + T) / block); shared, the prompt's full blocks once plus, per
sequence, its copy-on-write partial prompt block and its new tokens' blocks."""

from __future__ import annotations

import json
from typing import Any

import pytest

from fitserve.ledger.errors import PlanError
from fitserve.ledger.hardware import cpu_engine_dtype
from fitserve.ledger.kv import sharing_blocks
from fitserve.tools.planner.cli import main


def test_sharing_blocks_exact() -> None:
    # 1,000 prompt + 200 new = 1,200 tokens = 75 blocks of 16; the prompt's 62 full blocks
    # (992 tokens) are shared; each beam keeps 75 - 62 = 13 (8 prompt tokens + 200 new)
    sb = sharing_blocks(1000, 200, 4, 16)
    assert (sb.unshared, sb.shared, sb.shared_prompt_blocks, sb.private_blocks_each) == (
        300, 114, 62, 13)
    # beam floor: the 4 beams share all of their 1,199-token common history but the last
    # token: floor(1199 / 16) = 74 full blocks once + 4 x (75 - 74) = 78 blocks
    assert sb.beam_floor == 78
    # 1,000 + 7 = 1,007 tokens = 63 blocks; common 1,006 -> 62 full blocks + 4 x 1 = 66
    assert sharing_blocks(1000, 7, 4, 16).beam_floor == 66
    # block 8, 19 + 5 = 24 tokens = 3 blocks; common 23 -> 2 full + 4 x 1 = 6 (= n samples:
    # the partial prompt block is what each holds either way)
    assert (sharing_blocks(19, 5, 4, 8).beam_floor, sharing_blocks(19, 5, 4, 8).shared) == (6, 6)
    one = sharing_blocks(1000, 200, 1, 16)
    assert one.unshared == one.shared == 75  # one sequence: nothing to share
    aligned = sharing_blocks(1024, 0, 4, 16)  # no partial block, no new token: all shared
    assert (aligned.unshared, aligned.shared, aligned.beam_floor) == (256, 64, 64)
    with pytest.raises(PlanError):
        sharing_blocks(10, 0, 0, 16)


def plan_json(capsys: pytest.CaptureFixture[str], args: list[str]) -> dict[str, Any]:
    capsys.readouterr()
    assert main([*args, "--json"]) == 0
    out: dict[str, Any] = json.loads(capsys.readouterr().out)
    return out


def sharing_lines(plan: dict[str, Any]) -> dict[str, int]:
    sec = next(s for s in plan["sections"] if s["title"].startswith("KV sharing"))
    return {line["name"]: line["value"] for line in sec["lines"]}


def test_plan_prices_four_beams_over_a_1000_token_prompt(capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    # Llama-3.1-8B bf16: 32 layers x 2 x 8 KV heads x 128 x 2 B = 131,072 B per token,
    # 2,097,152 B per 16-token block: 300 blocks = 600 MiB, 114 blocks = 228 MiB (n samples,
    # the beams' upper bound), beam floor 78 blocks = 156 MiB
    lines = sharing_lines(plan_json(capsys, ["Llama-3.1-8B", "--gpu", "h100", "--share", "4",
                                             "--prompt-tokens", "1000", "--new-tokens", "200"]))
    assert lines == {"blocks, unshared": 300, "blocks, shared": 114, "blocks, beam floor": 78,
                     "KV bytes, unshared": 300 * 2_097_152, "KV bytes, shared": 114 * 2_097_152,
                     "KV bytes, beam floor": 78 * 2_097_152}
    assert 78 * 2_097_152 == 156 << 20
    # Qwen2.5-7B bf16: 28 layers x 2 x 4 KV heads x 128 x 2 B = 57,344 B per token, 917,504 B
    # per block: n samples 114 blocks = 99.75 MiB, beam floor 78 = 68.25 MiB
    lines = sharing_lines(plan_json(capsys, ["Qwen2.5-7B", "--gpu", "a100", "--share", "4",
                                             "--prompt-tokens", "1000", "--new-tokens", "200"]))
    assert (lines["KV bytes, shared"], lines["KV bytes, beam floor"]) == (
        114 * 917_504, 78 * 917_504)
    # SmolLM2-135M on the CPU engine: 30 layers x 2 x 3 KV heads x 64 = 11,520 elements per
    # token in the dtype "auto" picks on this CPU (bf16 with native bf16, else f32): 368,640 B
    # (bf16) or 737,280 B (f32) per 16-token block
    block = 16 * 11_520 * (2 if cpu_engine_dtype() == "bf16" else 4)
    lines = sharing_lines(plan_json(capsys, ["smollm2-135m", "--gpu", "cpu", "--share", "4",
                                             "--prompt-tokens", "1000", "--new-tokens", "200"]))
    assert (lines["KV bytes, unshared"], lines["KV bytes, shared"],
            lines["KV bytes, beam floor"]) == (300 * block, 114 * block, 78 * block)


def test_no_section_without_share_and_bad_share_exits_1(capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    plan = plan_json(capsys, ["Llama-3.1-8B", "--gpu", "h100"])
    assert not any(s["title"].startswith("KV sharing") for s in plan["sections"])
    capsys.readouterr()
    assert main(["Llama-3.1-8B", "--share", "0"]) != 0
    assert "--share must be >= 1" in capsys.readouterr().err
