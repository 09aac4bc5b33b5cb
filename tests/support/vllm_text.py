"""A model of the text vLLM v1 streams for one request (vllm/v1/engine/detokenizer.py, read at
the version that primes tokenizers' DecodeStream by stepping a prompt suffix), written here from
its rules so that tests can hold the OutputProcessor's per-step text against it:

- each new id goes through one DecodeStream step; a step that leaves the text ending inside a
  character (U+FFFD) or adds nothing gives no text, and nothing is ever flushed: the bytes of
  an unfinished character at the end are never sent;
- a finish on a stop token (eos, stop_token_ids) leaves that token's text out unless
  include_stop_str_in_output;
- stop strings are looked for once per update, in the text of the update's tokens after the
  first min_tokens (a match may begin earlier): the first listed string found wins, at its
  first place; the text is cut before it, or after it with include_stop_str_in_output;
- while unfinished, DELTA output holds back the last (longest stop - 1) characters, only when
  stop strings are cut (include_stop_str_in_output=False); a finished request sends the rest.
"""
from __future__ import annotations

from tokenizers.decoders import DecodeStream

_REPLACEMENT = "\ufffd"


class VllmTextModel:
    """One request's text as vLLM v1 builds it (`update` per engine output, then `delta`)."""

    def __init__(self, tok, prompt_ids: list[int], stop: list[str], include: bool,
                 min_tokens: int = 0, skip_special_tokens: bool = True):
        self.backend = tok.backend
        self.stop, self.include, self.min_tokens = list(stop), include, min_tokens
        self.buffer = max(map(len, stop)) - 1 if stop and not include else 0
        self.text, self.sent, self.num_tokens = "", 0, 0
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        for tid in self._safe_prompt_suffix(prompt_ids):
            self.stream.step(self.backend, tid)

    def _safe_prompt_suffix(self, prompt: list[int]) -> list[int]:
        """The shortest suffix of 4 to 23 ids that decodes without U+FFFD; else the prompt."""
        if len(prompt) > 4:
            for n in range(4, min(len(prompt) + 1, 24)):
                if _REPLACEMENT not in self.backend.decode(prompt[-n:]):
                    return prompt[-n:]
        return prompt

    def update(self, ids: list[int], stop_terminated: bool) -> str | None:
        """Text for `ids` (one engine output); the stop string it matched, if any."""
        if not ids:
            return None
        decoded = ids[:-1] if stop_terminated and not self.include else ids
        check_from = len(self.text)
        for k, tid in enumerate(decoded):
            self.text += self.stream.step(self.backend, tid) or ""
            if self.min_tokens and self.num_tokens + k + 1 <= self.min_tokens:
                check_from = len(self.text)
        self.num_tokens += len(ids)
        if not self.stop or self.num_tokens <= self.min_tokens:
            return None
        new_chars = len(self.text) - check_from
        if not new_chars:
            return None
        for s in self.stop:
            at = self.text.find(s, max(0, len(self.text) + 1 - new_chars - len(s)))
            if at >= 0:
                self.text = self.text[:at + len(s) if self.include else at]
                return s
        return None

    def delta(self, finished: bool) -> str:
        """The DELTA text of this output: new since the last, less the held-back tail."""
        end = len(self.text) - (0 if finished else self.buffer)
        if end <= self.sent:
            return ""
        piece, self.sent = self.text[self.sent:end], end
        return piece
