"""min_tokens masks eos even with ignore_eos, as vLLM does: its SamplingParams.all_stop_token_ids
holds eos whatever ignore_eos says (update_from_generation_config adds it "to support min_tokens
processing"), and its min_tokens logits processor masks all_stop_token_ids. ignore_eos only keeps
a sampled eos from ending the request."""
from __future__ import annotations

from scheduler_service.core.request import RequestStatus
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
