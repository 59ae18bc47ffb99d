"""Prebuild the lower-tier C++ kernels that the tier-subprocess tests compile.

``python -m tests.tier_builds`` builds, into $FITSERVE_HOME's cache, each extension that a
``run_tests_at_tier`` subprocess (tests/conftest.py) loads at a tier below this CPU's own, one
``python -m fitserve.kernels.cpu.build`` per tier (FITSERVE_CPU_TIER set as the subprocess sets
it, so the build keys are the same). ``make test`` runs it beside lint and the model's download,
which leave a core free, instead of inside pytest, where both workers keep both cores busy.

NOTE: only a speed-up: an extension missing here is compiled by the test that loads it (as
without this script), and a build that fails here fails (or falls back) there as before.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from fitserve.kernels.cpu.isa import TIERS, detect_isa

TIER_TEST_EXTENSIONS: dict[str, tuple[str, ...]] = {
    "scalar": ("qlinear", "ggml_blocks", "moe_experts", "fp8_gemv", "dense_gemv", "kvq_write",
               "paged_attention_kvq", "fused_ops"),
    "avx2": ("qlinear", "ggml_blocks", "moe_experts", "fp8_gemv", "dense_gemv", "kvq_write",
             "paged_attention", "paged_attention_kvq", "fused_ops"),
    "avx512": ("qlinear", "ggml_blocks", "moe_experts", "fp8_gemv", "dense_gemv",
               "paged_attention"),
}
"""Per tier, the extensions its tier-subprocess tests load (the ``tier`` parameters of each
``test_lower_tier*`` in tests/kernels)."""


def tiers_to_build() -> list[str]:
    """The tiers below this CPU's own (the ones ``run_tests_at_tier`` does not skip)."""
    own = TIERS.index(detect_isa().tier)
    return [t for t in TIER_TEST_EXTENSIONS if TIERS.index(t) < own]


def main() -> int:
    """Build each lower tier's extensions, one tier after another (each build runs its
    extensions side by side); print the time; exit 0 even where a build failed (see NOTE)."""
    t0 = time.perf_counter()
    tiers = tiers_to_build()
    for tier in tiers:
        subprocess.run([sys.executable, "-m", "fitserve.kernels.cpu.build",
                        *TIER_TEST_EXTENSIONS[tier]],
                       env={**os.environ, "FITSERVE_CPU_TIER": tier}, check=False)
    print(f"tier-subprocess test kernels ready for {', '.join(tiers) or 'no lower tier'}: "
          f"{time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
