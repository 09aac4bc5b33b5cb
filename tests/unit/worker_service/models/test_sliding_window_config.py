"""Which layers get a sliding window, read from config.json as transformers 5 reads it:
Mistral every layer (sliding_window null: none; absent: the config class's 4096); Qwen2/Qwen3 only with use_sliding_window, the
layers layer_types marks "sliding_attention", else those from max_window_layers on; Llama and
the MoE models refuse a config that turns a window on; a backend without windows is refused."""
from __future__ import annotations

import pytest
import torch

from kernels.attention.backend import AttentionBackend
from worker_service.layers.attention import Attention
from worker_service.models.llama import (LlamaForCausalLM, MistralForCausalLM,
                                         Qwen2ForCausalLM, Qwen3ForCausalLM)
from worker_service.models.qwen_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM


def test_mistral_windows_every_layer_or_none():
    assert MistralForCausalLM.layer_windows({"sliding_window": 4096}, 3) == (4096,) * 3
    assert MistralForCausalLM.layer_windows({"sliding_window": None}, 2) == (0, 0)
    assert MistralForCausalLM.layer_windows({}, 2) == (4096, 4096)   # MistralConfig's default
    # transformers' MistralModel ignores layer_types: so do we
    cfg = {"sliding_window": 8, "layer_types": ["full_attention", "sliding_attention"]}
    assert MistralForCausalLM.layer_windows(cfg, 2) == (8, 8)


@pytest.mark.parametrize("model", [Qwen2ForCausalLM, Qwen3ForCausalLM])
def test_qwen_windows_follow_use_sliding_window_and_its_layers(model):
    off = {"use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 1,
           "layer_types": ["full_attention", "sliding_attention", "sliding_attention"]}
    assert model.layer_windows(off, 3) == (0, 0, 0)
    on = {**off, "use_sliding_window": True}
    assert model.layer_windows(on, 3) == (0, 4096, 4096)
    no_types = {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 2}
    assert model.layer_windows(no_types, 4) == (0, 0, 16, 16)
    default_28 = {"use_sliding_window": True, "sliding_window": 16}
    assert model.layer_windows(default_28, 30) == (0,) * 28 + (16, 16)
    assert model.layer_windows({"use_sliding_window": True, "sliding_window": None}, 2) == (0, 0)
    with pytest.raises(ValueError, match="layer_types has 2 entries"):
        model.layer_windows({**on, "layer_types": on["layer_types"][:2]}, 3)


@pytest.mark.parametrize("model", [LlamaForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM])
def test_models_without_a_rule_refuse_a_window(model):
    assert model.layer_windows({"use_sliding_window": False, "sliding_window": 4096}, 2) == (0, 0)
    assert model.layer_windows({"sliding_window": 4096}, 2) == (0, 0)
    with pytest.raises(ValueError, match="use_sliding_window with sliding_window=4096"):
        model.layer_windows({"use_sliding_window": True, "sliding_window": 4096}, 2)


class NoWindowBackend(AttentionBackend):
    name = "no-window"

    def forward(self, query, key, value, kv_cache, meta, scale):
        return query


def test_a_backend_without_windows_is_refused_at_load():
    Attention(4, 2, 16, 0.25, NoWindowBackend())                 # no window: accepted
    with pytest.raises(ValueError, match="'no-window' attention backend cannot apply"):
        Attention(4, 2, 16, 0.25, NoWindowBackend(), sliding_window=8)
    with pytest.raises(ValueError, match="sliding_window=-1"):
        Attention(4, 2, 16, 0.25, NoWindowBackend(), sliding_window=-1)


def test_only_windowed_layers_pass_a_window_to_the_backend():
    seen = []

    class Recording(NoWindowBackend):
        supports_sliding_window = True

        def forward(self, query, key, value, kv_cache, meta, scale, **kwargs):
            seen.append(kwargs)
            return query

    q, kv = torch.zeros(3, 64), torch.zeros(3, 32)
    Attention(4, 2, 16, 0.25, Recording())(q, kv, kv, None, None)
    Attention(4, 2, 16, 0.25, Recording(), sliding_window=8)(q, kv, kv, None, None)
    assert seen == [{}, {"sliding_window": 8}]
