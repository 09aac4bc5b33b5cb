"""How far a regex's counted repetitions expand it, measured in one pass over its text.

llguidance (1.9.1) keeps `x{n,m}` symbolic when it validates a grammar, so `a{1000000}`,
`(a{1000}){1000}` or `a{1000}{1000}{1000}` pass its validation in a millisecond and its limits
(initial_lexer_fuel, max_grammar_size) do not see them: they see a handful of AST nodes. The
expansion happens on the worker, when the lexer is built against the tokenizer: `a{1000000}`
took 0.47 s and about 120 MB of the compile thread on a 320-id vocabulary, and spent the lexer's
whole fuel, so the request's first mask failed ("lexer error: too many expressions
constructed"); `a{100000}` cost 36 ms per mask. `regex_repeated_atoms` bounds that work from
above, as RE2 and Go bound each count at 1000 but for the whole regex: counted repetitions
multiply the size of what they repeat (nested ones multiply each other), alternatives add up,
and `*`, `+`, `?` cost nothing extra. Character classes, escapes (`\\d`, `\\p{L}`,
`\\x{..}`) and other atoms weigh 1; a group's `?:`, `?P<name>` or flags are not counted.
"""
from __future__ import annotations

import re

# {n}, {n,} or {n,m}, spaces allowed as the regex crate allows them.
_COUNTED = re.compile(r"\{\s*(\d+)\s*(?:(,)\s*(\d*)\s*)?\}")
# \p{..}, \P{..}, \x{..}, \u{..}, \U{..}: one atom with its braces.
_BRACED_ESCAPE = re.compile(r"\\[pPxuU]\{[^}]*\}")
_CAP = 1 << 62          # sizes are clamped here: nested counts may multiply without end


def regex_repeated_atoms(text: str) -> int:
    """The atoms `text`'s counted repetitions add to it: its size written out, less its size
    with every count taken once. A long regex without counts costs nothing here (the text's
    own length is bounded by --max-constraint-chars)."""
    full, plain = regex_sizes(text)
    return full - plain


def regex_repeat_size(text: str, expand: bool = True) -> int:
    """The number of atoms `text` expands to once every counted repetition is written out
    (`expand` False: with every count taken once)."""
    return regex_sizes(text)[0 if expand else 1]


def regex_sizes(text: str) -> tuple[int, int]:
    """(its size written out, its size with every count taken once), in one pass."""
    sizer = RepeatSizer()
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            braced = _BRACED_ESCAPE.match(text, i)
            i = braced.end() if braced else i + 2
            sizer.atom()
            continue
        if c == "[":
            i = _class_end(text, i)
            sizer.atom()
            continue
        if c == "(":
            i = _group_body(text, i)
            if i < 0:                     # a flag group, "(?i)": nothing to repeat
                i = -i
                sizer.forget()
                continue
            sizer.open()
            continue
        if c == ")":
            sizer.close()
        elif c == "|":
            sizer.alt()
        elif c == "{" and (counted := _COUNTED.match(text, i)):
            low, comma, high = counted.groups()
            sizer.count(int(high) if high else int(low) + (1 if comma else 0))
            i = counted.end()
            continue
        elif c not in "*+?":
            sizer.atom()
        i += 1
    return sizer.total()


class RepeatSizer:
    """Sizes of a regex-like sequence as it is read: per open group, the sum of its finished
    alternatives and its current branch, each as [written out, counts taken once]. A count
    multiplies the last item (an atom, a group, or an item already counted); `*`, `+`, `?`
    cost nothing. Lark terminals are sized with it too (grammar_repeats.py)."""

    def __init__(self):
        self.frames = [[0, 0, 0, 0]]    # finished alternatives (full, plain), branch (full, plain)
        self.last = (0, 0)              # the item a count would repeat

    def atom(self, full: int = 1, plain: int = 1) -> None:
        frame = self.frames[-1]
        frame[2], frame[3] = min(frame[2] + full, _CAP), min(frame[3] + plain, _CAP)
        self.last = (full, plain)

    def forget(self) -> None:
        """Nothing before this point can be repeated (a flag group)."""
        self.last = (0, 0)

    def open(self) -> None:
        self.frames.append([0, 0, 0, 0])

    def close(self) -> None:
        if len(self.frames) > 1:         # a surplus ")" is an atom, as the old scan read it
            done = self.frames.pop()
            self.atom(min(done[0] + done[2], _CAP), min(done[1] + done[3], _CAP))
        else:
            self.atom()

    def alt(self) -> None:
        frame = self.frames[-1]
        frame[0], frame[1] = min(frame[0] + frame[2], _CAP), min(frame[1] + frame[3], _CAP)
        frame[2] = frame[3] = 0
        self.last = (0, 0)

    def count(self, times: int) -> None:
        frame = self.frames[-1]
        full, plain = self.last
        grown = min(full * max(times, 1), _CAP)
        frame[2] = min(frame[2] + grown - full, _CAP)
        self.last = (grown, plain)

    def total(self) -> tuple[int, int]:
        while len(self.frames) > 1:      # groups left open: the engine refuses the text
            self.close()
        frame = self.frames[0]
        return min(frame[0] + frame[2], _CAP), min(frame[1] + frame[3], _CAP)


def _class_end(text: str, start: int) -> int:
    """The index after the character class opening at `start` (classes nest in the regex
    crate's syntax; a `]` first in a class is literal)."""
    depth, i, n = 0, start, len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "[":
            depth += 1
            i += 1
            if text.startswith("^", i):
                i += 1
            if text.startswith("]", i):
                i += 1
            continue
        if c == "]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return n


def _group_body(text: str, start: int) -> int:
    """Where the body of the group opening at `start` begins; for a flag group with no body
    ("(?i)"), minus the index after it."""
    i = start + 1
    if not text.startswith("?", i):
        return i
    if text.startswith(("?P<", "?<"), i):
        close = text.find(">", i)
        return len(text) if close < 0 else close + 1
    for j in range(i + 1, len(text)):
        if text[j] == ":":
            return j + 1
        if text[j] == ")":
            return -(j + 1)
    return len(text)
