"""worker_service/batch/diff_check.py through a real ModelRunner: every garbage payload kind is
refused as BAD_PAYLOAD (a bad value) or BAD_STATE (a handle the cache does not have) naming what
is wrong, before any of it is applied; never INTERNAL; and after a reset the runner gives the
same tokens as a fresh one."""
from __future__ import annotations

import pytest

from engine_common.constraints.constraint import Constraint
from engine_common.wire.codec import decode_scheduler_output
from engine_common.wire.diff import NO_LOGPROBS, SchedulerOutput
from engine_common.request.diff_limits import MAX_CONSTRAINT_DEPTH
from engine_common.request.params import SamplingParams, WorkerSamplingParams
from tests.support.deep_constraints import lark_chain
from tests.support.garbage_diffs import Limits, PREFILL, clean_run, enc, garbage_cases, new
from worker_service.config import RunnerConfig
from worker_service.failures import FailureKind, as_failure
from worker_service.batch.diff_check import BadDiff, DiffBounds, check_diff
from worker_service.runner.model_runner import ModelRunner

LIMITS = dict(block_size=4, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64)
NUM_BLOCKS = 64
NAMES = [c.name for c in garbage_cases(Limits(NUM_BLOCKS, 512, 64, 4, 4, 64))]
# Kinds caught when the step's inputs are built (step_inputs.py), after the diff is applied.
INPUT_CHECKED = ("tokens beyond the known ones", "a decode past max_model_len")


def _runner(model_dir: str) -> ModelRunner:
    runner = ModelRunner(RunnerConfig(model_dir=model_dir, dtype="float32", **LIMITS))
    runner.init_kv_cache(NUM_BLOCKS)
    return runner


@pytest.fixture(scope="module")
def runner(tiny_models) -> ModelRunner:
    return _runner(tiny_models("qwen3"))


def _limits(runner: ModelRunner) -> Limits:
    return Limits(NUM_BLOCKS, runner.vocab_size, runner.max_model_len, runner.block_size,
                  LIMITS["max_num_seqs"], LIMITS["max_num_batched_tokens"])


def test_there_are_at_least_35_kinds():
    assert len(NAMES) == len(set(NAMES)) >= 35


@pytest.fixture(scope="module")
def cases(runner) -> dict:
    return {c.name: c for c in garbage_cases(_limits(runner))}


@pytest.mark.parametrize("name", NAMES)
def test_garbage_is_refused_as_a_bad_payload_before_it_is_applied(runner, cases, name):
    case = cases[name]
    runner.reset()
    for payload in case.payloads[:-1]:
        runner.execute(payload)
    before = (dict(runner.batch.handle_to_row), set(runner.requests), runner.last_step)
    with pytest.raises(Exception) as err:
        runner.execute(case.garbage)
    failure = as_failure(err.value)
    assert failure.kind in (FailureKind.BAD_PAYLOAD, FailureKind.BAD_STATE), failure
    assert len(str(failure)) > 20, failure
    if name not in INPUT_CHECKED:
        assert (dict(runner.batch.handle_to_row), set(runner.requests),
                runner.last_step) == before, "the diff was (partly) applied"


def test_a_reset_after_garbage_gives_a_clean_epoch(runner, cases, tiny_models):
    for case in cases.values():
        runner.reset()
        for payload in case.payloads:
            try:
                runner.execute(payload)
            except Exception:
                break
    runner.reset()
    fresh = _runner(tiny_models("qwen3"))
    got = [runner.execute(p).sampled_token_ids for p in clean_run()]
    want = [fresh.execute(p).sampled_token_ids for p in clean_run()]
    assert got == want and all(got)


def _bounds(**overrides) -> DiffBounds:
    values = dict(num_kv_blocks=10, vocab_size=100, max_model_len=32, max_num_seqs=2,
                  max_num_batched_tokens=16, block_size=4, max_blocks_per_request=8,
                  max_cached_requests=6)
    return DiffBounds(**{**values, **overrides})


