"""The n-gram draft table (sfjax.spec.table): what it counts and keeps, how it chains, its file,
its lookup on the device, and the prompt-lookup proposer taking it only where the sequence's own
tokens hold no match."""

import jax.numpy as jnp
import numpy as np
import pytest

from sfjax.spec import proposers
from sfjax.spec import table as T

V = 10
CORPUS = [[5, 6, 7, 8, 9], [5, 6, 7, 8, 9], [1, 6, 7, 2, 3], [4, 6, 7, 2, 3]]


def _as_dict(t):
    return {int(k): tuple(v) for k, v in zip(np.asarray(t.keys), np.asarray(t.values).tolist())}


def test_build_counts_next_tokens_keeps_frequent_contexts_and_chains():
    t = T.build(CORPUS, V, width=2, min_count=2)
    # next token after (5, 6): 7 twice; after (6, 7): 8 twice, 2 twice (the tie: the smaller id);
    # (7, 8) -> 9 and (7, 2) -> 3 twice each; (1, 6) and (4, 6) once each: dropped. Each
    # continuation chains: (5, 6) -> 7, then (6, 7) -> 2; (7, 8) -> 9, then 9 has no entry (-1)
    assert _as_dict(t) == {5 * V + 6: (7, 2), 6 * V + 7: (2, 3), 7 * V + 8: (9, -1),
                           7 * V + 2: (3, -1)}
    assert np.all(np.diff(np.asarray(t.keys)) > 0)
    uni = np.asarray(t.unigram).tolist()
    # after 1 alone: 6, then (1, 6) was dropped, so 6 alone: 7
    assert uni[5] == [6, 7] and uni[6] == [7, 2] and uni[7] == [2, 3] and uni[1] == [6, 7]
    assert uni[8] == [9, -1] and uni[2] == [3, -1]
    assert uni[0] == uni[3] == uni[9] == [-1, -1]             # never followed by a token
    again = T.build(CORPUS, V, width=2, min_count=2)
    for a, b in zip((t.unigram, t.keys, t.values), (again.unigram, again.keys, again.values)):
        np.testing.assert_array_equal(a, b)


def test_build_counts_a_models_predictions_when_given():
    """A model's next-token predictions, not the corpus's own next tokens (which say 2 -> 3)."""
    t = T.build([[1, 2, 3], [1, 2, 3]], V, width=2, min_count=2,
                predictions=[[2, 4, 4], [2, 4, 5]])
    assert _as_dict(t) == {1 * V + 2: (4, -1)}              # (2, 3) -> 4 or 5: once each, dropped
    uni = np.asarray(t.unigram).tolist()
    assert uni[1] == [2, 4] and uni[2] == [4, -1] and uni[3] == [4, -1]


