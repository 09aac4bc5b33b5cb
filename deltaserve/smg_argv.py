"""The gateway's arguments on its standard input, not on its command line.

`deltaserve serve --api-key K` hands its keys to the gateway (smg 1.13.0, `--api-key`,
`--tenant-api-key`); on smg's command line they are in /proc/<pid>/cmdline, which every local
user reads (`ps -ef`). smg 1.13.0 reads no key from an environment variable or a file: its
`launch --help` takes them as arguments only, its CLI (smg/cli.py, launch_router.py) is argparse
without `fromfile_prefix_chars`, and the variables it reads (router_args.py, the Rust
extension's strings) are for multimodal, RDMA and the history backends. But the `smg` command
is a Python console script (`from smg.cli import main`) and `main(argv)` takes the argument list,
so smg's own Python runs a few lines that read the list from a pipe only we write and call
`main` with it: the command line shows those lines, never a key. A `smg` that is not such a
script (a binary found on PATH) gets its arguments on the command line, as before.
"""
from __future__ import annotations

import json
import os

_FROM_STDIN = ("import json, sys; argv = json.load(sys.stdin); sys.argv = ['smg', *argv]; "
               "from smg.cli import main; main(argv)")


def script_python(path: str) -> str | None:
    """The interpreter of a `#!/.../python...` script (a pip console script), else None."""
    try:
        with open(path, "rb") as f:
            first = f.readline(4096)
    except OSError:
        return None
    parts = first[2:].decode("utf-8", "replace").split() if first.startswith(b"#!") else []
    if len(parts) != 1 or not os.path.basename(parts[0]).startswith("python"):
        return None
    return parts[0]


def private_launch(cmd: list[str]) -> tuple[list[str], bytes | None]:
    """(the command to start, the bytes to write to its stdin): `cmd` = [smg, args...] as smg's
    Python reading args from stdin, or `cmd` itself and None when smg is not a Python script."""
    python = script_python(cmd[0])
    if python is None:
        return cmd, None
    return [python, "-c", _FROM_STDIN], json.dumps(cmd[1:]).encode()
