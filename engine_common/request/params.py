"""Sampling and stopping parameters, validated once where they enter the system.

Both sides share these: the scheduler validates what clients send, the worker receives the
sampling part on the wire (engine_common/wire/sampling_wire.py: the public API's SamplingParams
message) and applies it in its sampler.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine_common.request.sampling_knobs import (LOGIT_BIAS_RANGE, MAX_LOGIT_BIAS, DeclaredKnob,
                                          knob, knobs_of)


# An error message quotes at most this many characters of a value (issue 23: a 70 KB garbage
# field quoted whole broke gRPC's status metadata limit).
MAX_QUOTED_CHARS = 200


def clip(text: str, limit: int = MAX_QUOTED_CHARS) -> str:
    """`text`, or its first `limit` characters and how long it was."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


def quoted(value) -> str:
    """repr(value) for an error message, clipped."""
    return clip(repr(value))


class ParamError(ValueError):
    """A bad parameter value. Carries the field, the value and the allowed range."""

    def __init__(self, field_name: str, value, allowed: str):
        self.field = field_name
        self.value = value
        self.allowed = allowed
        super().__init__(f"{clip(field_name)}={quoted(value)} is invalid: must be {allowed}")


def _check_range(name: str, value, lo=None, hi=None, lo_open=False, hi_open=False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ParamError(name, value, "a number")
    lo_bad = lo is not None and (value <= lo if lo_open else value < lo)
    hi_bad = hi is not None and (value >= hi if hi_open else value > hi)
    if lo_bad or hi_bad:
        left = "(" if lo_open else "["
        right = ")" if hi_open else "]"
        lo_s = "-inf" if lo is None else lo
        hi_s = "inf" if hi is None else hi
        raise ParamError(name, value, f"in {left}{lo_s}, {hi_s}{right}")


def _check_int(name: str, value, lo=None, hi=None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ParamError(name, value, "an integer")
    _check_range(name, value, lo, hi)


# A temperature below this is greedy (vLLM's _SAMPLING_EPS).
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token. temperature 0 (or below GREEDY_BELOW) means greedy.

    top_k 0 (or -1) disables top-k; top_p 1 and min_p 0 disable theirs. Penalties of 1 (repetition)
    and 0 (presence, frequency) are off. `seed` None lets the scheduler draw one, so every rank of a
    tensor-parallel worker still samples from the same stream. `logit_bias`: (token id, bias)
    pairs, ids ascending and distinct, each bias in [-100, 100] added to that token's logit
    before everything else (OpenAI's logit_bias); the vocabulary bound is checked at the edge.
    """

    # Each knob declared once (engine_common/request/sampling_knobs.py says what follows from it).
    temperature: float = knob(0.0, "default: 0 (greedy)", lo=0.0, hi=100.0,
                              always_staged=True, generation_config=True)
    top_p: float = knob(1.0, "default: the server's (1)", lo=0.0, hi=1.0, lo_open=True,
                        generation_config=True)
    top_k: int = knob(0, "default: the server's (0: off)", lo=-1, hi=2**31 - 1, integer=True,
                      column="int32",
                      generation_config=True, to_column=lambda k: max(k, 0))
    min_p: float = knob(0.0, "default: the server's (0: off)", lo=0.0, hi=1.0,
                        generation_config=True)
    repetition_penalty: float = knob(1.0, lo=0.0, hi=100.0, lo_open=True, needs_history=True,
                                     generation_config=True)
    presence_penalty: float = knob(0.0, lo=-2.0, hi=2.0, needs_history=True)
    frequency_penalty: float = knob(0.0, lo=-2.0, hi=2.0, needs_history=True)
    seed: int | None = knob(None, "default: the server draws one", lo=0, hi=2**63 - 1,
                            integer=True, column=None)
    logit_bias: tuple[tuple[int, float], ...] = ()
    # vLLM's allowed_token_ids: only these ids may be sampled (every other logit -inf); () = all.
    allowed_token_ids: tuple[int, ...] = knob((), column=None, ids=True, max_ids=1024)

    def __post_init__(self):
        object.__setattr__(self, "logit_bias", _checked_logit_bias(self.logit_bias))
        for k in KNOBS:
            object.__setattr__(self, k.name, _checked_knob(k, getattr(self, k.name)))
        if self.temperature < GREEDY_BELOW:
            # vLLM samples such a row greedily; dividing by it overflowed float32 (1e-45 made
            # every positive logit inf, and the first of them won).
            object.__setattr__(self, "temperature", 0.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """Whether a knob that needs the prompt and output ids (a penalty) is on."""
        return any(getattr(self, k.name) != k.neutral for k in HISTORY_KNOBS)


KNOBS: tuple[DeclaredKnob, ...] = knobs_of(SamplingParams)
# The knobs with a batch column, and those that are sets of token ids (ragged per row).
COLUMN_KNOBS = tuple(k for k in KNOBS if k.meta.column and not k.meta.ids)
ID_SET_KNOBS = tuple(k for k in KNOBS if k.meta.ids)
HISTORY_KNOBS = tuple(k for k in KNOBS if k.meta.needs_history)


def _checked_knob(k: DeclaredKnob, value):
    """`value` of knob `k` once in its range (a set of ids as an ascending tuple)."""
    m = k.meta
    if m.ids:
        return _checked_ids(k.name, value, m.max_ids)
    if value is None and k.neutral is None:
        return value
    check = _check_int if m.integer else _check_range
    bounds = dict(lo_open=m.lo_open, hi_open=m.hi_open) if not m.integer else {}
    check(k.name, value, m.lo, m.hi, **bounds)
    return value


def _checked_ids(name: str, ids, max_ids: int) -> tuple[int, ...]:
    """A set of token ids as an ascending tuple of distinct ints (at most `max_ids`)."""
    ids = tuple(sorted(ids))
    if len(ids) > max_ids:
        raise ParamError(name, f"{len(ids)} ids", f"at most {max_ids} ids")
    for i, token_id in enumerate(ids):
        _check_int(f"{name}[{i}]", token_id, 0, 2**31 - 1)
        if i and ids[i - 1] == token_id:
            raise ParamError(name, token_id, "distinct token ids")
    return ids


def _checked_logit_bias(pairs) -> tuple[tuple[int, float], ...]:
    """Pairs (a dict, or (id, bias) pairs from the wire) as sorted (int, float) tuples."""
    items = sorted(pairs.items()) if isinstance(pairs, dict) else sorted(tuple(p) for p in pairs)
    if len(items) > MAX_LOGIT_BIAS:
        raise ParamError("logit_bias", f"{len(items)} entries", f"at most {MAX_LOGIT_BIAS}")
    out = []
    for token_id, bias in items:
        _check_int(f"logit_bias[{token_id!r}] (token id)", token_id, 0, 2**31 - 1)
        _check_range(f"logit_bias[{token_id}]", bias, -LOGIT_BIAS_RANGE, LOGIT_BIAS_RANGE)
        if out and out[-1][0] == token_id:
            raise ParamError("logit_bias", token_id, "distinct token ids")
        out.append((token_id, float(bias)))
    return tuple(out)


@dataclass(frozen=True)
class StoppingParams:
    """When to stop. max_tokens None means "until max_model_len"."""

    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    # The text (and so stop-string matching) leaves out special tokens (eos, chat markers), as
    # vLLM's SamplingParams.skip_special_tokens; False keeps their text.
    skip_special_tokens: bool = True

    def __post_init__(self):
        # Accept lists from callers but keep the dataclass hashable and immutable. One stop
        # string alone is a list of one, as in vLLM (tuple("END") stopped on "E", "N" and "D").
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        object.__setattr__(self, "stop", _as_tuple("stop", stop, "strings"))
        object.__setattr__(self, "stop_token_ids",
                           _as_tuple("stop_token_ids", self.stop_token_ids, "token ids"))
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1, None)
        _check_int("min_tokens", self.min_tokens, 0, None)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ParamError("min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ParamError("stop", s, "a non-empty string")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, 0, 2**32 - 1)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):   # "false" would read as true
                raise ParamError(name, getattr(self, name), "true or false")


def _as_tuple(name: str, values, what: str) -> tuple:
    """A list field as a tuple; None is none (vLLM's default for stop and stop_token_ids)."""
    if values is None:
        return ()
    try:
        return tuple(values)
    except TypeError:
        raise ParamError(name, values, f"a list of {what}") from None


@dataclass(frozen=True)
class WorkerSamplingParams:
    """What a worker needs to sample one request: the sampling params plus the stop ids to mask
    while fewer than `min_tokens` tokens have been produced, and a concrete seed."""

    sampling: SamplingParams
    seed: int
    min_tokens: int = 0
    stop_ids: tuple[int, ...] = field(default_factory=tuple)
