"""vLLM's list-valued serve flags, carried to the smg gateway (smg 1.13.0, checked on loopback):

  * --served-model-name NAME [ALIAS ...]: the first name is the model's (GetModelInfo, the
    metrics, the `model` of every answer, as vLLM reports the first); each further one is
    smg's `--model-alias ALIAS=NAME`, so a request naming it is served. smg's /v1/models lists
    only the first (vLLM lists them all).
  * --api-key KEY [KEY ...]: the first is smg's --api-key, each further one a
    `--tenant-api-key key-N:KEY` (smg admits every one; stored /v1/responses records are then
    readable only with the key that made them).

Neither has a meaning without the gateway: aliases with the OpenAI API off are refused (they
would be dropped), as is a name smg's `ALIAS=NAME` cannot carry.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from deltaserve.hub_cache import cached_snapshot, is_hub_id
from engine_common.request.params import ParamError


class ServedNames(argparse.Action):
    """--served-model-name NAME [ALIAS ...]: `served_model_name` the first, `model_aliases`
    the others (a repeat of a name once; each is still served)."""

    def __call__(self, parser, namespace, values, option_string=None):
        names = list(dict.fromkeys(values))
        namespace.served_model_name = names[0]
        namespace.model_aliases = tuple(names[1:])


def add_list_flags(group) -> None:
    """--served-model-name and --api-key, each taking one value or several (vLLM's)."""
    group.add_argument("--served-model-name", nargs="+", action=ServedNames,
                       default=argparse.SUPPRESS, metavar="NAME",
                       help="the model's name in both APIs (/v1/models, GetModelInfo) and the "
                       "metrics; further names are aliases the OpenAI API serves too, answers "
                       "naming the first (default: the model directory's name)")
    group.add_argument("--api-key", nargs="+", dest="api_key", default=argparse.SUPPRESS,
                       metavar="KEY",
                       help="the keys OpenAI clients may send as `Authorization: Bearer KEY`, "
                       "any one of them (the gRPC port's keys are --api-key-file) (default: "
                       "unset)")


def given_keys(args, environ=None) -> list[str]:
    """The --api-key values, else VLLM_API_KEY's (as vLLM: the flag wins; an empty variable is
    no key), so a vLLM line guarded by the variable is not served open."""
    keys = getattr(args, "api_key", None)
    if keys:
        return list(keys)
    env = (os.environ if environ is None else environ).get("VLLM_API_KEY")
    if env and not env.strip():
        raise ParamError("VLLM_API_KEY", env, "a key with a character other than whitespace")
    return [env] if env else []


def checked_keys(keys) -> tuple[str, ...]:
    """The --api-key values; one that is empty or blank is refused (smg trims a key, then
    refuses an empty one)."""
    for key in keys or ():
        if not key.strip():
            raise ParamError("--api-key", key, "a key with a character other than whitespace")
    return tuple(dict.fromkeys(keys or ()))


def checked_aliases(name: str | None, aliases: tuple[str, ...]) -> tuple[str, ...]:
    """The aliases, refused where smg's `--model-alias ALIAS=NAME` cannot carry one."""
    for alias in (name or "", *aliases) if aliases else ():
        if not alias.strip():
            raise ParamError("--served-model-name", alias, "a name with a character other "
                             "than whitespace")
    for alias in aliases:
        if "=" in alias:
            raise ParamError("--served-model-name", alias, "an alias without '=' (the "
                             "gateway takes aliases as ALIAS=NAME)")
    return aliases


def check_adapter_names(name: str | None, aliases: tuple[str, ...],
                        lora_engine_listen: str | None) -> None:
    """ParamError when the model's served name or an alias is an adapter's name in
    --lora-engine-listen: the gateway would route that name to the model and the adapter's
    port alike (two workers registering one name: one model, load-balanced), so some answers
    would come from the wrong one."""
    adapters = [entry.partition("=")[0] for entry in (lora_engine_listen or "").split()]
    for served in (name, *aliases):
        if served is not None and served in adapters:
            raise ParamError("--served-model-name", served, "a name no --lora-engine-listen "
                             f"adapter has (adapters: {', '.join(adapters)})")


# smg's flags and their values as one `--flag=value` word each: smg's argparse takes a
# separate value starting with '-' (a key from secrets.token_urlsafe, 1 in 64) for a flag.


def smg_alias_flags(name: str | None, aliases: tuple[str, ...]) -> list[str]:
    """smg's flags serving `aliases` as the model `name`."""
    return [f"--model-alias={alias}={name}" for alias in aliases]


def smg_key_flags(keys: tuple[str, ...]) -> list[str]:
    """smg's flags admitting each of `keys`: the first as --api-key, the others as tenants."""
    if not keys:
        return []
    extra = [f"--tenant-api-key=key-{i}:{key}" for i, key in enumerate(keys[1:], start=2)]
    return [f"--api-key={keys[0]}", *extra]


def swallowed_model(args) -> str | None:
    """Why `serve --api-key K MODEL` (or --served-model-name N MODEL) is refused: argparse
    gave MODEL to the list, as vLLM's does, and serve would start the default model with
    MODEL as a key or a name. None when a model was given or no list value is a path."""
    if getattr(args, "model", None) or getattr(args, "model_tag", None):
        return None
    lists = (("--api-key", list(getattr(args, "api_key", None) or ())),
             ("--served-model-name", [getattr(args, "served_model_name", None) or "",
                                      *getattr(args, "model_aliases", ())]))
    for flag, values in lists:
        path = next((v for v in values if _model_like(flag, v)), None)
        if path is not None:
            return (f"MODEL={path!r} is invalid: it was read as a value of {flag}, which takes "
                    "several; give MODEL before it (serve MODEL ...)")
    return None


def _model_like(flag: str, value: str) -> bool:
    """Whether a list value is surely a MODEL: a path that exists, a Hub id in the local cache,
    or, as a served name (vLLM refuses names without MODEL), any Hub id (org/name)."""
    if not value:
        return False
    if Path(value).expanduser().exists():
        return True
    if not is_hub_id(value):
        return False
    return flag == "--served-model-name" or cached_snapshot(value) is not None
