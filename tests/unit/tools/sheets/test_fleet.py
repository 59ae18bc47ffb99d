"""`fitserve plan fleet`: golden figures derived by hand below, exit codes, bad input, --json.

Defaults used throughout (stated in fleet.py): storage egress 400 Gb/s = 50e9 B/s for the
whole fleet, NIC 200 Gb/s = 25e9 B/s per node, local disk 20 GB/s = 20e9 B/s per node, PCIe
50 GB/s = 50e9 B/s per GPU, 8 GPUs per node, 8 GPUs per replica, chunk 64 MiB = 67,108,864 B,
start-up 10 s + 3 s (overlap the bytes) and 5 s + 30 s (after the bytes).
"""

from __future__ import annotations

import json
import math

import pytest

from fitserve.tools.sheets.sheet import build_sheet, run_tool

GIB = 1 << 30


def test_500g_onto_125_replicas_by_hand() -> None:
    # S = 500 GiB = 500 x 2^30 = 536,870,912,000 B (--model-bytes 500GiB).
    # R = 125 replicas of G = 8 GPUs, n = 8 per node: N = ceil(1000 / 8) = 125 nodes.
    # s = S / 8 = 67,108,864,000 B per GPU; a node holds one replica: U = S.
    s_bytes = 500 * GIB
    assert s_bytes == 536_870_912_000
    sh = build_sheet("fleet", ["--model-bytes", "500GiB", "--replicas", "125"])
    assert sh.line("nodes").value == 125
    assert sh.line("bytes per GPU").value == 67_108_864_000
    assert sh.line("bytes from storage, every replica its own").value == 125 * s_bytes
    assert sh.line("distinct bytes a node holds").value == s_bytes
    # naive bounds:
    #   storage = 125 x 536,870,912,000 / 50e9      = 1342.177 s
    #   NIC     = 536,870,912,000 / 25e9            =   21.475 s
    #   disk    = 536,870,912,000 / 20e9            =   26.844 s
    #   PCIe    = 67,108,864,000 / 50e9             =    1.342 s
    # the stages stream, so the naive load is the slowest: 1342.177 s (storage egress).
    assert sh.line("storage egress bound").value == pytest.approx(1342.17728, rel=1e-9)
    assert sh.line("node NIC bound").value == pytest.approx(21.47483648, rel=1e-9)
    assert sh.line("local disk bound").value == pytest.approx(26.8435456, rel=1e-9)
    assert sh.line("PCIe to GPU bound").value == pytest.approx(1.34217728, rel=1e-9)
    assert sh.line("naive load time").value == pytest.approx(1342.17728, rel=1e-9)
    # pipelined chain: k = max(1, 8/8) = 1 chain of L = 125 nodes.
    # stage rates: storage hop min(50e9 / 1, 25e9) = 25e9; relay 25e9; disk 20e9;
    # PCIe 8 links x 50e9 = 400e9  ->  b* = 20e9 (the disk).
    # C = ceil(536,870,912,000 / 67,108,864) = 8000 chunks exactly; t = 67,108,864 / 20e9
    # = 3.3554432 ms; H = 125 network hops + 2 local stages = 127.
    # T = (8000 + 127 - 1) x 3.3554432 ms = 8126 x 3.3554432 ms = 27.26633 s
    # bound U / b* = 536,870,912,000 / 20e9 = 26.8435456 s; naive / T = 49.225
    assert sh.line("chunks").value == 8000
    assert sh.line("stages a chunk crosses").value == 127
    assert sh.line("slowest stage").value == 20e9
    assert sh.line("chunk time").value == pytest.approx(3.3554432e-3, rel=1e-12)
    assert sh.line("pipelined broadcast time").value == pytest.approx(8126 * 3.3554432e-3,
                                                                      rel=1e-12)
    assert sh.line("tightest per-node bound").value == pytest.approx(26.8435456, rel=1e-12)
    assert sh.line("speed-up over naive").value == pytest.approx(1342.17728 / 27.2663314432,
                                                                 rel=1e-9)
    # start-up: max(T, 10 + 3) + 5 + 30
    assert sh.line("serving after, pipelined").value == pytest.approx(27.2663314432 + 35,
                                                                      rel=1e-12)
    assert sh.line("serving after, naive").value == pytest.approx(1342.17728 + 35, rel=1e-12)
    assert sh.ok


