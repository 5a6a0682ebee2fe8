"""Every speculation method on the demo target in one process, timed in turns, with HF as the peer.

    python scripts/code_prompts.py --out code_prompts.jsonl
    python scripts/bench_methods.py --prompts-file code_prompts.jsonl [--batch-sizes 1,8]
        [--temperatures 0,0.8] [--repeats 3] [--no-hf] [--cpu-threads 1] [--only NAMES]
        [--ngram-k 1,2,4,8]

One engine per method (plain; ngram k = 3 with the distilled table, fixed and adaptive; the draft
model, k = 4; the EAGLE-3 head at fixed k = 2 and 3 and adaptive k), built once and run on the
same prompts in turns, ``--repeats`` times over (each repeat starting one method later, so no
method always runs right after the same other); each keeps its fastest pass
(``sfjax.benchmark.run_engine``: the 8 prompts, 128 tokens each, EOS ignored, at most --batch-size
at once). At T > 0 every request has its own seed (``--seed`` + i). ``--mixed`` adds as many
prompts of random token ids, where little is accepted (adaptive k's case). ``--ngram-k`` adds the
n-gram + table engine at those k (``auto`` too), to see what a round costs by its verify rows.
Reported per method: output tok/s, the ratio to sfjax plain of the same batch size and
temperature, the same ratio for decoding alone (``decode``: the requests' mean time per output
token after their first, whose time is the prefill's), the device rounds and the pass's wall time
per round, acceptance rate and mean acceptance length, and whether the tokens equal plain
decoding's (``exact`` promises it). With HF (batch 1 only): HF
``generate`` plain, with the draft as assistant model (k = 4) and with prompt lookup (k = 3), as
``sfjax bench --compare-hf`` runs them, in the same turns.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np


def methods() -> dict[str, dict | None]:
    from sfjax.default_model import (default_draft_path, default_eagle_path,
                                     default_speculative_config)
    head = default_eagle_path()
    return {"plain": None,
            "ngram+table k3": {**default_speculative_config("ngram"), "num_speculative_tokens": 3},
            "ngram+table auto": {**default_speculative_config("ngram"),
                                 "num_speculative_tokens": "auto"},
            "draft k4": {"method": "draft_model", "model": default_draft_path(),
                         "num_speculative_tokens": 4},
            "eagle3 k2": {"method": "eagle3", "model": head, "num_speculative_tokens": 2},
            "eagle3 k3": {"method": "eagle3", "model": head, "num_speculative_tokens": 3},
            "eagle3 auto": {"method": "eagle3", "model": head, "num_speculative_tokens": "auto"}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts-file", required=True)
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--temperatures", default="0,0.8")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cpu-threads", type=int, default=None,
                    help="XLA:CPU's thread pool (as sfjax bench's)")
    ap.add_argument("--only", default=None, help="comma-separated method names")
    ap.add_argument("--ngram-k", default=None,
                    help="comma-separated k (or auto) of more n-gram + table engines")
    ap.add_argument("--mixed", action="store_true",
                    help="add as many prompts of random ids (not code: little to accept)")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    if args.cpu_threads is not None:
        from sfjax.cpu import limit_cpu_threads
        limit_cpu_threads(args.cpu_threads)
    from sfjax import LLM, SamplingParams
    from sfjax import benchmark as B
    from sfjax.default_model import (default_draft_path, default_model_path,
                                     default_speculative_config)

    chosen = methods()
    if args.only:
        chosen = {k: v for k, v in chosen.items() if k in args.only.split(",")}
        chosen.setdefault("plain", None)
    for k in (args.ngram_k.split(",") if args.ngram_k else []):
        chosen[f"ngram+table k{k}"] = {**default_speculative_config("ngram"),
                                       "num_speculative_tokens": k if k == "auto" else int(k)}
    results = []
    for batch in map(int, args.batch_sizes.split(",")):
        llms = {name: LLM(max_num_seqs=batch, speculative_config=spec)
                for name, spec in chosen.items()}
        work = B.file_workload(args.prompts_file, llms["plain"].get_tokenizer(), args.output_len,
                               None)
        if args.mixed:
            n, vocab = len(work.prompt_ids), llms["plain"].model_config.vocab_size
            noise = B.random_workload(n, len(work.prompt_ids[0]), args.output_len, vocab, args.seed)
            work = B.Workload(work.prompt_ids + noise.prompt_ids, work.max_tokens + noise.max_tokens,
                              work.prompts + noise.prompts)
        for temperature in map(float, args.temperatures.split(",")):
            params = [SamplingParams(temperature=temperature, seed=args.seed + i,
                                     max_tokens=args.output_len, ignore_eos=True)
                      for i in range(len(work.prompt_ids))]
            def timed(llm):
                rounds = llm.get_metrics()["steps"]
                r = B.run_engine(llm, work, params)
                return {**r, "rounds": llm.get_metrics()["steps"] - rounds}
            passes = {name: (lambda llm=llm: timed(llm)) for name, llm in llms.items()}
            if batch == 1 and not args.no_hf:
                modes = {"plain": {}, "prompt_lookup": {"prompt_lookup_num_tokens": 3},
                         "assisted": {"assistant_model": default_draft_path(),
                                      "num_assistant_tokens": 4,
                                      "num_assistant_tokens_schedule": "constant"}}
                for name, fn in B.hf_passes(default_model_path(), work, temperature, modes).items():
                    passes[f"HF {name}"] = fn
            for name, fn in passes.items():            # warm-up: compiles every shape
                if name in llms:
                    B.warm_up(llms[name], fn)
                else:
                    fn()
            best = {}
            names = list(passes)
            for i in range(args.repeats):       # each repeat in another order: no pass always
                for name in names[i % len(names):] + names[:i % len(names)]:    # follows one
                    r = passes[name]()
                    if name not in best or r["duration"] < best[name]["duration"]:
                        best[name] = r
            plain = best["plain"]
            rate = lambda r: r["output_tokens"] / r["duration"]
            # a request's time per token after its first (its prefill's): decoding alone
            tpot = lambda r: float(np.mean(r["tpot"])) if r.get("tpot") else None
            print(f"\nbatch {batch}, T = {temperature}")
            for name, r in best.items():
                s = r.get("spec") or {}
                row = {"batch": batch, "temperature": temperature, "method": name,
                       "tok_s": round(rate(r), 1), "vs_plain": round(rate(r) / rate(plain), 3),
                       "rounds": r.get("rounds"),
                       "ms_per_round": r.get("rounds") and round(1e3 * r["duration"] / r["rounds"],
                                                                  3),
                       "tpot_ms": tpot(r) and round(1e3 * tpot(r), 4),
                       "decode_vs_plain": tpot(r) and round(tpot(plain) / tpot(r), 3),
                       "acceptance_rate": s.get("acceptance_rate"),
                       "mean_acceptance_length": s.get("mean_acceptance_length"),
                       "tokens_equal_plain": r["tokens"] == plain["tokens"]}
                results.append(row)
                acc = (f"  acceptance {100 * s['acceptance_rate']:.1f}%, length "
                       f"{s['mean_acceptance_length']:.2f}" if s else "")
                per = (f"  {row['rounds']} rounds, {row['ms_per_round']:.3f} ms/round"
                       if row["rounds"] else "")
                dec = (f"  decode {row['decode_vs_plain']:.2f}x ({row['tpot_ms']:.3f} ms/token)"
                       if row["tpot_ms"] else "")
                print(f"  {name:<18}{row['tok_s']:>9.1f} tok/s  {row['vs_plain']:.2f}x plain"
                      f"{dec}{per}"
                      f"{acc}{'' if row['tokens_equal_plain'] else '  (tokens differ)'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
