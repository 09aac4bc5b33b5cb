"""Tokenizer wrapper and streaming detokenizer on a tiny byte-level BPE trained here."""
import copy
import itertools
import random

import pytest
from tokenizers.decoders import DecodeStream

from engine_common.model_files.model_dir import ModelDirError
from engine_common.text.tokenizer import PARTIAL, IncrementalDetokenizer, Tokenizer
from tests.support.tokenizers import _byte_token_ids, build_tiny_tokenizer_dir

SAMPLE_TEXTS = ["Hello 你好🙂 world", "naïve 🦊 café", "", "a", "Привет 🙂🙂"]




@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return build_tiny_tokenizer_dir(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tok(tok_dir):
    return Tokenizer.from_dir(tok_dir)


def test_special_ids_and_vocab(tok):
    assert tok.bos_token_id == 0 and tok.eos_token_id == 1
    assert tok.vocab_size == 320
    assert tok.id_to_token(tok.token_to_id("<s>")) == "<s>"


@pytest.mark.parametrize("text", SAMPLE_TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id  # the template post-processor adds BOS
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=False) == "<s>" + text


def test_encode_matches_transformers(tok_dir, tok):
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(str(tok_dir))
    for text in SAMPLE_TEXTS + ["<s>x</s>"]:
        assert tok.encode(text) == hf(text)["input_ids"]
        ids = tok.encode(text)
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)


def test_add_bos_token_flag_wins_over_post_processor(tmp_path):
    off = Tokenizer.from_dir(build_tiny_tokenizer_dir(tmp_path / "off", add_bos_token=False))
    on = Tokenizer.from_dir(build_tiny_tokenizer_dir(tmp_path / "on", add_bos_token=True,
                                                     bos_template=False))
    plain = Tokenizer.from_dir(build_tiny_tokenizer_dir(tmp_path / "plain", bos_template=False))
    body = plain.encode("Hello 你好")
    assert body and body[0] != 0
    assert off.encode("Hello 你好") == body
    assert on.encode("Hello 你好") == [0] + body
    # A flag the config leaves out keeps what the post-processor does (here: BOS).
    eos = Tokenizer.from_dir(build_tiny_tokenizer_dir(tmp_path / "eos", add_eos_token=True))
    assert eos.encode("Hello 你好") == [0] + body + [1]


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(ModelDirError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def _stream(tok, prompt_ids, output_ids, skip=True):
    detok = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens=skip)
    pieces = [detok.add(t) for t in output_ids]
    return pieces, detok.flush()


def test_stream_multibyte_split_across_tokens(tok):
    # One token per byte: every character of "你好🙂" is split across 3-4 tokens.
    byte_ids = _byte_token_ids(tok, "你好🙂".encode())
    assert None not in byte_ids and len(byte_ids) == 10
    pieces, tail = _stream(tok, tok.encode("Hi"), byte_ids)
    assert tail == ""
    assert [p for p in pieces if p] == ["你", "好", "🙂"]
    assert all("\ufffd" not in p for p in pieces)




def test_stream_equals_full_decode_on_random_ids(tok):
    rng = random.Random(1234)
    byte_ids = _byte_token_ids(tok, "你好🙂é".encode())
    for _ in range(400):
        prompt = tok.encode(rng.choice(SAMPLE_TEXTS))
        # Mix whole tokens, lone bytes of multi-byte characters and special tokens.
        out = [rng.choice(byte_ids) if rng.random() < 0.4 else rng.randrange(tok.vocab_size)
               for _ in range(rng.randrange(1, 16))]
        for skip in (True, False):
            pieces, tail = _stream(tok, prompt, out, skip)
            assert "".join(pieces) + tail == tok.decode(out, skip_special_tokens=skip)
            # Nothing but the final flush may end inside a character.
            assert all(not p.endswith("\ufffd") for p in pieces)


def test_long_streams_equal_full_decode(tok):
    # Outputs longer than the ids a detokenizer keeps before trimming them (64): the text
    # streamed across each trim, and the flushed tail after one, match decoding all at once.
    rng = random.Random(99)
    byte_ids = _byte_token_ids(tok, "你好🙂é".encode())
    for n in (63, 64, 65, 66, 130, 300):
        out = [rng.choice(byte_ids) if rng.random() < 0.4 else rng.randrange(tok.vocab_size)
               for _ in range(n)]
        out += byte_ids[:2]                 # ends inside "你": the flush has work to do
        for skip in (True, False):
            pieces, tail = _stream(tok, tok.encode("Prompt:"), out, skip)
            assert "".join(pieces) + tail == tok.decode(out, skip_special_tokens=skip)
            assert tail.endswith("\ufffd")


