"""Adaptive k (``"num_speculative_tokens": "auto"`` or ``adaptive_k``): each request's k follows
its own acceptance, tokens stay plain decoding's for every proposer, the engine's host and the
device pick the same k (one step per call or several), and no k compiles anything new."""

import jax
import numpy as np
import pytest

from sfjax import LLM
from sfjax.benchmark import compiles
from sfjax.spec.config import (ADAPTIVE_LEVELS, ADAPTIVE_MAX, ADAPTIVE_PROBE, SpeculativeConfig,
                               acceptance_level, adaptive_k, drafts_pay, fill_tile, kind_counts,
                               round_drafts)
from spec_util import (BATCH8_SEED, GEOMETRY, assert_same_outputs, delta, greedy, prompts,
                       repeated_prompts, run, sampled, spec_counters)


def _per_round(d):
    return d["num_draft_tokens"] / max(d["num_drafts"], 1)


def test_the_k_table_weighs_acceptance_against_the_rounds_cost():
    cheap = SpeculativeConfig("ngram", ADAPTIVE_MAX, adaptive_k=True)
    dear = SpeculativeConfig("ngram", ADAPTIVE_MAX, adaptive_k=True, draft_cost=1.0)
    from sfjax import toy
    cfg = toy.tiny_config()
    table = cheap.k_table(cfg, 8, row_tile=8, small=(2, 4))
    assert table.shape == (9, ADAPTIVE_LEVELS + 1, ADAPTIVE_MAX + 1)
    t = table[..., ADAPTIVE_MAX]                                    # rows that may draft 7
    assert t[1, 0] == 0 and t[1, -1] == ADAPTIVE_MAX
    assert (np.diff(t, axis=1) >= 0).all()                          # more acceptance, more k
    # batch 1 in certified tiles: 2 rows cost 1 row's tile, 3-4 a 4-row tile, 5-8 a full one
    assert set(t[1]) == {0, 1, 3, ADAPTIVE_MAX}
    # at 8 live rows a verify row costs a share of a full tile: none drafts at low acceptance
    low = ADAPTIVE_LEVELS // 8
    assert t[1, low] == 1 and t[8, low] == 0 and (t[8] <= t[1]).all()
    # a cap is weighed, not clipped: a row that may draft 4 (5 rows: a full tile) where 7 pay
    # drafts 3 (a 4-row tile); the best of 0..c never passes c and grows with it
    assert table[1, -1, 4] == 3 and (table[..., 0] == 0).all()
    assert (table <= np.arange(ADAPTIVE_MAX + 1)).all() and (np.diff(table, axis=2) >= 0).all()
    # without small tiles any 8 rows cost one tile: one request drafts 7 as soon as any pays
    assert set(cheap.k_table(cfg, 1, row_tile=8)[1, :, -1]) == {0, ADAPTIVE_MAX}
    # a draft as dear as a step never pays
    assert (dear.k_table(cfg, 8, row_tile=8, small=(2, 4)) == 0).all()
    assert SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": "auto"}) \
        == SpeculativeConfig("ngram", ADAPTIVE_MAX, adaptive_k=True)
    assert SpeculativeConfig("ngram", 8).k_table(cfg, 8) is None
    # integer steps: numpy on the host and jax.numpy on the device read the same entry; a row
    # the table gives 0 drafts 1 at every ADAPTIVE_PROBE-th output token, if it may draft
    accepted = np.array([0, 3, 99, 10, 10, 10, 10])
    rejected = np.array([0, 3, 1, 900, 900, 900, 900])
    live, generated = np.array([1, 8, 8, 8, 8, 3, 8]), np.array([5, 5, 5, 5, ADAPTIVE_PROBE, 9, 16])
    cap = np.array([7, 7, 7, 7, 7, 7, 0])
    host = adaptive_k(table, accepted, rejected, live, generated, cap)
    assert (host == np.asarray(adaptive_k(table, accepted, rejected, live, generated, cap,
                                          jax.numpy))).all()
    assert host[2] == ADAPTIVE_MAX and list(host[3:]) == [0, 1, 0, 0]
    with pytest.raises(ValueError, match="draft_cost"):
        SpeculativeConfig("ngram", 8, adaptive_k=True, draft_cost=-1.0)


