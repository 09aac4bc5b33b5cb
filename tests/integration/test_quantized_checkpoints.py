"""Weight-quantized checkpoints (engine_common/model_files/weight_quant.py,
worker_service/models/quant_checkpoint.py) against transformers on their dequantized twins
(tests/support/quant_models.py): every architecture we serve loads each format to the twin's
weights bit for bit; the engine's greedy tokens equal transformers' generate() on the twin in
float32; --dtype auto takes the config's torch_dtype (never FP8); TP=2 ranks read their own
blocks and groups and agree with one rank; shards off a block or group edge, and tensors that
do not fit the config, are refused by name."""
from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from deltaserve.llm import LLM
from engine_common.model_files.model_dir import ModelDirError, ModelInfo
from kernels.attention.torch_ref import TorchAttentionBackend
from tests.support.engine_checks import _check, _prompts
from tests.support.paged_prefill import assert_tp2_matches_tp1, prefill_logits
from tests.support.quant_models import FORMATS, make_quantized_pair
from worker_service.models.loader import WeightLoadError, load_model, resolve_dtype
from worker_service.config import RunnerConfig
from worker_service.models.tiny_model import ARCHS
from worker_service.parallel_state import TPGroup, single_rank_group
from worker_service.runner.memory_fit import (estimate_cpu_linear_bytes,
                                              estimate_weight_bytes, kv_room_bytes)

SERVED_ARCHS = [a for a in ARCHS if a != "gpt_oss"]      # GPT-OSS ships MXFP4 experts

# some tests compare the weights the loader writes, read back from the parameters
pytestmark = pytest.mark.usefixtures("keep_dense_weights")


@pytest.fixture(scope="module")
def quant_pair(tiny_models, tmp_path_factory):
    """(quantized, twin) dirs of a tiny `arch` model in `fmt`, built once each."""
    root = tmp_path_factory.mktemp("quant")
    cache = {}

    def get(arch: str, fmt: str, **kwargs):
        key = (arch, fmt, tuple(sorted(kwargs.items())))
        if key not in cache:
            cache[key] = make_quantized_pair(tiny_models(arch), root / f"{arch}-{len(cache)}",
                                             fmt, **kwargs)
        return cache[key]
    return get


def ours(path, dtype="float32", tp=None):
    return load_model(path, tp or single_rank_group(), TorchAttentionBackend(), "cpu", dtype)


def assert_same_weights(got, want) -> None:
    a, b = dict(got.named_parameters()), dict(want.named_parameters())
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


@pytest.mark.slow              # 15 architectures x 5 formats: about 2 minutes on 2 cores
@pytest.mark.parametrize("arch", SERVED_ARCHS)
def test_every_format_loads_as_its_dequantized_twin(quant_pair, arch):
    for fmt in FORMATS:
        quantized, twin = quant_pair(arch, fmt)
        ModelInfo.from_dir(quantized)                   # the scheduler side accepts it
        assert_same_weights(ours(quantized), ours(twin))


@pytest.mark.parametrize("arch,fmt", [("qwen3", f) for f in FORMATS]
                         + [("qwen3_moe", "fp8"), ("llama", "gptq"), ("phi3", "awq"),
                            ("deepseek_v3", "fp8"), ("glm4", "gptq"), ("cohere", "fp8-ct")])
def test_greedy_matches_transformers_on_the_twin(quant_pair, arch, fmt):
    quantized, twin = quant_pair(arch, fmt)
    llm = LLM(str(quantized), dtype="float32", num_kv_blocks=256, max_num_batched_tokens=24,
              max_num_seqs=8)
    _check(llm, str(twin), _prompts(llm.model_info.vocab_size)[:6], f"{arch}/{fmt}")


def test_partial_fp8_blocks_load(quant_pair):
    """Blocks of 48 x 48 over 64- and 128-wide weights: the last block row and column are
    partial, as in real checkpoints whose sizes are not multiples of 128."""
    quantized, twin = quant_pair("qwen3", "fp8", block=(48, 48))
    assert_same_weights(ours(quantized), ours(twin))


def test_dtype_auto_is_the_configs_torch_dtype_never_fp8(quant_pair, tmp_path):
    """A Qwen3-FP8 config names torch_dtype bfloat16: --dtype auto loads bfloat16 weights (the
    FP8 values times their scales, rounded once), and the memory estimate counts 2 bytes each."""
    quantized, twin = quant_pair("qwen3", "fp8")
    path = shutil.copytree(quantized, tmp_path / "bf16")
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("dtype", None)                  # as the released config.json: torch_dtype only
    cfg["torch_dtype"] = "bfloat16"
    (path / "config.json").write_text(json.dumps(cfg))
    assert resolve_dtype(cfg, "auto", path) == resolve_dtype(cfg, None, path) == torch.bfloat16
    got = ours(path, dtype="auto")
    assert {p.dtype for p in got.parameters()} == {torch.bfloat16}
    assert_same_weights(got, ours(twin, dtype="bfloat16"))
    _, weights, _ = kv_room_bytes(RunnerConfig(model_dir=str(path), device="cpu"),
                                  ModelInfo.from_dir(path), 1, 1, machine_bytes=1 << 40)
    assert weights == estimate_weight_bytes(cfg, 2) + estimate_cpu_linear_bytes(
        cfg, torch.bfloat16) > 0


