"""bench/gpu_checks.sh, the GPU kit, read without a GPU through its --dry-run: it parses, its
default stages' limits sum within the 12 minutes a device call affords them, each stage's
default limit is the one its function uses, and the tests stage runs the bf16 checks, then
session 46's CUDA twins (quickest answers first, MLA last), then the other CUDA modules, with
every file it names present."""
from __future__ import annotations

import os
import re
import subprocess

from tests.support.paths import REPO

SCRIPT = REPO / "bench" / "gpu_checks.sh"
NEW_TESTS = ["tests/gpu/test_quantized_cuda.py", "tests/gpu/test_hybrid_rope_cuda.py",
             "tests/gpu/test_mla_cuda.py"]


def dry(*args: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.endswith("_LIMIT")
             and k != "TESTS_ONLY"}
    return subprocess.run(["bash", str(SCRIPT), "--dry-run", *args], env={**clean, **env},
                          capture_output=True, text=True, timeout=60, cwd=REPO)


def test_the_script_parses():
    result = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_default_stages_fit_twelve_minutes_and_write_nothing(tmp_path):
    out = tmp_path / "out"
    result = dry(OUT=str(out))
    assert result.returncode == 0, result.stderr
    limits = dict(re.findall(r"^stage (\w+): limit (\d+) s$", result.stdout, re.M))
    assert list(limits) == ["bench", "profile", "tests"]
    total = int(re.search(r"^limits sum: (\d+) s$", result.stdout, re.M)[1])
    assert total == sum(map(int, limits.values())) <= 12 * 60
    assert not out.exists()


def test_each_stage_limit_is_the_one_its_function_uses():
    text = SCRIPT.read_text()
    declared = dict(re.findall(r"(\w+)=(\d+)", re.search(r"STAGE_LIMITS=\(([^)]*)\)",
                                                         text)[1]))
    assert set(declared) == {"bench", "profile", "tests", "attention", "fused", "hf"}
    for stage, limit in declared.items():
        used = set(re.findall(r"\$\{" + stage.upper() + r"_LIMIT:-(\d+)\}", text))
        assert used == {limit}, (stage, limit, used)
    result = dry("tests", "hf", TESTS_LIMIT="100")
    assert "stage tests: limit 100 s" in result.stdout and "limits sum: 340 s" in result.stdout


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
