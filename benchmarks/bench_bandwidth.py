"""The two memory limits the benchmarks divide by, at several buffer sizes and thread counts.

    .venv/bin/python benchmarks/bench_bandwidth.py [--sizes-mib 256,512,1024] [--rounds 2]

``copy`` is ``cpu_measure.measure_copy_bandwidth`` (read + write bytes counted; the planner's
figure and the benchmarks' "of limit" at 256 MiB), ``read`` is ``measure_read_bandwidth`` (a
plain parallel sum; the benchmarks' "of read"), each the median of its undisturbed runs, at each
size on 1 and 2 threads. Also prints glibc's memcpy non-temporal threshold (``ld.so
--list-tunables``): below it per thread, a copy uses ordinary stores, whose read-for-ownership
moves more bytes than the copy figure counts.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_engine import cpu_description  # noqa: E402

from fitserve.ledger.cpu_measure import measure_copy_bandwidth, measure_read_bandwidth  # noqa: E402


def nt_threshold() -> str:
    """glibc's x86_non_temporal_threshold, or why it is not known."""
    for ld in ("/lib64/ld-linux-x86-64.so.2", "/lib/ld-linux-x86-64.so.2"):
        if Path(ld).exists():
            out = subprocess.run([ld, "--list-tunables"], capture_output=True, text=True,
                                 check=False).stdout
            for line in out.splitlines():
                if "x86_non_temporal_threshold" in line:
                    value = int(line.split(":")[1].split()[0], 16)
                    return f"{value / 2**20:.1f} MiB"
    return "unknown (no ld.so --list-tunables)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes-mib", default="256,512,1024")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    print(f"CPU: {cpu_description()}\nglibc memcpy non-temporal threshold: {nt_threshold()}")
    print(f"{'round':>5} {'MiB':>6} {'threads':>7} {'copy GB/s':>10} {'read GB/s':>10}")
    for r in range(args.rounds):
        for mib in (int(v) for v in args.sizes_mib.split(",")):
            for threads in (1, 2):
                copy = measure_copy_bandwidth(mib << 20, threads=threads)
                read = measure_read_bandwidth(mib << 20, threads=threads)
                print(f"{r + 1:>5} {mib:>6} {threads:>7} {copy / 1e9:10.1f} {read / 1e9:10.1f}",
                      flush=True)


if __name__ == "__main__":
    main()
