"""The worker's grpc.health readiness follows a failed step: a step that leaves the ranks out of
step (a timeout, a model failure mid-collective, a symmetry divergence) makes the worker's
Health RPC say "not ready" until the next Init, and grpc.health.v1 (what a readiness probe
reads) must say the same, not SERVING from the last Init."""
from __future__ import annotations

import grpc
import pytest

from engine_common.wire.protos import worker_pb2
from worker_service.config import NodeLayout, RunnerConfig
from worker_service.failures import FailureKind, StepFailure
from engine_common.security.stream_key import STREAM_KEY_METADATA
from worker_service.service.node_worker import NodeWorker
from worker_service.service.servicer import WorkerServicer
from tests.support.fake_ranks import FakeRanks


class _OutOfStepRanks(FakeRanks):
    """Loads at once; every step fails INTERNAL and leaves the ranks out of step (as RankSet
    marks itself dirty)."""

    def __init__(self):
        super().__init__()
        self.dirty = False

    def load(self, config, layout):
        self.dirty = False
        return super().load(config, layout)

    def run_step(self, payload, verify, output_rank):
        self.dirty = True
        raise StepFailure(FailureKind.INTERNAL, "rank 1: the collective failed")

    def readiness(self):
        if not self.loaded:
            return False, "not initialized"
        return (False, "the ranks are out of step") if self.dirty else (True, "")


class _Aborted(Exception):
    pass


class _Context:
    """A Step call's context carrying the epoch's stream key."""

    def __init__(self, key: bytes):
        self.key = key

    def invocation_metadata(self):
        return ((STREAM_KEY_METADATA, self.key),)

    def abort(self, code, details):
        self.code = code
        raise _Aborted(details)


def test_a_step_that_leaves_the_ranks_out_of_step_turns_health_not_serving(tiny_models):
    node = NodeWorker(_OutOfStepRanks(), NodeLayout())
    served: list[bool] = []
    servicer = WorkerServicer(node, on_readiness=served.append)
    node.init(RunnerConfig(model_dir=tiny_models("qwen3"), max_model_len=64, block_size=4,
                           max_num_seqs=4, max_num_batched_tokens=64), NodeLayout(), epoch=1)
    served.append(True)                                   # the servicer's Init says so
    context = _Context(node.stream_key(1))
    responses = servicer.Step(iter([worker_pb2.StepRequest(epoch=1, step=0, payload=b"")]),
                              context)
    with pytest.raises(_Aborted, match="collective failed"):
        list(responses)
    assert context.code == grpc.StatusCode.INTERNAL
    assert node.readiness() == (False, "the ranks are out of step")
    assert served[-1] is False
