"""The engine end to end on a tiny model: batching, block sizes, stops, preemption, bad input."""

import contextlib
import dataclasses
import gc
import json
import os
import shutil
import weakref

import jax
import numpy as np
import pytest

from sfjax import LLM, SamplingParams, sampling, toy
from sfjax.benchmark import compiles
from sfjax.config import ModelConfig
from sfjax.engine import programs, rounds
from sfjax.engine.slots import SlotSync
from sfjax.spec import config as spec_config
from sfjax.step import Progress

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _prompts(n, seed=0, lo=2, hi=40):
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(2, 512, rng.integers(lo, hi)).tolist()} for _ in range(n)]


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def llm(tiny_folder):
    return LLM(tiny_folder, max_num_seqs=32, max_model_len=256)


def test_alone_equals_inside_a_batch_of_32(llm):
    prompts = _prompts(32, seed=1)
    batch = _ids(llm.generate(prompts, GREEDY, use_tqdm=False))
    for i in (0, 13, 31):
        assert _ids(llm.generate(prompts[i], GREEDY, use_tqdm=False))[0] == batch[i]
    seeded = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=24, ignore_eos=True) for i in range(32)]
    batch = _ids(llm.generate(prompts, seeded, use_tqdm=False))
    for i in (0, 31):
        assert _ids(llm.generate(prompts[i], seeded[i], use_tqdm=False))[0] == batch[i]
    assert len({tuple(b) for b in batch}) == 32


@pytest.mark.parametrize("block_size", [8, 32])
def test_block_sizes_give_identical_outputs(llm, tiny_folder, block_size):
    prompts = _prompts(6, seed=2, hi=70)
    params = [GREEDY, SamplingParams(temperature=0.8, seed=7, max_tokens=24, ignore_eos=True)]
    ref = [_ids(llm.generate(prompts, p, use_tqdm=False)) for p in params]
    other = LLM(tiny_folder, block_size=block_size, max_num_seqs=8, max_model_len=256)
    assert [_ids(other.generate(prompts, p, use_tqdm=False)) for p in params] == ref


def test_requests_join_while_others_decode(llm):
    prompts = _prompts(5, seed=3)
    alone = [_ids(llm.generate(p, GREEDY, use_tqdm=False))[0] for p in prompts]
    eng = llm.engine
    got = {}
    for i, p in enumerate(prompts):
        eng.add_request(f"join-{i}", p, GREEDY)
        for _ in range(3):                       # others decode before the next one arrives
            for out in eng.step():
                if out.finished:
                    got[out.request_id] = out.outputs[0].token_ids
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                got[out.request_id] = out.outputs[0].token_ids
    assert [got[f"join-{i}"] for i in range(5)] == alone


def test_chunked_prefill_and_preemption_keep_outputs(tiny_folder, llm):
    prompts = _prompts(8, seed=4, lo=30, hi=60)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = _ids(llm.generate(prompts, params, use_tqdm=False))
    # 14 blocks of 8 tokens cannot hold 8 sequences of ~90 tokens: requests get preempted
    small = LLM(tiny_folder, block_size=8, num_kv_blocks=15, max_num_seqs=8,
                max_num_batched_tokens=16, max_model_len=128)
    assert _ids(small.generate(prompts, params, use_tqdm=False)) == ref
    assert small.engine.scheduler.num_preemptions > 0
    assert small.engine.allocator.num_free == 14


def test_stop_token_ids_and_min_tokens(llm):
    prompt = _prompts(1, seed=5)[0]
    base = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    stop = base[4]
    first = base.index(stop)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                              stop_token_ids=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == base[:first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    # the stop token stays in token_ids; its text only with include_stop_str_in_output (vLLM)
    tok = llm.get_tokenizer()
    assert out.text == tok.decode(base[:first]) != tok.decode(base[:first + 1])
    kept = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                               stop_token_ids=[stop],
                                               include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.token_ids == out.token_ids and kept.text == tok.decode(base[:first + 1])
    # before min_tokens the stop token cannot be drawn at all
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, min_tokens=first + 3,
                                              stop_token_ids=[stop]), use_tqdm=False)[0].outputs[0]
    assert stop not in out.token_ids[:first + 3]
    assert len(out.token_ids) >= first + 3


