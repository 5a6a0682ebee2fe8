"""sfjax.functional inside a user's jitted program: the tokens equal LLM.generate's (plain, ngram,
draft_model; greedy and seeded sampling; stop tokens, min_tokens, max_tokens), and it composes
(AOT lower/compile, lax.scan over calls, no recompiles for new prompts, a device mesh)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from sfjax import LLM, SamplingParams, toy
from sfjax import functional as F
from sfjax import weights as W
from sfjax.config import ModelConfig
from sfjax.spec import table as ngram_table

B, MAX_LEN = 4, 64


def _prompts(seed, n=B):
    """Short prompts made of a repeated segment, so n-gram lookup finds drafts."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        seg = rng.integers(2, 500, 4).tolist()
        out.append(seg * 3 + rng.integers(2, 500, rng.integers(1, 4)).tolist())
    return out


def _params(seed):
    # stop tokens picked from the outputs these seeds give without them: rows end by "stop"
    # (row 2's stop token falls inside its min_tokens, where it is suppressed instead)
    return [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
            SamplingParams(temperature=1.0, seed=seed + 3, max_tokens=20, top_p=0.9, stop_token_ids=[145]),
            SamplingParams(temperature=0.7, seed=seed + 4, max_tokens=18, presence_penalty=0.5,
                           min_tokens=3, stop_token_ids=[100]),
            SamplingParams(temperature=1.0, seed=seed + 5, max_tokens=20, top_k=20, repetition_penalty=1.2)]


@pytest.fixture(scope="module")
def pair(tiny_folder, tmp_path_factory):
    """The tiny target, and a draft made of its first layer (with its embeddings and head)."""
    cfg = ModelConfig.from_folder(tiny_folder)
    weights = W.load_hf(tiny_folder, cfg)
    dcfg = dataclasses.replace(cfg, num_layers=1)
    dw = dataclasses.replace(weights, **{f: x[:1] for f, x in W.layer_arrays(weights).items()})
    draft = toy.build_model_folder(str(tmp_path_factory.mktemp("draft-1l")), dcfg, weights=dw)
    table = str(tmp_path_factory.mktemp("table") / ngram_table.TABLE_FILE)   # from other prompts
    ngram_table.save(ngram_table.build(_prompts(9, 64), cfg.vocab_size, width=3, min_count=1), table)
    return dict(folder=tiny_folder, cfg=cfg, weights=weights, draft=draft, draft_weights=dw,
                table=table, table_arrays=ngram_table.load(table, cfg.vocab_size))


def _spec(method, pair):
    return {"plain": None, "ngram": {"method": "ngram", "num_speculative_tokens": 3},
            "ngram_table": {"method": "ngram", "num_speculative_tokens": 3,
                            "prompt_lookup_table": pair["table"]},
            "draft_model": {"method": "draft_model", "model": pair["draft"], "num_speculative_tokens": 3}}[method]


@pytest.fixture(scope="module")
def engine(pair):
    """``engine(method)``: one LLM per method for the module (its compiled steps are reused)."""
    built = {}

    def make(method):
        if method not in built:
            built[method] = LLM(pair["folder"], max_num_seqs=B, max_model_len=MAX_LEN,
                                speculative_config=_spec(method, pair))
        return built[method]

    return make


def user_program(cfg: F.Config):
    """What a user writes: a jitted function from weights and a batch of prompt ids to generated
    ids (plus the counts)."""
    @jax.jit
    def generate(weights, draft_weights, prompt_ids, prompt_lens, sampling):
        out = F.generate(weights, prompt_ids, prompt_lens, sampling, cfg, draft_weights, width=24)
        return out.token_ids, out.num_tokens, out.num_draft_tokens, out.num_accepted_tokens
    return generate


def _run(gen, pair, prompts, params, draft=True):
    """draft: True for the draft model's weights, or the n-gram table (or None) to pass."""
    ids, lens = F.pad_prompts(prompts, length=16, batch=B)
    sp = F.Sampling.from_params(params + [params[0]] * (B - len(params)), eos_token_ids=pair["cfg"].eos_token_ids)
    tokens, n, drafted, accepted = jax.device_get(gen(pair["weights"], pair["draft_weights"] if draft is True else draft,
                                                      ids, lens, sp))
    return [tokens[i, :n[i]].tolist() for i in range(B)], n, drafted, accepted


