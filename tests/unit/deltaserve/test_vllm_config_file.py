"""`deltaserve serve --config FILE` (deltaserve/vllm_config_file.py): vLLM's YAML file of flags.
Each key acts as the same flag on the command line (its value checked and spelled alike), the
command line wins over the file, and a file we cannot use is refused in one line naming it."""
from __future__ import annotations

import pytest

from deltaserve import cli

NO_MODEL = "/nonexistent/model"     # read only after the flags pass: its error says they did


@pytest.fixture
def served(monkeypatch):
    """The namespace `serve` would start with, instead of starting it."""
    import deltaserve.embedded as embedded
    seen = {}

    def capture(args):
        seen["args"] = args
        return 0
    monkeypatch.setattr(embedded, "serve", capture)
    return seen


def _write(tmp_path, text: str) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return str(path)


# vLLM's docs' example, and values of every kind: its spellings (8k, half, underscores), a
# switch on and off, a list flag, a JSON flag written as a YAML mapping.
CONFIG = f"""\
model: {NO_MODEL}
host: "127.0.0.1"
port: 6379
max_model_len: 8k
dtype: half
enable-prefix-caching: false
async-scheduling: true
served-model-name: [llama, l3]
speculative-config: {{method: ngram, num_speculative_tokens: 3, prompt_lookup_max: 4}}
"""


def test_each_key_becomes_its_flag_with_vllm_s_spellings(tmp_path, served):
    assert cli.main(["serve", "--config", _write(tmp_path, CONFIG)]) == 0
    args = served["args"]
    assert args.model == NO_MODEL
    assert (args.host, args.port) == ("127.0.0.1", 6379)
    assert args.max_model_len == 8000 and args.dtype == "float16"
    assert args.enable_prefix_caching is False and args.async_scheduling is True
    assert (args.served_model_name, args.model_aliases) == ("llama", ("l3",))
    assert args.speculative_config == ('{"method": "ngram", "num_speculative_tokens": 3, '
                                       '"prompt_lookup_max": 4}')


def test_the_command_line_wins_over_the_file(tmp_path, served):
    path = _write(tmp_path, CONFIG)
    argv = ["serve", "other/model", f"--config={path}", "--max_model_len", "1024",
            "--served-model-name", "x", "--enable-prefix-caching"]
    assert cli.main(argv) == 0
    args = served["args"]
    assert args.model == "other/model"          # serve MODEL over the file's model
    assert args.max_model_len == 1024 and args.served_model_name == "x"
    assert args.model_aliases == () and getattr(args, "enable_prefix_caching", True) is True
    assert args.port == 6379                    # what only the file gives still holds


def test_the_file_s_values_are_checked_as_the_command_line_s(tmp_path, capsys):
    path = _write(tmp_path, f"model: {NO_MODEL}\npipeline-parallel-size: 2\n")
    assert cli.main(["serve", "--config", path]) == 2
    assert capsys.readouterr().err == ("deltaserve serve: error: --pipeline-parallel-size=2 is "
                                       "invalid: must be 1 (no pipeline parallelism: "
                                       "--tensor-parallel-size)\n")
    path = _write(tmp_path, f"model: {NO_MODEL}\nmax-num-seqs: 8\n")
    assert cli.main(["serve", "--config", path]) == 2      # good flags: on to the model
    assert capsys.readouterr().err == (f"deltaserve serve: error: model directory {NO_MODEL!r} "
                                       "does not exist\n")


@pytest.mark.parametrize("text, message", [
    ("max-modle-len: 10\n", "key 'max-modle-len' is not a flag of `deltaserve serve` (did you "
     "mean --max-model-len?)"),
    ("- a\n- b\n", "must be a YAML mapping of flag names to values (it holds a list)"),
    ("async-scheduling: 3\n", "async-scheduling: 3 must be true or false (--async-scheduling is "
     "a switch)"),
    ("port: [1, 2]\n", "port: a list, but --port takes one value"),
    ("port:\n", "port has no value"),
    ("a: [\n", "not YAML (line 2): expected the node content, but found '<stream end>'"),
    ("config: other.yaml\n", "key 'config': a config file cannot name another"),
])
def test_a_file_we_cannot_use_is_refused_naming_it(tmp_path, capsys, text, message):
    path = _write(tmp_path, text)
    assert cli.main(["serve", "--config", path]) == 2
    assert capsys.readouterr().err == (f"deltaserve serve: error: --config={path!r} is "
                                       f"invalid: {message}\n")


def test_a_missing_file_or_a_second_config_is_refused(tmp_path, capsys):
    missing = str(tmp_path / "none.yaml")
    assert cli.main(["serve", "--config", missing]) == 2
    assert capsys.readouterr().err == (f"deltaserve serve: error: --config={missing!r} is "
                                       "invalid: No such file or directory\n")
    path = _write(tmp_path, "port: 1\n")
    assert cli.main(["serve", "--config", path, "--config", path]) == 2
    assert "must be given once" in capsys.readouterr().err
    assert cli.main(["serve", "--config"]) == 2
    assert "--config needs a FILE" in capsys.readouterr().err


def test_an_empty_file_changes_nothing(tmp_path, served):
    assert cli.main(["serve", NO_MODEL, "--config", _write(tmp_path, "")]) == 0
    assert served["args"].model == NO_MODEL
