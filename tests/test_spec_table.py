"""The corpus n-gram table (sfjax.spec.table): what it keeps, its file, its lookup on the device,
and the prompt-lookup proposer taking it only where the sequence's own tokens hold no match."""

import jax.numpy as jnp
import numpy as np
import pytest

from sfjax.spec import proposers
from sfjax.spec import table as T

V = 10
CORPUS = [[5, 6, 7, 8, 9], [5, 6, 7, 8, 9], [1, 6, 7, 2, 3], [4, 6, 7, 2, 3]]


def test_build_keeps_the_most_frequent_continuation_of_frequent_contexts():
    t = T.build(CORPUS, V, width=2, min_count=2)
    got = {int(k): tuple(v) for k, v in zip(np.asarray(t.keys), np.asarray(t.values).tolist())}
    # (5, 6) -> (7, 8) twice; (6, 7) -> (8, 9) twice, (2, 3) twice: the first seen wins the tie;
    # (1, 6) and (4, 6) once each: dropped; (7, 8) -> (9 ...) has no 2-token continuation
    assert got == {5 * V + 6: (7, 8), 6 * V + 7: (8, 9)}
    assert np.all(np.diff(np.asarray(t.keys)) > 0)
    uni = np.asarray(t.unigram)
    assert tuple(uni[6]) == (7, 8) and tuple(uni[7]) == (8, 9) and tuple(uni[5]) == (6, 7)
    assert (uni[0] == -1).all() and (uni[9] == -1).all()       # never followed by two tokens
    again = T.build(CORPUS, V, width=2, min_count=2)
    for a, b in zip((t.unigram, t.keys, t.values), (again.unigram, again.keys, again.values)):
        np.testing.assert_array_equal(a, b)


def test_build_refuses_bad_settings():
    with pytest.raises(ValueError, match="width"):
        T.build(CORPUS, V, width=0)
    with pytest.raises(ValueError, match="vocab_size"):
        T.build(CORPUS, 50_000)


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


def test_lookup_bigram_then_unigram_then_nothing():
    t = T.build(CORPUS, V, width=2, min_count=2)
    prev = jnp.array([5, 1, -1, 0, 6], jnp.int32)
    last = jnp.array([6, 6, 7, 0, 7], jnp.int32)
    drafts, avail = map(np.asarray, T.lookup(t, prev, last, 3))
    assert avail.tolist() == [2, 2, 2, 0, 2]                 # k = 3 > width 2: at most 2
    assert drafts[:, :2].tolist() == [[7, 8], [7, 8], [8, 9], [0, 0], [8, 9]]
    assert (drafts[:, 2] == 0).all()
    d1, a1 = map(np.asarray, T.lookup(t, prev, last, 1))
    assert a1.tolist() == [1, 1, 1, 0, 1] and d1[:, 0].tolist() == [7, 7, 8, 0, 8]
    empty = T.build([[1, 2]], V, width=2, min_count=1)        # no bigram, no unigram entries
    assert np.asarray(T.lookup(empty, prev, last, 2)[1]).tolist() == [0] * 5


def test_proposer_takes_the_table_only_without_a_match():
    t = T.build(CORPUS, V, width=3, min_count=1)
    width = 12
    hist = np.zeros((3, width), np.int32)
    hist[0, :6] = [3, 4, 2, 3, 4, 2]     # last token 2 seen before: prompt lookup (-> 3 4 2)
    hist[1, :4] = [9, 0, 5, 6]           # 6 is new: table (5, 6) -> 7 8 9
    hist[2, :1] = [6]                    # one token: no match, no bigram: unigram 6 -> 7 8 9
    length = jnp.array([6, 4, 1], jnp.int32)
    args = (jnp.asarray(hist), jnp.arange(3), length, 3, 1, 3)
    plain_d, plain_a = map(np.asarray, proposers.ngram(*args))
    drafts, avail = map(np.asarray, proposers.ngram(*args, table=t))
    assert plain_a.tolist() == [3, 0, 0] and avail.tolist() == [3, 3, 3]
    assert drafts.tolist() == [plain_d[0].tolist(), [7, 8, 9], [7, 8, 9]]
