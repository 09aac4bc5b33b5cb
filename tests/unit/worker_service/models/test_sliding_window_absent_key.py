"""A config.json without `sliding_window` gets transformers' default window, not none.

transformers' MistralConfig, Qwen2Config and Qwen3Config (and the MoE configs) default
sliding_window to 4096 when the key is absent (null means none). The layer rules read an absent
key as null, so such a Mistral (or a Qwen2/Qwen3 with use_sliding_window) attended to every key
where transformers and vLLM (which reads transformers' config) attend to the last 4096 only,
and a Qwen-MoE config turning the window on without the key was served with full attention
instead of refused. Each case here is compared with transformers' own config object."""
from __future__ import annotations

import pytest

from worker_service.models.llama import (LlamaForCausalLM, MistralForCausalLM,
                                         Qwen2ForCausalLM, Qwen3ForCausalLM)
from worker_service.models.qwen_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM

transformers = pytest.importorskip("transformers")

LAYERS = 4
CASES = [
    {},                                                       # key absent
    {"sliding_window": None},
    {"sliding_window": 64},
    {"use_sliding_window": True},                             # key absent
    {"use_sliding_window": True, "sliding_window": None},
    {"use_sliding_window": True, "max_window_layers": 2},     # key absent
    {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1},
    {"use_sliding_window": False},
    # max_window_layers at its edges (no layer_types: the rule i >= max_window_layers)
    *({"use_sliding_window": True, "sliding_window": 8, "max_window_layers": n}
      for n in (0, LAYERS - 1, LAYERS, LAYERS + 5, -1)),
]


def transformers_windows(config) -> tuple[int, ...]:
    """Each layer's window as transformers' model applies it (0: full attention)."""
    window = config.sliding_window or 0
    types = getattr(config, "layer_types", None) or ["sliding_attention"] * LAYERS
    return tuple(window if t == "sliding_attention" else 0 for t in types)


@pytest.mark.parametrize("fields", CASES, ids=str)
@pytest.mark.parametrize("model, config_class", [
    (MistralForCausalLM, "MistralConfig"),
    (Qwen2ForCausalLM, "Qwen2Config"),
    (Qwen3ForCausalLM, "Qwen3Config"),
])
def test_layer_windows_equal_transformers(model, config_class, fields):
    config = getattr(transformers, config_class)(num_hidden_layers=LAYERS, **fields)
    assert model.layer_windows(dict(fields), LAYERS) == transformers_windows(config)


@pytest.mark.parametrize("model", [Qwen2MoeForCausalLM, Qwen3MoeForCausalLM])
def test_moe_refuses_a_window_turned_on_without_the_key(model):
    with pytest.raises(ValueError, match="use_sliding_window with sliding_window=4096"):
        model.layer_windows({"use_sliding_window": True}, LAYERS)
    assert model.layer_windows({"use_sliding_window": True, "sliding_window": None},
                               LAYERS) == (0,) * LAYERS


def test_llama_has_no_default_window():
    """LlamaConfig has no sliding_window: use_sliding_window alone changes nothing there."""
    assert LlamaForCausalLM.layer_windows({"use_sliding_window": True}, LAYERS) == (0,) * LAYERS
    assert LlamaForCausalLM.layer_windows({}, LAYERS) == (0,) * LAYERS
