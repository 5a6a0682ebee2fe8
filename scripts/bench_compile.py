"""Compile cost of one engine run: how many programs XLA compiles and the seconds it spends, for
plain decoding, a draft model and n-gram lookup, at ``num_scheduler_steps`` 1 and 8.

Each run builds a fresh engine on the tiny test model (``toy.tiny_config()``, seeded; the draft a
one-layer model) with 64 slots and generates 24 greedy tokens for one 5-token prompt; the
engine's shared programs are dropped between runs (``programs.clear``), so each run compiles
what a new process would (the small-tile certificate is kept on disk after the first run, as
``sfjax generate`` keeps it). For an A/B of two trees, run it with each on ``PYTHONPATH`` from a
directory outside both. Prints one line per run; ``--json`` prints them as a JSON list.

    python scripts/bench_compile.py
"""

from __future__ import annotations

import argparse
import collections
import json
import tempfile
import time

from jax import monitoring


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    compiles = collections.Counter()
    monitoring.register_event_duration_secs_listener(
        lambda event, duration, **_: compiles.update({"n": 1, "s": duration})
        if "backend_compile" in event else None)

    import sfjax
    from sfjax import LLM, SamplingParams, toy
    from sfjax.engine import programs

    tmp = tempfile.mkdtemp(prefix="bench-compile-")
    target = toy.build_model_folder(f"{tmp}/target", toy.tiny_config(), seed=0, std=0.1)
    draft = toy.build_model_folder(f"{tmp}/draft", toy.tiny_config(num_layers=1), seed=1, std=0.1)
    methods = {"plain": None, "ngram": {"method": "ngram", "num_speculative_tokens": 4},
               "draft_model": {"method": "draft_model", "model": draft, "num_speculative_tokens": 4}}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    rows = []
    for steps in (1, 8):
        for name, spec in methods.items():
            compiles.clear()
            t0 = time.perf_counter()
            llm = LLM(target, max_num_seqs=args.max_num_seqs, max_model_len=64,
                      num_scheduler_steps=steps, speculative_config=spec)
            out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8, 9]}], params, use_tqdm=False)
            rows.append(dict(method=name, num_scheduler_steps=steps, compiles=compiles["n"],
                             compile_s=round(compiles["s"], 2),
                             total_s=round(time.perf_counter() - t0, 2),
                             tokens=out[0].outputs[0].token_ids))
            del llm
            programs.clear()
            if not args.json:
                r = rows[-1]
                print(f"{name:<12} steps {steps}: {r['compiles']} compiles, {r['compile_s']:.1f} s "
                      f"compiling, {r['total_s']:.1f} s in all", flush=True)
    if args.json:
        print(json.dumps(dict(sfjax=sfjax.__file__, runs=rows)))
    else:
        assert len({tuple(r["tokens"]) for r in rows}) == 1, "the runs' tokens differ"
        print("tokens equal across runs; sfjax from", sfjax.__file__)


if __name__ == "__main__":
    main()
