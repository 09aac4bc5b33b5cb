"""How much text a grammar's rules can force in a row, estimated from above.

Where the grammar leaves one way on, llguidance computes the forced text (its fast-forward
tokens) on every mask, whatever the count that made it: `start: /a{1000}/ ~ 1000`,
`start: item ~ 1000` with `item: /a{1000}/`, or `A` written 1,000 times in a rule each cost
0.65 to 0.8 s per mask (about 0.7 us a forced byte on an Intel Xeon, Sapphire Rapids; 9,000 x
1,000: 6.6 s), while the same counts over a choice (`/[a-z]{1000}/ ~ 1000`, `("a" | "b") ~ 1000`)
cost under a millisecond. Sizing rules as terminals are sized (written out, names inlined)
would refuse real grammars (a 16 KB RFC grammar's start rule is 2.4 million atoms written out
through its shared rules), so rules are sized by their longest forced run instead.

Per item: whether it is one fixed text (`det`) and its length, else the forced text it can
begin with (`pre`), end with (`suf`) and hold (`best`). A choice forces its largest branch's
(an over-estimate: only a shared prefix is forced), a regex with a class, `.`, `|` or a
quantifier is not fixed and may force all of its written-out size, a counted fixed item is n
times as long, and a name stands for its definition (within a cycle of rules: nothing).
"""
from __future__ import annotations

import re
from re import _parser as sre     # the stdlib's regex parser: Python's syntax is near Rust's
from typing import NamedTuple

from engine_common.runtime.graph_components import strongly_connected

_CAP = 1 << 62
_TEXT_LIMIT = 100_000       # a fixed regex text longer than this is not held, only assumed one
_REPEATS = (sre.MAX_REPEAT, sre.MIN_REPEAT, getattr(sre, "POSSESSIVE_REPEAT", sre.MAX_REPEAT))


class Forced(NamedTuple):
    det: bool       # exactly one text: then pre, suf and best are its length
    pre: int
    suf: int
    best: int


def fixed(length: int) -> Forced:
    length = min(length, _CAP)
    return Forced(True, length, length, length)


_NOTHING = Forced(False, 0, 0, 0)


def forced_runs(bodies: dict[str, list], sizes_of_regex) -> dict[str, int]:
    """name -> the longest text its body may force, definitions taken in dependency order
    (`sizes_of_regex(token)`: the regex token's (written out, as written) sizes)."""
    refs = {name: [v.lstrip("!?").split(".", 1)[0] for k, v in body if k == "name"]
            for name, body in bodies.items()}
    runs: dict[str, Forced] = {}
    for component in strongly_connected(bodies, refs):
        runs.update((name, _NOTHING) for name in component)
        runs.update([(name, _body(bodies[name], runs, sizes_of_regex)) for name in component])
    return {name: forced.best for name, forced in runs.items()}


def _seq(a: Forced, b: Forced) -> Forced:
    if a.det and b.det:
        return fixed(a.pre + b.pre)
    pre = a.pre + b.pre if a.det else a.pre
    suf = a.suf + b.suf if b.det else b.suf
    return Forced(False, min(pre, _CAP), min(suf, _CAP),
                  min(max(a.best, b.best, a.suf + b.pre), _CAP))


def _choice(branches: list[Forced]) -> Forced:
    if len(branches) == 1:
        return branches[0]
    return Forced(False, max(b.pre for b in branches), max(b.suf for b in branches),
                  max(b.best for b in branches))


def _optional_copies(x: Forced) -> Forced:
    """x repeated any number of times from none (x*): each copy is a choice."""
    return Forced(False, 0, x.suf, max(x.best, x.suf + x.pre) if not x.det else x.best)


def _count(x: Forced, low: int, high: int | None) -> Forced:
    if x.det:
        exact = fixed(x.pre * low)
    else:
        exact = x if low >= 1 else Forced(True, 0, 0, 0)
        if low >= 2:
            exact = _seq(x, x)
    return exact if high == low else _seq(exact, _optional_copies(x))


class _Frame:
    def __init__(self, optional: bool = False):
        self.branches: list[Forced] = []
        self.current = fixed(0)
        self.last: Forced | None = None       # the item an operator would apply to
        self.before = fixed(0)                # the branch before that item
        self.optional = optional

    def add(self, item: Forced) -> None:
        self.before, self.last = self.current, item
        self.current = _seq(self.current, item)

    def apply(self, op) -> None:
        if self.last is not None:
            self.last = op(self.last)
            self.current = _seq(self.before, self.last)

    def end_branch(self) -> None:
        self.branches.append(self.current)
        self.current, self.last, self.before = fixed(0), None, fixed(0)

    def close(self) -> Forced:
        self.end_branch()
        whole = _choice(self.branches)
        return _count(whole, 0, 1) if self.optional else whole


