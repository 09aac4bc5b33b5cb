"""config.json's quantization_config: which quantized checkpoints can be served, found when the
model directory is first read (ModelInfo.from_dir) so that `deltaserve serve` and the scheduler
refuse the others before any worker starts.

Served: MXFP4 experts of GPT-OSS (quant_method "mxfp4", as openai/gpt-oss-20b/-120b ship them),
dequantized at load to the model's dtype (worker_service/layers/mxfp4.py). Its config may list
modules_to_not_convert (the modules stored unquantized; the loader tells them apart by their
tensor names) and dequantize (transformers' load-time switch: we always dequantize).

Also served: the weight-only formats of weight_quant.py (fp8, compressed-tensors FP8, gptq,
awq) on every architecture but GPT-OSS (whose checkpoints are MXFP4). Any other method, an
mxfp4 config on another architecture, or any other key is refused by name rather than loaded as
if unquantized.
"""
from __future__ import annotations

from engine_common.model_files.weight_quant import (WEIGHT_QUANT_METHODS, QuantConfigError,
                                                    weight_quant)

MXFP4_ARCHITECTURES = ("GptOssForCausalLM",)
# transformers' Mxfp4Config fields; `dequantize` (true: dequantize at load) asks for what we do
# either way, so both of its values are served
MXFP4_KEYS = ("quant_method", "modules_to_not_convert", "dequantize")


def quantization_problem(config: dict) -> str | None:
    """Why config.json's quantization_config cannot be served, or None (also without one)."""
    quant = config.get("quantization_config")
    if quant is None:
        return None
    if not isinstance(quant, dict):
        return f"quantization_config={quant!r} is invalid: must be an object"
    method = quant.get("quant_method")
    arch = (config.get("architectures") or [None])[0]
    if method in WEIGHT_QUANT_METHODS and arch not in MXFP4_ARCHITECTURES:
        try:
            weight_quant(config)
        except QuantConfigError as e:
            return str(e)
        return None
    if arch not in MXFP4_ARCHITECTURES:
        served = ", ".join(repr(m) for m in WEIGHT_QUANT_METHODS)
        return (f"quantization_config.quant_method={method!r} is not supported for {arch}: "
                f"only {served} ('mxfp4' on {', '.join(MXFP4_ARCHITECTURES)} only)")
    if method != "mxfp4":
        return (f"quantization_config.quant_method={method!r} is not supported for {arch}: "
                f"only 'mxfp4' on {', '.join(MXFP4_ARCHITECTURES)}")
    for key in sorted(set(quant) - set(MXFP4_KEYS)):
        return (f"quantization_config.{key}={quant[key]!r} is not supported: an mxfp4 config "
                f"may only hold {', '.join(MXFP4_KEYS)}")
    if not isinstance(quant.get("dequantize", False), bool):
        return (f"quantization_config.dequantize={quant['dequantize']!r} is invalid: must be "
                "true or false")
    skipped = quant.get("modules_to_not_convert")
    if skipped is not None and not (isinstance(skipped, list)
                                    and all(isinstance(m, str) for m in skipped)):
        return (f"quantization_config.modules_to_not_convert={skipped!r} is invalid: must be a "
                "list of module names")
    return None


def is_mxfp4(config: dict) -> bool:
    """Whether the checkpoint's experts are MXFP4 (after quantization_problem passed)."""
    quant = config.get("quantization_config")
    return isinstance(quant, dict) and quant.get("quant_method") == "mxfp4"