def test_500gb_is_decimal_and_a_bare_g_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    # "a 500 GB model": S = 500 x 10^9 B (the old parser read 500G and 500GB as 500 GiB,
    # 7.4% more). 125 replicas: storage 125 x 500e9 / 50e9 = 1,250 s (was 1,342.18 s);
    # chunks ceil(500e9 / 67,108,864) = ceil(7,450.58) = 7,451 (was 8,000);
    # equal chunks of 500e9 / 7,451 B, each 3.35526 ms at the disk's 20e9 B/s;
    # T = (7,451 + 127 - 1) x 3.35526 ms = 7,577 x 3.35526 ms = 25.4228 s (was 27.2663 s)
    for text in ("500GB", "500e9", "500 gb", "500000000000"):
        sh = build_sheet("fleet", ["--model-bytes", text, "--replicas", "125"])
        assert sh.line("model bytes per replica").value == 500_000_000_000
        assert sh.line("model bytes per replica").shown == "500.00 GB = 465.66 GiB"
        assert sh.line("storage egress bound").value == pytest.approx(1250.0, rel=1e-12)
        assert sh.line("chunks").value == 7451
        assert sh.line("pipelined broadcast time").value == pytest.approx(
            7577 * 500e9 / 7451 / 20e9, rel=1e-12)
    gib = build_sheet("fleet", ["--model-bytes", "500GiB", "--replicas", "125"])
    assert gib.line("model bytes per replica").shown == "536.87 GB = 500.00 GiB"
    # a bare G: refused, both readings named
    assert run_tool("fleet", ["--model-bytes", "500G", "--replicas", "125"]) == 2
    err = capsys.readouterr().err
    assert "ambiguous" in err and "500GB (500,000,000,000 B)" in err
    assert "500GiB (536,870,912,000 B)" in err


def test_llama_8b_one_gpu_replicas_share_a_node_copy() -> None:
    # Llama-3.1-8B in bf16: 8,030,261,248 parameters (32 layers x 218,103,808 matmul + 2 x
    # 128,256 x 4,096 embedding/lm_head + 262,144 + 4,096 norm weights) x 2 B = 16,060,522,496 B.
    s = 16_060_522_496
    sh = build_sheet("fleet", ["--model", "Llama-3.1-8B", "--replicas", "32",
                               "--gpus-per-replica", "1", "--gpu", "h100"])
    assert sh.line("model bytes per replica").value == s
    # 32 one-GPU replicas, 8 per node: N = 4 nodes; naive: a node takes 8 copies = 8 S;
    # pipelined: the node's 8 replicas share one copy, U = S x min(8, 1) / 1 = S.
    assert sh.line("nodes").value == 4
    assert sh.line("bytes into the busiest node, naive").value == 8 * s
    assert sh.line("distinct bytes a node holds").value == s
    # naive: storage 32 S / 50e9 = 10.2787 s; NIC 8 S / 25e9 = 5.1394 s; disk 8 S / 20e9 =
    # 6.4242 s; PCIe S / 50e9 = 0.3212 s -> storage egress, 10.2787 s
    assert sh.line("naive load time").value == pytest.approx(32 * s / 50e9, rel=1e-12)
    assert sh.line("node NIC bound").value == pytest.approx(8 * s / 25e9, rel=1e-12)
    # pipelined: stage rates storage hop 25e9, relay 25e9, disk 20e9, PCIe 1 GPU link each
    # x 50e9 ... min(8, 1) = 1 link's worth per node payload = 50e9 -> b* = 20e9 (disk).
    # C = ceil(16,060,522,496 / 67,108,864) = ceil(239.32) = 240 equal chunks; H = 4 + 2 = 6
    # T = (240 + 6 - 1) x (S / 240) / 20e9 = 245 / 240 x 0.80302612 s = 0.819756 s
    assert sh.line("rate: PCIe into the node's GPUs").value == 50e9
    assert sh.line("chunks").value == 240
    assert sh.line("stages a chunk crosses").value == 6
    assert sh.line("pipelined broadcast time").value == pytest.approx(245 / 240 * s / 20e9,
                                                                      rel=1e-12)
    assert sh.warnings == ()  # 16 GB fits an h100's 72 GB usable