def _engine(llm, prompts, params):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.mark.parametrize("method", ["plain", "ngram", "ngram_table", "draft_model"])
def test_tokens_and_counts_equal_llm_generate(pair, engine, method):
    spec = _spec(method, pair)
    llm = engine(method)
    cfg = F.Config(pair["cfg"], MAX_LEN, speculative_config=spec)
    gen = user_program(cfg)
    draft = {"draft_model": True, "ngram_table": pair["table_arrays"]}.get(method)
    if method == "ngram_table":                # the table named in the config must be passed
        with pytest.raises(ValueError, match="prompt_lookup_table"):
            _run(user_program(cfg), pair, _prompts(0), _params(0), draft=None)
    reasons = set()
    for seed in (0, 1):                        # new prompts and seeds, the same bucket
        prompts, params = _prompts(seed), _params(seed)
        ref = _engine(llm, prompts, params)
        got, n, drafted, accepted = _run(gen, pair, prompts, params, draft=draft)
        assert got == [o.outputs[0].token_ids for o in ref]
        reasons |= {o.outputs[0].finish_reason for o in ref}
        if spec is not None:
            counts = [(m["num_draft_tokens"], m["num_accepted_tokens"])
                      for m in (o.metrics.spec_decode for o in ref)]
            assert list(zip(drafted.tolist(), accepted.tolist())) == counts
    assert gen._cache_size() == 1                 # the second batch did not recompile
    assert reasons == {"stop", "length"}
    if spec is not None:
        assert 0 < sum(accepted) < sum(drafted)


def test_aot_compile_scan_over_calls_and_empty_rows(pair, engine):
    cfg = F.Config(pair["cfg"], MAX_LEN)
    batches = [_prompts(seed) for seed in (2, 3)]
    # row 0 runs to the end of the context: more tokens than max_model_len - P, which the
    # default width holds (it cut them silently)
    params = [SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)] + _params(2)[1:]
    ids, lens = zip(*(F.pad_prompts(p, length=16) for p in batches))
    sp = F.Sampling.from_params(params, eos_token_ids=pair["cfg"].eos_token_ids)

    def many(weights, ids, lens, sp):
        """lax.scan over several generate calls in one program."""
        return jax.lax.scan(lambda c, x: (c, F.generate(weights, x[0], x[1], sp, cfg).token_ids), 0,
                            (ids, lens))[1]

    abstract = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
    args = (W.abstract(pair["cfg"]), abstract(np.stack(ids)), abstract(np.stack(lens)),
            jax.tree.map(abstract, sp))
    compiled = jax.jit(many).lower(*args).compile()           # ahead of time, from shapes alone
    got = jax.device_get(compiled(pair["weights"], np.stack(ids), np.stack(lens), sp))
    for prompts, tokens in zip(batches, got):
        ref = [o.outputs[0].token_ids for o in _engine(engine("plain"), prompts, params)]
        assert [t[t >= 0].tolist() for t in tokens] == ref
        assert len(ref[0]) == MAX_LEN - len(prompts[0]) > MAX_LEN - 16
    # a batch bucket with an empty row: it stays done and empty, the others are unchanged
    ids3, lens3 = F.pad_prompts(batches[0][:3], length=16, batch=B)
    part = jax.device_get(compiled(pair["weights"], np.stack([ids3, ids[1]]), np.stack([lens3, lens[1]]), sp))
    assert (part[0][3] == -1).all() and (part[0][:3] == got[0][:3]).all() and (part[1] == got[1]).all()


def test_runs_under_a_mesh_and_shard_map(pair, engine):
    """Nothing in the functional path blocks sharding: no host callbacks, no device assumptions.
    (check_vma=False: the row-tile loops start from unvarying zeros; the sharding issue decides
    how the model runs under shard_map.)"""
    cfg = F.Config(pair["cfg"], MAX_LEN, speculative_config=_spec("ngram", pair))
    prompts, params = _prompts(4), _params(4)
    ids, lens = F.pad_prompts(prompts, length=16)
    sp = F.Sampling.from_params(params, eos_token_ids=pair["cfg"].eos_token_ids)
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    rows = P("data")
    fn = jax.shard_map(lambda w, i, n, s: F.generate(w, i, n, s, cfg).token_ids, mesh=mesh,
                       in_specs=(P(), rows, rows, rows), out_specs=rows, check_vma=False)
    with jax.set_mesh(mesh):
        tokens = jax.device_get(jax.jit(fn)(pair["weights"], ids, lens, sp))
    ref = _engine(engine("ngram"), prompts, params)
    assert [t[t >= 0].tolist() for t in tokens] == [o.outputs[0].token_ids for o in ref]


