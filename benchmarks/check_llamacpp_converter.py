"""Every family through llama.cpp's OWN converter and quantizer, then fitserve against transformers.

    .venv/bin/python benchmarks/check_llamacpp_converter.py                 # every family, F32 + 3 types
    .venv/bin/python benchmarks/check_llamacpp_converter.py --archs llama,gpt_oss --types Q4_K_M
    .venv/bin/python benchmarks/check_llamacpp_converter.py --wide --archs llama,qwen3_moe

The tests write GGUF files the way llama.cpp's convert_hf_to_gguf.py does (tests/numerics/
hf_to_gguf.py, moe_to_gguf.py); this runs the real one. Its source comes from llama-cpp-python's
sdist on PyPI (``--version``, default the llama.cpp peer's 0.3.36, ../shared/PEERS.md), cached
under FITSERVE_HOME/converter. Per family (the tests' tiny random models, tests/numerics/
tiny_models.py and the MoE / gpt-oss builders, with the default model's tokenizer, or a small
SentencePiece one where the converter requires tokenizer.model):

1. ``convert_hf_to_gguf.py --outtype f32``, then fitserve (float32) greedy against transformers
   greedy on the HF folder: the tokens must be equal.
2. With the llama.cpp peer's venv present: each ``--types`` made by ``llama_model_quantize``; fitserve
   holding the file as stored against (a) fitserve with every weight dequantized (gguf-py's values,
   float32; step 1 checked that path): equal tokens, top-1 logprobs within 1e-4; and (b) llama.cpp
   itself on an F32 copy of the file whose every tensor is gguf-py's dequantization of it (the
   same weights, no activation quantization, an F32 KV cache): equal tokens, or a first difference where fitserve's
   top-1 margin is under 0.05 (a near tie two fp32 engines may break either way). llama.cpp on
   the quantized file itself is printed too: it multiplies Q8-rounded activations, so on these
   random models its tokens part from both at top-1 margins up to ~1.5 -- while it agrees with
   (b) on the dequantized copy, the difference is its activation rounding, not the weights.

``--wide``: hidden 256 (intermediate 512), so Q4_K_M holds real Q4_K / Q6_K tensors; at the tiny
width of 64 every K-quant falls back (Q5_0 / Q5_1 / Q8_0 / IQ4_NL), which this also covers.
Configs use what a GGUF file can say: Gemma's query_pre_attn_scalar = head_dim and Gemma 3's
sliding pattern of 6 (llama.cpp's), no Qwen2-MoE dense layers (the converter cannot map them);
Mistral's sliding window is not written by the converter (llama.cpp then attends to everything, as
fitserve does), so its reference is the same config without the window. Exit status 1 if any
check fails.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from bench_formats import QUANTIZER  # noqa: E402 (the sibling script: llama_model_quantize)

from fitserve.config import EngineConfig  # noqa: E402
from fitserve.engine.core import Engine  # noqa: E402
from fitserve.envs import fitserve_home  # noqa: E402
from fitserve.loading.pull import pull  # noqa: E402
from fitserve.sampling import SamplingParams  # noqa: E402

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "mixtral", "qwen3_moe",
         "olmoe", "qwen2_moe", "gpt_oss")
SPM = ("qwen2", "gemma2", "gemma3", "phi3")  # SentencePiece vocabularies (tokenizer.model)
N_TOKENS = 12
PROMPT_LENGTHS = (1, 7, 23)
PEER_GREEDY = r"""
import json, sys, llama_cpp as L
llm = L.Llama(model_path=sys.argv[1], n_ctx=128, n_threads=2, n_batch=64, verbose=False,
              type_k=0, type_v=0)  # an F32 KV cache (GGML_TYPE_F32; llama.cpp's default is F16)
out = []
for p in json.loads(sys.argv[2]):
    llm.reset()
    toks = []
    for t in llm.generate(p, top_k=1, temp=0.0, repeat_penalty=1.0):
        toks.append(int(t))
        if len(toks) == int(sys.argv[3]):
            break
    out.append(toks)
print(json.dumps(out))
"""


def converter(version: str) -> Path:
    """convert_hf_to_gguf.py (with its conversion/ and gguf-py/) from llama-cpp-python's sdist."""
    root = fitserve_home() / "converter" / version
    script = root / "convert_hf_to_gguf.py"
    if script.is_file():
        return script
    dl = root.parent / f"dl-{version}"
    dl.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary",
                    ":all:", f"llama-cpp-python=={version}", "-d", str(dl)], check=True)
    (sdist,) = dl.glob("llama_cpp_python-*.tar.gz")
    prefix = f"{sdist.name.removesuffix('.tar.gz')}/vendor/llama.cpp/"
    keep = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "models/")
    with tarfile.open(sdist) as tar:
        for m in tar.getmembers():
            rel = m.name.removeprefix(prefix)
            if m.name.startswith(prefix) and rel.startswith(keep) and m.isfile():
                dst = root / rel
                dst.parent.mkdir(parents=True, exist_ok=True)
                src = tar.extractfile(m)
                assert src is not None
                dst.write_bytes(src.read())
    shutil.rmtree(dl)
    return script


