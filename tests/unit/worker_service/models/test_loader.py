"""Weight loading: sharded vs single file, dtypes, errors and per-rank slices (TP=2 against TP=1
end to end: tests/integration/test_tp2_loader.py)."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from worker_service.models.tiny_model import make_tiny_model
from kernels.attention.torch_ref import TorchAttentionBackend
from kernels.cpu import extension
from worker_service.models.loader import (WeightLoadError, allocate_kv_caches, kv_cache_shape,
                                          load_model)
from worker_service.models.registry import UnsupportedArchitectureError, get_model_class
from worker_service.parallel_state import TPGroup, single_rank_group

BACKEND = TorchAttentionBackend()

# these check the weights the loader writes, read back from the parameters
pytestmark = pytest.mark.usefixtures("keep_dense_weights")


@pytest.fixture(scope="module")
def qwen3_dirs(tmp_path_factory):
    """The same qwen3 weights saved as one file and as a sharded index."""
    single = make_tiny_model(tmp_path_factory.mktemp("single"), arch="qwen3", seed=3)
    sharded = make_tiny_model(tmp_path_factory.mktemp("sharded"), arch="qwen3", seed=3,
                              shard_size="60KB")
    return single, sharded


def load(path, tp=None, dtype=None):
    return load_model(path, tp or single_rank_group(), BACKEND, "cpu", dtype=dtype)


def test_sharded_and_single_file_load_identically(qwen3_dirs):
    single, sharded = qwen3_dirs
    assert (sharded / "model.safetensors.index.json").exists()
    assert not (single / "model.safetensors.index.json").exists()
    a, b = load(single).state_dict(), load(sharded).state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_weights_equal_checkpoint_and_tied_head(qwen3_dirs):
    single, _ = qwen3_dirs
    model = load(single)
    ckpt = load_file(single / "model.safetensors")
    assert model.lm_head_is_tied
    assert torch.equal(model.lm_head.weight, ckpt["model.embed_tokens.weight"])
    qkv = model.model.layers[1].self_attn.qkv_proj.weight
    expected = torch.cat([ckpt[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(qkv, expected)
    gate_up = model.model.layers[0].mlp.gate_up_proj.weight
    assert torch.equal(gate_up, torch.cat([ckpt["model.layers.0.mlp.gate_proj.weight"],
                                           ckpt["model.layers.0.mlp.up_proj.weight"]]))


def test_dtype_from_config_and_override(qwen3_dirs):
    single, _ = qwen3_dirs
    assert load(single).model.embed_tokens.weight.dtype == torch.float32       # config dtype
    assert load(single, dtype="auto").lm_head.weight.dtype == torch.float32
    model = load(single, dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert allocate_kv_caches(model, 3, 4, "cpu")[0].dtype == torch.bfloat16
    assert load(single, dtype=torch.float16).model.norm.weight.dtype == torch.float16
    with pytest.raises(ValueError, match="dtype='int8'"):
        load(single, dtype="int8")


def test_kv_cache_shape_follows_model(qwen3_dirs):
    model = load(qwen3_dirs[0])
    assert kv_cache_shape(model, 10, 16) == (2, 10, 16, 2, 16)
    assert len(allocate_kv_caches(model, 10, 16, "cpu")) == model.num_layers == 2


def test_unknown_architecture_is_a_clear_error(qwen3_dirs, tmp_path):
    with pytest.raises(UnsupportedArchitectureError, match="Qwen3ForCausalLM"):
        get_model_class("GPT2LMHeadModel")
    bad = tmp_path / "bad"
    bad.mkdir()
    config = json.loads((qwen3_dirs[0] / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "architectures": ["Nope"]}))
    with pytest.raises(UnsupportedArchitectureError, match="architecture='Nope'"):
        load(bad)


def copy_with_tensors(src, dst, edit):
    """A copy of model dir src whose weights are edit(tensors)."""
    dst.mkdir()
    for name in ("config.json", "generation_config.json"):
        (dst / name).write_text((src / name).read_text())
    save_file(edit(load_file(src / "model.safetensors")), dst / "model.safetensors")
    return dst


def test_missing_and_unexpected_weights_are_errors(qwen3_dirs, tmp_path):
    single, _ = qwen3_dirs
    missing = copy_with_tensors(single, tmp_path / "missing", lambda t: {
        k: v for k, v in t.items() if k != "model.layers.0.self_attn.k_proj.weight"})
    with pytest.raises(WeightLoadError, match=r"qkv_proj.weight\[k\]"):
        load(missing)
    extra = copy_with_tensors(single, tmp_path / "extra",
                              lambda t: {**t, "model.layers.0.foo.weight": torch.zeros(2)})
    with pytest.raises(WeightLoadError, match="model.layers.0.foo.weight"):
        load(extra)
    wrong = copy_with_tensors(single, tmp_path / "wrong", lambda t: {
        **t, "model.norm.weight": torch.zeros(3)})
    with pytest.raises(WeightLoadError, match="model.norm.weight"):
        load(wrong)


def test_absent_lm_head_is_tied_to_embeddings(tmp_path):
    path = make_tiny_model(tmp_path / "src", arch="llama")
    headless = copy_with_tensors(path, tmp_path / "headless", lambda t: {
        k: v for k, v in t.items() if k != "lm_head.weight"})
    model = load(headless)
    assert model.lm_head_is_tied
    assert not load(path).lm_head_is_tied


def test_tiny_tokenizer_module_does_not_import_torch():
    code = ("import sys, engine_common.text.tiny_tokenizer; "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("num_kv_heads,world", [(1, 2), (2, 4), (2, 2)])
def test_rank_slices(tmp_path, num_kv_heads, world):
    """q heads, MLP and vocab split by rank; kv heads split, or replicated when fewer than
    ranks (rank r keeps kv head r * num_kv_heads // world)."""
    path = make_tiny_model(tmp_path, arch="llama", num_key_value_heads=num_kv_heads)
    ckpt = load_file(path / "model.safetensors")
    q_rows, inter, vocab, d = 64 // world, 128 // world, 512 // world, 16
    for rank in range(world):
        model = load(path, tp=TPGroup(rank=rank, world_size=world))
        attn = model.model.layers[0].self_attn
        kv_head = rank * num_kv_heads // world if num_kv_heads < world else rank
        kv_rows = d * max(num_kv_heads // world, 1)
        q = ckpt["model.layers.0.self_attn.q_proj.weight"][rank * q_rows:(rank + 1) * q_rows]
        k = ckpt["model.layers.0.self_attn.k_proj.weight"][kv_head * d:kv_head * d + kv_rows]
        v = ckpt["model.layers.0.self_attn.v_proj.weight"][kv_head * d:kv_head * d + kv_rows]
        assert torch.equal(attn.qkv_proj.weight, torch.cat([q, k, v]))
        o = ckpt["model.layers.0.self_attn.o_proj.weight"][:, rank * q_rows:(rank + 1) * q_rows]
        assert torch.equal(attn.o_proj.weight, o)
        down = ckpt["model.layers.0.mlp.down_proj.weight"][:, rank * inter:(rank + 1) * inter]
        assert torch.equal(model.model.layers[0].mlp.down_proj.weight, down)
        up = ckpt["model.layers.0.mlp.up_proj.weight"][rank * inter:(rank + 1) * inter]
        assert torch.equal(model.model.layers[0].mlp.gate_up_proj.weight[inter:], up)
        head = ckpt["lm_head.weight"][rank * vocab:(rank + 1) * vocab]
        assert not model.lm_head_is_tied and torch.equal(model.lm_head.weight, head)
        assert model.num_kv_heads == max(num_kv_heads // world, 1)


def test_rope_tables_are_shared_by_all_layers(tmp_path):
    """One cos/sin table per model, not one per layer (each is [max_position, head_dim] fp32 on
    the device and would come straight out of the KV cache)."""
    path = make_tiny_model(tmp_path, arch="qwen3", num_hidden_layers=3)
    model = load_model(str(path), single_rank_group(), BACKEND, "cpu")
    tables = {id(b) for name, b in model.named_buffers(remove_duplicate=False)
              if name.endswith("cos_cache")}
    assert len(tables) == 1


def test_loading_says_how_far_it_is(qwen3_dirs, caplog):
    """A line at each quarter of the checkpoint's tensors, the last at 100%."""
    caplog.set_level(logging.INFO, logger="worker_service.models.loader")
    load(qwen3_dirs[0])
    lines = [r.getMessage() for r in caplog.records if "loading weights of" in r.getMessage()]
    assert [line.split(": ")[1].split("%")[0] for line in lines] == ["25", "50", "75", "100"]


@pytest.mark.skipif(os.environ.get(extension.ENV_SWITCH) == "0", reason="switched off")
def test_packing_for_the_cpu_kernels_says_how_far_it_is(qwen3_dirs, caplog):
    """The CPU's long step after the weights (packing them for the GEMM kernels) counts its
    layers: a line at each quarter, the last at 100% of every module it prepared."""
    caplog.set_level(logging.INFO, logger="worker_service.layers.cpu_kernels")
    load_model(str(qwen3_dirs[0]), single_rank_group(), BACKEND, "cpu")
    lines = [r.getMessage() for r in caplog.records
             if r.getMessage().startswith("packing weights for the CPU kernels")]
    percents = [int(line.split(": ")[1].split("%")[0]) for line in lines]
    assert len(percents) == 4 and percents == sorted(percents) and percents[-1] == 100
    assert percents[0] >= 25 and "layers, " in lines[-1]
