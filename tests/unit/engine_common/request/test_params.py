"""Bad sampling and stopping values raise ParamError naming the field, the value and the range."""
from __future__ import annotations

import pytest

from engine_common.request.params import ParamError, SamplingParams, StoppingParams

BAD_SAMPLING = [
    ("temperature", -0.5, "[0.0, 100.0]"),
    ("temperature", float("nan"), "a number"),
    ("top_p", 0.0, "(0.0, 1.0]"),
    ("top_p", 1.5, "(0.0, 1.0]"),
    ("top_k", -2, "[-1, 2147483647]"),
    ("top_k", 2.5, "an integer"),
    ("min_p", 1.1, "[0.0, 1.0]"),
    ("repetition_penalty", 0.0, "(0.0, 100.0]"),
    ("presence_penalty", 3.0, "[-2.0, 2.0]"),
    ("frequency_penalty", -2.5, "[-2.0, 2.0]"),
    ("seed", -1, "[0, 9223372036854775807]"),
    ("temperature", True, "a number"),
]


@pytest.mark.parametrize("field,value,allowed", BAD_SAMPLING)
def test_bad_sampling_values(field, value, allowed):
    with pytest.raises(ParamError) as e:
        SamplingParams(**{field: value})
    assert e.value.field == field
    assert allowed in str(e.value) and field in str(e.value)


BAD_STOPPING = [
    ({"max_tokens": 0}, "max_tokens", "[1, inf]"),
    ({"min_tokens": -1}, "min_tokens", "[0, inf]"),
    ({"max_tokens": 4, "min_tokens": 5}, "min_tokens", "<= max_tokens (4)"),
    ({"stop": ["ok", ""]}, "stop", "a non-empty string"),
    ({"stop_token_ids": [2**32]}, "stop_token_ids", "[0, 4294967295]"),
]


@pytest.mark.parametrize("kwargs,field,allowed", BAD_STOPPING)
def test_bad_stopping_values(kwargs, field, allowed):
    with pytest.raises(ParamError) as e:
        StoppingParams(**kwargs)
    assert e.value.field == field
    assert allowed in str(e.value)


def test_good_values():
    sp = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, seed=5)
    assert not sp.greedy and SamplingParams().greedy
    assert StoppingParams(stop=["a"], stop_token_ids=[1]).stop == ("a",)


def test_logit_bias_is_sorted_and_bounded():
    params = SamplingParams(logit_bias={9: -100, 4: 2.5})
    assert params.logit_bias == ((4, 2.5), (9, -100.0))
    with pytest.raises(ParamError, match="at most 1024"):
        SamplingParams(logit_bias={i: 1.0 for i in range(1025)})
    with pytest.raises(ParamError, match="distinct"):
        SamplingParams(logit_bias=[(1, 1.0), (1, 2.0)])


def test_allowed_token_ids_are_a_sorted_bounded_set():
    params = SamplingParams(allowed_token_ids=[9, 4, 7])
    assert params.allowed_token_ids == (4, 7, 9)
    with pytest.raises(ParamError, match="at most 1024 ids"):
        SamplingParams(allowed_token_ids=range(1025))
    with pytest.raises(ParamError, match="distinct"):
        SamplingParams(allowed_token_ids=[3, 3])
    with pytest.raises(ParamError, match=r"allowed_token_ids\[0\]=-1 is invalid"):
        SamplingParams(allowed_token_ids=[-1, 2])


def test_an_error_quotes_a_few_hundred_characters_of_a_value():
    """Issue 23: a 70 KB garbage field quoted whole broke gRPC's status metadata limit."""
    e = ParamError("stop", "x" * 70_000, "short")
    assert str(e) == f"stop='{'x' * 199}... (70002 characters) is invalid: must be short"
    assert e.value == "x" * 70_000          # the value itself is kept for the caller
    assert str(ParamError("n", 5, "small")) == "n=5 is invalid: must be small"


def test_one_stop_string_is_a_list_of_one():
    """As vLLM's stop=str: tuple("END") made three one-character stop strings, so the output
    stopped at the first E, N or D."""
    assert StoppingParams(stop="END").stop == ("END",)
    assert StoppingParams(stop=["a", "b"]).stop == ("a", "b")
    assert StoppingParams(stop=None, stop_token_ids=None) == StoppingParams()


def test_a_stop_list_that_is_no_list_is_refused_by_name():
    with pytest.raises(ParamError, match=r"stop_token_ids=5 is invalid: must be a list of "
                                         r"token ids"):
        StoppingParams(stop_token_ids=5)
    with pytest.raises(ParamError, match=r"stop=3 is invalid: must be a list of strings"):
        StoppingParams(stop=3)


def test_a_temperature_below_vllms_epsilon_is_greedy():
    """vLLM samples temperature < 1e-5 greedily. Divided by, 1e-45 overflowed float32: every
    positive logit became inf and the sampler took the first of them, not the best."""
    for tiny in (1e-45, 1e-9, 9.99e-6):
        assert SamplingParams(temperature=tiny).greedy
        assert SamplingParams(temperature=tiny) == SamplingParams(temperature=0.0)
    assert not SamplingParams(temperature=1e-5).greedy
