"""Row invariance of the whole forward (docs/design.md §1.2): a row's logits are the same bits whatever
the step's shape, the rows around it, its tile position, or how its tokens were chunked."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sfjax import model, rows as R, toy, weights as W
from sfjax.cache import KVCache

CFG = toy.tiny_config()
BS, MAX_BLOCKS = 8, 16


@functools.partial(jax.jit, static_argnames=("small_tiles", "stages"))
def _run(w, cache, tokens, positions, slots, tables, small_tiles=(), stages=()):
    tiling = R.Tiling(8, small_tiles, stages=stages)
    h, cache = model.forward(w, cache, tokens, positions, slots, tables, CFG, tiling)
    return model.logits(w, h, CFG, tiling), cache


def _call(w, cache, rows, tables, n, small_tiles=(), stages=()):
    """rows: list of (token, position, slot), padded to n rows."""
    t = np.zeros(n, np.int32)
    p = np.full(n, -1, np.int32)
    s = np.full(n, -1, np.int32)
    for i, (tok, pos, slot) in enumerate(rows):
        t[i], p[i], s[i] = tok, pos, slot
    return _run(w, cache, t, p, s, tables, small_tiles, stages)


@pytest.fixture(scope="module")
def setup():
    w = W.init_random(CFG, seed=3, std=0.1)
    tables = np.arange(1, 1 + 8 * MAX_BLOCKS, dtype=np.int32).reshape(8, MAX_BLOCKS)
    return w, tables


def test_prefill_once_equals_token_by_token_among_strangers(setup):
    w, tables = setup
    rng = np.random.default_rng(0)
    seq = rng.integers(0, CFG.vocab_size, 40)
    cache = KVCache.zeros(CFG, 8 * MAX_BLOCKS + 1, BS)
    ref, _ = _call(w, cache, [(t, i, 0) for i, t in enumerate(seq)], tables, 40)
    ref = np.asarray(ref)
    cache = KVCache.zeros(CFG, 8 * MAX_BLOCKS + 1, BS)
    # slot 3 decodes the same sequence one token a step, at a moving row, among other slots'
    # prefill chunks and decode rows, in steps of 8, 16 and 32 rows
    others = {s: list(rng.integers(0, CFG.vocab_size, 60)) for s in (1, 2, 5)}
    done = {s: 0 for s in others}
    for i, tok in enumerate(seq):
        n = [8, 16, 32][i % 3]
        rows = []
        for s in others:
            take = int(rng.integers(0, 4))
            for _ in range(take):
                if done[s] < 60 and len(rows) < n - 1:
                    rows.append((others[s][done[s]], done[s], s))
                    done[s] += 1
        at = int(rng.integers(0, len(rows) + 1))
        rows.insert(at, (tok, i, 3))
        logits, cache = _call(w, cache, rows, tables, n)
        assert (np.asarray(logits)[at] == ref[i]).all(), f"token {i}: row {at} of {n}"


def test_stale_kv_past_a_rows_position_is_invisible(setup):
    """Rollback moves a length: K/V written past a row's position (a rejected draft) changes
    nothing for it, bitwise."""
    w, tables = setup
    seq = np.random.default_rng(1).integers(0, CFG.vocab_size, 20)
    clean = KVCache.zeros(CFG, 8 * MAX_BLOCKS + 1, BS)
    ref, _ = _call(w, clean, [(t, i, 0) for i, t in enumerate(seq)], tables, 24)
    dirty = KVCache.zeros(CFG, 8 * MAX_BLOCKS + 1, BS)
    _, dirty = _call(w, dirty, [(7, i, 0) for i in range(40)], tables, 40)   # junk everywhere
    got, _ = _call(w, dirty, [(t, i, 0) for i, t in enumerate(seq)], tables, 24)
    assert (np.asarray(got)[:20] == np.asarray(ref)[:20]).all()


def _decodes_like_prefill(w, tables, small_tiles, seq, ref, stages=()) -> bool:
    """Whether ``seq`` decoded alone (one row a step), then by three slots at once (three rows),
    with ``small_tiles`` (each stage in its own, ``stages``), gives every row the logits ``ref``
    of its prefill in tiles of 8."""
    cache = KVCache.zeros(CFG, 8 * MAX_BLOCKS + 1, BS)
    for i, tok in enumerate(seq):
        rows = [(tok, i, 0)] if i < 15 else [(tok, i, s) for s in (0, 1, 2)]
        if i == 15:                         # slots 1 and 2 catch up to slot 0 in one step
            _, cache = _call(w, cache, [(t, j, s) for s in (1, 2) for j, t in enumerate(seq[:15])],
                             tables, 32, small_tiles, stages)
        logits, cache = _call(w, cache, rows, tables, 8, small_tiles, stages)
        if not all((np.asarray(logits)[r] == ref[i]).all() for r in range(len(rows))):
            return False
    return True


def test_the_small_tile_certificate_is_what_decoding_shows(setup):
    """A step whose rows fit a tile of 1, 2 or 4 runs in it only where that is certified
    (``rows.certify_row_tiles``). Whether a tile keeps row_tile's bits is the GEMM library's
    choice per M on this processor (on AVX-512 machines 2 and 4 do, on AVX2 ones none has been
    seen to), so the test holds the probe to what decoding in that tile shows, both ways: a
    certified tile gives every row its prefill's bits, one sequence decoded alone and then by
    three slots at once, and a refused tile changes some row's bits."""
    w, tables = setup
    tiles = R.certify_row_tiles(w, CFG, 8, (1, 2, 4))
    assert set(tiles) <= {1, 2, 4}
    seq = np.random.default_rng(2).integers(0, CFG.vocab_size, 30)
    ref, _ = _call(w, KVCache.zeros(CFG, 8 * MAX_BLOCKS + 1, BS),
                   [(t, i, 0) for i, t in enumerate(seq)], tables, 32)
    ref = np.asarray(ref)
    assert _decodes_like_prefill(w, tables, (), seq, ref), "tiles of 8 changed a row's bits"
    shown = tuple(t for t in (1, 2, 4) if _decodes_like_prefill(w, tables, (t,), seq, ref))
    assert shown == tiles, f"certified {tiles}, but decoding keeps the bits in tiles {shown}"
    assert _decodes_like_prefill(w, tables, tiles, seq, ref)


