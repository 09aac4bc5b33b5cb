"""Text <-> token ids for the scheduler: a thin wrapper over a model directory's tokenizer.json,
and a streaming detokenizer that never emits broken UTF-8.

Torch-free: only the `tokenizers` library is used.
"""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers.decoders import ByteLevel, DecodeStream

from engine_common.model_files.gguf_file import GGUFError, GGUFFile, find_gguf
from engine_common.model_files.gguf_tokenizer import tokenizer_config_from_gguf, tokenizer_from_gguf
from engine_common.model_files.model_dir import ModelDirError, load_json
from engine_common.text.pair_template import PairTemplate

# Prompt tokens handed to the stream as context: enough for decoders whose output depends on the
# previous token (leading-space rules), without decoding a long prompt.
_CONTEXT_TOKENS = 8
# Ids an IncrementalDetokenizer keeps before it trims them to the context (trimming on every
# token cost more than the token's own decode step).
_TRIM_AT = 64
# Ids a DecodeStream may hold without a whole character before their text is sent anyway: a
# character takes at most 4 byte tokens, so only output that is no text gets there.
_MAX_HELD = 16
_REPLACEMENT = "\ufffd"
# token_texts' entry for a token whose text alone ends inside a character (compared by `is`).
PARTIAL = _REPLACEMENT


