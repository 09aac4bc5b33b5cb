"""The tokenizer llguidance compiles grammars against, reading special tokens' text as text.

llguidance (1.9.1) built from the tokenizer's JSON tokenizes the text a grammar forces with the
Hugging Face tokenizer, which reads "<|im_end|>" in plain text as that special token; the
matcher then offered the special token instead of the text and could never write it (SmolLM2:
`choice: ["<|im_end|>"]` ended at once with an empty text, the Lark string
`"The answer is: <|im_end|> ok"` stopped before its end). Here llguidance gets the same
vocabulary (each id's bytes as it reads them from the JSON, its special ids as special) with a
tokenize function that encodes special tokens' text as ordinary text (`encode_special_tokens`),
as a grammar's text must be; the mask itself never tokenizes, so it costs the same.
"""
from __future__ import annotations

from typing import Sequence

import llguidance
import tokenizers


class _TextTokenizer:
    """llguidance's TokenizerWrapper protocol: the vocabulary's bytes, eos, the special ids,
    and a call that tokenizes text (or UTF-8 bytes) without special tokens."""

    is_tokenizer_wrapper = True

    def __init__(self, reference: llguidance.LLTokenizer, encoder: tokenizers.Tokenizer,
                 vocab_size: int, eos_token_ids: Sequence[int]):
        self.eos_token_id = sorted(eos_token_ids)[0] if eos_token_ids else reference.eos_token
        self.bos_token_id = None
        self.tokens = [reference.decode_bytes([i]) for i in range(vocab_size)]
        self.special_token_ids = [i for i in range(vocab_size) if reference.is_special_token(i)]
        self._encoder = encoder

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        return self._encoder.encode(text, add_special_tokens=False).ids


def text_only_tokenizer(tokenizer_json: str, vocab_size: int,
                        eos_token_ids: Sequence[int]) -> llguidance.LLTokenizer:
    """An LLTokenizer of the tokenizer JSON whose forced text never becomes a special token."""
    eos = sorted(eos_token_ids)
    reference = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos)
    encoder = tokenizers.Tokenizer.from_str(tokenizer_json)
    encoder.encode_special_tokens = True
    encoder.no_padding()
    encoder.no_truncation()
    wrapper = _TextTokenizer(reference, encoder, vocab_size, eos)
    return llguidance.LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=eos)
