"""min_tokens masks eos even with ignore_eos, as vLLM does: its SamplingParams.all_stop_token_ids
holds eos whatever ignore_eos says (update_from_generation_config adds it "to support min_tokens
processing"), and its min_tokens logits processor masks all_stop_token_ids. ignore_eos only keeps
a sampled eos from ending the request. A request whose allowed ids min_tokens would all mask is
refused at admission."""
from __future__ import annotations

import pytest

from engine_common.request.params import SamplingParams
from scheduler_service.core.request import RequestStatus
from scheduler_service.core.scheduler import RequestRejected
from tests.support.scheduler_sim import assert_no_leak, make, make_request, step


def _worker_stop_ids(sched, worker, request) -> tuple[int, ...]:
    sched.add_request(request)
    out, _ = step(sched, worker)
    (new,) = out.new_requests
    return new.sampling.stop_ids


def test_ignore_eos_still_masks_eos_until_min_tokens():
    sched, worker = make()
    ignoring = make_request("ignoring", [3, 4], min_tokens=3, ignore_eos=True,
                            stop_token_ids=(9,))
    assert _worker_stop_ids(sched, worker, ignoring) == (2, 9)
    assert ignoring.stop_token_ids == (9,)          # eos does not stop it
    sched.finish_requests("ignoring", RequestStatus.FINISHED_ABORTED)
    assert_no_leak(sched)


def test_without_ignore_eos_the_masked_ids_are_unchanged():
    sched, worker = make()
    plain = make_request("plain", [3, 4], min_tokens=3, stop_token_ids=(9, 2))
    assert _worker_stop_ids(sched, worker, plain) == (2, 9)
    assert plain.stop_token_ids == (2, 9)
    sched.finish_requests("plain", RequestStatus.FINISHED_ABORTED)


def test_an_eos_sampled_after_min_tokens_with_ignore_eos_does_not_stop():
    sched, worker = make(sample_fn=lambda state: 2)     # the model always wants eos
    request = make_request("r", [3, 4], max_tokens=5, min_tokens=2, ignore_eos=True)
    sched.add_request(request)
    while not request.finished:
        step(sched, worker)
    assert request.output_token_ids == [2] * 5
    assert request.status == RequestStatus.FINISHED_LENGTH


def test_allowed_ids_that_min_tokens_masks_all_are_refused_at_admission():
    """Every allowed id a stop id (eos counts, ignore_eos or not) and min_tokens > 0: no id could
    be sampled before min_tokens (every logit -inf, the argmax a silent id 0)."""
    sched, _ = make()
    for ignore_eos in (False, True):
        request = make_request(f"r{ignore_eos}", [3, 4], min_tokens=2, ignore_eos=ignore_eos,
                               stop_token_ids=(9,))
        request.sampling = SamplingParams(seed=1, allowed_token_ids=(2, 9))
        with pytest.raises(RequestRejected, match=r"allowed_token_ids=\[2, 9\] must be not "
                                                  "only eos and stop_token_ids"):
            sched.add_request(request)
    fine = make_request("fine", [3, 4], min_tokens=2)
    fine.sampling = SamplingParams(seed=1, allowed_token_ids=(2, 9, 11))
    sched.add_request(fine)
    late = make_request("late", [3, 4])                 # no min_tokens: eos may come first
    late.sampling = SamplingParams(seed=1, allowed_token_ids=(2,))
    sched.add_request(late)