def _token_content(value) -> str | None:
    """tokenizer_config.json writes special tokens as a string, {"content": ...} or null."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    """Encode and decode with a model directory's tokenizer.json.

    BOS/EOS handling follows tokenizer_config.json's `add_bos_token` / `add_eos_token` when they
    are present; otherwise tokenizer.json's own post-processor decides.
    """

    def __init__(self, backend: _HFTokenizer, config: dict | None = None):
        self.backend = backend
        self._max_token_bytes: int | None = None
        self._special_ids: frozenset[int] | None = None
        # skip_special_tokens -> token id -> its text alone (token_texts); None: the decoder
        # is not byte-level. Shared by every thread that detokenizes: entries are only added,
        # each with the one value it can have; at most the vocabulary's size of them.
        self._token_texts: dict[bool, dict[int, str]] | None = (
            {True: {}, False: {}} if isinstance(backend.decoder, ByteLevel) else None)
        config = config or {}
        self.bos_token_id = self._lookup(_token_content(config.get("bos_token")))
        self.eos_token_id = self._lookup(_token_content(config.get("eos_token")))
        # None: tokenizer.json's post-processor decides; else (add_bos, add_eos), where a flag the
        # config leaves out keeps what the post-processor does.
        self._explicit: tuple[bool, bool] | None = None
        self._pair_template: PairTemplate | None | bool = False     # False: not read yet
        add_bos, add_eos = config.get("add_bos_token"), config.get("add_eos_token")
        if add_bos is not None or add_eos is not None:
            implied_bos, implied_eos = self._post_processor_adds(backend)
            self._explicit = (bool(implied_bos if add_bos is None else add_bos),
                              bool(implied_eos if add_eos is None else add_eos))

    def _post_processor_adds(self, backend: _HFTokenizer) -> tuple[bool, bool]:
        """Whether tokenizer.json's post-processor adds BOS and EOS, read off a real text (an
        empty probe cannot tell BOS from EOS when they are the same token)."""
        plain = backend.encode("a", add_special_tokens=False).ids
        full = backend.encode("a", add_special_tokens=True).ids
        adds_bos = full[:1] == [self.bos_token_id] and full[1:1 + len(plain)] == plain
        rest = full[(1 if adds_bos else 0) + len(plain):]
        return adds_bos, rest[:1] == [self.eos_token_id]

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "Tokenizer":
        """Load `tokenizer.json` (required) and `tokenizer_config.json` (optional), or build the
        tokenizer a GGUF file's metadata describes."""
        path = Path(model_dir)
        try:
            gguf_path = find_gguf(path)
            if gguf_path is not None:
                gguf = GGUFFile.open(gguf_path)
                return cls(tokenizer_from_gguf(gguf), tokenizer_config_from_gguf(gguf))
        except GGUFError as e:
            raise ModelDirError(str(e)) from None
        tok_path = path / "tokenizer.json"
        if not tok_path.is_file():
            raise ModelDirError(f"{tok_path} not found (only tokenizer.json is supported)")
        try:
            backend = _HFTokenizer.from_file(str(tok_path))
        except Exception as e:  # the tokenizers library raises a bare Exception
            raise ModelDirError(f"{tok_path} could not be loaded: {e}") from None
        cfg_path = path / "tokenizer_config.json"
        config = load_json(cfg_path) if cfg_path.is_file() else {}
        return cls(backend, config)

    def _lookup(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def special_ids(self) -> frozenset[int]:
        """Ids of the special tokens (those skip_special_tokens leaves out of the text)."""
        if self._special_ids is None:
            self._special_ids = frozenset(
                i for i, t in self.backend.get_added_tokens_decoder().items() if t.special)
        return self._special_ids

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, with BOS/EOS as the model directory asks; none with
        add_special_tokens=False (a rendered chat template carries its own). Releases the GIL
        while the tokenizer runs (`encode_batch` does, `encode` does not), so a long text
        tokenized on another thread does not stall this process's other threads."""
        if not add_special_tokens:
            return self.backend.encode_batch([text], add_special_tokens=False)[0].ids
        if self._explicit is None:
            return self.backend.encode_batch([text], add_special_tokens=True)[0].ids
        add_bos, add_eos = self._explicit
        ids = self.backend.encode_batch([text], add_special_tokens=False)[0].ids
        if add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        if add_eos and self.eos_token_id is not None:
            ids = ids + [self.eos_token_id]
        return ids

    def encode_pair(self, text: str, text_pair: str) -> tuple[list[int], list[int]]:
        """(ids, token type ids) of a sentence pair, as transformers' tokenizer(text, text_pair)
        encodes it with tokenizer.json's pair template (BERT: [CLS] a [SEP] b [SEP], types
        0...0 1...1; RoBERTa: <s> a </s></s> b </s>, all 0). tokenizer_config.json's
        add_bos_token / add_eos_token do not apply: transformers (5.x) drops them when a
        tokenizer.json is there, for pairs as for single texts. An empty `text_pair` is no pair
        there (`[(text, text_pair)] if text_pair else [text]`): `text` alone, as
        tokenizer.json's post-processor makes it. Releases the GIL as `encode`."""
        if not text_pair:
            enc = self.backend.encode_batch([text], add_special_tokens=True)[0]
            return enc.ids, enc.type_ids
        template = self.pair_template()
        if template is not None:
            return template.join(self.encode(text, add_special_tokens=False),
                                 self.encode(text_pair, add_special_tokens=False))
        enc = self.backend.encode_batch([(text, text_pair)], add_special_tokens=True)[0]
        return enc.ids, enc.type_ids

    def pair_template(self) -> PairTemplate | None:
        """The special tokens a pair gets around its texts' plain ids (pair_template.py), read
        off the post-processor once; None when it is not of that shape (then only
        `encode_pair` encodes pairs, whole)."""
        if self._pair_template is False:
            self._pair_template = PairTemplate.probe(self.backend)
        return self._pair_template

    def max_token_bytes(self) -> int:
        """An upper bound on the characters one token covers: the most UTF-8 bytes any token of
        the vocabulary decodes to (special tokens included; a partial UTF-8 sequence decodes to
        U+FFFD, 3 bytes for each byte it holds), plus one for a leading space a decoder strips.
        Read once (about 0.1 s for a 50,000-token vocabulary), then remembered."""
        if self._max_token_bytes is None:
            decode = self.backend.decode
            self._max_token_bytes = 1 + max(
                len(decode([i], skip_special_tokens=False).encode())
                for i in range(self.backend.get_vocab_size(with_added_tokens=True)))
        return self._max_token_bytes

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `token_ids`; invalid UTF-8 becomes U+FFFD."""
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_texts(self, skip_special_tokens: bool) -> dict[int, str] | None:
        """token id -> its text decoded alone (PARTIAL when that ends inside a character; ""
        when it has no bytes), filled by `token_text` as ids are met; None unless the decoder
        is byte-level. A byte-level decoder (GPT-2, Llama 3, Qwen, SmolLM) maps each token to its
        own bytes and decodes their concatenation, so after ids that decode to whole characters
        a token adds exactly its text alone when that ends in a whole character. Sentencepiece
        decoders strip a leading space at the start: their text depends on the place."""
        return None if self._token_texts is None else self._token_texts[skip_special_tokens]

    def token_text(self, token_id: int, skip_special_tokens: bool) -> str:
        """Fill and return token_texts' entry for `token_id`: PARTIAL (this very object) when
        its text ends inside a character (U+FFFD), since it then adds no text until a later
        token completes it; "" when it has no bytes at all (a special token skipped, an id
        past the vocabulary), since it never adds any."""
        text = self.backend.decode([token_id], skip_special_tokens=skip_special_tokens)
        if text.endswith(_REPLACEMENT):
            text = PARTIAL
        self._token_texts[skip_special_tokens][token_id] = text
        return text


class IncrementalDetokenizer:
    """Turns generated ids into text one token at a time.

    `add` returns only complete characters: bytes of a character split across tokens are held until
    the character is complete (as tokenizers' DecodeStream, which vLLM v1 steps). For byte-level
    BPE tokenizers the concatenation of what `add` returns equals `tokenizer.decode(output_ids)`,
    less the characters of the ids still held at the end; `flush` returns those as decode gives
    them (U+FFFD for an unfinished character). The output processor never sends them, as vLLM.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int],
                 skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        context = self._clean_context(list(prompt_token_ids[-_CONTEXT_TOKENS:]))
        self._backend = tokenizer.backend
        # Recent ids: context, then generated ids; `_num_done` of them are already turned into
        # text. Only the last _CONTEXT_TOKENS done ids are ever read (`_window`).
        self._ids = context
        self._num_done = len(context)
        # A byte-level decoder's text after whole characters does not depend on the ids before:
        # the ids not yet turned into text are decoded alone, a single one from a cache (~0.1 us
        # against ~2 us for a DecodeStream step). Other decoders keep a DecodeStream.
        self._texts = tokenizer.token_texts(skip_special_tokens)
        self._stream = None if self._texts is not None else DecodeStream(
            ids=context, skip_special_tokens=skip_special_tokens)
        # Skipped special tokens spell nothing: the stream need not see them (it would decode
        # a run of them whole again at each token).
        self._silent = (tokenizer.special_ids() if skip_special_tokens and self._stream
                        else frozenset())

    def _clean_context(self, context: list[int]) -> list[int]:
        """Drop trailing prompt ids that end inside a character, so generated bytes never
        complete (and re-emit) prompt text."""
        while context and self._tokenizer.decode(context, self._skip).endswith(_REPLACEMENT):
            context.pop()
        return context

    def add(self, token_id: int) -> str:
        """New text made complete by `token_id` (possibly "")."""
        texts = self._texts
        if texts is None:
            return self._step(token_id)
        text = texts.get(token_id)
        if text is None:
            text = self._tokenizer.token_text(token_id, self._skip)
        if not text:
            # No bytes (a special token skipped, an id past the vocabulary): no text now or
            # later, so it is not kept (a run of them, eos repeated under ignore_eos, would
            # be decoded whole at each token).
            return ""
        ids = self._ids
        ids.append(token_id)
        n = len(ids)
        done = self._num_done
        if n - 1 == done:               # nothing held before: the token's own text
            if text is PARTIAL:         # it ends inside a character
                return ""
            piece = text
        else:
            # What DecodeStream.step gives: the held ids' text once it does not end inside a
            # character (U+FFFD). An unfinished UTF-8 sequence spans at most 3 bytes and each
            # id here holds one or more, so the last 4 ids' text ends in U+FFFD exactly when
            # the run's does: a long run (lead bytes a client forced) is not decoded whole at
            # every token, only once its text is complete.
            if n - done > 4 and self._backend.decode(
                    ids[-4:], skip_special_tokens=self._skip).endswith(_REPLACEMENT):
                return ""
            piece = self._backend.decode(ids[done:], skip_special_tokens=self._skip)
            if piece.endswith(_REPLACEMENT):
                return ""
        if n > _TRIM_AT:                # older ids than the context are never read again
            del ids[:-_CONTEXT_TOKENS]
            n = _CONTEXT_TOKENS
        self._num_done = n
        return piece

    def _step(self, token_id: int) -> str:
        """`add` on a DecodeStream (decoders whose text depends on the place)."""
        ids = self._ids
        ids.append(token_id)
        if token_id in self._silent:
            if self._num_done == len(ids) - 1:      # nothing held before it
                self._done()
            return ""
        try:
            piece = self._stream.step(self._backend, token_id)
        except Exception:  # noqa: BLE001 -- the tokenizers library raises a bare Exception
            piece = self._resync()
        if not piece:
            done = self._num_done
            if len(ids) - done <= _MAX_HELD:
                return ""
            # That many ids and no whole character (lone bytes a client forced): the stream
            # would decode the growing run at every token. Their text goes out as decoded
            # (U+FFFD), they leave the context, and the stream starts again from the text
            # before them (whole: its prefill must not end inside a character).
            piece = self._held_text()
            del ids[done:]
            self._stream = DecodeStream(ids=ids[-_CONTEXT_TOKENS:],
                                        skip_special_tokens=self._skip)
            return piece
        self._done()
        return piece

    def _done(self) -> None:
        """Every id so far is turned into text. Older ids than the context are never read
        again: drop them now and then."""
        ids = self._ids
        if len(ids) > _TRIM_AT:
            del ids[:-_CONTEXT_TOKENS]
        self._num_done = len(ids)

    def flush(self) -> str:
        """Text of the ids still held (an unfinished character decodes to U+FFFD); they are
        released."""
        if self._num_done == len(self._ids):
            return ""
        piece = self._held_text()
        self._num_done = len(self._ids)
        return piece

    def _held_text(self) -> str:
        """Text of the ids not yet turned into text. Never repeats text already returned: when
        decoding with them rewrites earlier text, they are decoded on their own."""
        start = max(0, self._num_done - _CONTEXT_TOKENS)    # the done ids' context window
        prefix = self._tokenizer.decode(self._ids[start:self._num_done], self._skip)
        full = self._tokenizer.decode(self._ids[start:], self._skip)
        if full.startswith(prefix):
            return full[len(prefix):]
        return self._tokenizer.decode(self._ids[self._num_done:], self._skip)

    def _resync(self) -> str:
        """DecodeStream refuses when a token rewrites text already streamed (ByteFallback
        decoders turn a whole invalid byte run into U+FFFD): emit the held ids' text as they
        decode, then restart the stream from the recent ids."""
        piece = self._held_text()
        self._stream = DecodeStream(ids=self._ids[-_CONTEXT_TOKENS:],
                                    skip_special_tokens=self._skip)
        return piece


def streamed_text(tokenizer: Tokenizer, token_ids: list[int], skip_special_tokens: bool) -> str:
    """What an IncrementalDetokenizer's `add` returns for `token_ids`, joined, on a byte-level
    decoder: their decoded text, less a character they leave unfinished at the end (its bytes,
    and any token ending with them, are never streamed). Decoded once unless the text ends in
    U+FFFD; a byte-level decoder's text is the same after whole characters whatever came before,
    so no prompt is needed."""
    text = tokenizer.decode(token_ids, skip_special_tokens)
    if not text.endswith(_REPLACEMENT):
        return text
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens)
    return "".join(map(detok.add, token_ids))
