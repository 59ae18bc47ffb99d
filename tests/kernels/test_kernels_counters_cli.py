"""Counters (bytes/FLOPs) and the ``kernels --explain`` command."""

from __future__ import annotations

import argparse

import pytest

from fitserve.tools.labs.cli import add_kernels_parser, parse_shape, run_kernels
from fitserve.tools.labs.counters import (
    AttnShape,
    naive_forward,
    split_kv_decode,
    tiled_backward,
    tiled_forward,
)


def test_naive_vs_tiled_traffic_prefill() -> None:
    s = AttnShape(1, 8, 8, 1024, 1024, 64, 2, causal=False)
    naive, tiled = naive_forward(s), tiled_forward(s, 64, 64)
    qo = 8 * 1024 * 64 * 2
    # naive: Q, K, V read + S and P written and read back in fp32
    assert naive.bytes_read == qo + 2 * qo + 8 * 2 * 1024 * 1024 * 4
    assert naive.bytes_written == qo + 8 * 2 * 1024 * 1024 * 4
    # tiled: K/V re-read by each of the 16 query tiles; ideal reads them once
    assert tiled.bytes_read == qo + 16 * 2 * qo
    assert tiled_forward(s, 64, 64, reread=False).bytes_read == qo + 2 * qo
    assert naive.flops_executed == tiled.flops_executed == 4 * 64 * 1024 * 1024 * 8
    # re-reads cost 16x the K/V bytes, still ~4x less than the M x N round trips of naive
    assert naive.bytes_total / tiled.bytes_total > 3.5
    assert naive.bytes_total / tiled_forward(s, 64, 64, reread=False).bytes_total > 30


def test_causal_counts_use_tiles_and_pairs() -> None:
    s = AttnShape(1, 1, 1, 128, 128, 16, 2)
    t = tiled_forward(s, 64, 64)
    assert t.flops_useful == 4 * 16 * (128 * 129 // 2)
    assert t.flops_executed == 4 * 16 * (64 * 64 * 3)      # three visited 64x64 tiles
    assert tiled_backward(s, 64, 64).flops_executed == 10 * 16 * 64 * 64 * 3


def test_gqa_fold_divides_kv_traffic() -> None:
    s = AttnShape(2, 32, 8, 1, 4096, 128, 2)
    folded, unfolded = tiled_forward(s), tiled_forward(s, gqa_fold=False)
    kv = 2 * 8 * 2 * 4096 * 128 * 2
    assert folded.bytes_read - 2 * 32 * 128 * 2 == kv
    assert unfolded.bytes_read - 2 * 32 * 128 * 2 == 4 * kv


def test_split_kv_partials_are_counted() -> None:
    s = AttnShape(1, 8, 8, 1, 1000, 64, 2)
    one, four = split_kv_decode(s, 1), split_kv_decode(s, 4)
    assert four.bytes_written - one.bytes_written == 8 * 3 * 65 * 4
    assert four.flops_executed == one.flops_executed


def test_parse_shape_defaults_and_errors() -> None:
    v = parse_shape("b=2,hq=9,hkv=3,t=1,s=100,d=64")
    assert (v["b"], v["hq"], v["hkv"], v["t"], v["s"], v["d"], v["dtype"]) == (
        2, 9, 3, 1, 100, 64, "bf16")
    assert parse_shape("hq=4")["hkv"] == 4
    for bad in ("b", "zz=1", "t=5,s=4", "dtype=int3"):
        with pytest.raises(ValueError):
            parse_shape(bad)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fitserve")
    add_kernels_parser(p.add_subparsers(dest="command", required=True))
    return p


def test_cli_explain_prints_counters(capsys: pytest.CaptureFixture[str]) -> None:
    args = _parser().parse_args(["kernels", "--explain", "b=1,hq=8,hkv=2,t=512,s=512,d=64,w=128"])
    assert run_kernels(args) == 0
    text = capsys.readouterr().out
    for needle in ("naive", "tiled", "tiled-ideal", "tiled-backward", "paged", "key tiles",
                   "window 128 vs causal", "GQA packing (G=4)", "rmsnorm"):
        assert needle in text


def test_cli_decode_shows_split_choice(capsys: pytest.CaptureFixture[str]) -> None:
    args = _parser().parse_args(["kernels", "--explain", "b=1,hq=9,hkv=3,t=1,s=8192,workers=16"])
    assert run_kernels(args) == 0
    assert "split-KV:" in capsys.readouterr().out


def test_cli_bad_shape_returns_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_kernels(_parser().parse_args(["kernels", "--explain", "q=1"])) == 2
    assert "bad SHAPE" in capsys.readouterr().err
