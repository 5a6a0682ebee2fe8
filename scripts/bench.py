"""Greedy-decode throughput of sfjax vs HF transformers on one random llama-68m-shaped model.

Run:
    cd /work/main && . .venv/bin/activate && python scripts/bench.py
    python scripts/bench.py --batch-sizes 1,32 --max-tokens 128 --prompt-len 96 [--repeats 3]
                            [--no-hf] [--model PATH] [--workdir DIR]

Per batch size B, each engine gets B prompts of --prompt-len random token ids (fixed seed) and
generates exactly --max-tokens tokens greedily (EOS ignored). A warm-up run comes first (sfjax
compiles its step shapes on first use; warm-up less the same work warm is reported as compile).
Then, timed with time.perf_counter around generate(), each the best of --repeats runs:
  * prefill: a max_tokens=1 run (prefill plus the first token, i.e. TTFT of the whole batch);
  * total:   the max_tokens run; tok/s = B * max_tokens / total (prefill included);
  * decode:  B * (max_tokens - 1) / (total - prefill), the rate with the prefill taken out.
Both engines run float32 on the same weights; torch uses its default thread count.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np


def bench_sfjax(folder: str, ids: list[list[int]], max_tokens: int, repeats: int) -> dict:
    import sfjax
    t = time.perf_counter()
    llm = sfjax.LLM(folder, max_num_seqs=len(ids), max_model_len=len(ids[0]) + max_tokens)
    load = time.perf_counter() - t
    prompts = [{"prompt_token_ids": p} for p in ids]

    def gen(n):
        sp = sfjax.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t
        toks = [o.outputs[0].token_ids for o in outs]
        assert all(len(x) == n for x in toks), "sfjax returned a wrong number of tokens"
        return dt, toks

    warm = gen(max_tokens)[0] + gen(1)[0]    # compiles the shapes of both timed runs
    return timed(gen, len(ids), max_tokens, repeats, load=load, warm=warm, warm_prefill=True)


def bench_hf(folder: str, ids: list[list[int]], max_tokens: int, repeats: int) -> dict:
    import torch
    from transformers import LlamaForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    t = time.perf_counter()
    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    load = time.perf_counter() - t
    x = torch.tensor(ids, dtype=torch.long)   # equal lengths: no padding needed

    def gen(n):
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                 max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
        dt = time.perf_counter() - t
        toks = out[:, x.shape[1]:].tolist()
        assert all(len(r) == n for r in toks), "HF returned a wrong number of tokens"
        return dt, toks

    warm = gen(max_tokens)[0]
    return timed(gen, len(ids), max_tokens, repeats, load=load, warm=warm, warm_prefill=False)


def timed(gen, b: int, n: int, repeats: int, warm_prefill: bool, **r) -> dict:
    """Best-of-``repeats`` prefill (max_tokens=1) and full runs, keeping the full run's tokens;
    compile = warm-up time less the same runs warm (the first-call cost)."""
    r["prefill"] = min(gen(1)[0] for _ in range(repeats))
    runs = [gen(n) for _ in range(repeats)]
    r["total"], r["tokens"] = min(runs, key=lambda x: x[0])
    r["spread"] = max(x[0] for x in runs) / r["total"]
    r["compile"] = r["warm"] - r["total"] - (r["prefill"] if warm_prefill else 0.0)
    r["tok_s"] = b * n / r["total"]
    r["decode_tok_s"] = b * (n - 1) / max(r["total"] - r["prefill"], 1e-9) if n > 1 else float("nan")
    return r


def machine() -> str:
    import jax
    import transformers
    try:
        import torch
        tv, threads = torch.__version__, torch.get_num_threads()
    except ImportError:
        tv, threads = "absent", "-"
    return (f"cpus: os.cpu_count()={os.cpu_count()}, usable={len(os.sched_getaffinity(0))} | "
            f"jax {jax.__version__} backend={jax.default_backend()} devices={jax.devices()} | "
            f"torch {tv} (get_num_threads={threads}) | transformers {transformers.__version__} | "
            f"loadavg {os.getloadavg()[0]:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", default="1,32")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per measurement (best kept)")
    ap.add_argument("--no-hf", action="store_true", help="skip the HF transformers peer")
    ap.add_argument("--model", help="an existing HF folder (default: build a random llama-68m)")
    ap.add_argument("--workdir", help="where to build the model (default: a temp dir)")
    args = ap.parse_args()
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    n = args.max_tokens
    print(machine(), flush=True)

    tmp = None
    folder = args.model
    if folder is None:
        import sfjax.toy
        if args.workdir is None:
            tmp = tempfile.TemporaryDirectory(prefix="sfjax-bench-")
        folder = os.path.join(args.workdir or tmp.name, "llama-68m-random")
        t = time.perf_counter()
        sfjax.toy.build_model_folder(folder, sfjax.toy.llama_68m_config(), seed=0)
        print(f"built random llama-68m (float32) at {folder} in {time.perf_counter() - t:.1f}s")
    with open(os.path.join(folder, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    print(f"model: {folder} | prompt_len={args.prompt_len} max_tokens={n} greedy, ignore_eos",
          flush=True)

    rows = []
    for b in batch_sizes:
        ids = np.random.default_rng(0).integers(2, vocab, (b, args.prompt_len)).tolist()
        engines = [("sfjax", bench_sfjax)] + ([] if args.no_hf else [("hf", bench_hf)])
        res = {}
        for name, fn in engines:
            res[name] = fn(folder, ids, n, args.repeats)
            r = res[name]
            print(f"B={b:<3} {name:<5} load {r['load']:.2f}s  warm-up {r['warm']:.2f}s "
                  f"(~{r['compile']:.2f}s over a warm run)  "
                  f"prefill {r['prefill']:.3f}s  total {r['total']:.3f}s  "
                  f"{r['tok_s']:.1f} tok/s  decode-only {r['decode_tok_s']:.1f} tok/s  "
                  f"(slowest/best of {args.repeats}: {r['spread']:.2f})", flush=True)
        if "hf" in res:
            same = sum(a == h for a, h in zip(res["sfjax"]["tokens"], res["hf"]["tokens"]))
            print(f"B={b:<3} greedy outputs identical to HF: {same}/{b} sequences", flush=True)
        rows.append((b, res))

    print(f"\n{'B':>3} {'engine':<6} {'compile s':>9} {'prefill s':>9} {'total s':>8} "
          f"{'tok/s':>8} {'decode tok/s':>12} {'sfjax/HF':>9} {'decode ratio':>12}")
    for b, res in rows:
        for name, r in res.items():
            ratio = dratio = ""
            if name == "sfjax" and "hf" in res:
                ratio = f"{r['tok_s'] / res['hf']['tok_s']:.3f}"
                dratio = f"{r['decode_tok_s'] / res['hf']['decode_tok_s']:.3f}"
            print(f"{b:>3} {name:<6} {r['compile']:>9.2f} {r['prefill']:>9.3f} {r['total']:>8.3f} "
                  f"{r['tok_s']:>8.1f} {r['decode_tok_s']:>12.1f} {ratio:>9} {dratio:>12}")
    print("compile s: warm-up time less the same work warm (sfjax: jit compiles; HF: first-call cost)."
          "\ntok/s counts generated tokens only (B * max_tokens) over the whole generate() call, "
          "prefill included;\ndecode tok/s = B * (max_tokens - 1) / (total - prefill).")
    print(f"1-min loadavg at the end: {os.getloadavg()[0]:.2f} (this run alone adds about "
          f"{len(os.sched_getaffinity(0))}; much more means other work shared the CPUs)")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
