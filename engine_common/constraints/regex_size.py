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
    return regex_repeat_size(text) - regex_repeat_size(text, expand=False)


def regex_repeat_size(text: str, expand: bool = True) -> int:
    """The number of atoms `text` expands to once every counted repetition is written out
    (`expand` False: with every count taken once)."""
    frames = [[0, 0]]        # per open group: [sum of finished alternatives, current branch]
    last = 0                 # the size of the item a quantifier would repeat
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        frame = frames[-1]
        if c == "\\":
            braced = _BRACED_ESCAPE.match(text, i)
            i = braced.end() if braced else i + 2
            frame[1], last = frame[1] + 1, 1
            continue
        if c == "[":
            i = _class_end(text, i)
            frame[1], last = frame[1] + 1, 1
            continue
        if c == "(":
            i = _group_body(text, i)
            if i < 0:                     # a flag group, "(?i)": nothing to repeat
                i, last = -i, 0
                continue
            frames.append([0, 0])
            continue
        if c == ")" and len(frames) > 1:
            done = frames.pop()
            last = min(done[0] + done[1], _CAP)
            frames[-1][1] = min(frames[-1][1] + last, _CAP)
        elif c == "|":
            frame[0], frame[1], last = min(frame[0] + frame[1], _CAP), 0, 0
        elif c == "{" and (counted := _COUNTED.match(text, i)):
            low, comma, high = counted.groups()
            times = int(high) if high else int(low) + (1 if comma else 0)
            grown = min(last * max(times, 1), _CAP) if expand else last
            frame[1] = min(frame[1] + grown - last, _CAP)
            last = grown
            i = counted.end()
            continue
        elif c not in "*+?":
            frame[1], last = frame[1] + 1, 1
        i += 1
    while len(frames) > 1:                # groups left open: the engine refuses the regex
        done = frames.pop()
        frames[-1][1] = min(frames[-1][1] + done[0] + done[1], _CAP)
    return min(frames[0][0] + frames[0][1], _CAP)


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
