"""How `serve` starts smg with its arguments on stdin (deltaserve/smg_argv.py), for the shapes a
`smg` command takes on disk: pip's and uv's console scripts (a `#!python` line, or the
`#!/bin/sh` trampoline both write when the interpreter's path has a space or is long), pipx's
symlink to one, one run by `#!/usr/bin/env python3`, a Python wrapper of the operator's own
and a shell wrapper.

Each real run below starts a stand-in `smg` package (tmp_path/site/smg/cli.py) whose `main`
writes the arguments it got, its stdout line and its exit code: the launch must call `main`
with the arguments, keep its output and exit code, and put no argument on a command line."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from deltaserve.smg_argv import private_launch

_CLI = """import json, sys
def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    print("smg says hello", flush=True)
    with open(%r, "w") as f:
        json.dump(argv, f)
    return 3
"""
_PIP_SCRIPT = """# -*- coding: utf-8 -*-
import re
import sys
from smg.cli import main
if __name__ == '__main__':
    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])
    sys.exit(main())
"""
ARGS = ["launch", "--api-key=key-0f3c9a7b5e1d", "--port", "8000"]


def _site(tmp_path: Path) -> tuple[Path, Path]:
    """The stand-in package's folder and the file its main writes."""
    got = tmp_path / "got.json"
    got.unlink(missing_ok=True)
    (tmp_path / "site" / "smg").mkdir(parents=True, exist_ok=True)
    (tmp_path / "site" / "smg" / "__init__.py").write_text("")
    (tmp_path / "site" / "smg" / "cli.py").write_text(_CLI % str(got))
    return tmp_path / "site", got


def _script(path: Path, text: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return str(path)


def _run(tmp_path: Path, smg: str) -> tuple[list[str], int, str, list[str] | None]:
    """(what was exec'd, exit code, output, the arguments main got) of `smg ARGS` launched as
    serve launches it."""
    site, got = _site(tmp_path)
    launch, stdin = private_launch([smg, *ARGS])
    env = {**os.environ, "PYTHONPATH": str(site)}
    done = subprocess.run(launch, input=stdin, capture_output=True, env=env, timeout=60)
    argv = json.loads(got.read_text()) if got.exists() else None
    return launch, done.returncode, done.stdout.decode(), argv


def _private(launch: list[str]) -> None:
    assert not any("key-0f3c9a7b5e1d" in part for part in launch), launch


def test_a_pip_console_script_gets_its_arguments_on_stdin(tmp_path):
    smg = _script(tmp_path / "venv" / "bin" / "smg", f"#!{sys.executable}\n{_PIP_SCRIPT}")
    launch, code, out, argv = _run(tmp_path, smg)
    _private(launch)
    assert argv == ARGS and "smg says hello" in out
    assert code == 3, "main's exit code, as the console script's sys.exit(main()) gives it"
    shim = tmp_path / "bin" / "smg"          # pipx's: a symlink to the venv's script
    shim.parent.mkdir()
    shim.symlink_to(smg)
    launch, code, out, argv = _run(tmp_path, str(shim))
    assert launch[0] == sys.executable and argv == ARGS and code == 3


def test_the_sh_trampoline_for_an_interpreter_path_with_a_space(tmp_path):
    """pip (distlib) and uv write `#!/bin/sh` and an `exec` line when the interpreter's path
    has a space or is longer than a shebang may be: it was taken for no Python script, and
    the keys went on the command line."""
    venv = tmp_path / "my venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").symlink_to(sys.executable)
    site, _ = _site(tmp_path)
    for quote in ('"', "'"):      # pip quotes it with ", uv with '
        trampoline = (f"#!/bin/sh\n'''exec' {quote}{venv / 'python'}{quote} \"$0\" \"$@\"\n"
                      f"' '''\n{_PIP_SCRIPT}")
        smg = _script(venv / "smg", trampoline)
        assert subprocess.run([smg, "--x"], capture_output=True, timeout=60,
                              env={**os.environ, "PYTHONPATH": str(site)}
                              ).returncode == 3        # the script itself runs so
        launch, code, out, argv = _run(tmp_path, smg)
        _private(launch)
        assert launch[0] == str(venv / "python") and argv == ARGS and code == 3, (quote, out)


def test_a_script_run_by_env_python(tmp_path):
    smg = _script(tmp_path / "bin" / "smg", f"#!/usr/bin/env python3\n{_PIP_SCRIPT}")
    launch, code, out, argv = _run(tmp_path, smg)
    _private(launch)
    assert launch[:2] == ["/usr/bin/env", "python3"] and argv == ARGS and code == 3


