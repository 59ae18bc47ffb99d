"""W1 decode speed with a quantized KV cache against bf16 KV, by context length (default model).

    .venv/bin/python benchmarks/bench_kv_quant.py
    .venv/bin/python benchmarks/bench_kv_quant.py --contexts 128,1024,4096,8192 --rounds 3

One request of a ``ctx - new``-token prompt (random token ids, fixed seed) then ``--new`` greedy
tokens (so the context grows to ``ctx``, as in bench_long_context.py, and 8192 fits a model
trained on 8192 positions), EOS ignored, on the default model's GGUF as stored (Q4_1) with bf16 activations. The
KV configs: bf16 (dense), int8 (its auto scales: per-channel keys), int8-token, fp8_e4m3 and
fp8_e5m2 (per token), and int8-dequant: int8 through the old path (each layer dequantizes the
blocks it reads into a compact bf16 cache before the dense kernel), for reference. Each config
runs in its own process; --rounds repeats the whole set round-robin so the shared host's slow
periods fall on all alike. Per context: one warm-up request (it also fills the prefix cache, so
the timed runs re-prefill only the prompt's last partial block), then --runs timed requests;
decode tok/s = (new - 1) / (last token time - first token time). Prints medians over all
rounds and each config's ratio to bf16 at each context.

--kernel times the attention op alone instead (no model, no cache write): one layer's decode
attention of the default model's shape (3 KV heads x 3 query heads each x 64 dims, 16-token
blocks in shuffled order) at each context, the dense bf16 kernel against the quantized one per
codec and scale layout, each of --layers layers on its own cache (so they exceed the last-level
cache as the model's do), configs alternating, median of --runs passes; ratios to bf16.
--interleave builds every config's engine in one process and alternates their requests
(medians of --runs rounds; fairer than a process per config on a loaded host).
--split times one layer's two cache ops per config (the KV write: rotation + the new token's
codes and scales; the attention), one thread's CPU time. --clock cpu times the thread's CPU
seconds, --ordered keeps blocks in pool order, --hugepages
puts every cache in 2 MiB transparent huge pages (madvise; shuffled blocks then cost no TLB miss
each). Per config it also prints ns per key per KV head and the GB/s of KV (codes + scales) read,
beside a plain read (torch sum) of the same bytes in as many buffers, at the same thread count.
"""

from __future__ import annotations

import argparse
import functools
import json
import mmap
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
# name -> (--kv-cache-dtype, --kv-cache-scales, read the codes in place)
CONFIGS: dict[str, tuple[str, str, bool]] = {
    "bf16": ("auto", "auto", True),
    "int8": ("int8", "auto", True),
    "int8-token": ("int8", "token", True),
    "fp8_e4m3": ("fp8_e4m3", "auto", True),
    "fp8_e5m2": ("fp8_e5m2", "auto", True),
    "int8-dequant": ("int8", "auto", False),
}


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from fitserve.config import EngineConfig
    from fitserve.engine.core import Engine
    from fitserve.sampling import SamplingParams

    torch.set_num_threads(spec["threads"])
    # NOTE: --clock cpu times the process's CPU seconds: on a loaded shared host that is what a
    # step costs, not when the scheduler let it run (use --threads 1: idle workers spin)
    clock = time.process_time if spec.get("clock") == "cpu" else time.perf_counter
    kv_dtype, scales, in_place = CONFIGS[spec["config"]]
    contexts: list[int] = spec["contexts"]
    new = spec["new"]
    engine = Engine(EngineConfig(model=spec["gguf"], dtype="bfloat16", weights="as-stored",
                                 device="cpu", max_model_len=max(contexts),
                                 enforce_eager=True, kv_cache_dtype=kv_dtype,  # type: ignore[arg-type]
                                 kv_cache_scales=scales))  # type: ignore[arg-type]
    runner = engine.runner
    if not in_place:
        runner.use_kvq = False  # the old path: dequantize the step's blocks, then the dense kernel
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    out: dict[str, list[float]] = {}
    for ctx in contexts:
        if ctx <= new:
            raise SystemExit(f"--contexts {ctx}: not longer than --new {new} tokens")
        prompt = torch.randint(100, 40000, (ctx - new,), generator=gen).tolist()

        def run(prompt: list[int] = prompt) -> float:
            times = []
            for o in engine.stream(prompt, params):
                times += [clock()] * len(o.delta_token_ids)
            return (new - 1) / (times[-1] - times[0])

        run()
        out[str(ctx)] = [run() for _ in range(spec["runs"])]
    backend = runner._decode_batch([[0]], [1], None, runner.use_kvq).backend.name
    loop = runner.decode_loop  # which decode path the steps took: the C++ step, the flat loop
    path = ("modules" if loop is None or loop.calls == 0 else
            f"decode loop, C++ step {loop.native_calls}/{loop.calls}")
    return {"config": spec["config"], "tok_s": out, "decode_backend": f"{backend} ({path})",
            "kv_format": runner.kv_format}


