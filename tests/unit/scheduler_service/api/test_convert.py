"""Generation protobuf <-> domain conversions, and the message of every bad-field error."""
from __future__ import annotations

import math

import pytest

from engine_common.text.chat_template import ChatMessage
from engine_common.constraints.constraint import Constraint
from engine_common.request.params import ParamError, SamplingParams, StoppingParams
from engine_common.wire.protos import generation_pb2 as pb
from scheduler_service.api import convert
from scheduler_service.api.front_door import (ValidatedRequest, check_prompt_length,
                                              checked_constraint)
from scheduler_service.engine.output_processor import RequestOutput, RequestTimings, TokenLogprob
from scheduler_service.core.request import RequestStatus


def _req(**kw) -> pb.GenerateRequest:
    kw.setdefault("token_ids", [1, 2, 3])
    return pb.GenerateRequest(**kw)


# -- requests ---------------------------------------------------------------------------------

def test_text_prompt_with_unset_params_takes_defaults():
    got = convert.request_from_proto(pb.GenerateRequest(request_id="r", text="Hi"))
    assert got == ValidatedRequest("r", "Hi", None, SamplingParams(),
                                   StoppingParams(max_tokens=None), 0, convert.NAMES)
    assert got.sampling.greedy


def test_chat_prompt_carries_the_messages_in_order():
    msg = pb.GenerateRequest(request_id="c", messages=[
        pb.ChatMessage(role="system", content="Be brief."),
        pb.ChatMessage(role="user", content="Hi"), pb.ChatMessage(role="assistant")])
    got = convert.request_from_proto(msg)
    assert (got.prompt_text, got.prompt_token_ids) == (None, None)
    assert got.prompt_messages == (ChatMessage("system", "Be brief."), ChatMessage("user", "Hi"),
                                   ChatMessage("assistant", ""))


def test_token_prompt_and_every_field_carried():
    msg = pb.GenerateRequest(
        request_id="x", token_ids=[5, 0, 9], logprobs=3, priority=-2,
        sampling=pb.SamplingParams(temperature=0.5, top_p=0.9, top_k=40, min_p=0.05,
                                   repetition_penalty=1.1, presence_penalty=0.5,
                                   frequency_penalty=-0.5, seed=123),
        stopping=pb.StoppingCriteria(max_tokens=7, min_tokens=2, stop=["\n", "END"],
                                     stop_token_ids=[4], ignore_eos=True,
                                     include_stop_str_in_output=True))
    got = convert.request_from_proto(msg, vocab_size=10)
    assert (got.request_id, got.prompt_text, got.prompt_token_ids) == ("x", None, (5, 0, 9))
    assert got.sampling == SamplingParams(0.5, 0.9, 40, 0.05, 1.1, 0.5, -0.5, 123)
    assert got.stopping == StoppingParams(7, 2, ("\n", "END"), (4,), True, True)
    assert (got.num_logprobs, got.priority) == (3, -2)


def test_unset_fields_take_the_published_defaults_but_temperature_stays_greedy():
    defaults = SamplingParams(temperature=0.8, top_p=0.95, top_k=20, repetition_penalty=1.05)
    got = convert.request_from_proto(_req(sampling=pb.SamplingParams(top_k=5)), defaults=defaults)
    assert got.sampling == SamplingParams(temperature=0.0, top_p=0.95, top_k=5,
                                          repetition_penalty=1.05)
    warm = convert.request_from_proto(_req(sampling=pb.SamplingParams(temperature=0.7)),
                                      defaults=defaults)
    assert (warm.sampling.temperature, warm.sampling.top_k) == (0.7, 20)


def test_skip_special_tokens_unset_is_true_and_false_when_asked():
    assert convert.request_from_proto(_req()).stopping.skip_special_tokens is True
    got = convert.request_from_proto(_req(stopping=pb.StoppingCriteria(skip_special_tokens=False)))
    assert got.stopping.skip_special_tokens is False


def test_explicit_zero_temperature_is_greedy():
    got = convert.request_from_proto(_req(sampling=pb.SamplingParams(temperature=0.0, top_k=3)))
    assert got.sampling.greedy


def test_request_id_assigned_only_when_empty():
    ids = iter(["gen-1", "gen-2"])
    assert convert.request_from_proto(_req(), make_request_id=lambda: next(ids)).request_id == "gen-1"
    assert convert.request_from_proto(_req(request_id="mine")).request_id == "mine"
    a, b = (convert.request_from_proto(_req()).request_id for _ in range(2))
    assert a != b and len(a) == 32


