"""Two schedulers racing for one worker: an Init that turns out stale must not interrupt the
newer owner.

The displaced scheduler A re-Inits at once (its step was interrupted) with the epoch the newer
scheduler B is loading. A's Init passed the fence while B's load was still running, then spent
its Init checks (config.json, preflight, the memory estimate) while B finished. A then claimed
the epoch (B's claim was released), interrupted the ranks and only under the lock found its
epoch stale. A rank group's interrupt stays set until the next load or Reset, so B's next step
was aborted as "interrupted by a new Init or Reset", its ranks marked out of step and respawned
(a model reload on every GPU) because of a refused Init. Now the claim checks the fence too, and
interrupts only while it holds the claim."""
from __future__ import annotations

import threading

import pytest

from worker_service.config import NodeLayout, RunnerConfig
from worker_service.failures import FailureKind, StepFailure
from worker_service.service import node_worker
from worker_service.service.node_worker import NodeWorker
from tests.support.fake_ranks import FakeRanks
from tests.unit.worker_service.service.test_node_worker import SlowLoadRanks

LAYOUT = NodeLayout()


class StickyInterruptRanks(FakeRanks):
    """Rank processes as RankGroup drives them: an interrupt stays set until the next load or
    drop_requests, and a step that finds it set is aborted."""

    def __init__(self):
        super().__init__()
        self.interrupted = False

    def interrupt(self):
        super().interrupt()
        self.interrupted = True

    def load(self, config, layout):
        self.interrupted = False
        return super().load(config, layout)

    def drop_requests(self):
        self.interrupted = False
        return 0

    def run_step(self, payload, verify, output_rank):
        if self.interrupted:
            raise StepFailure(FailureKind.SUPERSEDED, "interrupted by a new Init or Reset")
        return super().run_step(payload, verify, output_rank)


def runner_config(model_dir: str) -> RunnerConfig:
    return RunnerConfig(model_dir=model_dir, max_model_len=64, block_size=4, max_num_seqs=4,
                        max_num_batched_tokens=64)


def test_an_init_found_stale_after_its_checks_leaves_the_new_owner_running(tiny_models,
                                                                            monkeypatch):
    config = runner_config(tiny_models("qwen3"))
    ranks = StickyInterruptRanks()
    w = NodeWorker(ranks, LAYOUT)
    w.init(config, LAYOUT, epoch=1, owner="A")
    checks = node_worker.check_init
    newer_done = []

    def checks_while_b_takes_over(*args):
        checks(*args)
        if not newer_done:                  # A's checks: B's whole Init happens meanwhile
            newer_done.append("B")
            w.init(config, LAYOUT, epoch=2, owner="B")

    monkeypatch.setattr(node_worker, "check_init", checks_while_b_takes_over)
    interrupts_before = ranks.interrupts
    with pytest.raises(StepFailure, match="epoch 2 is stale") as refused:
        w.init(config, LAYOUT, epoch=2, owner="A")
    assert refused.value.kind == FailureKind.STALE_EPOCH
    assert newer_done and (w.fence.epoch, w.fence.owner, w.epoch) == (2, "B", 2)
    # B's steps run: A's refused Init left nothing behind.
    b = w.open_stream(w.stream_key(w.epoch))
    assert w.step(b, 2, 0, b"").payload == b"ok"
    assert w.step(b, 2, 1, b"").payload == b"ok"
    assert ranks.interrupts == interrupts_before + 1      # B's Init alone


def test_a_reset_refused_as_stale_does_not_interrupt(tiny_models):
    config = runner_config(tiny_models("qwen3"))
    ranks = StickyInterruptRanks()
    w = NodeWorker(ranks, LAYOUT)
    w.init(config, LAYOUT, epoch=1, owner="A")
    a_key = w.stream_key(1)
    w.init(config, LAYOUT, epoch=2, owner="B")
    interrupts_before = ranks.interrupts
    with pytest.raises(StepFailure, match="scheduler A does not own"):
        w.reset(3, "A", a_key)
    assert ranks.interrupts == interrupts_before
    assert w.step(w.open_stream(w.stream_key(w.epoch)), 2, 0, b"").payload == b"ok"


def test_the_owners_reset_does_not_interrupt_a_takeover_in_progress(tiny_models):
    """A (the owner) resets after a late step while B's Init is loading: the Reset interrupted
    B's load (B failed and retried, as in the livelock the claims end). It is refused
    SUPERSEDED instead; B's load completes and A is then fenced."""
    config = runner_config(tiny_models("qwen3"))
    ranks = SlowLoadRanks()
    w = NodeWorker(ranks, LAYOUT)
    ranks.release.set()
    w.init(config, LAYOUT, epoch=1, owner="A")
    a_key = w.stream_key(1)
    ranks.release.clear()
    ranks.loading.clear()
    took_over: list = []
    newer = threading.Thread(target=lambda: took_over.append(
        w.init(config, LAYOUT, epoch=2, owner="B")))
    newer.start()
    assert ranks.loading.wait(30)
    interrupts = ranks.interrupts
    for epoch in (2, 3):
        with pytest.raises(StepFailure, match="an Init of epoch 2 .*is in progress") as refused:
            w.reset(epoch, "A", a_key)
        assert refused.value.kind == FailureKind.SUPERSEDED
    assert ranks.interrupts == interrupts
    ranks.release.set()
    newer.join(30)
    assert took_over and (w.fence.epoch, w.fence.owner, w.epoch) == (2, "B", 2)
    with pytest.raises(StepFailure, match="scheduler A does not own"):
        w.reset(3, "A", a_key)
