"""Every GGUF weight type as stored: fitserve vs llama.cpp on the same file, W1 (and W2).

    .venv/bin/python benchmarks/bench_formats.py                                   # default model
    .venv/bin/python benchmarks/bench_formats.py --shape 1.7b --types Q4_K_M,Q8_0 --w2
    .venv/bin/python benchmarks/bench_formats.py --types Q4_K_M --peers llamacpp,transformers
    .venv/bin/python benchmarks/bench_formats.py --shape 1.7b --types IQ4_XS --w2 --runs 1 --rounds 3

The files are made here, never committed: an F16 GGUF first (``--shape default``: the default
model's own weights, dequantized from its Q4_1 file; ``--shape 1.7b``: random weights of
SmolLM2-1.7B's shape, with the default model's tokenizer metadata), then each type with
llama.cpp's own quantizer (``llama_model_quantize`` in the llama.cpp peer's venv, see
../shared/PEERS.md). They are cached under FITSERVE_HOME/bench.

Each engine runs in its own process (bench_engine.py's workers: same token ids, threads, greedy,
EOS ignored, one warm-up, medians of --runs). Per type the table prints the file's size,
fitserve's held weight bytes and peak RSS, W1 decode tok/s for both engines, their ratio and
fitserve's fraction of its bandwidth limit (weight bytes read per token over the copy
bandwidth, the higher of those measured just before and after its worker) and of its read limit
(the same bytes over a plain parallel read's bandwidth, measured the same way: the issue's
"measured read bandwidth"), and
with --w2 the W2 (32 x 128 + 128) rates. With --rounds R the two engines' workers alternate R
times per type: the rates pool every round's runs, the limit is the median of the rounds' own,
and each round's paired ratios (fitserve / llama.cpp, run minutes apart) and their median are
printed -- on this shared host one worker's minute can be 20% slower than the next.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_engine as be  # noqa: E402  (the workers and their orchestration)

T = TypeVar("T")

# SmolLM2-1.7B's shape (config.json of HuggingFaceTB/SmolLM2-1.7B-Instruct)
SHAPE_17B = {"block_count": 24, "embedding_length": 2048, "feed_forward_length": 8192,
             "attention.head_count": 32, "attention.head_count_kv": 32,
             "context_length": 8192, "rope.freq_base": 130000.0}
QUANTIZER = """
import sys, llama_cpp as L
p = L.llama_model_quantize_default_params()
p.nthread = int(sys.argv[4])
p.ftype = getattr(L, "LLAMA_FTYPE_MOSTLY_" + sys.argv[3])
sys.exit(L.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p))
"""


def _copy_fields(reader: Any, writer: Any, override: dict[str, Any]) -> None:
    """Every metadata key of ``reader`` (but the file type and those in ``override``) into
    ``writer``, with its own value type."""
    import gguf

    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type") \
                or name in override:
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub)


def write_f16(default_gguf: Path, out: Path, shape: str) -> Path:
    """The F16 source file of ``shape`` (see the module docstring)."""
    if out.is_file():
        return out
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(str(default_gguf))
    arch = "llama"
    over = {f"{arch}.{k}": v for k, v in SHAPE_17B.items()} if shape == "1.7b" else {}
    tmp = out.with_suffix(".part")
    w = gguf.GGUFWriter(str(tmp), arch)
    _copy_fields(reader, w, over)
    for key, value in over.items():
        if isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, value)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    rng = np.random.default_rng(0)
    if shape == "default":
        for t in reader.tensors:
            a = np.asarray(dequantize(t.data, t.tensor_type), np.float32).reshape(
                [int(d) for d in reversed(t.shape)])
            w.add_tensor(t.name, a.astype(np.float16) if a.ndim == 2 else a)
    else:
        s = SHAPE_17B
        h, ff, nl = s["embedding_length"], s["feed_forward_length"], s["block_count"]
        kv = h // s["attention.head_count"] * s["attention.head_count_kv"]
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
        shapes = {"token_embd.weight": (vocab, h), "output_norm.weight": (h,)}
        for i in range(nl):
            shapes |= {f"blk.{i}.attn_norm.weight": (h,), f"blk.{i}.ffn_norm.weight": (h,),
                       f"blk.{i}.attn_q.weight": (h, h), f"blk.{i}.attn_k.weight": (kv, h),
                       f"blk.{i}.attn_v.weight": (kv, h), f"blk.{i}.attn_output.weight": (h, h),
                       f"blk.{i}.ffn_gate.weight": (ff, h), f"blk.{i}.ffn_up.weight": (ff, h),
                       f"blk.{i}.ffn_down.weight": (h, ff)}
        for name, shp in shapes.items():
            if len(shp) == 1:
                w.add_tensor(name, np.ones(shp, np.float32))
            else:  # std 1/sqrt(fan_in): activations stay O(1) through 24 layers
                a = rng.standard_normal(shp, np.float32) / np.sqrt(shp[1])
                w.add_tensor(name, a.astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.rename(out)
    return out


def quantize(llamacpp_python: str, src: Path, qtype: str, threads: int) -> Path:
    out = src.with_name(src.name.replace("-f16.gguf", f"-{qtype.lower()}.gguf"))
    if not out.is_file():
        print(f"quantizing {src.name} -> {qtype} with llama.cpp ...", file=sys.stderr)
        subprocess.run([llamacpp_python, "-c", QUANTIZER, str(src), str(out) + ".part", qtype,
                        str(threads)], check=True, capture_output=True)
        Path(str(out) + ".part").rename(out)
    return out


def bandwidth_around(run: Callable[[], T]) -> tuple[float, T, tuple[float, float], float]:
    """Run ``run()`` between two copy-bandwidth (and read-bandwidth) measurements; the higher
    copy figure, its result, both copy figures and the higher read figure.

    NOTE: this VM's copy bandwidth moves between ~44 and ~78 GB/s from one minute to the next
    (quiet host), so one figure before a worker let a fraction of the limit read 130%; the
    higher of before and after gives the stricter limit, and both are printed."""
    from fitserve.ledger.cpu_measure import measure_copy_bandwidth, measure_read_bandwidth

    before, read_before = measure_copy_bandwidth(), measure_read_bandwidth()
    out = run()
    after, read_after = measure_copy_bandwidth(), measure_read_bandwidth()
    return max(before, after), out, (before, after), max(read_before, read_after)


def held_types(path: Path) -> str:
    """The file's tensor types by bytes, e.g. 'Q4_K 71%, Q6_K 24%, F32 0%'."""
    from fitserve.loading.gguf_spec import read_gguf_header

    by: dict[str, int] = {}
    for t in read_gguf_header(path).tensors:
        by[t.type_name] = by.get(t.type_name, 0) + t.n_bytes
    total = sum(by.values())
    return ", ".join(f"{k} {v / total:.0%}" for k, v in sorted(by.items(), key=lambda kv: -kv[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=["default", "1.7b"], default="default")
    ap.add_argument("--types", default="Q4_0,Q8_0,Q4_K_M,Q5_K_M,Q6_K,Q5_0,IQ4_XS",
                    help="llama.cpp ftype names (LLAMA_FTYPE_MOSTLY_<name>)")
    ap.add_argument("--peers", default="llamacpp")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1,
                    help="per type, fitserve then llama.cpp this many times alternated; rates "
                         "pool every round's runs, and each round's paired ratios and their "
                         "median are printed (a noisy host's slow minutes then fall on both)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--w2", action="store_true", help="also W2 (32 requests; slow on 1.7b)")
    ap.add_argument("--llamacpp-python", default=str(Path.home() / "peers/llamacpp/bin/python"))
    args = ap.parse_args()

    from fitserve.envs import fitserve_home

    if not Path(args.llamacpp_python).exists():
        sys.exit(f"needs llama.cpp's quantizer: no {args.llamacpp_python} (see ../shared/PEERS.md)")
    base = be.workload_spec(args.threads, args.runs, 32)
    if not args.w2:
        del base["w2_batch"]  # every worker then runs W1 only
    folder = fitserve_home() / "bench"
    folder.mkdir(parents=True, exist_ok=True)
    src = write_f16(Path(base["gguf"]), folder / f"formats-{args.shape}-f16.gguf", args.shape)
    me = [sys.executable, str(HERE / "bench_engine.py")]
    rows = []
    for qtype in filter(None, args.types.split(",")):
        path = quantize(args.llamacpp_python, src, qtype, args.threads)
        spec = {**base, "gguf": str(path), "config": "as-stored"}
        fss, peers, bwss, rbws = [], [], [], []
        for i in range(args.rounds):
            print(f"{qtype}: fitserve (round {i + 1} of {args.rounds}) ...", file=sys.stderr)
            _, fs_i, bws_i, rbw_i = bandwidth_around(lambda spec=spec: be.run_worker(
                [*me, "--worker", "fitserve"], spec))
            fss.append(fs_i)
            bwss.append(bws_i)
            rbws.append(rbw_i)
            if "llamacpp" in args.peers:
                print(f"{qtype}: llama.cpp (round {i + 1}) ...", file=sys.stderr)
                peers.append(be.run_worker(
                    [args.llamacpp_python, str(HERE / "peers/llamacpp_worker.py")], spec))
        # the limit: each round's higher copy figure, their median (the rates pool the rounds)
        bw = statistics.median(max(b) for b in bwss)
        bws = (statistics.median(b[0] for b in bwss), statistics.median(b[1] for b in bwss))
        rbw = statistics.median(rbws)
        fs = be.merge_rounds(fss) if any(fss) else None
        peer = be.merge_rounds(peers) if any(peers) else None
        tf = None
        if "transformers" in args.peers:
            tf = be.run_worker([*me, "--worker", "transformers"], spec)
        rows.append((qtype, path, bw, fs, peer, tf, bws, rbw))
    report(rows, args)


def rss_bound(path: Path, fs: dict[str, Any] | None) -> float:
    """Bytes peak RSS is held to: the file + the ledger's lines beside the weights (the
    engine's plan peak with the file's size in place of the held weights)."""
    if not fs or "ledger_step_bytes" not in fs:
        return float("nan")
    return float(path.stat().st_size + fs["ledger_runtime_bytes"] + fs["ledger_rope_bytes"]
                 + fs["ledger_kv_bytes"] + fs["ledger_step_bytes"])


def _rate(r: dict[str, Any] | None, w: str) -> float:
    return r[w]["tok_s"] if r and w in r else float("nan")


def report(rows: list[tuple[str, Path, float, Any, Any, Any, tuple[float, float], float]],
           args: argparse.Namespace) -> None:
    print(f"\nCPU: {be.cpu_description()}\nshape {args.shape}, threads={args.threads}, medians "
          f"of {args.runs} runs x {args.rounds} round(s); limit = weight bytes held / copy bandwidth (the higher of the "
          f"figures measured just before and just after fitserve's worker); of read = the same "
          f"bytes over a plain parallel read's bandwidth (measured alike)")
    print("RSS bound = file + the ledger's runtime baseline, RoPE tables, KV pool and step peak "
          "(activations, output staging, attention scratch, logits, sampler, allocator "
          "retention), as `fitserve plan` adds them up; target: peak RSS within 10% of it")
    print(f"{'type':<8}{'file MiB':>9}{'held MiB':>9}{'RSS MiB':>8}{'bound':>7}{'W1 fitserve':>12}"
          f"{'llama.cpp':>10}{'ratio':>7}{'of limit':>9}{'of read':>8}"
          + (f"{'W2 fitserve':>12}{'llama.cpp':>10}{'ratio':>7}" if args.w2 else "")
          + (f"{'W1 transformers':>16}" if "transformers" in args.peers else ""))
    for qtype, path, bw, fs, peer, tf, bws, rbw in rows:
        held = fs["weight_bytes_read"] if fs else float("nan")
        w1, p1 = _rate(fs, "W1"), _rate(peer, "W1")
        bound = rss_bound(path, fs) / 2**20
        line = (f"{qtype:<8}{path.stat().st_size / 2**20:9.0f}{held / 2**20:9.0f}"
                f"{fs['peak_rss_mib'] if fs else float('nan'):8.0f}{bound:7.0f}{w1:12.1f}{p1:10.1f}"
                f"{w1 / p1:7.2f}{w1 * held / bw:9.0%}{w1 * held / rbw:8.0%}")
        if args.w2:
            w2, p2 = _rate(fs, "W2"), _rate(peer, "W2")
            line += f"{w2:12.1f}{p2:10.1f}{w2 / p2:7.2f}"
        if "transformers" in args.peers:
            line += f"{_rate(tf, 'W1'):16.1f}"
        print(line)
        if fs and "ledger_step_bytes" in fs:
            print(f"{'':8}bound MiB: file {path.stat().st_size / 2**20:.0f} + runtime "
                  f"{fs['ledger_runtime_bytes'] / 2**20:.0f} + KV {fs['ledger_kv_bytes'] / 2**20:.0f}"
                  f" + step {fs['ledger_step_bytes'] / 2**20:.0f} (output staging "
                  f"{fs['ledger_staging_bytes'] / 2**20:.0f}) + RoPE "
                  f"{fs['ledger_rope_bytes'] / 2**20:.1f}; peak RSS / bound "
                  f"{fs['peak_rss_mib'] / bound:.2f}; KV {fs.get('kv_blocks', '?')} blocks, "
                  f"{fs.get('preemptions', '?')} preemptions")
        print(f"{'':8}tensors: {held_types(path)}; bandwidth {bw / 1e9:.1f} GB/s (before "
              f"{bws[0] / 1e9:.1f}, after {bws[1] / 1e9:.1f}; read {rbw / 1e9:.1f}); engine start {fs['startup_s'] if fs else float('nan'):.1f} s (load, build, ledger)")
    if args.rounds > 1:
        for qtype, _, _, fs, peer, _, _, _ in rows:
            if fs and peer:
                print(f"{qtype} fitserve / llama.cpp per round: " + be.round_ratios(fs, peer))
    ratios = [_rate(fs, "W1") / _rate(p, "W1") for _, _, _, fs, p, _, _, _ in rows if fs and p]
    if ratios:
        print(f"median W1 ratio fitserve / llama.cpp over the types: {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
