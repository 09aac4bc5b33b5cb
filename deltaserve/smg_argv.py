"""The gateway's arguments on its standard input, not on its command line.

`deltaserve serve --api-key K` hands its keys to the gateway (smg 1.13.0, `--api-key`,
`--tenant-api-key`); on smg's command line they are in /proc/<pid>/cmdline, which every local
user reads (`ps -ef`). smg 1.13.0 reads no key from an environment variable or a file: its
`launch --help` takes them as arguments only, its CLI (smg/cli.py, launch_router.py) is argparse
without `fromfile_prefix_chars`, and the variables it reads (router_args.py, the Rust
extension's strings) are for multimodal, RDMA and the history backends. But the `smg` command
is a Python console script (`from smg.cli import main`) and `main(argv)` takes the argument list,
so smg's own Python runs a few lines that read the list from a pipe only we write and call
`main` with it: the command line shows those lines, never a key.

A console script is recognized as installers write it: its first line `#!PYTHON` (pip, uv; an
option may follow), `#!/usr/bin/env python3`, or `#!/bin/sh` with an `exec PYTHON "$0" "$@"`
line (pip's and uv's trampoline for an interpreter path with a space or too long for a shebang),
and `from smg.cli import main` in its text. Anything else (a binary, a shell wrapper, a Python
wrapper of the operator's own, which must run as written) gets its arguments on the command
line, as before.
"""
from __future__ import annotations

import json
import os
import shlex

# `-c` puts the working directory first on sys.path (a console script puts its own folder):
# dropped before any import, or a json.py there (serve's working directory may be /tmp) would
# run in the gateway. The console script's last line is `sys.exit(main())`: the same exit code.
_FROM_STDIN = ("import sys\n"
               "if sys.path[:1] == ['']: del sys.path[0]\n"
               "import json\n"
               "argv = json.load(sys.stdin)\n"
               "sys.argv = ['smg', *argv]\n"
               "from smg.cli import main\n"
               "sys.exit(main(argv))\n")
_CONSOLE_SCRIPT = b"from smg.cli import main"
_HEAD_BYTES = 4096


def script_python(path: str) -> list[str] | None:
    """The command that runs smg's console script at `path` (its interpreter, with the
    shebang's option or `env`), or None when `path` is no such script."""
    try:
        with open(path, "rb") as f:
            head = f.read(_HEAD_BYTES)
    except OSError:
        return None
    lines = head.split(b"\n")
    if not head.startswith(b"#!") or len(lines) < 2 or _CONSOLE_SCRIPT not in head:
        return None
    # As the kernel reads a shebang: the interpreter, then the rest as one argument.
    interpreter, _, arg = lines[0][2:].decode("utf-8", "replace").strip().partition(" ")
    arg = arg.strip()
    if interpreter == "/bin/sh":          # the trampoline: '''exec' PYTHON "$0" "$@"
        try:
            words = shlex.split(lines[1].decode("utf-8", "replace"))
        except ValueError:
            return None
        if words[:1] != ["exec"] or words[2:] != ["$0", "$@"]:
            return None
        command, python = words[1:2], words[1]
    elif os.path.basename(interpreter) == "env":       # env python3 (one word: no -S)
        command, python = [interpreter, arg], arg
    elif not arg or arg.startswith("-"):
        command, python = [interpreter, *([arg] if arg else [])], interpreter
    else:
        return None
    return command if os.path.basename(python).startswith("python") else None


def private_launch(cmd: list[str]) -> tuple[list[str], bytes | None]:
    """(the command to start, the bytes to write to its stdin): `cmd` = [smg, args...] as smg's
    Python reading args from stdin, or `cmd` itself and None when smg is not its console
    script."""
    python = script_python(cmd[0])
    if python is None:
        return cmd, None
    return [*python, "-c", _FROM_STDIN], json.dumps(cmd[1:]).encode()