def test_eos_from_generation_config_ends_the_sequence(tiny_folder, tmp_path, llm):
    prompt = _prompts(1, seed=6)[0]
    base = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    eos = base[3]
    folder = shutil.copytree(tiny_folder, tmp_path / "m")
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [eos]}, f)
    other = LLM(folder, max_num_seqs=4, max_model_len=256)
    out = other.generate(prompt, SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == base[:base.index(eos) + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", None)
    out = other.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0]
    assert out.token_ids == base and out.finish_reason == "length"


def test_max_model_len_ends_with_length(llm):
    out = llm.generate({"prompt_token_ids": [5] * 250}, SamplingParams(temperature=0, max_tokens=6),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 6 and out.finish_reason == "length"


def _device_rows_follow_the_host(eng):
    """The live slots' block tables and sampling rows on the device are the host's, bit for bit,
    and every slot's progress is the host's record of it (``SlotSync.progress``), advanced by
    the call in flight if one is (sent before the last was read back: ``async_scheduling``)."""
    running = eng.scheduler.running
    tables, table, progress = jax.device_get((eng.state.block_tables, eng.state.table,
                                              eng.state.progress))
    record = eng.slots.progress
    if eng._inflight is not None:       # what reading it back will record, on a copy
        call = eng._inflight
        n, tokens, length, live, drafted, accepted, copies = rounds.unpack(
            np.asarray(call.result[0]), eng.programs.max_rounds)
        ahead = SlotSync(eng.block_tables, None, lambda reqs: None)
        ahead.progress = record.copy()
        ahead.advanced(call.slots, length[call.slots], live[call.slots], tokens,
                       drafted[:n, call.slots], accepted[:n, call.slots], copies[call.slots])
        record = ahead.progress
    for got, want in zip(jax.tree.leaves(progress), jax.tree.leaves(Progress.of_rows(record))):
        assert got.tobytes() == want.tobytes()
    widths = (table.stop_ids.shape[1], table.bias.shape[1], table.allowed.shape[1])
    fresh = eng.batches.table(running, widths=widths)
    for req in running:
        assert (tables[req.slot] == eng.block_tables[req.slot]).all()
        for got, want in zip(jax.tree.leaves(table), jax.tree.leaves(fresh)):
            assert got[req.slot].tobytes() == want[req.slot].tobytes()


@contextlib.contextmanager
def _sends(eng):
    """Records each update the engine sends the device, as ("slots" | "blocks", slots sent)."""
    sent, real = [], eng._programs

    def recording(engine, widths):
        progs = real(engine, widths)
        return dataclasses.replace(
            progs,
            update_slots=lambda state, slots, *rows: (sent.append(("slots", slots))
                                                      or progs.update_slots(state, slots, *rows)),
            update_blocks=lambda tables, slots, rows: (sent.append(("blocks", slots))
                                                       or progs.update_blocks(tables, slots, rows)))
    eng._programs = recording
    try:
        yield sent
    finally:
        eng._programs = real


def test_slot_state_stays_on_the_device_and_follows_the_host(llm):
    """Block tables and sampling rows stay on the device between calls (sfjax.engine.slots):
    after every step the live slots' rows there are the host's; a call in which no slot's blocks
    or request changed sends nothing; a request with longer id lists widens the table and its end
    narrows it again; and a slot reused after a request with logit_bias, allowed ids and
    penalties gives the next request exactly its own tokens."""
    eng = llm.engine
    prompts = _prompts(3, seed=11)
    plain = _ids(llm.generate(prompts, GREEDY, use_tqdm=False))
    wide = SamplingParams(temperature=0.7, seed=3, max_tokens=40, ignore_eos=True,
                          presence_penalty=1.5, repetition_penalty=1.3,
                          logit_bias={t: 5.0 for t in range(10, 30)},
                          allowed_token_ids=list(range(8, 108)))
    with _sends(eng) as sent:
        eng.add_request("wide", prompts[0], wide)
        slot, calls, widths = None, 0, set()
        while eng.has_unfinished_requests():
            eng.step()
            calls += 1
            if "wide" in eng.requests:
                slot = eng.requests["wide"].slot
            widths.add(jax.device_get(eng.state.table.bias).shape[1])
            _device_rows_follow_the_host(eng)
        assert widths == {32} and 0 < len(sent) < calls   # 40 tokens in 8-round calls, 16-token blocks
        kinds = [kind for kind, _ in sent]   # the admission, the first rounds' progress; then
        assert kinds[:2] == ["slots", "slots"] and set(kinds[2:]) == {"blocks"}   # growth alone
        for i, p in enumerate(prompts):                  # each lands in the freed slot
            eng.add_request(f"after-{i}", p, GREEDY)
            got = None
            while eng.has_unfinished_requests():
                for out in eng.step():
                    got = out.outputs[0].token_ids if out.finished else got
                assert eng.requests[f"after-{i}"].slot == slot if f"after-{i}" in eng.requests else True
                _device_rows_follow_the_host(eng)
            assert got == plain[i]
        assert jax.device_get(eng.state.table.bias).shape[1] == sampling.MIN_LIST_WIDTHS[1]
        assert jax.device_get(eng.state.table.allowed).shape[1] == sampling.MIN_LIST_WIDTHS[2]


def test_decoding_on_the_device_sends_nothing_between_calls(llm):
    """A request decoding in device rounds whose pages do not change sends no slot row: the
    device advances its progress (length, newest token, counters) itself. Its tokens are the
    one-step-per-call engine's (``test_rounds``); here, the traffic: the prefill call sends the
    admission, the first call of rounds the slot's progress, and the next call nothing."""
    eng = llm.engine
    # 2 + 14 tokens: one 16-token block; a prefill call, then rounds of 8 and of 6
    with _sends(eng) as sent:
        eng.add_request("one", {"prompt_token_ids": [5, 9]},
                        SamplingParams(temperature=0, max_tokens=14, ignore_eos=True))
        calls = []
        while eng.has_unfinished_requests():
            before = len(sent)
            eng.step()
            calls.append(len(sent) - before)
            _device_rows_follow_the_host(eng)
        assert calls == [1, 1, 0]


def test_copies_are_counted_apart_on_the_device_as_on_the_host(llm, tiny_folder):
    """N-gram lookup with adaptive k: the device counts the drafts of rounds that copied the
    row's own tokens apart (``Progress.copy_accepted``, ``copy_rejected``) and the host's
    record follows it after every step, with async scheduling, several rounds a call and one
    request waiting for a slot; the tokens are plain decoding's, and the request and engine
    counters agree."""
    prompts = [{"prompt_token_ids": ([7, 3, 9, 4] * 6)[:n]} for n in (23, 18, 13)]
    prompts += _prompts(2, seed=5)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = _ids(llm.generate(prompts, params, use_tqdm=False))
    spec = LLM(tiny_folder, max_num_seqs=4, max_model_len=256,
               speculative_config={"method": "ngram", "num_speculative_tokens": "auto",
                                   "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    eng = spec.engine
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, params)
    got, copies = {}, [0, 0]
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                got[int(out.request_id)] = out.outputs[0].token_ids
                d = out.metrics.spec_decode
                assert 0 <= d["num_accepted_copy_tokens"] <= d["num_accepted_tokens"]
                copies[d["num_accepted_copy_tokens"] > 0] += 1
        _device_rows_follow_the_host(eng)
    assert [got[i] for i in range(len(prompts))] == plain
    total = spec.get_metrics()["spec_decode"]
    assert copies[True] >= 3
    assert 0 < total["num_accepted_copy_tokens"] <= total["num_accepted_tokens"]


def test_engines_share_the_programs_of_what_the_device_reads(model_folder):
    """Programs are keyed on what they are specialised on: models that differ only in their
    special token ids (the host puts stop ids in the sampling table) share the engine's one
    program; speculation that differs in what the device rounds read (adaptive k,
    disable_by_batch_size) does not."""
    geometry = dict(max_num_seqs=4, max_model_len=64)
    a = LLM(model_folder(toy.tiny_config(), seed=0, std=0.1), **geometry).engine
    b = LLM(model_folder(toy.tiny_config(eos_token_ids=(5, 6), bos_token_id=2), seed=0, std=0.1),
            **geometry).engine
    assert a.batches.eos_token_ids != b.batches.eos_token_ids
    assert a.programs.round is b.programs.round
    assert a.programs.round_logprobs is b.programs.round_logprobs
    spec = {"method": "ngram", "num_speculative_tokens": spec_config.ADAPTIVE_MAX}
    fixed = LLM(model_folder(toy.tiny_config(), seed=0, std=0.1), **geometry,
                speculative_config=spec).engine
    again = LLM(model_folder(toy.tiny_config(), seed=0, std=0.1), **geometry,
                speculative_config=spec).engine
    auto = LLM(model_folder(toy.tiny_config(), seed=0, std=0.1), **geometry, speculative_config={
        "method": "ngram", "num_speculative_tokens": "auto", "disable_by_batch_size": 3}).engine
    assert fixed.programs.round is again.programs.round
    assert fixed.programs.round is not auto.programs.round


def test_kept_programs_are_bounded_by_the_shapes_they_hold(tiny_folder, monkeypatch):
    """The shared programs are let go by the executables they hold, not only by their count
    (each shape bucket an engine meets compiles one; on XLA:CPU each costs hundreds of memory
    maps): a dropped engine whose round compiled more shapes than the bound is freed once
    another engine shape is built, though the count of programs would keep it; the same engine
    built again first takes it (the bound is applied after an engine's lookups, not between)."""
    monkeypatch.setattr(programs, "PROGRAM_CACHE_SIZE", 64)
    monkeypatch.setattr(programs, "EXECUTABLE_CACHE_SIZE", 1)
    llm = LLM(tiny_folder, max_num_seqs=4, max_model_len=48, num_scheduler_steps=1)
    for prompt in ([5, 6, 7], list(range(10, 40))):          # two prefill buckets, then decode
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=3),
                     use_tqdm=False)
    assert programs._executables(llm.engine.programs.round) >= 2
    again = LLM(tiny_folder, max_num_seqs=4, max_model_len=48, num_scheduler_steps=1)
    assert again.engine.programs.round is llm.engine.programs.round      # the same engine: kept
    held = weakref.ref(llm.engine.programs.round)
    del llm, again
    gc.collect()
    assert held() is not None                   # the newest kept program stays, whatever it holds
    LLM(tiny_folder, max_num_seqs=4, max_model_len=40, num_scheduler_steps=1)
    gc.collect()
    assert held() is None


def test_an_engine_keeps_few_widened_tables_compiled(tiny_folder, monkeypatch):
    """A request whose stop ids, logit_bias or allowed ids outgrow the sampling table widens it,
    new shapes for every program. An engine keeps ``WIDE_PROGRAMS`` widenings compiled beside
    its own, the least recently used let go and compiled again if asked for (a hunt's 14
    requests of growing lists kept 711 MB more in a server, for good); a list repeating an id
    does not widen it. The tokens do not depend on any of it."""
    monkeypatch.setattr(programs, "WIDE_PROGRAMS", 1)       # the bound, at its least
    llm = LLM(tiny_folder, max_num_seqs=4, max_model_len=48, num_scheduler_steps=1)
    kept, base = llm.engine._programs, llm.engine.slots.widths
    run = lambda **kw: llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(
        temperature=0.8, seed=4, max_tokens=4, ignore_eos=True, **kw), use_tqdm=False)[0]
    plain = run(allowed_token_ids=list(range(40))).outputs[0].token_ids
    assert run(allowed_token_ids=list(range(40)) * 30).outputs[0].token_ids == plain
    assert kept.held() == [base]                     # repeats widened nothing
    asks = [dict(allowed_token_ids=list(range(100))), dict(stop_token_ids=list(range(400, 420)))]
    first = run(**asks[0]).outputs[0].token_ids
    [wide] = [w for w in kept.held() if w != base]
    gone = weakref.ref(kept(llm.engine, wide).round)
    for kw in asks[1:]:
        run(**kw)
    gc.collect()
    assert len(kept.held()) == 1 + programs.WIDE_PROGRAMS and kept.held()[0] == base
    assert gone() is None                            # the oldest widening's programs are freed
    assert run(**asks[0]).outputs[0].token_ids == first      # compiled again: the same tokens