def test_copies_and_guesses_are_weighed_apart():
    """A row's copies (n-gram drafts of a match in its own tokens) and its other drafts keep
    their own acceptance (``kind_counts``), each with its prior: a fresh row drafts the most it
    may on a copy and little on a guess; each kind's rejections lower only its own k; the host's
    numpy and the device's jax.numpy read the same entries."""
    from sfjax import toy
    table = SpeculativeConfig("ngram", ADAPTIVE_MAX, adaptive_k=True).k_table(
        toy.tiny_config(), 8, row_tile=8, small=(2, 4))
    copy = np.array([True, False, True, False, True, False])
    # all accepted / rejecting rounds, and the copies' among them
    accepted, rejected = np.array([0, 0, 30, 30, 30, 30]), np.array([0, 0, 20, 20, 2, 2])
    c_accepted, c_rejected = np.array([0, 0, 5, 5, 28, 28]), np.array([0, 0, 18, 18, 1, 1])
    counts = kind_counts(accepted, rejected, c_accepted, c_rejected, copy)
    assert [c.tolist() for c in counts] == [[0, 0, 5, 25, 28, 2], [0, 0, 18, 2, 1, 1]]
    level = acceptance_level(*counts, copy=copy)
    assert level[0] > level[1] and level[2] < level[3] and level[4] > level[1]
    live, generated, cap = np.ones(6, np.int32), np.full(6, 5), np.full(6, ADAPTIVE_MAX)
    host = adaptive_k(table, *counts, live, generated, cap, copy=copy)
    assert host[0] == ADAPTIVE_MAX and host[1] < host[0]      # fresh: copy 8/9, guess 1/2
    assert host[2] < host[3] and host[4] == ADAPTIVE_MAX      # a kind's rejections are its own
    jnp = jax.numpy
    device = adaptive_k(table, *kind_counts(*map(jnp.asarray, (accepted, rejected, c_accepted,
                                                               c_rejected, copy)), xp=jnp),
                        live, generated, cap, jnp, jnp.asarray(copy))
    assert (np.asarray(device) == host).all()
    # without copies (every proposer but n-gram lookup) the estimate is the one over all drafts
    none = np.zeros(6, bool)
    assert (acceptance_level(*kind_counts(accepted, rejected, 0, 0, none), copy=none)
            == acceptance_level(accepted, rejected)).all()


def test_a_rounds_drafts_are_dropped_where_they_do_not_pay():
    """``drafts_pay``: a round's drafts against its cost, on the device's ints."""
    jnp = jax.numpy
    tiles = dict(row_tile=8, small=(2, 4), tiled=True)
    level = lambda a, n: jnp.full(n, int(a * ADAPTIVE_LEVELS), jnp.int32)   # noqa: E731
    live = lambda n: jnp.ones(n, bool)                                      # noqa: E731
    def pay(k, a, **kw):
        return bool(drafts_pay(jnp.asarray(k, jnp.int32), level(a, len(k)), live(len(k)),
                               ADAPTIVE_MAX, 0.0, **{**tiles, **kw}))
    assert pay([1], 0.1)                          # batch 1: a 2-row tile costs what 1 row's does
    assert not pay([0] * 7 + [1], 0.3)            # one row's draft opens a second 8-row tile
    assert pay([0] * 6 + [1], 0.3)                # ... or fits the first one's spare row
    assert pay([3] * 8, 0.9) and not pay([3] * 8, 0.3)
    assert pay([1], 0.3, small=(), tiled=False)   # one kernel launch: a row costs 0.02 more
    assert not pay([0] * 8, 0.9)                  # no drafts: nothing to pay for
    # rows that are not live do not count: one live row of eight entries
    assert bool(drafts_pay(jnp.asarray([1] + [0] * 7, jnp.int32), level(0.1, 8),
                           jnp.asarray([True] + [False] * 7), ADAPTIVE_MAX, 0.0, **tiles))
    # a prefill chunk's rows in the round: one more tile over nine is dearer than over one
    assert not pay([1] * 8, 0.2) and pay([1] * 8, 0.2, taken=56)


