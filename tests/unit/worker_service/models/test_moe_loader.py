"""Loading MoE checkpoints: per-expert tensors land in the stacked expert weights (and this rank's
slice of them); a missing, extra or mis-shaped expert tensor is an error naming it; the TP sizes
a MoE config allows."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from kernels.attention.torch_ref import TorchAttentionBackend
from worker_service.models.loader import WeightLoadError, load_model
from worker_service.models.qwen_moe import SparseMoeBlock
from worker_service.models.tiny_model import make_tiny_model
from worker_service.models.tp_sizes import tp_size_problem, valid_tp_sizes
from worker_service.parallel_state import TPGroup, single_rank_group

EXPERTS = "model.layers.0.mlp.experts"
pytestmark = pytest.mark.usefixtures("keep_dense_weights")   # reads the stacked parameters


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("moe"), arch="qwen2_moe", seed=5)


def load(path, tp=None):
    return load_model(path, tp or single_rank_group(), TorchAttentionBackend(), "cpu")


def copy_with_tensors(src, dst, edit):
    dst.mkdir()
    for name in ("config.json", "generation_config.json"):
        (dst / name).write_text((src / name).read_text())
    save_file(edit(load_file(src / "model.safetensors")), dst / "model.safetensors")
    return dst


def test_expert_tensors_fill_the_stacked_weights_per_rank(moe_dir):
    ckpt = load_file(moe_dir / "model.safetensors")
    whole = load(moe_dir)
    assert [type(layer.mlp).__name__ for layer in whole.model.layers] == [
        "SparseMoeBlock", "DecoderMLP", "SparseMoeBlock"]
    gate, up, down = (ckpt[f"{EXPERTS}.5.{p}_proj.weight"] for p in ("gate", "up", "down"))
    experts = whole.model.layers[0].mlp.experts
    assert torch.equal(experts.w13_weight[5], torch.cat([gate, up]))
    assert torch.equal(experts.w2_weight[5], down)
    half = gate.shape[0] // 2
    rank1 = load(moe_dir, TPGroup(rank=1, world_size=2)).model.layers[0].mlp
    assert torch.equal(rank1.experts.w13_weight[5], torch.cat([gate[half:], up[half:]]))
    assert torch.equal(rank1.experts.w2_weight[5], down[:, half:])
    # the router and the shared expert's gate are replicated
    assert torch.equal(rank1.gate.weight, ckpt["model.layers.0.mlp.gate.weight"])
    assert torch.equal(rank1.shared_expert_gate.weight,
                       ckpt["model.layers.0.mlp.shared_expert_gate.weight"])
    assert isinstance(rank1, SparseMoeBlock)


def test_qwen2_moe_qkv_bias_follows_its_own_config_key(tmp_path):
    """transformers' Qwen2-MoE reads qkv_bias (default on), not attention_bias."""
    with_bias = load(make_tiny_model(tmp_path / "on", arch="qwen2_moe", num_hidden_layers=2))
    without = load(make_tiny_model(tmp_path / "off", arch="qwen2_moe", num_hidden_layers=2,
                                   qkv_bias=False))
    assert with_bias.model.layers[0].self_attn.qkv_proj.bias is not None
    assert without.model.layers[0].self_attn.qkv_proj.bias is None
    assert with_bias.model.layers[0].self_attn.o_proj.bias is None


def test_a_missing_expert_tensor_is_named(moe_dir, tmp_path):
    gone = f"{EXPERTS}.3.up_proj.weight"
    missing = copy_with_tensors(moe_dir, tmp_path / "missing",
                                lambda t: {k: v for k, v in t.items() if k != gone})
    with pytest.raises(WeightLoadError, match=r"1 parameters are missing from the checkpoint: "
                                              rf"\['{gone}'\]"):
        load(missing)


def test_an_extra_expert_tensor_is_named(moe_dir, tmp_path):
    ninth = f"{EXPERTS}.8.down_proj.weight"       # the config has 8 experts: 0..7
    extra = copy_with_tensors(moe_dir, tmp_path / "extra", lambda t: {
        **t, ninth: t[f"{EXPERTS}.0.down_proj.weight"].clone()})
    with pytest.raises(WeightLoadError, match=rf"'{ninth}': expert 8 is out of range"):
        load(extra)
    dense = "model.layers.1.mlp.experts.0.gate_proj.weight"   # layer 1 has no experts
    in_dense = copy_with_tensors(moe_dir, tmp_path / "in_dense", lambda t: {
        **t, dense: t[f"{EXPERTS}.0.gate_proj.weight"].clone()})
    with pytest.raises(WeightLoadError, match=rf"match no parameter: \['{dense}'\]"):
        load(in_dense)


def test_a_mis_shaped_expert_tensor_is_named(moe_dir, tmp_path):
    name = f"{EXPERTS}.2.gate_proj.weight"
    wrong = copy_with_tensors(moe_dir, tmp_path / "wrong", lambda t: {
        **t, name: torch.zeros(5, 64)})
    with pytest.raises(WeightLoadError, match=rf"'{name}'.*does not match parameter shape"):
        load(wrong)


def test_tp_sizes_must_divide_the_expert_widths():
    cfg = {"num_attention_heads": 8, "num_key_value_heads": 8, "intermediate_size": 96,
           "moe_intermediate_size": 12, "shared_expert_intermediate_size": 20}
    assert tp_size_problem(cfg, 8) == "does not divide moe_intermediate_size=12"
    assert tp_size_problem({**cfg, "moe_intermediate_size": 16}, 8) == (
        "does not divide shared_expert_intermediate_size=20")
    assert valid_tp_sizes(cfg) == [1, 2, 4]
