"""Greedy-decode throughput of sfjax vs HF transformers: plain decoding, and speculative decoding.

Run:
    python scripts/bench.py
    python scripts/bench.py [--suite plain] --batch-sizes 1,32 --max-tokens 128 --prompt-len 96
                            [--repeats 3] [--no-hf] [--model PATH] [--workdir DIR]
    python scripts/bench.py --suite spec [--batch-sizes 1,8] [--max-tokens 128] [--prompt-len 96]
                            [--k 4] [--repeats 3] [--no-hf] [--workdir DIR]
                            [--quiet-wait SECONDS [--quiet-cores 0.1] [--quiet-retries 3]]

Plain suite (the default; one random llama-68m-shaped model). Per batch size B, each engine gets B
prompts of --prompt-len random token ids (fixed seed) and generates exactly --max-tokens tokens
greedily (EOS ignored). Warm-up runs come first, until every bucket the runs ask for has
compiled (``sfjax.benchmark.warm_up``: sfjax compiles its step shapes on first use, and a
smaller bucket at a later ask); the warm-up less the same passes warm is reported as compile.
Then, timed with time.perf_counter around generate(), each the best of --repeats runs:
  * prefill: a max_tokens=1 run (prefill plus the first token, i.e. TTFT of the whole batch);
  * total:   the max_tokens run; tok/s = B * max_tokens / total (prefill included);
  * decode:  B * (max_tokens - 1) / (total - prefill), the rate with the prefill taken out.
Both engines run float32 on the same weights; torch uses its default thread count.

Spec suite (speculative decoding on a constructed pair; same timing rules). The target is a
12-layer llama-68m-width Llama (llama-160m's shape) whose layers 3..12 have zero o_proj and
down_proj, so they add nothing to the residual stream; the draft is its first two layers with the
same embeddings, final norm and head, so the two give bitwise-equal logits and every greedy draft
is accepted (checked in the run). A second draft from another seed disagrees with the target on
nearly every token: it gives the cost of a round in which every draft is rejected. Two prompt sets:
"random" (random ids, as in the plain suite) and "repeat" (a 24-token random segment repeated to
--prompt-len; n-gram lookup has something to find there). Rows:
  * sfjax: plain, ngram (k, prompt_lookup_max=3), draft_model (k), via LLM(speculative_config=...);
    acceptance from llm.get_metrics()["spec_decode"] over the timed run;
  * HF: generate() plain, with assistant_model=<draft> (num_assistant_tokens=k, schedule
    "constant", assistant_confidence_threshold=0 so it does draft k a round), and with
    prompt_lookup_num_tokens=k (max_matching_ngram_size=3, as sfjax's ngram). HF assisted
    generation supports batch 1 only: at larger batches HF runs plain only.
Each row reports the cores other processes used while it was timed (from /proc/stat); with
--quiet-wait the suite waits for the CPUs to go quiet before each row and redoes a row that
other work shared (the machine may be shared with test runs).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time

import numpy as np


# ---------------------------------------------------------------------------------------------
# Engines: a gen(n) -> (seconds, tokens per sequence) closure per configuration


def sfjax_gen(llm, ids: list[list[int]], stats: dict | None = None):
    """gen(n) for ``llm`` on ``ids``; with ``stats``, each call leaves in it the spec-decode
    counters and engine steps of that call (the counters are cumulative in the engine)."""
    import sfjax
    prompts = [{"prompt_token_ids": p} for p in ids]

    def counters():
        m = llm.get_metrics()
        s = m.get("spec_decode", {})
        return (m["steps"], s.get("num_drafts", 0), s.get("num_draft_tokens", 0),
                s.get("num_accepted_tokens", 0))

    def gen(n):
        sp = sfjax.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        before = counters()
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t
        toks = [o.outputs[0].token_ids for o in outs]
        assert all(len(x) == n for x in toks), "sfjax returned a wrong number of tokens"
        if stats is not None:
            steps, rounds, drafted, accepted = (a - b for a, b in zip(counters(), before))
            stats.update(steps=steps, rounds=rounds, drafted=drafted, accepted=accepted)
        return dt, toks

    return gen


def bench_sfjax(folder: str, ids: list[list[int]], max_tokens: int, repeats: int) -> dict:
    import sfjax.benchmark
    t = time.perf_counter()
    # the timed runs repeat the warm-up's prompts: no prefix cache, or prefill would be skipped
    llm = sfjax.LLM(folder, max_num_seqs=len(ids), max_model_len=len(ids[0]) + max_tokens,
                    enable_prefix_caching=False)
    load = time.perf_counter() - t
    gen = sfjax_gen(llm, ids)
    warm, passes = sfjax.benchmark.warm_up(llm, lambda: (gen(max_tokens), gen(1)))
    return timed(gen, len(ids), max_tokens, repeats, load=load, warm=warm, passes=passes,
                 warm_prefill=True)


HF_ROUNDS = {"rounds": 0, "drafted": 0, "accepted": 0, "rounds_with_drafts": 0}


def count_hf_rounds() -> None:
    """Counts HF assisted-generation rounds, drafts and accepted drafts into HF_ROUNDS (wraps the
    candidate generators' update_candidate_strategy, called once a round with the verify logits
    [1, drafts + 1, V] and the number of drafts accepted)."""
    from transformers.generation import candidate_generator as cg
    for cls in (cg.CandidateGenerator, cg.AssistedCandidateGenerator):
        orig = cls.__dict__["update_candidate_strategy"]
        if getattr(orig, "_counted", False):
            continue

        def wrapped(self, input_ids, scores, num_matches, _orig=orig):
            d = scores.shape[1] - 1
            HF_ROUNDS["rounds"] += 1
            HF_ROUNDS["rounds_with_drafts"] += d > 0
            HF_ROUNDS["drafted"] += d
            HF_ROUNDS["accepted"] += int(num_matches)
            return _orig(self, input_ids, scores, num_matches)

        wrapped._counted = True
        cls.update_candidate_strategy = wrapped


def load_hf(folder: str):
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return model, time.perf_counter() - t


def hf_gen(model, ids: list[list[int]], stats: dict | None = None, **kw):
    import torch
    x = torch.tensor(ids, dtype=torch.long)   # equal lengths: no padding needed

    def gen(n):
        before = dict(HF_ROUNDS)
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                 max_new_tokens=n, min_new_tokens=n, pad_token_id=0, **kw)
        dt = time.perf_counter() - t
        toks = out[:, x.shape[1]:].tolist()
        assert all(len(r) == n for r in toks), "HF returned a wrong number of tokens"
        if stats is not None:
            stats.update({k: HF_ROUNDS[k] - before[k] for k in HF_ROUNDS})
        return dt, toks

    return gen


def bench_hf(folder: str, ids: list[list[int]], max_tokens: int, repeats: int) -> dict:
    model, load = load_hf(folder)
    gen = hf_gen(model, ids)
    warm = gen(max_tokens)[0]
    return timed(gen, len(ids), max_tokens, repeats, load=load, warm=warm, warm_prefill=False)


class OtherCpu:
    """Cores used by every process but this one since construction: /proc/stat's busy time
    (user, nice, system, irq, softirq; not steal) less this process's os.times()."""

    def __init__(self):
        self.t0 = self._read()

    @staticmethod
    def _read():
        try:
            with open("/proc/stat") as f:
                v = [int(x) for x in f.readline().split()[1:8]]
        except (OSError, ValueError):
            return None
        t = os.times()
        return (time.monotonic(), (v[0] + v[1] + v[2] + v[5] + v[6]) / os.sysconf("SC_CLK_TCK"),
                t.user + t.system)

    def cores(self) -> float:
        t1 = self._read()
        if t1 is None or self.t0 is None:
            return float("nan")
        busy = (t1[1] - self.t0[1]) - (t1[2] - self.t0[2])
        return max(busy, 0.0) / max(t1[0] - self.t0[0], 1e-9)


