"""A stream's Mailbox and the merging of what piled up in it (coalesce): a consumer that reads
slower than the engine steps gets the waiting steps as one output, in order, and never past an
error or a final output."""
from __future__ import annotations

import asyncio

from scheduler_service.core.request import RequestStatus
from scheduler_service.engine.stream_hub import coalesce
from scheduler_service.engine.output_processor import RequestOutput, RequestTimings
from scheduler_service.engine.stream_hub import Mailbox
from scheduler_service.errors import EngineUnavailable


def out(ids, total, finish=None):
    return RequestOutput("r", list(ids), "".join(f"<{i}>" for i in ids), [], finish is not None,
                         finish, None, 3, total, 0, RequestTimings(0.0, None, None))


def test_take_waits_for_a_put_and_then_hands_out_everything_waiting():
    async def run():
        box = Mailbox(asyncio.get_running_loop())
        taker = asyncio.ensure_future(box.take())
        await asyncio.sleep(0)            # the taker is waiting now
        assert not taker.done()
        box.put(1)
        box.put(2)
        first = await taker
        box.put(3)
        return first, await box.take(), box.take_nowait()

    assert asyncio.run(run()) == ([1, 2], [3], [])


def test_a_cancelled_take_leaves_the_box_usable():
    async def run():
        box = Mailbox(asyncio.get_running_loop())
        taker = asyncio.ensure_future(box.take())
        await asyncio.sleep(0)
        taker.cancel()
        await asyncio.gather(taker, return_exceptions=True)
        box.put("x")
        return taker.cancelled(), await box.take()

    assert asyncio.run(run()) == (True, ["x"])


def test_coalesce_merges_runs_of_outputs_up_to_a_final_one():
    merged, = coalesce([out([5], 1), out([6], 2), out([7], 3, RequestStatus.FINISHED_LENGTH)])
    assert (merged.new_token_ids, merged.new_text, merged.num_output_tokens) == (
        [5, 6, 7], "<5><6><7>", 3)
    assert merged.finished and merged.finish_reason == RequestStatus.FINISHED_LENGTH


def test_coalesce_keeps_an_error_after_the_outputs_before_it():
    error = EngineUnavailable("worker gone")
    first, second = coalesce([out([5], 1), out([6], 2), error])
    assert first.new_token_ids == [5, 6] and not first.finished and second is error
    single = [out([5], 1)]
    assert coalesce(single) is single and coalesce([]) == []


class _CountingIds(list):
    """Token ids that count the elements each `+` copies (a merge two by two copies the pile
    again at every step)."""

    copied = 0

    def __add__(self, other):
        result = _CountingIds(list.__add__(self, other))
        _CountingIds.copied += len(result)
        return result


def test_coalesce_is_linear_in_what_waited():
    """A consumer that lagged 2,000 steps: each token copied a bounded number of times (before,
    ~n^2/2 = 2 million; 20,000 steps held the event loop ~2 s). The merge equals the pairwise
    one."""
    n = 2000
    items = [out([i], i + 1) for i in range(n - 1)] + [out([n - 1], n,
                                                          RequestStatus.FINISHED_LENGTH)]
    for item in items:
        item.new_token_ids = _CountingIds(item.new_token_ids)
    _CountingIds.copied = 0
    merged, = coalesce(items)
    assert _CountingIds.copied <= 2 * n, _CountingIds.copied
    assert merged.new_token_ids == list(range(n)) and merged.finished
    assert merged.new_text == "".join(f"<{i}>" for i in range(n))
    assert merged.num_output_tokens == n


def test_coalesce_merges_at_most_max_run_outputs_into_one():
    """A reader that lags 130 steps gets 3 messages of at most 64 steps (MAX_MERGED_STEPS in
    AsyncEngine.generate), not one that grows with the lag: each write then goes through its
    client's window in bounded time (--stream-send-timeout)."""
    items = [out([i], i + 1) for i in range(130)]
    merged = coalesce(items, 64)
    assert [m.new_token_ids for m in merged] == [list(range(64)), list(range(64, 128)),
                                                 [128, 129]]
    assert [m.num_output_tokens for m in merged] == [64, 128, 130]
    assert len(coalesce(items)) == 1
