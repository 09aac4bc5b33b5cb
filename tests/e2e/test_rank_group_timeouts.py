"""A step or control call that only some ranks answer must fail, never count as a success.

Real rank processes (gloo on CPU) behind a RankGroup driven by a NodeWorker: rank 1 is stopped with
SIGSTOP after Init, so rank 0 answers a Reset (no collective) and rank 1 never does.
"""
from __future__ import annotations

import os
import signal

import pytest

from tests.support.grpc_harness import wait_stopped
from worker_service.config import NodeLayout, RunnerConfig
from worker_service.failures import StepFailure
from worker_service.ranks.rank_group import RankGroup, RankGroupOptions
from worker_service.service.node_worker import NodeWorker


def test_reply_missing_from_one_rank_fails_the_call(tiny_models):
    layout = NodeLayout(tp_size=2, num_local_ranks=2)
    worker = NodeWorker(RankGroup("cpu", layout, RankGroupOptions(control_timeout_s=1.5)), layout)
    config = RunnerConfig(model_dir=tiny_models("qwen3"), num_kv_blocks=32, max_num_seqs=4,
                          max_num_batched_tokens=64)
    victim = None
    try:
        worker.init(config, layout, epoch=1)
        assert worker.reset(2, "", worker.stream_key(1)) == 0       # both ranks answer
        victim = worker.ranks.rank_set.pids[1]
        os.kill(victim, signal.SIGSTOP)
        wait_stopped(victim)
        with pytest.raises(StepFailure) as failure:   # at the 1.5 s control timeout
            worker.reset(3, "", worker.stream_key(2))
        assert failure.value.kind.name == "RANK_FAILED"
        assert "[1]" in str(failure.value), str(failure.value)
        ready, why = worker.readiness()
        assert not ready and "out of step" in why
    finally:
        if victim is not None:
            os.kill(victim, signal.SIGCONT)
        worker.close()
