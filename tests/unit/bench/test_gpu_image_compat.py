"""What the lent GPU image lacks, the CUDA tests do without. Its transformers is 5.17
(/work/.library/device/KINDS.md's pip list), whose finegrained_fp8 has no
_dequantize_fp8_weight: tests/gpu/test_quantized_cuda.py built every quantized pair through it
(an ImportError in each case). tests/support/quant_models.dequant_fp8_blocks falls back to the
same product, equal to transformers' bit for bit where both run."""
from __future__ import annotations

import pytest
import torch

from tests.support.quant_models import dequant_fp8_blocks, quantize_fp8_blocks

finegrained = pytest.importorskip("transformers.integrations.finegrained_fp8")


@pytest.mark.parametrize("shape,block", [((48, 80), (16, 16)), ((40, 72), (16, 32)),
                                         ((24, 24), (128, 128))])
def test_fp8_reference_without_transformers_function_equals_it(monkeypatch, shape, block):
    """Partial last block rows and columns included; with the function gone (as on 5.17) the
    fallback gives transformers' result exactly."""
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    weight, scale = quantize_fp8_blocks(w, block)
    want = finegrained._dequantize_fp8_weight(weight, scale, list(block), torch.float32)
    assert torch.equal(dequant_fp8_blocks(weight, scale, block), want)
    monkeypatch.delattr(finegrained, "_dequantize_fp8_weight")
    with pytest.raises(ImportError):
        from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight  # noqa
    got = dequant_fp8_blocks(weight, scale, block)
    assert got.dtype == torch.float32 and torch.equal(got, want)


def test_quantized_pairs_build_without_the_transformers_function(monkeypatch, tiny_models,
                                                                  tmp_path):
    """make_quantized_pair for each format test_quantized_cuda.py serves, with the function
    absent: it used to raise ImportError for every format (the import sat at quantize's top)."""
    from tests.support.quant_models import make_quantized_pair

    monkeypatch.delattr(finegrained, "_dequantize_fp8_weight")
    for fmt in ("fp8", "gptq", "awq"):
        quantized, twin = make_quantized_pair(tiny_models("qwen3"), tmp_path / fmt, fmt)
        assert (quantized / "config.json").is_file() and (twin / "config.json").is_file()
