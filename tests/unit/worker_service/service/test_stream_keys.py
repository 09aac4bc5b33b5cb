"""The epoch's stream key at the node worker (service/stream_keys.py): every Init and Reset makes
a new one; a stream opens only with the current one; a stream opened before an epoch began cannot
step in it. The fake ranks of test_node_worker.py; the gRPC side is test_stream_key_grpc.py."""
from __future__ import annotations

import pytest

from worker_service.failures import FailureKind, StepFailure
from worker_service.service.node_worker import NodeWorker
from tests.support.fake_ranks import LAYOUT, FakeRanks, runner_config


def _refused(call, match: str) -> StepFailure:
    with pytest.raises(StepFailure, match=match) as e:
        call()
    assert e.value.kind == FailureKind.NOT_ALLOWED
    return e.value


def test_no_stream_opens_before_the_first_init():
    w = NodeWorker(FakeRanks(), LAYOUT)
    assert w.stream_key(None) == b"" and w.stream_key(0) == b""
    _refused(lambda: w.open_stream(b"x" * 32), "no epoch yet")


def test_each_epoch_has_its_own_key_and_the_last_one_is_void(tiny_models):
    w = NodeWorker(FakeRanks(), LAYOUT)
    w.init(runner_config(tiny_models("qwen3")), LAYOUT, epoch=1, owner="A")
    first = w.stream_key(1)
    assert len(first) == 32
    w.step(w.open_stream(first), 1, 0, b"")
    w.reset(2, "A", first)
    second = w.stream_key(2)
    assert w.stream_key(1) == b"" and len(second) == 32 and second != first
    w.init(runner_config(tiny_models("qwen3")), LAYOUT, epoch=3, owner="B")
    assert w.stream_key(2) == b"" and w.stream_key(3) not in (b"", first, second)
    for key, what in ((first, "the wrong"), (second, "the wrong"), (None, "no"), (b"", "no")):
        failure = _refused(lambda: w.open_stream(key), f"carries {what} stream key")
        assert "deltaserve-stream-key-bin" in str(failure)
    assert w.step(w.open_stream(w.stream_key(3)), 3, 0, b"").payload == b"ok"


def test_a_stream_opened_before_a_reset_cannot_step_in_the_new_epoch(tiny_models):
    w = NodeWorker(FakeRanks(), LAYOUT)
    w.init(runner_config(tiny_models("qwen3")), LAYOUT, epoch=1, owner="A")
    early = w.open_stream(w.stream_key(1))
    w.reset(2, "A", w.stream_key(1))
    _refused(lambda: w.step(early, 2, 0, b""), "opened before epoch 2 began")
    # Refused without failing the epoch: a stream with the new key steps at step 0.
    assert w.step(w.open_stream(w.stream_key(2)), 2, 0, b"").payload == b"ok"
    # The old stream's steps of its own epoch are stale, as before.
    with pytest.raises(StepFailure) as stale:
        w.step(early, 1, 1, b"")
    assert stale.value.kind in (FailureKind.STALE_EPOCH, FailureKind.SUPERSEDED)


def test_a_stream_keyed_by_an_impostors_init_cannot_step_in_the_owners_next_epoch(tiny_models):
    """A token holder may Init with the owner's id (Info publishes it) and so hold a key, of an
    epoch scrubbed clean; the owner's next Init starts an epoch that stream cannot step in."""
    w = NodeWorker(FakeRanks(), LAYOUT)
    w.init(runner_config(tiny_models("qwen3")), LAYOUT, epoch=1, owner="A")
    w.init(runner_config(tiny_models("qwen3")), LAYOUT, epoch=2, owner="A")      # the impostor
    impostor = w.open_stream(w.stream_key(2))
    w.init(runner_config(tiny_models("qwen3")), LAYOUT, epoch=3, owner="A")      # the owner again
    _refused(lambda: w.step(impostor, 3, 0, b""), "opened before epoch 3 began")
