"""Several decode rounds per host call (``num_scheduler_steps``): the same tokens, finish reasons,
speculation counters and device rounds as one step per call, with arrivals, aborts, requests
that need the host between tokens, and a cache too small for the rounds."""

import dataclasses

import numpy as np
import pytest

from sfjax import LLM, SamplingParams, toy
from sfjax.engine.engine import EngineConfig
from sfjax.engine.scheduler import Status
from sfjax.engine.slots import LENGTH, LIVE
from engine_checks import check_engine, check_idle

# Without certified small tiles: in a one-tile bucket each is a branch of every tile loop
# (``rows.per_tile_sized``), and it gives a row the whole tile's bits (tests/test_model.py), so it
# cannot change what these tests compare; tests/golden_runs.py runs several rounds with them.
GEOMETRY = dict(max_num_seqs=4, max_model_len=64, row_tile=8, small_row_tiles=False)


def _params():
    """Every stop rule the rounds end on: EOS, stop ids, max_tokens (also 1 and 2), min_tokens,
    max_model_len; greedy and seeded draws with the filters, penalties, logit_bias and
    allowed_token_ids."""
    return [
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=1, max_tokens=23, top_k=40, top_p=0.9,
                       logit_bias={7: 4.0, 300: 2.5, 12: -100}),
        SamplingParams(temperature=1.0, seed=2, max_tokens=40, repetition_penalty=1.3,
                       presence_penalty=0.4, frequency_penalty=0.2, min_p=0.05),
        SamplingParams(temperature=0.8, seed=3, max_tokens=50, stop_token_ids=[5, 17, 33],
                       min_tokens=6),
        SamplingParams(temperature=0, max_tokens=1),
        SamplingParams(temperature=0.7, seed=4, max_tokens=2),
        SamplingParams(temperature=1.2, seed=5, max_tokens=50),      # EOS (id 1) may end it
        SamplingParams(temperature=0, max_tokens=None, ignore_eos=True,   # up to max_model_len
                       allowed_token_ids=list(range(40, 90))),
    ]


# at most 8 tokens each, so few prefill shapes compile
PROMPTS = [{"prompt_token_ids": p} for p in
           ([7, 300, 12, 45, 99], [3, 3, 17, 250, 3, 3, 17], [480, 2, 2, 2], [11, 12, 13, 11, 12],
            [200, 201], [9] * 8, list(range(40, 48)), [64, 65, 64, 65, 64])]


def _spec(kind, folders):
    return {"plain": None,
            "ngram": {"method": "ngram", "num_speculative_tokens": 3},
            "draft": {"model": folders["same"], "num_speculative_tokens": 3},
            "draft-rejection": {"model": folders["other"], "num_speculative_tokens": 2,
                                "acceptance_method": "rejection_sampler"}}[kind]


@pytest.fixture(scope="module")
def folders(tiny_folder, model_folder):
    return {"same": tiny_folder, "other": model_folder(toy.tiny_config(), seed=1, std=0.1)}


def _summary(outs):
    return [(o.request_id, o.outputs[0].token_ids, o.outputs[0].finish_reason,
             o.outputs[0].stop_reason, o.outputs[0].text) for o in outs]


@pytest.mark.parametrize("kind", ["plain", "ngram", "draft"])
def test_rounds_give_the_single_step_tokens(tiny_folder, folders, kind):
    """With each call read back before the next is sent (async scheduling sends one early while
    requests wait for slots, and so admits them a call later: the same tokens, other rounds)."""
    spec = _spec(kind, folders)
    runs = {}
    for steps in (1, 8):
        llm = LLM(tiny_folder, **GEOMETRY, num_scheduler_steps=steps, speculative_config=spec,
                  async_scheduling=False)
        outs = llm.generate(PROMPTS, _params(), use_tqdm=False)
        m = llm.get_metrics()
        runs[steps] = (_summary(outs), m["steps"], m.get("spec_decode"),
                       [o.metrics.spec_decode for o in outs], m["host_steps"])
        check_idle(llm.engine)
    one, many = runs[1], runs[8]
    assert many[0] == one[0]                  # tokens, finish and stop reasons, text
    assert many[1] == one[1]                  # the same device rounds
    assert many[2] == one[2] and many[3] == one[3]   # spec counters, per request too
    assert one[4] == one[1] and many[4] < many[1], "no call ran several rounds"


