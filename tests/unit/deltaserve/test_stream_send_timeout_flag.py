"""`--stream-send-timeout S` (scheduler and serve): the flag is spelled as the docs, the stall
status and the metric's help name it. It was derived from the field as `--stream-send-timeout-s`:
`--stream-send-timeout` then only worked as argparse's abbreviation of it, refusals named a flag
the docs never mention, and a later flag sharing the prefix would have made it ambiguous. A value
out of range is one line naming the flag, the value and the range, exit status 2."""
from __future__ import annotations

import pytest

from deltaserve import cli
from engine_common.configuration.settings import from_args, to_flags
from scheduler_service.api.api_options import ApiOptions


SCHEDULER = ["scheduler", "--model", "m", "--workers", "127.0.0.1:1"]


@pytest.mark.parametrize("command", [SCHEDULER, ["serve"]])
def test_the_flag_is_spelled_as_documented(command):
    args = cli.build_parser().parse_args(command + ["--stream-send-timeout", "5"])
    options = from_args(ApiOptions, args)
    assert options.stream_send_timeout_s == 5.0
    flags = to_flags(options)        # what `deltaserve serve` passes its scheduler
    assert flags[flags.index("--stream-send-timeout") + 1] == "5.0"


@pytest.mark.parametrize("value", ["-1", "nan"])
def test_a_timeout_out_of_range_is_one_line_naming_flag_value_and_range(value, capsys):
    assert cli.main(SCHEDULER + ["--stream-send-timeout", value]) == 2
    err = capsys.readouterr().err
    assert err.startswith("deltaserve scheduler: error: --stream-send-timeout="), err
    assert value.replace("-1", "-1.0") in err and "must be a number >= 0" in err, err
    assert len(err.strip().splitlines()) == 1


def test_a_timeout_not_a_number_names_the_flag(capsys):
    with pytest.raises(SystemExit):
        cli.main(SCHEDULER + ["--stream-send-timeout", "abc"])
    err = capsys.readouterr().err
    assert "argument --stream-send-timeout: invalid float value: 'abc'" in err, err
