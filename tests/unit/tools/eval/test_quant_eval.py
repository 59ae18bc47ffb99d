"""fitserve.tools.eval.eval metrics against hand-computed float64 values, the block bootstrap on
synthetic data, the noise/real verdict, and the shipped held-out texts (eval_run)."""

from __future__ import annotations

import hashlib
import math
import re
import struct
from importlib import resources
from pathlib import Path

import pytest
import torch

from fitserve.tools.eval.eval import (
    BootstrapConfig,
    TokenStats,
    agreement_lengths,
    bootstrap_means,
    compare,
    effective_block,
    mean_ci,
    paired_verdict,
    summarize,
    token_stats,
)
from fitserve.tools.eval.eval_run import (
    SHIPPED_TEXTS,
    EvalError,
    ModelChoice,
    check_choice,
    derive,
    read_text,
)

FAST = BootstrapConfig(block_len=16, resamples=400, seed=0)


def _naive(ref: list[list[float]], cand: list[list[float]], targets: list[int]
           ) -> tuple[list[float], list[float], list[float], list[float]]:
    """KL / flip / NLLs from the definitions, in Python floats (float64), no torch."""
    kls, flips, nr, nc = [], [], [], []
    for r, c, t in zip(ref, cand, targets, strict=True):
        zr, zc = math.log(sum(math.exp(x) for x in r)), math.log(sum(math.exp(x) for x in c))
        lr, lc = [x - zr for x in r], [x - zc for x in c]
        kls.append(sum(math.exp(a) * (a - b) for a, b in zip(lr, lc, strict=True)))
        flips.append(float(r.index(max(r)) != c.index(max(c))))
        nr.append(-lr[t])
        nc.append(-lc[t])
    return kls, flips, nr, nc


def test_token_stats_match_hand_computed_float64() -> None:
    gen = torch.Generator().manual_seed(3)
    ref = torch.randn(7, 5, generator=gen, dtype=torch.float64) * 2
    cand = ref + torch.randn(7, 5, generator=gen, dtype=torch.float64) * 0.7
    targets = torch.tensor([0, 4, 2, 2, 1, 3, 0])
    got = token_stats(ref.float(), cand.float(), targets)
    kl, flip, nr, nc = _naive(ref.float().double().tolist(), cand.float().double().tolist(),
                              targets.tolist())
    assert got.kl.dtype == torch.float64
    assert got.kl.tolist() == pytest.approx(kl, rel=1e-9, abs=1e-12)
    assert got.flip.tolist() == flip
    assert got.nll_ref.tolist() == pytest.approx(nr, rel=1e-12)
    assert got.nll_cand.tolist() == pytest.approx(nc, rel=1e-12)
    assert 0 < sum(flip) < 7  # the example has both agreeing and flipped rows
    assert all(k > 0 for k in kl)


def test_token_stats_of_a_model_against_itself_are_exactly_zero() -> None:
    logits = torch.randn(300, 1000) * 5  # more rows than one float64 block (64)
    stats = token_stats(logits, logits.clone(), torch.randint(1000, (300,)))
    assert torch.equal(stats.kl, torch.zeros(300, dtype=torch.float64))
    assert torch.equal(stats.flip, torch.zeros(300, dtype=torch.float64))
    assert torch.equal(stats.nll_ref, stats.nll_cand)
    s = summarize(stats, FAST, horizon=32)
    assert (s.kl.mean, s.kl.lo, s.kl.hi) == (0.0, 0.0, 0.0)
    assert (s.flip_rate.mean, s.flip_rate.lo, s.flip_rate.hi) == (0.0, 0.0, 0.0)
    assert s.agreement.mean == 32.0 and s.ppl_ref == s.ppl_cand


def test_token_stats_zero_probability_and_shape_checks() -> None:
    ref = torch.tensor([[0.0, -float("inf"), 1.0]])  # p_ref = 0 for token 1: term is 0, not nan
    cand = torch.tensor([[0.5, 0.0, 0.2]])
    kl = token_stats(ref, cand, torch.tensor([0])).kl
    assert math.isfinite(float(kl[0])) and float(kl[0]) > 0
    with pytest.raises(ValueError, match="vocabularies"):
        token_stats(torch.zeros(2, 3), torch.zeros(2, 4), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="targets"):
        token_stats(torch.zeros(2, 3), torch.zeros(2, 3), torch.tensor([0]))


