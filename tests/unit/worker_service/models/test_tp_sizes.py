"""Tensor-parallel sizes a model allows, and the error that names the ones that would work."""
from __future__ import annotations

import pytest

from engine_common.request.params import ParamError
from worker_service.models.tp_sizes import check_tp_size, tp_size_problem, valid_tp_sizes

SMOLLM2 = {"num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536}


def test_smollm2_splits_over_1_or_3_ranks():
    assert valid_tp_sizes(SMOLLM2) == [1, 3]
    assert tp_size_problem(SMOLLM2, 3) is None
    with pytest.raises(ParamError) as err:
        check_tp_size(SMOLLM2, 2, "--local-ranks")
    assert str(err.value) == (
        "--local-ranks=2 is invalid: must be a tensor-parallel size this model can be split "
        "over: 1, 3 (2 does not divide num_attention_heads=9; 9 divides the 9 attention heads "
        "but does not divide intermediate_size=1536)")


def test_a_size_that_divides_the_heads_but_not_the_mlp():
    with pytest.raises(ParamError, match=r"tp_size=9 is invalid: must be a tensor-parallel size "
                                         r"this model can be split over: 1, 3 \(9 does not "
                                         r"divide intermediate_size=1536\)$"):
        check_tp_size(SMOLLM2, 9)


def test_kv_heads_are_replicated_when_fewer_than_ranks():
    cfg = {"num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 64}
    assert valid_tp_sizes(cfg) == [1, 2, 4, 8]
    odd = {"num_attention_heads": 12, "num_key_value_heads": 4, "intermediate_size": 48}
    assert tp_size_problem(odd, 6) == ("neither divides num_key_value_heads=4 nor is a "
                                       "multiple of it")
    assert valid_tp_sizes(odd) == [1, 2, 4, 12]


def test_kv_heads_default_to_the_attention_heads():
    assert valid_tp_sizes({"num_attention_heads": 4, "intermediate_size": 8}) == [1, 2, 4]
