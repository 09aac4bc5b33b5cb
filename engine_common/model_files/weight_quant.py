"""Weight-only quantized checkpoints of Hugging Face's common formats, read torch-free from
config.json's quantization_config: what is served (a WeightQuant) and why the rest is refused.

Served, each dequantized at load to the model's dtype (worker_service/models/quant_checkpoint.py):

    quant_method "fp8"                 Qwen3-*-FP8, DeepSeek-V3: fmt e4m3, `weight_scale_inv`
                                       float32 per [bn, bk] block (weight_block_size), or one per
                                       tensor without a block size (`weight_scale_inv`, or
                                       AutoFP8's `weight_scale`); activation_scheme dynamic;
                                       scale_fmt ue8m0 (power-of-two scales) or none
    quant_method "compressed-tensors"  RedHatAI / neuralmagic "*-FP8-dynamic": format
                                       float-quantized, weights float 8-bit symmetric, strategy
                                       channel ([R, 1] `weight_scale`) or tensor; input
                                       activations dynamic or none; `ignore` modules plain
    quant_method "gptq"                bits 4 or 8, group_size (-1: one group), desc_act (g_idx),
                                       sym; checkpoint_format gptq (zeros stored minus one) or
                                       gptq_v2
    quant_method "awq"                 version gemm, bits 4, zero_point true

Activations are never quantized: every served format is run as weight-only (W8A16 / W4A16),
where vLLM quantizes activations too for FP8 W8A8. Static activation scales, KV-cache scales,
other methods and bit widths, and keys that change the layout are refused by name.
"""
from __future__ import annotations

from dataclasses import dataclass

WEIGHT_QUANT_METHODS = ("fp8", "compressed-tensors", "gptq", "awq")
GPTQ_BITS = (4, 8)
GPTQ_FORMATS = ("gptq", "gptq_v2")
# keys each method may carry that change nothing at load: calibration metadata and switches we
# honour either way (transformers' `dequantize`)
_QUIET_KEYS = {
    "fp8": {"quant_method", "fmt", "activation_scheme", "weight_block_size",
            "modules_to_not_convert", "modules_to_convert", "dequantize", "ignored_layers",
            "scale_fmt", "expert_dtype"},
    "gptq": {"quant_method", "bits", "group_size", "desc_act", "sym", "checkpoint_format",
             "damp_percent", "damp_auto_increment", "static_groups", "true_sequential",
             "model_name_or_path", "model_file_base_name", "is_marlin_format", "lm_head",
             "pack_dtype", "meta", "quantizer", "mse", "tokenizer", "dataset", "use_exllama",
             "exllama_config", "use_cuda_fp16", "batch_size", "pad_token_id", "max_input_length",
             "cache_block_outputs", "modules_in_block_to_quantize",
             "module_name_preceding_first_block",
             "block_name_to_quantize", "backend", "hyb_act", "v2", "v2_alpha", "act_group_aware",
             "format", "dynamic", "adapter", "model_seqlen",
             # GPTQModel's settings of the quantization run (where it ran, how it fell back):
             # the packed tensors read the same whatever they say
             "offload_to_disk", "offload_to_disk_path", "pack_impl", "device",
             "v2_memory_device", "compute_device_filter", "fail_safe", "failsafe", "fallback"},
    # transformers 5's AwqConfig is a GPTQConfig: it saves GPTQ's calibration keys too
    "awq": {"quant_method", "bits", "group_size", "version", "format", "zero_point",
            "modules_to_not_convert", "backend", "do_fuse", "fuse_max_seq_len",
            "exllama_config", "modules_to_fuse", "act_group_aware", "batch_size",
            "block_name_to_quantize", "cache_block_outputs", "damp_percent", "dataset",
            "desc_act", "max_input_length", "meta", "model_seqlen",
            "module_name_preceding_first_block", "modules_in_block_to_quantize", "pad_token_id",
            "sym", "tokenizer", "true_sequential"},
    "compressed-tensors": {"quant_method", "format", "config_groups", "ignore",
                           "kv_cache_scheme", "quantization_status", "global_compression_ratio",
                           "sparsity_config", "version", "transform_config",
                           "provider", "producer"},
}
# static input scales were calibrated for quantized activations; ours stay unquantized, so
# serving them would silently ignore the scales
_STATIC_WHY = "(activations are served unquantized: static input scales would be ignored)"


