"""Engine flags shared by `fitserve generate`, `fitserve serve` and `fitserve profile`, and the
EngineConfig they build (vLLM keeps its EngineArgs beside the engine too: vllm/engine/arg_utils).

Here, in the engine's layer, so the CLI and the offline tools both import it and neither imports
the other.
"""

from __future__ import annotations

import argparse
import json
from typing import Any, get_args

from fitserve.config import (
    SCHEDULING_POLICIES,
    SLO_ACTIONS,
    DType,
    EngineConfig,
    Quantization,
    SpeculativeConfig,
)
from fitserve.ledger.formats import ENGINE_KV_CACHE_DTYPES, ENGINE_WEIGHT_CHOICES, KV_CACHE_SCALES


def parse_bytes_arg(text: str) -> int:
    """argparse type for sizes like 512M or 2G, read by the planner's parser so both agree."""
    from fitserve.ledger.units import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_speculative_config_arg(text: str) -> SpeculativeConfig:
    """argparse type for ``--speculative-config``: a JSON object in vLLM's spelling, checked now.

    Bad JSON, a value that is not an object, an unknown key, a bad method or an out-of-range
    ``num_speculative_tokens`` is an ArgumentTypeError, so argparse exits 2 naming the flag.
    """
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(
            f"must be a JSON object such as '{{\"method\": \"ngram\", \"num_speculative_tokens\": 4}}', "
            f"got {text!r}")
    try:
        return SpeculativeConfig.from_dict(value)
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_chat_template_arg(text: str) -> str:
    """argparse type for ``--chat-template``: a Jinja file or the template text, compiled now.

    A template that does not compile, or a path that cannot be read, is an ArgumentTypeError,
    so argparse exits 2 naming the flag before any model loads.
    """
    from fitserve.loading.chat_template import ChatTemplateError, load_chat_template

    try:
        return load_chat_template(text)
    except ChatTemplateError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_chat_template_arg(p: argparse.ArgumentParser) -> None:
    """``--chat-template`` (vLLM's flag), for the commands that render chats."""
    p.add_argument("--chat-template", type=parse_chat_template_arg, default=None, metavar="FILE|TEMPLATE",
                   help="the Jinja chat template to use instead of the model's own (a model file without "
                        "one cannot chat otherwise): a file's path, or the template text itself")


DEFAULT_MODEL = "smollm2-135m"
# vLLM's --dtype spellings that name one of fitserve's dtypes
DTYPE_ALIASES = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def parse_dtype_arg(text: str) -> str:
    """argparse type for ``--dtype``: vLLM's aliases (half, float) mapped to fitserve's names."""
    return DTYPE_ALIASES.get(text, text)


