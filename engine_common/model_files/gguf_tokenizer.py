"""The tokenizer a GGUF file describes, as a `tokenizers` Tokenizer (what tokenizer.json holds)
plus the tokenizer_config.json fields (special tokens, add_bos_token, chat_template).

The mapping follows transformers' GGUF loader (integrations/gguf/gguf_tokenizer_mapping.py), so
the ids equal `AutoTokenizer.from_pretrained(dir, gguf_file=...)`'s. Supported
`tokenizer.ggml.model` values:

    "gpt2"   byte-level BPE (Llama 3, Qwen, SmolLM2): the vocabulary is spelled in GPT-2's byte
             alphabet; split by the regex `tokenizer.ggml.pre` names (table below)
    "llama"  SentencePiece BPE (Llama 2, Mistral v0.1, TinyLlama): "▁" marks a space, a "▁" is
             prepended to the text, unknown bytes fall back to the <0xXX> tokens; without merges
             in the file they are rebuilt from the scores (transformers' generate_merges);
             per architecture as transformers builds it (GGUF_SENTENCEPIECE_BUILDERS):
             gemma/gemma2/gemma3: GemmaTokenizer (spaces normalized to "▁", nothing prepended,
             whitespace-only tokens the file spells with spaces respelled with "▁", merges
             rebuilt in file order); phi3: "▁" prepended and spaces replaced by a normalizer

Metadata used:

    tokenizer.ggml.tokens       string[V]  the vocabulary, id = index
    tokenizer.ggml.scores       float[V]   SentencePiece piece scores (merge priority)
    tokenizer.ggml.token_type   int32[V]   1 normal, 2 unknown, 3 control (-> special added
                                           token), 4 user-defined (-> non-special added token),
                                           6 byte
    tokenizer.ggml.merges       string[M]  "left right", highest priority first
    tokenizer.ggml.pre          string     picks the pre-tokenizer split regex (table below)
    tokenizer.ggml.{bos,eos,unknown,padding}_token_id, add_bos_token, add_eos_token
    tokenizer.chat_template     string
"""
from __future__ import annotations

from functools import lru_cache
from types import MappingProxyType

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from engine_common.model_files.gguf_file import GGUFError, GGUFFile
from engine_common.model_files.gguf_values import (MISSING, metadata_bool, metadata_int,
                                                   metadata_list, metadata_str)

SUPPORTED_MODELS = ("gpt2", "llama")
_GEMMA_ARCHS = ("gemma", "gemma2", "gemma3")
_SPACE = "\u2581"
_CONTROL, _USER_DEFINED = 3, 4
_GEMMA_MASK = "<mask>"              # GemmaTokenizer's default mask_token

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> split regex; any other value keeps GPT-2's own ByteLevel regex
# (SmolLM2's "smollm" among them, exactly as transformers does).
PRE_TOKENIZER_SPLITS = MappingProxyType({
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx"),
                    _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
})