def wait_quiet(limit: float, max_cores: float, sample: float = 5.0) -> float:
    """Sleeps until other processes used at most ``max_cores`` over ``sample`` seconds, or
    ``limit`` seconds have passed; returns the seconds waited."""
    t = time.monotonic()
    while time.monotonic() - t < limit:
        c = OtherCpu()
        time.sleep(sample)
        if c.cores() <= max_cores:
            break
    return time.monotonic() - t


def timed(gen, b: int, n: int, repeats: int, warm_prefill: bool, quiet: dict | None = None,
          **r) -> dict:
    """Best-of-``repeats`` prefill (max_tokens=1) and full runs, keeping the full run's tokens;
    compile = warm-up time (``r["warm"]``, ``r["passes"]`` passes, default 1) less that many
    passes warm (the first-call cost, and the compiles of buckets a later pass asks for).
    r["others"]: cores other processes used meanwhile. With ``quiet`` (wait, max_cores,
    retries), the timed runs start after wait_quiet and are redone (up to ``retries`` times)
    when others used more."""
    for attempt in range(1 + (quiet["retries"] if quiet else 0)):
        if quiet:
            r["waited"] = r.get("waited", 0.0) + wait_quiet(quiet["wait"], quiet["max_cores"])
        other = OtherCpu()
        r["prefill"] = min(gen(1)[0] for _ in range(repeats))
        runs = [gen(n) for _ in range(repeats)]
        r["others"], r["attempts"] = other.cores(), attempt + 1
        if not quiet or r["others"] <= quiet["max_cores"]:
            break
    r["total"], r["tokens"] = min(runs, key=lambda x: x[0])
    r["spread"] = max(x[0] for x in runs) / r["total"]
    r["compile"] = r["warm"] - r.get("passes", 1) * (r["total"] + (r["prefill"] if warm_prefill
                                                                 else 0.0))
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