def test_stream_encoded_text(tok):
    for text in SAMPLE_TEXTS:
        ids = tok.encode(text)[1:]
        pieces, tail = _stream(tok, tok.encode("Prompt:"), ids)
        assert "".join(pieces) == text and tail == ""


def test_prompt_ending_inside_a_character(tok):
    # The prompt ends with the first byte of "你"; output starts with the remaining bytes.
    nihao = _byte_token_ids(tok, "你".encode())
    prompt = tok.encode("Hi") + nihao[:1]
    out = nihao[1:] + tok.encode("ok")[1:]
    pieces, tail = _stream(tok, prompt, out)
    assert "".join(pieces) + tail == tok.decode(out)
    assert "Hi" not in "".join(pieces)


def test_flush_returns_unfinished_character(tok):
    out = tok.encode("ab")[1:] + _byte_token_ids(tok, "你".encode())[:2]
    pieces, tail = _stream(tok, [], out)
    assert "".join(pieces) == "ab"
    assert tail == "\ufffd" and "".join(pieces) + tail == tok.decode(out)


def test_tiny_model_tokenizer_matches_transformers(tmp_path):
    from transformers import AutoTokenizer

    from engine_common.text.tiny_tokenizer import CORPUS as TINY_CORPUS
    from engine_common.text.tiny_tokenizer import make_tiny_tokenizer_dir
    info = make_tiny_tokenizer_dir(tmp_path)
    ours, hf = Tokenizer.from_dir(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    assert ours.eos_token_id == info["eos_token_id"]
    for text in list(TINY_CORPUS[:4]) + SAMPLE_TEXTS:
        ids = ours.encode(text)
        assert ids == hf(text)["input_ids"]
        pieces, tail = _stream(ours, ours.encode("Q:"), ids)
        assert "".join(pieces) + tail == hf.decode(ids, skip_special_tokens=True)


def _stream_only(tok, prompt_ids, output_ids, skip):
    """The pieces of a detokenizer on a DecodeStream, as for any decoder: the reference."""
    stream_tok = copy.copy(tok)
    stream_tok._token_texts = None
    return _stream(stream_tok, prompt_ids, output_ids, skip)


def test_byte_level_detokenizer_gives_the_stream_pieces(tok):
    # A byte-level tokenizer decodes the held ids alone (one from the cache): the same pieces
    # as a DecodeStream, not only the same concatenation, with lone bytes of multi-byte
    # characters, special tokens (skipped or not) and ids past the vocabulary in the mix.
    assert tok.token_texts(True) is not None
    rng = random.Random(7)
    byte_ids = _byte_token_ids(tok, "你好🙂é".encode())
    special = tok.eos_token_id
    for _ in range(300):
        prompt = tok.encode(rng.choice(SAMPLE_TEXTS + ["x"]))
        out = [rng.choice(byte_ids) if rng.random() < 0.3 else
               special if rng.random() < 0.05 else tok.vocab_size + 5 if rng.random() < 0.02
               else rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 90))]
        for skip in (True, False):
            assert _stream(tok, prompt, out, skip) == _stream_only(tok, prompt, out, skip)


def test_token_texts_are_filled_as_ids_are_met(tok_dir):
    tok = Tokenizer.from_dir(tok_dir)
    word = tok.encode("Hello")[-1]
    assert word not in tok.token_texts(True)
    detok = IncrementalDetokenizer(tok, [])
    assert detok.add(word) == tok.decode([word]) == tok.token_texts(True)[word]
    assert tok.token_text(tok.eos_token_id, True) == ""          # a skipped special token
    assert tok.token_text(_byte_token_ids(tok, "你".encode())[0], True) is PARTIAL  # part of one
    assert tok.token_text(tok.eos_token_id, False) == tok.decode([tok.eos_token_id], False)


class _CountingBackend:
    """A tokenizers backend that counts the ids it is asked to decode."""

    def __init__(self, backend):
        self.backend, self.ids_decoded = backend, 0

    def decode(self, ids, skip_special_tokens=True):
        self.ids_decoded += len(ids)
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)


