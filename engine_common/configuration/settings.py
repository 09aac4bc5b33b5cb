"""Settings declared once: a config field carries its default, help, rule, flag and wire number.

    max_num_seqs: int = setting(256, "requests in the running batch", rule=AtLeast(1), wire=3)

From that one declaration come: the validation (`validate`, called by the config's
__post_init__), the command-line flag (`add_flags` / `from_args`: --max-num-seqs, its type, help
and default), the protobuf field of a config that travels on the wire (`proto_message` writes
the message text that `make proto` puts into worker.proto; `to_proto` / `from_proto` copy values)
and the msgpack form for the rank ring (`to_wire` / `from_wire`). Adding a setting is one field
plus its use.

NOTE the rules of a declaration:
- A field whose type admits None is skipped by its rule when None ("unset: a default elsewhere").
- A bool flag is `--name` (store true) when the default is False; a True default needs an
  explicit `flag="--no-..."`, which stores False.
- `parse` converts the flag's text (e.g. GiB -> bytes); the help then describes the flag's unit.
- `cli=False` keeps a field off the command line (set by code: the model directory, the device).
- `aliases` are more flags for the same field: vLLM's names where the meaning is the same
  (--tensor-parallel-size for --local-ranks).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import textwrap
import typing
from dataclasses import MISSING, dataclass
from typing import Any, Callable

from engine_common.request.params import ParamError

_META = "deltaserve_setting"


@dataclass(frozen=True)
class Setting:
    """The metadata of one declared field (see the module docstring)."""

    help: str
    rule: Rule | None = None
    flag: str | None = None          # default: "--" + name with "-" for "_"
    cli: bool = True
    wire: int | None = None          # protobuf field number, for configs sent in messages
    parse: Callable[[str], Any] | None = None
    metavar: str | None = None
    aliases: tuple[str, ...] = ()    # more flags for the same field (vLLM's names)


def setting(default, help: str, *, rule: Rule | None = None, flag: str | None = None,
            cli: bool = True, wire: int | None = None, parse: Callable[[str], Any] | None = None,
            metavar: str | None = None, aliases: tuple[str, ...] = ()):
    """A dataclass field with its Setting."""
    meta = Setting(help, rule, flag, cli, wire, parse, metavar, aliases)
    return dataclasses.field(default=default, metadata={_META: meta})


# -- rules --------------------------------------------------------------------------------------

class Rule:
    """A check of one value; `allowed` is the "must be ..." text of its ParamError."""

    allowed = "valid"

    def ok(self, value) -> bool:
        raise NotImplementedError

    def check(self, name: str, value) -> None:
        if not self.ok(value):
            raise ParamError(name, value, self.allowed)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return (_is_int(value) or isinstance(value, float)) and not math.isnan(value)


@dataclass(frozen=True)
class AtLeast(Rule):
    """An integer >= lo (and <= hi when given)."""

    lo: int
    hi: int | None = None

    @property
    def allowed(self) -> str:
        return f"an integer in [{self.lo}, {'inf' if self.hi is None else self.hi}]"

    def ok(self, value) -> bool:
        return _is_int(value) and value >= self.lo and (self.hi is None or value <= self.hi)


@dataclass(frozen=True)
class PowerOfTwo(Rule):
    hi: int

    @property
    def allowed(self) -> str:
        return f"a power of two in [1, {self.hi}]"

    def ok(self, value) -> bool:
        return _is_int(value) and 1 <= value <= self.hi and not value & (value - 1)


@dataclass(frozen=True)
class Positive(Rule):
    """A number > 0 (and <= hi when given)."""

    hi: float | None = None

    @property
    def allowed(self) -> str:
        return "a number > 0" if self.hi is None else f"in (0, {self.hi}]"

    def ok(self, value) -> bool:
        return _is_number(value) and value > 0 and (self.hi is None or value <= self.hi)


class AtLeastZero(Rule):
    allowed = "a number >= 0"

    def ok(self, value) -> bool:
        return _is_number(value) and value >= 0


@dataclass(frozen=True)
class OneOf(Rule):
    choices: tuple

    @property
    def allowed(self) -> str:
        return "one of " + ", ".join(map(str, self.choices))

    def ok(self, value) -> bool:
        return value in self.choices


class NonEmpty(Rule):
    allowed = "a non-empty string"

    def ok(self, value) -> bool:
        return isinstance(value, str) and bool(value)


class IsBool(Rule):
    allowed = "a bool"

    def ok(self, value) -> bool:
        return isinstance(value, bool)


class ReadableFile(Rule):
    """A path to a file this process can read ("-", standard input, when `stdin` is set)."""

    def __init__(self, stdin: bool = False):
        self.stdin = stdin
        self.allowed = "a readable file" + (" or - (standard input)" if stdin else "")

    def ok(self, value) -> bool:
        if self.stdin and value == "-":
            return True
        return isinstance(value, str) and os.path.isfile(value) and os.access(value, os.R_OK)


# -- reading declarations -----------------------------------------------------------------------

@dataclass(frozen=True)
class Declared:
    """One field of a config class with its Setting and resolved type."""

    name: str
    type: type                      # int, float, str or bool
    optional: bool                  # None is allowed
    default: Any
    setting: Setting

    @property
    def flag(self) -> str:
        return self.setting.flag or "--" + self.name.replace("_", "-")


def declared(cls) -> list[Declared]:
    """The declared fields of a config class, in declaration order."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        meta = f.metadata.get(_META)
        if meta is None:
            continue
        args = typing.get_args(hints[f.name]) or (hints[f.name],)
        base = next(a for a in args if a is not type(None))
        out.append(Declared(f.name, base, type(None) in args, f.default, meta))
    return out


