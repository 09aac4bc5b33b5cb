"""`deltaserve scheduler` and `deltaserve worker` refuse a bad model directory, a --max-model-len
past the model's and an unknown --log-level as docs/cli.md says every command does: one line
`deltaserve <cmd>: error: ...`, exit status 2. They were tracebacks with exit status 1: the
scheduler without an OpenAI front ran outside the start-up error handling (serve and the
fronted scheduler did not), and --log-level went unchecked to logging.basicConfig."""
from __future__ import annotations

import pytest

from deltaserve import cli
from tests.support.sim_server import make_sim_model_dir


def _one_line_error(capsys, command: str) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert lines[-1].startswith(f"deltaserve {command}: error: "), err
    return lines[-1]


@pytest.mark.parametrize("case", ["missing model", "max-model-len"])
def test_the_scheduler_refuses_its_model_settings_in_one_line(case, tmp_path, capsys):
    model = make_sim_model_dir(tmp_path / "model")
    extra = ["--max-model-len", "999999"] if case == "max-model-len" else []
    argv = ["scheduler", "--model", str(tmp_path / "nothing") if case == "missing model"
            else str(model), "--workers", "127.0.0.1:1", "--listen", "127.0.0.1:0", *extra]
    assert cli.main(argv) == 2
    line = _one_line_error(capsys, "scheduler")
    assert ("does not exist" in line if case == "missing model"
            else "max_model_len=999999 exceeds the model's" in line), line


@pytest.mark.parametrize("level", ["LOUD", "5x"])
def test_an_unknown_log_level_is_refused_naming_the_choices(level, capsys, monkeypatch):
    def no_worker(*args, **kwargs):        # (before, under pytest's logging, it served)
        raise AssertionError("the worker was started")
    monkeypatch.setattr("worker_service.service.server.run_worker", no_worker)
    with pytest.raises(SystemExit) as stopped:
        cli.main(["worker", "--listen", "127.0.0.1:0", "--log-level", level])
    assert stopped.value.code == 2
    line = _one_line_error(capsys, "worker")
    assert "--log-level" in line and level.upper() in line and "DEBUG" in line, line


def test_the_log_level_is_case_insensitive():
    args = cli.build_parser().parse_args(["worker", "--listen", "127.0.0.1:0",
                                          "--log-level", "debug"])
    assert args.log_level == "DEBUG"
