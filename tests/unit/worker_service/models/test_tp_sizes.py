"""Tensor-parallel sizes a model allows, and the error that names the ones that would work."""
from __future__ import annotations

import pytest

from engine_common.request.params import ParamError
from worker_service.models.deepseek_config import V2_DEFAULTS, V3_DEFAULTS
from worker_service.models.tp_sizes import (DEEPSEEK_DENSE_DEFAULTS, check_tp_size,
                                            tp_size_problem, valid_tp_sizes)

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


# DeepSeek-shaped: 16 heads, experts 1408 wide (16 | 1408), dense MLP 10950 wide (4 does not
# divide it); first_k_dense_replace 0 and moe_layer_freq 1: every layer sparse, no dense MLP
ALL_MOE_DEEPSEEK = {"architectures": ["DeepseekV2ForCausalLM"], "num_attention_heads": 16,
                    "num_key_value_heads": 16, "num_hidden_layers": 4,
                    "intermediate_size": 10950, "moe_intermediate_size": 1408,
                    "n_shared_experts": 2, "first_k_dense_replace": 0, "moe_layer_freq": 1}


def test_deepseek_without_dense_layers_is_not_held_to_intermediate_size():
    """The dense width of a model whose layers are all sparse splits nothing: TP=4 and 16
    divide the experts (and the shared experts, 2 x 1408) and are served."""
    assert valid_tp_sizes(ALL_MOE_DEEPSEEK) == [1, 2, 4, 8, 16]
    check_tp_size(ALL_MOE_DEEPSEEK, 4)


@pytest.mark.parametrize("change", [{"first_k_dense_replace": 1}, {"moe_layer_freq": 2},
                                    {"architectures": ["DeepseekV3ForCausalLM"],
                                     "first_k_dense_replace": None}])
def test_deepseek_with_a_dense_layer_is_held_to_it(change):
    """One dense layer (the first, every other one, or V3's default first 3 when the key is
    absent) brings intermediate_size back."""
    cfg = {**ALL_MOE_DEEPSEEK, **change}
    if change.get("first_k_dense_replace", 0) is None:
        del cfg["first_k_dense_replace"]
    assert tp_size_problem(cfg, 4) == "does not divide intermediate_size=10950"
    assert valid_tp_sizes(cfg) == [1, 2]


def test_deepseek_experts_that_do_not_split_are_refused_without_dense_layers():
    cfg = {**ALL_MOE_DEEPSEEK, "moe_intermediate_size": 1400, "intermediate_size": 1024}
    with pytest.raises(ParamError, match=r"tp_size=16 is invalid: .*: 1, 2, 4, 8 \(16 does not "
                                         r"divide moe_intermediate_size=1400\)$"):
        check_tp_size(cfg, 16)
    assert tp_size_problem({k: v for k, v in ALL_MOE_DEEPSEEK.items()
                            if k != "intermediate_size"}, 4) is None


def test_deepseek_dense_defaults_are_the_config_classes():
    """tp_sizes reads first_k_dense_replace's default without torch; it is deepseek_config's."""
    assert DEEPSEEK_DENSE_DEFAULTS == {
        "DeepseekV2ForCausalLM": V2_DEFAULTS["first_k_dense_replace"],
        "DeepseekV3ForCausalLM": V3_DEFAULTS["first_k_dense_replace"]}


def test_deepseek_bad_layer_fields_are_left_to_the_config_reader():
    """A null first_k_dense_replace is refused by name when the model is built; the TP check
    counts the dense width rather than failing on the comparison."""
    cfg = {**ALL_MOE_DEEPSEEK, "first_k_dense_replace": None}
    assert tp_size_problem(cfg, 4) == "does not divide intermediate_size=10950"
