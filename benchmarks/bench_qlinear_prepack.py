"""The M > 1 weight layout made once at load vs panels packed per call (issue 43 item 1, 3).

For the default model's shapes (SmolLM2-135M: qkv 960x576, o 576x576, gate_up 3072x576,
down 576x1536), int4 (Q4_1 layout) and int8 (Q8_0) weights, bf16 x with int8 activations
(act_quant, the default path), M rows: the same weight called alternately through a copy that
was never prepacked (panels packed per call) and one prepacked with ``qlinear.prepack`` (what
the loader does), each side's minimum over rounds of one-thread CPU time per call
(``time.thread_time``: a loaded host's waits do not count). Both sides give the same bits.
Also the same-run peak: the int8 and int4 kernels on M = 2048 rows x 2048 x 2048, prepacked.

    python benchmarks/bench_qlinear_prepack.py [--ms 8,64,512,2048] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch

from fitserve.kernels.cpu.isa import cpu_model_name, detect_isa
from fitserve.kernels.cpu.qlinear import (
    int4_linear,
    int8_linear,
    prepack,
    qlinear_ops_available,
    qlinear_tier,
)

SHAPES = [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536)]


def cpu_seconds(fn: Callable[[], object], reps: int) -> float:
    """Minimum one-thread CPU seconds of fn() over reps calls."""
    best = float("inf")
    for _ in range(reps):
        t0 = time.thread_time()
        fn()
        best = min(best, time.thread_time() - t0)
    return best


def weight(kind: str, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(n * 7 + k)
    sc = (torch.rand(n, k // 32, generator=gen) * 0.01 + 0.001).half()
    if kind == "int4":
        q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
        return q, sc, (-8 * sc.float()).half()
    return torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen), sc, None


def caller(kind: str, t: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]
           ) -> Callable[[torch.Tensor], torch.Tensor]:
    q, sc, mn = t
    if kind == "int4":
        return lambda x: int4_linear(x, q, sc, mn, 32, True)
    return lambda x: int8_linear(x, q, sc, 32, True)


def ab(kind: str, n: int, k: int, m: int, rounds: int) -> tuple[float, float]:
    """(seconds packed per call, seconds prepacked), alternating the two `rounds` times."""
    plain = weight(kind, n, k)
    packed = tuple(None if t is None else t.clone() for t in plain)
    blob = prepack(*packed, 32)  # noqa: F841  (held: the registration lives as long as it)
    x = torch.randn(m, k).to(torch.bfloat16)
    f_plain, f_packed = caller(kind, plain), caller(kind, packed)  # type: ignore[arg-type]
    if not torch.equal(f_plain(x), f_packed(x)):
        raise AssertionError(f"{kind} {n}x{k} M={m}: prepacked and per-call results differ")
    reps = max(2, min(50, 4000 // m))
    a = b = float("inf")
    for _ in range(rounds):
        a = min(a, cpu_seconds(lambda: f_plain(x), reps))
        b = min(b, cpu_seconds(lambda: f_packed(x), reps))
    return a, b


def peak(kind: str, rounds: int) -> float:
    """FLOP/s (one thread) of M = 2048 x 2048 x 2048, prepacked."""
    t = weight(kind, 2048, 2048)
    blob = prepack(*t, 32)  # noqa: F841
    x = torch.randn(2048, 2048).to(torch.bfloat16)
    f = caller(kind, t)
    f(x)
    return 2.0 * 2048**3 / min(cpu_seconds(lambda: f(x), 2) for _ in range(rounds))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ms", default="8,64,512,2048")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if not qlinear_ops_available():
        raise SystemExit("the qlinear C++ ops are unavailable")
    torch.set_num_threads(1)
    isa = detect_isa()
    print(f"CPU: {cpu_model_name()}; tier {qlinear_tier()}; amx_int8 {isa.amx_int8}; "
          f"load average {os.getloadavg()}; one thread, CPU time, min of {args.rounds} rounds")
    peaks = {kind: peak(kind, args.rounds) for kind in ("int8", "int4")}
    print("same-run peak (M = 2048 x 2048 x 2048, prepacked): " +
          ", ".join(f"{k} {v / 1e9:.0f} GFLOP/s" for k, v in peaks.items()))
    print(f"{'kind':<5}{'shape':<9}{'M':>6}{'per call us':>13}{'prepacked us':>14}{'speed-up':>10}"
          f"{'GFLOP/s':>9}{'of peak':>9}")
    for kind in ("int4", "int8"):
        for name, n, k in SHAPES:
            for m in (int(v) for v in args.ms.split(",")):
                a, b = ab(kind, n, k, m, args.rounds)
                gf = 2.0 * m * n * k / b
                print(f"{kind:<5}{name:<9}{m:>6}{a * 1e6:>13.1f}{b * 1e6:>14.1f}{a / b:>9.2f}x"
                      f"{gf / 1e9:>9.0f}{gf / peaks[kind]:>9.0%}", flush=True)
    print(f"load average at the end {os.getloadavg()}")


if __name__ == "__main__":
    main()
