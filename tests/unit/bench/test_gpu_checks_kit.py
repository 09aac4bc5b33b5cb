"""bench/gpu_checks.sh, the GPU kit, read without a GPU through its --dry-run: it parses; it
prints each stage's limit and the longest the stage can run (its later runs' floors and every
run's kill grace: a device call's timeout must cover that, not the limit); each command
docs/gpu.md gives with limits runs as written and fits one device call (600 s, 60 s of it kept
for the wheel install and the environment record); each stage's default limit is the one its
function uses; and the tests stage runs the bf16 checks, then session 46's CUDA twins
(quickest answers first, MLA last), then the other CUDA modules, with every file it names
present."""
from __future__ import annotations

import os
import re
import subprocess

from tests.support.paths import REPO

CALL_LIMIT = 600                  # one device command's limit (the device tool's timeout_s)
KIT_START = 60                    # the kit's wheel install and environment record

SCRIPT = REPO / "bench" / "gpu_checks.sh"
NEW_TESTS = ["tests/gpu/test_quantized_cuda.py", "tests/gpu/test_hybrid_rope_cuda.py",
             "tests/gpu/test_mla_cuda.py"]


def _clean_env() -> dict[str, str]:
    """This environment without the kit's own settings."""
    kit = ("TESTS_ONLY", "BENCH_VARIANTS", "PROFILE_VARIANTS", "BENCH_SYNC", "DS_COMMIT")
    return {k: v for k, v in os.environ.items() if not k.endswith("_LIMIT") and k not in kit}


def dry(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), "--dry-run", *args], env={**_clean_env(), **env},
                          capture_output=True, text=True, timeout=60, cwd=REPO)


def _stages(stdout: str) -> dict[str, tuple[int, int]]:
    """stage -> (limit, at most) from a dry run."""
    return {name: (int(limit), int(most)) for name, limit, most in
            re.findall(r"^stage (\w+): limit (\d+) s, at most (\d+) s$", stdout, re.M)}


def _at_most(stdout: str) -> int:
    return int(re.search(r"^at most: (\d+) s ", stdout, re.M)[1])


def test_the_script_parses():
    result = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_default_stages_say_their_limits_and_longest_runs_and_write_nothing(tmp_path):
    """Defaults: bench 240 s (two runs: the second's floor 30 s; kill grace 20 s each), profile
    180, tests 300 (first a collection of 120 s, kill grace 10, then four runs, each later
    one's floor 60 s; kill grace 30 s each): the limits sum to 720 s, the longest run to
    1240 s, over one device call."""
    out = tmp_path / "out"
    result = dry(OUT=str(out))
    assert result.returncode == 0, result.stderr
    stages = _stages(result.stdout)
    assert stages == {"bench": (240, 240 + 20 + 50), "profile": (180, 200),
                      "tests": (300, 130 + 300 + 30 + 3 * 90)}
    total = int(re.search(r"^limits sum: (\d+) s$", result.stdout, re.M)[1])
    assert total == sum(limit for limit, _ in stages.values()) == 720
    assert _at_most(result.stdout) == sum(most for _, most in stages.values()) == 1240
    assert not out.exists()


def _doc_commands() -> list[str]:
    """docs/gpu.md's kit commands that set limits (continuation lines joined)."""
    text = (REPO / "docs" / "gpu.md").read_text().replace("\\\n", " ")
    return [line.strip() for line in text.splitlines()
            if "bash bench/gpu_checks.sh" in line and "_LIMIT=" in line]


def test_the_documented_commands_run_as_written_and_fit_one_device_call():
    """Each, with --dry-run put in, parses and runs in bash as written (no placeholder read as
    a redirection), and at most takes one call's limit less the kit's start."""
    commands = _doc_commands()
    assert len(commands) >= 2
    for command in commands:
        dry_command = command.replace("bash bench/gpu_checks.sh",
                                      "bash bench/gpu_checks.sh --dry-run", 1)
        result = subprocess.run(["bash", "-c", dry_command], env=_clean_env(),
                                capture_output=True, text=True, timeout=60, cwd=REPO)
        assert result.returncode == 0 and not result.stderr, (command, result.stderr)
        assert _at_most(result.stdout) <= CALL_LIMIT - KIT_START, (command, result.stdout)


def test_each_stage_limit_is_the_one_its_function_uses():
    text = SCRIPT.read_text()
    declared = dict(re.findall(r"(\w+)=(\d+)", re.search(r"STAGE_LIMITS=\(([^)]*)\)",
                                                         text)[1]))
    assert set(declared) == {"bench", "profile", "tests", "attention", "fused", "hf"}
    for stage, limit in declared.items():
        used = set(re.findall(r"\$\{" + stage.upper() + r"_LIMIT:-(\d+)\}", text))
        assert used == {limit}, (stage, limit, used)
    result = dry("tests", "hf", TESTS_LIMIT="100")
    assert _stages(result.stdout) == {"tests": (100, 130 + 100 + 30 + 270), "hf": (240, 260)}
    assert "limits sum: 340 s" in result.stdout
    result = dry("bench", "profile", "attention", "fused", BENCH_VARIANTS="a;b",
                 PROFILE_VARIANTS=";--skip 0")          # one more run per variant entry
    assert _stages(result.stdout) == {"bench": (240, 240 + 20 + 2 * 50),
                                      "profile": (180, 180 + 20 + 50),
                                      "attention": (240, 240 + 20 + 6 * 40),
                                      "fused": (400, 400 + 20 + 3 * 50)}


def test_the_tests_stage_runs_the_new_cuda_twins_after_the_bf16_checks():
    result = dry("tests")
    runs = re.findall(r"^tests run ([\w-]+): (.*)$", result.stdout, re.M)
    assert [label for label, _ in runs] == ["engine-bf16", "session46", "cuda-modules",
                                            "marked-gpu"]
    assert runs[1][1].split() == ["-s", *NEW_TESTS]
    modules = runs[2][1].split()
    assert not set(modules) & set(NEW_TESTS + ["tests/gpu/test_engine_bf16.py"])
    for path in NEW_TESTS + modules:
        assert (REPO / path).is_file(), path


def test_unknown_stages_are_refused_by_name():
    result = dry("bogus")
    assert result.returncode == 2
    assert "unknown stage 'bogus'" in result.stderr
