"""PromptLogprobList: a request's prompt logprobs, built only when read. The event loop passes
it on (len, truth, merging a lagging stream's outputs) without building a single entry; read,
it equals the entries prompt_logprob_entries gives, built once."""
from __future__ import annotations

from engine_common.wire.diff import PromptLogprobs
from scheduler_service.engine import request_output
from scheduler_service.engine.request_output import (PromptLogprob, PromptLogprobList,
                                                     RequestOutput, RequestTimings, merge_run)

GOT = PromptLogprobs([-1.0, -2.5], [1, 4], [3, 9, 3, 11], [-1.0, -2.0, -0.5, -2.5])
PROMPT = [7, 3, 8]


def _out(prompt_logprobs) -> RequestOutput:
    return RequestOutput("r", [1], "a", [], False, None, None, 3, 1, 0,
                         RequestTimings(0.0, None, None), None, prompt_logprobs)


def test_passed_on_without_building(monkeypatch):
    built = []
    monkeypatch.setattr(request_output, "prompt_logprob_entries",
                        lambda *a: built.append(a) or [])
    lazy = PromptLogprobList(PROMPT, GOT)
    merged = merge_run([_out(lazy), _out(None), _out(None)])
    assert merged.prompt_logprobs is lazy and len(lazy) == 3 and lazy
    assert built == []


def test_read_it_equals_the_entries_built_once(monkeypatch):
    lazy = PromptLogprobList(PROMPT, GOT)
    assert lazy == [None, PromptLogprob(3, -1.0, 1, [3, 9], [-1.0, -2.0]),
                    PromptLogprob(8, -2.5, 4, [3, 11], [-0.5, -2.5])]
    monkeypatch.setattr(request_output, "prompt_logprob_entries", None)   # not called again
    assert lazy[2].token_id == 8 and list(lazy)[0] is None and len(list(lazy)) == 3
