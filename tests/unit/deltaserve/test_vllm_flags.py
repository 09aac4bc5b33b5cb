"""`vllm serve` command lines pasted onto `deltaserve serve` (deltaserve/vllm_flags.py): each
flag accepted with the meaning docs/cli.md's "Coming from vLLM" table gives it, or refused in one
line naming the flag, the value and what to use instead, before the model is read. Command
lines after vLLM's docs and recipes (Qwen3, Llama 3.1 tool calling, a quantized checkpoint)."""
from __future__ import annotations

import shlex

import pytest

from deltaserve import cli
from deltaserve.vllm_flags import VLLM_FLAGS, vllm_flag_problem, vllm_spellings
from engine_common.configuration.config import SchedulerConfig
from scheduler_service.api.engine_flags import engine_settings
from tests.support.paths import REPO

NO_MODEL = "/nonexistent/model"     # read only after the flags pass: its error says they did
MODEL_MISSING = f"model directory {NO_MODEL!r} does not exist"

# `vllm serve MODEL ...` lines as deployments write them, MODEL replaced by NO_MODEL.
ACCEPTED_LINES = [
    # vLLM's Qwen3 recipe: reasoning, tool calling, a long context
    "--tensor-parallel-size 1 --max-model-len 32768 --enable-auto-tool-choice "
    "--tool-call-parser qwen --reasoning-parser qwen3 --seed 0",
    # Llama 3.1 8B Instruct on one GPU, the frontend's logging flags
    "--dtype half --max-model-len 8k --gpu-memory-utilization 0.9 --max-num-seqs 64 "
    "--served-model-name llama --disable-log-requests --disable-log-stats --enforce-eager "
    "--swap-space 4 --enable-chunked-prefill --trust-remote-code --uvicorn-log-level warning",
    # a server behind a proxy, with CORS for a web UI
    "--host 127.0.0.1 --port 8000 --api-key sk-local --root-path /llm "
    "--allowed-origins '[\"https://ui.example\"]' --response-role assistant "
    "--max-num-batched-tokens 4096 --block-size 16 --max-logprobs 20 --load-format auto "
    "--tokenizer-mode auto --revision main --distributed-executor-backend mp -pp 1 -dp 1 "
    "--limit-mm-per-prompt '{\"image\":0}' --num-scheduler-steps 1 --task generate "
    "--generation-config vllm --override-generation-config {} --enable-log-requests",
]


@pytest.mark.parametrize("line", ACCEPTED_LINES)
def test_a_realistic_vllm_command_line_is_accepted_up_to_reading_the_model(line, capsys):
    assert cli.main(["serve", NO_MODEL, *shlex.split(line)]) == 2
    err = capsys.readouterr().err
    assert err == f"deltaserve serve: error: {MODEL_MISSING}\n", err


@pytest.mark.parametrize("argv,message", [
    ("-pp 2", "--pipeline-parallel-size=2 is invalid: must be 1 (no pipeline parallelism: "
     "--tensor-parallel-size)"),
    ("--data-parallel-size 4", "--data-parallel-size=4 is invalid: must be 1 (one `deltaserve "
     "serve` per replica behind a router)"),
    ("--distributed-executor-backend ray", "--distributed-executor-backend='ray' is invalid: must "
     "be mp or uni (several machines: `deltaserve worker` on each, docs/tensor-parallel.md)"),
    ("-q bitsandbytes", "--quantization='bitsandbytes' is invalid: must be fp8 or "
     "compressed-tensors or gptq or gptq_marlin or awq or awq_marlin or mxfp4 or gguf (a "
     "quantized "
     "checkpoint of that method; nothing is quantized at load)"),
    ("--enable-auto-tool-choice", "--enable-auto-tool-choice is invalid: needs "
     "--tool-call-parser (as in vLLM)"),
    ("--tokenizer-mode mistral", "--tokenizer-mode='mistral' is invalid: must be auto or hf "
     "(the model's tokenizer.json)"),
    ("--tokenizer /models/other", f"--tokenizer='/models/other' is invalid: must be the model "
     f"itself ({NO_MODEL!r}): the tokenizer is read from the model directory (copy another "
     "tokenizer's files into it)"),
    ("--revision v1.1", "--revision='v1.1' is invalid: must be main (give that revision's "
     "snapshot directory as MODEL)"),
    ("--response-role bot", "--response-role='bot' is invalid: must be assistant (chat answers "
     "have the role assistant)"),
    ("--override-generation-config '{\"temperature\":0.5}'", "--override-generation-config="
     "'{\"temperature\":0.5}' is invalid: must be {} (write them into a generation_config.json "
     "and give its directory as --generation-config DIR)"),
    ("--num-scheduler-steps 8", "--num-scheduler-steps=8 is invalid: must be 1 "
     "(--async-scheduling overlaps steps)"),
    ("--task embed", "--task='embed' is invalid: must be generate (vLLM removed --task; here: "
     "--runner pooling)"),
    ("--load-format dummy", "--load-format='dummy' is invalid: must be auto or safetensors or "
     "gguf (weights in safetensors or GGUF files)"),
    ("--allowed-origins *", "--allowed-origins='*' is invalid: must be a JSON list of origins, "
     "e.g. '[\"https://example.com\"]' or '[\"*\"]'"),
])
def test_a_vllm_flag_that_would_change_results_is_refused_in_one_line_before_the_model(
        argv, message, capsys):
    assert cli.main(["serve", NO_MODEL, *shlex.split(argv)]) == 2
    err = capsys.readouterr().err
    assert err == f"deltaserve serve: error: {message}\n", err


