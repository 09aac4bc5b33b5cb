"""`serve --config FILE`: vLLM's YAML file of flags (`vllm serve --config config.yaml`).

Each key is a flag's long name without the dashes (`max-model-len`, or vLLM's `max_model_len`),
each value what the flag takes: `true` sets a switch (`false` turns it off: `--no-NAME` where the
flag has that form, else nothing), a list gives a flag of several values (`served-model-name:
[a, b]`) each item, a mapping is passed as JSON (`speculative-config: {method: ngram, ...}`).
As in vLLM, the command line wins over the file (a flag given on both: the command line's
value alone; `serve MODEL` over the file's `model`), and the file over the defaults. The file
becomes flags before anything is parsed, so each value is checked as the same flag on the
command line would be, and a key that names no flag of `serve` is refused naming the file.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json

from deltaserve.vllm_flags import near_miss

CONFIG_FLAG = "--config"


def expand_config_file(argv: list[str], serve: argparse.ArgumentParser) -> list[str]:
    """`argv` (after the subcommand) with `--config FILE` replaced by the file's flags, those
    the command line also gives left out. ValueError naming the file for a file we cannot use."""
    path, rest = _take_config(argv)
    if path is None:
        return argv
    given = _given_flags(rest, serve)
    out: list[str] = []
    for key, value in _load(path).items():
        action = _action(serve, path, key)
        if given & set(action.option_strings):
            continue                                   # the command line's value wins
        if action.dest == "model" and _has_positional(rest, serve):
            continue                                   # serve MODEL over the file's model
        out.extend(_flags(path, key, value, action, serve))
    return out + rest


def _take_config(argv: list[str]) -> tuple[str | None, list[str]]:
    """The --config FILE of argv (one at most) and argv without it."""
    path, rest, i = None, [], 0
    while i < len(argv):
        name, eq, value = argv[i].partition("=")
        if name != CONFIG_FLAG:
            rest.append(argv[i])
            i += 1
            continue
        if not eq:
            if i + 1 >= len(argv):
                raise ValueError(f"{CONFIG_FLAG} needs a FILE (vLLM's YAML file of flags)")
            i += 1
            value = argv[i]
        if path is not None:
            raise ValueError(f"{CONFIG_FLAG}={value!r} is invalid: must be given once "
                             f"({path!r} given already)")
        path = value
        i += 1
    return path, rest


def _load(path: str) -> dict:
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ValueError(f"{CONFIG_FLAG}={path!r} is invalid: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        line = f" (line {where.line + 1})" if where is not None else ""
        raise ValueError(f"{CONFIG_FLAG}={path!r} is invalid: not YAML{line}: "
                         f"{getattr(e, 'problem', None) or e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{CONFIG_FLAG}={path!r} is invalid: must be a YAML mapping of flag "
                         f"names to values (it holds a {type(data).__name__})")
    return data


def _action(serve: argparse.ArgumentParser, path: str, key) -> argparse.Action:
    flag = "--" + str(key).lstrip("-").replace("_", "-")
    if flag == CONFIG_FLAG:
        raise ValueError(f"{CONFIG_FLAG}={path!r} is invalid: key {key!r}: a config file "
                         "cannot name another")
    for action in serve._actions:
        if flag in action.option_strings:
            return action
    if flag == "--model-tag":
        return _action(serve, path, "model")
    raise ValueError(f"{CONFIG_FLAG}={path!r} is invalid: key {key!r} is not a flag of "
                     f"`deltaserve serve`{near_miss([flag], serve)}")


def _flags(path: str, key, value, action: argparse.Action,
           serve: argparse.ArgumentParser) -> list[str]:
    flag = next(o for o in action.option_strings if o.startswith("--"))
    takes_value = action.nargs != 0
    if isinstance(value, bool) and not takes_value:
        if value:
            return [flag]
        negated = "--no-" + flag[2:]
        known = {o for a in serve._actions for o in a.option_strings}
        return [negated] if negated in known else []
    if not takes_value:
        raise ValueError(f"{CONFIG_FLAG}={path!r} is invalid: {key}: {value!r} must be true or "
                         f"false ({flag} is a switch)")
    if value is None:
        raise ValueError(f"{CONFIG_FLAG}={path!r} is invalid: {key} has no value")
    if isinstance(value, list):
        if action.nargs not in ("+", "*") and not isinstance(action, argparse._AppendAction):
            raise ValueError(f"{CONFIG_FLAG}={path!r} is invalid: {key}: a list, but {flag} "
                             "takes one value")
        items = [_text(v) for v in value]
        if isinstance(action, argparse._AppendAction):
            return [part for item in items for part in (flag, item)]
        return [flag, *items] if items else []
    return [f"{flag}={_text(value)}"]


def _text(value) -> str:
    """A YAML value as the command line would spell it: mappings as JSON, booleans as vLLM's
    JSON flags read them."""
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _given_flags(argv: list[str], serve: argparse.ArgumentParser) -> set[str]:
    """The option strings the command line uses (`--a_b` read as `--a-b`, as vLLM's parser)."""
    known = {o for a in serve._actions for o in a.option_strings}
    given = set()
    for arg in argv:
        if arg.startswith("-"):
            name = arg.partition("=")[0]
            name = name.replace("_", "-") if name.startswith("--") else name
            given.add(name)
            # an action's other spellings count as given too (-q and --quantization)
            for action in serve._actions:
                if name in action.option_strings:
                    given.update(action.option_strings)
    return given & known


def _has_positional(argv: list[str], serve: argparse.ArgumentParser) -> bool:
    """Whether the command line names `serve MODEL` positionally: parsed with the flags it has,
    the positional is set."""
    with contextlib.redirect_stderr(io.StringIO()):   # a bad flag: its own error comes later
        try:
            args, _ = serve.parse_known_args(argv)
        except SystemExit:
            return False
    return getattr(args, "model_tag", None) is not None
