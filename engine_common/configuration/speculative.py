"""vLLM's `--speculative-config` JSON, parsed and validated (docs/speculative-decoding.md).

    {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": N,
     "prompt_lookup_min": M, "disable_by_batch_size": B}

Only the n-gram (prompt lookup) method exists. As vLLM: one of prompt_lookup_max / _min
given alone sets the other to it, neither given sets both to 5. disable_by_batch_size (optional,
>= 2 as in vLLM): a step that runs more requests than B drafts nothing, since with a batch a
step stops being bound by reading the weights and drafts cost what they save. Every error names the key, its
value and the allowed range (ParamError).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from engine_common.request.params import ParamError

METHODS = ("ngram",)
MAX_SPECULATIVE_TOKENS = 16       # drafts per request and step
MAX_LOOKUP = 64                   # longest n-gram a proposer looks for
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
         "disable_by_batch_size")
MAX_BATCH = 2**31 - 1
_FLAG = "speculative_config"


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int
    disable_by_batch_size: int | None = None     # None: draft at any batch size


def _int(key: str, value, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ParamError(f"{_FLAG}.{key}", value, f"an integer in [{lo}, {hi}]")
    return value


def parse_speculative_config(value: str | dict | None) -> SpeculativeConfig | None:
    """The config of a JSON text or a dict (the offline LLM's argument); None: off."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ParamError(_FLAG, value, f"a JSON object ({e})") from None
    if not isinstance(value, dict):
        raise ParamError(_FLAG, value, "a JSON object")
    unknown = sorted(set(value) - set(_KEYS))
    if unknown:
        raise ParamError(f"{_FLAG}.{unknown[0]}", value[unknown[0]],
                         "absent: the keys are " + ", ".join(_KEYS))
    method = value.get("method")
    if method not in METHODS:
        raise ParamError(f"{_FLAG}.method", method, "one of " + ", ".join(METHODS))
    if "num_speculative_tokens" not in value:
        raise ParamError(f"{_FLAG}.num_speculative_tokens", None,
                         f"an integer in [1, {MAX_SPECULATIVE_TOKENS}]")
    k = _int("num_speculative_tokens", value["num_speculative_tokens"], 1,
             MAX_SPECULATIVE_TOKENS)
    lo = value.get("prompt_lookup_min")
    hi = value.get("prompt_lookup_max")
    if lo is None and hi is None:
        lo = hi = 5
    elif lo is None:
        lo = _int("prompt_lookup_max", hi, 1, MAX_LOOKUP)
    elif hi is None:
        hi = _int("prompt_lookup_min", lo, 1, MAX_LOOKUP)
    lo = _int("prompt_lookup_min", lo, 1, MAX_LOOKUP)
    hi = _int("prompt_lookup_max", hi, lo, MAX_LOOKUP)
    batch = value.get("disable_by_batch_size")
    if batch is not None:
        batch = _int("disable_by_batch_size", batch, 2, MAX_BATCH)
    return SpeculativeConfig(method, k, hi, lo, batch)


def to_json(value: str | dict | None) -> str | None:
    """The flag's text form of a dict or text (LLM's speculative_config=)."""
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True)