def test_each_stage_in_its_own_certified_tiles_keeps_the_bits(setup):
    """``Tiling.stages`` (``rows.tune_stage_tiles`` picks them by speed): a stage's one-tile
    calls in its own tiles among the certified ones, others in whole tiles, give every row its
    prefill's bits, whatever the mix."""
    w, tables = setup
    tiles = R.certify_row_tiles(w, CFG, 8, (2, 4))
    seq = np.random.default_rng(3).integers(0, CFG.vocab_size, 30)
    ref, _ = _call(w, KVCache.zeros(CFG, 8 * MAX_BLOCKS + 1, BS),
                   [(t, i, 0) for i, t in enumerate(seq)], tables, 32)
    for stages in [(("mlp", tiles[-1:]), ("head", tiles[:1])),
                   (("qkv", ()), ("o", tiles[-1:]), ("down", ()))]:
        assert _decodes_like_prefill(w, tables, tiles, seq, np.asarray(ref), stages), stages


def test_a_stage_runs_in_its_own_small_tiles():
    """``Rows.apply(..., stage=)`` runs a one-tile call in the smallest of the stage's tiles that
    holds its valid rows (the call's ``small`` where the stage is not named); a call under a
    mesh runs whole tiles."""
    tiling = R.Tiling(8, (2, 4), stages=(("mlp", (4,)), ("head", ())))
    f = jax.jit(lambda valid, stage: tiling.rows(valid).apply(lambda t: t * t.shape[0],
                                                             jnp.ones((8, 3)), stage=stage),
                static_argnums=1)
    one, three = jnp.arange(8) < 1, jnp.arange(8) < 3
    for stage, tile_of_one, tile_of_three in [("qkv", 2, 4), (None, 2, 4), ("mlp", 4, 4),
                                              ("head", 8, 8)]:
        assert float(f(one, stage)[0, 0]) == tile_of_one and float(f(three, stage)[0, 0]) == tile_of_three
    assert tiling.rows(one, split=True).tiling == R.Tiling(8)


def test_each_stage_takes_the_tile_it_runs_fastest_in():
    """``rows._stage_choice``: for the calls each certified tile is the smallest to hold, the
    fastest tile of at least as many rows, if it beats that tile by ``TUNE_MARGIN``; only the
    stages whose choice is not every certified tile are named."""
    times = {(s, t): 1.0 for s in R.STAGES for t in (2, 4, 8)}
    times.update({("mlp", 2): 2.0, ("mlp", 8): 1.5,             # 4 rows for 1..4 rows
                  ("head", 4): 0.95,                             # within the margin: 2 kept
                  ("down", 2): 3.0, ("down", 4): 3.0})           # whole tiles
    assert R._stage_choice(times, (2, 4), 8) == (("mlp", (4,)), ("down", ()))
    assert R._stage_choice(times, (4,), 8) == (("down", ()),)