@pytest.mark.parametrize("msg, expected", [
    (pb.Constraint(json_schema='{"type": "integer"}'),
     Constraint("json_schema", '{"type": "integer"}')),
    (pb.Constraint(json_object=True), Constraint("json_object", True)),
    (pb.Constraint(regex="[a-z]+"), Constraint("regex", "[a-z]+")),
    (pb.Constraint(grammar='start: "a"'), Constraint("grammar", 'start: "a"')),
    (pb.Constraint(choice=pb.ChoiceConstraint(choices=["yes", "no"])),
     Constraint("choice", ("yes", "no"))),
])
def test_constraint_kinds_carried(msg, expected):
    assert convert.request_from_proto(_req(constraint=msg)).constraint == expected


def test_no_constraint_is_none():
    assert convert.request_from_proto(_req()).constraint is None
    assert convert.request_from_proto(_req(constraint=pb.Constraint())).constraint is None


@pytest.mark.parametrize("msg, field, message", [
    (pb.Constraint(regex="(ab"), "constraint.regex", "unclosed group"),
    (pb.Constraint(regex=""), "constraint.regex", "a non-empty string"),
    (pb.Constraint(json_schema='{"type": "foo"}'), "constraint.json_schema", "Invalid type"),
    (pb.Constraint(grammar="start: foo"), "constraint.grammar", "unknown name"),
    (pb.Constraint(json_object=False), "constraint.json_object", "true"),
    (pb.Constraint(choice=pb.ChoiceConstraint()), "constraint.choice.choices", "one or more"),
])
def test_bad_constraints_are_refused_at_admission(msg, field, message):
    """The shape at conversion, the grammar engine's verdict by checked_constraint (which the
    servicer runs on the tokenizer pool)."""
    with pytest.raises(ParamError) as e:
        checked_constraint(convert.request_from_proto(_req(constraint=msg)).constraint)
    assert e.value.field == field and message in str(e.value)


def test_conversion_leaves_the_grammar_engine_to_the_pool():
    """An unclosed group is not the converter's business (no llguidance on the event loop)."""
    req = convert.request_from_proto(_req(constraint=pb.Constraint(regex="(ab")))
    assert req.constraint == Constraint("regex", "(ab")
    assert checked_constraint(None) is None


def test_default_max_tokens_applies_only_when_unset():
    assert convert.request_from_proto(_req(), default_max_tokens=16).stopping.max_tokens == 16
    set_ = _req(stopping=pb.StoppingCriteria(max_tokens=3))
    assert convert.request_from_proto(set_, default_max_tokens=16).stopping.max_tokens == 3


def test_logprobs_limit():
    assert convert.request_from_proto(_req(logprobs=20)).num_logprobs == 20
    assert convert.request_from_proto(_req(logprobs=30), max_logprobs=30).num_logprobs == 30


def test_sampling_defaults_round_trip_through_proto():
    for params in (SamplingParams(), SamplingParams(0.7, 0.9, 50, 0.1, 1.2, 0.3, 0.4, 2**63 - 1)):
        msg = convert.sampling_to_proto(params)
        assert msg.HasField("top_p") and msg.HasField("seed") == (params.seed is not None)
        temperature_set = pb.SamplingParams(temperature=params.temperature)
        msg.MergeFrom(temperature_set)
        assert convert.sampling_from_proto(msg) == params


# -- every bad field: (message, field named in the error, value, allowed) ---------------------

