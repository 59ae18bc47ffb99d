"""The FP8 attention simulation (fitserve.tools.labs.fp8_attention) against its float64 reference.

- with nothing quantized the simulation IS the reference (bit for bit);
- round_bits equals a bf16 / f16 / f32 cast at 8 / 11 / 24 bits; the Hadamard is orthonormal;
- each of the three points has its error, and its fix cuts it by a clear factor:
  (a) Q/K with outlier channels in K: K's channel-mean smoothing + Hadamard rotation (and the
      finding that per-channel scales do not help fp8, while they do help int8);
  (b) P near zero: per-row scaling by 448 / rowmax (and P in bf16);
  (c) accumulators: fp32 accumulation, promotion to fp32 every 128 terms;
- the low-precision accumulator drifts with the sequence length; promotion holds it.
"""

from __future__ import annotations

import pytest
import torch

from fitserve.tools.labs.fp8_attention import (
    AttentionQuant,
    ReportRow,
    accumulate_matmul,
    accumulator_drift,
    attention,
    format_report,
    hadamard,
    quantize_p,
    reference,
    report,
    round_bits,
    simulate,
    synthetic_case,
)


@pytest.fixture(scope="module")
def rows() -> dict[tuple[str, str], ReportRow]:
    """The report's rows by (first word of the problem, fix): ("e4m3", ...), ("P", ...)."""
    # NOTE: 16 queries (the benchmark's report() uses 64): the QK^T accumulator loop costs
    # Tq x Tk per step; the factors asserted below hold at both sizes.
    table = report(tq=16)
    print("\n" + format_report(table))
    return {(r.problem.split()[0], r.fix): r for r in table}


def test_no_quantization_is_the_reference() -> None:
    q, k, v = synthetic_case(tq=8, tk=256, d=64)
    assert torch.equal(attention(q, k, v, AttentionQuant()), reference(q, k, v))
    exact = accumulate_matmul(q, k.T, bits=52)
    assert float((exact - q @ k.T).abs().max()) < 1e-12


def test_round_bits_is_the_cast_and_hadamard_is_orthonormal() -> None:
    x = torch.randn(1000, dtype=torch.float64) * 1e3
    for bits, dt in ((8, torch.bfloat16), (11, torch.float16), (24, torch.float32)):
        assert torch.equal(round_bits(x, bits), x.to(dt).double())
    h = hadamard(128)
    assert torch.allclose(h @ h.T, torch.eye(128, dtype=torch.float64), atol=1e-14)


def test_qk_outliers_fixed_by_smoothing_and_rotation(rows: dict[tuple[str, str], ReportRow]
                                                     ) -> None:
    assert rows[("e4m3", "K mean + Hadamard rotation")].factor > 5
    assert rows[("e4m3", "K minus its channel mean (softmax-exact)")].factor > 2.5
    assert rows[("e4m3", "Hadamard rotation of Q and K")].factor > 2
    # fp8 is floating point: per-channel scales leave its relative precision as it was ...
    assert rows[("e4m3", "per-token Q, per-channel K scales")].factor < 1.3
    # ... while they are int8's fix (its step is fixed by the scale)
    assert rows[("int8", "per-token Q, per-channel K scales")].factor > 1.5
    # and the per-tensor scale does not crush K's small channels: few entries leave e4m3's
    # normal range (it spans 2^14.8; the outliers are ~2^5 above the rest)
    _, k, _ = synthetic_case()
    scaled = k / (k.abs().max() / 448)
    assert float((scaled.abs() < 2.0**-6).double().mean()) < 0.002


def test_probabilities_near_zero_fixed_by_row_scaling(rows: dict[tuple[str, str], ReportRow]
                                                      ) -> None:
    assert rows[("P", "rows scaled by 448 / rowmax, undone after PV")].factor > 5
    assert rows[("P", "P kept in bf16")].factor > 50
    q, k, v = synthetic_case()
    p = torch.softmax(q @ k.T / 128**0.5, dim=-1)
    raw, _ = quantize_p(p, "raw")
    assert float((raw == 0).double().mean()) > 0.5  # most probabilities flush to zero
    assert float(raw.sum(1).mean()) < 0.8  # and the mass they carried is gone


def test_accumulators_fixed_by_fp32_and_promotion(rows: dict[tuple[str, str], ReportRow]
                                                  ) -> None:
    assert rows[("QK^T", "fp32 accumulators")].factor > 1000
    assert rows[("PV", "fp32 accumulators")].factor > 1000
    assert rows[("PV", "promote to fp32 every 128")].factor > 2.5
    assert rows[("PV", "promote to fp32 every 128 (DS-V3)")].factor > 2.5


def test_low_precision_accumulation_drifts_with_length() -> None:
    drift = accumulator_drift(tks=(256, 4096))
    (_, short_low, short_prom), (_, long_low, long_prom) = drift
    assert long_low > 2.5 * short_low  # grows with the number of terms
    assert long_prom < 1.5 * short_prom  # promotion every 128 holds it
    assert long_low > 3 * long_prom


def test_simulate_api() -> None:
    q, k, v = synthetic_case(tq=4, tk=512, d=64)
    for point in ("qk", "p", "acc"):
        without, with_fix = (simulate(q, k, v, point=point, fix=f) for f in (False, True))
        assert with_fix.error < without.error
        assert without.out.shape == (4, 64)
    with pytest.raises(ValueError, match="point"):
        simulate(q, k, v, point="v", fix=True)