@dataclass(frozen=True)
class WeightQuant:
    """How a checkpoint's linear weights are stored (a config quantization_problem passed).

    fp8: `block` [rows, cols] per scale, or None (one scale per row or per tensor, told by the
    scale's shape). gptq / awq: `bits`, `group_size` (-1: every column one group), `zero_offset`
    (1: GPTQ's v1 format stores each zero point minus one)."""

    method: str
    bits: int = 8
    block: tuple[int, int] | None = None
    group_size: int = -1
    desc_act: bool = False
    zero_offset: int = 0


class QuantConfigError(ValueError):
    """A quantization_config that cannot be served; the message names the field."""


def weight_quant(config: dict) -> WeightQuant | None:
    """The WeightQuant of config.json's quantization_config, None without one (or for mxfp4);
    QuantConfigError naming the field when it cannot be served."""
    quant = config.get("quantization_config")
    if not isinstance(quant, dict) or quant.get("quant_method") not in WEIGHT_QUANT_METHODS:
        return None
    method = quant["quant_method"]
    _check_unknown_keys(method, quant)
    parse = {"fp8": _fp8, "compressed-tensors": _compressed_tensors, "gptq": _gptq,
             "awq": _awq}[method]
    return parse(quant)


def _check_unknown_keys(method: str, quant: dict) -> None:
    """Refuse a key the method's reader does not know, naming it. GPTQ: GPTQModel saves every
    field of its QuantizeConfig, most of them off, and adds fields each release; an unknown
    one at its off value (null, false, empty) asks for nothing that changes the packing, so
    only one that is set is refused."""
    unknown = sorted(set(quant) - _QUIET_KEYS[method])
    if method == "gptq":
        unknown = [key for key in unknown if not _is_off(quant[key])]
        if unknown:
            raise _field(unknown[0], quant[unknown[0]], "an unknown 'gptq' key may only be "
                         "null, false or empty (set, it may change the weights: GPTQModel's "
                         "rotation, GPTAQ, ...)")
    elif unknown:
        raise QuantConfigError(
            f"quantization_config.{unknown[0]}={quant[unknown[0]]!r} is not supported: a "
            f"{method!r} config may only hold {', '.join(sorted(_QUIET_KEYS[method]))}")


def _is_off(value) -> bool:
    """null, false or an empty string / list / object: a switch left off."""
    return value is None or value is False or (isinstance(value, (str, list, dict))
                                               and not value)


def _field(path: str, value, allowed: str) -> QuantConfigError:
    return QuantConfigError(f"quantization_config.{path}={value!r} is not supported: {allowed}")