def parse_fraction_arg(text: str) -> float:
    """argparse type for ``--gpu-memory-utilization``: a fraction in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def parse_threads_arg(text: str) -> int:
    """argparse type for ``--threads``: a positive thread count."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The flags every engine-running command takes (names follow vLLM's; llama.cpp's short
    forms -m, -c and -t too)."""
    p.add_argument("--model", "-m", default=DEFAULT_MODEL,
                   help="a .gguf file, a Hugging Face folder, or a known name")
    p.add_argument("--dtype", default="auto", type=parse_dtype_arg, choices=list(get_args(DType)),
                   help="the model's activation/weight dtype; vLLM's half and float mean float16 and float32 "
                        "(the CPU kernels take float16 too)")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-model-len", "-c", "--ctx-size", dest="max_model_len", type=int, default=None,
                   help="the context length: prompt + output tokens of one request (llama.cpp's -c/--ctx-size)")
    p.add_argument("--threads", "-t", type=parse_threads_arg, default=None, metavar="N",
                   help="torch's CPU threads for the model (llama.cpp's -t; default: torch's, one per core)")
    p.add_argument("--gpu-memory-utilization", type=parse_fraction_arg, default=None, metavar="FRACTION",
                   help="vLLM's: the share of the device's memory the engine may hold (CUDA default 0.9). On CPU: "
                        "that share of the RAM available at start-up; the KV pool gets what weights and step "
                        "scratch leave (the start-up ledger prints it). --kv-cache-memory / --num-kv-blocks win")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--kv-cache-memory", type=parse_bytes_arg, default=None,
                   help="KV pool size, e.g. 512M or 2G (on CPU: reserved at start, resident as "
                        "blocks are first written)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--weights", default="auto", choices=list(ENGINE_WEIGHT_CHOICES),
                   help="how weights are held: auto/as-stored (GGUF Q4_0/Q4_1/Q8_0 packed as "
                        "stored), bf16/float32 (dense), int4/int8 (RTN at load), fp8 (e4m3, per-channel scales)")
    p.add_argument("--quantization", default=None, choices=list(get_args(Quantization)),
                   help="quantize at load (vLLM's flag; same as --weights int4/int8/fp8)")
    p.add_argument("--activation-quant", default="auto", choices=["auto", "int8", "none"],
                   help="what packed int4/int8 weights multiply: int8 (x quantized per 32 "
                        "columns, integer dots: W4A8 as llama.cpp), none (bf16/fp32 x, weight-"
                        "only: W4A16, slower, closer to the unquantized model); auto: int8 for "
                        "bf16, none for float32")
    p.add_argument("--kv-cache-dtype", default="auto", choices=list(ENGINE_KV_CACHE_DTYPES),
                   help="KV cache element format: auto (the model dtype), fp8 (= fp8_e4m3), "
                        "fp8_e5m2 or int8 codes with float32 scales (vLLM's flag)")
    p.add_argument("--kv-cache-scales", default="auto", choices=list(KV_CACHE_SCALES),
                   help="scale layout of a quantized KV cache: token (K and V per token per "
                        "head) or channel-key (K per channel per block, V per token); auto: "
                        "channel-key for int8, token for fp8")
    p.add_argument("--enforce-eager", dest="enforce_eager", action="store_true", default=True,
                   help="run every step eager (the default on CPU, see --compile)")
    p.add_argument("--compile", dest="enforce_eager", action="store_false",
                   help="run decode-only steps under torch.compile (compiled at start-up, "
                        "cached under $FITSERVE_HOME/compile)")
    p.add_argument("--enable-prefix-caching", dest="enable_prefix_caching",
                   action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV blocks of prompt prefixes earlier requests computed "
                        "(automatic prefix caching; on by default)")
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="the same as --no-enable-prefix-caching")
    p.add_argument("--scheduling-policy", default="fcfs", choices=list(SCHEDULING_POLICIES),
                   help="fcfs: first come first served; priority: by each request's priority "
                        "(lower first, then arrival; vLLM's); slo: fcfs plus the TPOT target "
                        "capping prompt chunks and TTFT admission (see --slo-ttft-ms)")
    p.add_argument("--slo-ttft-ms", type=float, default=None,
                   help="slo: time-to-first-token target; a request predicted to miss it is "
                        "rejected (429 + Retry-After) or deprioritized (--slo-action)")
    p.add_argument("--slo-tpot-ms", type=float, default=None,
                   help="slo: time-per-output-token target; caps the prompt tokens a step "
                        "with decodes may take, from the step-time model")
    p.add_argument("--slo-action", default="reject", choices=list(SLO_ACTIONS),
                   help="slo: what happens to a request predicted to miss its TTFT target")
    p.add_argument("--step-model", default=None, metavar="JSON",
                   help="slo: the step-time model file (fitserve profile --workload calibrate "
                        "writes one); default: the one saved for this model and machine under "
                        "$FITSERVE_HOME/step-models, measured at start-up when there is none")
    p.add_argument("--tensor-parallel-size", "-tp", "--tp", dest="tensor_parallel_size",
                   type=int, default=1, metavar="N",
                   help="run the model over N processes on torch.distributed (gloo), Megatron "
                        "splits: 1/N of the heads, MLP rows and vocabulary each (vLLM's flag). "
                        "Spawns N-1 workers here; under torchrun every rank runs this command")
    p.add_argument("--speculative-config", type=parse_speculative_config_arg, default=None,
                   metavar="JSON",
                   help="speculative decoding (off by default), vLLM's JSON: e.g. "
                        "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4}'. Keys: method "
                        "(ngram: prompt lookup; draft_model: a smaller model with the target's "
                        "tokenizer; eagle: an EAGLE-like head file), model (the draft's path), "
                        "num_speculative_tokens (drafts per step, 1-16), "
                        "prompt_lookup_max / prompt_lookup_min (n-gram lengths tried, default 4 / 1). "
                        "Requests with penalties or logprobs decode without drafts; greedy output "
                        "is unchanged, sampling keeps the target distribution")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the parsed engine flags describe (ValueError: flags that contradict)."""
    if getattr(args, "threads", None) is not None and args.tensor_parallel_size > 1:
        # NOTE: each tensor-parallel rank takes cores / N threads (fitserve.dist.group)
        raise ValueError("--threads/-t cannot be combined with --tensor-parallel-size > 1: each rank "
                         "takes (CPU cores / N) threads; set OMP_NUM_THREADS under torchrun instead")
    return EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
        block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_bytes=args.kv_cache_memory, max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs, weights=args.weights, quantization=args.quantization,
        activation_quant=args.activation_quant, enforce_eager=args.enforce_eager, enable_prefix_caching=args.enable_prefix_caching,
        speculative_config=args.speculative_config, kv_cache_dtype=args.kv_cache_dtype,
        kv_cache_scales=args.kv_cache_scales, scheduling_policy=args.scheduling_policy,
        slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms, slo_action=args.slo_action,
        step_model=args.step_model, tensor_parallel_size=args.tensor_parallel_size,
        **_memory_utilization(args),
    )


def _memory_utilization(args: argparse.Namespace) -> dict[str, Any]:
    """--gpu-memory-utilization as the cache config's CUDA and host fractions (absent: defaults)."""
    frac = getattr(args, "gpu_memory_utilization", None)
    return {} if frac is None else {"gpu_memory_utilization": frac, "host_memory_utilization": frac}


def apply_threads_arg(args: argparse.Namespace) -> None:
    """--threads: torch's intra-op threads of the calling thread (call it in the thread that runs
    the model: OpenMP's thread count is per thread)."""
    threads = getattr(args, "threads", None)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
