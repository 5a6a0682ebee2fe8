"""Tokens/s of a llama-160m-shaped model on 1, 2, 4 and 8 fake CPU devices (tensor / data parallel).

Run (a few minutes on 2 cores):
    nice -n 19 python scripts/bench_tp.py
    python scripts/bench_tp.py [--meshes 1x1,2x1,4x1,4x2] [--batch 8] [--prompt-len 64]
                               [--max-tokens 32] [--workdir DIR] [--smoke]

Fake devices share the same CPU cores, so no speed-up is expected: the figure catches
pathological communication (a mesh far slower than its compute share would explain). The model is
JackFram/llama-160m's shape (12 layers, d 768, 12 heads, ffn 3072, vocabulary 32000) with random
weights from seed 0 (stored bfloat16 in an HF folder, served float32); llama-160m's 12 heads rule
out tp 8 (tp must divide 8 and the heads), so 8 devices run tp 4 x dp 2. Each mesh ``TPxDP`` gets
--batch requests of --prompt-len random ids (fixed seed) and generates exactly --max-tokens tokens
greedily (EOS ignored) through ``LLM(..., tensor_parallel_size=TP, data_parallel_size=DP)``: a
warm-up run first (it compiles every shape the run uses), then a timed run (sfjax.benchmark's
``run_engine``). Output tok/s = batch * max_tokens / duration (prefill included); TPOT is the
median time per output token after the first. Every mesh's tokens must equal one device's.
"""

from __future__ import annotations

import os

# fake CPU devices: set before JAX starts its backend
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""),
                                    "--xla_force_host_platform_device_count=8"]).strip()

import argparse  # noqa: E402
import atexit  # noqa: E402
import dataclasses  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from sfjax import LLM, SamplingParams, toy  # noqa: E402
from sfjax import benchmark as B  # noqa: E402


def model_folder(workdir: str, smoke: bool) -> str:
    cfg = (toy.tiny_config(num_heads=8, num_kv_heads=4, head_dim=8) if smoke
           else toy.llama_160m_config())
    cfg = dataclasses.replace(cfg, dtype="bfloat16")                 # half the bytes on disk
    path = os.path.join(workdir, "tiny" if smoke else "llama-160m-random")
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        toy.build_model_folder(path, cfg, seed=0)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--meshes", default="1x1,2x1,4x1,4x2", help="TPxDP, comma-separated")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--workdir", default=None, help="keeps the model folder between runs")
    p.add_argument("--smoke", action="store_true", help="a tiny model, 8 tokens: checks the script")
    args = p.parse_args()
    if args.smoke:
        args.max_tokens, args.prompt_len = 8, 16
    workdir = args.workdir
    if workdir is None:                 # a scratch folder, removed at exit
        workdir = tempfile.mkdtemp(prefix="sfjax-bench-tp-")
        atexit.register(shutil.rmtree, workdir, ignore_errors=True)
    folder = model_folder(workdir, args.smoke)
    meshes = [tuple(int(v) for v in m.split("x")) for m in args.meshes.split(",")]
    print(f"jax {jax.__version__}, {jax.device_count()} fake {jax.default_backend()} devices, "
          f"{os.cpu_count()} cores; batch {args.batch} x {args.prompt_len} prompt ids, "
          f"{args.max_tokens} tokens each, greedy")
    print("| devices | tp x dp | compile + warm-up (s) | duration (s) | output tok/s | "
          "TPOT median (ms) | tokens = 1 device |")
    print("|---|---|---|---|---|---|---|")
    params = SamplingParams(temperature=0, ignore_eos=True)
    first = None
    for tp, dp in meshes:
        llm = LLM(folder, dtype="float32", tensor_parallel_size=tp, data_parallel_size=dp,
                  max_num_seqs=args.batch, max_model_len=args.prompt_len + args.max_tokens,
                  enable_prefix_caching=False)
        work = B.random_workload(args.batch, args.prompt_len, args.max_tokens,
                                 llm.model_config.vocab_size, seed=0)
        t0 = time.monotonic()
        B.run_engine(llm, work, params)
        warm = time.monotonic() - t0
        r = B.run_engine(llm, work, params)
        first = r["tokens"] if first is None else first
        print(f"| {tp * dp} | {tp} x {dp} | {warm:.1f} | {r['duration']:.2f} | "
              f"{r['output_tokens'] / r['duration']:.1f} | {1e3 * np.median(r['tpot']):.1f} | "
              f"{'yes' if r['tokens'] == first else 'NO'} |", flush=True)
        del llm
        jax.clear_caches()


if __name__ == "__main__":
    main()
