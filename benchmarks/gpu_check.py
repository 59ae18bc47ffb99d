"""The prepared GPU check (issue 43, item 7): one script to run whenever a CUDA machine is lent.

    bash benchmarks/gpu_check.sh                 # on the GPU machine (installs carried wheels first)
    python benchmarks/gpu_check.py --device cpu  # here: the same steps on the CPU, as a smoke run

Steps, each printed with PASS / FAIL and the figures:
1. the Triton kernels' tests, compiled for real (not TRITON_INTERPRET) when CUDA is present;
2. the engine on the device, token-exact against transformers on the same random weights
   (float32, greedy, 32 new tokens, 4 prompts run alone and batched);
3. W1 (1 request, 32-token prompt, 128 new tokens) and W2 (32 requests x 128-token prompts x
   128 new tokens) in bf16 on a SmolLM2-135M-shaped random model, fitserve beside transformers
   (HF generate, batched) on the same device; medians of --runs.
The machine has no hub access and no tokenizer files of its own, so the script writes a
byte-level tokenizer and random-weight models itself; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                    max_position_embeddings=2048, rope_theta=100000.0, tie_word_embeddings=True)
TINY = dict(hidden_size=96, intermediate_size=192, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=320, max_position_embeddings=512)


def write_byte_tokenizer(folder: Path) -> None:
    """A byte-level BPE tokenizer with no merges (256 byte tokens + <s>, </s>), as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {ch: i + 3 for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        '{"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", '
        '"tokenizer_class": "PreTrainedTokenizerFast"}')


def write_model(folder: Path, sizes: dict[str, Any], seed: int) -> Any:
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.LlamaConfig(bos_token_id=1, eos_token_id=2, **sizes)
    model = tf.LlamaForCausalLM(cfg).to(torch.float32).eval()
    model.save_pretrained(folder)
    write_byte_tokenizer(folder)
    return model


def step_triton_tests(device: str) -> bool:
    env = dict(os.environ)
    if device == "cuda":
        env.pop("TRITON_INTERPRET", None)  # compile for the GPU
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           str(ROOT / "tests/kernels/test_kernels_triton.py")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    print(proc.stdout[-2000:], proc.stderr[-1000:], sep="\n")
    return proc.returncode == 0


def prompts_for(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(n)]


def hf_greedy(model: Any, prompt: list[int], new: int, device: str) -> list[int]:
    import torch

    ids = torch.tensor([prompt], device=device)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def step_token_exact(device: str, workdir: Path) -> bool:
    from fitserve import LLM, SamplingParams

    folder = workdir / "tiny"
    model = write_model(folder, TINY, seed=7).to(device)
    prompts = prompts_for(TINY["vocab_size"], 4, 11, seed=3)
    want = [hf_greedy(model, p, 32, device) for p in prompts]
    llm = LLM(str(folder), device=device, dtype="float32", max_model_len=128)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    alone = [llm.generate([p], params)[0].outputs[0].token_ids
             for p in prompts]
    batched = [r.outputs[0].token_ids
               for r in llm.generate([list(p) for p in prompts], params)]
    ok = True
    for i, w in enumerate(want):
        for name, got in (("alone", alone[i]), ("batched", batched[i])):
            same = list(got) == w
            ok &= same
            first = next((j for j, (a, b) in enumerate(zip(got, w, strict=False)) if a != b), None)
            print(f"  prompt {i} {name}: {'identical' if same else f'diverges at {first}'}")
    return ok


def timed(fn: Any, runs: int, device: str) -> float:
    import torch

    fn()  # warm-up
    times = []
    for _ in range(runs):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def step_speed(device: str, workdir: Path, runs: int, w2_requests: int) -> dict[str, float]:
    import torch

    from fitserve import LLM, SamplingParams

    folder = workdir / "smollm2-shape"
    hf = write_model(folder, SMOLLM2_135M, seed=11).to(device=device, dtype=torch.bfloat16)
    w1 = prompts_for(SMOLLM2_135M["vocab_size"], 1, 32, seed=5)
    w2 = prompts_for(SMOLLM2_135M["vocab_size"], w2_requests, 128, seed=6)
    new = 128
    llm = LLM(str(folder), device=device, dtype="bfloat16", max_model_len=512)
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    out = {
        "fitserve W1 tok/s": new / timed(lambda: llm.generate([w1[0]], params),
                                         runs, device),
        "fitserve W2 tok/s": w2_requests * new / timed(
            lambda: llm.generate([list(p) for p in w2], params), runs, device),
        "transformers W1 tok/s": new / timed(lambda: hf_greedy(hf, w1[0], new, device), runs, device),
    }
    ids = torch.tensor(w2, device=device)

    def hf_batch() -> None:
        with torch.no_grad():
            hf.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)

    out["transformers W2 tok/s"] = w2_requests * new / timed(hf_batch, runs, device)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--w2-requests", type=int, default=32)
    ap.add_argument("--skip-speed", action="store_true")
    args = ap.parse_args()
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("FAIL: --device cuda but torch sees no CUDA device")
        return 2
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"torch {torch.__version__}; device {name}; commit "
          f"{subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], cwd=ROOT, capture_output=True, text=True).stdout.strip() or '?'}")
    results: dict[str, bool] = {}
    print("== 1. Triton kernels' tests")
    results["triton tests"] = step_triton_tests(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        print("== 2. engine vs transformers, token-exact (float32)")
        results["token-exact"] = step_token_exact(args.device, Path(tmp))
        if not args.skip_speed:
            print(f"== 3. W1 / W2 (bf16, SmolLM2-135M shape, medians of {args.runs})")
            for k, v in step_speed(args.device, Path(tmp), args.runs, args.w2_requests).items():
                print(f"  {k}: {v:.1f}")
    for k, ok in results.items():
        print(f"{'PASS' if ok else 'FAIL'}: {k}")
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
