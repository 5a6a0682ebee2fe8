"""The ``sfjax`` command: ``sfjax generate "def fib(n):"``, ``sfjax bench``."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from sfjax import benchmark as B
from sfjax.default_model import default_speculative_config


def _json_object(flag: str, text: str | None, example: str, default=None):
    """A flag's JSON object (``default`` when the flag is not given); a ValueError naming the
    flag otherwise."""
    if not text:
        return default
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{flag} is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object, e.g. '{example}'")
    return value


def _llm(args, default_spec: dict | None = None):
    from sfjax import LLM

    spec = _json_object("--speculative-config", args.speculative_config,
                        '{"method": "ngram", "num_speculative_tokens": 4}', default_spec)
    options = _json_object("--compiler-options", args.compiler_options,
                           '{"xla_gpu_autotune_level": 0}')
    return LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len, seed=args.seed or 0,
               block_size=args.block_size, max_num_seqs=args.max_num_seqs,
               max_num_batched_tokens=args.max_num_batched_tokens,
               enable_prefix_caching=not args.no_prefix_caching,
               num_scheduler_steps=args.num_scheduler_steps, speculative_config=spec,
               async_scheduling=not args.no_async_scheduling,
               small_row_tiles=not args.no_small_row_tiles, attention=args.attention,
               compiler_options=options, num_kv_blocks=args.num_kv_blocks,
               **({} if args.kv_cache_bytes is None else {"kv_cache_bytes": args.kv_cache_bytes}))


def _params(args, **over):
    from sfjax import SamplingParams

    return SamplingParams(**{**dict(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        seed=args.seed, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos,
        stop=args.stop or None), **over})


def _acceptance(llm) -> str:
    m = llm.get_metrics().get("spec_decode")
    if m is None:
        return ""
    return (f"; acceptance rate {m['acceptance_rate']:.2f}, "
            f"mean acceptance length {m['mean_acceptance_length']:.2f}")


def _generate(args) -> int:
    prompts = list(args.prompts)
    if args.file:
        try:
            with open(args.file) as f:
                prompts += [line.rstrip("\n") for line in f if line.strip()]
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--file {args.file}: {e.strerror if isinstance(e, OSError) else e}") from None
    if not prompts:
        raise ValueError("no prompts: give them as arguments or with --file")
    from sfjax import checks

    for i, prompt in enumerate(prompts):               # before anything is loaded
        checks.text(f"prompt {i}", prompt)
    params = _params(args)
    t0 = time.perf_counter()
    llm = _llm(args, default_speculative_config() if args.model is None else None)
    if not args.json:
        print(f"model: {_model_name(args)}; speculation: {_method(llm)}", flush=True)
    compile_s = llm.engine.precompile(progress=not args.json) if args.precompile else None
    t1 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=not args.json)
    t2 = time.perf_counter()
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    load_s, gen_s = t1 - t0 - (compile_s or 0), t2 - t1
    if args.json:
        spec = llm.get_metrics().get("spec_decode")
        print(json.dumps({
            "model": _model_name(args), "speculation": _method(llm),
            "timings": {"load_s": load_s, "compile_s": compile_s, "generate_s": gen_s,
                        "output_tokens": n, "output_tokens_per_s": n / max(gen_s, 1e-9),
                        # without --precompile, generate_s holds the compiles it met
                        "generate_includes_compile": compile_s is None},
            "spec_decode": None if spec is None else {
                k: spec[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens",
                                     "acceptance_rate", "mean_acceptance_length")},
            "outputs": [{"prompt": o.prompt, "text": o.outputs[0].text,
                         "token_ids": o.outputs[0].token_ids,
                         "finish_reason": o.outputs[0].finish_reason,
                         "spec_decode": o.metrics.spec_decode} for o in outs]}, indent=2))
        return 0
    for o in outs:
        print(f"Prompt: {o.prompt!r}, Generated text: {o.outputs[0].text!r}")
    compiled = (f"compile {compile_s:.2f} s; generate {n} tokens in {gen_s:.2f} s"
                if compile_s is not None else
                f"generate {n} tokens in {gen_s:.2f} s (includes compilation)")
    print(f"load {load_s:.2f} s; {compiled}{_acceptance(llm)}")
    return 0


def _model_name(args) -> str:
    return args.model if args.model is not None else "the embedded default (sfjax/default/target)"


def _method(llm) -> str:
    spec = llm.engine.spec
    if spec is None:
        return "off"
    c = spec.config
    extra = (f", lookup {c.prompt_lookup_min}..{c.prompt_lookup_max}"
             + (", n-gram table" if c.prompt_lookup_table else "") if c.method == "ngram"
             else f", {'head' if c.method == 'eagle3' else 'draft'} {c.model}")
    k = f"adaptive, <= {c.num_speculative_tokens}" if c.adaptive_k else c.num_speculative_tokens
    return f"{c.method} (k = {k}{extra}, {c.acceptance_method} acceptance)"


def _bench(args) -> int:
    B.check_args(args, offline=True)                   # before anything is loaded
    params = _params(args, ignore_eos=True, stop=None)
    prompts = B.read_prompts(args.prompts_file, args.num_prompts) if args.prompts_file else None
    llm = _llm(args)
    if prompts is not None:
        work = B.tokenized(prompts, llm.get_tokenizer(), args.output_len)
    else:
        work = B.random_workload(args.num_prompts or 32, args.input_len, args.output_len,
                                 llm.model_config.vocab_size, args.seed or 0)
    if args.precompile:
        compile_s = llm.engine.precompile(progress=not args.json)
        if not args.json:
            print(f"compiled every shape bucket in {compile_s:.2f} s")
    warm, _ = B.warm_up(llm, lambda: B.run_engine(llm, work, params))   # compiles every shape
    passes = {"sfjax": lambda: B.run_engine(llm, work, params)}
    if args.compare_hf:
        modes = {"plain": {}}
        spec = llm.engine.spec
        k = spec.k_max if spec else 4
        modes["prompt_lookup"] = {"prompt_lookup_num_tokens": k}
        if spec is not None and spec.config.method == "draft_model":
            modes["assisted"] = {"assistant_model": str(spec.config.model),
                                 "num_assistant_tokens": k,
                                 "num_assistant_tokens_schedule": "constant"}
        passes.update(B.hf_passes(llm.model_path, work, args.temperature, modes))
    best: dict[str, dict] = {}
    for _ in range(args.repeats):                      # interleaved: sfjax, then each HF mode
        for name, one_pass in passes.items():
            x = one_pass()
            if name not in best or x["duration"] < best[name]["duration"]:
                best[name] = x
    r = best.pop("sfjax")
    result = {"sfjax": r, "compile_and_warmup_s": warm}
    if not args.json:
        print(B.report(r))
        print(f"(compilation and warm-up, before the timed run: {warm:.2f} s)")
    if args.compare_hf:
        hf = best
        result["hf"] = hf
        ours = r["output_tokens"] / r["duration"]
        if not args.json:
            import torch                                  # hf_passes imported it
            print(f"{' HF transformers (batch 1, same prompt ids) ':=^50}")
            print(f"{'torch threads:':<40}{torch.get_num_threads()}")
            for name, h in hf.items():
                rate = h["output_tokens"] / h["duration"]
                print(f"{f'HF {name} (tok/s):':<40}{rate:<10.2f} sfjax / HF: {ours / rate:.2f}x")
            best = max(h["output_tokens"] / h["duration"] for h in hf.values())
            print(f"{'sfjax / HF best:':<40}{ours / best:.2f}x")
            if args.temperature == 0 and any(h["tokens"] != r["tokens"] for h in hf.values()):
                print("note: some HF greedy tokens differ from sfjax's (float ties or dtype)")
    if args.json:
        strip = lambda d: {k: v for k, v in d.items() if k != "tokens"}
        result["sfjax"] = strip(r)
        result["hf"] = {k: strip(v) for k, v in result.get("hf", {}).items()}
        print(json.dumps(result, indent=2, default=float))
    return 0


# carried over as they are: the tokenizer (fast, or a slow one's files), the generation config,
# and an n-gram draft table
CARRIED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json",
                 "chat_template.jinja", "generation_config.json", "ngram_table.safetensors")


def _convert(args) -> int:
    """An HF folder to an orbax export (config.json, tokenizer files, n-gram table, orbax/), or
    back."""
    import os
    import shutil

    from sfjax import weights as W
    from sfjax.config import ModelConfig

    src, dst = args.src, args.dst
    if not os.path.isfile(os.path.join(src, "config.json")):
        raise ValueError(f"src: {src!r} is not a model folder (no config.json)")
    if os.path.exists(dst) and os.listdir(dst):
        raise ValueError(f"dst: {dst!r} exists and is not empty")
    cfg = ModelConfig.from_folder(src, args.dtype)
    to_orbax = not os.path.isdir(os.path.join(src, W.ORBAX_DIR))
    if to_orbax:
        W.save_orbax(dst, cfg, W.load_hf(src, cfg))
    else:
        W.save_hf(dst, cfg, W.load_orbax(src, cfg))
    for name in CARRIED_FILES:
        if os.path.isfile(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), dst)
    print(f"wrote {'an orbax checkpoint' if to_orbax else 'an HF folder'} to {dst}")
    return 0


def _common(p: argparse.ArgumentParser, requests: bool = True) -> None:
    """The engine's flags; with ``requests``, also the sampling and output flags a command's own
    requests take (``sfjax serve`` takes them from each HTTP request instead)."""
    p.add_argument("--model", default=None,
                   help="HF model folder (default: the embedded model; generate and serve then "
                        "draft with its n-gram table, adaptive k, and bench runs it plain, unless "
                        "--speculative-config says otherwise)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV cache pages (default: enough for --max-num-seqs full sequences within "
                        "--kv-cache-bytes)")
    p.add_argument("--kv-cache-bytes", type=int, default=None,
                   help="bytes of KV pages per device when --num-kv-blocks is not given "
                        "(default 1 GiB)")
    p.add_argument("--max-num-seqs", type=int, default=32, help="requests running at once")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per step (prefill chunks and decode rows); default max(512, seqs)")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--num-scheduler-steps", type=int, default=8,
                   help="decode rounds per host call while every request decodes (1..1024)")
    p.add_argument("--no-async-scheduling", action="store_true",
                   help="read every call back before sending the next (by default, while every "
                        "request decodes and no waiting one has a free slot, the next call is "
                        "sent first)")
    p.add_argument("--attention", default="auto",
                   help="paged attention: auto (the Pallas kernel on GPU/TPU, the reference by query "
                        "blocks on CPU), reference, reference_tiles (faster for batched CPU serving), "
                        "triton, mosaic_tpu, interpret")
    p.add_argument("--compiler-options", default=None,
                   help="XLA options for every program the engine compiles, as a JSON object, "
                        "e.g. '{\"xla_gpu_autotune_level\": 0}'")
    p.add_argument("--no-small-row-tiles", action="store_true",
                   help="run every step in tiles of 8 rows, also where a tile of 2 or 4 is "
                        "certified to keep the bits (CPU)")
    p.add_argument("--cpu-threads", type=int, default=None,
                   help="XLA:CPU's intra-op threads (default: one per core). At batch 1 on a "
                        "small model 1 is faster: the host thread then has a core of its own")
    p.add_argument("--speculative-config", default=None,
                   help='JSON, as vLLM\'s: \'{"method": "ngram", "num_speculative_tokens": 4}\' or '
                        '\'{"method": "draft_model", "model": "path/to/draft", '
                        '"num_speculative_tokens": 4}\'')
    p.add_argument("--seed", type=int, default=None,
                   help="the engine's seed, which keys the draws of requests without a seed of "
                        "their own" + ("; and the requests' seed" if requests else ""))
    p.add_argument("--precompile", action="store_true",
                   help="compile every shape bucket at start (a progress bar), timed apart")
    if requests:
        p.add_argument("--temperature", type=float, default=0.0)
        p.add_argument("--top-p", type=float, default=1.0)
        p.add_argument("--top-k", type=int, default=0)
        p.add_argument("--min-p", type=float, default=0.0)
        p.add_argument("--json", action="store_true", help="print JSON instead of text")


def engine_flags() -> dict[str, tuple[str, object]]:
    """The engine's flags (``_common``'s without the requests'): flag -> (dest, default)."""
    p = argparse.ArgumentParser(add_help=False)
    _common(p, requests=False)
    return {a.option_strings[0]: (a.dest, a.default) for a in p._actions}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sfjax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text for prompts")
    g.add_argument("prompts", nargs="*", help="prompt strings")
    g.add_argument("--file", help="a file of prompts, one per line")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--stop", action="append", help="a stop string (repeatable)")
    _common(g)
    g.set_defaults(run=_generate)
    b = sub.add_parser("bench", help="latency and throughput with vLLM's labels; --compare-hf",
                       description=B.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("--prompts-file", help="prompts, one per line (or .jsonl with 'prompt')")
    b.add_argument("--num-prompts", type=int, default=None, help="default: 32 random, or the file's")
    b.add_argument("--input-len", type=int, default=128, help="random prompts: tokens each")
    b.add_argument("--output-len", type=int, default=128, help="new tokens per request (EOS ignored)")
    b.add_argument("--repeats", type=int, default=3,
                   help="timed runs after the warm-up, sfjax and each HF mode in turn; the fastest of each is reported")
    b.add_argument("--compare-hf", action="store_true",
                   help="also run HF transformers generate (plain, prompt lookup, assisted) on the "
                        "same prompt ids, one at a time, and print the ratios (needs torch)")
    _common(b)
    b.set_defaults(run=_bench, max_tokens=None, ignore_eos=True, stop=None)
    from sfjax.serve import cli as serve_cli      # sfjax serve, and bench --base-url
    serve_cli.add_bench_args(b, offline=_bench)
    serve_cli.add_parser(sub, lambda p: _common(p, requests=False))
    c = sub.add_parser("convert", help="an HF model folder to an orbax checkpoint, or back",
                       description="sfjax convert SRC DST: SRC an HF folder -> DST with config.json, "
                                   "the tokenizer files and the weights as an orbax checkpoint "
                                   "(orbax/); SRC such an export -> DST an HF folder (safetensors).")
    c.add_argument("src")
    c.add_argument("dst", help="a new or empty folder")
    c.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    c.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    c.set_defaults(run=_convert)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # sfjax's own messages; not JAX's backend probing ("Unable to initialize backend 'tpu'")
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("sfjax").setLevel(logging.WARNING if getattr(args, "json", False)
                                        else logging.INFO)
    try:
        if getattr(args, "cpu_threads", None) is not None:
            from sfjax.cpu import limit_cpu_threads
            try:
                limit_cpu_threads(args.cpu_threads)
            except RuntimeError as e:       # a platform without thread affinity (not Linux)
                raise ValueError(f"--cpu-threads {args.cpu_threads}: {str(e).split(': ', 1)[-1]}") from None
        return args.run(args)
    except (ValueError, OSError) as e:   # JSONDecodeError and checks.InvalidType are ValueErrors
        print(f"sfjax {args.command}: error: {_one_line(e)}", file=sys.stderr)
        return 2


def _one_line(e: BaseException) -> str:
    """The error on one printable line (a non-UTF-8 argument holds lone surrogates)."""
    text = " ".join(str(e).split())
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


if __name__ == "__main__":
    sys.exit(main())