def test_messages_name_the_field_the_value_and_the_range():
    import numpy as np
    cases = [
        (SchedulerOutput(0, new_requests=[new(blocks=[0, 10])]),
         r"new_requests\[0\]\.block_ids\[1\]=10 is invalid: must be < num_kv_blocks \(10\)"),
        (SchedulerOutput(0, new_requests=[new(prompt=[1, 100])]),
         r"new_requests\[0\]\.prompt_token_ids\[1\]=100 is invalid: must be < vocab_size"),
        (SchedulerOutput(0, new_requests=[new(h, blocks=[h]) for h in range(3)]),
         r"requests in the batch=3 is invalid: must be <= max_num_seqs \(2\)"),
        (SchedulerOutput(0, new_requests=[new(sampling=WorkerSamplingParams(
            SamplingParams(allowed_token_ids=[3, 100]), seed=0))]),
         r"new_requests\[0\]\.sampling\.allowed_token_ids\[1\]=100 is invalid: must be < "
         r"vocab_size"),
    ]
    for diff, message in cases:
        with pytest.raises(BadDiff, match=message):
            check_diff(diff, _bounds(), {}, {}, np.zeros(2, dtype=np.int32))


def test_no_logprobs_passes_the_codec_and_the_check_and_below_it_is_refused():
    import numpy as np
    diff = SchedulerOutput(0, new_requests=[new(logprobs=NO_LOGPROBS)])
    assert decode_scheduler_output(enc(diff)) == diff
    check_diff(diff, _bounds(), {}, {}, np.zeros(2, dtype=np.int32))
    with pytest.raises(BadDiff, match=r"new_requests\[0\]\.num_logprobs=-2 is invalid: must be "
                                      r"in \[-1, 100\]"):
        check_diff(SchedulerOutput(0, new_requests=[new(logprobs=-2)]), _bounds(), {}, {},
                   np.zeros(2, dtype=np.int32))


def test_a_handle_recycled_in_the_same_diff_is_accepted():
    """finished_handles are applied before new_requests: a handle may be finished and reused by
    a new request in one diff, as the scheduler recycles them."""
    import numpy as np
    from worker_service.batch.input_batch import CachedRequestState
    cached = {0: CachedRequestState(0, [1, 2], None, [0], 0)}
    diff = SchedulerOutput(1, finished_handles=[0], new_requests=[new(0, blocks=[1])])
    check_diff(diff, _bounds(), cached, {0: 0}, np.ones(2, dtype=np.int32))
    assert enc(diff) and PREFILL


def test_finishing_a_preempted_request_frees_no_seat_in_the_batch():
    """Issue 31: a preempted request (cached, no row) that finishes was counted as leaving the
    batch, so a full batch took one more request and overflowed as the diff was applied."""
    import numpy as np
    from worker_service.batch.input_batch import CachedRequestState
    cached = {h: CachedRequestState(h, [1, 2], None, [h], 0) for h in range(3)}
    running = {0: 0, 2: 1}                        # handle 1 is preempted
    diff = SchedulerOutput(3, finished_handles=[1], new_requests=[new(3, blocks=[5])])
    with pytest.raises(BadDiff, match=r"requests in the batch=3 is invalid: must be <= "
                                      r"max_num_seqs \(2\)"):
        check_diff(diff, _bounds(), cached, running, np.ones(2, dtype=np.int32))
    check_diff(SchedulerOutput(3, finished_handles=[0], new_requests=[new(3, blocks=[5])]),
               _bounds(), cached, running, np.ones(2, dtype=np.int32))   # a running one does


def test_a_constraint_too_deep_names_its_depth_and_the_bound():
    import numpy as np
    deep = Constraint("grammar", lark_chain(3000))
    with pytest.raises(BadDiff, match=r"new_requests\[0\]\.constraint depth=3002 is invalid: "
                                      rf"must be <= {MAX_CONSTRAINT_DEPTH}"):
        check_diff(SchedulerOutput(0, new_requests=[new(constraint=deep)]), _bounds(), {}, {},
                   np.zeros(2, dtype=np.int32))


def _cached(handles) -> dict:
    from worker_service.batch.input_batch import CachedRequestState
    return {h: CachedRequestState(h, [1, 2], None, [], 0) for h in handles}


def test_a_diff_that_would_cache_too_many_requests_is_refused():
    """Preempted requests stay cached (no KV blocks): without a bound a token holder grew the
    cache by max_num_seqs requests a step. 2 running + 3 preempted (bound 6): two more new
    requests would make 7."""
    import numpy as np
    cached, running = _cached(range(5)), {0: 0, 1: 1}
    grow = SchedulerOutput(5, preempted_handles=[0, 1], new_requests=[new(5), new(6)])
    with pytest.raises(BadDiff, match=r"cached requests after the diff=7 is invalid: must be "
                                      r"<= 6 \(max_num_seqs 2 \+ the scheduler's most waiting"):
        check_diff(grow, _bounds(), cached, running, np.ones(2, dtype=np.int32))
    # Finishing one first leaves room: 6 is allowed.
    check_diff(SchedulerOutput(5, finished_handles=[4], preempted_handles=[0, 1],
                               new_requests=[new(5), new(6)]),
               _bounds(), cached, running, np.ones(2, dtype=np.int32))


