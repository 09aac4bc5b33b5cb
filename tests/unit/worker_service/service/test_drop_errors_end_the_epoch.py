"""A drop of every cached request that raises something other than a StepFailure (a CUDA error
from zeroing the KV cache, a bug) still ends the epoch, on both paths that drop: Reset and the
vanished owner's grace (service/orphan_watch.py).

Both caught only StepFailure. A Reset whose drop raised RuntimeError left the epoch running
with its requests half dropped (steps of it went on); the grace's drop raised out of its timer
thread and the epoch went on too, the vanished owner's KV possibly not zeroed, with nothing
telling a later stream why. Over fake ranks (no model is loaded)."""
from __future__ import annotations

from worker_service.failures import FailureKind
from worker_service.service.node_worker import NodeWorker
from tests.support.fake_ranks import LAYOUT, FakeRanks, runner_config
from tests.unit.worker_service.service.test_node_worker import _refused, model_dir

__all__ = ["model_dir"]     # the fixture, used by name


def _cuda_error():
    raise RuntimeError("CUDA error: an illegal memory access was encountered")


def _worker(model_dir: str) -> tuple[NodeWorker, FakeRanks, list]:
    ranks = FakeRanks()
    w = NodeWorker(ranks, LAYOUT)
    timers: list = []
    w.orphans.call_later = lambda delay_s, fn: timers.append(fn)
    w.init(runner_config(model_dir), LAYOUT, epoch=1, owner="A")
    return w, ranks, timers


def test_a_reset_whose_drop_raises_ends_the_epoch(model_dir):
    w, ranks, _ = _worker(model_dir)
    stream = w.open_stream(w.stream_key(w.epoch))
    w.step(stream, 1, 0, b"")
    ranks.drop_requests = _cuda_error
    _refused(lambda: w.reset(2, "A", w.stream_key(1)), RuntimeError, "illegal memory access")
    assert (w.fence.epoch, w.fence.owner) == (1, "A")
    _refused(lambda: w.step(stream, 1, 1, b""), FailureKind.EPOCH_FAILED,
             "internal: a Reset to epoch 2 failed: its message is in the worker's log")


def test_the_graces_drop_that_raises_ends_the_epoch(model_dir):
    w, ranks, timers = _worker(model_dir)
    stream = w.open_stream(w.stream_key(w.epoch))
    w.step(stream, 1, 0, b"")
    w.stream_ended(stream)
    ranks.drop_requests = _cuda_error
    [grace_over] = timers
    grace_over()                              # raised RuntimeError out of the timer thread
    late = w.open_stream(w.stream_key(w.epoch))
    _refused(lambda: w.step(late, 1, 1, b""), FailureKind.EPOCH_FAILED,
             r"dropping its cached requests failed \(RuntimeError: CUDA error")
