"""model_files/checkpoint_dtype.py and the loader's resolve_dtype on a config.json without
`dtype` (openai/gpt-oss-20b's names none): the weights' dtype as transformers 5's default
dtype="auto" takes it (the first floating tensor of the first checkpoint file), single-file
and sharded; a config's dtype still wins; no checkpoint or no floating tensor: float32."""
from __future__ import annotations

import json
import shutil
import struct

import pytest
import torch

from engine_common.model_files.checkpoint_dtype import checkpoint_dtype
from worker_service.models.loader import resolve_dtype

transformers = pytest.importorskip("transformers")


def resaved_without_dtype(src, dst, dtype: torch.dtype, **save_kwargs):
    """src's model saved in `dtype`, its config.json then stripped of dtype / torch_dtype."""
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=dtype)
    shutil.copytree(src, dst)
    for old in dst.glob("model*.safetensors*"):
        old.unlink()
    model.save_pretrained(dst, **save_kwargs)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.pop("dtype", None), cfg.pop("torch_dtype", None)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst, cfg


@pytest.mark.parametrize("dtype,shard", [(torch.bfloat16, None), (torch.float16, "100KB"),
                                         (torch.float32, None)])
def test_the_checkpoint_dtype_is_transformers_auto(tiny_models, tmp_path, dtype, shard):
    kwargs = {} if shard is None else {"max_shard_size": shard}
    path, cfg = resaved_without_dtype(tiny_models("gpt_oss"), tmp_path / "m", dtype, **kwargs)
    assert (path / "model.safetensors.index.json").exists() == (shard is not None)
    want = transformers.AutoModelForCausalLM.from_pretrained(path).dtype
    assert want == dtype
    assert checkpoint_dtype(path) == str(dtype).removeprefix("torch.")
    assert resolve_dtype(cfg, None, path) == resolve_dtype(cfg, "auto", path) == dtype
    assert resolve_dtype({**cfg, "dtype": "float32"}, None, path) == torch.float32
    assert resolve_dtype(cfg, "float16", path) == torch.float16
    assert resolve_dtype(cfg) == torch.float32               # no directory: as before


def test_gpt_oss_without_dtype_loads_in_its_weights_dtype(tiny_models, tmp_path):
    """Was: float32, twice the bytes of gpt-oss-20b's bfloat16 weights."""
    from kernels.attention.selector import get_attention_backend
    from worker_service.models.loader import load_model
    from worker_service.parallel_state import single_rank_group
    path, _ = resaved_without_dtype(tiny_models("gpt_oss"), tmp_path / "m", torch.bfloat16)
    model = load_model(path, single_rank_group(), get_attention_backend("torch", "cpu"), "cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_no_floating_tensor_or_no_checkpoint_says_none(tmp_path):
    header = json.dumps({"__metadata__": {"format": "pt"},
                         "a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0")
    assert checkpoint_dtype(tmp_path) is None
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 8)       # a header far too long
    assert checkpoint_dtype(tmp_path) is None
    assert checkpoint_dtype(tmp_path / "absent") is None


def test_a_quantized_checkpoints_scales_are_not_its_dtype(tmp_path):
    """An FP8 checkpoint whose config names no dtype: its float32 weight_scale_inv (first in
    key order here) and F8 weights are skipped; the bfloat16 plain tensors are the dtype, so
    --dtype auto and the memory estimate never take FP8 or the scales' float32."""
    from safetensors.torch import save_file
    save_file({"a.weight_scale_inv": torch.ones(1, 1),
               "a.weight": torch.zeros(2, 2).to(torch.float8_e4m3fn),
               "b.norm.weight": torch.ones(2, dtype=torch.bfloat16)},
              tmp_path / "model.safetensors")
    assert checkpoint_dtype(tmp_path) == "bfloat16"
    assert resolve_dtype({"quantization_config": {"quant_method": "fp8"}}, "auto",
                         tmp_path) == torch.bfloat16
