"""Subcommands other packages declare: `deltaserve bench` comes from the deltaserve.commands entry
point group, which deltaserve/cli.py reads, so the CLI imports nothing of bench. The metadata here
is the one pip installs: setuptools' PEP 517 hook writes it from pyproject.toml."""
from __future__ import annotations

import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from bench import throughput
from deltaserve import cli
from tests.support.grpc_harness import child_env
from tests.support.paths import REPO

PLUGIN = '''
def add_command(sub):
    p = sub.add_parser("hello", help="says hello")
    p.add_argument("--code", type=int, default=0)
    p.set_defaults(run_command=lambda args: print("hello from a plugin") or args.code)
'''


@pytest.fixture(scope="module")
def installed_metadata(tmp_path_factory) -> Path:
    """A folder holding deltaserve's dist-info as `pip install` would write it from pyproject."""
    out = tmp_path_factory.mktemp("dist-info")
    hook = "import sys; from setuptools import build_meta; " \
           "build_meta.prepare_metadata_for_build_wheel(sys.argv[1])"
    subprocess.run([sys.executable, "-c", hook, str(out)], cwd=REPO, check=True,
                   capture_output=True, timeout=60)
    for scratch in out.glob("*.egg-info"):   # the hook's working copy; pip keeps the dist-info
        shutil.rmtree(scratch)
    return out


def _commands(folder: Path) -> list[metadata.EntryPoint]:
    [dist] = metadata.distributions(name="deltaserve", path=[str(folder)])
    return sorted(dist.entry_points.select(group=cli.COMMAND_GROUP), key=lambda e: e.name)


def test_pyproject_declares_bench_in_the_command_group(installed_metadata):
    [bench] = _commands(installed_metadata)
    assert (bench.name, bench.value) == ("bench", "bench.throughput:add_command")
    assert bench.load() is throughput.add_command


def test_the_parser_gets_bench_from_the_installed_metadata(installed_metadata, monkeypatch):
    monkeypatch.syspath_prepend(str(installed_metadata))
    args = cli.build_parser().parse_args(["bench", "--preset", "tiny", "--num-seqs", "3"])
    assert (args.command, args.preset, args.num_seqs) == ("bench", "tiny", 3)
    assert args.run_command is throughput.run_and_report


def test_deltaserve_bench_help_runs_from_an_installed_checkout(installed_metadata):
    env = child_env({"PYTHONPATH": f"{installed_metadata}:{REPO}"})
    out = subprocess.run([sys.executable, "-m", "deltaserve.cli", "bench", "--help"], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "--preset" in out.stdout and "--vs-transformers" in out.stdout


def test_any_declared_command_is_added_and_run(tmp_path, monkeypatch, capsys):
    """The CLI knows no command by name: a distribution that declares one in the group is enough."""
    (tmp_path / "hello_plugin.py").write_text(PLUGIN)
    info = tmp_path / "hello_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: hello-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        f"[{cli.COMMAND_GROUP}]\nhello = hello_plugin:add_command\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert cli.main(["hello", "--code", "3"]) == 3
    assert capsys.readouterr().out == "hello from a plugin\n"
