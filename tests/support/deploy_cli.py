"""The deltaserve command line as deploy/ spells it, parsed by the real CLI parser."""
from __future__ import annotations

import argparse

from deltaserve.cli import build_parser


def parse_strictly(argv: list[str]):
    """The CLI's namespace for argv, every flag spelled out in full (no argparse prefix
    matching); None for `--help` (valid: it exits 0)."""
    parser = build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                sub.allow_abbrev = False
    try:
        return parser.parse_args(argv)
    except SystemExit as e:
        assert e.code == 0 and "--help" in argv, f"deltaserve rejects {argv}"
        return None