def test_llama_70b_fp8_direct_two_nodes_per_replica() -> None:
    # Llama-3.3-70B, fp8 decoder matmuls, embedding and lm_head bf16: 68,451,041,280 matmul
    # weights x 1 B (+ one f32 scale per tensor: 80 layers x 7 tensors x 4 B = 2,240 B)
    # + 2 x 1,050,673,152 x 2 B + 1,318,912 norm weights x 2 B
    # = 68,451,043,520 + 4,202,692,608 + 2,637,824 = 72,656,373,952 B.
    s = 68_451_041_280 + 80 * 7 * 4 + 2 * 1_050_673_152 * 2 + 1_318_912 * 2
    assert s == 72_656_373_952
    args = ["--model", "Llama-3.3-70B", "--weights", "fp8", "--replicas", "10",
            "--gpus-per-replica", "16", "--direct", "--nic-gbps", "400"]
    sh = build_sheet("fleet", args)
    assert sh.line("model bytes per replica").value == s
    # G = 16 over n = 8: 2 nodes per replica, N = 20; each node holds half: U = S x 8 / 16.
    # k = 2 chains (node halves) of L = 10 nodes; storage hop min(50e9 / 2, 50e9) = 25e9 B/s,
    # relay 400 Gb/s = 50e9, PCIe 8 x 50e9 = 400e9, no disk (--direct) -> b* = 25e9 (storage).
    assert sh.line("nodes").value == 20
    assert sh.line("distinct bytes a node holds").value == s / 2
    assert sh.line("chains x nodes per chain").shown == "2 x 10"
    assert sh.line("slowest stage").value == 25e9
    # H = 10 network hops + 1 local stage (PCIe) = 11; C = ceil((S / 2) / 2^26) = 542
    c = math.ceil(s / 2 / 67_108_864)
    assert c == 542
    assert sh.line("stages a chunk crosses").value == 11
    assert sh.line("pipelined broadcast time").value == pytest.approx(
        (c + 10) * (s / 2 / c) / 25e9, rel=1e-12)
    # storage is paid once: the bound S / E = (S / 2) / (E / 2) is the pipelined limit
    assert sh.line("tightest per-node bound").value == pytest.approx(s / 50e9, rel=1e-12)
    # naive has no disk line with --direct
    with pytest.raises(KeyError):
        sh.line("local disk bound")


def test_gpu_memory_check_on_two_accelerators() -> None:
    base = ["--model-bytes", "500GiB", "--replicas", "4"]
    # 62.5 GiB = 67.1e9 B per GPU: fits an h100 (80e9 x 0.9 = 72e9), not an a100-40gb (36e9)
    assert build_sheet("fleet", [*base, "--gpu", "h100"]).warnings == ()
    w = build_sheet("fleet", [*base, "--gpu", "a100-40gb"]).warnings
    assert len(w) == 1 and "does not fit a100-40gb" in w[0]


def test_exit_codes_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--model-bytes", "500GiB", "--replicas", "125"]
    assert run_tool("fleet", [*base, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["data"]["pipelined_s"] == pytest.approx(27.2663314432, rel=1e-12)
    # serving after 62.27 s: a 60 s deadline is missed (1), a 90 s one met (0)
    assert run_tool("fleet", [*base, "--deadline-s", "60"]) == 1
    assert "MISSES" in capsys.readouterr().out
    assert run_tool("fleet", [*base, "--deadline-s", "90", "--explain"]) == 0
    assert "arithmetic" in capsys.readouterr().out  # the --explain column
    sh = build_sheet("fleet", base)
    assert sh.line("pipelined broadcast time").explain == (
        "(8,000 + 127 - 1) x 3.3554 ms = 27.27 s")
    assert all(ln.formula and ln.explain for sec in sh.sections for ln in sec.lines)


@pytest.mark.parametrize(("extra", "message"), [
    (["--replicas", "0"], "--replicas must be >= 1"),
    (["--replicas", "4", "--nic-gbps", "0"], "--nic-gbps must be > 0"),
    (["--replicas", "4", "--storage-gbps", "-1"], "--storage-gbps must be > 0"),
    (["--replicas", "4", "--pcie-gbyte-s", "0"], "--pcie-gbyte-s must be > 0"),
    (["--replicas", "4", "--disk-gbyte-s", "0"], "--disk-gbyte-s must be > 0"),
    (["--replicas", "4", "--gpu", "h900"], "unknown GPU 'h900'"),
    (["--replicas", "4", "--gpus-per-replica", "3"], "one must divide the other"),
    (["--replicas", "4", "--graph-capture-s", "-5"], "--graph-capture-s must be >= 0"),
    (["--replicas", "4", "--chunk", "0"], "--chunk must be > 0"),
])
def test_bad_input_exits_2_naming_the_problem(capsys: pytest.CaptureFixture[str],
                                              extra: list[str], message: str) -> None:
    assert run_tool("fleet", ["--model-bytes", "500GiB", *extra]) == 2
    assert message in capsys.readouterr().err


def test_unknown_model_and_zero_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_tool("fleet", ["--model", "nope-1b", "--replicas", "2"]) == 2
    assert "unknown model 'nope-1b'" in capsys.readouterr().err
    assert run_tool("fleet", ["--model-bytes", "0", "--replicas", "2"]) == 2
    assert "--model-bytes must be > 0" in capsys.readouterr().err
