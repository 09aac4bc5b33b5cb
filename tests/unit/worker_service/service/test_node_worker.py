"""NodeWorker's fencing, Init safety and stream rules over fake ranks (no model is loaded; the
Init checks read the tiny model's directory)."""
from __future__ import annotations

import json
import os
import threading

import pytest

from worker_service.config import RunnerConfig
from worker_service.failures import DoesNotFit, FailureKind, StepFailure, as_failure
from worker_service.service.init_checks import InitGuards
from worker_service.service.node_worker import NodeWorker
from tests.support.fake_ranks import LAYOUT, FakeRanks, runner_config

@pytest.fixture
def model_dir(tiny_models) -> str:
    return tiny_models("qwen3")


def _state(w: NodeWorker, ranks: FakeRanks) -> tuple:
    return (w.epoch, w.fence.epoch, w.fence.owner, ranks.num_model_loads, ranks.interrupts,
            ranks.loaded, w.readiness())


def _refused(call, kind, match: str) -> None:
    expected = StepFailure if isinstance(kind, FailureKind) else kind
    with pytest.raises(expected, match=match) as e:
        call()
    if isinstance(kind, FailureKind):
        assert e.value.kind == kind


def test_a_refused_init_leaves_model_epoch_and_owner_as_they_were(model_dir, tmp_path):
    ranks = FakeRanks()
    w = NodeWorker(ranks, LAYOUT, InitGuards(model_root=os.path.dirname(model_dir),
                                             max_message_bytes=4 << 20))
    w.init(runner_config(model_dir), LAYOUT, epoch=5, owner="A")
    before = _state(w, ranks)
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "link").symlink_to(outside)
    refusals = [
        (runner_config(model_dir), 5, StepFailure, "epoch 5 is stale: the worker's epoch is 5 "
                                             r"\(scheduler A\)"),
        (runner_config(model_dir), 3, StepFailure, "epoch 3 is stale"),
        (runner_config(model_dir), 5 + (1 << 32) + 1, StepFailure,
         r"epoch=4294967302 is invalid: must be in \[6, 4294967301\]"),
        (runner_config(model_dir), (1 << 64) - 1, StepFailure, "an epoch climbs at most 4294967296"),
        (runner_config("/etc"), 9, ValueError, "must be under this worker's --model-root"),
        (runner_config(str(tmp_path / "link")), 9, ValueError, "--model-root"),
        (runner_config(model_dir + "/../missing"), 9, ValueError, "does not exist"),
        (runner_config(model_dir, max_model_len=None, max_num_seqs=64, max_num_batched_tokens=2048),
         9, ValueError, "a step diff may take .* MiB, more than this worker's "
                        "--max-message-mib 4"),
        (runner_config(model_dir, attention_backend="flash_attn"), 9,
         (ValueError, NotImplementedError), "flash_attn"),
        (RunnerConfig(model_dir=model_dir, max_model_len=10**6), 9, ValueError,
         "max_position_embeddings"),
    ]
    for config, epoch, error, match in refusals:
        _refused(lambda: w.init(config, LAYOUT, epoch=epoch, owner="B"), error, match)
        assert _state(w, ranks) == before, (config, epoch)
    # The owner's epoch is intact: its steps still run.
    stream = w.open_stream(w.stream_key(w.epoch))
    assert w.step(stream, 5, 0, b"").payload == b"ok"


def _huge_model(model_dir: str, path) -> str:
    """The tiny model's directory with hidden_size 10^9 in config.json (issue 23: 10^7 passed
    every check and the worker was OOM-killed loading it; 10^9 is more than any machine)."""
    path.mkdir()
    for name in os.listdir(model_dir):
        if name != "config.json":
            (path / name).symlink_to(os.path.join(model_dir, name))
    config = json.loads(open(os.path.join(model_dir, "config.json")).read())
    config["hidden_size"] = 10**9
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def test_what_cannot_fit_the_machine_is_refused_before_anything_changes(model_dir, tmp_path):
    ranks = FakeRanks()
    w = NodeWorker(ranks, LAYOUT)
    w.init(runner_config(model_dir), LAYOUT, epoch=5, owner="A")
    before = _state(w, ranks)
    cases = [(runner_config(model_dir, kv_cache_bytes=2**62), r"KV cache 4294967296\.00 GiB"),
             (runner_config(_huge_model(model_dir, tmp_path / "huge")), r"weights need about \d{3,}")]
    for config, match in cases:
        _refused(lambda: w.init(config, LAYOUT, epoch=9, owner="B"), DoesNotFit,
                 match + r".* more than this machine's [\d.]+ GiB of memory")
        assert as_failure(DoesNotFit("x"), at_init=True).kind == FailureKind.DOES_NOT_FIT
        assert _state(w, ranks) == before


class FailingRanks(FakeRanks):
    """Loads fail (a checkpoint that does not load) once `fail` is set."""

    fail = False

    def load(self, config, layout):
        if self.fail:
            self.loaded = None
            raise RuntimeError("checkpoint truncated")
        return super().load(config, layout)