def interleaved(spec: dict[str, Any], configs: list[str]) -> None:
    """Every config's engine in this one process, requests alternating config by config
    (--runs rounds per context), so a loaded host's slow periods fall on all alike; prints
    medians and ratios to the first config."""
    import torch

    from fitserve.config import EngineConfig
    from fitserve.engine.core import Engine
    from fitserve.sampling import SamplingParams

    torch.set_num_threads(spec["threads"])
    clock = time.thread_time if spec["clock"] == "cpu" else time.perf_counter
    engines = {c: Engine(EngineConfig(
        model=spec["gguf"], dtype="bfloat16", weights="as-stored", device="cpu",
        max_model_len=max(spec["contexts"]), enforce_eager=True,
        kv_cache_dtype=CONFIGS[c][0], kv_cache_scales=CONFIGS[c][1]))  # type: ignore[arg-type]
        for c in configs}
    new = spec["new"]
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    for ctx in spec["contexts"]:
        prompt = torch.randint(100, 40000, (ctx - new,), generator=gen).tolist()

        def run(engine: Engine, prompt: list[int] = prompt) -> float:
            times: list[float] = []
            for o in engine.stream(prompt, params):
                times += [clock()] * len(o.delta_token_ids)
            return (new - 1) / (times[-1] - times[0])

        for engine in engines.values():  # warm-up (and the prefix cache)
            run(engine)
        res: dict[str, list[float]] = {c: [] for c in configs}
        for _ in range(spec["runs"]):
            for c, engine in engines.items():
                res[c].append(run(engine))
        first = statistics.median(res[configs[0]])
        for c in configs:
            med = statistics.median(res[c])
            print(f"context {ctx:5d} {c:13s} {med:7.1f} tok/s  x {configs[0]} {med / first:5.2f}  "
                  f"runs {' '.join(f'{x:.1f}' for x in res[c])}")


def _us_per_layer(calls: list[Callable[[], object]], clock: Callable[[], float]) -> float:
    """The time of 10 passes over every layer's call, per call (us)."""
    t0 = clock()
    for _ in range(10):
        for call in calls:
            call()
    return (clock() - t0) / (10 * len(calls)) * 1e6


def _huge(t: Any) -> Any:
    """A copy of tensor ``t`` in anonymous memory advised MADV_HUGEPAGE before its first touch."""
    import torch

    size = t.numel() * t.element_size()
    buf = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.madvise(mmap.MADV_HUGEPAGE)
    out = torch.frombuffer(buf, dtype=torch.uint8, count=size).view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


def _kv_bytes(ctx: int, batch: int, codec: str, layout: str) -> int:
    """Bytes of K/V (codes + the scales they use) one layer's call reads."""
    hkv, d, bs = 3, 64, 16
    keys = batch * ctx * hkv
    if not codec:
        return keys * d * 2 * 2
    k_scales = keys // bs * d * 4 if layout == "channel-key" else keys * 4
    return keys * d * 2 + k_scales + keys * 4