def test_a_draft_models_round_traces_one_draw(pair, monkeypatch):
    """A draft model's scan draws a draft and then feeds it, so the draw and the draft's LM head
    are traced, and compiled, once per round: a first draw before the loop was a second copy of
    them (40% of the time to compile the round), and the skippable step traced its body twice."""
    from sfjax.spec import proposers
    draws, draw = [], proposers._draw_draft
    monkeypatch.setattr(proposers, "_draw_draft", lambda *a: draws.append(a[-2]) or draw(*a))
    cfg = F.Config(pair["cfg"], MAX_LEN, speculative_config={
        "method": "draft_model", "model": pair["cfg"], "num_speculative_tokens": 3})
    ids, lens = F.pad_prompts(_prompts(0))
    sp = F.Sampling.from_params(_params(0), eos_token_ids=())
    jax.eval_shape(lambda w: F.generate(w, ids, lens, sp, cfg, w), pair["weights"])
    assert len(draws) == 1 and not isinstance(draws[0], int)      # the scan step's j, traced


def test_weights_are_checked_against_the_config(pair):
    cfg = F.Config(pair["cfg"], MAX_LEN, speculative_config={
        "method": "draft_model", "model": pair["cfg"], "num_speculative_tokens": 2})
    ids, lens = F.pad_prompts(_prompts(0))
    sp = F.Sampling.from_params(_params(0), eos_token_ids=())
    w = pair["weights"]

    def trace(weights, draft):
        jax.eval_shape(lambda a, b: F.generate(a, ids, lens, sp, cfg, b), weights, draft)

    with pytest.raises(ValueError, match=r"^weights.wk: shape \(2, 64, 16\), config needs \(2, 64, 32\)"):
        trace(dataclasses.replace(w, wk=w.wk[..., :16]), w)
    with pytest.raises(ValueError, match=r"^weights.embed: dtype bfloat16, config needs float32"):
        trace(jax.tree.map(lambda x: x.astype(jnp.bfloat16), w), w)
    split = W.split_layers(w)
    with pytest.raises(ValueError, match=r"^weights.wo\[1\]: shape \(32, 64\), config needs \(64, 64\)"):
        trace(dataclasses.replace(split, wo=(split.wo[0], split.wo[1][:32])), w)
    with pytest.raises(ValueError, match=r"^draft_weights.w_up: shape"):
        trace(w, dataclasses.replace(w, w_up=w.w_up[:1]))
    with pytest.raises(ValueError, match="draft_weights: the draft_model method needs"):
        trace(w, None)


