"""W1 / W2 of a Gemma-3-shaped and a Phi-3-shaped model: fitserve beside llama.cpp on the same
GGUF file (as stored) and beside transformers on the same HF folder (bf16).

    .venv/bin/python benchmarks/bench_families.py                     # both models, Q8_0, Q4_K_M
    .venv/bin/python benchmarks/bench_families.py --models gemma3 --types Q8_0 --no-w2 --runs 2

The models (random weights, seeded; never committed, cached under FITSERVE_HOME/bench):
- gemma3: Gemma-3-270M's own config (18 layers, hidden 640, 4 query / 1 KV head of 256, MLP
  2048, vocabulary 262144 tied, 5 of 6 layers on a 512-token window, local RoPE base 1e4,
  global 1e6, query_pre_attn_scalar 256): 268M parameters.
- phi3: Phi-3 scaled to ~290M parameters: 20 layers, hidden 1024, 8 query / 2 KV heads of 128
  (Phi-3-medium's and Phi-4's head size and 4:1 GQA), MLP 2816, vocabulary 32064 untied,
  fused qkv / gate_up, LongRoPE (Phi-3.5-mini's way: original context 4096 of 131072, so W1 / W2
  run on the short factors).

phi3's GGUF carries a SentencePiece vocabulary written the way llama.cpp's converter writes Phi-3's
(``tokenizer.ggml.model = "llama"``; llama.cpp's phi3 loader refuses the tests' tiny byte-level
one): a 32000-piece BPE model with byte fallback trained with ``sentencepiece`` on a generated
corpus, Phi-3's 11 added tokens, [PAD] up to 32064 (tests/gguf_vocab_files.phi3_vocab); its
prompts are the benchmark text in that vocabulary, and fitserve's tokenizer of the file is
checked against transformers' and llama.cpp's before the run. gemma3 keeps the tiny vocabulary
(its ids are the default model's, modulo the vocabulary).

Each is saved as an HF folder (bf16), written from it as an F16 GGUF the way llama.cpp's converter
writes these families (tests/numerics/hf_to_gguf.py: gguf-py's writer and tensor map), then
quantized by llama.cpp's own quantizer (bench_formats.quantize). The workers are bench_engine.py's
(each engine in its own process, the same token ids, greedy, EOS ignored, one warm-up, medians of
--runs). Ratios: fitserve / llama.cpp per GGUF type, fitserve bf16 / transformers bf16.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))  # tests.numerics.hf_to_gguf
import bench_engine as be  # noqa: E402  (the workers and their orchestration)
import bench_formats as bf  # noqa: E402  (llama.cpp's quantizer)

GEMMA3_270M = dict(vocab_size=262144, hidden_size=640, intermediate_size=2048,
                   num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1,
                   head_dim=256, max_position_embeddings=32768, query_pre_attn_scalar=256,
                   sliding_window=512, rms_norm_eps=1e-6, tie_word_embeddings=True,
                   layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                for i in range(18)],
                   rope_parameters={"full_attention": {"rope_type": "default",
                                                       "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "default",
                                                          "rope_theta": 1e4}})
PHI3_300M = dict(vocab_size=32064, hidden_size=1024, intermediate_size=2816,
                 num_hidden_layers=20, num_attention_heads=8, num_key_value_heads=2,
                 max_position_embeddings=131072, original_max_position_embeddings=4096,
                 rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                  "short_factor": [1.0 + 0.01 * i for i in range(64)],
                                  "long_factor": [1.0 + 0.5 * i for i in range(64)]},
                 tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def hf_config(name: str) -> Any:
    import transformers as tf

    if name == "gemma3":
        return tf.Gemma3TextConfig(**GEMMA3_270M)
    return tf.Phi3Config(**PHI3_300M)


def generated_corpus(lines: int = 20000, seed: int = 0) -> list[str]:
    """Text of made-up words (Zipf-weighted), enough for a 32000-piece BPE vocabulary, plus the
    tests' corpus (code, whitespace runs, emoji, CJK, accents)."""
    import itertools
    import random

    from tests.gguf_vocab_files import TRAINING

    rng = random.Random(seed)
    onsets = ["", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v",
              "w", "st", "tr", "ch", "sh", "th", "pl", "gr"]
    vowels, codas = ["a", "e", "i", "o", "u", "ai", "ea", "ou"], ["", "", "n", "r", "s", "t", "ng"]
    words = ["".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas)
                     for _ in range(rng.choice([1, 1, 2, 2, 3, 4]))) for _ in range(60000)]
    cum = list(itertools.accumulate(1.0 / (i + 1) for i in range(len(words))))
    text = [" ".join(rng.choices(words, cum_weights=cum, k=rng.randint(5, 25))) + "."
            for _ in range(lines)]
    return list(TRAINING) + text


def phi3_vocabulary(vocab_size: int) -> Any:
    """Phi-3's vocabulary (tests/gguf_vocab_files.Vocab) over a trained 32000-piece model."""
    from tests.gguf_vocab_files import phi3_vocab, train_sentencepiece

    sp = train_sentencepiece(gemma=False, sentences=generated_corpus(), vocab_size=32000)
    return phi3_vocab(sp, vocab_size)


