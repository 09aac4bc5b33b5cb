"""StarCoder2 against transformers on the same tiny random weights, float32 on the CPU
(worker_service/models/tiny_model.py): LayerNorms with random weights and biases, the plain
gelu-tanh MLP, biases on every projection, a tied head.

  - logits through the paged cache equal transformers' forward: one whole prefill, and chunked
    prefills then decodes of two requests batched, without a window and with a window of 8 on
    every layer (decoding far past it),
  - the in-process engine's greedy tokens equal transformers' generate(), whole and chunked
    prefills batched with decodes, with prefix-cache hits,
  - two gloo ranks give the single rank's logits,
  - use_bias false and the exact gelu are read, another activation is refused naming it
    (LoRA: test_lora_families.py).
"""
from __future__ import annotations

import pytest
import torch

from tests.integration.test_model_vs_transformers import hf_logits
from tests.support.config_edit import with_config
from tests.support.engine_checks import check_chunked_greedy, check_greedy_and_prefix_hits
from tests.support.hf_reference import hf_model
from tests.support.paged_prefill import assert_tp2_matches_tp1, load, prefill_logits
from tests.support.window_schedule import assert_chunks_and_decodes_match

WINDOWS = {"none": {}, "window8": {"sliding_window": 8}}


@pytest.mark.parametrize("overrides", [{}, {"use_bias": False, "hidden_act": "gelu"}],
                         ids=["defaults", "no-bias-exact-gelu"])
def test_prefill_logits_match_transformers(tiny_models, overrides):
    path = tiny_models("starcoder2", **overrides)
    ids = torch.arange(41) * 37 % 500 + 3
    ours = load(path)
    assert (ours.model.layers[0].mlp.c_fc.bias is None) == ("use_bias" in overrides)
    torch.testing.assert_close(prefill_logits(ours, ids), hf_logits(hf_model(path), ids),
                               rtol=0, atol=1e-4)


@pytest.mark.parametrize("window", list(WINDOWS))
def test_chunked_prefill_and_decode_logits_match_transformers(tiny_models, window):
    """Two requests prefilled in chunks of 11, 16 and 5 tokens, then decoded side by side."""
    path = tiny_models("starcoder2", **WINDOWS[window])
    model = load(path)
    assert model.args.shared_window() == (8 if window == "window8" else 0)
    assert_chunks_and_decodes_match(model, hf_model(path), atol=1e-4)


@pytest.mark.parametrize("check", [check_greedy_and_prefix_hits, check_chunked_greedy],
                         ids=["whole-then-prefix-hits", "chunked"])
def test_engine_greedy_matches_transformers(tiny_models, check):
    check(tiny_models("starcoder2"), "starcoder2")


@pytest.mark.slow
def test_tp2_matches_tp1_over_gloo(tmp_path):
    from worker_service.models.tiny_model import make_tiny_model
    assert_tp2_matches_tp1([make_tiny_model(tmp_path / "starcoder2", arch="starcoder2",
                                            seed=2)], tmp_path)


def test_another_activation_is_refused(tiny_models, tmp_path):
    path = tiny_models("starcoder2")
    with pytest.raises(ValueError, match=r"hidden_act='silu' is not supported for "
                                         r"Starcoder2ForCausalLM: must be one of"):
        load(with_config(path, tmp_path / "silu", hidden_act="silu"))
