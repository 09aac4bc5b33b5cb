"""The tokenizer a GGUF file describes, as a `tokenizers` Tokenizer (what tokenizer.json holds)
plus the tokenizer_config.json fields (special tokens, add_bos_token, chat_template).

The mapping follows transformers' GGUF loader (integrations/gguf/gguf_tokenizer_mapping.py), so
the ids equal `AutoTokenizer.from_pretrained(dir, gguf_file=...)`'s. Supported:
`tokenizer.ggml.model` = "gpt2" (byte-level BPE: Llama 3, Qwen, SmolLM2). Metadata used:

    tokenizer.ggml.tokens       string[V]  the vocabulary, id = index
    tokenizer.ggml.token_type   int32[V]   1 normal, 3 control (-> special added token),
                                           4 user-defined (-> non-special added token)
    tokenizer.ggml.merges       string[M]  "left right", highest priority first
    tokenizer.ggml.pre          string     picks the pre-tokenizer split regex (table below)
    tokenizer.ggml.{bos,eos,unknown,padding}_token_id, add_bos_token, add_eos_token
    tokenizer.chat_template     string
"""
from __future__ import annotations

from functools import lru_cache
from types import MappingProxyType

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from engine_common.gguf_file import GGUFError, GGUFFile

SUPPORTED_MODELS = ("gpt2",)
_CONTROL, _USER_DEFINED = 3, 4

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
    kind = gguf.require("tokenizer.ggml.model")
    if kind not in SUPPORTED_MODELS:
        raise GGUFError(f"{gguf.path}: tokenizer.ggml.model={kind!r} is not supported: must be "
                        f"one of {SUPPORTED_MODELS}")
    tokens = gguf.require("tokenizer.ggml.tokens")
    tok = Tokenizer(_byte_level_bpe(tokens, gguf.require("tokenizer.ggml.merges")))
    tok.pre_tokenizer = _pre_tokenizer(gguf.get("tokenizer.ggml.pre"))
    tok.decoder = decoders.ByteLevel()
    _add_special_tokens(tok, tokens, gguf.get("tokenizer.ggml.token_type") or [])
    return tok


def _byte_level_bpe(tokens: list[str], merges: list[str]) -> models.BPE:
    spelling = byte_to_unicode()
    alphabet = set(spelling.values())
    vocab = {}
    for index, token in enumerate(tokens):
        if not set(token) <= alphabet:   # spelled as text: respell its UTF-8 bytes
            token = "".join(spelling[b] for b in token.encode("utf-8"))
        vocab[token] = index
    pairs = [tuple(m.split(" ")) for m in merges]
    return models.BPE(vocab=vocab, merges=pairs, dropout=None, continuing_subword_prefix="",
                      end_of_word_suffix="", fuse_unk=False)


def _pre_tokenizer(pre: str | None):
    split = PRE_TOKENIZER_SPLITS.get(pre)
    if split is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _add_special_tokens(tok: Tokenizer, tokens: list[str], token_types: list[int]) -> None:
    """Control tokens become special added tokens (a control token spelled outside the byte
    alphabet is a llama.cpp mislabel and is skipped); user-defined ones plain added tokens."""
    alphabet = set(byte_to_unicode().values())
    control = [AddedToken(t, normalized=False, special=True)
               for t, kind in zip(tokens, token_types) if kind == _CONTROL and set(t) <= alphabet]
    if control:
        tok.add_special_tokens(control)
    vocab = tok.get_vocab()
    user = [AddedToken(t, normalized=False, special=False)
            for t, kind in zip(tokens, token_types) if kind == _USER_DEFINED and t in vocab]
    if user:
        tok.add_tokens(user)


def tokenizer_config_from_gguf(gguf: GGUFFile) -> dict:
    """tokenizer_config.json: the special tokens by name, add_bos/eos_token, the chat template."""
    tokens = gguf.require("tokenizer.ggml.tokens")
    config: dict = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for name, key in _SPECIAL_TOKENS:
        token_id = gguf.get(f"tokenizer.ggml.{key}")
        if token_id is not None and 0 <= token_id < len(tokens):
            config[name] = tokens[token_id]
    for key in ("add_bos_token", "add_eos_token"):
        value = gguf.get(f"tokenizer.ggml.{key}")
        config[key] = bool(value) if value is not None else False
    template = gguf.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    return config