def test_the_tokenizer_may_name_the_model_itself():
    args = cli.build_parser().parse_args(["serve", "--model", "/m/x", "--tokenizer", "/m/x/"])
    cli._take_model_tag(args)
    assert vllm_flag_problem(args) is None


@pytest.mark.parametrize("argv,hint", [
    (["--seeds", "1"], " (did you mean --seed?)"),
    (["--trust-remote-codes"], " (did you mean --trust-remote-code?)"),
    (["--enable-auto-tools-choice"], " (did you mean --enable-auto-tool-choice?)"),
    (["--max-model-length=9"], " (did you mean --max-model-len?)"),
    (["--kv-transfer-config", "{}"], ""),        # vLLM's, no near miss: argparse's error alone
])
def test_an_unknown_flag_still_fails_with_argparse_s_error_naming_a_near_miss(
        argv, hint, capsys):
    with pytest.raises(SystemExit) as stopped:
        cli.main(["serve", NO_MODEL, *argv])
    assert stopped.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("usage: deltaserve ")
    assert err[-1] == f"deltaserve: error: unrecognized arguments: {' '.join(argv)}{hint}"


@pytest.mark.parametrize("given,expected", [
    (["--dtype", "half"], ["--dtype=float16"]), (["--dtype=float"], ["--dtype=float32"]),
    (["--max-model-len", "32k"], ["--max-model-len=32000"]),
    (["--max-model-len=32K"], ["--max-model-len=32768"]),
    (["--max-model-len", "1.5k"], ["--max-model-len=1500"]),
    (["--max-model-len", "25.6k"], ["--max-model-len=25600"]),
    (["--max-model-len", "1.5K"], ["--max-model-len=1.5K"]),     # vLLM refuses it too
    (["--max-model-len=AUTO"], []),
    (["--max-model-len", "-1"], []), (["--max-model-len=auto"], []),
    (["--max-model-len", "4096", "--seed", "3"], ["--max-model-len=4096", "--seed", "3"]),
    (["--max-model-len", "x"], ["--max-model-len=x"]),      # the flag's own error then
    # vLLM reads --max-num-batched-tokens with human_readable_int too (no -1 / auto there)
    (["--max-num-batched-tokens", "8k"], ["--max-num-batched-tokens=8000"]),
    (["--max-num-batched-tokens=2K"], ["--max-num-batched-tokens=2048"]),
    (["--max-num-batched-tokens", "-1"], ["--max-num-batched-tokens=-1"]),
    # vLLM's parser takes a flag's underscores as dashes; values keep theirs
    (["--max_model_len", "4k", "--tensor_parallel_size=1"],
     ["--max-model-len=4000", "--tensor-parallel-size=1"]),
    (["--served_model_name", "my_model", "--stop=a_b"],
     ["--served-model-name", "my_model", "--stop=a_b"]),
])
def test_vllm_spellings_of_shared_flags_values_become_ours(given, expected):
    assert vllm_spellings(["serve", *given]) == ["serve", *expected]


def test_shared_flags_read_vllm_spellings_with_vllm_s_meaning():
    """--dtype half is float16, 32K is 32768 tokens (vLLM: k decimal, K binary)."""
    args = cli.build_parser().parse_args(vllm_spellings(
        ["serve", "--model", NO_MODEL, "--dtype", "half", "--max-model-len", "32K",
         "--seed", "11"]))
    settings = engine_settings(args, NO_MODEL)
    assert settings.worker.dtype == "float16"
    assert settings.worker.max_model_len == 32768
    assert settings.policy.seed == 11


def test_a_vllm_line_with_underscored_flags_reads_as_the_dashed_one():
    """`vllm serve M --max_model_len 8k --max_num_batched_tokens 2k` (older vLLM docs) means
    what the dashed flags mean, not an unrecognized-arguments error."""
    args = cli.build_parser().parse_args(vllm_spellings(
        ["serve", NO_MODEL, "--max_model_len", "8k", "--max_num_batched_tokens", "2k",
         "--served_model_name", "my_model"]))
    settings = engine_settings(args, NO_MODEL)
    assert settings.worker.max_model_len == 8000
    assert settings.policy.max_num_batched_tokens == 2000
    assert args.served_model_name == "my_model"


def test_a_seed_out_of_range_is_refused_naming_the_flag(capsys):
    assert cli.main(["serve", NO_MODEL, "--seed", "-1"]) == 2
    err = capsys.readouterr().err
    assert err == ("deltaserve serve: error: --seed=-1 is invalid: must be an integer in "
                   f"[0, {2**63 - 1}]\n"), err


def test_every_vllm_flag_has_a_row_in_docs_cli_md():
    """The table is the user's answer: every flag we accept or refuse for vLLM is in it, with
    its class."""
    doc = (REPO / "docs" / "cli.md").read_text()
    section = doc[doc.index("## Coming from vLLM"):]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    for flag in VLLM_FLAGS:
        row = [r for r in rows if f"`{flag.names[0]}`" in r.split(" | ")[0]]
        assert len(row) == 1 and f" | {flag.kind} | " in row[0], (flag.names[0], row)
    for name in ("--seed", "--max-model-len", "--dtype", "--tensor-parallel-size",
                 "--allowed-origins"):
        assert f"`{name}" in section, name


def test_scheduler_config_seed_defaults_to_unseeded():
    assert SchedulerConfig().seed is None
