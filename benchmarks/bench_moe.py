"""A Qwen3-MoE-shaped model as stored: fitserve vs llama.cpp on the same GGUF, W1 and W2, and
W1 against the active-bytes bandwidth limit (issue 39's benchmark).

    .venv/bin/python benchmarks/bench_moe.py                       # default shape, Q4_K_M and Q8_0
    .venv/bin/python benchmarks/bench_moe.py --shape small --runs 1   # a quick check (~300 MB)
    .venv/bin/python benchmarks/bench_moe.py --types Q4_K_M --no-w2 --runs 5
    .venv/bin/python benchmarks/bench_moe.py --types Q4_K_M --rounds 2   # engines alternated

Shapes (random weights, std 1/sqrt(fan_in); architecture ``qwen3moe``: q/k norms, top-8 softmax
routing renormalised, no shared expert; untied lm_head; the default model's tokenizer metadata,
vocabulary 49152):

    default  Qwen3-30B-A3B scaled down: hidden 1024, 24 layers, 64 experts top-8, expert
             intermediate 256, 16 heads / 4 KV heads of 128 -> 1.44B parameters (0.33B active):
             F16 ~2.9 GB, Q4_K_M ~0.9 GB, Q8_0 ~1.5 GB
    small    hidden 512, 8 layers, 32 experts top-8, expert intermediate 256, 8 heads / 2 KV
             heads of 64 -> 0.16B parameters: F16 ~0.3 GB

The F16 file is streamed tensor by tensor (gguf-py's writer), then quantized by llama.cpp's own
quantizer (bench_formats.quantize, in the llama.cpp peer's venv); all cached under
FITSERVE_HOME/bench. Each engine runs as bench_engine.py's worker in its own process (same token
ids, threads, greedy, EOS ignored, one warm-up, medians of --runs), fitserve then llama.cpp per
type, --rounds times alternated (each figure the median of the rounds' medians; the load
average is printed as it goes). fitserve's worker also reports what its engine holds (experts' module class and format,
held bytes by part) and the bytes one token reads at batch 1, counted by the ledger over the
engine's tensors in the file's own per-tensor formats (fitserve.ledger.weights.engine_held_tensors:
every non-expert tensor but the embedding lookup, plus k/E of each layer's experts); the limit
is that over the copy bandwidth, the higher of the figures measured just before and just
after the worker (fitserve.ledger.cpu_measure.measure_copy_bandwidth). The ledger's model of the mix
(fitserve.ledger.moe.active_bytes on model_weight_bytes(spec, TYPE)) is printed beside it.

Cost on the 2-core dev host: the default F16 file ~30 s to write, each llama.cpp quantization
~1-2 min (cached after); the run is dominated by W2 (4 x 32 requests per engine and type:
--no-w2 or --types Q4_K_M for a shorter one). benchmarks/profile_moe.py shows where a batch-1
step goes.

Targets (issue 39): W1 >= 1.15x llama.cpp and >= 70% of the active-bytes limit; W2 >= 1.5x.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_engine as be  # noqa: E402  (the workers and their orchestration)
import bench_formats as bf  # noqa: E402  (llama.cpp's quantizer, metadata copy, tensor types)

SHAPES: dict[str, dict[str, int]] = {
    "default": {"hidden": 1024, "layers": 24, "experts": 64, "top_k": 8, "expert_ff": 256,
                "heads": 16, "kv_heads": 4, "head_dim": 128},
    "small": {"hidden": 512, "layers": 8, "experts": 32, "top_k": 8, "expert_ff": 256,
              "heads": 8, "kv_heads": 2, "head_dim": 64},
}
ARCH = "qwen3moe"


def _tensor_shapes(s: dict[str, int], vocab: int) -> dict[str, tuple[int, ...]]:
    """llama.cpp's qwen3moe tensors, numpy order (rows last-but-one; experts [E, rows, cols])."""
    h, e, ff, hd = s["hidden"], s["experts"], s["expert_ff"], s["head_dim"]
    q, kv = s["heads"] * hd, s["kv_heads"] * hd
    out: dict[str, tuple[int, ...]] = {"token_embd.weight": (vocab, h),
                                       "output_norm.weight": (h,), "output.weight": (vocab, h)}
    for i in range(s["layers"]):
        b = f"blk.{i}."
        out |= {b + "attn_norm.weight": (h,), b + "attn_q.weight": (q, h),
                b + "attn_k.weight": (kv, h), b + "attn_v.weight": (kv, h),
                b + "attn_output.weight": (h, q), b + "attn_q_norm.weight": (hd,),
                b + "attn_k_norm.weight": (hd,), b + "ffn_norm.weight": (h,),
                b + "ffn_gate_inp.weight": (e, h), b + "ffn_gate_exps.weight": (e, ff, h),
                b + "ffn_up_exps.weight": (e, ff, h), b + "ffn_down_exps.weight": (e, h, ff)}
    return out


