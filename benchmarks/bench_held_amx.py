"""AMX-INT8 tiles vs the AVX-512 VNNI panels on the same held int4 / int8 weight (issue 43.1).

    PYTHONPATH=$PWD python benchmarks/bench_held_amx.py [--ms 8,12,16,32,128,512]

One thread, timed by its CPU clock (time.thread_time); SmolLM2-135M's gate/up (N 3072, K 576)
and down (N 576, K 1536) shapes, 32-column groups, random codes, x bf16. For each M the two
paths alternate three times in this one process (qlinear.set_amx), the best of each kept; the
ratio is AMX time / VNNI time. Needs a CPU with AMX-INT8 (else it says so and exits 0). The
bits of the two are checked equal by tests/kernels/test_qlinear_held.py.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_engine import cpu_description  # noqa: E402

from fitserve.kernels.cpu.qlinear import amx_active, hold, int4_linear, int8_linear, set_amx  # noqa: E402
from tests.kernels.test_qlinear_cpp import make_int4, make_int8  # noqa: E402

SHAPES = (("gate_up", 3072, 576), ("down", 576, 1536))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="8,12,16,32,128,512")
    args = ap.parse_args()
    print(f"CPU: {cpu_description()}")
    if not amx_active():
        print("no AMX-INT8 tiles here (or FITSERVE_AMX=0): nothing to compare")
        return
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    for bits in (4, 8):
        for name, n, k in SHAPES:
            if bits == 4:
                q, s, m, _ = make_int4(n, k, 32, True, gen)
            else:
                q, s, _, _ = make_int8(n, k, 32, gen)
                m = None
            hq, hs, hm = hold(q, s, m, 32)
            for rows in (int(v) for v in args.ms.split(",")):
                x = torch.randn(rows, k).bfloat16()
                call = (functools.partial(int4_linear, x, hq, hs, hm, 32, True) if bits == 4
                        else functools.partial(int8_linear, x, hq, hs, 32, True))
                best: dict[bool, float] = {}
                for on in (False, True) * 3:
                    set_amx(on)
                    call()
                    call()
                    reps = max(3, int(3e9 / (n * k * rows)))
                    t = time.thread_time()
                    for _ in range(reps):
                        call()
                    best[on] = min(best.get(on, float("inf")), (time.thread_time() - t) / reps)
                set_amx(True)
                gmac = n * k * rows / 1e9
                print(f"int{bits} {name:8s} M={rows:4d}  vnni {best[False] * 1e6:8.1f} us "
                      f"({gmac / best[False]:4.0f} GMAC/s)  amx {best[True] * 1e6:8.1f} us "
                      f"({gmac / best[True]:4.0f})  amx/vnni {best[True] / best[False]:.2f}",
                      flush=True)


if __name__ == "__main__":
    main()
