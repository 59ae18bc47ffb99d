"""The planner's tensor-parallel split rule (fitserve.ledger.tp_split) with exact numbers: each
format's column block, a mix's row-parallel blocks, and which tp each MoE model of the catalog
splits over in its own weights (gpt-oss: MXFP4 experts at whole 32-column blocks)."""

from __future__ import annotations

import pytest

from fitserve.ledger.errors import PlanError
from fitserve.ledger.tp_split import (
    check_tp_split,
    format_column_block,
    mix_row_blocks,
    tp_split_problem,
)
from fitserve.tools.planner.model_source import catalog_entry


@pytest.mark.parametrize(("fmt", "block"), [
    ("bf16", 1), ("f32", 1), ("fp8", 1), ("int8", 1), ("fp8-block", 128), ("mxfp4", 32),
    ("Q4_0", 32), ("Q4_1", 32), ("Q8_0", 32), ("Q4_K", 256), ("Q6_K", 256), ("IQ4_XS", 256),
    ("int4-g32-asym", 32), ("int4-g64-sym", 64), ("int4-g128-asym", 128), ("int4-g128", 128),
    ("int8-g64", 64), ("int8-ch", 32), ("int4-g128-sym-perm", 0)])
def test_format_column_block(fmt: str, block: int) -> None:
    assert format_column_block(fmt) == block


@pytest.mark.parametrize(("fmt", "dense", "expert"), [
    ("bf16", (), ()), ("gpt-oss-mxfp4", (), (32,)), ("Q4_K_M", (256,), (256,)),
    ("Q4_0", (32,), (32,)), ("int4-g128", (128,), (128,)), ("fp8-block", (128,), (128,))])
def test_mix_row_blocks(fmt: str, dense: tuple[int, ...], expert: tuple[int, ...]) -> None:
    assert mix_row_blocks(fmt) == (dense, expert)


# tp of 1, 2, 4, 8 each catalog MoE model splits over in the named weights, by hand:
#   gpt-oss (MXFP4 experts, 2880 wide): 2880/2 = 1440 = 45 x 32; 2880/4 = 720 = 22.5 x 32;
#       2880/8 = 360 = 11.25 x 32
#   Qwen3-30B-A3B (experts 768 wide, 32 heads / 4 KV): bf16 all; Q4_K_M (256-blocks):
#       768/2 = 384 = 1.5 x 256
#   Mixtral-8x7B (14336 wide, 32 x 128 = 4096 attention columns): int4-g128 all
#   DeepSeek-V3 (fp8 128-tiles, experts 2048, dense 18432, 128 heads): all
@pytest.mark.parametrize(("name", "fmt", "ok"), [
    ("gpt-oss-20b", "gpt-oss-mxfp4", (1, 2)), ("gpt-oss-120b", "gpt-oss-mxfp4", (1, 2)),
    ("gpt-oss-20b", "bf16", (1, 2, 4, 8)), ("Qwen3-30B-A3B", "bf16", (1, 2, 4, 8)),
    ("Qwen3-30B-A3B", "Q4_K_M", (1,)), ("Mixtral-8x7B", "int4-g128", (1, 2, 4, 8)),
    ("DeepSeek-V3", "fp8-block", (1, 2, 4, 8))])
def test_catalog_moe_models_split_where_the_engine_would(name: str, fmt: str,
                                                         ok: tuple[int, ...]) -> None:
    spec = catalog_entry(name).spec
    got = []
    for tp in (1, 2, 4, 8):
        try:
            check_tp_split(spec, tp, fmt)
            got.append(tp)
        except PlanError:
            pass
    assert tuple(got) == ok


def test_the_refusal_names_the_block() -> None:
    spec = catalog_entry("gpt-oss-20b").spec
    assert tp_split_problem(spec, 4, expert_group_sizes=(32,)) == (
        "gpt-oss-20b: expert intermediate size=2880 / tensor_parallel_size=4 = 720 columns per "
        "rank is not a whole number of the packed weights' groups of 32; use --weights bf16 "
        "or another --tp")
    assert "act-order" in str(tp_split_problem(spec, 2, group_sizes=(0,)))