@pytest.mark.parametrize("kind", ["plain", "ngram", "draft-rejection"])
def test_stop_strings_and_logprobs_run_in_rounds(tiny_folder, folders, kind):
    """Stop strings taken from each request's own text (so they hit, mid-output), and logprobs
    (top 3, none, top 0, top 20): several rounds per call still run while these requests decode.
    The host cuts each text at its stop string where one step per call does, and every output
    equals one step per call's: tokens, text, stop reason, each token's logprob entry (its
    logprob, rank and top ids, bitwise), the cumulative logprob, and the speculation counters
    (the rounds past a stop not counted), per request and in total. Under rejection sampling
    the entries are those of the emitted tokens, which may differ from the target's draws."""
    spec = _spec(kind, folders)
    free = LLM(tiny_folder, **GEOMETRY, speculative_config=spec).generate(
        PROMPTS[:4], _params()[:4], use_tqdm=False)
    stops = []
    for o in free:
        text = o.outputs[0].text
        assert len(text) > 4, "a text too short to cut"
        stops.append([text[len(text) // 2:len(text) // 2 + 2]])
    params = [dataclasses.replace(p, stop=stop, logprobs=n)
              for p, stop, n in zip(_params()[:4], stops, (3, None, 0, 20))]
    runs = {}
    for steps in (1, 8):
        llm = LLM(tiny_folder, **GEOMETRY, num_scheduler_steps=steps, speculative_config=spec)
        outs = llm.generate(PROMPTS[:4], params, use_tqdm=False)
        m = llm.get_metrics()
        runs[steps] = (_summary(outs), m.get("spec_decode"),
                       [(o.outputs[0].logprobs, o.outputs[0].cumulative_logprob,
                         o.metrics.spec_decode) for o in outs])
        assert (m["host_steps"] < m["steps"]) == (steps > 1), "no call ran several rounds"
        check_idle(llm.engine)
    assert runs[8] == runs[1]
    summary, _, reported = runs[1]
    assert [o[3] for o in summary] == [s[0] for s in stops]          # each cut at its stop
    assert all(len(a[1]) < len(b.outputs[0].token_ids) for a, b in zip(summary, free))
    for (_, ids, *_), (lps, cum, _), p in zip(summary, reported, params):
        if p.logprobs is None:
            assert lps is None and cum is None
            continue
        assert len(lps) == len(ids) and all(len(e) >= max(p.logprobs, 1) for e in lps)
        assert cum == pytest.approx(sum(e[t].logprob for e, t in zip(lps, ids)))


def test_arrivals_aborts_and_host_requests_between_rounds(tiny_folder, folders):
    """Requests arrive and are aborted while others decode; one asks for logprobs and one for a
    stop string. Every
    request's output equals a single-step engine's, the invariants hold after every step, and
    nothing leaks."""
    spec = _spec("draft-rejection", folders)
    params = _params()
    host = [SamplingParams(temperature=0, max_tokens=20, logprobs=2),
            SamplingParams(temperature=0.8, seed=7, max_tokens=30, stop=["a"])]
    results = {}
    for steps in (1, 8):
        eng = LLM(tiny_folder, **GEOMETRY, num_scheduler_steps=steps, speculative_config=spec).engine
        outs, n = {}, 0
        while n < 12 or eng.has_unfinished_requests():
            if n < 12 and (n < 3 or n % 3 == 0):       # arrivals while others are decoding
                p = {6: host[0], 9: host[1]}.get(n, params[n % len(params)])
                eng.add_request(f"r{n}", PROMPTS[n % len(PROMPTS)], p)
            if n == 4:
                eng.abort("r1")
            for o in eng.step():
                outs[o.request_id] = o
            check_engine(eng)
            n += 1
        check_idle(eng)
        results[steps] = {k: _summary([o])[0] + (o.outputs[0].logprobs is not None,)
                          for k, o in outs.items() if o.finished and k != "r1"}
    assert results[8] == results[1]


def _spy_follows(eng):
    """Counts the calls ``Engine._follow`` sends before the one before them is read back, and
    those of their requests that had ended on the host by the time the call was read (a stop
    string, an abort, a failure: their tokens dropped)."""
    seen = {"sent": 0, "dropped": 0, "with_stops": 0, "waiting": 0, "no_round": 0}
    follow, collect = eng._follow, eng._collect

    def spy_follow(call):
        nxt = follow(call)
        seen["sent"] += nxt is not None
        seen["with_stops"] += nxt is not None and any(req.params.stop for req in nxt.decode)
        return nxt

    def spy_collect(call):
        seen["dropped"] += sum(req.status is not Status.RUNNING for req in call.decode)
        if call.waits:          # sent while requests waited for slots: no round if one ended
            seen["waiting"] += 1
            seen["no_round"] += int(np.asarray(call.result[0])[0, 1]) == 0
        return collect(call)

    eng._follow, eng._collect = spy_follow, spy_collect
    return seen


# draft-rejection first, after the test above: each kind's two runs and the tests before it
# share compiled programs (the suite's programs cache is bounded, and a draft model's round
# takes the longest to compile)
@pytest.mark.parametrize("steps", [1, 8])
@pytest.mark.parametrize("kind", ["draft-rejection", "plain", "ngram", "ngram-threshold"])
def test_async_scheduling_gives_the_same_outputs(tiny_folder, folders, kind, steps):
    """The next call sent before the last is read back (``async_scheduling``, the default): every
    output (tokens, text, finish and stop reasons, logprobs bitwise, speculation counters per
    request and in total) and the device rounds equal an engine that reads each call back before
    sending the next, with stop strings that end requests on the host while the next call runs
    (its tokens for them are dropped) and every device stop rule. Calls went out early, also
    while requests waited for slots (then running no round when a request had ended in the call
    before, so its slot goes to a waiting one first); under a speculation threshold none with a
    request that has stop strings: the device would count it as running after the host had
    ended it (``Engine._follow``)."""
    spec = _spec(kind.replace("-threshold", ""), folders)
    if kind == "ngram-threshold":
        spec = dict(spec, disable_by_batch_size=3)
    order = (1, 3, 6, 7, 0, 2)         # the last two, with stop strings, wait for a slot
    free = LLM(tiny_folder, **GEOMETRY, speculative_config=spec).generate(
        [PROMPTS[0], PROMPTS[2]], [_params()[0], _params()[2]], use_tqdm=False)
    stops = {i: [o.outputs[0].text[len(o.outputs[0].text) // 2:][:2]] for i, o in zip((0, 2), free)}
    params = [dataclasses.replace(_params()[i], stop=stops.get(i), logprobs=n)
              for i, n in zip(order, (2, 0, 5, None, None, 3))]
    prompts = [PROMPTS[i] for i in order]
    runs = {}
    for overlap in (False, True):
        llm = LLM(tiny_folder, **GEOMETRY, num_scheduler_steps=steps, speculative_config=spec,
                  async_scheduling=overlap)
        seen = _spy_follows(llm.engine)
        outs = llm.generate(prompts, params, use_tqdm=False)
        m = llm.get_metrics()
        runs[overlap] = (_summary(outs), [(o.outputs[0].logprobs, o.outputs[0].cumulative_logprob,
                                           o.metrics.spec_decode) for o in outs],
                         m["steps"], m.get("spec_decode"), seen)
        check_idle(llm.engine)
    off, on = runs[False], runs[True]
    assert on[:2] == off[:2] and on[3] == off[3]
    assert on[2] >= off[2]          # more device rounds only for requests ended on the host
    assert off[4] == dict.fromkeys(off[4], 0)
    assert on[4]["sent"] > 0, "no call went out before the last was read back"
    if kind == "ngram-threshold":
        assert on[4]["with_stops"] == 0
    else:
        assert on[4]["with_stops"] > 0 and on[4]["dropped"] > 0, on[4]
        assert 0 < on[4]["no_round"] < on[4]["waiting"], on[4]    # six requests, four slots
    assert any(o[3] is not None for o in on[0]), "no stop string ended a request"


def test_rounds_shrink_to_the_free_blocks(tiny_folder):
    """A cache too small for 16 rounds of every request: fewer rounds per call (or single steps
    with preemption), the same tokens as a roomy single-step engine."""
    params = [SamplingParams(temperature=0.9, seed=i, max_tokens=52, ignore_eos=True) for i in range(4)]
    ref = LLM(tiny_folder, **GEOMETRY, num_scheduler_steps=1).generate(PROMPTS[:4], params, use_tqdm=False)
    tight = LLM(tiny_folder, **GEOMETRY, num_scheduler_steps=16, block_size=8, num_kv_blocks=1 + 24)
    got = tight.generate(PROMPTS[:4], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    m = tight.get_metrics()
    assert m["host_steps"] < m["steps"]
    check_idle(tight.engine)


@pytest.mark.parametrize("bad", [0, -1, 1025])
def test_num_scheduler_steps_out_of_range(bad):
    with pytest.raises(ValueError, match=rf"num_scheduler_steps = {bad} is out of range: must be an int in \[1, 1024\]"):
        EngineConfig(num_scheduler_steps=bad)


# penalties strong enough that a draft drawn over the wrong history is another token
PENALISED = [SamplingParams(temperature=0.8, seed=40 + i, max_tokens=24, ignore_eos=True,
                            repetition_penalty=2.0, presence_penalty=1.5, frequency_penalty=1.0)
             for i in range(3)] + [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                  repetition_penalty=1.8, presence_penalty=1.0)]


def _tokens_and_counts(outs):
    return ([o.outputs[0].token_ids for o in outs],
            [(o.metrics.spec_decode["num_draft_tokens"], o.metrics.spec_decode["num_accepted_tokens"])
             for o in outs])


@pytest.mark.parametrize("steps", [1, 8])
def test_draft_penalties_see_the_rounds_own_drafts(tiny_folder, steps):
    """A draft model that is the target, drawing with the target's keys (exact acceptance): each
    draft is the token plain decoding draws at its position only if its penalties count the
    round's earlier drafts, so every draft must be accepted, one step or several rounds a call."""
    plain = LLM(tiny_folder, **GEOMETRY, num_scheduler_steps=1).generate(
        PROMPTS[:4], PENALISED, use_tqdm=False)
    llm = LLM(tiny_folder, **GEOMETRY, num_scheduler_steps=steps,
              speculative_config={"model": tiny_folder, "num_speculative_tokens": 3})
    tokens, counts = _tokens_and_counts(llm.generate(PROMPTS[:4], PENALISED, use_tqdm=False))
    assert tokens == [o.outputs[0].token_ids for o in plain]
    assert all(d > 0 and a == d for d, a in counts), counts
    check_idle(llm.engine)


def test_penalised_rejection_sampling_repeats_across_rounds_and_slot_reuse(model_folder):
    """Rejection sampling on a peaked model drafting for itself, penalised seeded requests: the
    draft's distribution is the target's at every position (so every draft is accepted), and
    the tokens and counters are the same with one step or eight rounds a call, for requests in
    a fresh engine or after others in the slots they left (old tokens past their lengths)."""
    peaked = model_folder(toy.tiny_config(), seed=0, std=0.3)
    spec = {"model": peaked, "num_speculative_tokens": 6, "acceptance_method": "rejection_sampler"}
    params = [SamplingParams(temperature=t, seed=50 + i, max_tokens=30, ignore_eos=True,
                             repetition_penalty=3.0, presence_penalty=2.0, frequency_penalty=2.0)
              for i, t in enumerate((0.3, 0.6, 1.0, 1.5))]
    late = [{"prompt_token_ids": [5, 6, 5, 6]}] * 4
    runs = []
    for steps in (1, 8):
        llm = LLM(peaked, **GEOMETRY, num_scheduler_steps=steps, speculative_config=spec)
        runs.append(_tokens_and_counts(llm.generate(late, params, use_tqdm=False)))
        llm.generate(PROMPTS[4:8], [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)] * 4,
                     use_tqdm=False)                              # long outputs in every slot
        runs.append(_tokens_and_counts(llm.generate(late, params, use_tqdm=False)))
        check_idle(llm.engine)
    assert all(r == runs[0] for r in runs), runs
    assert all(d > 0 and a == d for d, a in runs[0][1]), runs[0][1]


def _spy_calls(eng):
    """Records, per device call, the host's rows (slot, position pairs), the slots its progress
    marks live and their lengths: ``Engine._call`` wrapped on the instance."""
    calls, call = [], eng._call

    def spy(batch, sb, rows, with_logprobs, progress, *args, **kwargs):
        real = np.asarray(batch.slots) >= 0
        live = [] if progress is None else np.flatnonzero(progress[:, LIVE]).tolist()
        calls.append((list(zip(np.asarray(batch.slots)[real].tolist(),
                               np.asarray(batch.positions)[real].tolist())), list(rows), live,
                      [] if progress is None else progress[live, LENGTH].tolist()))
        return call(batch, sb, rows, with_logprobs, progress, *args, **kwargs)

    eng._call = spy
    return calls


@pytest.mark.parametrize("kind", ["plain", "ngram", "draft"])
def test_host_lays_out_only_prefill_chunks(tiny_folder, folders, kind):
    """With a token budget of 8, long prompts arrive in chunks while others decode: every call's
    host rows are prefill rows only (no live slot's, none at a decoding position), their count
    per data shard is what the call says, some calls carry both prefill rows and live decode
    slots, and the tokens and counters equal an engine whose prompts fit one step."""
    spec = _spec(kind, folders)
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 480 + 2 for j in range(5 + 5 * i)]}
               for i in range(4)]
    params = [dataclasses.replace(p, max_tokens=24) for p in _params()[:4]]
    roomy = LLM(tiny_folder, **GEOMETRY, max_num_batched_tokens=64,
                speculative_config=spec)
    want = _tokens_and_counts(roomy.generate(prompts, params, use_tqdm=False)) if spec else \
        [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    llm = LLM(tiny_folder, **GEOMETRY, max_num_batched_tokens=8, speculative_config=spec)
    calls = _spy_calls(llm.engine)
    outs = llm.generate(prompts, params, use_tqdm=False)
    got = _tokens_and_counts(outs) if spec else [o.outputs[0].token_ids for o in outs]
    assert got == want
    mixed = 0
    for host, rows, live, lengths in calls:
        assert len(host) == sum(rows) <= 8
        assert not {slot for slot, _ in host} & set(live), "a live slot's row laid out on the host"
        mixed += bool(host and live)
    assert mixed > 0, "no call had both prefill chunks and decoding slots"
    check_idle(llm.engine)


def test_a_row_whose_pages_do_not_hold_its_drafts_drafts_none(tiny_folder, folders):
    """A cache so small that a decoding row's pages often cannot grow for its k drafts: the
    device drafts none for it that round (its pages hold only its next token), and the tokens
    equal a roomy plain engine's."""
    params = [SamplingParams(temperature=0.9, seed=i, max_tokens=52, ignore_eos=True)
              for i in range(4)]
    ref = LLM(tiny_folder, **GEOMETRY, num_scheduler_steps=1).generate(PROMPTS[:4], params,
                                                                        use_tqdm=False)
    tight = LLM(tiny_folder, **GEOMETRY, num_scheduler_steps=1, block_size=8,
                num_kv_blocks=1 + 24, speculative_config=_spec("ngram", folders))
    refused, grow = [], tight.engine.scheduler.grow

    def spy(req, upto):
        ok = grow(req, upto)
        if not ok and upto > req.num_tokens:
            refused.append(req.request_id)
        return ok

    tight.engine.scheduler.grow = spy
    got = tight.generate(PROMPTS[:4], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    assert refused, "no row's pages were refused growth for its drafts"
    check_idle(tight.engine)


def test_aborts_failures_and_arrivals_while_a_call_is_in_flight(tiny_folder, folders):
    """Each while a call is in flight (sent before the last was read back): a request is aborted,
    one fails as its tokens are read (its detokenizer raises), and one arrives. The aborted one
    ends with its tokens so far (a prefix of its own) and gets nothing after; the failed one ends
    with its error; the others' tokens equal each one's run alone; the invariants hold after
    every step, and nothing leaks."""
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=9, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=10, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=36, ignore_eos=True)]
    llm = LLM(tiny_folder, **GEOMETRY, speculative_config=_spec("ngram", folders))
    alone = [llm.generate([PROMPTS[i]], params[i], use_tqdm=False)[0].outputs[0].token_ids
             for i in range(4)]

    def fails(token):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "boom while detokenizing")

    eng = llm.engine
    for i in range(3):
        eng.add_request(f"r{i}", PROMPTS[i], params[i])
    outs, events = {}, []
    while eng.has_unfinished_requests():
        if eng._inflight is not None and len(events) < 3:
            event = ("abort", "fail", "arrive")[len(events)]
            events.append(event)
            if event == "abort":
                eng.abort("r0")
            elif event == "fail":
                eng.requests["r1"].detok.add = fails
            else:
                eng.add_request("r3", PROMPTS[3], params[3])
        for o in eng.step():
            outs.setdefault(o.request_id, []).append(o)
        check_engine(eng)
    check_idle(eng)
    assert events == ["abort", "fail", "arrive"], "no call was in flight for each event"
    last = {k: v[-1] for k, v in outs.items()}
    assert [sum(o.finished for o in outs[k]) for k in sorted(outs)] == [1] * 4
    assert last["r0"].outputs[0].finish_reason == "abort"
    got = last["r0"].outputs[0].token_ids
    assert 0 < len(got) < len(alone[0]) and got == alone[0][:len(got)]
    assert last["r1"].outputs[0].finish_reason == "error" and "boom" in last["r1"].error
    assert [last[f"r{i}"].outputs[0].token_ids for i in (2, 3)] == [alone[2], alone[3]]


def test_async_scheduling_keeps_the_counters_under_a_speculation_threshold(tiny_folder, folders):
    """Three requests at a threshold of three (no drafts while all run): once one ends, the
    others draft, in the call sent ahead too; each request's counters equal those of an engine
    that reads every call back first (the host counts the rounds that drafted)."""
    spec = dict(_spec("ngram", folders), disable_by_batch_size=3)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (6, 40, 44)]
    runs = []
    for overlap in (False, True):
        llm = LLM(tiny_folder, **GEOMETRY, speculative_config=spec, async_scheduling=overlap)
        outs = llm.generate(PROMPTS[:3], params, use_tqdm=False)
        runs.append(([o.outputs[0].token_ids for o in outs],
                     [o.metrics.spec_decode for o in outs], llm.get_metrics()["spec_decode"]))
        check_idle(llm.engine)
    assert runs[1] == runs[0]
    assert runs[0][2]["num_draft_tokens"] > 0


