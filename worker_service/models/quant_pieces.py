"""The shapes and dtypes a quantized module's pieces must have, checked from the safetensors
headers before any weight is read (quant_checkpoint.py's plan), as vLLM's loaders refuse a
tensor that does not fit its parameter. Without this a scale grid, a zero-point or scale table
or a g_idx larger than the weight needs would be read only where a rank's band reaches, the
rest silently ignored.

    fp8 blocks [bn, bk]   weight_scale_inv [ceil(R / bn), ceil(C / bk)]
    fp8 / ct, no block    weight_scale(_inv) [] / [1] (per tensor) or [R] / [R, 1] (per row)
    gptq (p = 32 / bits)  qweight I32 [C / p, R], qzeros I32 [G, ceil(R / p)], scales [G, R],
                          g_idx (integer) [C]; G = ceil(C / group_size), 1 for group_size -1
    awq                   qweight I32 [C, R / 8], qzeros I32 [G, R / 8], scales [G, R],
                          G = ceil(C / group_size)

Scales must be floating (F32, BF16, F16, or F8_E8M0's power-of-two scales for fp8).
"""
from __future__ import annotations

from engine_common.model_files.weight_quant import WeightQuant

SCALE_DTYPES = ("F32", "BF16", "F16", "F8_E8M0")
INT_DTYPES = ("I32", "I64", "I16", "I8", "U8")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _piece(files, name: str) -> tuple[list[int], str]:
    piece = files.slice(name)
    return [int(n) for n in piece.get_shape()], piece.get_dtype()


def _expect(name: str, shape: list[int], dtype: str, shapes: list[list[int]],
            dtypes: tuple[str, ...], why: str) -> None:
    if shape not in shapes:
        want = " or ".join(str(s) for s in shapes)
        raise ValueError(f"{name}: shape {shape} does not fit the weight: must be {want} "
                         f"({why})")
    if dtype not in dtypes:
        raise ValueError(f"{name}: dtype {dtype} is not supported: only {', '.join(dtypes)}")


def check_fp8_scale(files, prefix: str, quant: WeightQuant, rows: int, cols: int) -> None:
    """The FP8 module's scale: one per block, or per tensor / per row without a block."""
    name = f"{prefix}.weight_scale_inv"
    if name not in files.index:
        name = f"{prefix}.weight_scale"
    shape, dtype = _piece(files, name)
    if quant.block is not None:
        bn, bk = quant.block
        shapes, why = [[_cdiv(rows, bn), _cdiv(cols, bk)]], \
            f"one scale per [{bn}, {bk}] block of [{rows}, {cols}]"
    else:
        shapes, why = [[], [1], [rows], [rows, 1]], f"per tensor or per row of {rows}"
    _expect(name, shape, dtype, shapes, SCALE_DTYPES, why)


def check_packed(files, prefix: str, quant: WeightQuant, rows: int, cols: int) -> None:
    """GPTQ's / AWQ's qweight, qzeros, scales (and g_idx) against the dequantized [R, C]."""
    gptq = quant.method == "gptq"
    per_word = 32 // quant.bits if gptq else 8
    size = quant.group_size if quant.group_size > 0 else cols
    groups = _cdiv(cols, size)
    what = f"[{rows}, {cols}] in groups of {size} input columns, {per_word} codes a word"
    qweight = [cols // per_word, rows] if gptq else [cols, rows // per_word]
    _expect(f"{prefix}.qweight", *_piece(files, f"{prefix}.qweight"), [qweight], ("I32",), what)
    _expect(f"{prefix}.qzeros", *_piece(files, f"{prefix}.qzeros"),
            [[groups, _cdiv(rows, per_word)]], ("I32",), what)
    _expect(f"{prefix}.scales", *_piece(files, f"{prefix}.scales"), [[groups, rows]],
            SCALE_DTYPES[:3], what)
    if gptq and f"{prefix}.g_idx" in files.index:
        _expect(f"{prefix}.g_idx", *_piece(files, f"{prefix}.g_idx"), [[cols]], INT_DTYPES,
                "one group index per input column")