def test_agreement_lengths_by_hand() -> None:
    flip = torch.tensor([0, 0, 1, 0, 0, 0, 1, 0], dtype=torch.float64)
    # runs before the next flip: 2 1 0 3 2 1 0 1(end) -> capped at 3, starts 0..8-3
    assert agreement_lengths(flip, horizon=3).tolist() == [2, 1, 0, 3, 2, 1]
    assert agreement_lengths(flip, horizon=100).tolist() == [2]  # H = n = 8: one start
    assert agreement_lengths(torch.zeros(10), horizon=4).tolist() == [4.0] * 7
    assert agreement_lengths(torch.ones(5), horizon=2).tolist() == [0.0] * 4


def test_effective_block_and_bootstrap_means_are_seeded() -> None:
    assert effective_block(1000, 64) == 64 and effective_block(100, 64) == 25
    assert effective_block(3, 64) == 1
    v = torch.randn(500, dtype=torch.float64)
    a, b = bootstrap_means(v, FAST), bootstrap_means(v, FAST)
    assert torch.equal(a, b) and a.shape == (400,)
    assert not torch.equal(a, bootstrap_means(v, BootstrapConfig(16, 400, seed=1)))
    # each resample mean is the mean of whole circular blocks: check one by brute force
    gen = torch.Generator().manual_seed(0)
    starts = torch.randint(500, (400, 32), generator=gen)[0]
    idx = (starts[:, None] + torch.arange(16)) % 500
    assert float(a[0]) == pytest.approx(float(v[idx.flatten()].mean()), rel=1e-12)
    with pytest.raises(ValueError):
        bootstrap_means(torch.zeros(0))


def _ar1(n: int, rho: float, gen: torch.Generator) -> torch.Tensor:
    """x[t] = rho x[t-1] + e[t] (stationary): e filtered by rho^k, k < 200 (rho^200 ~ 0)."""
    k = 200
    e = torch.randn(1, 1, n + k, generator=gen, dtype=torch.float64)
    kernel = (rho ** torch.arange(k, dtype=torch.float64)).flip(0).view(1, 1, -1)
    return torch.nn.functional.conv1d(e, kernel).flatten()[1:]


def test_block_bootstrap_covers_the_true_mean_of_correlated_data() -> None:
    """AR(1) with rho 0.8 (true mean 0): the 95% block interval covers 0 about 95% of the time;
    resampling single tokens (block 1) covers far less: why blocks are needed."""
    gen = torch.Generator().manual_seed(11)
    block, single = BootstrapConfig(64, 200, 0), BootstrapConfig(1, 200, 0)
    series = [_ar1(1500, 0.8, gen) for _ in range(50)]
    cover = sum(not mean_ci(x, block).excludes(0.0) for x in series) / len(series)
    cover1 = sum(not mean_ci(x, single).excludes(0.0) for x in series) / len(series)
    print(f"coverage: blocks of 64 {cover:.2f}, single tokens {cover1:.2f}")
    assert cover >= 0.82, cover
    assert cover1 <= 0.75, cover1


def test_bootstrap_interval_covers_iid_mean_and_shrinks_with_more_data() -> None:
    gen = torch.Generator().manual_seed(5)
    true = 0.3
    hits = 0
    for _ in range(80):
        x = true + torch.randn(400, generator=gen, dtype=torch.float64)
        hits += not mean_ci(x, FAST).excludes(true)
    assert hits / 80 >= 0.88
    small = mean_ci(torch.randn(500, generator=gen, dtype=torch.float64), FAST)
    big = mean_ci(torch.randn(8000, generator=gen, dtype=torch.float64), FAST)
    # width ~ 1 / sqrt(n): 16x the data, about a quarter of the width
    assert (big.hi - big.lo) < 0.4 * (small.hi - small.lo)
    assert small.lo <= small.mean <= small.hi


def test_verdict_noise_for_identical_and_iid_candidates_real_for_a_shift() -> None:
    gen = torch.Generator().manual_seed(7)
    a = torch.rand(1000, generator=gen, dtype=torch.float64)
    same = paired_verdict(a, a.clone(), FAST)
    assert same.verdict == "noise" and (same.diff.lo, same.diff.hi) == (0.0, 0.0)
    false_alarms = 0
    for _ in range(40):
        x = torch.rand(1000, generator=gen, dtype=torch.float64)
        y = torch.rand(1000, generator=gen, dtype=torch.float64)
        false_alarms += paired_verdict(x, y, FAST).verdict == "real"
    assert false_alarms <= 6  # about 5% of 40 expected
    real = paired_verdict(a * 1.2 + 0.02, a, FAST)
    assert real.verdict == "real" and real.diff.lo > 0