def write_moe_f16(default_gguf: Path, out: Path, shape: str) -> Path:
    """The random-weight F16 GGUF of ``shape``, streamed one tensor at a time (the default
    shape's float32 draws would not fit in memory at once). Norms F32 ones, the rest F16."""
    if out.is_file():
        return out
    import gguf

    s = SHAPES[shape]
    reader = gguf.GGUFReader(str(default_gguf))
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    tmp = out.with_suffix(".part")
    w = gguf.GGUFWriter(str(tmp), ARCH)
    # the tokenizer only: the default model's llama.* shape keys do not apply here
    bf._copy_fields(reader, w, {k: None for k in reader.fields if not k.startswith("tokenizer.")})
    w.add_name(f"bench-moe-{shape}")
    w.add_context_length(4096)
    w.add_embedding_length(s["hidden"])
    w.add_block_count(s["layers"])
    w.add_feed_forward_length(s["expert_ff"] * s["top_k"])  # unused: every layer is sparse
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_key_length(s["head_dim"])
    w.add_value_length(s["head_dim"])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6)
    w.add_expert_count(s["experts"])
    w.add_expert_used_count(s["top_k"])
    w.add_expert_feed_forward_length(s["expert_ff"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    shapes = _tensor_shapes(s, vocab)
    for name, shp in shapes.items():
        dt = np.dtype(np.float32 if len(shp) == 1 else np.float16)
        w.add_tensor_info(name, shp, dt, int(np.prod(shp)) * dt.itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    for shp in shapes.values():
        if len(shp) == 1:
            w.write_tensor_data(np.ones(shp, np.float32))
            continue
        # std 1/sqrt(fan_in): activations stay O(1) through the layers; one expert at a time
        rows = shp if len(shp) == 2 else shp[1:]
        parts = [rng.standard_normal(rows, np.float32) / np.float32(np.sqrt(shp[-1]))
                 for _ in range(1 if len(shp) == 2 else shp[0])]
        w.write_tensor_data(np.stack(parts).reshape(shp).astype(np.float16))
    w.close()
    tmp.rename(out)
    return out


# -- the fitserve worker (bench_engine.fitserve_worker, plus what its engine holds) -----------
def _engine_report(engine: Any) -> dict[str, Any]:
    """What ``engine`` holds: the experts' module classes and formats (from the modules
    themselves), held bytes by part, and the ledger's bytes per token at batch 1."""
    from fitserve.ledger.weights import engine_format_rule, engine_held_tensors, held_bytes
    from fitserve.runner.placement import dtype_name

    model, spec = engine.runner.model, engine.spec
    kinds: dict[str, int] = {}
    held = {"experts": 0, "embedding": 0, "rest": 0}
    for name, mod in model.named_modules():
        own = [t for t in (*mod.parameters(recurse=False), *mod.buffers(recurse=False))
               if t.dim() >= 1 and "rotary" not in name]
        if not own:
            continue
        nbytes = sum(t.numel() * t.element_size() for t in own)
        part = ("experts" if ".experts." in name else
                "embedding" if "embed_tokens" in name else "rest")
        held[part] += nbytes
        if part == "experts":
            fmt = getattr(mod, "ggml_type", None) or getattr(getattr(mod, "packed", None),
                                                             "format", None)
            fmt = fmt or str(getattr(mod, "weight", own[0]).dtype).removeprefix("torch.")
            key = f"{type(mod).__name__} {fmt}"
            kinds[key] = kinds.get(key, 0) + nbytes
    dname = dtype_name(engine.dtype)
    tensors = engine_held_tensors(spec, dname, stored=engine.loaded.stored_formats,
                                  rule=engine_format_rule(engine.weights_choice, dname))
    experts = held_bytes(t for t in tensors if ".experts." in t.name)
    embed = held_bytes(t for t in tensors if "embed_tokens" in t.name)
    tied = not any(t.name.startswith("lm_head") for t in tensors)
    rest = held_bytes(tensors) - experts - (0 if tied else embed)
    k, e = spec.num_experts_per_token, spec.num_experts
    return {"expert_modules": kinds, "held_bytes": held,
            "ledger_held_bytes": held_bytes(tensors),
            "active_bytes_per_token": rest + experts * k / e,
            "expert_formats": sorted({t.fmt for t in tensors if ".experts." in t.name}),
            "experts": e, "top_k": k}


def moe_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """bench_engine's fitserve worker on ``spec``, with the engine it built kept for
    ``_engine_report`` (its Engine class is looked up at call time, so a subclass is seen)."""
    import fitserve.engine.core as core

    built: list[Any] = []

    class Recorded(core.Engine):  # type: ignore[misc]
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            built.append(self)

    core.Engine = Recorded  # type: ignore[misc]
    out = be.fitserve_worker(spec)
    return {**out, **_engine_report(built[0])}


# -- orchestration ------------------------------------------------------------------------------
def ledger_mix_active(path: Path, qtype: str) -> float:
    """The ledger's own model of a ``qtype`` file (its mix rules, not the file's tensors):
    fitserve.ledger.moe.active_bytes(...).per_token, or NaN where it has no such mix."""
    from fitserve.ledger.errors import PlanError
    from fitserve.ledger.moe import active_bytes
    from fitserve.ledger.weights import model_weight_bytes
    from fitserve.loading.gguf_spec import read_gguf_header, spec_from_gguf_header

    spec = spec_from_gguf_header(read_gguf_header(path), require_supported=False)
    try:
        return float(active_bytes(spec, model_weight_bytes(spec, qtype)).per_token)
    except (PlanError, KeyError, ValueError):
        return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="default")
    ap.add_argument("--types", default="Q4_K_M,Q8_0",
                    help="llama.cpp ftype names (LLAMA_FTYPE_MOSTLY_<name>)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1,
                    help="alternate fitserve and llama.cpp this many times per type")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-w2", action="store_true", help="W1 only")
    ap.add_argument("--no-peer", action="store_true", help="fitserve only (no llama.cpp)")
    ap.add_argument("--llamacpp-python", default=str(Path.home() / "peers/llamacpp/bin/python"))
    ap.add_argument("--json", default=None, help="also write every worker's result here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("spec", nargs="?", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(moe_worker(json.loads(Path(args.spec).read_text()))))
        return

    from fitserve.envs import fitserve_home

    if not Path(args.llamacpp_python).exists():
        sys.exit(f"needs llama.cpp's quantizer: no {args.llamacpp_python} (see ../shared/PEERS.md)")
    base = be.workload_spec(args.threads, args.runs, 32)
    if args.no_w2:
        del base["w2_batch"]
    folder = fitserve_home() / "bench"
    folder.mkdir(parents=True, exist_ok=True)
    print(f"writing / reusing the {args.shape} F16 file ...", file=sys.stderr)
    src = write_moe_f16(Path(base["gguf"]), folder / f"moe-{args.shape}-f16.gguf", args.shape)
    me = [sys.executable, str(Path(__file__).resolve()), "--worker"]
    rows = []
    print(f"load average at start: {_loadavg()}", file=sys.stderr)
    for qtype in filter(None, args.types.split(",")):
        path = src if qtype == "F16" else bf.quantize(args.llamacpp_python, src, qtype,
                                                      args.threads)
        spec = {**base, "gguf": str(path), "config": "as-stored"}
        rounds = []
        # NOTE: --rounds alternates the two engines (fitserve, llama.cpp, fitserve, ...) so a
        # change of the host's load mid-run hits both; each figure is the median over rounds
        for r in range(args.rounds):
            print(f"{qtype} round {r + 1}/{args.rounds}: fitserve ... (load {_loadavg()})",
                  file=sys.stderr)
            bw, fs, bws, rbw = bf.bandwidth_around(lambda spec=spec: be.run_worker(me, spec))
            print(f"  copy bandwidth before / after fitserve: {bws[0] / 1e9:.1f} / "
                  f"{bws[1] / 1e9:.1f} GB/s, read {rbw / 1e9:.1f}", file=sys.stderr)
            if fs:
                fs["read_bytes_per_s"] = rbw
            peer = None
            if not args.no_peer:
                print(f"{qtype} round {r + 1}: llama.cpp ... (load {_loadavg()})",
                      file=sys.stderr)
                peer = be.run_worker([args.llamacpp_python,
                                      str(HERE / "peers/llamacpp_worker.py")], spec)
                if peer is None:
                    print(f"{qtype}: llama.cpp could not run {path.name} (arch {ARCH}; see "
                          "above)", file=sys.stderr)
            rounds.append((bw, fs, peer))
        rows.append((qtype, path, *_merge(rounds)))
    report(rows, args)
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"cpu": be.cpu_description(), "shape": SHAPES[args.shape], "threads": args.threads,
             "rows": [{"type": q, "file": str(p), "copy_bytes_per_s": bw, "fitserve": fs,
                       "llama.cpp": peer} for q, p, bw, fs, peer in rows]}, indent=2))


