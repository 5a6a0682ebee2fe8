"""Output text, token by token: the two kinds of tokenizer Llama checkpoints ship (byte-level BPE,
Llama-3's; SentencePiece-style with byte fallback, Llama-2's), against ``tokenizers``' decode of
the same ids. The text only grows (a stream's deltas add up to the final text), no id sequence
fails a request, and the text is decoded after the prompt, so a SentencePiece token's leading
space stays (vLLM's text: prompt + text reads as decode(prompt + output))."""

from __future__ import annotations

import os
import random

import pytest

from sfjax import LLM, SamplingParams, toy
from sfjax.tokenizer import IncrementalDetokenizer

KINDS = {"byte_level": toy.build_tokenizer, "sentencepiece": toy.build_sentencepiece_tokenizer}


@pytest.fixture(scope="module", params=list(KINDS))
def tokenizer(request):
    return request.param, KINDS[request.param]()


def _stream(tok, ids, prompt=(), skip=True, drop_last=False):
    """(the text after each id, the final text) of ``ids`` after ``prompt``."""
    d = IncrementalDetokenizer(tok, skip, list(prompt))
    seen = []
    for i in ids:
        d.add(i)
        seen.append(d.text)
    d.finish(drop_last=drop_last)
    return seen, d.text


def test_random_ids_never_raise_and_the_text_only_grows(tokenizer):
    """2,000 random sequences of up to 12 ids after a random prompt of 0-6 ids (half of the
    SentencePiece vocabulary is byte tokens, so most hold bytes that are not UTF-8): every text
    seen on the way is the start of the final one, also when the last id's text is dropped (an
    EOS). The final text is the decode of prompt + ids past the prompt's text, or, where the
    output completes a character the prompt ends inside, that decode's end from the character
    on (its bytes are the output's); except where invalid bytes follow text already given (a
    decode of all the ids at once turns that text to U+FFFD too, ByteFallback), and only
    then."""
    kind, tok = tokenizer
    rng, vocab, seen_kinds = random.Random(0), tok.get_vocab_size(), set()
    for _ in range(2000):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 7))]
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 13))]
        skip, drop = rng.random() < 0.5, rng.random() < 0.3
        seen, text = _stream(tok, ids, prompt, skip=skip, drop_last=drop)
        assert all(text.startswith(s) for s in seen[:-1 if drop else None]), (ids, seen, text)
        head = tok.decode(prompt, skip_special_tokens=skip)
        whole = tok.decode(prompt + (ids[:-1] if drop else ids), skip_special_tokens=skip)
        kept = len(os.path.commonprefix([head, whole]))      # the prompt's text that stays
        if whole.startswith(head) and text == whole[len(head):]:
            seen_kinds.add("decode")
        elif not whole.startswith(head) and whole.endswith(text) and len(whole) - len(text) >= kept:
            seen_kinds.add("completed")          # the output completed the prompt's last character
        else:
            seen_kinds.add("broken")
            assert kind == "sentencepiece" and "\ufffd" in whole, (prompt, ids, text, whole)
    assert seen_kinds == {"decode", "completed", *(["broken"] if kind == "sentencepiece" else [])}


def test_bytes_that_break_a_decoded_run_do_not_fail_the_text():
    """A newline byte, then half an emoji's bytes, then a word: ``tokenizers.DecodeStream``
    raised 'Invalid prefix encountered' here (the request failed, the server answered 500)."""
    tok = toy.build_sentencepiece_tokenizer()
    word = tok.token_to_id("er")
    ids = [word, 2 + 0x0A, 2 + 0xF0, 2 + 0x9F, word]
    assert tok.decode(ids) == "er\ufffd\ufffd\ufffder"    # the newline's text changed
    seen, text = _stream(tok, ids)
    assert seen == ["er", "er\n", "er\n", "er\n", text] and text.endswith("er")


def test_a_run_of_bytes_that_never_make_a_character_is_decoded_once(tokenizer):
    """2,000 ids of byte 0xFF (a broken model, or allowed_token_ids of byte tokens): each id
    decoded the whole held run again (2,000 ids: two million decoded, quadratic); a run longer
    than ``HOLD`` ids is given out as U+FFFD, so each id is decoded a bounded number of times,
    and the text is still the decode of all of them."""
    kind, tok = tokenizer
    byte = 189 if kind == "byte_level" else 2 + 0xFF
    assert tok.decode([byte]) == "\ufffd"
    d = IncrementalDetokenizer(tok, True, [5, 6, 7])
    decoded, decode = [0], d._decode
    d._decode = lambda ids: decoded.__setitem__(0, decoded[0] + len(ids)) or decode(ids)
    for _ in range(2000):
        d.add(byte)
    d.finish()
    assert decoded[0] < 100 * 2000, decoded
    head = tok.decode([5, 6, 7])
    assert d.text == "\ufffd" * 2000 == tok.decode([5, 6, 7] + [byte] * 2000)[len(head):]


def test_output_text_keeps_the_leading_space_after_the_prompt(tokenizer):
    """The output is decoded after the prompt: prompt text + output text is the decode of
    prompt + output ids (``tokenizers`` alone strips a SentencePiece output's leading space)."""
    _, tok = tokenizer
    prompt = tok.encode("def fib(n):").ids
    rest = tok.encode(" return fib(n - 1)", add_special_tokens=False).ids
    seen, text = _stream(tok, rest, prompt)
    assert tok.decode(prompt, skip_special_tokens=True) + text == \
        tok.decode(prompt + rest, skip_special_tokens=True)
    assert text.startswith(" return") and seen[-1] == text