def test_an_overlong_scheduler_id_is_refused_before_anything_changes(model_dir):
    """One credential holder's megabyte-long id would be stored and logged with every status."""
    ranks = FakeRanks()
    w = NodeWorker(ranks, LAYOUT)
    w.init(runner_config(model_dir), LAYOUT, epoch=5, owner="A")
    before = _state(w, ranks)
    long_id = "x" * 257
    _refused(lambda: w.init(runner_config(model_dir), LAYOUT, epoch=6, owner=long_id), StepFailure,
             "scheduler_id of 257 characters is invalid: must be at most 256")
    assert _state(w, ranks) == before
    _refused(lambda: w.reset(6, long_id, w.stream_key(5)), StepFailure,
             "scheduler_id of 257 characters")
    assert _state(w, ranks) == before
    w.init(runner_config(model_dir), LAYOUT, epoch=6, owner="y" * 256)      # the limit itself is fine
    assert w.fence.owner == "y" * 256


def test_a_failed_load_leaves_the_epoch_and_owner_as_they_were(model_dir):
    """Issue 23: the epoch and owner changed before the load, which then failed."""
    ranks = FailingRanks()
    w = NodeWorker(ranks, LAYOUT)
    w.init(runner_config(model_dir), LAYOUT, epoch=5, owner="A")
    ranks.fail = True
    with pytest.raises(RuntimeError, match="checkpoint truncated"):
        w.init(runner_config(model_dir, dtype="bfloat16"), LAYOUT, epoch=9, owner="B")
    assert (w.fence.epoch, w.fence.owner, w.epoch) == (5, "A", None)
    ranks.fail = False
    w.init(runner_config(model_dir), LAYOUT, epoch=6, owner="A")     # the owner takes it back
    assert (w.fence.epoch, w.fence.owner, w.epoch) == (6, "A", 6)


def test_a_batch_too_big_for_memory_is_refused_before_anything_changes(model_dir):
    from worker_service.runner.preflight import check_batch_memory
    with pytest.raises(ValueError, match=r"max_num_seqs=8192 is invalid with max_model_len="
                                         r"1048576: .* more than half"):
        check_batch_memory(8192, 1 << 20, total_bytes=64 << 30)
    check_batch_memory(256, 32768, total_bytes=64 << 30)


def test_a_higher_epoch_takes_over_and_the_old_owner_is_fenced(model_dir):
    ranks = FakeRanks()
    w = NodeWorker(ranks, LAYOUT)
    w.init(runner_config(model_dir), LAYOUT, epoch=1, owner="A")
    a_key = w.stream_key(1)
    a = w.open_stream(a_key)
    w.step(a, 1, 0, b"")
    w.init(runner_config(model_dir), LAYOUT, epoch=2, owner="B")
    assert (w.fence.epoch, w.fence.owner) == (2, "B")
    _refused(lambda: w.step(a, 1, 1, b""), FailureKind.STALE_EPOCH,
             r"step 1 carries epoch 1, which is stale: the worker's epoch is 2 \(scheduler B\)")
    _refused(lambda: w.reset(3, "A", a_key), FailureKind.STALE_EPOCH,
             "scheduler A does not own")
    b = w.open_stream(w.stream_key(w.epoch))
    assert w.step(b, 2, 0, b"").payload == b"ok"
    assert w.reset(3, "B", w.stream_key(2)) == 0 and w.epoch == 3
    _refused(lambda: w.reset(3, "B", w.stream_key(3)), FailureKind.STALE_EPOCH,
             "epoch 3 is stale")


def test_a_new_stream_supersedes_only_with_the_current_epoch(model_dir):
    ranks = FakeRanks()
    w = NodeWorker(ranks, LAYOUT)
    w.init(runner_config(model_dir), LAYOUT, epoch=7, owner="A")
    owner = w.open_stream(w.stream_key(w.epoch))
    w.step(owner, 7, 0, b"")
    for epoch, step, kind in ((8, 0, FailureKind.EPOCH_MISMATCH),
                              (6, 0, FailureKind.STALE_EPOCH),
                              (7, 5, FailureKind.STEP_GAP)):
        wrong = w.open_stream(w.stream_key(w.epoch))    # the key, a wrong envelope
        _refused(lambda: w.step(wrong, epoch, step, b""), kind, ".")
    # Neither refused stream superseded the owner's, nor failed its epoch.
    assert w.step(owner, 7, 1, b"").payload == b"ok"
    newer = w.open_stream(w.stream_key(w.epoch))
    assert w.step(newer, 7, 2, b"").payload == b"ok"
    _refused(lambda: w.step(owner, 7, 3, b""), FailureKind.SUPERSEDED, "superseded")
    # A gap on the active stream does fail the epoch.
    _refused(lambda: w.step(newer, 7, 9, b""), FailureKind.STEP_GAP, "expected step 3")
    _refused(lambda: w.step(newer, 7, 3, b""), FailureKind.EPOCH_FAILED, "Reset or Init")


def test_reset_before_any_init_is_refused():
    w = NodeWorker(FakeRanks(), LAYOUT)
    _refused(lambda: w.reset(1, "", None), FailureKind.STALE_EPOCH, "does not own")


