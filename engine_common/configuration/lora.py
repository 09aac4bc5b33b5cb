"""LoRA adapter flags (vLLM's --enable-lora, --lora-modules, --max-loras, --max-lora-rank),
parsed torch-free: the scheduler maps an adapter name to its id, the workers load the files.

An adapter's id is its 1-based place in --lora-modules (0: the base model, no adapter), the same
on the scheduler and on every worker rank; runtime loads take free ids after them
(scheduler_service/core/lora_registry.py maps names to ids).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from engine_common.request.params import ParamError


# The most adapter ids (slots) a server holds at once: a worker sizes each adapted projection's
# stacks by the largest id it holds, so an id from a Worker call is bounded by it.
MAX_LORA_ID = 1024


class AdapterNotFound(ParamError):
    """A request or an unload names an adapter the server does not serve (now): NOT_FOUND over
    gRPC, as vLLM's 404."""


class AdapterExists(ParamError):
    """A load names an adapter the server serves already: ALREADY_EXISTS (vLLM: 400)."""


class AdapterRefused(ValueError):
    """A worker refused a LoRA directory at a runtime load (missing files, rank above
    --max-lora-rank, an unsupported target, shapes of another model): INVALID_ARGUMENT; the
    message names the path and the reason."""


@dataclass(frozen=True)
class LoRAModule:
    """One adapter of --lora-modules: the name requests use, its PEFT directory."""

    name: str
    path: str
    base_model_name: str | None = None


def _one_module(text: str) -> LoRAModule:
    text = text.strip()
    if text.startswith("{"):           # vLLM's JSON form
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise ParamError("lora_modules", text, f"name=path or JSON ({e})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) \
                or not isinstance(obj.get("path"), str):
            raise ParamError("lora_modules", text,
                             'JSON with string "name" and "path" (and "base_model_name")')
        return LoRAModule(obj["name"], obj["path"], obj.get("base_model_name"))
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ParamError("lora_modules", text, "name=path or vLLM's JSON form")
    return LoRAModule(name, path)


def parse_lora_modules(value) -> tuple[LoRAModule, ...]:
    """--lora-modules as given: None, a string of whitespace-separated entries, or a list of
    entries (each 'name=path', a JSON object, or a LoRAModule). Names must be unique."""
    if value is None or value == "":
        return ()
    if isinstance(value, str):
        value = [value] if value.strip().startswith("{") else value.split()
    modules = tuple(v if isinstance(v, LoRAModule) else _one_module(v) for v in value)
    names = [m.name for m in modules]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ParamError("lora_modules", dup, "unique adapter names")
    return modules


def adapter_name(value) -> str | None:
    """A request's adapter as its name: None, a name, or vLLM's LoRARequest (lora_name)."""
    if value is None or isinstance(value, str):
        return value or None
    name = getattr(value, "lora_name", None)
    if isinstance(name, str):
        return name
    raise ParamError("lora_request", value, "None, an adapter name or a LoRARequest")