def test_a_python_wrapper_of_the_operators_own_runs_as_written(tmp_path):
    """A Python `smg` that is not smg's console script (it sets something up first) must run as
    written: bypassing it for `from smg.cli import main` skipped its own lines."""
    marker = tmp_path / "wrapper-ran"
    smg = _script(tmp_path / "bin" / "smg",
                  f"#!{sys.executable}\nimport sys\nopen({str(marker)!r}, 'w').close()\n"
                  "sys.path.insert(0, '/opt/smg')\nimport smg.cli\n"
                  "sys.exit(smg.cli.main())\n")
    launch, stdin = private_launch([smg, *ARGS])
    assert (launch, stdin) == ([smg, *ARGS], None)


def test_a_shell_wrapper_gets_its_arguments_on_its_command_line(tmp_path):
    smg = _script(tmp_path / "bin" / "smg", "#!/bin/sh\nexec /opt/smg/bin/smg \"$@\"\n")
    assert private_launch([smg, *ARGS]) == ([smg, *ARGS], None)


def test_serve_warns_when_the_keys_go_on_a_command_line_and_keeps_them_out_of_the_env(
        tmp_path, monkeypatch, capfd):
    """A shell wrapper as `smg`: serve warns (naming no key) that the keys are on its command
    line, where they still reach it. The key given in VLLM_API_KEY (as docs/security.md
    advises, to keep it off our own command line) is in no child's environment: a child hands
    its environment on to everything it starts."""
    from types import SimpleNamespace

    from deltaserve.cli import build_parser
    from deltaserve.openai_gateway import OpenAIFront, openai_options
    from tests.support.grpc_harness import free_port, wait_for
    key = "env-key-7b3e9c1d5a0f"
    monkeypatch.setenv("VLLM_API_KEY", key)
    seen = tmp_path / "seen"
    smg = _script(tmp_path / "bin" / "smg",
                  f"#!/bin/sh\necho smg wrapper ran\nprintf '%s\\n' \"$@\" > {seen}.args\n"
                  f"env > {seen}.env\n")
    options, _ = openai_options(build_parser().parse_args(["serve", "--port",
                                                           str(free_port())]))
    front = OpenAIFront(options, smg, str(tmp_path), "127.0.0.1:1", ready_timeout=1)
    front.on_ready(SimpleNamespace(port=free_port(), adapter_ports=()), lambda url: None)
    try:
        wait_for(lambda: front.gone() is not None, 60, "the wrapper's exit", [])
        front.child._pump.join(10)
    finally:
        front.stop()
    err = capfd.readouterr().err
    assert "is not smg's Python console script: its API keys are on its command line" in err
    assert "[smg] smg wrapper ran" in err, err         # its output is folded into ours
    assert key not in err
    assert f"--api-key={key}" in Path(f"{seen}.args").read_text().split("\n")
    assert key not in Path(f"{seen}.env").read_text()


def test_starting_the_gateway_does_not_wait_for_it_to_read_its_arguments(tmp_path):
    """GatewayChild starts on the scheduler's event loop, where nothing may block: arguments
    larger than a pipe holds (64 KiB: some thousands of --api-key keys) used to be written
    there, and a gateway slow to read them (its imports) or stuck held the loop."""
    import io
    import threading

    from deltaserve.openai_gateway import GatewayChild
    go = tmp_path / "go"
    reader = (f"import os, sys, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.05)\n"
              "print(len(sys.stdin.buffer.read()), flush=True)\n")
    out, started, made = io.StringIO(), threading.Event(), []

    def start():
        made.append(GatewayChild([sys.executable, "-c", reader], out=out,
                                 stdin_data=b"k" * (1 << 20)))
        started.set()
    threading.Thread(target=start, daemon=True).start()
    try:
        assert started.wait(30), "GatewayChild waited for the child to read its stdin"
    finally:
        go.touch()
    assert started.wait(60)
    child = made[0]
    assert child.proc.wait(60) == 0
    child.stop()
    assert out.getvalue().split() == ["[smg]", str(1 << 20)]


def test_the_working_directory_cannot_shadow_a_module(tmp_path):
    """`python -c` puts the working directory first on sys.path, where the console script puts
    its own folder: a `json.py` (or `smg/`) in serve's working directory, which another local
    user may write (/tmp), ran inside the gateway, keys and all."""
    smg = _script(tmp_path / "venv" / "bin" / "smg", f"#!{sys.executable}\n{_PIP_SCRIPT}")
    site, got = _site(tmp_path)
    planted = tmp_path / "cwd"
    planted.mkdir()
    ran = tmp_path / "planted-ran"
    for name in ("json.py", "re.py"):
        (planted / name).write_text(f"open({str(ran)!r}, 'w').close()\nraise SystemExit(9)\n")
    launch, stdin = private_launch([smg, *ARGS])
    done = subprocess.run(launch, input=stdin, capture_output=True, cwd=planted, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(site)})
    assert not ran.exists(), done.stderr
    assert done.returncode == 3 and json.loads(got.read_text()) == ARGS, done.stderr