def test_prompt_rows_and_sampling_rows_must_agree(pair):
    """A sampling table or prompt_lens with other than one row per prompt row is refused at
    trace time, naming the field (a gather past the table's end took its last row's settings)."""
    cfg = F.Config(pair["cfg"], MAX_LEN)
    ids, lens = F.pad_prompts(_prompts(0, 3))
    trace = lambda l, sp: jax.eval_shape(lambda w: F.generate(w, ids, l, sp, cfg), pair["weights"])
    two = F.Sampling.from_params(_params(0)[:2], eos_token_ids=())
    with pytest.raises(ValueError, match=r"^sampling\.temperature: shape \(2,\) must be \(3,\) "
                                         r"\(one row per prompt row of prompt_ids, \(3, 16\)\)"):
        trace(lens, two)
    three = F.Sampling.from_params(_params(0)[:3], eos_token_ids=())
    with pytest.raises(ValueError, match=r"^prompt_lens: shape \(4,\) must be \(3,\)"):
        trace(np.append(lens, 1), three)
    # each field's own shape, its kind of dtype, and the table's ids in the vocabulary
    bad = lambda **kw: dataclasses.replace(three, **kw)
    for l, sp, match in (
            (lens[:, None], three, r"^prompt_lens: shape \(3, 1\) must be \(3,\)"),
            (lens, bad(key_data=np.zeros((3, 3), np.uint32)), r"^sampling\.key_data: shape \(3, 3\)"),
            (lens, bad(key_data=np.zeros((3, 2), np.float32)), r"^sampling\.key_data: dtype float32"),
            (lens, bad(stop_ids=np.zeros(3, np.int32)), r"^sampling\.stop_ids: shape \(3,\)"),
            (lens, bad(allowed=np.full((3, 1), 10**6, np.int32)),
             r"^sampling\.allowed: token ids must lie in \[0, 512\)"),
            (lens, F.Sampling.from_params(_params(0)[:3], eos_token_ids=(10**9,)),
             r"^sampling\.stop_ids: token ids must lie in \[0, 512\)")):
        with pytest.raises(ValueError, match=match):
            trace(l, sp)
    with pytest.raises(ValueError, match=r"^prompt_ids: must be an int array \[B, P\] with B >= 1"):
        jax.eval_shape(lambda w: F.generate(w, ids[:0], lens[:0], three, cfg), pair["weights"])
    with pytest.raises(TypeError, match="^cfg: must be a functional.Config, got dict"):
        F.prefill(pair["weights"], ids, lens, three, {})
    with pytest.raises(ValueError, match=r"^batch = -2 is out of range"):
        F.Sampling.from_params(_params(0)[0], eos_token_ids=(), batch=-2)
    with pytest.raises(ValueError, match=r"^prompts\[0\]: must be token ids in \[0, 2\*\*31\)"):
        F.pad_prompts([[1, 2**40]])
    rows = F.pad_prompts([range(3, 6), jnp.arange(4, dtype=jnp.int32), np.array([7])])[0]
    np.testing.assert_array_equal(rows[:, :4], [[3, 4, 5, 0], [0, 1, 2, 3], [7, 0, 0, 0]])
    with pytest.raises(TypeError, match="sampling: must be a functional.Sampling, got dict"):
        trace(lens, {})
    with pytest.raises(ValueError, match=r"^prompt_lens: \[.*\] must lie in \[0, 16\]"):
        trace(np.array([3, 17, 2], np.int32), three)
    with pytest.raises(TypeError, match="^prompt_ids: dtype float32 must be an integer type"):
        jax.eval_shape(lambda w: F.generate(w, ids.astype(np.float32), lens, three, cfg), pair["weights"])
    with pytest.raises(ValueError, match="length = 0"):
        F.pad_prompts(_prompts(0, 3), length=0)
    jax.eval_shape(lambda w: F.prefill(w, ids, lens, three, cfg), pair["weights"])   # agrees
    jax.eval_shape(lambda w: F.prefill(w, ids, lens.tolist(), three, cfg), pair["weights"])
    F.Sampling.from_params(_params(0)[:1], eos_token_ids=jnp.array([2]))     # ids as an array
    assert jax.eval_shape(lambda w: F.generate(w, ids, lens, three, cfg, width=0),
                          pair["weights"]).token_ids.shape == (3, 0)