def spm_tokenizer(folder: Path) -> None:
    """A small SentencePiece BPE model (byte fallback) as the folder's tokenizer.model."""
    import sentencepiece as spm

    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randrange(2, 8)))
             for _ in range(400)]
    text = folder / "spm-corpus.txt"
    text.write_text("\n".join(" ".join(rng.choice(words) for _ in range(12)) for _ in range(2000)))
    spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(folder / "tokenizer"),
                                   vocab_size=320, model_type="bpe", byte_fallback=True,
                                   pad_id=0, eos_id=1, bos_id=2, unk_id=3,
                                   minloglevel=2)
    text.unlink()
    (folder / "tokenizer.vocab").unlink()


def build(arch: str, folder: Path, tok: Any, tokdir: Path, wide: bool) -> tuple[Any, int]:
    """The tests' tiny random model of ``arch`` saved in ``folder`` with a tokenizer; it and
    the vocabulary size."""
    from tests.numerics.test_gpt_oss_vs_transformers import build_gpt_oss
    from tests.numerics.test_moe_vs_transformers import build_moe
    from tests.numerics.tiny_models import build_tiny

    vocab = 384 if arch in SPM else len(tok)
    width = dict(hidden_size=256, intermediate_size=512) if wide else {}
    if arch in ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3"):
        over: dict[str, Any] = {"vocab_size": vocab, **width}
        if arch == "gemma2":
            over["query_pre_attn_scalar"] = 24
        if arch == "gemma3":
            over.update(num_hidden_layers=6, query_pre_attn_scalar=32,
                        layer_types=["sliding_attention"] * 5 + ["full_attention"])
        if arch == "mistral":
            over["sliding_window"] = None
        if arch == "phi3" and wide:  # LongRoPE's factors: one per rotated pair (head_dim 64)
            over["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0,
                                       "partial_rotary_factor": 1.0,
                                       "short_factor": [1.0 + 0.1 * i for i in range(32)],
                                       "long_factor": [1.5 + 0.7 * i for i in range(32)]}
        ref = build_tiny(arch, folder, tok, **over)
        if arch in SPM:
            for f in folder.iterdir():
                if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
                    f.unlink()
            spm_tokenizer(folder)
        return ref, vocab
    if arch == "gpt_oss":
        return build_gpt_oss(folder, tokdir, vocab_size=vocab, **width), vocab
    moe = dict(hidden_size=256, intermediate_size=256, moe_intermediate_size=256) if wide else {}
    extra = {"mlp_only_layers": []} if arch == "qwen2_moe" else {}
    return build_moe(arch, folder, tokdir, vocab_size=vocab, **moe, **extra), vocab


def greedy(path: Path, weights: str, prompts: list[list[int]]) -> list[Any]:
    """fitserve's finished outputs for ``prompts`` (batched together), top-2 logprobs each."""
    engine = Engine(EngineConfig(model=str(path), dtype="float32", device="cpu", weights=weights,
                                 max_model_len=128, num_kv_blocks=96, block_size=4))
    params = SamplingParams(temperature=0.0, max_tokens=N_TOKENS, ignore_eos=True, logprobs=2)
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=str(i))
    done: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.error is not None:
                raise RuntimeError(f"{path.name}: request {out.request_id}: {out.error}")
            if out.finished:
                done[out.request_id] = out
    return [done[str(i)] for i in range(len(prompts))]


def dequantized_copy(path: Path) -> Path:
    """An F32 GGUF with ``path``'s metadata and every tensor as gguf-py dequantizes it."""
    import gguf
    import numpy as np
    from bench_formats import _copy_fields
    from gguf.quants import dequantize

    out = path.with_name(path.stem + "-dequantized-f32.gguf")
    reader = gguf.GGUFReader(path)
    writer = gguf.GGUFWriter(str(out), str(reader.fields["general.architecture"].contents()))
    _copy_fields(reader, writer, {})
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        values = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        writer.add_tensor(t.name, np.ascontiguousarray(values))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def peer_greedy(peer: Path, path: Path, prompts: list[list[int]]) -> list[list[int]] | None:
    r = subprocess.run([str(peer), "-c", PEER_GREEDY, str(path), json.dumps(prompts),
                        str(N_TOKENS)], capture_output=True, text=True)
    return json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else None


