"""`deltaserve generate` and `deltaserve chat` given a flag its request field cannot hold (a
negative --max-tokens, a --seed past uint64, --token-ids that are not ids) or a key file that is
not there: one line naming the flag and the range, exit status 2, before anything is sent.
protobuf's bare ValueError ("Value out of range") was a traceback."""
from __future__ import annotations

import pytest

from deltaserve import cli

NOWHERE = "127.0.0.1:9"        # never dialled: the flags are refused first


@pytest.mark.parametrize("argv,message", [
    (["chat", "--max-tokens", "-1", "hi"],
     "--max-tokens=-1 is invalid: must be an integer in [0, 4294967295]"),
    (["chat", "--top-k", str(2**31)], f"--top-k={2**31} is invalid: must be an integer in "
                                       f"[{-2**31}, {2**31 - 1}]"),
    (["generate", "--seed", "-1", "hi"],
     f"--seed=-1 is invalid: must be an integer in [0, {2**64 - 1}]"),
    (["generate", "--min-tokens", str(2**32), "hi"],
     f"--min-tokens={2**32} is invalid: must be an integer in [0, {2**32 - 1}]"),
    (["generate", "--token-ids", "5,x"],
     "--token-ids='5,x' is invalid: must be comma-separated token ids"),
    (["generate", "--token-ids", "5,-3"],
     "--token-ids=-3 is invalid: must be an integer in [0, 4294967295]"),
    (["chat", "--api-key-file", "/nonexistent/key", "hi"],
     "No such file or directory: '/nonexistent/key'"),
    # no prompt: sent as is, the server's "prompt='none given'" came back, after a round trip
    (["generate"], "prompt='none given' is invalid: must be a prompt text (the argument) or "
     "--token-ids"),
    # no deadline: 0, -1 and inf gave DEADLINE_EXCEEDED at once (exit 1), nan no deadline
    (["generate", "--timeout", "0", "hi"], "--timeout=0.0 is invalid: must be a finite number of "
     "seconds > 0"),
    (["chat", "--timeout", "-1", "hi"], "--timeout=-1.0 is invalid: must be a finite number of "
     "seconds > 0"),
    (["generate", "--timeout", "inf", "hi"], "--timeout=inf is invalid: must be a finite "
     "number of seconds > 0"),
    (["chat", "--timeout", "nan", "hi"], "--timeout=nan is invalid: must be a finite number of "
     "seconds > 0"),
])
def test_a_flag_its_field_cannot_hold_is_one_line_naming_it(argv, message, capsys):
    assert cli.main([argv[0], "--target", NOWHERE] + argv[1:]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"deltaserve {argv[0]}: error: ") and message in err, err
    assert len(err.strip().splitlines()) == 1