@pytest.mark.slow
def test_tp2_matches_tp1_over_gloo(quant_pair, tmp_path):
    """Two gloo ranks, each reading its band: FP8 blocks (qwen3, kv heads split), GPTQ act
    order (llama, one kv head replicated: both ranks read the same rows), AWQ groups."""
    paths = [quant_pair("qwen3", "fp8")[0], quant_pair("qwen3", "awq")[0],
             quant_pair("llama", "gptq")[0]]
    assert_tp2_matches_tp1(paths, tmp_path)


@pytest.mark.parametrize("fmt,kwargs,edge", [
    ("fp8", {"block": (48, 48)}, "FP8 block edges (multiples of 48)"),
    ("gptq", {"group_size": 64}, "GPTQ group edges (multiples of 64)"),
    ("awq", {"group_size": 64}, "AWQ group edges (multiples of 64)"),
])
def test_a_shard_off_a_block_or_group_edge_is_refused(quant_pair, fmt, kwargs, edge):
    """Rank 1 of 2 reads columns [64, 128) of down_proj (the first tensor read): 64 is no
    multiple of 48; o_proj's [32, 64) starts inside a group of 64."""
    quantized, _ = quant_pair("qwen3", fmt, **kwargs)
    ours(quantized, tp=TPGroup(rank=0, world_size=1))
    with pytest.raises(WeightLoadError) as err:
        ours(quantized, tp=TPGroup(rank=1, world_size=2))
    message = str(err.value)
    assert re.search(r"model\.layers\.0\.[a-z_.]+\.(weight|qweight): (rows|columns) "
                     r"\[\d+, \d+\) of \d+ do not fall on ", message), message
    assert edge + ": a tensor-parallel shard must start and end on one" in message


def rewrite(src, dst, edit) -> str:
    path = shutil.copytree(src, dst)
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


PREFIX = "model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("fmt,edit,problem", [
    ("fp8", lambda t: t.pop(f"{PREFIX}.weight_scale_inv"),
     f"checkpoint tensor '{PREFIX}.weight' is FP8 without a weight_scale_inv beside it"),
    ("fp8", lambda t: t.pop(f"{PREFIX}.weight"),
     f"checkpoint tensor '{PREFIX}.weight_scale_inv' has no {PREFIX}.weight beside it"),
    ("fp8", lambda t: t.update({f"{PREFIX}.input_scale": torch.ones(1)}),
     f"checkpoint tensor '{PREFIX}.input_scale' is not supported: input_scale (static "
     "activation or KV-cache scales"),
    ("fp8-ct", lambda t: t.update({"model.layers.0.self_attn.k_scale": torch.ones(1)}),
     "checkpoint tensor 'model.layers.0.self_attn.k_scale' is not supported"),
    ("gptq", lambda t: t.pop(f"{PREFIX}.qzeros"),
     f"{PREFIX}.qweight has no {PREFIX}.qzeros beside it"),
    ("gptq", lambda t: t.pop(f"{PREFIX}.g_idx"),
     f"{PREFIX}.qweight has no {PREFIX}.g_idx beside it (desc_act is true"),
    ("awq", lambda t: t.update({f"{PREFIX}.scales": t[f"{PREFIX}.scales"][:1]}),
     f"{PREFIX}.scales: shape [1, 64] does not fit the weight: must be [4, 64]"),
    # a scale grid one block row too many: its extra row used to be ignored silently
    ("fp8", lambda t: t.update({f"{PREFIX}.weight_scale_inv": t[f"{PREFIX}.weight_scale_inv"]
                                .repeat(2, 1)}),
     f"{PREFIX}.weight_scale_inv: shape [8, 4] does not fit the weight: must be [4, 4]"),
])
def test_tensors_that_do_not_fit_the_config_are_refused(quant_pair, tmp_path, fmt, edit,
                                                        problem):
    path = rewrite(quant_pair("qwen3", fmt)[0], tmp_path / "bad", edit)
    with pytest.raises(WeightLoadError) as err:
        ours(path)
    assert problem in str(err.value)


def test_unservable_configs_are_refused_before_and_at_load(quant_pair, tmp_path):
    quantized, _ = quant_pair("qwen3", "fp8")
    path = shutil.copytree(quantized, tmp_path / "static")
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["activation_scheme"] = "static"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelDirError, match=r"quantization_config\.activation_scheme='static'"):
        ModelInfo.from_dir(path)
    with pytest.raises(ValueError, match=r"quantization_config\.activation_scheme='static'"):
        ours(path)