def _layer_calls(ctx: int, batch: int, layers: int, codec: str, layout: str, ordered: bool,
                 huge: bool = False) -> list[Callable[[], object]]:
    """One decode attention call per layer over its own cache (the default model's shape:
    3 KV heads x 3 query heads each x 64 dims, 16-token blocks in shuffled order), so the
    caches together exceed the last-level cache as the model's do; codec "" = dense bf16."""
    import torch

    place = _huge if huge else (lambda t: t)

    from fitserve.kernels.cpu.paged_attention import paged_decode_attention
    from fitserve.kernels.cpu.paged_attention_kvq import paged_decode_attention_kvq
    from fitserve.quant.kv_cache import QuantizedKVCache

    hkv, g, d, bs = 3, 3, 64, 16
    nb = batch * -(-ctx // bs)
    gen = torch.Generator().manual_seed(0)
    order = torch.arange(nb) if ordered else torch.randperm(nb, generator=gen)
    tables = order.to(torch.int32).view(batch, -1)
    lens = torch.full((batch,), ctx, dtype=torch.int32)
    q = torch.randn(batch, hkv * g, d, generator=gen).bfloat16()
    calls: list[Callable[[], object]] = []
    for _ in range(layers):
        k, v = torch.randn(nb * bs, hkv, d, generator=gen), torch.randn(nb * bs, hkv, d, generator=gen)
        if not codec:
            kd = k.bfloat16().view(nb, bs, hkv, d).permute(2, 0, 1, 3).contiguous()
            vd = v.bfloat16().view(nb, bs, hkv, d).permute(2, 0, 1, 3).contiguous()
            calls.append(functools.partial(paged_decode_attention, q, place(kd), place(vd), tables,
                                           lens, 0.125))
            continue
        kv = QuantizedKVCache(codec, layout, num_kv_heads=hkv, num_blocks=nb, block_size=bs,
                              head_dim=d)
        kv.write(k, v, torch.arange(nb * bs))
        calls.append(functools.partial(
            paged_decode_attention_kvq, q, place(kv.k_codes), place(kv.v_codes),
            place(kv.k_scales), place(kv.v_scales), tables, lens, 0.125, codec=codec,
            channel_keys=layout == "channel-key"))
    return calls


def _plain_reads(nbytes: int, layers: int, huge: bool) -> list[Callable[[], object]]:
    """A torch sum over ``nbytes`` per layer (fp32, contiguous): the plain read of those bytes."""
    import torch

    bufs = [torch.randn(nbytes // 4) for _ in range(layers)]
    return [functools.partial(torch.sum, _huge(b) if huge else b) for b in bufs]


def kernel_bench(contexts: list[int], runs: int, batch: int, layers: int, clock: str,
                 ordered: bool, huge: bool = False) -> None:
    """The attention op alone, per layer: us, ns per key per KV head and GB/s of KV read for
    dense bf16 and each quantized config, a plain read of bf16's bytes, then bf16 time /
    quantized time. The configs alternate pass by pass (``runs`` rounds, medians), so a loaded
    host's slow periods fall on all alike."""
    timer = time.thread_time if clock == "cpu" else time.perf_counter
    codecs = ("int8", "fp8_e4m3", "fp8_e5m2")
    for ctx in contexts:
        keys = batch * ctx * 3
        sets = {("", ""): _layer_calls(ctx, batch, layers, "", "", ordered, huge),
                ("read", ""): _plain_reads(_kv_bytes(ctx, batch, "", ""), layers, huge)}
        for layout in ("token", "channel-key"):
            for c in codecs:
                sets[(c, layout)] = _layer_calls(ctx, batch, layers, c, layout, ordered, huge)
        for calls in sets.values():  # warm-up
            _us_per_layer(calls, timer)
        times: dict[tuple[str, str], list[float]] = {k: [] for k in sets}
        for _ in range(runs):
            for key, calls in sets.items():
                times[key].append(_us_per_layer(calls, timer))
        med = {k: statistics.median(v) for k, v in times.items()}
        dense = med[("", "")]
        print(f"context {ctx}: {'config':>22} {'us/layer':>9} {'ns/key/kvh':>10} {'GB/s':>6} "
              f"{'x bf16':>7}")
        for (c, layout), us in med.items():
            name = {"": "bf16 (dense)", "read": "plain read (bf16 bytes)"}.get(c, f"{c} {layout}")
            nbytes = _kv_bytes(ctx, batch, "" if c == "read" else c, layout)
            print(f"{'':>12} {name:>22} {us:9.1f} {us * 1e3 / keys:10.2f} "
                  f"{nbytes / us / 1e3:6.2f} {dense / us:6.2f}x")


def split_bench(contexts: list[int], runs: int, layers: int, ordered: bool) -> None:
    """One W1 layer's two cache ops, per config: the KV write (rope_write_kv_ or
    rope_write_kvq_: rotation + the new token's codes and scales) and the decode attention, in
    us per call of one thread's CPU time (through the Python op call: each includes ~1-2 us
    of argument handling the engine's C++ step does not pay), configs alternating, medians."""
    import torch

    from fitserve.kernels.cpu.fused import fused_ops_available
    from fitserve.kernels.cpu.paged_attention_kvq import CODEC_IDS, kvq_write_available

    fused_ops_available()
    kvq_write_available()
    hkv, g, d, bs = 3, 3, 64, 16
    gen = torch.Generator().manual_seed(0)
    angle = torch.rand(max(contexts), d // 2, generator=gen) * 6.28  # unit rotations: the
    cos, sin = angle.cos(), angle.sin()  # repeatedly rotated q/k stay finite
    configs = [("", ""), ("int8", "channel-key"), ("int8", "token"), ("fp8_e4m3", "token"),
               ("fp8_e5m2", "token")]
    for ctx in contexts:
        order = torch.arange(-(-ctx // bs)) if ordered else torch.randperm(-(-ctx // bs), generator=gen)
        last = int(order[(ctx - 1) // bs]) * bs + (ctx - 1) % bs
        pos, slot = torch.tensor([ctx - 1]), torch.tensor([last])
        ops: dict[tuple[str, str], tuple[list[Callable[[], object]], list[Callable[[], object]]]] = {}
        for codec, layout in configs:
            attn = _layer_calls(ctx, 1, layers, codec, layout, ordered)
            writes: list[Callable[[], object]] = []
            for call in attn:
                qk, v = torch.randn(1, hkv * (g + 1), d).bfloat16(), torch.randn(1, hkv, d).bfloat16()
                caches = call.args[1:3] if not codec else call.args[1:5]  # type: ignore[attr-defined]
                if not codec:
                    writes.append(functools.partial(torch.ops.fitserve_fused.rope_write_kv_, qk, v,
                                                    pos, cos, sin, *caches, slot, hkv * g, False))
                else:
                    writes.append(functools.partial(
                        torch.ops.fitserve.rope_write_kvq_, qk, v, pos, cos, sin, *caches, slot,
                        hkv * g, False, CODEC_IDS[codec], layout == "channel-key"))
            ops[(codec, layout)] = (writes, attn)
        times: dict[tuple[str, str], tuple[list[float], list[float]]] = {k: ([], []) for k in ops}
        for _ in range(runs + 1):  # the first pass warms up
            for key, (writes, attn) in ops.items():
                times[key][0].append(_us_per_layer(writes, time.thread_time))
                times[key][1].append(_us_per_layer(attn, time.thread_time))
        med = {k: (statistics.median(w[1:]), statistics.median(a[1:])) for k, (w, a) in times.items()}
        bw, ba = med[("", "")]
        print(f"context {ctx} ({'in order' if ordered else 'shuffled'}): us per layer call")
        for (codec, layout), (w, a) in med.items():
            name = f"{codec} {layout}" if codec else "bf16 (dense)"
            print(f"  {name:22s} write {w:7.2f}  attention {a:8.2f}  sum {w + a:8.2f}  "
                  f"x bf16: sum {(bw + ba) / (w + a):5.2f}  attention {ba / a:5.2f}")


def torch_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--contexts", default="128,1024,2048,4096,8192")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="wall: seconds elapsed; cpu: the worker's CPU seconds (loaded hosts)")
    ap.add_argument("--kernel", action="store_true", help="time the attention op alone")
    ap.add_argument("--batch", type=int, default=1, help="sequences per call (--kernel)")
    ap.add_argument("--layers", type=int, default=30, help="caches cycled through (--kernel)")
    ap.add_argument("--ordered", action="store_true",
                    help="blocks in pool order, as one request's fresh pool gives (--kernel)")
    ap.add_argument("--hugepages", action="store_true",
                    help="caches in 2 MiB transparent huge pages (--kernel)")
    ap.add_argument("--interleave", action="store_true",
                    help="all configs' engines in one process, requests alternating")
    ap.add_argument("--split", action="store_true",
                    help="one layer's KV write and attention per config, 1 thread CPU time")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("spec", nargs="?", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.spec))))
        return
    sys.path.insert(0, str(HERE.parent))
    from fitserve.kernels.cpu.isa import cpu_model_name, detect_isa
    from fitserve.loading.pull import pull

    contexts = [int(c) for c in args.contexts.split(",")]
    if args.split:
        print(f"CPU: {cpu_model_name()}; ISA: {detect_isa().describe()}; 1 thread, CPU clock; "
              f"load average {os.getloadavg()}")
        torch_threads(1)
        split_bench(contexts, args.runs, args.layers, args.ordered)
        return
    if args.kernel:
        print(f"CPU: {cpu_model_name()}; {os.cpu_count()} CPUs; ISA: {detect_isa().describe()}; "
              f"threads {args.threads}; batch {args.batch}; {args.clock} clock; blocks "
              f"{'in order' if args.ordered else 'shuffled'}"
              f"{', huge pages' if args.hugepages else ''}; load average {os.getloadavg()}; "
              "kernel time ratio bf16 / quantized")
        torch_threads(args.threads)
        kernel_bench(contexts, args.runs, args.batch, args.layers, args.clock, args.ordered,
                     args.hugepages)
        return
    configs = args.configs.split(",")
    base = {"gguf": str(pull("smollm2-135m", progress=False)), "contexts": contexts,
            "new": args.new, "runs": args.runs, "threads": args.threads, "clock": args.clock}
    if args.interleave:
        print(f"CPU: {cpu_model_name()}; ISA: {detect_isa().describe()}; threads {args.threads}; "
              f"W1 decode tok/s ({args.clock} clock), {args.new} new tokens, one process, "
              f"{args.runs} rounds; load average {os.getloadavg()}")
        interleaved(base, configs)
        return
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
    runs: dict[str, dict[str, list[float]]] = {c: {str(x): [] for x in contexts} for c in configs}
    info: dict[str, str] = {}
    for _ in range(args.rounds):
        for cfg in configs:
            proc = subprocess.run([sys.executable, __file__, "--worker",
                                   json.dumps({**base, "config": cfg})],
                                  capture_output=True, text=True, env=env, check=True)
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            info[cfg] = f"{r['kv_format']} via {r['decode_backend']}"
            for ctx, vals in r["tok_s"].items():
                runs[cfg][ctx] += vals
    print(f"CPU: {cpu_model_name()}; {os.cpu_count()} CPUs; ISA: {detect_isa().describe()}; "
          f"threads {args.threads}")
    print(f"W1 decode tok/s ({args.clock} clock), medians of {args.rounds} x {args.runs} runs, "
          f"{args.new} new tokens; load average {os.getloadavg()}")
    for cfg in configs:
        print(f"  {cfg:13s} {info[cfg]}")
    print(f"{'context':>8} " + " ".join(f"{c:>13s}" for c in configs))
    for ctx in map(str, contexts):
        med = {c: statistics.median(runs[c][ctx]) for c in configs}
        print(f"{ctx:>8} " + " ".join(f"{med[c]:13.1f}" for c in configs))
        if "bf16" in med:
            print(f"{'x bf16':>8} " + " ".join(f"{med[c] / med['bf16']:13.2f}" for c in configs))


if __name__ == "__main__":
    main()
