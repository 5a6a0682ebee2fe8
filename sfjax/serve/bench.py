"""``sfjax bench --base-url URL``: drives a running server like ``vllm bench serve``.

Each request is a streamed ``/v1/completions`` of prompt token ids (the prompts file tokenized by
the server's ``/tokenize``, or random ids), ``ignore_eos`` with ``--output-len`` tokens, at most
``--max-concurrency`` in flight, arriving at ``--request-rate`` (Poisson; inf: all at t = 0).
TTFT is from sending to the first chunk with tokens; ITL pools the gaps between a request's
chunks; TPOT is (latency - TTFT) / (output tokens - 1), as in vLLM. Acceptance comes from the
server's /metrics before and after. ``--compare-offline`` builds an engine here from the same
flags and runs the same prompts at the same concurrency, alternating with the HTTP runs.
"""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np

from sfjax import benchmark as B


def _error(status: int, body: str) -> str:
    """A failed request's reason: the server's error message, else its status and body."""
    try:
        return f"{status}: {json.loads(body)['error']['message']}"
    except (ValueError, KeyError, TypeError):
        return f"{status}: {body[:200]}"


async def _one(client, ids: list[int], max_tokens: int, sampling: dict) -> dict:
    """A request's chunk times and tokens, or its ``error``."""
    body = {"prompt": ids, "max_tokens": max_tokens, **sampling,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    start, times, tokens = time.monotonic(), [], []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": _error(r.status_code, (await r.aread()).decode(errors="replace"))}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"error": _error(200, json.dumps(chunk))}
            new = [t for c in chunk["choices"] for t in c.get("token_ids") or []]
            if new:
                times.append(time.monotonic())
                tokens += new
    return {"start": start, "times": times, "tokens": tokens}


async def _http_pass(base_url: str, work: B.Workload, args) -> dict:
    import httpx

    limit = args.max_concurrency or len(work.prompt_ids)
    gate = asyncio.Semaphore(limit)
    rng = np.random.default_rng(args.seed or 0)
    async with httpx.AsyncClient(base_url=base_url, timeout=None,
                                 limits=httpx.Limits(max_connections=limit + 8)) as client:
        before = _spec_counters((await client.get("/metrics")).text)

        async def run(ids, n):
            async with gate:
                return await _one(client, ids, n, _body(args))

        tasks, t0 = [], time.monotonic()
        for ids, n in zip(work.prompt_ids, work.max_tokens):
            tasks.append(asyncio.create_task(run(ids, n)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.monotonic() - t0
        after = _spec_counters((await client.get("/metrics")).text)
    ok = [i for i, r in enumerate(results) if "error" not in r and r["tokens"]]
    errors = [r.get("error", "no tokens") for r in results if "error" in r or not r["tokens"]]
    if not ok:        # nothing to time: no figure at all, rather than one over no requests
        raise ValueError(f"--base-url: all {len(results)} requests failed; the first: {errors[0]}")
    res = [results[i] for i in ok]
    ttft = [r["times"][0] - r["start"] for r in res]
    tpot = [(r["times"][-1] - r["times"][0]) / (len(r["tokens"]) - 1) for r in res if len(r["tokens"]) > 1]
    itl = [g for r in res for g in np.diff(r["times"])]
    return {"duration": duration, "tokens": [r["tokens"] for r in res], "ttft": ttft, "tpot": tpot,
            "itl": itl, "input_tokens": sum(len(work.prompt_ids[i]) for i in ok),
            "output_tokens": sum(len(r["tokens"]) for r in res), "failed": len(errors),
            "first_error": errors[0] if errors else None, "spec": _spec_delta(before, after)}


def _spec_counters(text: str) -> dict | None:
    names = {"sfjax:spec_decode_num_drafts_total": "num_drafts",
             "sfjax:spec_decode_num_draft_tokens_total": "num_draft_tokens",
             "sfjax:spec_decode_num_accepted_tokens_total": "num_accepted_tokens"}
    out = {}
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in names:
            out[names[name]] = float(line.rsplit(" ", 1)[1])
    return out or None


def _spec_delta(before: dict | None, after: dict | None) -> dict | None:
    if after is None:
        return None
    d = {k: int(after[k] - (before or {}).get(k, 0)) for k in after}
    return {"acceptance_rate": d["num_accepted_tokens"] / max(d["num_draft_tokens"], 1),
            "mean_acceptance_length": 1 + d["num_accepted_tokens"] / max(d["num_drafts"], 1), **d}


def run_offline(llm, work: B.Workload, params, max_concurrency: int | None) -> dict:
    """The workload through ``llm.engine`` with at most ``max_concurrency`` requests in flight,
    the next added as one finishes (the server side's closed loop, without HTTP)."""
    import dataclasses

    eng, limit = llm.engine, max_concurrency or len(work.prompt_ids)
    llm.reset_prefix_cache()
    before = llm.get_metrics().get("spec_decode")
    queue = list(enumerate(zip(work.prompt_ids, work.max_tokens)))[::-1]
    start, times, tokens, live = {}, {}, {}, 0
    t0 = time.monotonic()
    while queue or live:
        while queue and live < limit:
            i, (ids, n) = queue.pop()
            rid = f"offline-{time.monotonic_ns()}-{i}"
            eng.add_request(rid, {"prompt_token_ids": ids}, dataclasses.replace(params, max_tokens=n))
            start[rid], times[rid], live = time.monotonic(), [], live + 1
        for out in eng.step():
            if out.new_token_ids:
                times[out.request_id].append(time.monotonic())
            if out.finished:
                tokens[out.request_id], live = out.outputs[0].token_ids, live - 1
    duration = time.monotonic() - t0
    after = llm.get_metrics().get("spec_decode")
    rids = list(start)
    spec = None if after is None else _spec_delta(
        {k: before[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")} if before else None,
        {k: after[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")})
    return {"duration": duration, "tokens": [tokens[r] for r in rids],
            "ttft": [times[r][0] - start[r] for r in rids],
            "tpot": [(times[r][-1] - times[r][0]) / (len(tokens[r]) - 1) for r in rids if len(tokens[r]) > 1],
            "itl": [g for r in rids for g in np.diff(times[r])],
            "input_tokens": sum(map(len, work.prompt_ids)),
            "output_tokens": sum(len(tokens[r]) for r in rids), "spec": spec}


def _workload(args, base_url: str) -> B.Workload:
    import httpx

    if args.prompts_file:
        lines = B.read_prompts(args.prompts_file, args.num_prompts)
        ids = [httpx.post(f"{base_url}/tokenize", json={"prompt": p}, timeout=30).json()["tokens"]
               for p in lines]
        return B.Workload(ids, [args.output_len] * len(ids), lines)
    vocab = httpx.get(f"{base_url}/v1/models", timeout=30).json()["data"][0].get("vocab_size", 1000)
    return B.random_workload(args.num_prompts or 32, args.input_len, args.output_len, vocab,
                             args.seed or 0)


def _sampling(args) -> dict:
    """The request body's sampling fields: the flags' values (vLLM's names)."""
    return {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
            "min_p": args.min_p, "seed": args.seed}


def _body(args) -> dict:
    """What every request of the run carries beside its prompt: the sampling fields, and with
    --model the model it asks for (``vllm bench serve``'s --model)."""
    return {**_sampling(args), **({"model": args.model} if args.model is not None else {})}


def _check(args) -> None:
    """The flags --base-url runs with, refused here naming the flag (not as a traceback or a
    silent default)."""
    from sfjax import SamplingParams

    if args.compare_hf:
        raise ValueError("--compare-hf: not with --base-url (--compare-offline compares the "
                         "server with an engine built here)")
    B.check_args(args, offline=False)      # the workload's flags: the offline path's rule
    SamplingParams(**_sampling(args))      # a bad value is refused before any request
    if not args.compare_offline:           # the server runs its own engine
        from sfjax.cli import engine_flags
        for flag, (dest, default) in engine_flags().items():
            # --seed: the requests' too; --model: the name they ask for, as vLLM's bench sends it
            if flag not in ("--seed", "--model") and getattr(args, dest) != default:
                raise ValueError(f"{flag}: an engine flag; with --base-url the server's engine "
                                 f"runs (engine flags build one here only for --compare-offline)")


def main(args) -> int:
    from sfjax import SamplingParams
    import httpx

    import logging
    logging.getLogger("httpx").setLevel(logging.WARNING)     # not a line per request
    _check(args)
    base_url = args.base_url.rstrip("/")
    try:
        work = _workload(args, base_url)
    except httpx.HTTPError as e:
        raise ValueError(f"--base-url {base_url}: {type(e).__name__}: {e}") from None
    http = lambda: asyncio.run(_http_pass(base_url, work, args))
    passes = {"server": http}
    http()                                             # the server compiles what the run uses
    if args.compare_offline:
        from sfjax.cli import _llm
        from sfjax.default_model import default_speculative_config
        llm = _llm(args, default_speculative_config() if args.model is None else None)
        params = SamplingParams(**_sampling(args), ignore_eos=True)
        passes["offline"] = lambda: run_offline(llm, work, params, args.max_concurrency)
        passes["offline"]()
    best: dict[str, dict] = {}
    for _ in range(args.repeats):                      # interleaved, the fastest of each kept
        for name, one in passes.items():
            r = one()
            if name not in best or r["duration"] < best[name]["duration"]:
                best[name] = r
    conc = args.max_concurrency or "all"
    s = best["server"]
    if args.json:
        strip = lambda d: {k: v for k, v in d.items() if k != "tokens"}
        print(json.dumps({k: strip(v) for k, v in best.items()}, indent=2, default=float))
        return 0
    print(B.report(s, f"Serving Benchmark Result (HTTP, concurrency {conc})"))
    if s["failed"]:
        print(f"{'Failed requests:':<40}{s['failed']:<10}")
        print(f"{'First failure:':<40}{s['first_error']}")
    if "offline" in best:
        o = best["offline"]
        print(B.report(o, f"Offline engine (concurrency {conc})"))
        ratio = (s["output_tokens"] / s["duration"]) / (o["output_tokens"] / o["duration"])
        same = s["tokens"] == o["tokens"] if not s["failed"] else "n/a (requests failed)"
        print(f"{'server / offline output throughput:':<40}{ratio:.3f}")
        print(f"{'tokens equal to offline:':<40}{same}")
    return 0