def _loadavg() -> str:
    return " ".join(f"{v:.1f}" for v in os.getloadavg())


def _merge(rounds: list[tuple[float, Any, Any]]) -> tuple[float, Any, Any]:
    """(bandwidth, fitserve, llama.cpp) over the rounds: each rate the median of the rounds'
    medians (every run kept under "runs"), the rest from the first round that has a result."""
    bw = float(np.median([b for b, _, _ in rounds]))
    merged = []
    for i in (1, 2):
        res = [r[i] for r in rounds if r[i] is not None]
        if not res:
            merged.append(None)
            continue
        out = dict(res[0])
        if all("read_bytes_per_s" in r for r in res):
            out["read_bytes_per_s"] = float(np.median([r["read_bytes_per_s"] for r in res]))
        for w in ("W1", "W2"):
            if all(w in r for r in res):
                out[w] = {**res[0][w], "tok_s": float(np.median([r[w]["tok_s"] for r in res])),
                          "runs": [x for r in res for x in r[w]["runs"]],
                          "round_medians": [r[w]["tok_s"] for r in res]}
        merged.append(out)
    return bw, merged[0], merged[1]


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b == b and b > 0 and a == a else "-"


def report(rows: list[tuple[str, Path, float, Any, Any]], args: argparse.Namespace) -> None:
    s = SHAPES[args.shape]
    print(f"\nCPU: {be.cpu_description()}\nshape {args.shape}: {s}; threads={args.threads}, "
          f"medians of {args.runs} runs; limit = active bytes per token (batch 1) / copy "
          f"bandwidth (the higher of the figures measured just before and just after "
          f"fitserve's worker); of read = over a plain read's bandwidth (measured alike)"
          f"\ntargets: W1 >= 1.15x llama.cpp "
          f"and >= 70% of the limit, W2 >= 1.5x llama.cpp; {args.rounds} round(s) alternating "
          f"the engines; load average now {_loadavg()} (2 cores)")
    print(f"{'type':<8}{'file MiB':>9}{'active MiB':>11}{'limit':>8}{'W1 fitserve':>12}"
          f"{'llama.cpp':>10}{'ratio':>7}{'of limit':>9}{'of read':>8}{'W2 fitserve':>12}{'llama.cpp':>10}"
          f"{'ratio':>7}")
    for qtype, path, bw, fs, peer in rows:
        active = fs["active_bytes_per_token"] if fs else float("nan")
        limit = bw / active
        w1, p1 = bf._rate(fs, "W1"), bf._rate(peer, "W1")
        w2, p2 = bf._rate(fs, "W2"), bf._rate(peer, "W2")
        read = fs.get("read_bytes_per_s", float("nan")) if fs else float("nan")
        print(f"{qtype:<8}{path.stat().st_size / 2**20:9.0f}{active / 2**20:11.1f}{limit:8.1f}"
              f"{w1:12.1f}{p1:10.1f}{_ratio(w1, p1):>7}{w1 / limit:9.0%}{w1 * active / read:8.0%}"
              f"{w2:12.1f}{p2:10.1f}"
              f"{_ratio(w2, p2):>7}")
        print(f"{'':8}file tensors: {bf.held_types(path)}; copy bandwidth {bw / 1e9:.1f} GB/s")
        if fs:
            held = fs["held_bytes"]
            mods = ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in fs["expert_modules"].items())
            print(f"{'':8}fitserve holds: experts {held['experts'] / 2**20:.0f} MiB ({mods}), "
                  f"embedding {held['embedding'] / 2**20:.0f} MiB, rest "
                  f"{held['rest'] / 2**20:.0f} MiB; ledger {fs['ledger_held_bytes'] / 2**20:.0f}"
                  f" MiB; peak RSS {fs['peak_rss_mib']:.0f} MiB")
            print(f"{'':8}active bytes per token: {active / 2**20:.1f} MiB in the file's own "
                  f"tensor types ({fs['top_k']} of {fs['experts']} experts, "
                  f"{'/'.join(fs['expert_formats'])}); the ledger's {qtype} mix model "
                  f"{ledger_mix_active(path, qtype) / 2**20:.1f} MiB")
        for w in ("W1", "W2"):
            a, b = (fs or {}).get(w, {}), (peer or {}).get(w, {})
            if len(a.get("round_medians", [])) > 1 and b.get("round_medians"):
                print(f"{'':8}{w} per round fitserve / llama.cpp: " + ", ".join(
                    f"{x:.1f}/{y:.1f}" for x, y in zip(a["round_medians"], b["round_medians"],
                                                        strict=False)))
        if peer is None and not args.no_peer:
            print(f"{'':8}llama.cpp: no result (could it load arch {ARCH}? see stderr)")


if __name__ == "__main__":
    main()
