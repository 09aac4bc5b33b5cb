"""config.json and generation_config.json from GGUF metadata: the fields transformers' GGUF
loader reads agree, Qwen3's head width comes from attention.key_length, and what the engine
cannot run is refused by name."""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
from transformers import AutoConfig

from engine_common.model_files.gguf_config import generation_config_from_gguf, hf_config_from_gguf
from engine_common.model_files.gguf_file import GGUFError, GGUFFile
from engine_common.model_files.model_dir import ModelDirError, ModelInfo

SHAPE_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "rms_norm_eps", "max_position_embeddings", "vocab_size",
                "tie_word_embeddings", "eos_token_id")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_config_agrees_with_transformers_gguf_loader(tiny_ggufs, arch):
    path = Path(tiny_ggufs(arch))
    ours = hf_config_from_gguf(GGUFFile.open(path))
    ref = AutoConfig.from_pretrained(path.parent, gguf_file=path.name).to_dict()
    for field in SHAPE_FIELDS:
        assert ours[field] == ref[field], field
    assert ours["rope_parameters"]["rope_theta"] == ref["rope_parameters"]["rope_theta"]
    assert ours["model_type"] == ref["model_type"]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_config_reproduces_the_original_model_config(tiny_models, tiny_ggufs, arch):
    path = tiny_ggufs(arch)
    original = json.loads((Path(tiny_models("llama", rope_scaling=None) if arch == "llama"
                                else tiny_models(arch)) / "config.json").read_text())
    ours = hf_config_from_gguf(GGUFFile.open(path))
    for field in SHAPE_FIELDS + ("head_dim",):
        if field == "rms_norm_eps":   # GGUF stores it as float32, as transformers reads it
            assert ours[field] == pytest.approx(original[field], rel=1e-6)
        else:
            assert ours[field] == original[field], field
    assert ours["architectures"] == original["architectures"]
    assert ours["tie_word_embeddings"] is original["tie_word_embeddings"]


def test_model_info_of_a_gguf_path_and_of_its_directory(tiny_ggufs):
    path = Path(tiny_ggufs("qwen3"))
    for given in (path, path.parent):
        info = ModelInfo.from_dir(given)
        assert info.architecture == "Qwen3ForCausalLM" and info.name == path.stem
        assert info.eos_token_ids == (0,) and info.vocab_size == 512


def _minimal(tmp_path, arch="llama", extra=None, tensors=("token_embd.weight",), eos=1):
    import numpy as np

    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), arch)
    for key, value in {"block_count": 1, "context_length": 64, "embedding_length": 32,
                       "feed_forward_length": 64, "attention.head_count": 2,
                       "attention.layer_norm_rms_epsilon": 1e-5}.items():
        (w.add_uint32 if isinstance(value, int) else w.add_float32)(f"{arch}.{key}", value)
    w.add_array("tokenizer.ggml.tokens", ["a", "b"])
    if eos is not None:
        w.add_uint32("tokenizer.ggml.eos_token_id", eos)
    for key, value in (extra or {}).items():
        w.add_key_value(key, *value)
    for name in tensors:
        value = tensors[name] if isinstance(tensors, dict) else np.zeros((2, 32), np.float32)
        w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return GGUFFile.open(tmp_path / "m.gguf")


def test_defaults_when_optional_keys_are_missing(tmp_path):
    cfg = hf_config_from_gguf(_minimal(tmp_path))
    assert cfg["num_key_value_heads"] == 2 and cfg["head_dim"] == 16
    assert cfg["vocab_size"] == 2 and cfg["tie_word_embeddings"] is True
    assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}


def test_generation_config_ends_on_eot_and_eom_too(tmp_path):
    u32 = gguf.GGUFValueType.UINT32
    f = _minimal(tmp_path, extra={"tokenizer.ggml.eot_token_id": (0, u32),
                                  "tokenizer.ggml.eom_token_id": (1, u32)})
    assert generation_config_from_gguf(f)["eos_token_id"] == [1, 0]


def test_special_ids_past_the_vocabulary_are_dropped_and_warned_once(tmp_path, caplog):
    """llama.cpp keeps a special id only below the token count ("bad special token ... using
    default id"); transformers' GGUF tokenizer fails on one (tokens[id]). Such an id names no
    token the model can read or produce, so config.json and generation_config.json leave it
    out, with one warning per file and key in a process (the files are read several times:
    config.json, generation_config.json, the tokenizer bundle), naming the key, the value and
    the vocabulary size."""
    u32 = gguf.GGUFValueType.UINT32
    f = _minimal(tmp_path, extra={"tokenizer.ggml.bos_token_id": (2, u32),
                                  "tokenizer.ggml.padding_token_id": (32000, u32),
                                  "tokenizer.ggml.eot_token_id": (7, u32),
                                  "tokenizer.ggml.eom_token_id": (0, u32)})
    with caplog.at_level("WARNING"):
        for _ in range(2):
            cfg, gen = hf_config_from_gguf(f), generation_config_from_gguf(f)
    assert {k: cfg.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")} == {
        "bos_token_id": None, "eos_token_id": 1, "pad_token_id": None}
    assert gen == {"eos_token_id": [1, 0]}
    for key, value in (("bos_token_id", 2), ("padding_token_id", 32000), ("eot_token_id", 7)):
        assert caplog.text.count(f"tokenizer.ggml.{key}={value} is past the vocabulary "
                                 "(2 tokens): dropped") == 1, key
    assert "no end-of-generation id" not in caplog.text