def validate(config) -> None:
    """Run every declared field's rule (and the bool rule on bools); ParamError on the first
    violation. Called by each config's __post_init__."""
    for d in declared(type(config)):
        value = getattr(config, d.name)
        if value is None and d.optional:
            continue
        rule = d.setting.rule or (IsBool() if d.type is bool else None)
        if rule is not None:
            rule.check(d.name, value)


# -- command line -------------------------------------------------------------------------------

def add_flags(parser, *classes, skip: tuple[str, ...] = ()) -> None:
    """Add each declared field with cli=True of `classes` as a flag (a field shared by several
    classes through a common base appears once). Unset flags leave the dataclass default."""
    seen = set(skip)
    for cls in classes:
        for d in declared(cls):
            if d.setting.cli and d.name not in seen:
                seen.add(d.name)
                _add_flag(parser, d)


def _add_flag(parser, d: Declared) -> None:
    help_text = f"{d.setting.help} (default: {_default_text(d)})"
    kw = dict(dest=d.name, default=argparse.SUPPRESS, help=help_text)
    flags = (d.flag, *d.setting.aliases)
    if d.type is bool:
        parser.add_argument(*flags, action="store_false" if d.default else "store_true", **kw)
        return
    rule = d.setting.rule
    if isinstance(rule, OneOf) and d.setting.parse is None:
        kw["choices"] = rule.choices
    parser.add_argument(*flags, type=d.setting.parse or d.type,
                        metavar=d.setting.metavar, **kw)


def _default_text(d: Declared) -> str:
    if d.type is bool:
        return "on" if d.default else "off"
    if d.default is None:
        return "unset"
    return str(d.default)


def from_args(cls, args: argparse.Namespace, **values):
    """A `cls` from the flags that were given (and `values`, which win)."""
    given = {d.name: getattr(args, d.name) for d in declared(cls) if hasattr(args, d.name)}
    return cls(**{**given, **values})


def to_flags(config) -> list[str]:
    """The command line that makes `config` again with `from_args` (non-default fields only)."""
    out = []
    for d in declared(type(config)):
        value = getattr(config, d.name)
        if not d.setting.cli or value == d.default:
            continue
        if d.type is bool:
            out.append(d.flag)
        elif d.setting.parse is None:
            out += [d.flag, str(value)]
        else:
            raise ValueError(f"{d.name}: a parsed flag ({d.flag}) cannot be written back")
    return out


# -- wire forms ---------------------------------------------------------------------------------

def to_wire(config) -> dict:
    """A plain dict of every field (msgpack-able), for the rank ring."""
    return dataclasses.asdict(config)


def from_wire(cls, data: dict):
    return cls(**data)


def wire_fields(cls) -> list[Declared]:
    return [d for d in declared(cls) if d.setting.wire is not None]


_PROTO_TYPES = {int: "int64", float: "double", str: "string", bool: "bool"}


def proto_message(cls, name: str) -> str:
    """The protobuf message text for the wire fields of `cls` (every field `optional`: unset
    takes the declared default on the receiving side)."""
    lines = [f"message {name} {{"]
    for d in sorted(wire_fields(cls), key=lambda d: d.setting.wire):
        text = d.setting.help[0].upper() + d.setting.help[1:] + "."
        lines += ["  // " + line for line in textwrap.wrap(text, 95)]
        lines.append(f"  optional {_PROTO_TYPES[d.type]} {d.name} = {d.setting.wire};")
    lines.append("}")
    return "\n".join(lines)


def to_proto(config, message) -> None:
    """Copy every set wire field of `config` into `message` (None stays unset)."""
    for d in wire_fields(type(config)):
        value = getattr(config, d.name)
        if value is not None:
            setattr(message, d.name, value)


def from_proto(cls, message, **values):
    """A `cls` from a message's set fields (unset: the declared default) and `values`."""
    given = {d.name: getattr(message, d.name) for d in wire_fields(cls)
             if message.HasField(d.name)}
    return cls(**{**given, **values})


def field_default(cls, name: str):
    """The declared default of one field (for code that must name it, e.g. a fallback)."""
    f = cls.__dataclass_fields__[name]
    return f.default if f.default is not MISSING else None
