"""One request whose output cannot be processed ends alone: its stream gets RequestFailed
(INTERNAL), its blocks go back, the others finish with the tokens they get without it, and the
engine keeps its epoch. The failure is injected into one request's detokenizer (a tokenizer bug
is the real-world trigger); everything else is the real in-process engine on a tiny model."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from deltaserve.llm import LLM
from engine_common.request.params import SamplingParams, StoppingParams
from scheduler_service.engine.async_engine import AsyncEngine
from scheduler_service.errors import RequestFailed
from scheduler_service.engine.output_processor import OutputProcessor
from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.api.status import status_for

PROMPTS = {"a": [5, 17, 33, 2, 9], "bad": [7, 7, 41, 3], "c": [11, 12, 13, 14, 15, 16]}
STOP = StoppingParams(max_tokens=8, ignore_eos=True)


class FailingOutputProcessor(OutputProcessor):
    """The detokenizer of the request with the "bad" prompt raises on its third token."""

    def add_request(self, request: Request) -> None:
        super().add_request(request)
        if list(request.prompt_token_ids) != PROMPTS["bad"]:
            return
        detok = self._states[request.request_id].detokenizer
        calls = {"n": 0}
        real_add = detok.add

        def add(token_id: int) -> str:
            calls["n"] += 1
            if calls["n"] == 3:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
            return real_add(token_id)

        detok.add = add


@pytest.fixture()
def llm(tiny_models):
    engine = LLM(tiny_models("qwen3"), num_kv_blocks=64, max_num_seqs=8)
    engine.engine.output_processor = FailingOutputProcessor(engine.tokenizer)
    return engine


def _reference(tiny_models) -> dict[str, list[int]]:
    ref = LLM(tiny_models("qwen3"), num_kv_blocks=64, max_num_seqs=8)
    done = ref.generate([PROMPTS["a"], PROMPTS["c"]], SamplingParams(), STOP)
    return {"a": done[0].token_ids, "c": done[1].token_ids}


def test_engine_core_aborts_only_the_failing_request(llm, tiny_models):
    core = llm.engine
    requests = {rid: Request(rid, prompt, SamplingParams(), STOP)
                for rid, prompt in PROMPTS.items()}
    for request in requests.values():
        core.add_request(request)
    tokens = {rid: [] for rid in PROMPTS}
    finals = {}
    while core.has_unfinished_requests():
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                finals[out.request_id] = out
    bad = finals["bad"]
    assert isinstance(bad.error, RequestFailed)
    assert bad.finish_reason == RequestStatus.FINISHED_ABORTED
    assert "'bad'" in str(bad.error) and "UnicodeDecodeError" in str(bad.error)
    assert len(tokens["bad"]) == 2       # the two tokens processed before the failure
    assert finals["a"].error is None and finals["c"].error is None
    assert {k: tokens[k] for k in ("a", "c")} == _reference(tiny_models)
    s = core.scheduler
    assert s.num_free_blocks == s.num_total_blocks and len(core.output_processor) == 0
    # The worker dropped the aborted request too (the next diff carried it as finished).
    assert requests["bad"].handle not in llm.runner.requests


def test_async_stream_of_the_failing_request_alone_ends_with_internal(llm, tiny_models):
    engine = AsyncEngine(lambda: llm.engine.core, lambda: FailingOutputProcessor(llm.tokenizer))
    engine.start()

    async def collect(rid: str):
        out = []
        async for item in engine.generate(Request(rid, PROMPTS[rid], SamplingParams(), STOP)):
            out += item.new_token_ids
        return out

    async def main():
        assert await asyncio.to_thread(engine.wait_ready, 60), engine.last_error
        core = engine.core
        got = await asyncio.gather(*(collect(rid) for rid in PROMPTS), return_exceptions=True)
        return core, dict(zip(PROMPTS, got))

    try:
        core_before, got = asyncio.run(main())
        assert engine.core is core_before    # no new epoch
    finally:
        engine.shutdown()
    assert isinstance(got["bad"], RequestFailed)
    code, message = status_for(got["bad"])
    assert code == grpc.StatusCode.INTERNAL and "'bad'" in message
    assert not message.startswith("internal error")   # its own message, not the generic one
    assert {k: got[k] for k in ("a", "c")} == _reference(tiny_models)


def test_offline_llm_reports_the_failed_request_and_finishes_the_others(llm, tiny_models):
    a, bad, c = llm.generate(list(PROMPTS.values()), SamplingParams(), STOP)
    assert bad.finish_reason == RequestStatus.FINISHED_ABORTED and len(bad.token_ids) == 2
    assert "UnicodeDecodeError" in bad.error
    assert a.error is None and c.error is None
    assert {"a": a.token_ids, "c": c.token_ids} == _reference(tiny_models)
