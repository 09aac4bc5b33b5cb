"""The tokenizer built from GGUF metadata gives the ids and text of transformers' own GGUF
tokenizer (AutoTokenizer.from_pretrained(dir, gguf_file=...)), for each pre-tokenizer family."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from engine_common.model_files.gguf_file import GGUFError, GGUFFile
from engine_common.model_files.gguf_tokenizer import (PRE_TOKENIZER_SPLITS, tokenizer_config_from_gguf,
                                          tokenizer_from_gguf)
from engine_common.text.tiny_tokenizer import CORPUS
from engine_common.text.tokenizer import IncrementalDetokenizer, Tokenizer
from tests.support.gguf_files import write_spm_tokenizer_gguf

TEXTS = [
    "Hello world, how are you today?",
    "The quick brown fox: 3.14159 and 2048 tokens (not 20481)!",
    "I'm sure they'd say DON'T, we'll see.",
    "  leading spaces,\ttabs\t\tand\n\nnewlines \n",
    "<|im_start|>user\nhéllo wörld 你好 🙂<|im_end|>\n<|im_start|>assistant\n",
    "def add(a, b):\n    return a + b\n",
    "Ωμέγα Привет 日本語 ❤️ — “quoted” … end",
    "arallel layers never dash",
]


@pytest.mark.parametrize("pre", [None, "smollm", "llama-bpe", "qwen2"])
def test_ids_and_text_equal_transformers(tiny_ggufs, pre):
    path = Path(tiny_ggufs("qwen3", pre=pre, user_defined=("arallel",)))
    ours = tokenizer_from_gguf(GGUFFile.open(path))
    ref = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=False).ids
        assert ids == ref(text, add_special_tokens=False)["input_ids"], text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(
                ids, skip_special_tokens=skip), text


def test_split_regexes_change_the_pieces(tiny_ggufs):
    """Digits: GPT-2's regex keeps "2048" whole, Llama 3's splits runs of 3, Qwen2's each digit."""
    pieces = {}
    for pre in (None, "llama-bpe", "qwen2"):
        tok = tokenizer_from_gguf(GGUFFile.open(tiny_ggufs("qwen3", pre=pre)))
        pieces[pre] = [p for p, _ in tok.pre_tokenizer.pre_tokenize_str("x 20481")]
    assert pieces[None] == ["x", "Ġ20481"]
    assert pieces["llama-bpe"] == ["x", "Ġ", "204", "81"]
    assert pieces["qwen2"] == ["x", "Ġ", "2", "0", "4", "8", "1"]
    assert "smollm" not in PRE_TOKENIZER_SPLITS     # transformers keeps GPT-2's regex for it


def test_control_tokens_are_special_and_config_names_them(tiny_ggufs):
    path = tiny_ggufs("qwen3", bos_token_id=1, chat_template="{{ bos_token }}")
    gguf = GGUFFile.open(path)
    config = tokenizer_config_from_gguf(gguf)
    assert config["eos_token"] == "<|endoftext|>" and config["bos_token"] == "<|im_start|>"
    assert config["add_bos_token"] is True and config["chat_template"] == "{{ bos_token }}"
    tok = Tokenizer.from_dir(path)
    assert tok.encode("hi") == [1] + tok.encode("hi", add_special_tokens=False)
    assert tok.decode([1, 2]) == ""                            # special: skipped in text


def test_unsupported_tokenizer_model_is_named(tiny_ggufs):
    gguf = GGUFFile.open(tiny_ggufs("qwen3"))
    gguf.metadata["tokenizer.ggml.model"] = "t5"
    with pytest.raises(GGUFError, match="tokenizer.ggml.model='t5' is not supported: must "
                                        "be one of \\('gpt2', 'llama'\\)"):
        tokenizer_from_gguf(gguf)


@pytest.fixture(scope="module")
def spm_gguf(tmp_path_factory):
    return write_spm_tokenizer_gguf(tmp_path_factory.mktemp("spm") / "spm.gguf", CORPUS)


def test_sentencepiece_vocabulary_equals_transformers(spm_gguf):
    """Llama-2-style files: merges rebuilt from the scores in transformers' order, a prepended
    "▁", byte fallback for characters outside the vocabulary, BOS added."""
    ours = Tokenizer.from_dir(spm_gguf)
    ref = AutoTokenizer.from_pretrained(spm_gguf.parent, gguf_file=spm_gguf.name)
    assert json.loads(ours.backend.to_str())["model"]["merges"] == json.loads(
        ref.backend_tokenizer.to_str())["model"]["merges"]
    for text in TEXTS + ["", " x", "Ελληνικά ☃ snowman"]:
        ids = ours.encode(text)
        assert ids == ref(text)["input_ids"], text
        assert ids[:1] == [1]
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
    assert tokenizer_config_from_gguf(GGUFFile.open(spm_gguf))["add_bos_token"] is True


def test_sentencepiece_text_streams_as_it_decodes(spm_gguf):
    tok = Tokenizer.from_dir(spm_gguf)
    ids = tok.encode("Once upon a time, naïve 🙂 Zürich!")
    detok = IncrementalDetokenizer(tok, ids[:3])
    streamed = "".join(detok.add(t) for t in ids[3:]) + detok.flush()
    assert tok.decode(ids[:3] + ids[3:]).startswith(tok.decode(ids[:3]))
    assert streamed == tok.decode(ids)[len(tok.decode(ids[:3])):]


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "phi3"])
def test_gemma_and_phi3_sentencepiece_files_equal_transformers(tmp_path, arch):
    """transformers builds these per architecture: Gemma's tokenizer (spaces normalized to "▁",
    nothing prepended, whitespace-only pieces respelled, merges in file order) and Phi-3's
    (the prefix space from a normalizer), which differ from Llama 2's (transformers reads no
    GGUF "gemma" tokenizer; ours builds Gemma 1's as Gemma 2's)."""
    path = write_spm_tokenizer_gguf(tmp_path / f"{arch}.gguf", CORPUS, arch=arch)
    ours = Tokenizer.from_dir(path)
    ref = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in TEXTS + ["", " x", "  two  spaces   three", "\t\ttabs", "Ελληνικά ☃ snowman"]:
        ids = ours.encode(text)
        assert ids == ref(text)["input_ids"], text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
    llama = write_spm_tokenizer_gguf(tmp_path / "llama.gguf", CORPUS)
    text = "  hi" if arch == "phi3" else "hello"          # the builders differ
    assert ours.encode(text) != Tokenizer.from_dir(llama).encode(text)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "llama"])
@pytest.mark.parametrize("kind", [1, 3, 4])
def test_gemma_mask_token_decodes_as_transformers(tmp_path, arch, kind):
    """transformers wraps a Gemma file's tokenizer in GemmaTokenizer, whose mask_token
    "<mask>" (the file names no mask id) is special: skipped in decoded text and matched whole,
    however the file marks it (normal, control, or user-defined as older converters wrote
    it); a Llama file's "<mask>" is special only when marked control."""
    path = write_spm_tokenizer_gguf(tmp_path / f"{arch}.gguf", CORPUS, arch=arch,
                                    extra_tokens=(("<mask>", kind),))
    ours = Tokenizer.from_dir(path)
    ref = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    mask = ref.convert_tokens_to_ids("<mask>")
    assert mask == ours.backend.token_to_id("<mask>")
    ids = ours.encode("hello world") + [mask] + ours.encode("again", add_special_tokens=False)
    assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert ours.encode("a <mask> b") == ref("a <mask> b")["input_ids"]
    assert ("<mask>" in ours.decode(ids)) == (arch == "llama" and kind != 3)
