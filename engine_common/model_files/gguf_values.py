"""Numbers read from a GGUF file's metadata with their type and range checked, so a file whose
`<arch>.block_count` is a string or whose rms epsilon is negative is refused naming the key, the
value and what it must be, instead of failing later inside the model (or serving it wrong).
Torch-free."""
from __future__ import annotations

import math

from engine_common.model_files.gguf_file import GGUFError, GGUFFile

MISSING = object()      # no default: the key is required


def _lookup(gguf: GGUFFile, key: str, default):
    if key in gguf.metadata:
        return gguf.metadata[key], True
    if default is MISSING:
        gguf.require(key)                    # the GGUFError naming the missing key
    return default, False


def _invalid(gguf: GGUFFile, key: str, value, must: str) -> GGUFError:
    return GGUFError(f"{gguf.path}: metadata {key}={value!r} is invalid: must be {must}")


def metadata_int(gguf: GGUFFile, key: str, default=MISSING, minimum: int = 0) -> int:
    """An integer >= `minimum`; `default` (returned as it is) when the key is absent."""
    value, present = _lookup(gguf, key, default)
    if not present:
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _invalid(gguf, key, value, f"an integer >= {minimum}")
    return value


def metadata_float(gguf: GGUFFile, key: str, default=MISSING, positive: bool = True) -> float:
    """A finite number (> 0 when `positive`) as a float; `default` when the key is absent."""
    value, present = _lookup(gguf, key, default)
    if not present:
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or (positive and value <= 0):
        raise _invalid(gguf, key, value, "a finite number > 0" if positive else
                       "a finite number")
    return float(value)


def metadata_str(gguf: GGUFFile, key: str, default=MISSING) -> str:
    """A string; `default` when the key is absent."""
    value, present = _lookup(gguf, key, default)
    if present and not isinstance(value, str):
        raise _invalid(gguf, key, value, "a string")
    return value


def metadata_bool(gguf: GGUFFile, key: str, default=MISSING) -> bool:
    """A bool (GGUF's BOOL type, not a number or a string); `default` when absent."""
    value, present = _lookup(gguf, key, default)
    if present and not isinstance(value, bool):
        raise _invalid(gguf, key, value, "a bool")
    return value


_KIND_NAMES = {str: ("strings", "a string"), int: ("integers", "an integer"),
               float: ("numbers", "a number")}


def metadata_list(gguf: GGUFFile, key: str, kind: type, default=MISSING,
                  length: int | None = None) -> list:
    """A non-empty array of `kind` (str, int, or float: numbers), `length` long when given;
    the error names the first bad element. `default` when the key is absent."""
    value, present = _lookup(gguf, key, default)
    if not present:
        return value
    plural, singular = _KIND_NAMES[kind]
    must = f"a non-empty array of {plural}" + (
        f" ({length}: one per token)" if length is not None else "")
    if not isinstance(value, list) or not value or (length is not None and len(value) != length):
        got = f"an array of {len(value)}" if isinstance(value, list) else \
            f"a {type(value).__name__}"
        raise GGUFError(f"{gguf.path}: metadata {key} ({got}) is invalid: must be {must}")
    allowed = (int, float) if kind is float else kind
    for i, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, allowed):
            raise _invalid(gguf, f"{key}[{i}]", item, f"{singular} ({key} is {must})")
    return value
