"""Tokenizers unlike the tiny byte-level BPE: SentencePiece-style ByteFallback decoders (Llama 2,
Mistral, Gemma) and BOS == EOS post-processors."""
from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors

from engine_common.text.tokenizer import IncrementalDetokenizer, Tokenizer

WORDS = "▁ a b c d e f g h i j k l m n o p q r s t u v w x y z".split() + ["▁Hello", "▁world"]


@pytest.fixture(scope="module")
def byte_fallback(tmp_path_factory):
    """A Llama-2-style tokenizer: BPE with byte fallback tokens <0x00>..<0xFF>."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for w in WORDS:
        vocab.setdefault(w, len(vocab))
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    d = tmp_path_factory.mktemp("bytefallback")
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>",
                                                         "eos_token": "</s>"}))
    return Tokenizer.from_dir(d), vocab


def test_stray_byte_after_a_streamed_character_does_not_raise(byte_fallback):
    tok, vocab = byte_fallback
    byte = lambda b: vocab[f"<0x{b:02X}>"]  # noqa: E731
    det = IncrementalDetokenizer(tok, tok.encode("world"))
    # "你" spelled in bytes, then a stray continuation byte that makes the decoder rewrite the
    # whole byte run as U+FFFD (DecodeStream refuses that), then a word.
    out = (byte(0xE4), byte(0xBD), byte(0xA0), byte(0x99), vocab["▁Hello"])
    text = "".join(det.add(t) for t in out) + det.flush()
    assert text.startswith("你") and text.endswith(" Hello")
    assert "world" not in text  # never the prompt's text


def test_random_streams_never_raise_nor_leak_the_prompt(byte_fallback):
    tok, vocab = byte_fallback
    rng = random.Random(0)
    ids = list(vocab.values())
    for _ in range(300):
        det = IncrementalDetokenizer(tok, tok.encode("Hello world"))
        out = [rng.choice(ids[3:]) for _ in range(rng.randint(1, 12))]
        text = "".join(det.add(t) for t in out) + det.flush()
        text.encode("utf-8")  # always valid UTF-8
        if "world" in text:
            assert vocab["▁world"] in out


def test_bos_only_post_processor_with_bos_equal_eos(tmp_path):
    """add_bos_token set, add_eos_token left out, and BOS == EOS: no EOS is appended."""
    vocab = {"<|endoftext|>": 0, "h": 1, "i": 2}
    tok = HFTokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.add_special_tokens(["<|endoftext|>"])
    tok.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A",
                                                       special_tokens=[("<|endoftext|>", 0)])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "add_bos_token": True}))
    assert Tokenizer.from_dir(tmp_path).encode("hi") == [0, 1, 2]


def test_sentencepiece_decoders_keep_the_stream(byte_fallback):
    # "▁Hello" is " Hello" inside a text but "Hello" alone: its text depends on its place.
    tok, vocab = byte_fallback
    assert tok.token_texts(True) is None
    det = IncrementalDetokenizer(tok, tok.encode("world"))
    assert det.add(vocab["▁Hello"]) == " Hello"


class _CountingStream:
    """A DecodeStream that counts the ids stepped through it."""

    def __init__(self, stream):
        self.stream, self.steps = stream, 0

    def step(self, backend, token_id):
        self.steps += 1
        return self.stream.step(backend, token_id)


def test_skipped_special_tokens_never_reach_the_stream(byte_fallback):
    """A skipped special token spells nothing, so the DecodeStream need not see it: a run of
    them (eos repeated under ignore_eos) was decoded whole again at each token (quadratic:
    4000 took 0.7 s). Bytes of a character still join across them; kept specials still show."""
    tok, vocab = byte_fallback
    byte = lambda b: vocab[f"<0x{b:02X}>"]  # noqa: E731
    det = IncrementalDetokenizer(tok, tok.encode("world"))
    det._stream = counting = _CountingStream(det._stream)
    out = [vocab["</s>"]] * 300 + [byte(0xE4), vocab["</s>"], byte(0xBD), byte(0xA0)]
    out += [vocab["</s>"], vocab["▁Hello"]]
    pieces = [det.add(t) for t in out]
    assert counting.steps == 4 and "".join(pieces) == "你 Hello"
    kept = IncrementalDetokenizer(tok, tok.encode("world"), skip_special_tokens=False)
    assert "".join(kept.add(t) for t in [vocab["</s>"], vocab["▁Hello"]]) == tok.decode(
        [vocab["</s>"], vocab["▁Hello"]], skip_special_tokens=False)


def test_a_long_run_of_unfinished_bytes_is_not_decoded_again_and_again(byte_fallback):
    """Lone bytes that never make a character (a client can force one with allowed_token_ids)
    were held by the DecodeStream and decoded whole at every token: 4000 took 6.8 s of the
    event loop. After 16 ids without a whole character their text goes out as the tokenizer
    decodes it (U+FFFD each) and the stream starts again after them."""
    tok, vocab = byte_fallback
    lead = vocab["<0xE4>"]
    det = IncrementalDetokenizer(tok, tok.encode("world"))
    out = [lead] * 2000 + [vocab["▁Hello"]] + [lead] * 5 + [vocab["<0xBD>"], vocab["<0xA0>"]]
    pieces = []
    for t in out:
        pieces.append(det.add(t))
        assert len(det._ids) - det._num_done <= 16           # never a long run held
    # the last 7 ids' text still ends in U+FFFD: held, as DecodeStream holds them
    assert "".join(pieces) == tok.decode(out[:2001]) == "\ufffd" * 2000 + " Hello"
    assert det.flush() == "\ufffd" * 7
