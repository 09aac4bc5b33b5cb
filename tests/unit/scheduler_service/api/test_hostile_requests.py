"""Requests a hostile client sends, over a real gRPC channel on the real engine with a simulated
worker (both protocols): each is refused INVALID_ARGUMENT naming the field, the value and the
bound, before it can hurt anyone else; and what an Abort logs is the server's, not the
client's."""
from __future__ import annotations

import logging

import grpc
import pytest

from engine_common.wire.protos import generation_pb2 as gpb
from engine_common.wire.protos import generation_pb2_grpc
from engine_common.wire.protos import vllm_engine_pb2 as vpb
from engine_common.wire.protos import vllm_engine_pb2_grpc
from engine_common.text.chat_template import ChatTemplate
from scheduler_service.api import vllm_servicer
from scheduler_service.api.request_limits import MAX_ABORT_IDS
from tests.support.sim_server import SimServer, make_sim_model_dir
from tests.support.vllm_sim import PROMPT, LogLines, generate, rpc_code

MAX_MODEL_LEN = 256          # the simulated model's
ROOM = MAX_MODEL_LEN - len(PROMPT)
OUT_OF_VOCAB = 10**6         # the simulated model has 320 ids
# ChatML, as SmolLM2's: 25 characters of markup around each message's role and content.
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = SimServer(make_sim_model_dir(tmp_path_factory.mktemp("sim-model")))
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def stubs(server):
    with grpc.insecure_channel(server.target) as channel:
        yield (generation_pb2_grpc.GenerationStub(channel),
               vllm_engine_pb2_grpc.VllmEngineStub(channel))


def _ours(**kw) -> gpb.GenerateRequest:
    kw.setdefault("token_ids", PROMPT)
    return gpb.GenerateRequest(**kw)


def _refusal(call) -> str:
    code, details = rpc_code(call)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    return details


def test_min_tokens_beyond_the_room_is_refused_on_both_protocols(server, stubs):
    """min_tokens with max_tokens unset was bounded by nothing: 2**31 reached the step diff,
    where the worker (an int32) refuses it BAD_PAYLOAD and the epoch fails, every other
    stream with it. No request makes more than the room, so more is refused by name."""
    ours, vllm = stubs
    huge = 2**31
    details = _refusal(lambda: list(ours.Generate(
        _ours(stopping=gpb.StoppingCriteria(min_tokens=huge)), timeout=10)))
    assert details == (f"stopping.min_tokens={huge} is invalid: must be <= {ROOM} "
                       f"(max_model_len {MAX_MODEL_LEN} - {len(PROMPT)} prompt tokens)")
    details = _refusal(lambda: list(vllm.Generate(generate(min_tokens=huge), timeout=10)))
    assert details.startswith(f"sampling_params.min_tokens={huge} is invalid: must be <= {ROOM}")
    # the room itself is allowed: the request runs to max_model_len
    msgs = list(ours.Generate(_ours(stopping=gpb.StoppingCriteria(min_tokens=ROOM)), timeout=60))
    assert msgs[-1].finish_reason == gpb.LENGTH and msgs[-1].usage.completion_tokens == ROOM
    assert server.used_blocks() == 0


# (request, the refusal's start): lists an 8 MiB message holds millions of, counted before any
# of their ids is copied, checked against the vocabulary or sorted (each list's first id is out
# of the vocabulary: a refusal that names it read the list first).
_BIG_LISTS = [
    (_ours(sampling=gpb.SamplingParams(allowed_token_ids=[OUT_OF_VOCAB] * 1025)),
     "sampling.allowed_token_ids='1025 ids' is invalid: must be at most 1024 ids"),
    (_ours(sampling=gpb.SamplingParams(logit_bias={OUT_OF_VOCAB + i: 1.0 for i in range(1025)})),
     "sampling.logit_bias='1025 entries' is invalid: must be at most 1024"),
    (_ours(token_ids=[OUT_OF_VOCAB] * MAX_MODEL_LEN),
     f"prompt='{MAX_MODEL_LEN} tokens' is invalid: must be at most {MAX_MODEL_LEN - 1} tokens"),
    (_ours(token_ids=[], messages=[gpb.ChatMessage(role="u")] * (MAX_MODEL_LEN + 1)),
     f"messages='{MAX_MODEL_LEN + 1} messages' is invalid: must be at most {MAX_MODEL_LEN} "
     "messages"),
    (_ours(constraint=gpb.Constraint(choice=gpb.ChoiceConstraint(choices=[""] * 10_001))),
     "constraint.choice='10001 choices' is invalid: must be at most 10000 choices"),
    (generate(allowed_token_ids=[OUT_OF_VOCAB] * 1025),
     "sampling_params.allowed_token_ids='1025 ids' is invalid: must be at most 1024 ids"),
    (generate(logit_bias={OUT_OF_VOCAB + i: 1.0 for i in range(1025)}),
     "sampling_params.logit_bias='1025 entries' is invalid: must be at most 1024"),
    (generate(prompt=[OUT_OF_VOCAB] * MAX_MODEL_LEN),
     f"prompt='{MAX_MODEL_LEN} tokens' is invalid: must be at most {MAX_MODEL_LEN - 1} tokens"),
    (generate(choice=vpb.ChoiceConstraint(choices=[""] * 10_001)),
     "sampling_params.choice='10001 choices' is invalid: must be at most 10000 choices"),
]


