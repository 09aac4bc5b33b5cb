"""`--worker-orphan-grace S` (the worker's, and serve's for its worker): how long a worker keeps
an epoch's requests and KV cache after the epoch's Step stream ended (service/orphan_watch.py).
It was a constant (60 s): an operator could neither shorten how long a dead scheduler's tenants'
data stays nor lengthen it for a scheduler that reconnects slowly. A value out of range is one
line naming the flag, the value and the range, exit status 2."""
from __future__ import annotations

import pytest

from deltaserve import cli
from engine_common.configuration.config import WorkerServiceOptions
from engine_common.configuration.settings import from_args, to_flags
from worker_service.config import NodeLayout
from worker_service.service.node_worker import NodeWorker
from worker_service.service.orphan_watch import ORPHAN_GRACE_S
from tests.support.fake_ranks import FakeRanks, runner_config


@pytest.mark.parametrize("value", ["0", "-5", "3600.5", "nan"])
def test_a_grace_out_of_range_is_one_line_naming_flag_value_and_range(value, capsys):
    assert cli.main(["worker", "--listen", "127.0.0.1:0", "--worker-orphan-grace", value]) == 2
    err = capsys.readouterr().err
    assert err.startswith("deltaserve worker: error: --worker-orphan-grace="), err
    assert value in err and "must be in (0, 3600.0]" in err, err
    assert len(err.strip().splitlines()) == 1


def test_the_flag_reaches_the_worker_and_serve_passes_it_on():
    args = cli.build_parser().parse_args(["worker", "--listen", "127.0.0.1:0",
                                        "--worker-orphan-grace", "5"])
    options = from_args(WorkerServiceOptions, args)
    assert options.orphan_grace_s == 5.0
    assert WorkerServiceOptions().orphan_grace_s == ORPHAN_GRACE_S == 60.0
    # `deltaserve serve` starts its worker with to_flags(options) (embedded.start_worker).
    assert to_flags(options)[-2:] == ["--worker-orphan-grace", "5.0"]
    serve = cli.build_parser().parse_args(["serve", "--worker-orphan-grace", "7"])
    assert from_args(WorkerServiceOptions, serve).orphan_grace_s == 7.0


def test_the_grace_is_what_the_orphan_watch_waits(tiny_models):
    delays: list[float] = []
    w = NodeWorker(FakeRanks(), NodeLayout(), orphan_grace_s=5.0)
    w.orphans.call_later = lambda delay_s, fn: delays.append(delay_s)
    w.init(runner_config(tiny_models("qwen3")), NodeLayout(), epoch=1, owner="A")
    stream = w.open_stream(w.stream_key(1))
    w.step(stream, 1, 0, b"")
    w.stream_ended(stream)
    assert delays == [5.0]