BAD_REQUESTS = [
    (pb.GenerateRequest(), "prompt", "none given", "exactly one of text, token_ids or messages"),
    (pb.GenerateRequest(text="a", token_ids=[1]), "prompt", "text and token_ids",
     "exactly one of text, token_ids or messages"),
    (pb.GenerateRequest(text="a", messages=[pb.ChatMessage(role="user", content="hi")]),
     "prompt", "text and messages", "exactly one of text, token_ids or messages"),
    (pb.GenerateRequest(token_ids=[1], messages=[pb.ChatMessage(role="user")]), "prompt",
     "token_ids and messages", "exactly one of text, token_ids or messages"),
    (pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="a"),
                                  pb.ChatMessage(content="b")]),
     "messages[1].role", "", "a non-empty string (system, user, assistant, ...)"),
    (pb.GenerateRequest(text=""), "text", "", "a non-empty string"),
    (_req(token_ids=[1, 10]), "token_ids[1]", 10, "in [0, 9] (vocab_size)"),
    (_req(logprobs=21), "logprobs", 21, "in [0, 20]"),
    (_req(sampling=pb.SamplingParams(temperature=-0.5)), "sampling.temperature", -0.5,
     "in [0.0, 100.0]"),
    (_req(sampling=pb.SamplingParams(temperature=101)), "sampling.temperature", 101.0,
     "in [0.0, 100.0]"),
    (_req(sampling=pb.SamplingParams(top_p=0.0)), "sampling.top_p", 0.0, "in (0.0, 1.0]"),
    (_req(sampling=pb.SamplingParams(top_p=1.5)), "sampling.top_p", 1.5, "in (0.0, 1.0]"),
    (_req(sampling=pb.SamplingParams(top_k=-2)), "sampling.top_k", -2, "in [-1, 2147483647]"),
    (_req(sampling=pb.SamplingParams(min_p=1.5)), "sampling.min_p", 1.5, "in [0.0, 1.0]"),
    (_req(sampling=pb.SamplingParams(repetition_penalty=0.0)), "sampling.repetition_penalty", 0.0,
     "in (0.0, 100.0]"),
    (_req(sampling=pb.SamplingParams(presence_penalty=2.5)), "sampling.presence_penalty", 2.5,
     "in [-2.0, 2.0]"),
    (_req(sampling=pb.SamplingParams(frequency_penalty=-3)), "sampling.frequency_penalty", -3.0,
     "in [-2.0, 2.0]"),
    (_req(sampling=pb.SamplingParams(seed=2**63)), "sampling.seed", 2**63,
     f"in [0, {2**63 - 1}]"),
    (_req(stopping=pb.StoppingCriteria(max_tokens=0)), "stopping.max_tokens", 0, "in [1, inf]"),
    (_req(stopping=pb.StoppingCriteria(max_tokens=2, min_tokens=3)), "stopping.min_tokens", 3,
     "<= max_tokens (2)"),
    (_req(stopping=pb.StoppingCriteria(stop=["ok", ""])), "stopping.stop", "",
     "a non-empty string"),
    (_req(stopping=pb.StoppingCriteria(stop_token_ids=[3, 12])), "stopping.stop_token_ids[1]", 12,
     "in [0, 9] (vocab_size)"),
]


@pytest.mark.parametrize("msg,field,value,allowed", BAD_REQUESTS,
                         ids=[f"{b[1]}={b[2]!r}" for b in BAD_REQUESTS])
def test_bad_field_names_field_value_and_range(msg, field, value, allowed):
    with pytest.raises(ParamError) as info:
        convert.request_from_proto(msg, vocab_size=10)
    err = info.value
    assert (err.field, err.value, err.allowed) == (field, value, allowed)
    assert str(err) == f"{field}={value!r} is invalid: must be {allowed}"


def test_nan_temperature_is_rejected():
    with pytest.raises(ParamError, match=r"^sampling\.temperature=nan is invalid: must be a number"):
        convert.request_from_proto(_req(sampling=pb.SamplingParams(temperature=math.nan)))


def test_vocab_bound_is_skipped_without_a_vocab_size():
    assert convert.request_from_proto(_req(token_ids=[4_000_000_000])).prompt_token_ids == (
        4_000_000_000,)


def test_prompt_length_against_max_model_len():
    check_prompt_length(10, 6, 16)
    check_prompt_length(15, None, 16)
    with pytest.raises(ParamError) as info:
        check_prompt_length(10, 7, 16)
    assert str(info.value) == ("stopping.max_tokens=7 is invalid: must be <= 6 "
                               "(max_model_len 16 - 10 prompt tokens)")
    with pytest.raises(ParamError) as info:
        check_prompt_length(16, None, 16)
    assert str(info.value) == ("prompt='16 tokens' is invalid: must be at most 15 tokens "
                               "(max_model_len 16)")


# -- outputs ----------------------------------------------------------------------------------

def _out(**kw) -> RequestOutput:
    base = dict(request_id="r", new_token_ids=[7, 8], new_text="ab", logprobs=[], finished=False,
                finish_reason=None, stop_reason=None, num_prompt_tokens=5, num_output_tokens=4,
                num_cached_tokens=2, timings=RequestTimings(100.0, 100.5, None))
    base.update(kw)
    return RequestOutput(**base)


def test_finish_reason_mapping():
    expected = {RequestStatus.FINISHED_LENGTH: pb.LENGTH,
                RequestStatus.FINISHED_STOP_TOKEN: pb.STOP_TOKEN,
                RequestStatus.FINISHED_STOP_STRING: pb.STOP_STRING,
                RequestStatus.FINISHED_ABORTED: pb.ABORT}
    for status in RequestStatus:
        want = expected.get(status, pb.FINISH_REASON_UNSPECIFIED)
        assert convert.finish_reason_to_proto(status) == want, status
    assert convert.finish_reason_to_proto(None) == pb.FINISH_REASON_UNSPECIFIED


def test_running_output_has_no_finish_fields():
    msg = convert.output_to_proto(_out())
    assert (msg.request_id, list(msg.token_ids), msg.text) == ("r", [7, 8], "ab")
    assert (msg.usage.prompt_tokens, msg.usage.completion_tokens,
            msg.usage.cached_prompt_tokens) == (5, 4, 2)
    assert msg.finish_reason == pb.FINISH_REASON_UNSPECIFIED
    assert msg.WhichOneof("stop_reason") is None and not msg.HasField("timings")
    assert len(msg.logprobs) == 0


