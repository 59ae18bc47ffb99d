"""`plan explain rope-fusion | bf16-sum | kv-quant-roads`, derived by hand.

Llama-3.1-8B: 32 layers, 32 / 8 heads of 128; Llama-3.3-70B: 80 layers, 64 / 8 heads of 128.
"""

from __future__ import annotations

import math

import pytest

from fitserve.tools.labs.counters import rope_counts
from fitserve.tools.sheets.explain_numerics import bisect_crossing, to_bf16
from fitserve.tools.sheets.sheet import Sheet, build_sheet


def sheet(*argv: str) -> Sheet:
    return build_sheet("explain", list(argv))


def val(s: Sheet, name: str) -> float:
    v = s.line(name).value
    assert isinstance(v, (int, float)), (name, v)
    return float(v)


def test_rope_fusion_bytes_match_the_counter() -> None:
    s = sheet("rope-fusion")
    # q: eager 10 x 2 x 2048 x 32 x 128 + 2 x 4 x 2048 x 128 = 167,772,160 + 2,097,152
    assert val(s, "q: eager bytes") == 169_869_312
    fused = rope_counts(2048, 32, 128)  # the lab counter (read x + int32 pos, write x)
    assert val(s, "q: fused bytes") == fused.bytes_read + fused.bytes_written == 33_562_624
    # per layer (q + k): 213,909,504 - 41,959,424 = 171,950,080 B; + the KV write
    # 2 x 2 x 2048 x 8 x 128 = 8,388,608; x 32 layers = 5,770,838,016 B
    assert s.data["saved_forward"] == 32 * (171_950_080 + 8_388_608)
    big = sheet("rope-fusion", "--model", "Llama-3.3-70B", "--context", "1k")
    k = rope_counts(1024, 8, 128)
    assert val(big, "k: fused bytes") == k.bytes_read + k.bytes_written


def test_bf16_rounding_and_the_stall() -> None:
    assert to_bf16(1.0 + 2**-8) == 1.0  # tie -> even
    assert to_bf16(1.0 + 3 * 2**-8) == 1.0 + 2**-6  # tie between 1 + 2^-7 (odd) and 1 + 2^-6
    assert to_bf16(256.0 + 1.0) == 256.0  # ulp 2 at 256: 257 ties to even 256
    s = sheet("bf16-sum")
    # past S = 512 every addend < 1.5 < ulp / 2 = 2 is lost: error -> 1 - 512 / n-ish
    assert val(s, "n = 65,536") > 0.99
    assert val(s, "n = 1,024") == pytest.approx(0.5, abs=0.01)  # stuck at 512 of ~1024
    # fp32 holds these sums exactly (8-bit significands, sums < 2^17 need < 24 bits)
    assert "fp32 0.0e+00" in s.line("n = 65,536").shown


def test_bisection_procedure_on_a_known_curve() -> None:
    # a monotone curve err(n) = n x 2^-8: crosses 0.01 first at n = 3 (3/256 = 0.0117)
    err = [n / 256 for n in range(1, 1025)]
    found, probes = bisect_crossing(err, 0.01)
    assert found == 3 and probes == [1, 2, 4, 3]
    s = sheet("bf16-sum")
    first = s.data["first_crossing"]
    crossing = s.data["crossing"]
    assert isinstance(first, int) and isinstance(crossing, int) and first <= crossing
    assert val(s, "first n with error > 0.01 (bisection)") == crossing


def test_kv_quant_roads_int4_and_int2() -> None:
    s = sheet("kv-quant-roads")
    # int4: qmax 7; per-token step r a / 7 with r = 10: RMS 10 / (7 sqrt 12) = 0.4124
    assert val(s, "K per-token: error of a normal channel") == pytest.approx(
        10 / (7 * math.sqrt(12)))
    assert val(s, "K per-channel: error of a normal channel") == pytest.approx(
        1 / (7 * math.sqrt(12)))
    # block 16 x 128 x 4 / 8 = 1,024 B; per-token scales 16 x 4 = 64 B (6.25%); per-channel
    # 128 x 4 = 512 B (50%): a 16-token block is too short a group for channel scales
    assert val(s, "per-channel scales (K) per block") == 512
    assert val(s, "per-token scales (V) per block") == 64
    # tail: 32 layers x 8 heads x 15 tokens x 128 x 2 B = 983,040 B
    assert val(s, "full-precision tail per sequence (K)") == 983_040
    t = sheet("kv-quant-roads", "--model", "Llama-3.3-70B", "--kv-bits", "2",
              "--block-size", "128")
    # int2 qmax 1; 128 x 128 x 2 / 8 = 4,096 B; channel scales 512 B = 12.5%
    assert val(t, "block data per KV head") == 4096
    assert val(t, "K per-channel: error of a normal channel") == pytest.approx(1 / math.sqrt(12))
    assert val(t, "full-precision tail per sequence (K)") == 80 * 8 * 127 * 128 * 2


@pytest.mark.parametrize(("argv", "needle"), [
    (("gqa-packing", "--q-len", "0"), "--q-len must be in [1, 1024], got 0"),
    (("kv-quant-roads", "--kv-bits", "9"), "--kv-bits must be in [2, 8], got 9"),
    (("kv-quant-roads", "--outlier-ratio", "0"), "--outlier-ratio must be > 0"),
    (("paged-indirection", "--block-size", "0"), "--block-size must be in [1, 65536], got 0"),
    (("qat-fleet", "--traffic", "-5"), "--traffic must be > 0"),
    (("qat-fleet", "--model", "Mistral-7B-v0.1"), "no published pretraining token count"),
    (("qat-fleet", "--batch", "4096", "--context", "128k"), "does not fit 8 x h100"),
    (("bf16-sum", "--threshold", "2"), "--threshold must be > 0 and <= 1"),
    (("gemv-coalescing", "--gpu", "h100"), "--gpu does not apply to gemv-coalescing"),
    (("fa-l2-reuse", "--gpu", "h1000"), "unknown GPU"),
])
def test_bad_input_exit_2(capsys: pytest.CaptureFixture[str], argv: tuple[str, ...],
                          needle: str) -> None:
    from fitserve.tools.sheets.sheet import run_tool

    assert run_tool("explain", list(argv)) == 2
    assert needle in capsys.readouterr().err