def agreement(outs: list[Any], theirs: list[list[int]]) -> tuple[bool, str]:
    """Whether fitserve's outputs and another engine's tokens agree up to near ties, and how."""
    ok, parts = True, []
    for o, t in zip(outs, theirs, strict=True):
        k = first_difference(list(o.token_ids), t)
        if k >= N_TOKENS:
            parts.append("all")
            continue
        margin = o.logprobs[k].top[0][1] - o.logprobs[k].top[1][1]
        ok &= margin < 0.05
        parts.append(f"{k} (margin {margin:.3f})")
    return ok, ", ".join(parts)


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--archs", default=",".join(ARCHS))
    ap.add_argument("--types", default="Q8_0,Q4_K_M,IQ4_NL",
                    help="llama.cpp quantization types (LLAMA_FTYPE_MOSTLY_*); '' for F32 only")
    ap.add_argument("--wide", action="store_true", help="hidden 256: real K-quant tensors")
    ap.add_argument("--version", default="0.3.36", help="llama-cpp-python sdist to take it from")
    ap.add_argument("--llamacpp-python", default=str(Path.home() / "peers/llamacpp/bin/python"))
    ap.add_argument("--workdir", default=None, help="default: FITSERVE_HOME/converter/work")
    args = ap.parse_args()

    from tests.gguf_vocab_files import default_hf_tokenizer
    from tests.numerics.conftest import hf_greedy

    script = converter(args.version)
    work = Path(args.workdir) if args.workdir else fitserve_home() / "converter" / "work"
    tok = default_hf_tokenizer(pull("smollm2-135m", progress=False))
    tokdir = work / "tokenizer"
    tok.save_pretrained(tokdir)
    peer = Path(args.llamacpp_python)
    qtypes = [t for t in args.types.split(",") if t]
    if qtypes and not peer.exists():
        print(f"no {peer}: F32 only (the quantizer is llama.cpp's; ../shared/PEERS.md)")
        qtypes = []
    print(f"llama.cpp converter of llama-cpp-python {args.version}; width "
          f"{'256' if args.wide else 'tiny'}; {N_TOKENS} greedy tokens after prompts of "
          f"{PROMPT_LENGTHS} tokens")
    failed = 0
    for arch in args.archs.split(","):
        folder = work / arch
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        ref, vocab = build(arch, folder, tok, tokdir, args.wide)
        f32 = folder / "model-f32.gguf"
        r = subprocess.run([sys.executable, str(script), str(folder), "--outfile", str(f32),
                            "--outtype", "f32"], capture_output=True, text=True)
        if r.returncode != 0:
            failed += 1
            print(f"{arch:10s} F32     CONVERTER FAILED: {r.stderr.strip().splitlines()[-1]}")
            continue
        rng = random.Random(arch)
        prompts = [[rng.randrange(4, min(vocab, 320)) for _ in range(n)] for n in PROMPT_LENGTHS]
        try:
            outs = greedy(f32, "auto", prompts)
        except Exception as exc:  # a file the converter made that fitserve refuses: a finding
            failed += 1
            print(f"{arch:10s} F32     FITSERVE REFUSED: {type(exc).__name__}: {exc}")
            continue
        want = [hf_greedy(ref, p, N_TOKENS)[0] for p in prompts]
        agree = [first_difference(list(o.token_ids), w) for o, w in zip(outs, want, strict=True)]
        ok = all(a == N_TOKENS for a in agree)
        failed += not ok
        print(f"{arch:10s} F32     vs transformers: {'equal' if ok else f'DIFFER at {agree}'}")
        for q in qtypes:
            path = folder / f"model-{q.lower()}.gguf"
            r = subprocess.run([str(peer), "-c", QUANTIZER, str(f32), str(path), q, "2"],
                               capture_output=True, text=True)
            if r.returncode != 0:
                print(f"{arch:10s} {q:7s} llama.cpp's quantizer failed (rc {r.returncode})")
                continue
            from gguf import GGUFReader

            kinds = sorted({t.tensor_type.name for t in GGUFReader(path).tensors} - {"F32"})
            try:
                stored, dense = greedy(path, "auto", prompts), greedy(path, "float32", prompts)
            except Exception as exc:
                failed += 1
                print(f"{arch:10s} {q:7s} FITSERVE REFUSED: {type(exc).__name__}: {exc}")
                continue
            same = all(a.token_ids == b.token_ids and all(
                abs(la.top[0][1] - lb.top[0][1]) < 1e-4 for la, lb in zip(a.logprobs, b.logprobs, strict=True))
                for a, b in zip(stored, dense, strict=True))
            failed += not same
            line = (f"{arch:10s} {q:7s} [{' '.join(kinds)}] as stored vs dequantized: "
                    f"{'equal' if same else 'DIFFER'}")
            exact = peer_greedy(peer, dequantized_copy(path), prompts)
            if exact is None:
                line += "; llama.cpp could not run the file"
            else:
                ok, how = agreement(stored, exact)
                failed += not ok
                line += f"; llama.cpp on its dequantized F32 copy agrees for {how}"
                own = peer_greedy(peer, path, prompts)
                if own is not None:
                    line += f"; on the file itself for {agreement(stored, own)[1]}"
            print(line)
    print("all checks passed" if not failed else f"{failed} check(s) FAILED")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
