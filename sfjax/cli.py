"""The ``sfjax`` command: ``sfjax generate "def fib(n):"``."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time


def _generate(args) -> int:
    from sfjax import LLM, SamplingParams

    prompts = list(args.prompts)
    if args.file:
        with open(args.file) as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        raise ValueError("no prompts: give them as arguments or with --file")
    params = SamplingParams(temperature=args.temperature, seed=args.seed, max_tokens=args.max_tokens,
                            ignore_eos=args.ignore_eos)
    t0 = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len, seed=args.seed or 0)
    t1 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=not args.json)
    t2 = time.perf_counter()
    if args.json:
        print(json.dumps([{"prompt": o.prompt, "text": o.outputs[0].text,
                           "token_ids": o.outputs[0].token_ids,
                           "finish_reason": o.outputs[0].finish_reason} for o in outs], indent=2))
        return 0
    for o in outs:
        print(f"Prompt: {o.prompt!r}, Generated text: {o.outputs[0].text!r}")
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"load {t1 - t0:.2f} s; generate {n} tokens in {t2 - t1:.2f} s (includes compilation)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sfjax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text for prompts")
    g.add_argument("prompts", nargs="*", help="prompt strings")
    g.add_argument("--file", help="a file of prompts, one per line")
    g.add_argument("--model", default=None, help="HF model folder (default: the embedded model)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--json", action="store_true", help="print JSON instead of text")
    g.set_defaults(run=_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.json else logging.INFO, format="%(message)s")
    try:
        return args.run(args)
    except (ValueError, OSError) as e:
        print(f"sfjax {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
