"""One region [r0, r1) x [c0, c1) of a quantized module's dequantized weight [R, C], read from
only the packed words, scale blocks and groups that cover it (quant_checkpoint.py's slices).

A tensor-parallel rank reads a band of output rows (column-parallel) or input columns
(row-parallel). The band must start and end (unless at the weight's end) on:

    fp8 block-wise   multiples of the block: bn rows, bk columns (weight_block_size)
    gptq             columns: group_size (and the packed word, 32 / bits); rows: 32 / bits
    awq              columns: group_size; rows: 8 (the packed word)

else it is refused naming the tensor, the band and the sizes, as vLLM refuses such shards
(a partial block or word would take another rank's scale or codes).
"""
from __future__ import annotations

import torch

from engine_common.model_files.weight_quant import WeightQuant
from worker_service.layers.quant_fp8 import check_finite, dequantize_fp8
from worker_service.layers.quant_gptq import (awq_unpack, dequantize_grouped, gptq_codes,
                                              gptq_zeros)
from worker_service.layers.quant_linear import PackedBand
from worker_service.models.quant_pieces import check_fp8_scale, check_packed

Span = tuple[int, int]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_edges(name: str, what: str, span: Span, total: int, step: int, unit: str) -> None:
    """ValueError unless span starts on a multiple of step and ends on one or at total."""
    lo, hi = span
    if lo % step or (hi % step and hi != total):
        raise ValueError(f"{name}: {what} [{lo}, {hi}) of {total} do not fall on {unit} edges "
                         f"(multiples of {step}): a tensor-parallel shard must start and end on "
                         f"one (use a smaller tp_size)")


def packed_shape(files, prefix: str, quant: WeightQuant) -> tuple[int, int]:
    """The dequantized [R, C] of a quantized module, its pieces' shapes and dtypes checked
    (quant_pieces.py)."""
    method = quant.method
    if method in ("fp8", "compressed-tensors"):
        shape = files.slice(f"{prefix}.weight").get_shape()
        if len(shape) != 2:
            raise ValueError(f"{prefix}.weight: FP8 weight shape {shape} is not served: only "
                             "[out, in] linear weights")
        check_fp8_scale(files, prefix, quant, int(shape[0]), int(shape[1]))
        return int(shape[0]), int(shape[1])
    for piece in ("qzeros", "scales") + (("g_idx",) if quant.desc_act else ()):
        if f"{prefix}.{piece}" not in files.index:
            why = " (desc_act is true: act order needs each column's group)" \
                if piece == "g_idx" else ""
            raise ValueError(f"{prefix}.qweight has no {prefix}.{piece} beside it{why}")
    packed = files.slice(f"{prefix}.qweight").get_shape()
    if len(packed) != 2:
        raise ValueError(f"{prefix}.qweight: shape {packed} is not served: only 2-D packed "
                         "linear weights")
    per_word = 32 // quant.bits
    if method == "gptq":
        rows, cols = int(packed[1]), int(packed[0]) * per_word
    else:
        rows, cols = int(packed[1]) * 8, int(packed[0])
    check_packed(files, prefix, quant, rows, cols)
    return rows, cols