def test_what_a_callers_jit_hides_is_checked_where_it_can_be(pair):
    """Inside a caller's ``jit`` the table and prompt_lens arrive traced, so what ``LLM``
    refuses ran silently (an allowed id past the vocabulary dropped, every row token 0 when all
    were), and misuse gave raw errors: ids are checked by ``from_params`` given the vocabulary;
    a state decoded with another config's max_model_len, block size or proposer, a bias table
    narrower than its ids, draft weights a plain config would ignore, and bad widths or round
    counts are refused naming them; prompt_lens as a list of traced values is taken."""
    cfg = F.Config(pair["cfg"], MAX_LEN)
    w = pair["weights"]
    ids, lens = F.pad_prompts(_prompts(0, 3))
    with pytest.raises(ValueError, match=r"allowed_token_ids = 5000 is out of range"):
        F.Sampling.from_params(SamplingParams(temperature=0, allowed_token_ids=[5000, 7]),
                               eos_token_ids=(), batch=3, vocab_size=pair["cfg"].vocab_size)
    three = F.Sampling.from_params(_params(0)[:3], eos_token_ids=(), vocab_size=512)
    state = F.prefill(w, ids, lens, three, cfg)
    for other, what in ((F.Config(pair["cfg"], MAX_LEN // 2), "max_model_len"),
                        (F.Config(pair["cfg"], MAX_LEN, block_size=8), "block_size"),
                        (F.Config(pair["cfg"], MAX_LEN, speculative_config={
                            "method": "draft_model", "model": pair["cfg"],
                            "num_speculative_tokens": 2}), "a proposer's cache")):
        with pytest.raises(ValueError, match=f"^state: built with {what} "):
            F.decode(w, state, other, 1, w if what == "a proposer's cache" else None)
    for bad, match in ((2.5, r"^num_rounds = 2.5 has type float"),
                       (None, r"^num_rounds = None has type NoneType")):
        with pytest.raises(TypeError, match=match):
            F.decode(w, state, cfg, bad)
    with pytest.raises(ValueError, match=r"^width = -1 is out of range"):
        F.outputs(state, -1)
    with pytest.raises(ValueError, match=r"^width = -1 is out of range"):
        jax.eval_shape(lambda x: F.generate(x, ids, lens, three, cfg, width=-1), w)
    with pytest.raises(ValueError, match=r"^sampling\.bias: shape \(3, 3\) must be"):
        F.prefill(w, ids, lens, dataclasses.replace(three, bias=np.zeros((3, 3), np.float32)), cfg)
    with pytest.raises(ValueError, match=r"^draft_weights: given, but cfg has no speculative"):
        F.prefill(w, ids, lens, three, cfg, draft_weights=w)
    traced = jax.jit(lambda n: F.prefill(w, ids, [n[0], n[1], n[2]], three, cfg).progress.length)
    np.testing.assert_array_equal(traced(lens), state.progress.length)


def test_outside_jit_the_callers_table_is_kept_and_traced_prompt_lens_are_clipped(pair):
    """An eager ``prefill`` copies the table it is given (its rounds donate their state: the
    caller's arrays were deleted), and ``prompt_lens`` past P, traced where no check can raise,
    are taken as P."""
    cfg = F.Config(pair["cfg"], MAX_LEN)
    ids, lens = F.pad_prompts(_prompts(0, 3))
    table = jax.device_put(F.Sampling.from_params(_params(0)[:3], eos_token_ids=()))
    first = F.prefill(pair["weights"], ids, lens, table, cfg)
    again = F.prefill(pair["weights"], ids, lens, table, cfg)       # the same table, still there
    assert not any(x.is_deleted() for x in jax.tree.leaves(table))
    assert (first.progress.last == again.progress.last).all()
    lengths = jax.jit(lambda n: F.prefill(pair["weights"], ids, n, table, cfg).progress.length)
    assert (lengths(np.array([3, 40, 2], np.int32)) == lengths(np.array([3, 16, 2], np.int32))).all()
    with pytest.raises(ValueError, match=r"^batch: 4 rows, but 3 SamplingParams were given"):
        F.Sampling.from_params(_params(0)[:3], eos_token_ids=(), batch=4)


def test_sampling_params_the_functional_path_cannot_honour_are_refused():
    for bad in (dict(stop=["x"]), dict(logprobs=2), dict(disable_spec_decode=True), dict(n=2)):
        with pytest.raises(ValueError, match="not offered by sfjax.functional"):
            F.Sampling.from_params(SamplingParams(temperature=0, **bad), eos_token_ids=())
    with pytest.raises(ValueError, match="seed"):
        F.Sampling.from_params(SamplingParams(temperature=1.0), eos_token_ids=())


def test_logit_bias_and_allowed_token_ids_equal_llm_generate(pair, engine):
    """The per-request table (``sampling.Sampling``) carries logit_bias and allowed_token_ids to
    the device: the tokens equal LLM.generate's, plain and speculative, and the two act."""
    allowed = list(range(100, 140))
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logit_bias={7: 6.0, 300: 3.0}),
              SamplingParams(temperature=1.0, seed=11, max_tokens=16, allowed_token_ids=allowed),
              SamplingParams(temperature=0.8, seed=12, max_tokens=16, logit_bias={5: -100, 9: 2.0},
                             allowed_token_ids=[5, 9, 40, 41, 42]),
              SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)]
    prompts = _prompts(4)
    for method in ("plain", "ngram"):
        cfg = F.Config(pair["cfg"], MAX_LEN, speculative_config=_spec(method, pair))
        got, *_ = _run(user_program(cfg), pair, prompts, params, draft=None)
        assert got == [o.outputs[0].token_ids for o in _engine(engine(method), prompts, params)]
    assert got[0].count(7) > 8
    assert set(got[1]) <= set(allowed) and set(got[2]) <= {9, 40, 41, 42}


@pytest.mark.parametrize("bad, match", [
    (dict(row_tile=0), r"RunConfig.row_tile = 0 is out of range"),
    (dict(max_model_len=1), r"RunConfig.max_model_len = 1 is out of range"),
    (dict(attention="fast"), r"RunConfig.attention = 'fast': must be one of"),
    (dict(matmul="cublas"), r"RunConfig.matmul = 'cublas': must be one of None"),
    (dict(small_tiles=(3,)), r"RunConfig.small_tiles = \(3,\) is out of range"),
    (dict(small_tiles=(2,), stage_tiles=(("mlp", (4,)),)),
     r"RunConfig.stage_tiles = .* is out of range: .* its tiles among the small tiles \(2,\)"),
    (dict(stage_tiles=(("gemm", ()),)), r"RunConfig.stage_tiles = .* is out of range"),
    (dict(draft_stage_tiles=(("mlp", ()), ("mlp", ()))), r"RunConfig.draft_stage_tiles = .*"),
])
def test_the_run_config_names_a_bad_field(pair, bad, match):
    with pytest.raises(ValueError, match=match):
        F.Config(**{"model": pair["cfg"], "max_model_len": MAX_LEN, **bad})


