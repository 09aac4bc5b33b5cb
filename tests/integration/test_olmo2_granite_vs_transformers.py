"""OLMo 2 and Granite against transformers on the same tiny random weights, float32 on the CPU
(worker_service/models/tiny_model.py): OLMo 2 with q/k/v/o biases, RMSNorm over the whole q and
k projections and post-norm blocks; Granite with every multiplier away from 1 (embeddings x3,
sub-block outputs x0.5, attention scale 1/8 instead of 1/4, logits / 2.5) and a tied head.

  - logits through the paged cache equal transformers' forward: one whole prefill, and chunked
    prefills then decodes of two requests batched,
  - the in-process engine's greedy tokens equal transformers' generate(), whole and chunked
    prefills batched with decodes, with prefix-cache hits,
  - Granite's greedy logprobs are transformers' log_softmax of the scaled logits (the fused
    greedy head, off for a scale other than 1, is tests/unit/worker_service/models/
    test_granite_head.py's),
  - two gloo ranks give the single rank's logits (OLMo 2's q/k norm spans the ranks; with one kv
    head both ranks hold it),
  - an unsupported activation and a multiplier transformers would turn into inf/NaN are
    refused naming the key and value (LoRA: test_lora_families.py).
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from deltaserve.llm import LLM
from engine_common.request.params import SamplingParams, StoppingParams
from tests.integration.test_model_vs_transformers import hf_logits
from tests.support.engine_checks import check_chunked_greedy, check_greedy_and_prefix_hits
from tests.support.hf_reference import hf_model
from tests.support.paged_prefill import assert_tp2_matches_tp1, load, prefill_logits
from tests.support.window_schedule import assert_chunks_and_decodes_match
from worker_service.models.granite import granite_multipliers

ARCHS = ("olmo2", "granite")


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logits_match_transformers(tiny_models, arch):
    path = tiny_models(arch)
    ids = torch.arange(41) * 37 % 500 + 3
    expected = hf_logits(hf_model(path), ids)
    torch.testing.assert_close(prefill_logits(load(path), ids), expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_and_decode_logits_match_transformers(tiny_models, arch):
    """Two requests prefilled in chunks of 11, 16 and 5 tokens, then decoded side by side."""
    path = tiny_models(arch)
    assert_chunks_and_decodes_match(load(path), hf_model(path), atol=1e-4)


def test_the_granite_multipliers_matter(tiny_models, tmp_path):
    """Each multiplier set back to 1 changes transformers' logits: the test above checks them."""
    path = tiny_models("granite")
    ids = torch.arange(17) * 37 % 500 + 3
    ours = prefill_logits(load(path), ids)
    for key in ("embedding_multiplier", "residual_multiplier", "attention_multiplier",
                "logits_scaling"):
        plain = _with_config(path, tmp_path / key, **{key: 1.0})
        assert (prefill_logits(load(plain), ids) - ours).abs().max() > 1e-2, key


@pytest.mark.parametrize("check", [check_greedy_and_prefix_hits, check_chunked_greedy],
                         ids=["whole-then-prefix-hits", "chunked"])
@pytest.mark.parametrize("arch", ARCHS)
def test_engine_greedy_matches_transformers(tiny_models, arch, check):
    check(tiny_models(arch), arch)


def test_granite_greedy_logprobs_are_of_the_scaled_logits(tiny_models):
    path = tiny_models("granite")
    llm = LLM(path, dtype="float32", num_kv_blocks=64, max_num_seqs=2)
    prompt = [5, 17, 33, 60, 2, 9, 41, 77, 13, 8, 250, 31]
    out = llm.generate([prompt], SamplingParams(), StoppingParams(max_tokens=8, ignore_eos=True),
                       num_logprobs=0)[0]
    full = torch.tensor(prompt + out.token_ids)
    expected = torch.log_softmax(hf_logits(hf_model(path), full), dim=-1)
    chosen = expected[len(prompt) - 1:-1].gather(1, full[len(prompt):, None])[:, 0]
    got = torch.tensor([lp.logprob for lp in out.logprobs])
    torch.testing.assert_close(got, chosen, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_tp2_matches_tp1_over_gloo(tmp_path):
    from worker_service.models.tiny_model import make_tiny_model
    models = [make_tiny_model(tmp_path / arch, arch=arch, seed=2) for arch in ARCHS]
    models.append(make_tiny_model(tmp_path / "olmo2-1kv", arch="olmo2", seed=3,
                                  num_key_value_heads=1))
    assert_tp2_matches_tp1(models, tmp_path)


def _with_config(src: str, dst, **changes) -> str:
    shutil.copytree(src, dst)
    cfg = json.load(open(f"{dst}/config.json"))
    json.dump({**cfg, **changes}, open(f"{dst}/config.json", "w"))
    return str(dst)


@pytest.mark.parametrize("arch", ARCHS)
def test_an_unsupported_activation_is_refused(tiny_models, tmp_path, arch):
    path = _with_config(tiny_models(arch), tmp_path / "gelu", hidden_act="gelu")
    with pytest.raises(ValueError, match=r"hidden_act='gelu' is not supported for "
                                         r"(Olmo2|Granite)ForCausalLM: must be 'silu'"):
        load(path)


@pytest.mark.parametrize("key,value", [("logits_scaling", "2"), ("embedding_multiplier", None),
                                       ("residual_multiplier", float("inf")),
                                       ("attention_multiplier", True)])
def test_a_multiplier_that_is_not_a_finite_number_is_refused(key, value):
    with pytest.raises(ValueError, match=rf"config.json: {key}={value!r} is invalid: must be a "
                                         rf"finite number"):
        granite_multipliers({key: value})


def test_logits_scaling_zero_is_refused_and_the_others_are_served(tiny_models, tmp_path):
    with pytest.raises(ValueError, match=r"logits_scaling=0 is invalid: .* must be a non-zero"):
        load(_with_config(tiny_models("granite"), tmp_path / "zero", logits_scaling=0))
    assert granite_multipliers({"attention_multiplier": 0, "logits_scaling": -2}) == {
        "embedding_multiplier": 1.0, "residual_multiplier": 1.0, "attention_multiplier": 0.0,
        "logits_scaling": -2.0}

