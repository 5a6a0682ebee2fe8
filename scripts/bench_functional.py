"""Tokens/s of sfjax.functional called from a user's jitted loop vs LLM.generate, on the constructed
pair of the speculative decoding benchmark (scripts/bench.py --suite spec).

Run:
    python scripts/bench_functional.py
    python scripts/bench_functional.py [--batch-sizes 1,32] [--max-tokens 128] [--prompt-len 96]
                                       [--k 4] [--repeats 3] [--workdir DIR]
                                       [--quiet-wait SECONDS [--quiet-cores 0.1] [--quiet-retries 3]]
    python scripts/bench_functional.py --smoke   # a tiny pair (the draft's shape is sfjax.toy's
                                                 # tiny config), 16 tokens, batch 1 and 4, 1 repeat

The pair is bench.py's (``build_pair``): a 12-layer target whose layers 3..12 add nothing, and its
first 2 layers as the draft, so every greedy draft is accepted. Per batch size B and method
(plain, ngram with prompt_lookup_max=3, draft_model; k = --k), on bench.py's "random" prompts
(B x --prompt-len ids), greedy, exactly --max-tokens tokens (EOS ignored):
  * engine:     LLM(target, max_num_seqs=B, max_model_len=prompt_len + max_tokens,
                speculative_config=...).generate(...)
  * functional: the user's program, one jitted function: F.place_weights (once),
                F.prefill, then a lax.while_loop calling F.decode(..., num_rounds=1) until every
                row is done, then F.outputs. max_tokens is an array, so the max_tokens=1 run
                (prefill) and the full run share one program.
Timing is bench.py's ``timed``: a warm-up first (compile = warm-up less the same work warm), then
the best of --repeats for prefill (max_tokens=1) and the full run; tok/s = B * max_tokens / total;
decode tok/s = B * (max_tokens - 1) / (total - prefill). Both paths' tokens are compared (they
must be identical). ms/step: the full run's time over the engine's device steps or the
functional loop's rounds (the same rounds: one per step); the difference is about the engine's
host work per step (scheduling, building the batch, reading the tokens back).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402  (scripts/bench.py: the pair, the prompts, the timing rules)


def functional_gen(folder: str, draft: str | None, spec: dict | None, ids: list[list[int]],
                   max_len: int, width: int, stats: dict):
    """gen(n) for the functional path; each call leaves its rounds and spec counters in ``stats``."""
    import jax
    import jax.numpy as jnp
    from sfjax import SamplingParams
    from sfjax import functional as F
    from sfjax import weights as W
    from sfjax.config import ModelConfig

    cfg = ModelConfig.from_folder(folder)
    weights = W.load_hf(folder, cfg)
    fc = F.Config(cfg, max_len, speculative_config=spec)
    draft_weights = W.load_hf(draft, fc.draft) if fc.draft is not None else None

    @jax.jit
    def user_loop(weights, draft_weights, prompt_ids, prompt_lens, sampling):
        weights = F.place_weights(weights, fc)     # laid out once, not once a round
        if draft_weights is not None:
            draft_weights = F.place_weights(draft_weights, fc, draft=True)
        state = F.prefill(weights, prompt_ids, prompt_lens, sampling, fc, draft_weights)

        def body(carry):
            state, rounds = carry
            return F.decode(weights, state, fc, 1, draft_weights), rounds + 1

        state, rounds = jax.lax.while_loop(lambda c: jnp.any(~c[0].done), body, (state, jnp.int32(0)))
        return F.outputs(state, width), rounds

    prompt_ids = np.array(ids, np.int32)
    lens = np.full(len(ids), prompt_ids.shape[1], np.int32)

    def gen(n):
        sp = F.Sampling.from_params(SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                                    eos_token_ids=(), batch=len(ids))
        t = time.perf_counter()
        out, rounds = jax.block_until_ready(user_loop(weights, draft_weights, prompt_ids, lens, sp))
        dt = time.perf_counter() - t
        out = jax.device_get(out)
        toks = [row[:k].tolist() for row, k in zip(out.token_ids, out.num_tokens)]
        assert all(len(x) == n for x in toks), "functional returned a wrong number of tokens"
        stats.update(steps=int(rounds) + 1, rounds=int(out.num_drafts.sum()),
                     drafted=int(out.num_draft_tokens.sum()), accepted=int(out.num_accepted_tokens.sum()))
        return dt, toks

    return gen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", default=None, help="default 1,32 (--smoke: 1,4)")
    ap.add_argument("--max-tokens", type=int, default=None, help="default 128 (--smoke: 16)")
    ap.add_argument("--prompt-len", type=int, default=None, help="default 96 (--smoke: 16)")
    ap.add_argument("--k", type=int, default=4, help="drafts per round")
    ap.add_argument("--repeats", type=int, default=None, help="default 3 (--smoke: 1)")
    ap.add_argument("--smoke", action="store_true", help="a tiny pair and a short run")
    ap.add_argument("--workdir", help="where to build the pair (default: a temp dir)")
    ap.add_argument("--quiet-wait", type=float, default=0.0,
                    help="before each timed part, wait up to this many seconds for other processes "
                         "to go quiet (0: don't wait)")
    ap.add_argument("--quiet-cores", type=float, default=0.1)
    ap.add_argument("--quiet-retries", type=int, default=3)
    args = ap.parse_args()
    smoke = args.smoke
    sizes = [int(b) for b in (args.batch_sizes or ("1,4" if smoke else "1,32")).split(",")]
    n = args.max_tokens or (16 if smoke else 128)
    plen = args.prompt_len or (16 if smoke else 96)
    repeats = args.repeats or (1 if smoke else 3)
    quiet = (dict(wait=args.quiet_wait, max_cores=args.quiet_cores, retries=args.quiet_retries)
             if args.quiet_wait > 0 else None)

    import sfjax
    from sfjax import toy
    print(bench.machine(), flush=True)
    tmp = None if args.workdir else tempfile.TemporaryDirectory(prefix="sfjax-bench-functional-")
    root = args.workdir or tmp.name
    t = time.perf_counter()
    f = bench.build_pair(root, draft_cfg=toy.tiny_config() if smoke else None)
    print(f"built the pair in {time.perf_counter() - t:.1f}s ({'tiny, smoke' if smoke else 'llama-68m width'}; "
          f"target 12 layers, 3..12 dead; draft = its first 2) | prompt_len={plen} max_tokens={n} "
          f"greedy, ignore_eos | k={args.k}", flush=True)
    with open(os.path.join(f["target"], "config.json")) as fh:
        vocab = json.load(fh)["vocab_size"]
    specs = {"plain": None,
             "ngram": {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 3},
             "draft_model": {"method": "draft_model", "model": f["draft"], "num_speculative_tokens": args.k}}
    rows = []
    for b in sizes:
        ids = bench.prompt_sets(b, plen, vocab)["random"]
        for method, spec in specs.items():
            res = {}
            for path in ("engine", "functional"):
                stats = {}
                t = time.perf_counter()
                if path == "engine":
                    llm = sfjax.LLM(f["target"], max_num_seqs=b, max_model_len=plen + n,
                                    speculative_config=spec, enable_prefix_caching=False)
                    gen = bench.sfjax_gen(llm, ids, stats)
                else:
                    gen = functional_gen(f["target"], f["draft"], spec, ids, plen + n, n, stats)
                load = time.perf_counter() - t
                warm = gen(n)[0] + gen(1)[0]
                r = bench.timed(gen, b, n, repeats, warm_prefill=True, quiet=quiet, load=load, warm=warm)
                del gen                                  # stats: the last call, a full run
                r.update(steps=stats["steps"], ms_step=1e3 * r["total"] / stats["steps"])
                if spec:
                    bench.spec_numbers(r, stats)
                res[path] = r
                acc = f"  accept {r['accept']:.3f} mean len {r['mean_len']:.2f}" if spec else ""
                print(f"B={b:<2} {method:<11} {path:<10} {r['tok_s']:8.1f} tok/s  decode {r['decode_tok_s']:8.1f}"
                      f"  prefill {r['prefill']:.3f}s total {r['total']:.3f}s  compile ~{r['compile']:.1f}s"
                      f"  {r['steps']} steps, {r['ms_step']:.2f} ms/step{acc}  [others used {r['others']:.2f} "
                      f"cores; loadavg {os.getloadavg()[0]:.2f}]", flush=True)
            same = res["engine"]["tokens"] == res["functional"]["tokens"]
            assert same, f"B={b} {method}: functional tokens differ from LLM.generate's"
            rows.append((b, method, res))

    print(f"\n{'B':>3} {'method':<11} {'engine tok/s':>12} {'functional':>10} {'ratio':>6} "
          f"{'engine ms/step':>14} {'functional':>10} {'host ms/step':>12}  tokens")
    for b, method, res in rows:
        e, fn = res["engine"], res["functional"]
        print(f"{b:>3} {method:<11} {e['tok_s']:>12.1f} {fn['tok_s']:>10.1f} {fn['tok_s'] / e['tok_s']:>6.2f} "
              f"{e['ms_step']:>14.2f} {fn['ms_step']:>10.2f} {e['ms_step'] - fn['ms_step']:>12.2f}  identical")
    print("ratio: functional / engine tok/s (prefill included). host ms/step: engine ms/step less "
          "functional ms/round, the engine's host work per step.")
    bench.end_note()
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