def test_a_run_of_skipped_special_tokens_is_not_decoded_again_and_again(tok):
    """Ids that spell nothing (special tokens, skipped) are done with at once: a model that
    repeats eos under ignore_eos costs one cache look-up a token, not a decode of the whole run
    (quadratic: 8000 of them took 3.6 s on the event loop). The text is unchanged: the held
    bytes of a character still join the ones after the run."""
    detok = IncrementalDetokenizer(tok, tok.encode("Q:"))
    detok._backend = counting = _CountingBackend(tok.backend)
    first, *rest = _byte_token_ids(tok, "你".encode())
    pieces = [detok.add(tok.eos_token_id) for _ in range(400)]
    assert counting.ids_decoded <= 2 and pieces == [""] * 400
    pieces = [detok.add(first)] + [detok.add(tok.eos_token_id) for _ in range(5)]
    pieces += [detok.add(t) for t in rest]
    assert pieces == [""] * 7 + ["你"]
    assert "".join(detok.add(t) for t in tok.encode("Hello", add_special_tokens=False)) == "Hello"


def test_a_run_of_unfinished_characters_is_not_decoded_again_and_again(tok):
    """Ids held because their text ends inside a character are not decoded whole at every
    token: a client can force a lone lead byte with allowed_token_ids (8000 of them took 5.9 s
    of the event loop on SmolLM2's tokenizer). Whether the run's text ends in U+FFFD is read
    off its last 4 ids (4 bytes or more: an unfinished UTF-8 sequence never spans more); the
    run is decoded whole once, when its text is complete. The pieces are DecodeStream's."""
    lead, cont = _byte_token_ids(tok, "你".encode())[:2]
    hi = tok.encode("Hi", add_special_tokens=False)
    out = [lead] * 300 + hi + [lead] * 50 + [cont] * 7 + [lead, cont] + [lead] * 40
    out += _byte_token_ids(tok, "好".encode()) + [tok.eos_token_id] + hi
    detok = IncrementalDetokenizer(tok, tok.encode("Q:"))
    detok._backend = counting = _CountingBackend(tok.backend)
    pieces = [detok.add(t) for t in out]
    assert counting.ids_decoded <= 6 * len(out)
    assert pieces == _decode_stream(tok, tok.encode("Q:"), out, True)
    assert "".join(pieces) == tok.decode(out)
    # and on random runs of lone bytes (leads, continuations, invalid ones), whole tokens,
    # special tokens and ids past the vocabulary, special tokens skipped or not
    rng = random.Random(9)
    byte_ids = _byte_token_ids(tok, bytes(range(256)))
    whole = tok.encode("你好🙂é Привет", add_special_tokens=False)
    for _ in range(300):
        out = [rng.choice(byte_ids) if rng.random() < 0.6 else rng.choice(whole)
               if rng.random() < 0.8 else rng.choice([0, 1, tok.vocab_size + 1])
               for _ in range(rng.randrange(1, 40))]
        for skip in (True, False):
            assert _stream(tok, [], out, skip)[0] == _decode_stream(tok, [], out, skip)


def _decode_stream(tok, prompt_ids, output_ids, skip):
    """tokenizers' DecodeStream stepped through the prompt, then through `output_ids` (vLLM's
    pieces: held ids are never given up, however many)."""
    stream = DecodeStream(skip_special_tokens=skip)
    for t in prompt_ids:
        stream.step(tok.backend, t)
    return [stream.step(tok.backend, t) or "" for t in output_ids]


def test_the_last_4_bytes_tell_whether_a_text_ends_inside_a_character(tok):
    """What the detokenizer's probe of a held run rests on, checked on the tokenizers decoder
    itself: for every 5-byte sequence over bytes of each kind (ASCII, continuation bytes in
    and out of the range a lead accepts, 2/3/4-byte leads, the invalid C0 and F5), the text
    ends in U+FFFD exactly when that of its last 4 bytes does. (4.2 million sequences of 5 to
    7 bytes over 21 kinds agreed as well, checked once.)"""
    kinds = [0x41, 0x80, 0xA0, 0xBF, 0xC0, 0xC2, 0xE0, 0xED, 0xF0, 0xF5]
    ids = dict(zip(kinds, _byte_token_ids(tok, bytes(kinds))))
    decode = tok.backend.decode
    for seq in itertools.product(kinds, repeat=5):
        run = [ids[b] for b in seq]
        assert decode(run).endswith("\ufffd") == decode(run[1:]).endswith("\ufffd"), seq