def test_scales_in_another_shard_than_their_weights(quant_pair, tmp_path):
    """A sharded checkpoint (DeepSeek-V3 has 163 files) may keep a module's scale or packed
    pieces in another file than its weight: every piece is found through the index."""
    for fmt in ("fp8", "gptq"):
        quantized, twin = quant_pair("qwen3", fmt)
        path = shutil.copytree(quantized, tmp_path / fmt)
        tensors = load_file(path / "model.safetensors")
        (path / "model.safetensors").unlink()
        main = {n: t for n, t in tensors.items() if n.endswith((".weight", ".qweight"))}
        rest = {n: t for n, t in tensors.items() if n not in main}
        files = {"model-00001-of-00002.safetensors": main,
                 "model-00002-of-00002.safetensors": rest}
        for fname, part in files.items():
            save_file(part, path / fname, metadata={"format": "pt"})
        weight_map = {n: f for f, part in files.items() for n in part}
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        assert_same_weights(ours(path), ours(twin))


def test_gptqs_spare_zero_biases_are_skipped_nonzero_ones_refused(quant_pair, tmp_path):
    """GPTQ-for-LLaMa / AutoGPTQ saved an all-zero bias beside every packed module, Llama's
    too (vLLM skips them): skipped where the model has no bias; a nonzero one is refused."""
    quantized, twin = quant_pair("llama", "gptq")
    zero = rewrite(quantized, tmp_path / "zero", lambda t: t.update(
        {f"{PREFIX}.bias": torch.zeros(64, dtype=torch.float16)}))
    assert_same_weights(ours(zero), ours(twin))
    nonzero = rewrite(quantized, tmp_path / "nonzero", lambda t: t.update(
        {f"{PREFIX}.bias": torch.ones(64, dtype=torch.float16)}))
    with pytest.raises(WeightLoadError, match=r"1 checkpoint tensors match no parameter: "
                                              r"\['model\.layers\.0\.self_attn\.q_proj\.bias'\]"):
        ours(nonzero)


def test_fp8_as_transformers_itself_loads_the_fp8_directory(quant_pair):
    """transformers dequantizes an FP8 checkpoint at load on a machine without an FP8 GPU
    (FineGrainedFP8's dequantize): our weights equal its, bit for bit, and the prefill logits
    agree, from the quantized directory itself rather than a twin."""
    transformers = pytest.importorskip("transformers")
    quantized, _ = quant_pair("qwen3", "fp8")
    hf = transformers.AutoModelForCausalLM.from_pretrained(quantized, dtype=torch.float32)
    got = ours(quantized)
    layer, hf_layer = got.model.layers[0], hf.model.layers[0]
    hf_qkv = torch.cat([getattr(hf_layer.self_attn, p).weight for p in ("q_proj", "k_proj",
                                                                        "v_proj")])
    assert torch.equal(layer.self_attn.qkv_proj.weight, hf_qkv)
    assert torch.equal(layer.mlp.down_proj.weight, hf_layer.mlp.down_proj.weight)
    ids = torch.arange(30) * 7 % 500 + 3
    with torch.no_grad():
        want = hf(ids[None]).logits[0]
    torch.testing.assert_close(prefill_logits(got, ids), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("fmt,fname,settings", [
    # AutoGPTQ 0.4's quantize_config.json (no quant_method), TheBloke's older *-GPTQ repos
    ("gptq", "quantize_config.json", {"bits": 4, "group_size": 16, "damp_percent": 0.01,
                                      "desc_act": True, "static_groups": False, "sym": False,
                                      "true_sequential": True, "model_name_or_path": None,
                                      "model_file_base_name": "model"}),
    # AutoAWQ's quant_config.json, in its own key names
    ("awq", "quant_config.json", {"zero_point": True, "q_group_size": 16, "w_bit": 4,
                                  "version": "GEMM"}),
])
def test_settings_in_a_file_beside_config_json(quant_pair, tmp_path, fmt, fname, settings):
    quantized, twin = quant_pair("qwen3", fmt)
    path = shutil.copytree(quantized, tmp_path / fmt)
    cfg = json.loads((path / "config.json").read_text())
    del cfg["quantization_config"]
    (path / "config.json").write_text(json.dumps(cfg))
    (path / fname).write_text(json.dumps(settings))
    assert ModelInfo.from_dir(path).hf_config["quantization_config"]["quant_method"] == fmt
    assert_same_weights(ours(path), ours(twin))
    (path / fname).write_text(json.dumps({**settings, "desc_act": "yes"}))
    with pytest.raises(ModelDirError, match=r"quantization_config\.desc_act='yes'"):
        ModelInfo.from_dir(path)
    (path / fname).write_text("[4]")
    with pytest.raises(ModelDirError, match=rf"{fname} is invalid: must be a JSON object"):
        ModelInfo.from_dir(path)
