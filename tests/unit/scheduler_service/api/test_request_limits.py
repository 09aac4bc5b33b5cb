"""The public API's guards on the protobuf: request limits, API key files, option rules."""
from __future__ import annotations

import pytest

from engine_common.request.params import ParamError
from engine_common.wire.protos import generation_pb2 as pb
from scheduler_service.api.api_options import ApiOptions
from scheduler_service.api.api_keys import load_api_keys
from engine_common.wire.protos import vllm_engine_pb2 as vpb
from scheduler_service.api import convert, vllm_convert
from scheduler_service.api.request_limits import check_prompt_chars, check_request_limits


def check_generate_limits(msg, options):
    check_request_limits(convert.limited_fields(msg), options)


def check_vllm_generate_limits(msg, options):
    check_request_limits(vllm_convert.limited_fields(msg), options)

OPTIONS = ApiOptions(max_stop_strings=3, max_stop_chars=10, max_stop_token_ids=2,
                     max_prompt_chars=100, max_constraint_chars=20)


def _request(**stopping) -> pb.GenerateRequest:
    return pb.GenerateRequest(text="hi", stopping=pb.StoppingCriteria(**stopping))


@pytest.mark.parametrize("msg,message", [
    (_request(stop=["a", "b", "c", "d"]),
     r"stopping.stop='4 strings' is invalid: must be at most 3 strings \(--max-stop-strings\)"),
    (_request(stop=["abcdef", "ghijk"]),
     r"stopping.stop='11 characters in all' is invalid: must be at most 10 characters"),
    (_request(stop_token_ids=[1, 2, 3]),
     r"stopping.stop_token_ids='3 ids' is invalid: must be at most 2 ids"),
    (pb.GenerateRequest(text="x" * 101), r"text='101 characters' is invalid: must be at most 100"),
    (pb.GenerateRequest(text="hi", request_id="r" * 257), r"request_id='257 characters'"),
    (pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="x" * 97)]),
     r"messages='101 characters' is invalid: must be at most 100 characters"),
])
def test_each_limit_is_invalid_argument_naming_the_field_and_the_flag(msg, message):
    with pytest.raises(ParamError, match=message):
        check_generate_limits(msg, OPTIONS)


def test_constraints_are_bounded_before_the_grammar_engine_sees_them():
    schema = pb.GenerateRequest(text="hi", constraint=pb.Constraint(json_schema="x" * 21))
    with pytest.raises(ParamError, match=r"constraint.json_schema='21 characters' is invalid: "
                                         r"must be at most 20 characters \(--max-constraint-"):
        check_generate_limits(schema, OPTIONS)
    choices = vpb.GenerateRequest(text="hi", sampling_params=vpb.SamplingParams(
        choice=vpb.ChoiceConstraint(choices=["a" * 10, "b" * 11])))
    with pytest.raises(ParamError, match=r"sampling_params.choice='21 characters'"):
        check_vllm_generate_limits(choices, OPTIONS)
    check_generate_limits(pb.GenerateRequest(text="hi", constraint=pb.Constraint(
        regex="[a-z]{1,19}")), OPTIONS)
    check_vllm_generate_limits(vpb.GenerateRequest(text="hi", sampling_params=vpb.SamplingParams(
        json_object=True)), OPTIONS)


def test_requests_within_the_limits_pass():
    check_generate_limits(_request(stop=["abc", "def"], stop_token_ids=[1, 2]), OPTIONS)
    check_prompt_chars("text", "x" * 100, OPTIONS)
    many = _request(stop=["s"] * 200_000)     # the attack of issue 13: refused by count first
    with pytest.raises(ParamError, match="200000 strings"):
        check_generate_limits(many, ApiOptions())


def test_api_key_files(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# team A\nkey-aaaaaaaaaaaaaaaa\n\n  key-bbbbbbbbbbbbbbbb  \n")
    book = load_api_keys(str(path))
    a, b = (book.policy_of(f"Bearer key-{c * 16}") for c in "ab")
    assert len(book.policies) == 2 and book.policy_of("Bearer key-cccccccccccccccc") is None
    assert (a.admin, a.min_priority, a.max_priority) == (False, 0, 2**31 - 1)
    assert a.salt != b.salt and a.salt.startswith("key:")     # no key shares another's cache
    path.write_text("key-aaaaaaaaaaaaaaaa admin salt=team priority=-5..5\n"
                    "key-bbbbbbbbbbbbbbbb salt=team\n")
    book = load_api_keys(str(path))
    a, b = (book.policy_of(f"Bearer key-{c * 16}") for c in "ab")
    assert (a.admin, a.salt, a.min_priority, a.max_priority) == (True, "name:team", -5, 5)
    assert (b.admin, b.salt) == (False, "name:team")
    for bad in ("admn", "priority=5..-5", "priority=1", "salt="):
        path.write_text(f"key-aaaaaaaaaaaaaaaa {bad}\n")
        with pytest.raises(ParamError, match=r"keys:1' is invalid: must be (attributes|priority)"):
            load_api_keys(str(path))
    path.write_text("key-aaaaaaaaaaaaaaaa\nshort\n")
    with pytest.raises(ParamError, match=r"keys:2' is invalid: must be one key per line"):
        load_api_keys(str(path))
    path.write_text("k" * 1025 + "\n")     # no client could send it: gRPC refuses the header
    with pytest.raises(ParamError, match=r"keys:1' is invalid: must be one key per line, .* "
                                         r"at most 1024"):
        load_api_keys(str(path))
    path.write_text("# nothing\n")
    with pytest.raises(ParamError, match="at least one key"):
        load_api_keys(str(path))


def test_tls_options_come_in_pairs(tmp_path):
    pem = tmp_path / "c.pem"
    pem.write_text("x")
    with pytest.raises(ParamError, match="tls_key=None is invalid"):
        ApiOptions(tls_cert=str(pem))
    with pytest.raises(ParamError, match="tls_client_ca=.* unset without --tls-cert"):
        ApiOptions(tls_client_ca=str(pem))
    with pytest.raises(ParamError, match="max_logprobs=257 is invalid: must be an integer in "
                                         r"\[0, 256\]"):
        ApiOptions(max_logprobs=257)