@pytest.fixture(scope="module")
def sp_folder(tmp_path_factory):
    return toy.build_model_folder(str(tmp_path_factory.mktemp("sp")), toy.tiny_config(), seed=3,
                                  std=0.3, tokenizer="sentencepiece")


def test_an_engine_on_a_sentencepiece_model_streams_its_final_text(sp_folder):
    """A random model on the SentencePiece tokenizer draws byte tokens freely (every request
    here meets bytes that are not UTF-8): eight sampled requests stream outputs whose texts
    each start the next one's and end as the final text, decoded after the prompt, and none
    fails."""
    llm = LLM(sp_folder, max_num_seqs=8, max_model_len=128)
    engine, tok = llm.engine, llm.get_tokenizer()
    for i in range(8):
        engine.add_request(f"r{i}", "def fib(n):",
                           SamplingParams(temperature=1.0, seed=i, max_tokens=40, ignore_eos=True))
    texts: dict[str, list[str]] = {}
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            assert out.outputs[0].finish_reason != "error", out.error
            texts.setdefault(out.request_id, []).append(out.outputs[0].text)
            if out.finished:     # the engine's text is the detokenizer's after the prompt
                replay = IncrementalDetokenizer(tok, True, out.prompt_token_ids)
                for t in out.outputs[0].token_ids:
                    replay.add(t)
                replay.finish()
                assert out.outputs[0].text == replay.text
    assert len(texts) == 8
    for seq in texts.values():
        assert all(b.startswith(a) for a, b in zip(seq, seq[1:])), seq


def test_the_tokenizers_own_eos_ends_a_sequence(tmp_path):
    """An instruct model's tokenizer_config.json names its end of turn as ``eos_token`` where
    generation_config.json is missing or older: vLLM stops on it, and so does sfjax (the
    request ran on to max_tokens)."""
    import json

    cfg = toy.tiny_config()
    folder = toy.build_model_folder(str(tmp_path), cfg, seed=0, std=0.1)
    params = SamplingParams(temperature=0, max_tokens=6, logit_bias={300: 100.0})
    before = LLM(folder, max_num_seqs=1, max_model_len=64).generate("def", params, use_tqdm=False)
    assert before[0].outputs[0].token_ids == [300] * 6
    path = tmp_path / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["eos_token"] = toy.build_tokenizer(cfg.vocab_size).id_to_token(300)
    path.write_text(json.dumps(config))
    out = LLM(folder, max_num_seqs=1, max_model_len=64).generate("def", params, use_tqdm=False)
    assert out[0].outputs[0].token_ids == [300] and out[0].outputs[0].finish_reason == "stop"


def test_a_prompt_ending_inside_a_character_leaves_it_to_the_output(tokenizer):
    """A prompt of token ids can end in the first byte of a character: an output whose first
    token is its second byte starts with that character (vLLM's), not U+FFFD; an output that
    does not complete it has its own text (the prompt's broken byte stays the prompt's)."""
    kind, tok = tokenizer
    if kind == "sentencepiece":
        byte = lambda b: 2 + b
    else:       # byte-level BPE spells bytes 0xA1-0xAC and 0xAE-0xFF as those code points
        byte = lambda b: tok.token_to_id(chr(b))
    word = tok.encode(" the", add_special_tokens=False).ids
    prompt = tok.encode("hello").ids + [byte(0xC3)]                   # "é" is C3 A9
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)
    seen, text = _stream(tok, [byte(0xA9), *word], prompt)
    assert seen[0] == "é" and text == decode(prompt + [byte(0xA9)] + word)[len("hello"):]
    seen, text = _stream(tok, word, prompt)
    assert text == decode(prompt + word)[len("hello\ufffd"):] and text.endswith(" the")


def test_characters_spelled_in_byte_tokens_across_the_prompts_end():
    """Llama-2-style vocabularies spell CJK and emoji in byte tokens, and HF's ByteFallback turns
    a whole run of byte tokens to U+FFFD when it starts inside a character: the context the
    output is decoded after starts at a character (the output's '世界' after '你好' came out
    '������'). 2,000 strings of accented letters, euro signs and emoji, spelled mostly in
    bytes and cut anywhere between prompt and output: the output's text is the end of the whole
    decode, with no U+FFFD."""
    tok = toy.build_sentencepiece_tokenizer()
    spell = lambda ch, rng: ([2 + b for b in ch.encode()] if rng.random() < 0.7
                             else tok.encode(ch, add_special_tokens=False).ids)
    rng = random.Random(1)
    for _ in range(2000):
        ids = [0] + [i for ch in rng.choices(["é", "€", "😀", "a", " ", "ü", "你"], k=6)
                     for i in spell(ch, rng)]
        cut = rng.randrange(2, len(ids))
        seen, text = _stream(tok, ids[cut:], ids[:cut])
        whole = tok.decode(ids, skip_special_tokens=True)
        assert whole.endswith(text) and "\ufffd" not in text and text.startswith(seen[0]), \
            (ids[:cut], ids[cut:], text, whole)
    prompt = [0] + [2 + b for b in "你好".encode()]
    assert _stream(tok, [2 + b for b in "世界".encode()], prompt)[1] == "世界"
