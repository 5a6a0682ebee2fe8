"""Generate on every chip of a TPU pod (or several hosts, or several processes on one machine).

Every host runs this same command; ``jax.distributed.initialize()`` joins them, the (data, model)
mesh spans all of their devices, and process 0 alone prints the results.

    # a TPU pod slice: every worker, no distributed flags (the TPU runtime tells JAX the rest)
    gcloud compute tpus tpu-vm ssh NAME --zone=ZONE --worker=all --command="cd sfjax && \\
        python scripts/tpu_pod_generate.py --model /data/llama-export --prompts prompts.txt \\
        --tensor-parallel-size 4 --compilation-cache-dir /data/jax-cache"

    # elsewhere (GPU hosts, or CPU processes on one machine): say who is who
    python scripts/tpu_pod_generate.py --coordinator-address 10.0.0.1:1234 --num-processes 2 \\
        --process-id 0 --model M --prompts P     # and --process-id 1 on the other host

The distributed flags fall back to JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID;
with none of them set, ``initialize()`` auto-detects (Cloud TPU, Slurm, Open MPI) or, with
``--num-processes 1``, is skipped. ``--model`` is an HF folder (every process reads the whole
safetensors and keeps its shards) or an ``sfjax convert`` export (its orbax checkpoint restores
straight into the shards: each process reads only its own). ``--prompts`` is a file of prompts,
one per line, or JSONL (``.jsonl``) with "prompt" or "prompt_token_ids" per line. The mesh is
``--tensor-parallel-size`` x ``--data-parallel-size`` (default: all devices / tp), over
``jax.devices()`` in order, so tensor parallelism stays inside a host when tp <= its chips.
Outputs are the same tokens, bit for bit, as one device gives (docs/tpu-pods.md).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

import jax


def _env_int(name: str) -> int | None:
    return int(os.environ[name]) if os.environ.get(name) else None


def init_distributed(args) -> None:
    """Joins the other processes (before any JAX computation); nothing for a single process."""
    num = args.num_processes if args.num_processes is not None else _env_int("JAX_NUM_PROCESSES")
    pid = args.process_id if args.process_id is not None else _env_int("JAX_PROCESS_ID")
    if num is not None and num < 1:
        raise ValueError(f"--num-processes (or JAX_NUM_PROCESSES) {num} must be >= 1")
    if pid is not None and (pid < 0 or num is not None and pid >= num):
        raise ValueError(f"--process-id (or JAX_PROCESS_ID) {pid} must be in [0, {num}), "
                         f"--num-processes")
    if num == 1:
        return
    # CPU processes talk over gloo, jax's default jax_cpu_collectives_implementation (>= 0.10.2)
    try:
        jax.distributed.initialize(coordinator_address=args.coordinator_address,
                                   num_processes=num, process_id=pid)
    except ValueError as e:         # no cluster detected and not told
        raise ValueError(f"jax.distributed.initialize: {e} No cluster was detected (Cloud TPU, "
                         "Slurm, Open MPI): give --coordinator-address, --num-processes and "
                         "--process-id, or --num-processes 1 for a single process") from None


def read_prompts(path: str) -> list:
    """Prompt strings, one a line; or, for ``.jsonl``, "prompt" / "prompt_token_ids" records."""
    with open(path) as f:
        lines = [line.rstrip("\n") for line in f]
    if not path.endswith(".jsonl"):
        return [line for line in lines if line.strip()]
    prompts = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError as e:
            raise ValueError(f"--prompts {path!r} line {n}: not valid JSON ({e})") from None
        if not isinstance(rec, dict) or not {"prompt", "prompt_token_ids"} & set(rec):
            raise ValueError(f"--prompts {path!r} line {n}: expected an object with 'prompt' or "
                             "'prompt_token_ids'")
        prompts.append(rec)
    return prompts


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="an HF folder or an `sfjax convert` export")
    p.add_argument("--prompts", required=True, help="a file: one prompt a line, or .jsonl")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--data-parallel-size", type=int, default=None, help="default: devices / tp")
    p.add_argument("--coordinator-address", default=None, help="host:port of process 0")
    p.add_argument("--num-processes", type=int, default=None)
    p.add_argument("--process-id", type=int, default=None)
    p.add_argument("--compilation-cache-dir", default=None,
                   help="jax's persistent compilation cache (e.g. on a shared disk): a second "
                        "run loads the compiled steps instead of compiling them")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None, help="per-request seed (sampling)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--speculative-config", default=None, help="JSON, as `sfjax generate`'s")
    p.add_argument("--json", action="store_true", help="print JSON (prompt, text, token_ids)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except (ValueError, OSError) as e:      # bad input: one line (on every process), exit code 2
        print(f"tpu_pod_generate: error: {e}", file=sys.stderr)
        return 2


def run(args) -> int:
    init_distributed(args)
    if args.compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", args.compilation_cache_dir)
    lead = jax.process_index() == 0
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("sfjax").setLevel(logging.INFO if lead and not args.json else logging.WARNING)

    from sfjax import LLM, SamplingParams       # after initialize(): JAX must not start first
    from sfjax.cli import _json_object

    tp, dp = args.tensor_parallel_size, args.data_parallel_size
    for flag, value in (("--tensor-parallel-size", tp), ("--data-parallel-size", dp)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} {value} must be >= 1")
    dp = dp or max(1, jax.device_count() // tp)
    if jax.process_count() > 1 and tp * dp != jax.device_count():
        raise ValueError(f"tensor_parallel_size {tp} x data_parallel_size {dp} = {tp * dp} devices; "
                         f"across processes the mesh must span all {jax.device_count()}")
    prompts = read_prompts(args.prompts)
    t0 = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, tensor_parallel_size=tp, data_parallel_size=dp,
              max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              block_size=args.block_size,
              speculative_config=_json_object("--speculative-config", args.speculative_config,
                                              '{"method": "ngram", "num_speculative_tokens": 3}'))
    t1 = time.perf_counter()
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            seed=args.seed, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    outs = llm.generate(prompts, params, use_tqdm=lead and not args.json)
    t2 = time.perf_counter()
    if not lead:
        return 0
    if args.json:
        print(json.dumps([{"prompt": o.prompt, "text": o.outputs[0].text,
                           "token_ids": o.outputs[0].token_ids,
                           "finish_reason": o.outputs[0].finish_reason} for o in outs]))
        return 0
    for o in outs:
        print(f"Prompt: {o.prompt!r}, Generated text: {o.outputs[0].text!r}")
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"{jax.process_count()} processes, {jax.device_count()} devices, mesh data {dp} x model "
          f"{tp}; load {t1 - t0:.2f} s; generate {n} tokens in {t2 - t1:.2f} s (with compilation)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