def read_fp8(files, prefix: str, quant: WeightQuant, shape: tuple[int, int], rows: Span,
             cols: Span) -> torch.Tensor:
    """fp8 / compressed-tensors: the region's weight and its blocks' (or rows') scales."""
    name = f"{prefix}.weight"
    scale_name = f"{prefix}.weight_scale_inv"
    if scale_name not in files.index:             # compressed-tensors', AutoFP8's
        scale_name = f"{prefix}.weight_scale"
    weight = files.slice(name)[rows[0]:rows[1], cols[0]:cols[1]]
    scale = files.slice(scale_name)
    block = quant.block
    if block is None:
        scale_shape = scale.get_shape()
        per_row = len(scale_shape) >= 1 and scale_shape[0] == shape[0] and shape[0] > 1
        return dequantize_fp8(weight, scale[rows[0]:rows[1]] if per_row
                              else files.tensor(scale_name), None, name)
    check_edges(name, "rows", rows, shape[0], block[0], "FP8 block")
    check_edges(name, "columns", cols, shape[1], block[1], "FP8 block")
    region = scale[rows[0] // block[0]:_cdiv(rows[1], block[0]),
                   cols[0] // block[1]:_cdiv(cols[1], block[1])]
    return dequantize_fp8(weight, region, block, name)


def _groups(files, prefix: str, quant: WeightQuant, cols: Span, total_cols: int) -> torch.Tensor:
    """Each column's group in the band: g_idx (act order) when stored, else c // group_size."""
    g_idx = f"{prefix}.g_idx"
    if quant.method == "gptq" and g_idx in files.index:
        groups = files.slice(g_idx)[cols[0]:cols[1]]
        if groups.shape[0] != cols[1] - cols[0]:
            raise ValueError(f"{g_idx}: {files.slice(g_idx).get_shape()} entries, expected "
                             f"{total_cols} (one per input column)")
        num_groups = files.slice(f"{prefix}.scales").get_shape()[0]
        if groups.numel() and (int(groups.min()) < 0 or int(groups.max()) >= num_groups):
            raise ValueError(f"{g_idx}: group {int(groups.min())} .. {int(groups.max())} out of "
                             f"range: the scales hold groups [0, {num_groups})")
        return groups.long()
    size = quant.group_size if quant.group_size > 0 else total_cols
    return torch.arange(cols[0], cols[1]) // size


def read_gptq(files, prefix: str, quant: WeightQuant, shape: tuple[int, int], rows: Span,
              cols: Span) -> torch.Tensor:
    """gptq: the band's packed input words, its rows' zeros and scales of the groups it uses."""
    name, per_word = f"{prefix}.qweight", 32 // quant.bits
    check_edges(name, "rows", rows, shape[0], per_word, "packed zero-point word")
    check_edges(name, "columns", cols, shape[1], per_word, "packed word")
    if quant.group_size > 0:
        check_edges(name, "columns", cols, shape[1], quant.group_size, "GPTQ group")
    groups = _groups(files, prefix, quant, cols, shape[1])
    g0, g1 = (int(groups.min()), int(groups.max()) + 1) if groups.numel() else (0, 0)
    q = gptq_codes(files.slice(name)[cols[0] // per_word:_cdiv(cols[1], per_word),
                                     rows[0]:rows[1]], quant.bits)[:cols[1] - cols[0]]
    zeros = files.slice(f"{prefix}.qzeros")[g0:g1, rows[0] // per_word:_cdiv(rows[1], per_word)]
    z = gptq_zeros(zeros, quant.bits, quant.zero_offset)[:, :rows[1] - rows[0]]
    scales = files.slice(f"{prefix}.scales")[g0:g1, rows[0]:rows[1]]
    return dequantize_grouped(q, z, scales, groups - g0, name)


def read_awq(files, prefix: str, quant: WeightQuant, shape: tuple[int, int], rows: Span,
             cols: Span) -> torch.Tensor:
    """awq: the band's input rows of the packed output words covering its rows."""
    q, z, scales, g0 = _awq_pieces(files, prefix, quant, shape, rows, cols)
    groups = torch.arange(cols[0], cols[1]) // quant.group_size - g0
    return dequantize_grouped(q, z, scales, groups, f"{prefix}.qweight")


def _awq_pieces(files, prefix: str, quant: WeightQuant, shape: tuple[int, int], rows: Span,
                cols: Span) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(codes, zeros, scales, first group) of an AWQ band, AWQ_ORDER undone, edges checked."""
    name, per_word = f"{prefix}.qweight", 8
    check_edges(name, "rows", rows, shape[0], per_word, "packed AWQ word")
    check_edges(name, "columns", cols, shape[1], quant.group_size, "AWQ group")
    words = slice(rows[0] // per_word, _cdiv(rows[1], per_word))
    g0, g1 = cols[0] // quant.group_size, _cdiv(cols[1], quant.group_size)
    q = awq_unpack(files.slice(name)[cols[0]:cols[1], words])[:, :rows[1] - rows[0]]
    z = awq_unpack(files.slice(f"{prefix}.qzeros")[g0:g1, words])[:, :rows[1] - rows[0]]
    return q, z, files.slice(f"{prefix}.scales")[g0:g1, rows[0]:rows[1]], g0


REGION_READERS = {"fp8": read_fp8, "compressed-tensors": read_fp8, "gptq": read_gptq,
                  "awq": read_awq}


def _span(span: Span | None, total: int) -> Span:
    return (0, total) if span is None else span


def packed_gptq(files, prefix: str, quant: WeightQuant, shape: tuple[int, int],
                rows: Span | None, cols: Span | None) -> PackedBand | None:
    """gptq: the band's codes, zeros and scales as stored (quant_linear.py's kernels), or None
    for act order (g_idx not c // group_size): the kernels take groups of consecutive columns,
    and the pieces of one fused layer (q, k, v) each permute their inputs their own way."""
    rows, cols = _span(rows, shape[0]), _span(cols, shape[1])
    name, per_word = f"{prefix}.qweight", 32 // quant.bits
    check_edges(name, "rows", rows, shape[0], per_word, "packed zero-point word")
    check_edges(name, "columns", cols, shape[1], per_word, "packed word")
    size = quant.group_size if quant.group_size > 0 else shape[1]
    if quant.group_size > 0:
        check_edges(name, "columns", cols, shape[1], quant.group_size, "GPTQ group")
    groups = _groups(files, prefix, quant, cols, shape[1])
    if not torch.equal(groups, torch.arange(cols[0], cols[1]) // size):
        return None
    g0, g1 = cols[0] // size, _cdiv(cols[1], size)
    q = gptq_codes(files.slice(name)[cols[0] // per_word:_cdiv(cols[1], per_word),
                                     rows[0]:rows[1]], quant.bits)[:cols[1] - cols[0]]
    zeros = files.slice(f"{prefix}.qzeros")[g0:g1, rows[0] // per_word:_cdiv(rows[1], per_word)]
    z = gptq_zeros(zeros, quant.bits, quant.zero_offset)[:, :rows[1] - rows[0]]
    scales = files.slice(f"{prefix}.scales")[g0:g1, rows[0]:rows[1]]
    return _band(q, z, scales, min(size, cols[1] - cols[0]), quant.bits, name)


def packed_awq(files, prefix: str, quant: WeightQuant, shape: tuple[int, int],
               rows: Span | None, cols: Span | None) -> PackedBand:
    """awq: the band's codes, zeros and scales in row order (AWQ_ORDER undone)."""
    rows, cols = _span(rows, shape[0]), _span(cols, shape[1])
    q, z, scales, _ = _awq_pieces(files, prefix, quant, shape, rows, cols)
    return _band(q, z, scales, quant.group_size, 4, f"{prefix}.qweight")


def _band(q: torch.Tensor, z: torch.Tensor, scales: torch.Tensor, group_size: int, bits: int,
          name: str) -> PackedBand:
    """q [C, R] -> the band [R, C] uint8; scales checked finite as the dequantized path does."""
    check_finite(scales.to(torch.float32), f"{name}: non-finite scales")
    return PackedBand(q.t().to(torch.uint8).contiguous(), z.to(torch.int32),
                      scales.contiguous(), group_size, bits)


PACKED_READERS = {"gptq": packed_gptq, "awq": packed_awq}