def test_a_call_not_read_back_leaves_the_engine_able_to_step(tiny_folder):
    """Reading a call back fails once (with a call sent ahead in flight): the step raises, and
    the engine steps on from what the host had read, with the same tokens as a run without
    the failure."""
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=40, ignore_eos=True)
              for i in range(3)]
    llm = LLM(tiny_folder, **GEOMETRY)
    ref = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], params, use_tqdm=False)]
    eng = llm.engine
    collect, calls = eng._collect, []

    def flaky(call):
        calls.append(eng._inflight is not None)
        if len(calls) == 4:
            raise RuntimeError("boom while reading back")
        return collect(call)

    eng._collect = flaky
    for i in range(3):
        eng.add_request(f"r{i}", PROMPTS[i], params[i])
    got, raised = {}, 0
    while eng.has_unfinished_requests():
        try:
            outs = eng.step()
        except RuntimeError:
            raised += 1
            continue
        for o in outs:
            got[o.request_id] = o.outputs[0].token_ids
        check_engine(eng)
    assert raised == 1 and any(calls[:4]), "no call was in flight when reading failed"
    assert [got[f"r{i}"] for i in range(3)] == ref
    check_idle(eng)


@pytest.mark.parametrize("kind", ["plain", "ngram"])
def test_decode_calls_do_not_run_in_a_prefill_bucket(tiny_folder, folders, kind, monkeypatch):
    """After a prefill of 4 prompts of 30 tokens (a 128-row bucket), decoding calls run in a
    bucket of at most ``FIT_SLACK`` times their own rows (4 slots of k + 1 rows: 16), not in
    the prefill's: every row of a bucket costs the round something, skipped tiles or not (here
    with no calls waiting before a bucket compiles, ``COMPILE_AFTER``: the next test counts
    them). The tokens equal those of calls of one round each (which never share the prefill's
    bucket)."""
    import sfjax.engine.compile as buckets
    from sfjax.rows import bucket

    monkeypatch.setattr(buckets, "COMPILE_AFTER", 0)
    spec = _spec(kind, folders)
    prompts = [{"prompt_token_ids": [(11 * i + 5 * j) % 480 + 2 for j in range(30)]}
               for i in range(4)]
    params = [dataclasses.replace(p, max_tokens=20) for p in _params()[:4]]
    llm = LLM(tiny_folder, **GEOMETRY, speculative_config=spec, num_scheduler_steps=8)
    shapes = _spy_shapes(llm.engine)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    k1 = 4 if spec else 1
    need = bucket(GEOMETRY["max_num_seqs"] * k1, GEOMETRY["row_tile"])
    assert max(n for host, n, _ in shapes if host) >= 4 * need      # a prefill bucket ran
    decode = [(n, r) for host, n, r in shapes if not host]
    slack = buckets.FIT_SLACK
    assert decode and all(n <= slack * need and r <= slack * need for n, r in decode)
    one = LLM(tiny_folder, **GEOMETRY, speculative_config=spec, num_scheduler_steps=1)
    assert got == [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    check_idle(llm.engine)


def test_a_speculating_engine_sizes_its_decode_bucket_by_its_load(tiny_folder, folders):
    """One request on an engine of 32 slots with n-gram k = 3 decodes in one tile (its own
    k + 1 rows), not in a bucket of every slot's (128 rows and logit rows): the bucket follows
    the slots that decode. Its first ``COMPILE_AFTER`` decode calls run in the prefill's
    bucket (128 rows), which the engine has compiled; the next compiles the tile's bucket, and
    every later one runs in it. The tokens equal a plain engine's."""
    from sfjax.engine.compile import COMPILE_AFTER

    prompt = [{"prompt_token_ids": [3, 3, 17, 250, 3, 3, 17, 250, 3, 3]}]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    llm = LLM(tiny_folder, max_num_seqs=32, max_model_len=64, row_tile=8, num_scheduler_steps=1,
              speculative_config=_spec("ngram", folders))
    shapes = _spy_shapes(llm.engine)
    got = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    prefill = [s[1:] for s in shapes if s[0]]
    assert len(prefill) == 1 and prefill[0][0] == 128, shapes      # every slot's k + 1 rows
    decode = [(n, r) for host, n, r in shapes if not host]
    assert len(decode) > COMPILE_AFTER + 2, shapes        # 48 tokens, at most 4 a call
    assert decode == prefill * COMPILE_AFTER + [(8, 8)] * (len(decode) - COMPILE_AFTER)
    assert llm.engine.buckets_pending() == []
    ref = LLM(tiny_folder, **GEOMETRY).generate(prompt, params, use_tqdm=False)
    assert got == ref[0].outputs[0].token_ids
    check_idle(llm.engine)


def test_a_benchmarks_warm_up_runs_until_its_buckets_have_compiled(tiny_folder, folders):
    """A pass whose one decode call asks for the tile's bucket once: ``warm_up`` runs it until
    that bucket has compiled and then one pass more that compiles nothing (``COMPILE_AFTER`` + 2
    passes, which it returns: a benchmark's compile time is its warm-up less that many warm
    passes), so a timed pass runs in it."""
    from sfjax.benchmark import warm_up
    from sfjax.engine.compile import COMPILE_AFTER

    llm = LLM(tiny_folder, max_num_seqs=32, max_model_len=64, row_tile=8,
              enable_prefix_caching=False, speculative_config=_spec("ngram", folders))
    prompt = [{"prompt_token_ids": [3, 3, 17, 250, 3, 3, 17, 250, 3, 3]}]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    shapes, passes = _spy_shapes(llm.engine), []
    _, ran = warm_up(llm, lambda: passes.append(llm.generate(prompt, params, use_tqdm=False)))
    assert ran == len(passes) == COMPILE_AFTER + 2 and llm.engine.buckets_pending() == []
    shapes.clear()
    llm.generate(prompt, params, use_tqdm=False)
    assert [s[1:] for s in shapes if not s[0]] == [(8, 8)], shapes


def test_a_benchmarks_warm_up_waits_for_the_prefix_caches_buckets(tiny_folder):
    """The first pass of a repeated prompt compiles every bucket it asks for (its decode calls
    ask the tile's bucket more than ``COMPILE_AFTER`` times), but the next pass meets the prefix
    cache, and its shorter prefill asks for a bucket of its own: ``warm_up`` runs until that one
    has compiled too, so a timed pass after it compiles nothing and runs in its own buckets."""
    from sfjax.benchmark import compiles, warm_up
    from sfjax.engine.compile import COMPILE_AFTER

    llm = LLM(tiny_folder, max_num_seqs=4, max_model_len=128, row_tile=8, block_size=16,
              num_scheduler_steps=1)
    prompt = [{"prompt_token_ids": list(range(3, 51))}]          # 48: 32 cached, 16 computed
    params = SamplingParams(temperature=0, max_tokens=COMPILE_AFTER + 3, ignore_eos=True)
    _, ran = warm_up(llm, lambda: llm.generate(prompt, params, use_tqdm=False))
    hits = llm.get_metrics()["prefix_cache"]["hit_tokens"]
    assert hits == 32 * (ran - 1) and ran == COMPILE_AFTER + 3
    with compiles() as seen:
        llm.generate(prompt, params, use_tqdm=False)
    assert not seen and llm.engine.buckets_pending() == []


def _spy_shapes(eng) -> list[tuple]:
    """(host rows, rows, logit rows) of each call ``eng`` sends, in order."""
    shapes, call = [], eng._call

    def spy(batch, draft, rows, *args, **kwargs):
        shapes.append((sum(rows), len(batch.tokens), len(batch.logit_rows)))
        return call(batch, draft, rows, *args, **kwargs)

    eng._call = spy
    return shapes