@pytest.mark.parametrize("request_msg,refusal", _BIG_LISTS,
                         ids=[f"{i}-{r.split('=')[0]}" for i, (_, r) in enumerate(_BIG_LISTS)])
def test_long_lists_are_refused_by_their_length_before_their_ids_are_read(stubs, request_msg,
                                                                           refusal):
    ours, vllm = stubs
    stub = ours if isinstance(request_msg, gpb.GenerateRequest) else vllm
    details = _refusal(lambda: list(stub.Generate(request_msg, timeout=10)))
    assert details.startswith(refusal), details


def test_an_abort_logs_its_ids_quoted_and_only_the_first_few(stubs, caplog):
    """An Abort carries any number of ids of any characters: its log line was every one of
    them, raw (a forged line after a newline; 5 MB for this one)."""
    _, vllm = stubs
    forged = "x\nERROR scheduler_service: forged"
    ids = [forged] + ["y" * 256] * 20_000
    with caplog.at_level(logging.INFO, logger=vllm_servicer.__name__), \
            LogLines(vllm_servicer.__name__) as lines:
        vllm.Abort(vpb.AbortRequest(request_ids=ids), timeout=30)
    (line,) = [line for line in lines if line.startswith("Abort")]
    assert "\n" not in line and len(line) < 1000, line[:300]
    assert line.startswith("Abort of 20001 ids: 'x\\nERROR scheduler_service: forged', 'yyy")


def test_an_abort_of_more_ids_than_the_limit_is_refused_before_they_are_read(stubs, caplog):
    """Abort's ids were bounded only by the message size (4 million empty ones in 8 MiB), each
    scoped and looked up on the event loop. More than MAX_ABORT_IDS: INVALID_ARGUMENT naming
    the field, the count and the limit, before the ids are walked (the vLLM Abort's log line,
    written after, is not); the limit itself is served."""
    ours, vllm = stubs
    over = [""] * (MAX_ABORT_IDS + 1)
    want = f"request_ids='{MAX_ABORT_IDS + 1} ids' is invalid: must be at most {MAX_ABORT_IDS} ids"
    with caplog.at_level(logging.INFO, logger=vllm_servicer.__name__), \
            LogLines(vllm_servicer.__name__) as lines:
        assert _refusal(lambda: ours.Abort(gpb.AbortRequest(request_ids=over), timeout=30)
                        ).startswith(want)
        assert _refusal(lambda: vllm.Abort(vpb.AbortRequest(request_ids=over), timeout=30)
                        ).startswith(want)
        assert not [line for line in lines if line.startswith("Abort")]
        at_limit = over[1:]
        assert ours.Abort(gpb.AbortRequest(request_ids=at_limit), timeout=30).num_aborted == 0
        vllm.Abort(vpb.AbortRequest(request_ids=at_limit), timeout=30)
    assert [line for line in lines if line.startswith("Abort")] == [
        f"Abort of {MAX_ABORT_IDS} ids: '', '', '', '', '', '', '', ''"]


def test_a_chat_whose_markup_makes_it_too_long_is_refused_before_tokenizing(tmp_path):
    """A chat's roles and contents are bounded by what max_model_len tokens can cover (issue
    23's tokenizer flood), but the template's markup around each message is not in that count:
    tiny messages rendered to 25 times their characters, all tokenized before the prompt's
    length was checked (SmolLM2: 671,744 one-character messages, 16.8 M characters, about 8 s
    of a tokenizer thread). The rendered text is held to the same bound before the tokenizer
    sees it."""
    server = SimServer(make_sim_model_dir(tmp_path), chat_template=ChatTemplate(CHATML))
    try:
        fit = server.model.prompt_chars_fit
        # As many messages as max_model_len allows, their characters within the bound
        per = fit // MAX_MODEL_LEN
        many = [gpb.ChatMessage(role="u", content="x" * (per - 1))] * MAX_MODEL_LEN
        with grpc.insecure_channel(server.target) as channel:
            ours = generation_pb2_grpc.GenerationStub(channel)
            details = _refusal(lambda: list(ours.Generate(gpb.GenerateRequest(messages=many),
                                                          timeout=30)))
            assert details.startswith(f"messages='{len(many)} messages, "), details
            assert f"at most {fit} characters once rendered with the chat template" in details
            details = _refusal(lambda: ours.Tokenize(gpb.TokenizeRequest(messages=many),
                                                     timeout=30))
            assert details.startswith(f"messages='{len(many)} messages, "), details
            short = [gpb.ChatMessage(role="user", content="hi")]
            msgs = list(ours.Generate(gpb.GenerateRequest(
                messages=short, stopping=gpb.StoppingCriteria(max_tokens=2)), timeout=30))
            assert msgs[-1].usage.completion_tokens == 2
    finally:
        server.close()