def test_the_stage_choice_is_probed_and_kept_across_processes(setup, monkeypatch, tmp_path):
    """``rows.tune_stage_tiles``: a choice is timed twice, probed as a certificate is (the probe
    runs the stages in their tiles), kept on disk and taken by a new process without timing
    again; a choice the second timing does not repeat, or whose probe shows other bits, is
    dropped."""
    w, _ = setup
    monkeypatch.setenv("SFJAX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(R, "_TUNED", {})
    slow_mlp = lambda weights, ts, options, stages=R.STAGES: {
        (s, t): 2.0 if (s, t) == ("mlp", 2) else 1.0 for s in R.STAGES for t in ts}
    monkeypatch.setattr(R, "_stage_times", slow_mlp)
    probed = []
    monkeypatch.setattr(R, "_certify", lambda *a: probed.append(a[6]) or a[3])   # passes
    assert R.tune_stage_tiles(w, CFG, 8, (2, 4)) == (("mlp", (4,)),)
    assert probed == [(("mlp", (4,)),)]
    monkeypatch.setattr(R, "_TUNED", {})                    # as a new process
    monkeypatch.setattr(R, "_stage_times", lambda *a: pytest.fail("timed again"))
    assert R.tune_stage_tiles(w, CFG, 8, (2, 4)) == (("mlp", (4,)),) and len(probed) == 1
    monkeypatch.setattr(R, "_TUNED", {})
    monkeypatch.setenv("SFJAX_CACHE_DIR", "off")
    monkeypatch.setattr(R, "_stage_times", slow_mlp)
    monkeypatch.setattr(R, "_certify", lambda *a: a[3][:1])                     # tile 4 fails
    assert R.tune_stage_tiles(w, CFG, 8, (2, 4)) == ()
    monkeypatch.setattr(R, "_TUNED", {})
    monkeypatch.setattr(R, "_certify", lambda *a: a[3])
    timings = iter([slow_mlp(w, (2, 4, 8), {}), {(s, t): 1.0 for s in R.STAGES for t in (2, 4, 8)}])
    monkeypatch.setattr(R, "_stage_times", lambda *a: next(timings))           # not repeated
    assert R.tune_stage_tiles(w, CFG, 8, (2, 4)) == ()
    assert R.tune_stage_tiles(w, CFG, 8, ()) == ()


def test_per_tile_sized_picks_the_smallest_tile_that_holds_the_rows():
    for n, cases in [(8, [(1, 2), (2, 2), (3, 4), (4, 4), (5, 8), (8, 8)]),
                     (16, [(1, 8), (3, 8), (16, 8)])]:          # steps of more tiles: row_tile
        f = jax.jit(lambda valid: R.per_tile_sized(lambda t: t * t.shape[0], 8, (2, 4), valid,
                                                 jnp.ones((n, 3))))
        for last, tile in cases:
            out = np.asarray(f(jnp.arange(n) < last))
            done = -(-last // tile) * tile
            assert (out[:done] == tile).all() and (out[done:] == 0).all(), (n, last, tile)
        assert (np.asarray(f(jnp.zeros(n, bool))) == 0).all()      # nothing valid: nothing runs


def test_a_small_tile_is_one_call_without_a_loop():
    """A step whose rows fit a certified small tile calls the stage once on that tile, in its
    branch of the switch with no tile loop around it (the loops cost the demo target's batch-1
    round a fifth of its operations); the whole tile's branch alone loops."""
    f = lambda valid: R.per_tile_sized(lambda t: t * 2.0, 8, (2, 4), valid, jnp.ones((8, 3)))
    cond, = [e for e in jax.make_jaxpr(f)(jnp.ones(8, bool)).eqns if e.primitive.name == "cond"]
    loops = [sum(e.primitive.name == "while" for e in branch.jaxpr.eqns)
             for branch in cond.params["branches"]]
    assert loops == [0, 0, 0, 1]        # nothing valid, a tile of 2, of 4, the whole tile


def test_a_tile_loop_traces_its_body_once():
    """``per_tile`` needs its body's output shapes before the loop traces it: it traces the body
    once and replays the recording (``rows.traced``; tracing it for the shapes too cost a third of
    the time to trace a round), and computes what the body computes."""
    traced = []

    x, w = jnp.arange(48.0).reshape(16, 3), jnp.ones((3, 2))

    def body(t):
        traced.append(t.shape)
        return {"y": t @ w, "n": jnp.sum(t, axis=1)}

    out = jax.jit(lambda x: R.per_tile(body, 8, 2, x))(x)
    assert traced == [(8, 3)]
    np.testing.assert_array_equal(out["y"], x @ w)
    np.testing.assert_array_equal(out["n"], jnp.sum(x, axis=1))


def test_the_certificate_refuses_a_tile_with_other_bits(setup, monkeypatch):
    """A body whose bits follow the tile's size (here a norm that adds the tile's row count) gets
    no small tile."""
    w, _ = setup
    norm = R.rms_norm
    monkeypatch.setattr(R, "rms_norm", lambda x, g, eps: norm(x, g, eps) + x.shape[0] * 1e-3)
    monkeypatch.setattr(R, "_CERTIFIED", {})
    monkeypatch.setenv("SFJAX_CACHE_DIR", "off")        # the patched body is not in the source
    assert R.certify_row_tiles(w, CFG, 8, (2, 4)) == ()


def test_a_deep_models_certificate_probes_its_first_layers(monkeypatch):
    """A model deeper than ``rows.PROBE_LAYERS`` is probed on its first layers, not all of them
    (one trace of the probe: the layers it traced), with the whole model's answer."""
    deep = toy.tiny_config(num_layers=5)
    w = W.split_layers(W.init_random(deep, seed=3, std=0.1))     # unrolled: a call per layer
    monkeypatch.setattr(R, "_CERTIFIED", {})
    monkeypatch.setenv("SFJAX_CACHE_DIR", "off")
    traced, layer = [], model.decoder_layer
    monkeypatch.setattr(model, "decoder_layer",
                        lambda carry, lw, i, ctx: traced.append(i) or layer(carry, lw, i, ctx))
    tiles = R.certify_row_tiles(w, deep, 8, (2, 4))
    assert traced == list(range(R.PROBE_LAYERS)) and R.PROBE_LAYERS < deep.num_layers
    traced.clear()
    monkeypatch.setattr(R, "PROBE_LAYERS", deep.num_layers)
    assert R._certify(w, deep, 8, (2, 4), "auto", {}) == tiles
    assert traced == list(range(deep.num_layers))


def test_certificates_are_kept_across_processes_and_keyed_on_what_they_follow(setup, monkeypatch,
                                                                               tmp_path):
    """A probe's answer is stored (sfjax.certificate_cache) and a fresh process takes it without
    probing; another key (row tile, XLA flags, the engine's compile options: they change bits) or
    a damaged file probes again."""
    w, _ = setup
    monkeypatch.setenv("SFJAX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(R, "_CERTIFIED", {})
    probes = []
    certify = R._certify
    options = []
    monkeypatch.setattr(R, "_certify",
                        lambda *a: probes.append(a[2]) or options.append(a[5]) or certify(*a))
    first = R.certify_row_tiles(w, CFG, 8, (2, 4))
    assert probes == [8] and (tmp_path / "row_tile_certificates.json").exists()
    monkeypatch.setattr(R, "_CERTIFIED", {})                # as a new process
    assert R.certify_row_tiles(w, CFG, 8, (2, 4)) == first and probes == [8]
    monkeypatch.setattr(R, "_CERTIFIED", {})
    R.certify_row_tiles(w, CFG, 4, (2,))                    # another key
    monkeypatch.setattr(R, "_CERTIFIED", {})
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_fast_math=false")
    assert R.certify_row_tiles(w, CFG, 8, (2, 4)) == first and probes == [8, 4, 8]
    monkeypatch.setattr(R, "_CERTIFIED", {})
    R.certify_row_tiles(w, CFG, 8, (2, 4), compiler_options=(("xla_backend_optimization_level", 1),))
    assert probes == [8, 4, 8, 8] and options[-1] == {"xla_backend_optimization_level": 1}
    (tmp_path / "row_tile_certificates.json").write_text("{not json")
    monkeypatch.setattr(R, "_CERTIFIED", {})
    assert R.certify_row_tiles(w, CFG, 8, (2, 4)) == first and probes == [8, 4, 8, 8, 8]