def test_xla_options_keep_the_tokens_and_get_their_own_programs(llm, tiny_folder):
    """``compiler_options`` reach the engine's programs (an engine with other options compiles
    its own). The levels differ in the last bits of some logits (FMA contraction from -O1 up),
    far below these runs' margins, so their tokens stay: greedy and seeded sampled, one round
    per call and several."""
    prompts = _prompts(4, seed=5)
    params = [GREEDY, SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True,
                                     repetition_penalty=1.3)]
    ref = [_ids(llm.generate(prompts, p, use_tqdm=False)) for p in params]
    for level in (1, 2):
        other = LLM(tiny_folder, max_num_seqs=32, max_model_len=256,
                    compiler_options={"xla_backend_optimization_level": level})
        assert other.engine.programs.round is not llm.engine.programs.round
        assert [_ids(other.generate(prompts, p, use_tqdm=False)) for p in params] == ref


def test_ordinary_id_lists_compile_nothing_new(llm, monkeypatch):
    """Requests within sampling.MIN_LIST_WIDTHS (stop ids, a few logit_bias entries, 50 allowed
    ids) leave the table's shape, so after plain requests they compile no program: a serving
    engine does not stall on the first request that carries them. (Each bucket compiles at its
    first ask here, ``COMPILE_AFTER`` 0, so that the plain requests compile every bucket the
    others' calls take: this test is about the lists.)"""
    import sfjax.engine.compile as buckets

    monkeypatch.setattr(buckets, "COMPILE_AFTER", 0)
    prompts = _prompts(3, seed=21)
    llm.generate(prompts, GREEDY, use_tqdm=False)
    # the same lengths, other tokens: no prefix-cache hit (whose admission compiles its own rows)
    prompts = [{"prompt_token_ids": [2 + (t + 1) % 510 for t in p["prompt_token_ids"]]} for p in prompts]
    listed = [SamplingParams(temperature=0.8, seed=5, max_tokens=24, stop_token_ids=[3, 4, 5, 6, 7],
                             logit_bias={t: 3.0 for t in range(20, 32)}),
              SamplingParams(temperature=0, max_tokens=24, allowed_token_ids=list(range(100, 150))),
              GREEDY]
    with compiles() as seen:
        outs = llm.generate(prompts, listed, use_tqdm=False)
    assert not seen
    assert all(100 <= t < 150 for t in outs[1].outputs[0].token_ids)