def test_a_rounds_verify_rows_are_packed_by_each_slots_k():
    """Entry e (slot order[e], live ones first) takes its own k + 1 rows and logit rows, one
    entry after another, so the padding is all at the end (where the tile loops skip it): with
    k = 3, 0, 1 the three live entries take 4 + 1 + 2 of the 4 x 5 rows, and the dead one none."""
    from sfjax import sharding
    order, live = jnp.asarray([2, 0, 1, 3]), jnp.asarray([True, True, True, False])
    k = jnp.asarray([3, 0, 1, 0])
    length, plen = jnp.asarray([10, 20, 30, 0]), jnp.asarray([4, 5, 6, 0])
    slot = jnp.where(live, order, -1)
    first, n = sharding.slot_rows(slot, live, 4, None, 5, 8, counts=k + 1)
    assert n == 24 and first.tolist() == [0, 4, 5, 24]
    logit_first, rows, real, draws = F._packed_logit_rows(order, live, length, plen, first, k, 24)
    assert logit_first.tolist() == [0, 4, 5, 7] and int(real) == 7
    assert rows.tolist() == [0, 1, 2, 3, 4, 5, 6] + [0] * 17
    assert draws.slot.tolist() == [2, 2, 2, 2, 0, 1, 1] + [-1] * 17
    assert draws.seq_pos.tolist() == [9, 10, 11, 12, 19, 29, 30] + [-1] * 17
    assert draws.prompt_len.tolist() == [4, 4, 4, 4, 5, 6, 6] + [0] * 17
    # without counts, K + 1 rows an entry, live or not (the single step's layout)
    assert sharding.slot_rows(slot, live, 4, None, 5, 8)[0].tolist() == [0, 5, 10, 15]


def test_ngram_lays_out_verify_rows_only_for_the_drafts_it_found(pair):
    """The n-gram lookup runs before the round's layout (``functional._spec_k``): a row's k is
    capped by the drafts its lookup found, so a draft that does not exist takes no verify row
    (it used to be a hole among the round's rows, which the tile loops still ran over), and the
    round's proposer reads those same drafts."""
    from sfjax.spec import proposers

    cfg = F.Config(pair["cfg"], MAX_LEN, speculative_config=_spec("ngram", pair))
    rng = np.random.default_rng(5)
    seg = rng.integers(2, 500, 4).tolist()
    found = seg * 3 + seg[:2]                       # its last tokens recur: drafts follow them
    unique = rng.permutation(np.arange(2, 500))[:14].tolist()   # nothing recurs: no drafts
    ids, lens = F.pad_prompts([found, unique, found[:9]])
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)] * 3
    st = F.prefill(pair["weights"], ids, lens,
                   F.Sampling.from_params(params, eos_token_ids=(), vocab_size=512), cfg)
    p = st.progress      # row 0's tokens so far (its drawn one too): the segment over and over
    n = int(p.length[0])
    last = p.last.at[0].set(seg[(n - 1) % 4])
    st = dataclasses.replace(st, history=st.history.at[0, :n].set(jnp.asarray((seg * 9)[:n])),
                             progress=dataclasses.replace(p, last=last))
    batch, sb, (order, live, k, _, copied) = F._layout(st, cfg, False)
    p = st.progress
    drafts, available, matched = proposers.ngram(st.history, order, p.length[order], 3, 1, 4)
    assert bool(live.all()) and available[1] == 0 < available[0]
    np.testing.assert_array_equal(copied, matched)    # the round counts its copies apart
    np.testing.assert_array_equal(k, np.minimum(3, available))
    np.testing.assert_array_equal(sb.k, k)
    np.testing.assert_array_equal(sb.drafts, drafts)
    # each live row's last token, then a verify row per found draft: packed, nothing between
    count = np.asarray(k) + 1
    np.testing.assert_array_equal(sb.verify_row, np.cumsum(count) - count)
    real = np.flatnonzero(np.asarray(batch.positions) >= 0)
    np.testing.assert_array_equal(real, sb.verify_row)