def end_note() -> None:
    print(f"1-min loadavg at the end: {os.getloadavg()[0]:.2f} (this run alone adds about "
          f"{len(os.sched_getaffinity(0))}; much more means other work shared the CPUs)")


# ---------------------------------------------------------------------------------------------
# The plain suite


def plain_suite(args) -> None:
    batch_sizes = [int(b) for b in (args.batch_sizes or "1,32").split(",")]
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
    end_note()
    if tmp is not None:
        tmp.cleanup()


# ---------------------------------------------------------------------------------------------
# The spec suite


SEGMENT = 24   # the repeat prompt set: a SEGMENT-token random segment, repeated to --prompt-len


def build_pair(root: str, *, draft_cfg=None) -> dict[str, str]:
    """The constructed target/draft pair and a disagreeing draft; returns their folders.
    ``draft_cfg``: the draft's shape, 2 layers (default llama-68m's); the target is it with 12."""
    import jax
    from sfjax import toy
    from sfjax import weights as W
    dcfg = draft_cfg or toy.llama_68m_config()         # 2 layers
    tcfg = dataclasses.replace(dcfg, num_layers=12)    # llama-160m's shape by default
    w = W.init_random(tcfg, seed=0)
    dead = lambda x: x.at[2:].set(0.0)                 # layers 3..12 write nothing to the residual
    w = dataclasses.replace(w, wo=dead(w.wo), w_down=dead(w.w_down))
    dw = dataclasses.replace(w, **{f: x[:2] for f, x in W.layer_arrays(w).items()})
    jax.block_until_ready(dw)
    out = {"target": os.path.join(root, "target-12l-dead10"), "draft": os.path.join(root, "draft-2l"),
           "bad": os.path.join(root, "draft-2l-seed1")}
    toy.build_model_folder(out["target"], tcfg, weights=w)
    toy.build_model_folder(out["draft"], dcfg, weights=dw)
    toy.build_model_folder(out["bad"], dcfg, seed=1)   # disagrees with the target
    return out


