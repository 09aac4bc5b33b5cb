"""GGUF files of Gemma 1/2/3, Phi-3, StarCoder2 and a Mistral that carries its window, written
as llama.cpp converts them (tests/support/gguf_family_files.py) from tiny Hugging Face models:
the model built from the GGUF equals the one built from the directory (same logits: names,
fused tensors, Gemma's norm + 1, windows, softcaps, scales and ropes all read back), and the
in-process engine on the GGUF gives transformers' greedy tokens on the Hugging Face twin, with
chunked prefill (past the windows of 8) and prefix hits.

The twins are built as the converters' inputs would be: Gemma 2/3 with query_pre_attn_scalar
equal to head_dim (every released size but the 27Bs, whose rule tests/unit covers), Gemma 3 with
llama.cpp's fixed layer pattern (every 6th layer full), Gemma 1 without attention biases.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deltaserve.llm import LLM
from tests.support.engine_checks import _check, _prompts
from tests.support.gguf_family_files import write_family_gguf
from tests.support.paged_prefill import load, prefill_logits

TWINS = {
    "gemma": ("gemma", {"attention_bias": False}),
    "gemma2": ("gemma2", {"query_pre_attn_scalar": 16}),
    "gemma3": ("gemma3", {"num_hidden_layers": 6, "query_pre_attn_scalar": 16,
                          "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}),
    "phi3": ("phi3", {}),
    "phi3-partial-rotary": ("phi3", {"rope_parameters": {
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}}),
    "starcoder2": ("starcoder2", {}),
    "mistral-window": ("mistral", {"sliding_window": 8}),
}
ARCHITECTURES = {"gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM",
                 "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM",
                 "phi3-partial-rotary": "Phi3ForCausalLM",
                 "starcoder2": "Starcoder2ForCausalLM", "mistral-window": "MistralForCausalLM"}

# some tests compare the weights the loader writes, read back from the parameters
pytestmark = pytest.mark.usefixtures("keep_dense_weights")


@pytest.fixture(scope="module")
def twins(tiny_models, tmp_path_factory):
    """name -> (the Hugging Face directory, its GGUF), written once per module."""
    root = tmp_path_factory.mktemp("gguf-families")
    made = {}

    def get(name: str) -> tuple[str, Path]:
        if name not in made:
            arch, overrides = TWINS[name]
            hf_dir = tiny_models(arch, **overrides)
            made[name] = hf_dir, write_family_gguf(root / f"{name}.gguf", hf_dir)
        return made[name]

    return get


@pytest.mark.parametrize("name", list(TWINS))
def test_the_gguf_builds_the_model_the_directory_builds(twins, name):
    hf_dir, gguf_path = twins(name)
    from_gguf, from_dir = load(gguf_path), load(hf_dir)
    assert type(from_gguf).__name__ == ARCHITECTURES[name]
    assert from_gguf.args.layer_windows == from_dir.args.layer_windows
    ids = torch.arange(41) * 37 % 500 + 3
    torch.testing.assert_close(prefill_logits(from_gguf, ids), prefill_logits(from_dir, ids),
                               rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["gemma", "gemma2", "gemma3", "phi3-partial-rotary",
                                  "starcoder2", "mistral-window"])
def test_engine_greedy_on_the_gguf_equals_transformers_on_the_twin(twins, name):
    """Chunked prefills (24 tokens a step) batched with decodes, then the same prompts again
    for prefix hits; no KV block left held."""
    hf_dir, gguf_path = twins(name)
    llm = LLM(str(gguf_path), dtype="float32", num_kv_blocks=256, max_num_batched_tokens=24,
              max_num_seqs=8)
    assert llm.model_info.architecture == ARCHITECTURES[name]
    prompts = _prompts(llm.model_info.vocab_size)
    _check(llm, hf_dir, prompts, f"{name}/gguf-chunked")
    _check(llm, hf_dir, prompts, f"{name}/gguf-prefix-hits")
    assert llm.scheduler.kv.stats.hits > 0


@pytest.mark.slow
def test_tp2_over_gloo_matches_one_rank(twins, tmp_path):
    """Each rank reads the whole dequantized tensor and keeps its slice: Phi-3's fused qkv /
    gate_up cut before sharding, Gemma 3's norms offset, StarCoder2's biases."""
    from tests.support.paged_prefill import assert_tp2_matches_tp1
    assert_tp2_matches_tp1([twins(name)[1] for name in ("phi3", "gemma3", "starcoder2")],
                           tmp_path)


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "phi3", "starcoder2"])
def test_weights_and_shapes_equal_transformers_gguf_loader(twins, name):
    """Where transformers reads the family's GGUF files: every tensor we yield equals the one
    its loader puts in the model (names, fused pieces, norms with the + 1 taken off), and the
    config's shape fields agree."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine_common.model_files.gguf_config import hf_config_from_gguf
    from engine_common.model_files.gguf_file import GGUFFile
    from worker_service.models.gguf_weights import iter_gguf_weights

    _, path = twins(name)
    ours_cfg = hf_config_from_gguf(GGUFFile.open(path))
    ref_cfg = AutoConfig.from_pretrained(path.parent, gguf_file=path.name).to_dict()
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "tie_word_embeddings"):
        assert ours_cfg[key] == ref_cfg[key], key
    ref = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                               dtype=torch.float32).state_dict()
    ours = dict(iter_gguf_weights(GGUFFile.open(path), ours_cfg))
    assert set(ours) <= set(ref)
    for key, value in ours.items():
        torch.testing.assert_close(torch.from_numpy(value), ref[key], rtol=0, atol=0,
                                   msg=key)
