"""Serving benchmark: many requests at once through the engine, with and without memory pressure,
and prefix caching on a shared-prefix workload; HF transformers static batching as the peer.

Run:
    python scripts/bench_serving.py
    python scripts/bench_serving.py [--requests 256] [--max-num-seqs 32] [--no-hf] [--workdir DIR]
                                    [--quiet-wait SECONDS] [--smoke]

Model: a random llama-68m-shaped Llama (float32), built from a seed. Workloads (fixed seeds):
  * random: --requests prompts of 16..128 random ids, each with its own max_tokens in 16..96,
    greedy, EOS ignored, all submitted at once (offline serving);
  * shared-prefix: --requests prompts, each one of 8 random 192-token "system prompts" followed
    by an 8..32-token tail, 32 new tokens each.
Rows (each workload is run twice on one engine; the second, warm run is reported, and the first
run's extra time is reported as compile):
  * sfjax roomy: a KV cache large enough for max_num_seqs full sequences (no preemption);
  * sfjax pressed: a cache of --pressed-blocks 16-token blocks, so requests are preempted and
    recomputed; its outputs must equal roomy's (checked); once without the prefix cache (all of a
    preempted request is recomputed) and once with it (what was not evicted is reused);
    the roomy and pressed rows run with the prefix cache off unless said;
  * sfjax prefix cache off / on on the shared-prefix workload: outputs must be equal (checked);
    the hit rate is vLLM's (prompt tokens served from the cache / prompt tokens looked up);
  * HF: generate() over static batches of max_num_seqs requests in arrival order (left-padded,
    each batch runs to its longest max_tokens; only the requested tokens are counted).
Output tok/s = requested output tokens / wall time; latency = a request's finish time - the
submit time (everything is submitted at t = 0), mean over requests.
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import OtherCpu, end_note, load_hf, machine, wait_quiet  # noqa: E402


def workloads(n: int, vocab: int, smoke: bool) -> dict:
    rng = np.random.default_rng(0)
    hi = 32 if smoke else 128
    random = [(rng.integers(3, vocab, int(rng.integers(16, hi + 1))).tolist(),
               int(rng.integers(16, (24 if smoke else 96) + 1))) for _ in range(n)]
    systems = [rng.integers(3, vocab, 48 if smoke else 192).tolist() for _ in range(8)]
    shared = [(systems[i % 8] + rng.integers(3, vocab, int(rng.integers(8, 33))).tolist(),
               8 if smoke else 32) for i in range(n)]
    return {"random": random, "shared-prefix": shared}


def run_sfjax(llm, work) -> dict:
    from sfjax import SamplingParams
    prompts = [{"prompt_token_ids": p} for p, _ in work]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in work]
    r = {}
    for attempt in ("warm-up", "timed"):
        llm.reset_prefix_cache()       # hits only from sharing within the run
        before = llm.get_metrics()
        other = OtherCpu()
        t0, m0 = time.perf_counter(), time.monotonic()
        outs = llm.generate(prompts, params, use_tqdm=False)
        r[attempt] = time.perf_counter() - t0
        r["others"] = other.cores()
    after = llm.get_metrics()
    r["tokens"] = [o.outputs[0].token_ids for o in outs]
    out_tokens = sum(len(t) for t in r["tokens"])
    r["tok_s"] = out_tokens / r["timed"]
    r["latency"] = float(np.mean([o.metrics.finished_time - m0 for o in outs]))
    r["compile"] = r["warm-up"] - r["timed"]
    r["preemptions"] = after["num_preemptions"] - before["num_preemptions"]
    if "prefix_cache" in after:
        q = after["prefix_cache"]["query_tokens"] - before["prefix_cache"]["query_tokens"]
        h = after["prefix_cache"]["hit_tokens"] - before["prefix_cache"]["hit_tokens"]
        r["hit_rate"] = h / max(q, 1)
    return r


def run_hf(model, work, batch: int) -> dict:
    import torch
    t0 = time.perf_counter()
    other = OtherCpu()
    finish = []
    for i in range(0, len(work), batch):
        chunk = work[i:i + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, (p, _) in enumerate(chunk):
            ids[j, width - len(p):] = torch.tensor(p)
            mask[j, width - len(p):] = 1
        n = max(m for _, m in chunk)
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=n,
                           min_new_tokens=n, pad_token_id=0)
        finish += [time.perf_counter() - t0] * len(chunk)
    total = time.perf_counter() - t0
    return {"timed": total, "tok_s": sum(m for _, m in work) / total,
            "latency": float(np.mean(finish)), "others": other.cores()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--pressed-blocks", type=int, default=96,
                    help="16-token KV blocks of the pressed engine (default 96: ~1/3 of the need)")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--workdir")
    ap.add_argument("--quiet-wait", type=float, default=0.0,
                    help="before each row, wait up to this many seconds for the CPUs to go quiet")
    ap.add_argument("--smoke", action="store_true", help="the tiny test model and short requests")
    args = ap.parse_args()

    from sfjax import LLM, toy
    print(machine())
    root = args.workdir
    if root is None:                 # a scratch folder, removed at exit
        root = tempfile.mkdtemp(prefix="sfjax-bench-serving-")
        atexit.register(shutil.rmtree, root, ignore_errors=True)
    cfg = toy.tiny_config() if args.smoke else toy.llama_68m_config()
    folder = toy.build_model_folder(os.path.join(root, "model"), cfg, seed=0)
    work = workloads(args.requests, cfg.vocab_size, args.smoke)
    geometry = dict(max_num_seqs=args.max_num_seqs, max_model_len=512, block_size=16)
    rows = []

    def row(name, workload, fn):
        if args.quiet_wait:
            wait_quiet(args.quiet_wait, 0.1)
        r = fn()
        r.update(name=name, workload=workload)
        rows.append(r)
        extra = "".join(f", {k} {r[k]}" for k in ("preemptions",) if k in r)
        if "hit_rate" in r:
            extra += f", prefix-cache hit rate {r['hit_rate']:.3f}"
        print(f"{workload:>13} | {name:<22} | {r['tok_s']:8.1f} out tok/s | mean latency "
              f"{r['latency']:6.2f} s | wall {r['timed']:6.2f} s | compile {r.get('compile', 0):5.1f} s"
              f" | other cores {r['others']:.2f}{extra}", flush=True)
        return r

    off_ = dict(geometry, enable_prefix_caching=False)
    roomy = row("sfjax roomy", "random", lambda: run_sfjax(LLM(folder, **off_), work["random"]))
    pressed = row("sfjax pressed", "random", lambda: run_sfjax(
        LLM(folder, num_kv_blocks=args.pressed_blocks + 1, **off_), work["random"]))
    assert pressed["tokens"] == roomy["tokens"], "preemption changed an output"
    assert pressed["preemptions"] > 0, "the pressed cache did not force preemption"
    pressed_pc = row("sfjax pressed + prefix", "random", lambda: run_sfjax(
        LLM(folder, num_kv_blocks=args.pressed_blocks + 1, **geometry), work["random"]))
    assert pressed_pc["tokens"] == roomy["tokens"], "preemption changed an output"
    off = row("sfjax prefix cache off", "shared-prefix",
              lambda: run_sfjax(LLM(folder, **off_), work["shared-prefix"]))
    on = row("sfjax prefix cache on", "shared-prefix", lambda: run_sfjax(
        LLM(folder, enable_prefix_caching=True, **geometry), work["shared-prefix"]))
    assert on["tokens"] == off["tokens"], "prefix caching changed an output"
    if not args.no_hf:
        model, _ = load_hf(folder)
        hf = {w: row("HF static batches", w, lambda w=w: run_hf(model, work[w], args.max_num_seqs))
              for w in work}
    print(f"\npressed / roomy: {pressed['tok_s'] / roomy['tok_s']:.2f}x tok/s, "
          f"{pressed['latency'] / roomy['latency']:.2f}x mean latency ({pressed['preemptions']} preemptions)")
    print(f"pressed with the prefix cache / roomy: {pressed_pc['tok_s'] / roomy['tok_s']:.2f}x tok/s "
          f"(recompute of what was not evicted only; {pressed_pc['preemptions']} preemptions)")
    print(f"prefix cache on / off: {on['tok_s'] / off['tok_s']:.2f}x tok/s, "
          f"{off['timed'] / on['timed']:.2f}x faster wall, hit rate {on['hit_rate']:.3f}")
    if not args.no_hf:
        print(f"sfjax roomy / HF (random): {roomy['tok_s'] / hf['random']['tok_s']:.2f}x tok/s, "
              f"{hf['random']['latency'] / roomy['latency']:.2f}x lower mean latency")
        print(f"sfjax prefix cache on / HF (shared-prefix): "
              f"{on['tok_s'] / hf['shared-prefix']['tok_s']:.2f}x tok/s")
    end_note()


if __name__ == "__main__":
    main()