def test_blocks_are_freed_when_requests_finish_or_abort(llm):
    eng = llm.engine
    total = eng.allocator.num_free
    llm.generate(_prompts(4, seed=7), GREEDY, use_tqdm=False)
    assert eng.allocator.num_free == total
    eng.add_request("to-abort", _prompts(1, seed=8)[0], GREEDY)
    eng.step()
    assert eng.allocator.num_free < total
    eng.abort("to-abort")
    assert eng.allocator.num_free == total          # at once
    assert eng.has_unfinished_requests()            # until its final output is returned
    [final] = eng.step()
    assert final.request_id == "to-abort" and final.finished
    assert final.outputs[0].finish_reason == "abort" and not eng.has_unfinished_requests()


@pytest.mark.parametrize("prompt, params, match", [
    ({"prompt_token_ids": [3] * 300}, GREEDY, "max_model_len"),
    ({"prompt_token_ids": []}, GREEDY, "empty"),
    ({"prompt_token_ids": [9999]}, GREEDY, "vocabulary"),
    ({"prompt_token_ids": [3] * 250}, SamplingParams(max_tokens=10), "max_tokens"),
    (12, GREEDY, "prompt must be"),
])
def test_bad_requests_are_refused_and_nothing_else_is_lost(llm, prompt, params, match):
    good = _prompts(2, seed=9)
    ref = _ids(llm.generate(good, GREEDY, use_tqdm=False))
    with pytest.raises(ValueError, match=match):
        llm.generate([good[0], prompt, good[1]], params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    eng = llm.engine
    eng.add_request("keep-0", good[0], GREEDY)
    with pytest.raises(ValueError, match=match):
        eng.add_request("bad", prompt, params)
    eng.add_request("keep-1", good[1], GREEDY)
    done = {}
    while eng.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0].token_ids for o in eng.step() if o.finished})
    assert [done["keep-0"], done["keep-1"]] == ref


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_text_the_tokenizer_spells_past_the_models_vocabulary_is_refused(model_folder, tmp_path):
    """A tokenizer may hold more tokens than the model's embedding: a text prompt it spells with
    such ids is refused, as the same ids given as prompt_token_ids are (it ran on clamped
    embeddings), and the engine goes on."""
    folder = shutil.copytree(model_folder(toy.tiny_config(vocab_size=300)), tmp_path / "m")
    toy.save_tokenizer(str(folder), toy.build_tokenizer(512))
    llm = LLM(str(folder), max_num_seqs=2, max_model_len=64)
    text = "def f(x): return x"                     # ids up to 442 in the toy tokenizer
    with pytest.raises(ValueError, match=r"prompt: the tokenizer gives token id 442, outside "
                                         r"the model's vocabulary \[0, 300\)"):
        llm.generate(text, GREEDY, use_tqdm=False)
    assert len(llm.generate("hello", GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 24


@pytest.mark.parametrize("change, match", [
    ({"vocab_size": "abc"}, r"config.json: vocab_size = 'abc' has type str"),
    ({"num_hidden_layers": -1}, r"config.json: num_hidden_layers = -1 is out of range"),
    ({"max_position_embeddings": 0}, r"config.json: max_position_embeddings = 0 is out of range"),
    ({"rms_norm_eps": "x"}, r"config.json: rms_norm_eps = 'x' has type str"),
    ({"eos_token_id": "x"}, r"config.json: eos_token_id\[0\] = 'x' has type str"),
    ({"rope_scaling": [1, 2]}, r"config.json: rope_scaling \[1, 2\] must be a JSON object"),
    ({"rope_scaling": {"rope_type": "linear", "factor": "x"}},
     r"config.json: rope_scaling.factor = 'x' has type str"),
    ({"rope_theta": 0}, r"config.json: rope_theta = 0.0 is out of range"),
    ({"hidden_size": None}, r"config.json is missing the field 'hidden_size'"),
])
def test_config_json_values_of_the_wrong_kind_are_refused_naming_the_field(change, match):
    """(They failed in Python or inside JAX, naming nothing: 'invalid literal for int()', a
    str divided by a tracer, 'need at least one array to stack'.)"""
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_config({**toy.tiny_config().to_hf_config(), **change})
    with pytest.raises(ValueError, match="config.json: must be a JSON object, got list"):
        ModelConfig.from_hf_config([1])


def test_bad_model_folders(tmp_path, tiny_folder):
    with pytest.raises(ValueError, match="not a folder"):
        LLM(str(tmp_path / "missing"))
    broken = shutil.copytree(tiny_folder, tmp_path / "broken")
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        LLM(str(broken))
    other = shutil.copytree(tiny_folder, tmp_path / "gpt2")
    cfg = json.loads((other / "config.json").read_text())
    cfg.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture"):
        LLM(str(other))
    eos = shutil.copytree(tiny_folder, tmp_path / "eos")
    (eos / "generation_config.json").write_text(json.dumps({"eos_token_id": ["2"]}))
    with pytest.raises(ValueError, match=r"generation_config.json: eos_token_id\[0\] = '2' has"):
        LLM(str(eos))
    noweights = shutil.copytree(tiny_folder, tmp_path / "noweights")
    os.remove(noweights / "model.safetensors")
    with pytest.raises(ValueError, match="safetensors"):
        LLM(str(noweights))


def test_quantized_folders_are_refused_naming_what(tmp_path, tiny_folder):
    """A quantized checkpoint was served with its int8 values cast to float and its scales
    dropped (other tokens, no error), or failed in numpy (float8); a generation_config.json that
    is not JSON and a config dtype sfjax lacks name their file."""
    from safetensors.numpy import load_file, save_file

    q = shutil.copytree(tiny_folder, tmp_path / "q")
    cfg = json.loads((q / "config.json").read_text())
    (q / "config.json").write_text(json.dumps(
        {**cfg, "quantization_config": {"quant_method": "bitsandbytes", "load_in_8bit": True}}))
    with pytest.raises(ValueError, match=r"quantization_config \(bitsandbytes\) is not supported"):
        LLM(str(q))
    (q / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(q / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.weight"
    save_file({**tensors, name: tensors[name].astype(np.int8)}, q / "model.safetensors")
    with pytest.raises(ValueError, match=f"{name} is int8: sfjax loads float weights"):
        LLM(str(q))
    bad = shutil.copytree(tiny_folder, tmp_path / "bad")
    (bad / "generation_config.json").write_text("{oops")
    with pytest.raises(ValueError, match="generation_config.json is not valid JSON"):
        LLM(str(bad))
    (bad / "generation_config.json").unlink()
    (bad / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "float64"}))
    with pytest.raises(ValueError, match="config.json: dtype 'float64' is not supported"):
        LLM(str(bad))
    assert LLM(str(bad), dtype="float32", max_num_seqs=1, max_model_len=32).model_config.dtype \
        == "float32"


def test_text_is_the_decode_of_the_tokens(llm):
    tok = llm.get_tokenizer()
    outs = llm.generate(["def fib(n):", "The quick brown fox"], GREEDY, use_tqdm=False)
    for o in outs:
        assert o.prompt_token_ids == tok.encode(o.prompt).ids
        assert o.outputs[0].text == tok.decode(o.outputs[0].token_ids, skip_special_tokens=True)