def test_compare_two_candidates_on_every_metric() -> None:
    gen = torch.Generator().manual_seed(2)
    ref = torch.randn(400, 50, generator=gen)
    targets = torch.randint(50, (400,), generator=gen)
    near = token_stats(ref, ref + 0.05 * torch.randn(400, 50, generator=gen), targets)
    far = token_stats(ref, ref + 1.0 * torch.randn(400, 50, generator=gen), targets)
    out = compare(near, far, FAST, horizon=8)
    assert set(out) == {"kl", "flip_rate", "nll", "agreement"}
    assert out["kl"].verdict == "real" and out["kl"].diff.hi < 0
    assert out["flip_rate"].verdict == "real" and out["agreement"].diff.lo > 0
    same = compare(near, near, FAST, horizon=8)
    assert all(c.verdict == "noise" for c in same.values())
    with pytest.raises(ValueError, match="different texts"):
        compare(near, TokenStats.cat([near, near]), FAST)


def test_shipped_texts_match_their_readme() -> None:
    data = resources.files("fitserve.tools.eval").joinpath("data")
    readme = data.joinpath("README.md").read_text(encoding="utf-8")
    for name, file in SHIPPED_TEXTS.items():
        body, label = read_text(name)
        raw = data.joinpath(file).read_bytes()
        assert body.encode("utf-8") == raw and name in label
        digest = re.search(rf"`{re.escape(file)}`\s+`([0-9a-f]{{64}})`", readme)
        assert digest and hashlib.sha256(raw).hexdigest() == digest.group(1), file
        assert 10_000 < len(raw) < 60_000
    assert read_text(None)[0].startswith("Chapter 1\n\nSir Walter Elliot")


def test_read_text_bad_inputs(tmp_path: Path) -> None:
    with pytest.raises(EvalError, match="no such file"):
        read_text(str(tmp_path / "missing.txt"))
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(EvalError, match="empty"):
        read_text(str(tmp_path / "empty.txt"))
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(EvalError, match="UTF-8"):
        read_text(str(tmp_path / "bin.txt"))


def test_derive_compare_specs() -> None:
    base = ModelChoice("m", quantization="int4", dtype="float32", kv_cache_dtype="int8")
    a = derive(base, "int8")
    assert (a.weights, a.quantization, a.dtype, a.kv_cache_dtype) == ("int8", None, "float32",
                                                                        "int8")
    b = derive(base, "kv-cache-dtype=fp8_e4m3,label=fp8 kv")
    assert (b.quantization, b.kv_cache_dtype, b.name()) == ("int4", "fp8_e4m3", "fp8 kv")
    assert derive(base, "quantization=int8").weights == "auto"
    dense = derive(base, "bf16")
    assert (dense.weights, dense.dtype) == ("bf16", "auto")
    check_choice(dense)  # no conflict with the primary's --dtype float32
    for bad in ("colour=red", "weights=", "dtype"):
        with pytest.raises(EvalError, match="KEY=VALUE"):
            derive(base, bad.replace("dtype", "dtype,x"))
    with pytest.raises(EvalError, match="unknown --weights"):
        check_choice(derive(base, "int3"))
    with pytest.raises(EvalError, match="unknown --kv-cache-dtype"):
        check_choice(ModelChoice(kv_cache_dtype="int3"))
    with pytest.raises(EvalError, match="conflicts"):
        check_choice(ModelChoice(weights="int8", quantization="int4"))


def _xdr_char(s: str) -> bytes:
    b = s.encode()
    return struct.pack(">ii", 0x00040009, len(b)) + b


def test_extract_heldout_reads_r_serialization() -> None:
    """The extraction script's R XDR reader on a hand-made named list (what an .rdx holds)."""
    import importlib.util

    path = Path(resources.files("fitserve.tools.eval").joinpath("data", "extract_heldout.py"))
    spec = importlib.util.spec_from_file_location("extract_heldout", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    head = b"X\n" + struct.pack(">iiii", 3, 0x40201, 0x30500, 5) + b"UTF-8"
    strs = struct.pack(">ii", 16, 2) + _xdr_char("emma") + _xdr_char("persuasion")
    ints = struct.pack(">iiii", 13, 2, 7, 9)
    names = (struct.pack(">i", 0x402) + struct.pack(">i", 1) + _xdr_char("names") +
             struct.pack(">ii", 16, 2) + _xdr_char("a") + _xdr_char("b") + struct.pack(">i", 254))
    blob = head + struct.pack(">ii", 0x213, 2) + strs + ints + names
    assert mod._XDR(blob).item() == {"a": ["emma", "persuasion"], "b": [7, 9]}