class SlowLoadRanks(FakeRanks):
    """Rank processes whose load waits for `release` unless interrupted (as RankGroup's does:
    an interrupt fails it SUPERSEDED and leaves the ranks to be respawned)."""

    def __init__(self):
        super().__init__()
        self.loading = threading.Event()
        self.release = threading.Event()
        self.aborted = threading.Event()

    def load(self, config, layout):
        self.loading.set()
        for _ in range(2000):                     # bounded: a broken test fails, never hangs
            if self.release.wait(0.01):
                break
            if self.aborted.is_set():
                self.aborted.clear()
                raise StepFailure(FailureKind.SUPERSEDED, "interrupted by a new Init or Reset")
        else:
            raise RuntimeError("the load was never released")
        return super().load(config, layout)

    def interrupt(self):
        super().interrupt()
        self.aborted.set()


def test_an_init_no_newer_than_one_in_progress_does_not_interrupt_it(model_dir):
    """Scheduler B takes over (epoch 2) while the old owner A is busy: B's Init interrupts A's
    step, and A re-Inits at once with max(its epoch, Info's epoch) + 1 = 2 as well, since B's
    epoch counts only once its load is done. A's Init interrupted B's load (rank processes are
    then respawned), B retried and interrupted A's: with loads longer than the schedulers'
    retry pause the two never stopped. An Init whose epoch is not above one in progress is
    refused instead, without touching it, and the one in progress completes."""
    ranks = SlowLoadRanks()
    w = NodeWorker(ranks, LAYOUT)
    ranks.release.set()
    w.init(runner_config(model_dir), LAYOUT, epoch=1, owner="A")
    ranks.release.clear()
    ranks.loading.clear()
    took_over: list = []
    newer = threading.Thread(target=lambda: took_over.append(
        w.init(runner_config(model_dir), LAYOUT, epoch=2, owner="B")))
    newer.start()
    assert ranks.loading.wait(30)
    interrupts = ranks.interrupts
    _refused(lambda: w.init(runner_config(model_dir), LAYOUT, epoch=2, owner="A"),
             FailureKind.SUPERSEDED, "an Init of epoch 2 .*is in progress")
    assert ranks.interrupts == interrupts
    ranks.release.set()
    newer.join(30)
    assert took_over and (w.fence.epoch, w.fence.owner, w.epoch) == (2, "B", 2)
    # A learns it was taken over: its next Init is stale.
    _refused(lambda: w.init(runner_config(model_dir), LAYOUT, epoch=2, owner="A"),
             FailureKind.STALE_EPOCH, "epoch 2 is stale")


def test_a_failed_reset_leaves_the_fence_as_it_was(model_dir):
    """A Reset whose ranks fail to drop their requests (a rank died) must not move the fence:
    the owner's next step then carried an epoch below it, came back STALE_EPOCH, and the
    scheduler took that for a takeover and stopped for good."""
    ranks = FakeRanks()
    w = NodeWorker(ranks, LAYOUT)
    w.init(runner_config(model_dir), LAYOUT, epoch=1, owner="A")

    def dead():
        raise StepFailure(FailureKind.RANK_FAILED, "rank 1 was killed by signal 9")
    ranks.drop_requests = dead
    _refused(lambda: w.reset(2, "A", w.stream_key(1)), FailureKind.RANK_FAILED, "killed")
    assert (w.fence.epoch, w.fence.owner) == (1, "A")
    # The epoch the Reset failed in is over (the ranks may have dropped some requests):
    # a clear failure that asks for Init, not a takeover.
    _refused(lambda: w.step(w.open_stream(w.stream_key(w.epoch)), 1, 0, b""),
             FailureKind.EPOCH_FAILED, "a Reset to epoch 2 failed")


@pytest.mark.parametrize("kind", [FailureKind.INTERNAL, FailureKind.OUT_OF_MEMORY,
                                  FailureKind.BAD_PAYLOAD])
def test_a_failed_epoch_repeats_an_exceptions_text_only_in_the_log(model_dir, kind):
    """A later step of a failed epoch is refused naming the earlier failure. An exception's
    text (INTERNAL and the kinds sent with its code) may quote a request, and the scheduler
    tells its streams that code only: the refusal names the kind; a field-naming failure is
    repeated whole."""
    ranks = FakeRanks()
    w = NodeWorker(ranks, LAYOUT)
    w.init(runner_config(model_dir), LAYOUT, epoch=1, owner="A")
    stream = w.open_stream(w.stream_key(1))
    text = "RuntimeError: row 1 quotes 'tenant-b: hunter2'"

    def fails(payload, verify, output_rank):
        raise StepFailure(kind, text)
    ranks.run_step = fails
    _refused(lambda: w.step(stream, 1, 0, b""), kind, "hunter2")     # its own reply: whole
    with pytest.raises(StepFailure) as later:
        w.step(stream, 1, 1, b"")
    assert later.value.kind == FailureKind.EPOCH_FAILED
    assert f"({kind.value}: " in str(later.value), later.value
    assert ("hunter2" in str(later.value)) == (kind == FailureKind.BAD_PAYLOAD), later.value