def _tokenizer_model(path: Path) -> str:
    import gguf

    field = gguf.GGUFReader(str(path)).fields["tokenizer.ggml.model"]
    return str(field.contents())


def write_models(name: str, folder: Path, default_gguf: Path) -> tuple[Path, Path, int]:
    """The HF folder (bf16; the default model's tokenizer, phi3's own) and the F16 GGUF of
    ``name``, and its parameter count."""
    import torch
    import transformers as tf

    from tests.numerics.hf_to_gguf import write_gguf_like_llama_cpp

    hf_dir, f16 = folder / f"families-{name}-hf", folder / f"families-{name}-f16.gguf"
    if name == "phi3" and f16.is_file() and _tokenizer_model(f16) != "llama":
        for old in folder.glob(f"families-{name}-*.gguf"):  # an earlier run's tiny vocabulary
            old.unlink()
    if not (hf_dir / "config.json").is_file():
        print(f"{name}: random weights -> {hf_dir}", file=sys.stderr)
        torch.manual_seed(0)
        model = tf.AutoModelForCausalLM.from_config(hf_config(name), dtype=torch.bfloat16)
        model.save_pretrained(str(hf_dir))
        tf.AutoTokenizer.from_pretrained(str(default_gguf.parent), gguf_file=default_gguf.name
                                         ).save_pretrained(str(hf_dir))
    model = tf.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    params = sum(p.numel() for p in model.parameters())
    if not f16.is_file():
        print(f"{name}: F16 GGUF -> {f16}", file=sys.stderr)
        vocab = phi3_vocabulary(model.config.vocab_size) if name == "phi3" else None
        write_gguf_like_llama_cpp(model, f16.with_suffix(".part"), f16=True, vocab=vocab
                                  ).rename(f16)
        if name == "phi3":  # the folder gets the file's tokenizer too
            tf.AutoTokenizer.from_pretrained(str(folder), gguf_file=f16.name
                                             ).save_pretrained(str(hf_dir))
    return hf_dir, f16, params


LLAMACPP_TOKENIZE = """
import json, sys, llama_cpp
m = llama_cpp.Llama(model_path=sys.argv[1], vocab_only=True, verbose=False)
print(json.dumps([m.tokenize(t.encode(), add_bos=False, special=True)
                  for t in json.loads(sys.stdin.read())]))
"""


def check_tokenizer(f16: Path, llamacpp_python: str) -> str:
    """fitserve's tokenizer of ``f16`` against transformers' (must be equal) and llama.cpp's,
    on the tests' corpus and Phi-3's chat markers."""
    import json
    import subprocess

    from fitserve.loading import load_tokenizer
    from tests.gguf_vocab_files import CORPUS, hf_tokenizer

    texts = [t for t in CORPUS if t and not t.startswith(" ")]  # where llama.cpp agrees too
    texts += ["<|user|>\nWhat is 2+2?<|end|>\n<|assistant|>"]
    ours, ref = load_tokenizer(f16), hf_tokenizer(f16)
    mine = [ours.encode(t, add_special_tokens=False) for t in texts]
    bad = [t for t, ids in zip(texts, mine, strict=True)
           if ids != ref.encode(t, add_special_tokens=False)]
    if bad:
        raise SystemExit(f"{f16.name}: fitserve's tokenizer differs from transformers' on {bad}")
    out = subprocess.run([llamacpp_python, "-c", LLAMACPP_TOKENIZE, str(f16)], check=True,
                         input=json.dumps(texts), capture_output=True, text=True).stdout
    same = sum(a == b for a, b in zip(mine, json.loads(out), strict=True))
    return (f"{f16.name}: fitserve's ids == transformers' on {len(texts)} texts; "
            f"== llama.cpp's on {same} of {len(texts)}")


