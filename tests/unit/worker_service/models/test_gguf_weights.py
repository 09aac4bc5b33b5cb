"""GGUF tensors under Hugging Face names: the weights equal transformers' GGUF loader's (Llama,
Qwen2) and the original checkpoint (F32, all three families); the engine's model built from a
GGUF equals the one built from the original directory."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from transformers import AutoModelForCausalLM

from engine_common.model_files.gguf_config import hf_config_from_gguf
from engine_common.model_files.gguf_file import GGUFError, GGUFFile
from engine_common.model_files.model_dir import ModelDirError
from kernels.attention.torch_ref import TorchAttentionBackend
from tests.support.gguf_files import llama_cpp_permute
from worker_service.models.gguf_weights import hf_name, iter_gguf_weights, unpermute_rows
from worker_service.models.loader import load_model
from worker_service.parallel_state import single_rank_group

# these check the weights the loader writes, read back from the parameters
pytestmark = pytest.mark.usefixtures("keep_dense_weights")


def _ours(path) -> dict[str, np.ndarray]:
    f = GGUFFile.open(path)
    return dict(iter_gguf_weights(f, hf_config_from_gguf(f)))


def _original(tiny_models, arch) -> Path:
    """The directory a tiny GGUF was written from ("llama3": the llama with llama3 rope)."""
    if arch == "llama":
        return Path(tiny_models("llama", rope_scaling=None))
    return Path(tiny_models("llama" if arch == "llama3" else arch))


def test_names():
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("blk.12.attn_k.bias") == "model.layers.12.self_attn.k_proj.bias"
    assert hf_name("blk.0.attn_q_norm.weight") == "model.layers.0.self_attn.q_norm.weight"
    assert hf_name("blk.3.ffn_down.weight") == "model.layers.3.mlp.down_proj.weight"
    assert hf_name("rope_freqs.weight") is None and hf_name("blk.x.attn_q.weight") is None


@pytest.mark.parametrize("shape, heads", [((24, 8), 3), ((12,), 2), ((64, 32), 4)])
def test_unpermute_inverts_llama_cpp_permute(shape, heads):
    w = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    permuted = llama_cpp_permute(w, heads)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(unpermute_rows(permuted, heads), w)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("qtype", ["F32", "Q4_0", "Q4_1", "Q8_0", "F16"])
def test_weights_equal_transformers_gguf_loader(tiny_ggufs, arch, qtype):
    path = Path(tiny_ggufs(arch, qtype))
    ref = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                               dtype=torch.float32).state_dict()
    ours = _ours(path)
    assert set(ours) <= set(ref) and set(ref) - set(ours) <= {"lm_head.weight"}  # tied head
    for name, w in ours.items():
        np.testing.assert_array_equal(w, ref[name].numpy(), err_msg=name)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_f32_weights_equal_the_original_checkpoint(tiny_models, tiny_ggufs, arch):
    original = load_file(str(_original(tiny_models, arch) / "model.safetensors"))
    ours = _ours(tiny_ggufs(arch))
    assert set(ours) == set(original)
    for name, w in ours.items():
        np.testing.assert_array_equal(w, original[name], err_msg=name)


@pytest.mark.parametrize("arch", ["llama", "llama3", "qwen3"])
def test_engine_model_from_gguf_equals_model_from_directory(tiny_models, tiny_ggufs, arch):
    """Weights, and the rope tables (llama3: rebuilt from the file's rope_freqs)."""
    def load(path):
        return load_model(path, single_rank_group(), TorchAttentionBackend(), "cpu")

    a, b = load(tiny_ggufs(arch)), load(_original(tiny_models, arch))
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name
    rope_a = a.model.layers[0].self_attn.rotary_emb
    rope_b = b.model.layers[0].self_attn.rotary_emb
    torch.testing.assert_close(rope_a.cos_cache, rope_b.cos_cache, rtol=0, atol=1e-6)
    torch.testing.assert_close(rope_a.sin_cache, rope_b.sin_cache, rtol=0, atol=1e-6)


def test_a_tensor_without_a_hf_name_is_refused(tmp_path, tiny_ggufs):
    w = gguf.GGUFWriter(str(tmp_path / "odd.gguf"), "llama")
    w.add_tensor("blk.0.attn_weird.weight", np.zeros((2, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = GGUFFile.open(tmp_path / "odd.gguf")
    with pytest.raises(GGUFError, match="'blk.0.attn_weird.weight' has no Hugging Face"):
        list(iter_gguf_weights(f, {"num_attention_heads": 1, "num_key_value_heads": 1,
                                   "general.architecture": "llama"}))


def test_load_model_reports_gguf_problems_as_model_dir_errors(tmp_path):
    (tmp_path / "broken.gguf").write_bytes(b"GGUF" + b"\0" * 8)
    with pytest.raises(ModelDirError):
        load_model(tmp_path / "broken.gguf", single_rank_group(), TorchAttentionBackend(), "cpu")
