"""The gateway's API keys are not on its command line.

`deltaserve serve --api-key K1 K2` started `smg launch ... --api-key=K1 --tenant-api-key=key-2:K2`:
/proc/<smg pid>/cmdline, which every local user can read (`ps -ef`), held both keys until smg's
`setproctitle("smg::router")` overwrote it (0.28 s after the exec on this loaded 2-core AMD EPYC,
AVX2 only), and an execve audit log keeps them for good. smg 1.13.0 reads keys from no variable
or file, so smg's own Python now reads its arguments from a pipe (deltaserve/smg_argv.py). Here the real gateway is started as `serve` starts it (OpenAIFront,
no worker behind it: the keys are checked before any worker is asked): no key in the command
line or environment of it or any process it started, and each key still passes its key
check, while a wrong one is refused."""
from __future__ import annotations

import http.client
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from deltaserve.child_process import dying_with_parent
from deltaserve.cli import build_parser
from deltaserve.openai_gateway import OpenAIFront, openai_options
from deltaserve.smg_argv import private_launch, script_python
from tests.support.gateway import require_smg
from tests.support.grpc_harness import REPO, free_port, wait_for

KEYS = ("first-key-0f3c9a7b5e1d", "tenant-key-8a2e4c6b0d9f")


def _status(port: int, key: str) -> int | None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("POST", "/v1/completions", '{"model": "m", "prompt": "hi"}',
                     {"authorization": f"Bearer {key}", "content-type": "application/json"})
        response = conn.getresponse()
        response.read()
        return response.status
    except OSError:
        return None
    finally:
        conn.close()


def _tree(pid: int) -> list[int]:
    """`pid` and every process under it."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            children = (task / "children").read_text().split() if (task / "children").exists() \
                else []
            todo += [int(c) for c in children]
    return found


def test_the_gateways_keys_are_on_no_command_line(tiny_models, tmp_path, capfd):
    smg = require_smg()
    assert script_python(smg) is not None, f"{smg} is not a Python console script"
    port = free_port()
    options, _ = openai_options(build_parser().parse_args(
        ["serve", "--port", str(port), "--api-key", *KEYS]))
    front = OpenAIFront(options, smg, tiny_models("qwen3"), "127.0.0.1:1", ready_timeout=1)
    front.on_ready(SimpleNamespace(port=free_port(), adapter_ports=()), lambda url: None)
    try:
        wait_for(lambda: _status(port, "wrong-key-000000000000") is not None, 60,
                 "the gateway's port", [])
        assert _status(port, "wrong-key-000000000000") == 401
        # Both keys reached smg: past its key check (404: no worker serves model "m").
        assert [_status(port, key) for key in KEYS] == [404, 404]
        # What was exec'd (the death-signal launcher, which execs smg's Python with the rest):
        # what /proc/<pid>/cmdline shows and an execve audit log keeps.
        for key in KEYS:
            assert not any(key in part for part in front.child.proc.args), front.child.proc.args
        pids = _tree(front.child.proc.pid)
        for pid in pids:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            assert b"smg" in cmdline or pid != front.child.proc.pid, cmdline
            for key in KEYS:
                assert key.encode() not in cmdline, (pid, cmdline)
                assert key.encode() not in environ, pid
    finally:
        front.stop()
    # smg's own log lines still reach ours (folded, "[smg] "), and none of ours or its holds a
    # key.
    out = capfd.readouterr()
    assert "[smg] " in out.err, out.err[-2000:]
    for key in KEYS:
        assert key not in out.out + out.err


def test_a_gateway_that_is_no_python_script_gets_its_arguments_as_before(tmp_path):
    binary = tmp_path / "smg"
    binary.write_bytes(b"\x7fELF\x02\x01\x01")
    cmd = [str(binary), "launch", "--api-key=k"]
    assert private_launch(cmd) == (cmd, None)
    script = tmp_path / "smg-script"
    script.write_text(f"#!{sys.executable}\nimport sys\nfrom smg.cli import main\n")
    launch, argv = private_launch([str(script), "launch", "--api-key=k"])
    assert launch[0] == sys.executable and b"--api-key=k" in argv
    assert not any("--api-key" in part for part in launch)


def test_the_real_gateway_fails_as_before_its_exit_code_and_message_kept(tmp_path):
    """smg refusing its arguments: the same exit code and message by stdin as by argv."""
    smg = require_smg()
    cmd = [smg, "launch", "--api-key=a-key-31c8e0f2b4d6", "--no-such-flag"]
    direct = subprocess.run(cmd, capture_output=True, timeout=120)
    launch, argv = private_launch(cmd)
    piped = subprocess.run(dying_with_parent(launch), input=argv, capture_output=True,
                           timeout=120)
    assert direct.returncode == piped.returncode == 2, (direct, piped)
    assert b"unrecognized arguments: --no-such-flag" in piped.stderr, piped.stderr
    assert piped.stderr == direct.stderr


# A serve stand-in: starts the real gateway as serve does, prints its pid, then waits.
_SERVE = """
import sys
from deltaserve.openai_gateway import GatewayChild
from deltaserve.smg_argv import private_launch
launch, argv = private_launch(sys.argv[1:])
child = GatewayChild(launch, stdin_data=argv)
print(child.proc.pid, flush=True)
sys.stdin.read()
"""


def test_a_killed_serve_leaves_no_gateway(tmp_path):
    smg = require_smg()
    cmd = [smg, "launch", "--host", "127.0.0.1", "--port", str(free_port()),
           "--worker-urls", "grpc://127.0.0.1:1", "--api-key=a-key-31c8e0f2b4d6"]
    serve = subprocess.Popen([sys.executable, "-c", _SERVE, *cmd], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, cwd=REPO,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        pid = int(serve.stdout.readline())
        wait_for(lambda: b"smg::router" in Path(f"/proc/{pid}/cmdline").read_bytes(), 60,
                 "the gateway's start", [])
    finally:
        serve.kill()
        serve.wait()
    wait_for(lambda: not _alive(pid), 30, "the gateway's exit after serve was killed", [])


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False