def jobs_of(name: str, args: argparse.Namespace, base: dict[str, Any],
            folder: Path) -> list[tuple[str, dict[str, Any] | None]]:
    """Every worker's result for model ``name``: (label, result)."""
    hf_dir, f16, params = write_models(name, folder, Path(base["gguf"]))
    vocab = hf_config(name).vocab_size
    ids = {"w1_prompt": [t % vocab for t in base["w1_prompt"]]}
    if "w2_batch" in base:
        ids["w2_batch"] = [[t % vocab for t in p] for p in base["w2_batch"]]
    if name == "phi3":  # the benchmark text in the file's own vocabulary
        from fitserve.loading import load_tokenizer

        print(check_tokenizer(f16, args.llamacpp_python), file=sys.stderr)
        text = load_tokenizer(f16).encode(be.TEXT, add_special_tokens=False)
        ids["w1_prompt"] = text[:32]
        if "w2_batch" in base:
            ids["w2_batch"] = [text[i * 7 : i * 7 + 128] for i in range(len(base["w2_batch"]))]
    w2_types = args.w2_types.split(",")

    def w1_only(label: str) -> dict[str, Any]:  # W2 only for the types of --w2-types
        return {} if "all" in w2_types or label in w2_types else {"w2_batch": None}

    me = [sys.executable, str(HERE / "bench_engine.py")]
    out: list[tuple[str, dict[str, Any] | None]] = [(f"{params / 1e6:.0f}M parameters", None)]

    def keep(label: str, result: dict[str, Any] | None) -> None:
        out.append((label, result))  # printed now too: a cut-short run keeps what it measured
        print(f"  {name} {label}: W1 {_rate(result, 'W1'):.1f} tok/s, W2 {_rate(result, 'W2'):.1f}"
              " tok/s", file=sys.stderr)

    for qtype in filter(None, args.types.split(",")):
        path = bf.quantize(args.llamacpp_python, f16, qtype, args.threads)
        spec = _drop_none({**base, **ids, "gguf": str(path), "config": "as-stored",
                           **w1_only(qtype)})
        print(f"{name} {qtype}: fitserve ...", file=sys.stderr)
        keep(f"fitserve {qtype}", be.run_worker([*me, "--worker", "fitserve"], spec))
        if "llamacpp" in args.peers:
            print(f"{name} {qtype}: llama.cpp ...", file=sys.stderr)
            keep(f"llama.cpp {qtype}", be.run_worker(
                [args.llamacpp_python, str(HERE / "peers/llamacpp_worker.py")], spec))
    for dtype in filter(None, args.hf_dtypes.split(",")):
        spec = _drop_none({**base, **ids, "gguf": str(hf_dir), "hf_dir": str(hf_dir),
                           "config": dtype, **w1_only(dtype)})
        print(f"{name} {dtype}: fitserve, transformers ...", file=sys.stderr)
        keep(f"fitserve {dtype}", be.run_worker([*me, "--worker", "fitserve"], spec))
        keep(f"transformers {dtype}", be.run_worker([*me, "--worker", "transformers"], spec))
    return out


def _drop_none(spec: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in spec.items() if v is not None}


def _rate(r: dict[str, Any] | None, w: str) -> float:
    return r[w]["tok_s"] if r and w in r else float("nan")


def report(name: str, rows: list[tuple[str, dict[str, Any] | None]]) -> None:
    print(f"\n{name} ({rows[0][0]})")
    print(f"{'engine':<20}{'W1 TTFT ms':>11}{'W1 tok/s':>10}{'W2 tok/s':>10}{'RSS MiB':>9}"
          f"{'W1 ratio':>9}{'W2 ratio':>9}  (fitserve / peer on the same file or folder)")
    by = dict(rows[1:])
    for label, r in rows[1:]:
        line = (f"{label:<20}{r['W1']['ttft_ms'] if r else float('nan'):11.1f}"
                f"{_rate(r, 'W1'):10.1f}{_rate(r, 'W2'):10.1f}"
                f"{r.get('peak_rss_mib', float('nan')) if r else float('nan'):9.0f}")
        peer = by.get(label.replace("llama.cpp", "fitserve").replace("transformers", "fitserve"))
        if peer is not r:
            line += f"{_rate(peer, 'W1') / _rate(r, 'W1'):9.2f}{_rate(peer, 'W2') / _rate(r, 'W2'):9.2f}"
        print(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="gemma3,phi3")
    ap.add_argument("--types", default="Q8_0,Q4_K_M",
                    help="llama.cpp ftype names (LLAMA_FTYPE_MOSTLY_<name>)")
    ap.add_argument("--peers", default="llamacpp", help="llamacpp on each GGUF, or none")
    ap.add_argument("--hf-dtypes", default="bf16",
                    help="fitserve beside transformers on the HF folder in these (fp32, bf16)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-w2", action="store_true", help="W1 only")
    ap.add_argument("--w2-types", default="all",
                    help="run W2 only for these GGUF types / HF dtypes (e.g. Q8_0,bf16)")
    ap.add_argument("--w2-requests", type=int, default=32,
                    help="W2's batch (fewer on a loaded host: W2 is then N x (128 + 128))")
    ap.add_argument("--llamacpp-python", default=str(Path.home() / "peers/llamacpp/bin/python"))
    args = ap.parse_args()

    from fitserve.envs import fitserve_home

    if not Path(args.llamacpp_python).exists():
        sys.exit(f"needs llama.cpp's quantizer: no {args.llamacpp_python} (see ../shared/PEERS.md)")
    import os

    load_start = os.getloadavg()
    base = be.workload_spec(args.threads, args.runs, args.w2_requests)
    if args.no_w2:
        del base["w2_batch"]  # every worker then runs W1 only
    folder = fitserve_home() / "bench"
    folder.mkdir(parents=True, exist_ok=True)
    results = {name: jobs_of(name, args, base, folder)
               for name in filter(None, args.models.split(","))}
    print(f"\nCPU: {be.cpu_description()}\nthreads={args.threads}, medians of {args.runs} runs "
          f"after a warm-up; W1: 32-token prompt + 128 new; "
          f"{'no W2' if args.no_w2 else f'W2: {args.w2_requests} x (128 + 128)'}, "
          f"EOS ignored\nload average (1, 5, 15 min) at the start {load_start}, at the end "
          f"{os.getloadavg()}")
    for name, rows in results.items():
        report(name, rows)


if __name__ == "__main__":
    main()