# tokenizer_config.json name -> tokenizer.ggml key of its id
_SPECIAL_TOKENS = (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                   ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id"))


@lru_cache(maxsize=1)
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table of byte-level BPE vocabularies."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def tokenizer_from_gguf(gguf: GGUFFile) -> Tokenizer:
    """The file's tokenizer, ready to encode (what tokenizer.json would hold)."""
    kind = metadata_str(gguf, "tokenizer.ggml.model")
    if kind not in SUPPORTED_MODELS:
        raise GGUFError(f"{gguf.path}: tokenizer.ggml.model={kind!r} is not supported: must be "
                        f"one of {SUPPORTED_MODELS}")
    tokens = metadata_list(gguf, "tokenizer.ggml.tokens", str)
    merges = _merges(gguf, None if kind == "llama" else MISSING)
    if kind == "gpt2":
        tok = Tokenizer(_byte_level_bpe(tokens, merges))
        tok.pre_tokenizer = _pre_tokenizer(metadata_str(gguf, "tokenizer.ggml.pre", None))
        tok.decoder = decoders.ByteLevel()
    elif gguf.get("general.architecture") in _GEMMA_ARCHS:
        tok = _gemma_bpe(tokens, merges)
    else:
        tok = _sentencepiece_bpe(tokens, merges, metadata_list(
            gguf, "tokenizer.ggml.scores", float, None, len(tokens)), gguf)
        if gguf.get("general.architecture") == "phi3":
            # transformers' phi3_tokenizer: the prefix space from a normalizer, no Metaspace
            tok.normalizer = normalizers.Sequence([normalizers.Prepend(_SPACE),
                                                   normalizers.Replace(" ", _SPACE)])
            tok.pre_tokenizer = None
    _add_special_tokens(tok, tokens, metadata_list(gguf, "tokenizer.ggml.token_type", int, [],
                                                   len(tokens)),
                        kind == "gpt2", _named_special_tokens(gguf, tokens))
    return tok


def _sentencepiece_bpe(tokens: list[str], merges: list[tuple[str, str]] | None,
                       scores: list[float] | None, gguf: GGUFFile) -> Tokenizer:
    """transformers' LlamaTokenizer(vocab, merges) as it builds it for a GGUF."""
    vocab = {token: index for index, token in enumerate(tokens)}
    if merges is not None:
        pairs = merges
    elif scores is not None:
        pairs = merges_from_scores(vocab, dict(zip(tokens, scores)))
    else:
        raise GGUFError(f"{gguf.path}: a 'llama' tokenizer needs tokenizer.ggml.merges or "
                        "tokenizer.ggml.scores; the file has neither")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, dropout=None, fuse_unk=True,
                               byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first",
                                                 split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return tok


def _gemma_bpe(tokens: list[str], merges: list[tuple[str, str]] | None) -> Tokenizer:
    """transformers' gemma_tokenizer + GemmaTokenizer for a GGUF: whitespace-only tokens the
    file spells with spaces respelled as "▁"s (GemmaTokenizer looks them up so), merges from the
    file or rebuilt with the file's order as their priority (Gemma's scores do not follow its
    merge order), spaces normalized to "▁", nothing prepended."""
    respelled = [_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {token: index for index, token in enumerate(respelled)}
    if merges is not None:
        pairs = merges
    else:
        pairs = merges_from_scores(vocab, {t: -i for i, t in enumerate(respelled)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=True, unk_token="<unk>",
                               dropout=None, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous",
                                             invert=False)
    tok.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(),
                                     decoders.Fuse()])
    tok.normalizer = normalizers.Replace(" ", _SPACE)
    return tok


def merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a piece into two known
    pieces, the best-scoring piece's first (transformers' generate_merges, same order)."""
    merges = []
    for piece, score in scores.items():
        local = [(piece[:i], piece[i:], score) for i in range(1, len(piece))
                 if piece[:i] in vocab and piece[i:] in vocab]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _merges(gguf: GGUFFile, default) -> list[tuple[str, str]] | None:
    """tokenizer.ggml.merges as (left, right) pairs; GGUFError naming the first merge that is
    not two pieces joined by one space (the tokenizers library would panic on it)."""
    key = "tokenizer.ggml.merges"
    merges = metadata_list(gguf, key, str, default)
    if merges is None:
        return None
    pairs = [tuple(m.split(" ")) for m in merges]
    for i, pair in enumerate(pairs):
        if len(pair) != 2 or not all(pair):
            raise GGUFError(f"{gguf.path}: metadata {key}[{i}]={merges[i]!r} is invalid: must "
                            "be two pieces joined by one space")
    return pairs


def _byte_level_bpe(tokens: list[str], pairs: list[tuple[str, str]]) -> models.BPE:
    spelling = byte_to_unicode()
    alphabet = set(spelling.values())
    vocab = {}
    for index, token in enumerate(tokens):
        if not set(token) <= alphabet:   # spelled as text: respell its UTF-8 bytes
            token = "".join(spelling[b] for b in token.encode("utf-8"))
        vocab[token] = index
    return models.BPE(vocab=vocab, merges=pairs, dropout=None, continuing_subword_prefix="",
                      end_of_word_suffix="", fuse_unk=False)


def _pre_tokenizer(pre: str | None):
    split = PRE_TOKENIZER_SPLITS.get(pre)
    if split is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _named_special_tokens(gguf: GGUFFile, tokens: list[str]) -> dict[str, str]:
    """bos / eos / unk / pad token strings, by tokenizer_config.json name (an id past the
    vocabulary names none: llama.cpp drops it). A Gemma file also gets GemmaTokenizer's
    mask_token: transformers wraps its tokenizer in that class, whose default "<mask>" the file
    cannot override (GGUF names no mask id), so "<mask>" is special there however the file
    marks it (older converters wrote it user-defined): skipped in decoded text."""
    named = {}
    for name, key in _SPECIAL_TOKENS:
        token_id = metadata_int(gguf, f"tokenizer.ggml.{key}", None, minimum=-1)
        if token_id is not None and 0 <= token_id < len(tokens):
            named[name] = tokens[token_id]
    if gguf.get("general.architecture") in _GEMMA_ARCHS and _GEMMA_MASK in tokens:
        named["mask_token"] = _GEMMA_MASK
    return named


def _add_special_tokens(tok: Tokenizer, tokens: list[str], token_types: list[int],
                        byte_level: bool, named: dict[str, str]) -> None:
    """Control tokens and the named special tokens (bos, eos, unk, pad, Gemma's mask) become
    special added tokens (in a byte-level vocabulary a control token spelled outside the byte
    alphabet is a llama.cpp mislabel and is skipped); user-defined ones plain added tokens."""
    alphabet = set(byte_to_unicode().values())
    special = [t for t, kind in zip(tokens, token_types)
               if kind == _CONTROL and (not byte_level or set(t) <= alphabet)]
    special += [t for t in named.values() if t not in special]
    if special:
        tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
    vocab = tok.get_vocab()
    user = [AddedToken(t, normalized=False, special=False)
            for t, kind in zip(tokens, token_types) if kind == _USER_DEFINED and t in vocab]
    if user:
        tok.add_tokens(user)


def tokenizer_config_from_gguf(gguf: GGUFFile) -> dict:
    """tokenizer_config.json: the special tokens by name, add_bos/eos_token, the chat template.
    A SentencePiece ("llama") vocabulary that does not say adds BOS, as llama.cpp does."""
    tokens = metadata_list(gguf, "tokenizer.ggml.tokens", str)
    config: dict = {"tokenizer_class": "PreTrainedTokenizerFast",
                    **_named_special_tokens(gguf, tokens)}
    default_bos = gguf.get("tokenizer.ggml.model") == "llama"
    for key, default in (("add_bos_token", default_bos), ("add_eos_token", False)):
        config[key] = metadata_bool(gguf, f"tokenizer.ggml.{key}", default)
    template = metadata_str(gguf, "tokenizer.chat_template", None)
    if template:
        config["chat_template"] = template
    return config