def _fp8(quant: dict) -> WeightQuant:
    if quant.get("fmt", "e4m3") != "e4m3":
        raise _field("fmt", quant["fmt"], "only 'e4m3'")
    if quant.get("scale_fmt") not in (None, "float", "ue8m0"):
        raise _field("scale_fmt", quant["scale_fmt"], "only 'float', 'ue8m0' (DeepSeek-V3.1's "
                     "power-of-two scales) or null")
    if quant.get("expert_dtype") not in (None, "fp8"):
        raise _field("expert_dtype", quant["expert_dtype"], "only 'fp8' (FP4-packed experts "
                     "are not served)")
    _module_list("modules_to_convert", quant.get("modules_to_convert"))
    scheme = quant.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise _field("activation_scheme", scheme, f"only 'dynamic' {_STATIC_WHY}")
    _module_list("modules_to_not_convert", quant.get("modules_to_not_convert"))
    _module_list("ignored_layers", quant.get("ignored_layers"))
    block = quant.get("weight_block_size")
    if block is None:
        return WeightQuant("fp8")
    if not (isinstance(block, (list, tuple)) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise _field("weight_block_size", block, "must be [rows, cols], two positive integers")
    return WeightQuant("fp8", block=(block[0], block[1]))


def _module_list(path: str, value) -> None:
    if value is not None and not (isinstance(value, list)
                                  and all(isinstance(m, str) for m in value)):
        raise _field(path, value, "must be a list of module names")


def _int_field(quant: dict, key: str, allowed: tuple, default=None) -> int:
    value = quant.get(key, default)
    if value not in allowed or isinstance(value, bool):
        raise _field(key, value, f"must be one of {list(allowed)}")
    return value


def _group_size(quant: dict) -> int:
    size = quant.get("group_size", -1)
    if not isinstance(size, int) or isinstance(size, bool) or not (size == -1 or size > 0):
        raise _field("group_size", size, "must be a positive integer or -1 (one group)")
    return size


def _gptq(quant: dict) -> WeightQuant:
    bits = _int_field(quant, "bits", GPTQ_BITS)
    for key in ("desc_act", "sym"):
        if not isinstance(quant.get(key, False), bool):
            raise _field(key, quant[key], "must be true or false")
    if quant.get("dynamic"):
        raise _field("dynamic", quant["dynamic"], "per-module overrides are not served: "
                     "only null or {}")
    # transformers 5 saves `format`; the legacy `checkpoint_format` wins where both are
    key = "checkpoint_format" if quant.get("checkpoint_format") else "format"
    fmt = str(quant.get(key) or "gptq").lower()
    if fmt not in GPTQ_FORMATS:
        raise _field(key, quant[key], f"must be one of {list(GPTQ_FORMATS)}")
    if quant.get("pack_dtype", "int32") not in ("int32", "torch.int32"):
        # GPTQModel packs into int64 / int16 / int8 words on request: other word widths
        raise _field("pack_dtype", quant["pack_dtype"], "only 'int32' (codes packed into "
                     "32-bit words)")
    if quant.get("is_marlin_format"):
        raise _field("is_marlin_format", True, "only the gptq packing (false)")
    return WeightQuant("gptq", bits=bits, group_size=_group_size(quant),
                       desc_act=bool(quant.get("desc_act", False)),
                       zero_offset=1 if fmt == "gptq" else 0)


def _awq(quant: dict) -> WeightQuant:
    bits = _int_field(quant, "bits", (4,))
    # the legacy `version` wins over transformers 5's `format`, as AwqConfig reads them
    key = "version" if quant.get("version") else "format"
    if str(quant.get(key) or "gemm").lower() != "gemm":
        raise _field(key, quant[key], "only 'gemm' (GEMV and llm-awq pack differently)")
    if quant.get("desc_act"):
        raise _field("desc_act", quant["desc_act"], "only false (AWQ has no act order)")
    if quant.get("zero_point", True) is not True:
        raise _field("zero_point", quant["zero_point"], "only true")
    _module_list("modules_to_not_convert", quant.get("modules_to_not_convert"))
    size = _group_size(quant)
    if size == -1:
        raise _field("group_size", size, "must be a positive integer")
    return WeightQuant("awq", bits=bits, group_size=size)


def _compressed_tensors(quant: dict) -> WeightQuant:
    if quant.get("format") != "float-quantized":
        raise _field("format", quant.get("format"), "only 'float-quantized' (FP8 weights)")
    if quant.get("kv_cache_scheme") is not None:
        raise _field("kv_cache_scheme", quant["kv_cache_scheme"], "only null (KV-cache scales "
                     "are not served: the cache stays in the model dtype)")
    if quant.get("sparsity_config"):
        raise _field("sparsity_config", quant["sparsity_config"], "only null")
    _module_list("ignore", quant.get("ignore"))
    groups = quant.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise _field("config_groups", groups, "must name at least one group")
    for name, group in groups.items():
        _ct_group(f"config_groups.{name}", group)
    return WeightQuant("compressed-tensors")


def _ct_group(path: str, group) -> None:
    if not isinstance(group, dict):
        raise _field(path, group, "must be an object")
    if group.get("targets") != ["Linear"]:
        raise _field(f"{path}.targets", group.get("targets"), "only ['Linear']")
    weights = group.get("weights") or {}
    want = {"type": "float", "num_bits": 8, "symmetric": True}
    for key, value in want.items():
        if weights.get(key) != value:
            raise _field(f"{path}.weights.{key}", weights.get(key), f"only {value!r}")
    if weights.get("strategy") not in ("channel", "tensor"):
        raise _field(f"{path}.weights.strategy", weights.get("strategy"),
                     "only 'channel' or 'tensor'")
    if weights.get("dynamic"):
        raise _field(f"{path}.weights.dynamic", weights["dynamic"], "only false")
    acts = group.get("input_activations")
    if acts is not None and (not isinstance(acts, dict) or acts.get("dynamic") is not True):
        value = acts.get("dynamic") if isinstance(acts, dict) else acts
        raise _field(f"{path}.input_activations.dynamic", value, f"only true {_STATIC_WHY}")
    if group.get("output_activations") is not None:
        raise _field(f"{path}.output_activations", group["output_activations"], "only null")