def test_continuations_are_what_the_device_lookup_chains_to():
    """Each stored continuation is the one-token lookup applied again and again, as ``lookup``
    does it on the device: the table is a chained n-gram model."""
    rng = np.random.default_rng(0)
    corpus = [rng.integers(0, 12, size=rng.integers(2, 40)).tolist() for _ in range(30)]
    t = T.build(corpus, 13, width=4, min_count=2)            # 12: never seen, no entry
    assert 0 < t.keys.shape[0] < 144
    keys = np.asarray(t.keys)
    for prev, last, want in ((keys // 13, keys % 13, np.asarray(t.values)),
                             (np.full(13, -1), np.arange(13), np.asarray(t.unigram))):
        got, alive = [], np.ones(len(last), bool)
        for _ in range(4):
            d, have = map(np.asarray, T.lookup(t, jnp.asarray(prev, jnp.int32),
                                               jnp.asarray(last, jnp.int32), 1))
            alive &= have[:] > 0
            got.append(np.where(alive, d[:, 0], -1))
            prev, last = last, d[:, 0]
        np.testing.assert_array_equal(np.stack(got, 1), want)
    assert (np.asarray(t.unigram)[12] == -1).all() and (np.asarray(t.unigram)[:12] >= 0).all()


def test_build_refuses_bad_settings():
    with pytest.raises(ValueError, match="width"):
        T.build(CORPUS, V, width=0)
    with pytest.raises(ValueError, match="vocab_size"):
        T.build(CORPUS, 50_000)
    with pytest.raises(ValueError, match="predictions must match"):
        T.build([[1, 2, 3]], V, predictions=[[1, 2]])
    with pytest.raises(ValueError, match=r"sequences hold ids outside 0\.\.9"):
        T.build([[1, 12, 3]], V)
    with pytest.raises(ValueError, match="predictions hold ids"):
        T.build([[1, 2]], V, predictions=[[1, -1]])


def test_file_round_trip_and_its_checks(tmp_path):
    t = T.build(CORPUS, V, width=2, min_count=1)
    path = str(tmp_path / T.TABLE_FILE)
    T.save(t, path)
    back = T.load(path, V)
    for f in ("unigram", "keys", "values"):
        np.testing.assert_array_equal(getattr(back, f), getattr(t, f))
    with pytest.raises(ValueError, match=r"prompt_lookup_table.*vocabulary \(10\).*\(11\)"):
        T.load(path, 11)
    with pytest.raises(ValueError, match="prompt_lookup_table.*cannot read"):
        T.load(str(tmp_path / "nope.safetensors"))
    from safetensors.numpy import save_file
    save_file({"x": np.zeros(3, np.int32)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="not an n-gram table"):
        T.load(str(tmp_path / "other.safetensors"))
    (tmp_path / "text.safetensors").write_text("not safetensors")     # safetensors' own error
    with pytest.raises(ValueError, match="prompt_lookup_table: cannot read .* as safetensors"):
        T.load(str(tmp_path / "text.safetensors"))


def test_lookup_bigram_then_unigram_then_nothing():
    t = T.build(CORPUS, V, width=2, min_count=2)
    prev = jnp.array([5, 1, -1, 0, 6, 7], jnp.int32)
    last = jnp.array([6, 6, 7, 0, 7, 8], jnp.int32)
    drafts, avail = map(np.asarray, T.lookup(t, prev, last, 2))
    assert avail.tolist() == [2, 2, 2, 0, 2, 1]
    assert drafts.tolist() == [[7, 2], [7, 2], [2, 3], [0, 0], [2, 3], [9, 0]]
    d1, a1 = map(np.asarray, T.lookup(t, prev, last, 1))
    assert a1.tolist() == [1, 1, 1, 0, 1, 1] and d1[:, 0].tolist() == [7, 7, 2, 0, 2, 9]
    empty = T.build([[1, 2]], V, width=2, min_count=1)        # no bigram; one unigram (1 -> 2)
    assert empty.keys.shape[0] == 0
    assert np.asarray(T.lookup(empty, prev, last, 2)[1]).tolist() == [0] * 6


@pytest.mark.parametrize("width", [1, 2, 3])
@pytest.mark.parametrize("k", [1, 4, 7, 9])
def test_lookup_past_the_width_chains_as_a_wider_table(width, k):
    """Past its width a lookup goes on from its own last two drafts: the drafts and counts of a
    table built k wide, for every context pair of the vocabulary (the chain's stops included:
    a token with no entry ends it)."""
    rng = np.random.default_rng(width * 10 + k)
    # V - 2 never occurs (no entry: no drafts) and V - 1 only last (a chain stops after it)
    corpus = [rng.integers(0, V - 2, 12).tolist() + [V - 1] for _ in range(6)]
    narrow = T.build(corpus, V, width=width, min_count=2)
    wide = T.build(corpus, V, width=max(k, width), min_count=2)
    prev, last = (jnp.asarray(x.ravel(), jnp.int32)
                  for x in np.meshgrid(np.arange(-1, V), np.arange(V), indexing="ij"))
    (d, a), (dw, aw) = (map(np.asarray, T.lookup(t, prev, last, k)) for t in (narrow, wide))
    np.testing.assert_array_equal(a, aw)
    np.testing.assert_array_equal(d, dw)
    assert (a == 0).any() and (a > 0).any() and (a < k).any()
    assert a.max() == k                      # some run past the narrow width, to k


def test_proposer_takes_the_table_only_without_a_match():
    t = T.build(CORPUS, V, width=3, min_count=1)
    width = 12
    hist = np.zeros((3, width), np.int32)
    hist[0, :6] = [3, 4, 2, 3, 4, 2]     # last token 2 seen before: prompt lookup (-> 3 4 2)
    hist[1, :4] = [9, 0, 5, 6]           # 6 is new: table (5, 6) -> 7, (6, 7) -> 2, (7, 2) -> 3
    hist[2, :1] = [6]                    # one token: no match, no bigram: 6 alone -> 7, then 2 3
    length = jnp.array([6, 4, 1], jnp.int32)
    args = (jnp.asarray(hist), jnp.arange(3), length, 3, 1, 3)
    plain_d, plain_a, _ = map(np.asarray, proposers.ngram(*args))
    drafts, avail, copied = map(np.asarray, proposers.ngram(*args, table=t))
    assert plain_a.tolist() == [3, 0, 0] and avail.tolist() == [3, 3, 3]
    assert copied.tolist() == [True, False, False]       # the table's guesses are not copies
    assert drafts.tolist() == [plain_d[0].tolist(), [7, 2, 3], [7, 2, 3]]
