"""Messages that carry many tokens' logprobs are built on a worker thread, not on the event loop:
a non-streamed vLLM choice's complete (its whole output at once; 20,000 tokens at 20 logprobs
take ~0.15 s of CPU), and any output holding more than OFF_LOOP_TOKENS tokens (a consumer that
lagged many steps: 20,000 steps at 20 top logprobs took ~1 s for Generate's message). One
step's output is still built inline."""
from __future__ import annotations

import threading

import pytest

from engine_common.wire.protos import vllm_engine_pb2 as vpb
from engine_common.wire.protos import vllm_engine_pb2_grpc
from scheduler_service.api import vllm_servicer
from scheduler_service.api.convert import OFF_LOOP_TOKENS, builds_off_loop
from scheduler_service.engine.request_output import RequestOutput, RequestTimings
from tests.integration.test_prompt_logprobs_grpc import PROMPT, _serve, llm, model  # noqa: F401


def _output(num_tokens: int, prompt_logprobs=None) -> RequestOutput:
    return RequestOutput("r", list(range(num_tokens)), "", [], False, None, None, 3, num_tokens,
                         0, RequestTimings(0.0, None, None), None, prompt_logprobs)


def test_which_outputs_are_built_off_the_loop():
    assert not builds_off_loop(_output(1)) and not builds_off_loop(_output(OFF_LOOP_TOKENS))
    assert builds_off_loop(_output(OFF_LOOP_TOKENS + 1))
    assert builds_off_loop(_output(1, prompt_logprobs=[None]))


def test_a_non_streamed_finish_counts_the_final_output_s_own_tokens():
    """The choice holds the tokens before this output (messages() adds the output's own as it
    builds): 128 before and 4 in the finishing output are 132 in the complete (the CI run
    that delivered the last 4 in one output built it on the loop)."""
    from types import SimpleNamespace

    from scheduler_service.api.vllm_outputs import Choice, choice_builds_off_loop

    inp = SimpleNamespace(num_prompt_logprobs=None, stream=False)
    for before, last, off in ((OFF_LOOP_TOKENS, 4, True), (OFF_LOOP_TOKENS - 4, 4, False),
                              (OFF_LOOP_TOKENS - 3, 4, True)):
        choice = Choice()
        choice.token_ids = list(range(before))
        out = _output(last)
        out.finished = True
        assert choice_builds_off_loop(inp, out, choice) == off, (before, last)
    assert not choice_builds_off_loop(SimpleNamespace(num_prompt_logprobs=None, stream=True),
                                      out, choice)


@pytest.mark.parametrize("stream", [False, True])
def test_a_long_non_streamed_choice_is_completed_off_the_loop(llm, monkeypatch, stream):
    calls = []          # (thread, finished, the output's tokens)
    build = vllm_servicer.messages

    def recording(inp, index, out, choice, *rest):
        msgs = build(inp, index, out, choice, *rest)
        calls.append((threading.current_thread(), out.finished, len(out.new_token_ids)))
        return msgs
    monkeypatch.setattr(vllm_servicer, "messages", recording)
    max_tokens = OFF_LOOP_TOKENS + 4

    async def talk(ch):
        return [m async for m in vllm_engine_pb2_grpc.VllmEngineStub(ch).Generate(
            vpb.GenerateRequest(request_id=f"long-{stream}", stream=stream,
                                tokenized=vpb.TokenizedInput(input_ids=PROMPT),
                                sampling_params=vpb.SamplingParams(
                                    logprobs=5, max_tokens=max_tokens, ignore_eos=True)))]
    msgs = _serve(llm, talk)
    complete = msgs[-1].complete
    assert len(complete.output_logprobs.token_logprobs) == (max_tokens if not stream else
                                                            len(complete.output_ids))
    final = [(thread, n) for thread, finished, n in calls if finished]
    assert len(final) == 1
    # Not streamed, the complete carries every token: built on a worker thread. Streamed, the
    # final output is one step's (built inline) unless the consumer lagged many steps.
    thread, num_tokens = final[0]
    inline = stream and num_tokens <= OFF_LOOP_TOKENS
    assert (thread is threading.main_thread()) == inline, calls[-3:]