def _body(body: list, runs: dict[str, Forced], sizes_of_regex) -> Forced:
    frames = [_Frame()]
    for kind, value in body:
        frame = frames[-1]
        if kind == "string":
            text = value[1:-1] if value.endswith('"') else value[1:-2]
            frame.add(_NOTHING if string_is_free(value) else fixed(len(text)))
        elif kind == "regex":
            full, _ = sizes_of_regex(value)
            end = value.rfind("/")
            free = regex_is_free(value[1:end] if end > 0 else value[1:], value[end + 1:])
            frame.add(Forced(False, full, full, full) if free else fixed(full))
        elif kind == "name":
            frame.add(runs.get(value.lstrip("!?").split(".", 1)[0], fixed(0)))
        elif kind in ("json", "ext"):
            frame.add(_NOTHING)
        elif kind == "open":
            frames.append(_Frame(optional=value == "["))
        elif kind == "close" and len(frames) > 1:
            frames[-2].add(frames.pop().close())
        elif kind == "alt":
            frame.end_branch()
        elif kind in ("tilde_count", "brace_count"):
            low, high = _bounds(value)
            frame.apply(lambda x: _count(x, low, high))
        elif kind == "other" and value in "*+?":
            frame.apply({"*": lambda x: _count(x, 0, None), "+": lambda x: _count(x, 1, None),
                         "?": lambda x: _count(x, 0, 1)}[value])
    while len(frames) > 1:
        frames[-2].add(frames.pop().close())
    return frames[0].close()


def _bounds(count: str) -> tuple[int, int | None]:
    """(low, high or None) of `~ n`, `~ n..m`, `{n}`, `{n,m}`, `{n,}`, `{,m}`."""
    inner = count.strip("~{} \t")
    if count.startswith("~"):
        parts = [p.strip() for p in inner.split("..")]
    else:
        parts = [p.strip() for p in inner.split(",")]
    low = int(parts[0]) if parts[0] else 0
    if len(parts) == 1:
        return low, low
    return low, int(parts[1]) if parts[1] else None


def regex_is_free(body: str, flags: str = "") -> bool:
    """Whether the regex surely matches more than one text (a class of several characters,
    `.`, a quantifier or count range, differing alternatives, case folding). When unsure (a
    syntax only Rust's regex crate reads, as `\\p{L}`): False, so its size counts in full."""
    try:
        parsed = sre.parse(body)
    except (re.error, RecursionError, OverflowError, ValueError):
        return False
    return _fixed_text(parsed, "i" in flags or bool(parsed.state.flags & re.IGNORECASE)) is None


def string_is_free(token: str) -> bool:
    """Whether a Lark string token matches several texts: `"..."i` with a cased letter."""
    return token.endswith("i") and any(c.lower() != c.upper() for c in token[1:-2])


def _fixed_text(items, fold: bool = False) -> str | int | None:
    """The one text `items` matches (its length alone when longer than _TEXT_LIMIT), or None
    when it may match several (`fold`: case-insensitively, so a cased letter is a choice)."""
    out: list = []
    for op, av in items:
        if op == sre.LITERAL:
            part = chr(av)
            if fold and part.lower() != part.upper():
                return None
        elif op == sre.IN:
            chars = {chr(a) for o, a in av if o == sre.LITERAL}
            if len(chars) != 1 or any(o != sre.LITERAL for o, a in av):
                return None
            part = chars.pop()
            if fold and part.lower() != part.upper():
                return None
        elif op in _REPEATS:
            low, high, sub = av
            inner = _fixed_text(sub, fold)
            if inner is None or low != high and inner != "":
                return None
            part = _times(inner, low)
        elif op == sre.SUBPATTERN:
            part = _fixed_text(av[3], (fold or bool(av[1] & re.IGNORECASE))
                               and not av[2] & re.IGNORECASE)
        elif op == sre.BRANCH:
            texts = [_fixed_text(branch, fold) for branch in av[1]]
            if any(t is None for t in texts) or len(set(texts)) > 1:
                return None
            part = texts[0]
        elif op == getattr(sre, "ATOMIC_GROUP", None):
            part = _fixed_text(av, fold)
        elif op == sre.AT:
            part = ""
        else:                       # ANY, NOT_LITERAL, CATEGORY, ...: a choice
            return None
        if part is None:
            return None
        out.append(part)
    return _join(out)


def _times(text: str | int, n: int) -> str | int:
    length = (text if isinstance(text, int) else len(text)) * n
    return length if isinstance(text, int) or length > _TEXT_LIMIT else text * n


def _join(parts: list) -> str | int:
    if any(isinstance(p, int) for p in parts) or sum(map(len, parts)) > _TEXT_LIMIT:
        return sum(p if isinstance(p, int) else len(p) for p in parts)
    return "".join(parts)