def test_a_rounds_drafts_are_judged_with_its_fill():
    """``round_drafts``: free drafts fill the tiles the rows' k open before the round is judged,
    and a round whose drafts do not pay still fills the tiles it runs without them. The first
    state is one a batch-8 run of the demo target reached (tests/test_demo_model.py): judged
    without the fill, its 17 rows in three tiles did not pay, and no row drafted again."""
    jnp = jax.numpy
    k = jnp.asarray([2, 1, 1, 1, 1, 1, 1, 1], jnp.int32)
    cap = jnp.asarray([3, 4, 4, 4, 4, 4, 4, 4], jnp.int32)
    level = jnp.asarray([44, 36, 32, 18, 27, 36, 21, 21], jnp.int32)
    live = jnp.ones(8, bool)

    def drafts(k, cap, level, live, taken=0, fill=True):
        return [int(x) for x in round_drafts(k, cap, level, live, taken, ADAPTIVE_MAX, 0.0, 8,
                                             (2, 4), True, fill=fill)]
    assert not bool(drafts_pay(k, level, live, ADAPTIVE_MAX, 0.0, 8, (2, 4), True))
    got = drafts(k, cap, level, live)
    assert sum(got) + 8 == 24 and all(int(a) <= g <= int(c) for a, g, c in zip(k, got, cap))
    assert got == [3, 4, 1, 1, 1, 4, 1, 1]        # the highest acceptance first, to their caps
    assert drafts(k, cap, level, live, fill=False) == [0] * 8     # draft steps: all or none
    # low acceptance: no drafts open a tile; five live rows still fill their 8-row tile
    low = jnp.full(8, 4, jnp.int32)
    assert drafts(k, cap, low, live) == [0] * 8
    five = jnp.arange(8) < 5
    assert drafts(k, cap, low, five) == [3, 0, 0, 0, 0, 0, 0, 0]
    assert drafts(k, cap, low, five, fill=False) == [0] * 8
    assert drafts(k, cap, low, five, taken=3) == [0] * 8      # 3 host rows take the tile's rest


def test_free_drafts_fill_the_last_tile_best_rows_first():
    """``fill_tile``: the rows a round's last tile leaves empty go to more drafts, up to each
    row's cap, the rows of highest acceptance first; the tiles stay the same."""
    jnp = jax.numpy
    k, cap = jnp.array([1, 0, 0, 0], jnp.int32), jnp.array([7, 7, 2, 7], jnp.int32)
    level = jnp.array([10, 50, 40, 5], jnp.int32)
    live = jnp.array([True, True, True, False])

    def fill(taken, small):
        return [int(x) for x in fill_tile(k, cap, level, live, taken, 8, small)]
    assert fill(0, ()) == [1, 4, 0, 0]            # 4 rows in an 8-row tile: 4 more drafts
    assert fill(0, (2, 4)) == [1, 0, 0, 0]        # 4 rows fill a certified 4-row tile
    assert fill(2, (2, 4)) == [1, 2, 0, 0]        # 2 host rows before them: 6 rows in 8
    assert fill(1, (2, 4)) == [1, 3, 0, 0]        # 5 rows in 8: the best row takes all 3
    assert fill(9, ()) == [1, 3, 0, 0]            # 13 rows in two tiles: 3 spare


@pytest.mark.parametrize("draft", ["same", "other"])
def test_k_follows_each_requests_acceptance_and_tokens_equal_plain(spec_llm, plain_llm, draft):
    llm = spec_llm(draft, "auto", draft_cost=0.1)
    ps = prompts(8, seed=BATCH8_SEED)
    before = spec_counters(llm)
    for params in (greedy(), sampled(8, seed=BATCH8_SEED)):
        assert_same_outputs(run(llm, ps, params), run(plain_llm, ps, params))
    d = delta(before, spec_counters(llm))
    if draft == "same":       # everything accepted: k climbs, round by round, as far as 8
        # live rows' verify rows pay (``SpeculativeConfig.k_table``)
        assert d["num_accepted_tokens"] == d["num_draft_tokens"] and _per_round(d) > 1.5
        assert len(d["accepted_per_pos"]) >= 3
    else:                     # almost nothing accepted: one draft a round, or none
        assert _per_round(d) < 1.2


