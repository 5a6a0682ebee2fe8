"""``sfjax bench``: offline serving latency and throughput with vLLM's benchmark labels, and the
same prompts through HF transformers in the same run (``--compare-hf``).

Definitions follow vLLM's benchmark: TTFT is a request's first token time less its arrival; TPOT
is (latency - TTFT) / (output tokens - 1); ITL pools the gaps between a request's successive
token deliveries (a speculative round delivers several tokens at once: one gap). Every request
arrives at t = 0; at most ``max_num_seqs`` run at once. With ``--compare-hf`` the timed passes
take turns (sfjax, then each HF mode, ``--repeats`` times over) and each side's fastest is reported.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import time
from typing import Callable

import numpy as np


@dataclasses.dataclass
class Workload:
    prompt_ids: list[list[int]]
    max_tokens: list[int]
    prompts: list[str | None]


@contextlib.contextmanager
def compiles():
    """Yields a list that collects one entry per program JAX traces, lowers, compiles or loads
    from its persistent cache inside the block (``jax.monitoring``'s compile events)."""
    import jax

    seen: list[str] = []
    listen = lambda event, secs, **kw: seen.append(event) if event.startswith(
        ("/jax/core/compile/", "/jax/compilation_cache/")) else None
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def warm_up(llm, one_pass: Callable[[], object]) -> tuple[float, int]:
    """Runs ``one_pass`` (a pass of a benchmark's workload on ``llm``, an LLM or an Engine) until
    a pass compiles nothing and leaves no bucket pending, so the timed passes run as a
    long-running engine runs the workload: an engine compiles a smaller bucket at its
    ``COMPILE_AFTER`` + 1st ask (``compile.Buckets.fit``), so one pass leaves its draining calls
    padded, and a pass that repeats a prompt meets the prefix cache, whose shorter prefill
    asks for a bucket of its own. Returns (seconds, passes run): a benchmark's compile time is
    the warm-up less that many warm passes. One still compiling after 2 (``COMPILE_AFTER`` + 2)
    passes (a repeated prompt needs ``COMPILE_AFTER`` + 3) is logged: its timed passes would
    compile too."""
    from sfjax.engine.compile import COMPILE_AFTER

    t = time.perf_counter()
    for done in range(1, 2 * (COMPILE_AFTER + 2) + 1):
        with compiles() as seen:
            one_pass()
        pending = getattr(llm, "engine", llm).buckets_pending()
        if not seen and not pending:
            break
    else:
        logging.getLogger("sfjax").warning(
            "warm-up: pass %d still compiled %d programs (buckets pending: %s); the timed "
            "passes will compile too", done, len(seen), pending)
    return time.perf_counter() - t, done


def check_args(args, offline: bool) -> None:
    """The workload's flags, refused naming the flag before anything loads: one rule for both
    ``sfjax bench`` paths (offline and ``--base-url``); offline, the flags of the server's
    path alone are refused too."""
    from sfjax.checks import integer, real

    integer("--num-prompts", args.num_prompts, 1, optional=True)
    integer("--input-len", args.input_len, 1)
    integer("--output-len", args.output_len, 1)
    integer("--repeats", args.repeats, 1)
    real("--request-rate", args.request_rate, 0.0, lo_open=True, finite=False)
    integer("--max-concurrency", args.max_concurrency, 1, optional=True)
    for flag, given in (("--max-concurrency", args.max_concurrency is not None),
                        ("--request-rate", args.request_rate != float("inf")),
                        ("--compare-offline", args.compare_offline)):
        if offline and given:
            raise ValueError(f"{flag}: only with --base-url (offline, every request arrives at "
                             f"t = 0 and at most --max-num-seqs run at once)")


def random_workload(num: int, input_len: int, output_len: int, vocab: int, seed: int) -> Workload:
    rng = np.random.default_rng(seed)
    ids = [rng.integers(3, vocab, input_len).tolist() for _ in range(num)]
    return Workload(ids, [output_len] * num, [None] * num)


def read_prompts(path: str, num: int | None = None) -> list[str]:
    """The first ``num`` (default: all) prompts of a text file (one per non-blank line) or a
    JSONL file (a ``{"prompt": str}`` object per non-blank line); a ValueError naming
    --prompts-file, the file and the line for a file that can't be read or a line that is not
    such a prompt."""
    from sfjax.checks import text

    where = f"--prompts-file {path!r}"
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ValueError(f"{where}: {e.strerror or e}") from None
    jsonl = path.endswith(".jsonl")
    prompts = []
    for n, line in enumerate(raw.splitlines(), 1):
        if num is not None and len(prompts) >= num:
            break
        try:
            line = line.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{where} line {n}: not UTF-8 text ({e.reason} at byte "
                             f"{e.start})") from None
        if not line.strip():
            continue
        if jsonl:
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{where} line {n}: not valid JSON ({e})") from None
            if not isinstance(obj, dict) or "prompt" not in obj:
                raise ValueError(f"{where} line {n}: must be a JSON object with a \"prompt\", "
                                 f'e.g. {{"prompt": "def fib(n):"}}')
            line = text(f"{where} line {n}: \"prompt\"", obj["prompt"])
        prompts.append(line)
    if not prompts:
        raise ValueError(f"{where} has no prompts")
    return prompts


def file_workload(path: str, tokenizer, output_len: int, num: int | None) -> Workload:
    """Prompts from a text file (one per line) or a JSONL file ({"prompt": ...} per line)."""
    return tokenized(read_prompts(path, num), tokenizer, output_len)


def tokenized(prompts: list[str], tokenizer, output_len: int) -> Workload:
    return Workload([tokenizer.encode(p).ids for p in prompts], [output_len] * len(prompts),
                    prompts)


def run_engine(llm, work: Workload, params) -> dict:
    """Runs the workload through ``llm.engine`` step by step (``params``: one SamplingParams, or
    one per request); returns per-request timings."""
    eng = llm.engine
    llm.reset_prefix_cache()           # a repeated workload must not hit the previous run's blocks
    before = llm.get_metrics().get("spec_decode")
    t0 = time.monotonic()
    ids = []
    per = params if isinstance(params, (list, tuple)) else [params] * len(work.prompt_ids)
    for i, (p, n, sp) in enumerate(zip(work.prompt_ids, work.max_tokens, per)):
        rid = f"bench-{time.monotonic_ns()}-{i}"
        eng.add_request(rid, {"prompt_token_ids": p}, dataclasses.replace(sp, max_tokens=n))
        ids.append(rid)
    deliveries = {rid: [] for rid in ids}           # (time, tokens) per step that gave tokens
    tokens = {}
    while eng.has_unfinished_requests():
        outs = eng.step()
        now = time.monotonic()
        for out in outs:
            if out.new_token_ids:
                deliveries[out.request_id].append((now, len(out.new_token_ids)))
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
    duration = time.monotonic() - t0
    after = llm.get_metrics().get("spec_decode")
    spec = None
    if after is not None:
        d = {k: after[k] - (before[k] if before else 0)
             for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
        spec = {"acceptance_rate": d["num_accepted_tokens"] / max(d["num_draft_tokens"], 1),
                "mean_acceptance_length": 1 + d["num_accepted_tokens"] / max(d["num_drafts"], 1), **d}
    ttft, tpot, itl = [], [], []
    for rid in ids:
        times = [t for t, _ in deliveries[rid]]
        n = sum(k for _, k in deliveries[rid])
        ttft.append(times[0] - t0)
        if n > 1:
            tpot.append((times[-1] - times[0]) / (n - 1))
        itl += list(np.diff(times))
    return {"duration": duration, "tokens": [tokens[r] for r in ids], "ttft": ttft, "tpot": tpot,
            "itl": itl, "input_tokens": sum(map(len, work.prompt_ids)),
            "output_tokens": sum(len(tokens[r]) for r in ids), "spec": spec}


def report(r: dict, title: str = "Serving Benchmark Result") -> str:
    """vLLM's result block, plus speculative decoding's acceptance."""
    ms = lambda xs, f: 1000 * float(f(xs)) if xs else float("nan")
    n = len(r["tokens"])
    lines = [f"{' ' + title + ' ':=^50}",
             f"{'Successful requests:':<40}{n:<10}",
             f"{'Benchmark duration (s):':<40}{r['duration']:<10.2f}",
             f"{'Total input tokens:':<40}{r['input_tokens']:<10}",
             f"{'Total generated tokens:':<40}{r['output_tokens']:<10}",
             f"{'Request throughput (req/s):':<40}{n / r['duration']:<10.2f}",
             f"{'Output token throughput (tok/s):':<40}{r['output_tokens'] / r['duration']:<10.2f}",
             f"{'Total token throughput (tok/s):':<40}"
             f"{(r['input_tokens'] + r['output_tokens']) / r['duration']:<10.2f}"]
    for name, key, head in (("TTFT", "ttft", "Time to First Token"),
                            ("TPOT", "tpot", "Time per Output Token (excl. 1st token)"),
                            ("ITL", "itl", "Inter-token Latency")):
        lines.append(f"{head:-^50}")
        for stat, f in (("Mean", np.mean), ("Median", np.median),
                        ("P99", lambda x: np.percentile(x, 99))):
            lines.append(f"{f'{stat} {name} (ms):':<40}{ms(r[key], f):<10.2f}")
    if r["spec"] is not None:
        s = r["spec"]
        lines += [f"{'Speculative Decoding':-^50}",
                  f"{'Acceptance rate (%):':<40}{100 * s['acceptance_rate']:<10.2f}",
                  f"{'Mean acceptance length:':<40}{s['mean_acceptance_length']:<10.2f}",
                  f"{'Drafts:':<40}{s['num_drafts']:<10}",
                  f"{'Draft tokens:':<40}{s['num_draft_tokens']:<10}",
                  f"{'Accepted tokens:':<40}{s['num_accepted_tokens']:<10}"]
    lines.append("=" * 50)
    return "\n".join(lines)


def hf_passes(model_path: str, work: Workload, temperature: float,
              modes: dict[str, dict]) -> dict[str, Callable[[], dict]]:
    """HF transformers ``generate`` over the same prompt ids, one request at a time (assisted
    generation takes batch 1), per mode ({name: generate kwargs}): after one warm-up pass each,
    {name: a function running one timed pass}, which returns its duration, output tokens and
    token ids. The caller interleaves them with its own passes, so a slow spell of the machine
    falls on both sides of a ratio. Imports torch: only for ``--compare-hf``."""
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        raise ValueError(f"--compare-hf needs torch and transformers installed ({e})") from None
    load = lambda p: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()
    model = load(model_path)
    sample = dict(do_sample=True, temperature=temperature) if temperature > 0 else dict(do_sample=False)

    def one_pass(kw):
        t0, toks = time.monotonic(), []
        for p, n in zip(work.prompt_ids, work.max_tokens):
            x = torch.tensor([p])
            with torch.inference_mode():
                y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                                   min_new_tokens=n, pad_token_id=0, **sample, **kw)
            toks.append(y[0, len(p):].tolist())
        return {"duration": time.monotonic() - t0, "tokens": toks, "output_tokens": sum(map(len, toks))}

    out = {}
    for name, kw in modes.items():
        kw = dict(kw)
        if "assistant_model" in kw:
            kw["assistant_model"] = load(kw["assistant_model"])
        one_pass(kw)                                      # warms torch up
        out[name] = functools.partial(one_pass, kw)
    return out