def test_leaving_lists_are_bounded_by_count_before_any_handle_is_looked_at():
    import numpy as np
    for diff, message in (
            (SchedulerOutput(0, finished_handles=list(range(7))),
             r"finished_handles length=7 is invalid: must be <= max_cached_requests \(6\)"),
            (SchedulerOutput(0, preempted_handles=[0] * 3),
             r"preempted_handles length=3 is invalid: must be <= max_num_seqs \(2\)")):
        with pytest.raises(BadDiff, match=message):       # a handle check would say BAD_STATE
            check_diff(diff, _bounds(), _cached(range(7)), {0: 0, 1: 1},
                       np.ones(2, dtype=np.int32))


def test_a_decoded_prompt_out_of_vocab_is_named_by_index_and_value():
    """The codec hands the worker a prompt as a numpy uint32 array: the check still names the
    first id out of range, its index and the bound, as for a list."""
    import numpy as np
    diff = decode_scheduler_output(enc(SchedulerOutput(0, new_requests=[
        new(prompt=[1, 99, 100, 7, 250])])))
    assert isinstance(diff.new_requests[0].prompt_token_ids, np.ndarray)
    with pytest.raises(BadDiff, match=r"new_requests\[0\]\.prompt_token_ids\[2\]=100 is "
                                      r"invalid: must be < vocab_size \(100\)"):
        check_diff(diff, _bounds(), {}, {}, np.zeros(2, dtype=np.int32))
    ok = decode_scheduler_output(enc(SchedulerOutput(0, new_requests=[new(prompt=[1, 99])])))
    check_diff(ok, _bounds(), {}, {}, np.zeros(2, dtype=np.int32))


def test_the_unnamed_pass_accepts_clean_new_requests_and_refuses_each_bad_field():
    """_new_fits (no field names built) passes a clean decoded new request, once per params
    object for the knobs; for each field out of range it defers to the named check, which
    refuses it naming the field (the garbage kinds above check the refusals end to end)."""
    import numpy as np
    from worker_service.batch import diff_check
    from worker_service.batch.diff_check import _View, _new_fits

    blocks = np.zeros(2, dtype=np.int32)
    sampling = WorkerSamplingParams(SamplingParams(top_k=5, logit_bias={7: 1.0}), seed=3,
                                    stop_ids=(9,))
    good = decode_scheduler_output(enc(SchedulerOutput(0, new_requests=[
        new(prompt=[1, 99], blocks=(0, 9), sampling=sampling)]))).new_requests[0]
    assert _new_fits(good, _bounds(), _View({}, {}, blocks))
    assert diff_check._KNOBS_FIT.get(good.sampling.sampling) == 100
    large = WorkerSamplingParams(SamplingParams(allowed_token_ids=range(50)), seed=0)
    assert _new_fits(new(prompt=[1, 99], blocks=(0, 9), sampling=large), _bounds(),
                     _View({}, {}, blocks))
    assert large.sampling not in diff_check._KNOBS_FIT, "large params are not pinned"
    bad = {"handle": dict(handle=-1), "block_ids": dict(blocks=(0, 10)),
           "num_computed_tokens": dict(computed=4), "num_logprobs": dict(logprobs=101),
           "sampling.logit_bias": dict(sampling=WorkerSamplingParams(
               SamplingParams(logit_bias={100: 1.0}), seed=0)),
           "sampling.stop_ids": dict(sampling=WorkerSamplingParams(SamplingParams(), seed=0,
                                                                   stop_ids=(100,)))}
    for field, change in bad.items():
        request = new(**{"prompt": [1, 99], "blocks": (0, 9), **change})
        assert not _new_fits(request, _bounds(), _View({}, {}, blocks)), field
        with pytest.raises(BadDiff, match=rf"new_requests\[0\]\.{field}"):
            check_diff(SchedulerOutput(0, new_requests=[request]), _bounds(), {}, {}, blocks)