def prompt_sets(b: int, prompt_len: int, vocab: int) -> dict[str, list[list[int]]]:
    rand = np.random.default_rng(0).integers(2, vocab, (b, prompt_len))
    seg = np.random.default_rng(1).integers(2, vocab, (b, SEGMENT))
    rep = np.tile(seg, (1, -(-prompt_len // SEGMENT)))[:, :prompt_len]
    return {"random": rand.tolist(), "repeat": rep.tolist()}


def spec_numbers(r: dict, s: dict) -> None:
    """Adds acceptance rate and mean acceptance length from a timed run's round counters."""
    rounds = s.get("rounds_with_drafts", s.get("rounds", 0))
    r["rounds"], r["drafted"], r["accepted"] = s.get("rounds", 0), s["drafted"], s["accepted"]
    r["steps"] = s.get("steps")
    r["accept"] = s["accepted"] / s["drafted"] if s["drafted"] else float("nan")
    r["mean_len"] = 1 + s["accepted"] / rounds if rounds else float("nan")


def spec_suite(args) -> None:
    import sfjax.benchmark
    batch_sizes = [int(b) for b in (args.batch_sizes or "1,8").split(",")]
    n, k, plen = args.max_tokens, args.k, args.prompt_len
    if args.model:
        raise SystemExit("--model: the spec suite builds its own target/draft pair")
    print(machine(), flush=True)
    tmp = None
    if args.workdir is None:
        tmp = tempfile.TemporaryDirectory(prefix="sfjax-bench-spec-")
    root = args.workdir or tmp.name
    t = time.perf_counter()
    f = build_pair(root)
    print(f"built the pair in {time.perf_counter() - t:.1f}s under {root}: target = 12-layer "
          f"llama-68m-width (llama-160m shape), layers 3..12 with zero o_proj/down_proj; draft = its "
          f"first 2 layers + embeddings, final norm, head; 'bad' draft = 2-layer random, seed 1. "
          f"float32", flush=True)
    with open(os.path.join(f["target"], "config.json")) as fh:
        vocab = json.load(fh)["vocab_size"]
    print(f"prompts: 'random' = {plen} random ids (seed 0); 'repeat' = a {SEGMENT}-token random "
          f"segment (seed 1) repeated to {plen} | max_tokens={n} greedy, ignore_eos | k={k}",
          flush=True)
    max_len = plen + n
    quiet = (dict(wait=args.quiet_wait, max_cores=args.quiet_cores, retries=args.quiet_retries)
             if args.quiet_wait > 0 else None)
    settle = (lambda: wait_quiet(quiet["wait"], quiet["max_cores"])) if quiet else (lambda: 0.0)
    spec_cfgs = {
        "plain": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3},
        "draft_model": {"method": "draft_model", "model": f["draft"], "num_speculative_tokens": k},
    }
    hf_models = {}
    if not args.no_hf:
        from transformers.utils import logging as hf_logging
        hf_logging.set_verbosity_error()   # assisted generate()'s inner calls warn about their own kwargs
        count_hf_rounds()
        for name in ("target", "draft", "bad"):
            hf_models[name] = load_hf(f[name])
        for name in ("draft", "bad"):   # draft k a round, always (not stopped by confidence)
            gc = hf_models[name][0].generation_config
            gc.num_assistant_tokens = k
            gc.num_assistant_tokens_schedule = "constant"
            gc.assistant_confidence_threshold = 0.0
        check_pair(hf_models, prompt_sets(1, plen, vocab), n)

    rows = []   # dicts: b, engine, method, prompts, r (timings, tokens, spec counters)

    def report(row):
        r = row["r"]
        acc = (f"  accept {r['accept']:.3f}  mean len {r['mean_len']:.2f} ({r['drafted']} drafted in "
               f"{r['rounds']} rounds)" if "accept" in r else "")
        comp = "(done above)" if r["compile"] != r["compile"] else f"~{r['compile']:.1f}s"
        print(f"B={row['b']:<2} {row['engine']:<5} {row['method']:<16} {row['prompts']:<6} "
              f"{row['r']['tok_s']:7.1f} tok/s  decode {r['decode_tok_s']:7.1f} tok/s  "
              f"prefill {r['prefill']:.3f}s total {r['total']:.3f}s  compile {comp} "
              f"(slowest/best {r['spread']:.2f}){acc}  [other processes used {r['others']:.2f} cores "
              f"while timed; attempt {r['attempts']}; loadavg {os.getloadavg()[0]:.2f}]", flush=True)
        rows.append(row)

    for b in batch_sizes:
        sets = prompt_sets(b, plen, vocab)
        # sfjax: one engine per (model, method), warmed up once, timed on both prompt sets
        runs = [("plain", f["target"], None), ("ngram", f["target"], spec_cfgs["ngram"]),
                ("draft_model", f["target"], spec_cfgs["draft_model"]),
                ("plain(draft alone)", f["draft"], None)]
        if b == 1:
            runs.append(("draft_model(bad)", f["target"],
                         dict(spec_cfgs["draft_model"], model=f["bad"])))
        for method, folder, spec in runs:
            t = time.perf_counter()
            llm = sfjax.LLM(folder, max_num_seqs=b, max_model_len=max_len, speculative_config=spec,
                            enable_prefix_caching=False)   # repeated prompts: no cache hits
            load = time.perf_counter() - t
            names = ["random"] if method.startswith(("plain(", "draft_model(")) else list(sets)
            for i, pname in enumerate(names):
                stats = {}
                gen = sfjax_gen(llm, sets[pname], stats)
                settle()
                warm, passes = sfjax.benchmark.warm_up(llm, lambda: (gen(n), gen(1)))
                r = timed(gen, b, n, args.repeats, load=load, warm=warm, passes=passes,
                          warm_prefill=True, quiet=quiet)
                if i:   # the first prompt set paid the compiles
                    r["compile"] = float("nan")
                if spec:
                    spec_numbers(r, stats)
                r["steps"] = stats["steps"]
                report(dict(b=b, engine="sfjax", method=method, prompts=pname, r=r))
            del llm
        if args.no_hf:
            continue
        hf_runs = [("plain", "target", {}), ("plain(draft alone)", "draft", {})]
        if b == 1:
            hf_runs += [("assisted", "target", {"assistant_model": hf_models["draft"][0]}),
                        ("prompt_lookup", "target", {"prompt_lookup_num_tokens": k,
                                                     "max_matching_ngram_size": 3}),
                        ("assisted(bad)", "target", {"assistant_model": hf_models["bad"][0]})]
        else:
            print(f"B={b:<2} hf    HF assisted generation / prompt lookup support batch 1 only: "
                  f"plain only", flush=True)
        for method, model, kw in hf_runs:
            names = ["random"] if "(" in method else list(sets)
            for i, pname in enumerate(names):
                stats = {}
                gen = hf_gen(hf_models[model][0], sets[pname], stats, **kw)
                settle()
                warm = gen(n)[0]
                r = timed(gen, b, n, args.repeats, load=hf_models[model][1], warm=warm,
                          warm_prefill=False, quiet=quiet)
                if kw:
                    spec_numbers(r, stats)
                report(dict(b=b, engine="hf", method=method, prompts=pname, r=r))

    summarize(rows, batch_sizes, n, k)
    end_note()
    if tmp is not None:
        tmp.cleanup()


def check_pair(hf_models: dict, sets: dict, n: int) -> None:
    """The pair's premise, on HF: bitwise-equal logits over each batch-1 prompt set's prompt and
    equal greedy tokens; and the 'bad' draft's greedy tokens share (almost) nothing with them."""
    import torch
    target, draft, bad = (hf_models[x][0] for x in ("target", "draft", "bad"))
    for pname, ids in sets.items():
        x = torch.tensor(ids)
        with torch.inference_mode():
            same_logits = torch.equal(target(x).logits, draft(x).logits)
        toks = {name: hf_gen(m, ids)(n)[1][0] for name, m in
                (("target", target), ("draft", draft), ("bad", bad))}
        agree = sum(a == c for a, c in zip(toks["target"], toks["bad"]))
        print(f"check ({pname} prompt, B=1, HF): target and draft logits bitwise equal: "
              f"{same_logits}; greedy {n} tokens equal: {toks['target'] == toks['draft']}; "
              f"'bad' draft agrees with the target on {agree}/{n} positions", flush=True)
        assert same_logits and toks["target"] == toks["draft"], "the constructed pair is broken"


def summarize(rows: list[dict], batch_sizes: list[int], n: int, k: int) -> None:
    def find(b, engine, method, prompts="random"):
        for row in rows:
            if (row["b"], row["engine"], row["method"], row["prompts"]) == (b, engine, method, prompts):
                return row["r"]
        return None

    print(f"\n{'B':>2} {'engine':<6} {'method':<19} {'prompts':<7} {'tok/s':>7} {'decode':>7} "
          f"{'accept':>6} {'mean len':>8} {'vs plain':>8} {'dec vs plain':>12} {'compile s':>9} "
          f"{'others':>6}")
    for row in rows:
        r, b = row["r"], row["b"]
        base = find(b, row["engine"], "plain", row["prompts"])
        vs = dvs = ""
        if base is not None and row["method"] != "plain" and "draft alone" not in row["method"]:
            vs = f"{r['tok_s'] / base['tok_s']:.2f}x"
            dvs = f"{r['decode_tok_s'] / base['decode_tok_s']:.2f}x"
        acc = f"{r['accept']:6.3f} {r['mean_len']:8.2f}" if "accept" in r else f"{'-':>6} {'-':>8}"
        print(f"{b:>2} {row['engine']:<6} {row['method']:<19} {row['prompts']:<7} {r['tok_s']:7.1f} "
              f"{r['decode_tok_s']:7.1f} {acc} {vs:>8} {dvs:>12} {r['compile']:9.1f} {r['others']:6.2f}")
    print("tok/s: B * max_tokens / whole generate() call (prefill included); decode = B * "
          "(max_tokens - 1) / (total - prefill). accept = accepted / drafted tokens; mean len = "
          "tokens emitted per drafting round (1 + accepted / rounds). vs plain: against the same "
          "engine's plain row on the same prompts and B. compile: warm-up less a warm run "
          "(nan: the engine was already compiled on the other prompt set). others: cores other "
          "processes used during the timed runs (0 = the row had the CPUs to itself).")

    bad = []
    for row in rows:
        ref = find(row["b"], "sfjax", "plain", row["prompts"])
        if ref and row["r"]["tokens"] != ref["tokens"]:
            bad.append(f"B={row['b']} {row['engine']} {row['method']} {row['prompts']}")
    print(f"greedy outputs: every row's tokens identical to sfjax plain's on the same prompts: "
          f"{'yes' if not bad else 'NO: ' + '; '.join(bad)} ({len(rows)} rows)")

    print("\nratios:")
    for b in batch_sizes:
        for pname in ("random", "repeat"):
            sp = find(b, "sfjax", "plain", pname)
            for method in ("draft_model", "ngram"):
                r = find(b, "sfjax", method, pname)
                if sp and r:
                    print(f"  B={b} {pname:<6} sfjax {method:<11} / sfjax plain: "
                          f"{r['tok_s'] / sp['tok_s']:.2f}x tok/s, "
                          f"{r['decode_tok_s'] / sp['decode_tok_s']:.2f}x decode "
                          f"(mean len {r['mean_len']:.2f})")
            hp = find(b, "hf", "plain", pname)
            if sp and hp:
                print(f"  B={b} {pname:<6} sfjax plain / HF plain: {sp['tok_s'] / hp['tok_s']:.2f}x")
            sbest = max(((m, find(b, "sfjax", m, pname)) for m in ("draft_model", "ngram")),
                        key=lambda x: x[1]["tok_s"] if x[1] else -1)
            hbest = max(((m, find(b, "hf", m, pname)) for m in ("assisted", "prompt_lookup")),
                        key=lambda x: x[1]["tok_s"] if x[1] else -1)
            if sbest[1] and hbest[1]:
                print(f"  B={b} {pname:<6} sfjax best ({sbest[0]}, {sbest[1]['tok_s']:.1f} tok/s) / "
                      f"HF best assisted ({hbest[0]}, {hbest[1]['tok_s']:.1f} tok/s): "
                      f"{sbest[1]['tok_s'] / hbest[1]['tok_s']:.2f}x")
            elif sbest[1] and hp:
                print(f"  B={b} {pname:<6} sfjax best ({sbest[0]}) / HF plain (no HF assisted "
                      f"at B={b}): {sbest[1]['tok_s'] / hp['tok_s']:.2f}x")

    sp, sd = find(1, "sfjax", "plain"), find(1, "sfjax", "draft_model")
    if sp and sd:
        x = sd["tok_s"] / sp["tok_s"]
        print(f"\ngoal (issue 4): draft_model k={k} at B=1 >= 2.5x plain tok/s (ideal ~3x): "
              f"{x:.2f}x -> {'met' if x >= 2.5 else 'NOT met'}")
    sa = find(1, "sfjax", "plain(draft alone)")
    if sp and sd and sa:
        t_t = (sp["total"] - sp["prefill"]) / (n - 1)
        t_d = (sa["total"] - sa["prefill"]) / (n - 1)
        t_r = (sd["total"] - sd["prefill"]) / max(sd["steps"] - 1, 1)
        print(f"  sfjax B=1 per step: target plain {1e3 * t_t:.2f} ms, draft plain {1e3 * t_d:.2f} ms "
              f"(ratio {t_d / t_t:.2f}); draft_model round {1e3 * t_r:.2f} ms emitting "
              f"{sd['mean_len']:.2f} tokens; with a round = 1 target step + {k} draft steps the "
              f"model predicts {(k + 1) * t_t / (t_t + k * t_d):.2f}x")
    for engine, method in (("sfjax", "draft_model(bad)"), ("hf", "assisted(bad)")):
        r, p = find(1, engine, method), find(1, engine, "plain")
        if r and p:
            t_round = (r["total"] - r["prefill"]) / (n - 1)   # 1 token a round when all are rejected
            t_step = (p["total"] - p["prefill"]) / (n - 1)
            print(f"  all-rejected ({engine}, B=1, k={k}): accept {r['accept']:.3f}, mean len "
                  f"{r['mean_len']:.2f}; {r['tok_s']:.1f} tok/s = {r['tok_s'] / p['tok_s']:.2f}x "
                  f"plain; a round {1e3 * t_round:.2f} ms vs a plain step {1e3 * t_step:.2f} ms "
                  f"({t_round / t_step:.2f}x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", choices=("plain", "spec"), default="plain")
    ap.add_argument("--batch-sizes", help="default 1,32 (plain suite), 1,8 (spec suite)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=96)
    ap.add_argument("--k", type=int, default=4, help="spec suite: drafts per round")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per measurement (best kept)")
    ap.add_argument("--no-hf", action="store_true", help="skip the HF transformers peer")
    ap.add_argument("--model", help="plain suite: an existing HF folder (default: build a random llama-68m)")
    ap.add_argument("--workdir", help="where to build the model(s) (default: a temp dir)")
    ap.add_argument("--quiet-wait", type=float, default=0.0,
                    help="spec suite: before each warm-up and timed part, wait up to this many "
                         "seconds for other processes to go quiet (0: don't wait)")
    ap.add_argument("--quiet-cores", type=float, default=0.1,
                    help="spec suite: 'quiet' = other processes use at most this many cores")
    ap.add_argument("--quiet-retries", type=int, default=3,
                    help="spec suite: redo a timed part that other processes shared, this many times")
    args = ap.parse_args()
    (spec_suite if args.suite == "spec" else plain_suite)(args)


if __name__ == "__main__":
    main()
