"""fitserve command line: plan | pull | generate | serve | bench | kernels | quantize | eval | profile."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from fitserve.cli.parser import FitserveArgumentParser
from fitserve.engine.args import (
    add_chat_template_arg,
    add_engine_args,
    apply_threads_arg,
    engine_config_from_args,
)


def _cmd_pull(args: argparse.Namespace) -> int:
    from fitserve.loading.pull import pull

    path = pull(args.name, progress=True)
    print(path)
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from fitserve.engine.core import Engine
    from fitserve.sampling import SamplingParams

    if args.chat_template is not None and not args.chat:
        print("fitserve generate: error: --chat-template needs --chat (a plain prompt uses no template)",
              file=sys.stderr)
        return 2
    apply_threads_arg(args)
    engine = Engine(engine_config_from_args(args))
    if args.chat_template is not None:
        engine.tokenizer.chat_template = args.chat_template  # --chat-template replaces the model's
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.seed, stop=args.stop or None, ignore_eos=args.ignore_eos,
    )
    prompt: str | list[int] = args.prompt
    if args.chat:
        text = engine.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
        prompt = engine.tokenizer.encode(text, add_special_tokens=False)
    last = None
    for out in engine.stream(prompt, params):
        sys.stdout.write(out.delta_text)
        sys.stdout.flush()
        last = out
    sys.stdout.write("\n")
    if last is not None and args.verbose:
        print(f"[{len(last.token_ids)} tokens, finish_reason={last.finish_reason.value if last.finish_reason else None}]",
              file=sys.stderr)
        from fitserve.dist.engine_tp import TPModelRunner, collectives_table

        if isinstance(engine.runner, TPModelRunner):
            print(collectives_table(engine.runner, len(last.token_ids)), file=sys.stderr)
    engine.shutdown()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = FitserveArgumentParser(prog="fitserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)  # subcommands inherit the class

    p = sub.add_parser("pull", help="fetch a known model into the local cache")
    p.add_argument("name", nargs="?", default="smollm2-135m")
    p.set_defaults(func=_cmd_pull)

    p = sub.add_parser("generate", help="generate text for one prompt, streaming tokens")
    add_engine_args(p)
    p.add_argument("prompt")
    p.add_argument("--chat", action="store_true", help="apply the chat template (the model's, or --chat-template)")
    add_chat_template_arg(p)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("-v", "--verbose", action="store_true")
    p.set_defaults(func=_cmd_generate)

    for adder in _optional_parsers():
        adder(sub)
    return parser


def _optional_parsers() -> list[Callable[[Any], object]]:
    from fitserve.cli.serve import add_serve_parser
    from fitserve.tools.bench.cli import add_bench_parser
    from fitserve.tools.eval.cli import add_eval_parser
    from fitserve.tools.labs.cli import add_kernels_parser
    from fitserve.tools.planner.cli import add_plan_parser
    from fitserve.tools.profile.cli import add_profile_parser
    from fitserve.tools.quantize.cli import add_quantize_parser

    return [add_plan_parser, add_kernels_parser, add_serve_parser, add_bench_parser,
            add_quantize_parser, add_eval_parser, add_profile_parser]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) >= 2 and argv[0] == "plan":
        from fitserve.tools.planner.sheet_index import TOOLS

        if argv[1] in TOOLS:
            # NOTE: routed before argparse: `plan` takes a model as its first positional, and a
            # tool name there is never a model (no catalog entry or file is called that).
            from fitserve.tools.sheets.sheet import run_tool

            return run_tool(argv[1], argv[2:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as exc:
        print(f"fitserve {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