def test_ngram_and_eagle3_with_adaptive_k_equal_plain(spec_llm, plain_llm, eagle_head):
    ps = repeated_prompts(8, seed=3)
    # drafts priced free, so that 8 rows of this head's low acceptance still draft
    for method, extra in (("ngram", {"prompt_lookup_max": 3}), ("eagle3", {"model": eagle_head})):
        llm = spec_llm(None, "auto", method, draft_cost=0.0, **extra)
        before = spec_counters(llm)
        for params in (greedy(), sampled(8, seed=3)):
            assert_same_outputs(run(llm, ps, params), run(plain_llm, ps, params))
        assert delta(before, spec_counters(llm))["num_drafts"] > 0


def test_the_hosts_k_for_priced_ngram_drafts_bounds_both_kinds():
    """For n-gram drafts at a ``draft_cost`` the host grows a request's pages for its k
    (``Speculator.k_for``) without knowing whether the device's lookup will find a copy: it
    takes the larger of the two kinds' k, so the device's never passes it."""
    from types import SimpleNamespace

    from sfjax import toy
    from sfjax.engine.speculation import SpecMetrics, Speculator
    from sfjax.spec.config import draft_cap

    cfg = toy.tiny_config()
    config = SpeculativeConfig("ngram", ADAPTIVE_MAX, adaptive_k=True, draft_cost=0.05)
    spec = Speculator(config, cfg, 64, 16, 16)
    spec.k_table = config.k_table(cfg, 1, row_tile=8, small=(2, 4))
    cap = draft_cap(ADAPTIVE_MAX, 40, 20, 64)
    for copies, guesses in (((38, 2), (2, 20)), ((2, 20), (38, 2)), ((0, 0), (0, 0))):
        m = SpecMetrics(num_accepted_tokens=copies[0] + guesses[0],
                        num_rejections=copies[1] + guesses[1], copy_accepted=copies[0],
                        copy_rejections=copies[1])
        req = SimpleNamespace(strategy_slot=spec.slot, spec_metrics=m, output_token_ids=[1] * 5,
                              num_tokens=20)
        device = [int(adaptive_k(spec.k_table, *kind_counts(
            m.num_accepted_tokens, m.num_rejections, m.copy_accepted, m.copy_rejections, copy),
            1, 5, cap, copy=copy)) for copy in (False, True)]
        assert spec.k_for(req, 40, 1) == max(device) and device[0] != device[1], device


@pytest.mark.parametrize("method", ["draft_model", "ngram", "ngram priced"])
def test_host_and_device_pick_the_same_k_and_nothing_recompiles(tiny_folder, drafts, monkeypatch,
                                                                method):
    """One step per call (the host picks k, or for n-gram drafts a bound on it) and eight (the
    device does): the same drafts and acceptances request by request, free n-gram drafts and
    priced ones. Then a workload whose acceptance, so its k, differs runs on the programs
    already compiled (each bucket compiled at its first ask, ``COMPILE_AFTER`` 0: this is about
    k)."""
    import sfjax.engine.compile as buckets

    monkeypatch.setattr(buckets, "COMPILE_AFTER", 0)
    spec = ({"method": "draft_model", "model": drafts["near"], "draft_cost": 0.1}
            if method == "draft_model" else {"method": "ngram", "prompt_lookup_max": 3})
    if method == "ngram priced":
        spec["draft_cost"] = 0.05
    spec["num_speculative_tokens"] = "auto"
    ps = prompts(8, seed=BATCH8_SEED) if method == "draft_model" else repeated_prompts(8, seed=3)
    counters = {}
    for steps in (1, 8):
        # no prefix cache: the second workload's prompts would hit it, a path (write_history)
        # the first did not take; what must not compile here is a new k
        llm = LLM(tiny_folder, speculative_config=spec, num_scheduler_steps=steps,
                  enable_prefix_caching=False, **GEOMETRY)
        outs = run(llm, ps, greedy())
        counters[steps] = [o.metrics.spec_decode for o in outs]
    assert counters[1] == counters[8]
    with compiles() as seen:
        before = spec_counters(llm)
        run(llm, ps, sampled(8, seed=BATCH8_SEED))
        d = delta(before, spec_counters(llm))
    assert not seen
    assert _per_round(d) != pytest.approx(
        sum(c["num_draft_tokens"] for c in counters[8]) / sum(c["num_drafts"] for c in counters[8]))