@pytest.mark.parametrize("eot", [None, 0])
def test_an_eos_past_the_vocabulary_says_when_nothing_ends_generation(tmp_path, caplog, eot):
    """With its eos dropped and no eot/eom id, nothing ends a request but its max_tokens, a
    stop string or the model's length: said once, by name; an eot id alone still ends it (it
    was left out of generation_config.json unless an eos came with it)."""
    extra = {} if eot is None else {"tokenizer.ggml.eot_token_id": (eot,
                                                                     gguf.GGUFValueType.UINT32)}
    f = _minimal(tmp_path, eos=5, extra=extra)
    with caplog.at_level("WARNING"):
        configs = [(hf_config_from_gguf(f), generation_config_from_gguf(f)) for _ in range(2)]
    assert caplog.text.count("tokenizer.ggml.eos_token_id=5 is past the vocabulary") == 1
    assert "eos_token_id" not in configs[0][0]
    assert configs[0][1] == ({} if eot is None else {"eos_token_id": 0})
    assert caplog.text.count("no end-of-generation id is left") == (1 if eot is None else 0)


def test_unsupported_architecture_is_named(tmp_path):
    with pytest.raises(GGUFError, match="general.architecture='gpt2' is not supported: must "
                                        "be one of \\['gemma', 'gemma2', 'gemma3', 'llama', "
                                        "'phi3', 'qwen2', 'qwen3', 'starcoder2'\\]$"):
        hf_config_from_gguf(_minimal(tmp_path, arch="gpt2"))


@pytest.mark.parametrize("arch, hf_arch", [("olmo2", "Olmo2ForCausalLM"),
                                           ("command-r", "CohereForCausalLM"),
                                           ("smollm3", "SmolLM3ForCausalLM")])
def test_a_family_served_from_hugging_face_only_is_named_with_the_way_out(tmp_path, arch,
                                                                          hf_arch):
    with pytest.raises(GGUFError, match=rf"general.architecture='{arch}' is not supported: "
                                        rf"must be one of .*; {arch} GGUF files are not read: "
                                        rf"serve the Hugging Face checkpoint \({hf_arch}\)"):
        hf_config_from_gguf(_minimal(tmp_path, arch=arch))


def test_llama3_rope_scaling_is_read_back_from_rope_freqs(tiny_models, tiny_ggufs):
    original = json.loads((Path(tiny_models("llama")) / "config.json").read_text())
    want = {**(original.get("rope_scaling") or {}), **(original.get("rope_parameters") or {})}
    got = hf_config_from_gguf(GGUFFile.open(tiny_ggufs("llama3")))["rope_parameters"]
    assert got["rope_type"] == "llama3" == want["rope_type"]
    for key in ("rope_theta", "factor", "low_freq_factor", "high_freq_factor",
                "original_max_position_embeddings"):
        assert got[key] == pytest.approx(want[key], rel=1e-6), key


def test_rope_scaling_the_engine_cannot_run_is_refused(tmp_path):
    import numpy as np

    odd = {"token_embd.weight": np.zeros((2, 32), np.float32),
           "rope_freqs.weight": np.array([1, 3, 2, 5, 1, 1, 1, 1], np.float32)}
    with pytest.raises(GGUFError, match="rope_freqs.weight is not Llama 3.1 rope scaling"):
        hf_config_from_gguf(_minimal(tmp_path, tensors=odd))
    (tmp_path / "a").mkdir()
    with pytest.raises(GGUFError, match=r"rope_freqs.weight is F32 \(2, 32\): must be F32 \(8,\)"):
        hf_config_from_gguf(_minimal(tmp_path / "a",
                                     tensors=("token_embd.weight", "rope_freqs.weight")))
    (tmp_path / "b").mkdir()
    f = _minimal(tmp_path / "b", extra={"llama.rope.scaling.type": ("yarn",
                                                                    gguf.GGUFValueType.STRING)})
    with pytest.raises(GGUFError, match="llama.rope.scaling.type='yarn' is not supported"):
        hf_config_from_gguf(f)


def test_missing_required_key_is_named(tmp_path):
    f = _minimal(tmp_path)
    del f.metadata["llama.block_count"]
    with pytest.raises(GGUFError, match="metadata key 'llama.block_count' is missing"):
        hf_config_from_gguf(f)


def test_model_info_reports_gguf_problems_as_model_dir_errors(tmp_path):
    (tmp_path / "bad.gguf").write_bytes(b"nope")
    with pytest.raises(ModelDirError, match="is not a GGUF file"):
        ModelInfo.from_dir(tmp_path / "bad.gguf")