def test_output_carries_the_id_the_client_knows_when_given():
    assert convert.output_to_proto(_out(), request_id="own").request_id == "own"
    empty = convert.output_to_proto(_out(new_token_ids=[], new_text="", num_prompt_tokens=0,
                                         num_output_tokens=0, num_cached_tokens=0))
    assert empty.HasField("usage")     # an all-zero usage is still sent, as it always was


def test_finished_by_stop_string_carries_reason_stop_and_timings():
    timings = RequestTimings(arrival_time=100.0, first_token_time=100.25, finish_time=101.5,
                             first_scheduled_time=100.125)   # read when the timings carry it
    msg = convert.output_to_proto(_out(
        finished=True, finish_reason=RequestStatus.FINISHED_STOP_STRING, stop_reason="\n",
        timings=timings))
    assert msg.finish_reason == pb.STOP_STRING and msg.stop_string == "\n"
    assert (msg.timings.queued_s, msg.timings.time_to_first_token_s, msg.timings.total_s) == (
        0.125, 0.25, 1.5)


def test_finished_by_stop_token_and_by_length():
    stop = convert.output_to_proto(_out(
        finished=True, finish_reason=RequestStatus.FINISHED_STOP_TOKEN, stop_reason=2,
        timings=RequestTimings(1.0, 2.0, 3.0)))
    assert (stop.finish_reason, stop.WhichOneof("stop_reason"), stop.stop_token_id) == (
        pb.STOP_TOKEN, "stop_token_id", 2)
    assert (stop.timings.queued_s, stop.timings.total_s) == (0.0, 2.0)
    length = convert.output_to_proto(_out(
        finished=True, finish_reason=RequestStatus.FINISHED_LENGTH,
        timings=RequestTimings(1.0, None, 3.0)))
    assert length.finish_reason == pb.LENGTH and length.WhichOneof("stop_reason") is None
    assert length.timings.time_to_first_token_s == 0.0


def test_aborted_output_with_no_tokens():
    msg = convert.output_to_proto(_out(new_token_ids=[], new_text="", finished=True,
                                       finish_reason=RequestStatus.FINISHED_ABORTED,
                                       num_cached_tokens=-1))
    assert msg.finish_reason == pb.ABORT and list(msg.token_ids) == []
    assert msg.usage.cached_prompt_tokens == 0


def test_logprobs_per_token_with_alternatives():
    logprobs = [TokenLogprob(7, -0.25, [7, 3], [-0.25, -1.5]), TokenLogprob(8, -2.0)]
    msg = convert.output_to_proto(_out(logprobs=logprobs), token_text=lambda t: f"<{t}>")
    assert [(e.token_id, e.logprob) for e in msg.logprobs] == [(7, -0.25), (8, -2.0)]
    assert [(t.token_id, t.logprob, t.text) for t in msg.logprobs[0].top_logprobs] == [
        (7, -0.25, "<7>"), (3, -1.5, "<3>")]
    assert len(msg.logprobs[1].top_logprobs) == 0
    plain = convert.output_to_proto(_out(logprobs=logprobs))
    assert plain.logprobs[0].top_logprobs[1].text == ""


def test_logit_bias_is_carried_and_its_ids_and_values_are_bounded():
    msg = _req(sampling=pb.SamplingParams(logit_bias={7: -100.0, 2: 0.5}))
    assert convert.request_from_proto(msg, vocab_size=10).sampling.logit_bias == (
        (2, 0.5), (7, -100.0))
    with pytest.raises(ParamError) as err:
        convert.request_from_proto(_req(sampling=pb.SamplingParams(logit_bias={10: 1.0})),
                                   vocab_size=10)
    assert err.value.field == "sampling.logit_bias[10]"
    with pytest.raises(ParamError) as err:
        convert.request_from_proto(_req(sampling=pb.SamplingParams(logit_bias={3: -100.5})))
    assert err.value.field == "sampling.logit_bias[3]" and "[-100.0, 100.0]" in err.value.allowed


def test_allowed_token_ids_are_carried_and_an_id_outside_the_vocabulary_is_refused_by_name():
    msg = _req(sampling=pb.SamplingParams(allowed_token_ids=[7, 2]))
    assert convert.request_from_proto(msg, vocab_size=10).sampling.allowed_token_ids == (2, 7)
    with pytest.raises(ParamError) as err:
        convert.request_from_proto(_req(sampling=pb.SamplingParams(allowed_token_ids=[3, 10])),
                                   vocab_size=10)
    assert str(err.value) == ("sampling.allowed_token_ids[1]=10 is invalid: must be in [0, 9] "
                              "(vocab_size)")
