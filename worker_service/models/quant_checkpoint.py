"""A weight-quantized safetensors checkpoint (engine_common/model_files/weight_quant.py) read as
if it were plain: each quantized module's packed tensors become one `<module>.weight` whose lazy
slice dequantizes, to float32, only the region a rank asks for (the parameter's copy then rounds
it to the model dtype). The model and its weight loaders see an ordinary checkpoint.

    fp8                 <m>.weight F8_E4M3 + <m>.weight_scale_inv  -> <m>.weight
    compressed-tensors  <m>.weight F8_E4M3 + <m>.weight_scale      -> <m>.weight
    gptq                <m>.qweight + qzeros + scales (+ g_idx)    -> <m>.weight
    awq                 <m>.qweight + qzeros + scales              -> <m>.weight

Modules left unquantized (the embeddings, lm_head, a config's ignore list) are read as they are;
the packed names tell the two apart. Everything is checked from the headers before a weight is
read: an FP8 weight without its scale, a scale or packed piece without its weight, and tensors
of what is not served (static input scales, KV-cache scales, asymmetric zero points) are refused
by name. A rank's region must start and end on an FP8 block, a group and a packed word, or be
refused naming the sizes (quant_regions.py).
"""
from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Any, Iterator

from safetensors import safe_open

from engine_common.model_files.weight_quant import WeightQuant
from worker_service.models.quant_regions import PACKED_READERS, REGION_READERS, packed_shape

# the tensor each method's quantized module is named by, and the pieces read with it
MAIN_PIECE = {"fp8": "weight", "compressed-tensors": "weight", "gptq": "qweight",
              "awq": "qweight"}
# fp8: transformers' / DeepSeek's weight_scale_inv, or AutoFP8's weight_scale (per tensor)
SCALE_PIECES = {"fp8": ("weight_scale_inv", "weight_scale"),
                "compressed-tensors": ("weight_scale",), "gptq": ("qzeros", "scales"),
                "awq": ("qzeros", "scales")}
OPTIONAL_PIECES = {"gptq": ("g_idx",)}
# tensors of what is not served: static activation scales, KV-cache scales, zero points of
# asymmetric FP8
REFUSED_PIECES = ("input_scale", "activation_scale", "output_scale", "k_scale", "v_scale",
                  "kv_scale", "weight_zero_point")
FP8_DTYPES = ("F8_E4M3", "F8_E5M2")


class QuantCheckpointError(ValueError):
    """The checkpoint's tensors do not fit its quantization_config."""


class CheckpointFiles:
    """Every safetensors file of an index, opened on first use and closed together."""

    def __init__(self, index: dict[str, Path]) -> None:
        self.index = index
        self._stack = ExitStack()
        self._open: dict[Path, Any] = {}

    def slice(self, name: str):
        """The lazy safetensors slice of tensor `name`."""
        return self._file(name).get_slice(name)

    def tensor(self, name: str):
        """The whole tensor `name` (a 0-d scale cannot be sliced)."""
        return self._file(name).get_tensor(name)

    def _file(self, name: str):
        path = self.index[name]
        if path not in self._open:
            self._open[path] = self._stack.enter_context(
                safe_open(path, framework="pt", device="cpu"))
        return self._open[path]

    def close(self) -> None:
        self._stack.close()


class DequantSlice:
    """A quantized weight as a lazy slice of its dequantized float32 [R, C] value: supports
    get_shape() and [a:b] / [:, a:b] / [a:b, c:d], as the weight loaders read slices.
    With native CPU weights (GPTQ / AWQ), also `read_packed(rows, cols)`: the band as stored
    (layers/quant_linear.PackedBand, None for act order), which the linear layers keep packed;
    every other reader (MoE experts, fused splits, embeddings) still dequantizes."""

    def __init__(self, name: str, shape: tuple[int, int], read_region,
                 read_packed=None) -> None:
        self.name = name
        self.shape = shape
        self._read = read_region
        if read_packed is not None:
            self.read_packed = read_packed

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def get_dtype(self) -> str:
        return "F32"

    def __getitem__(self, key):
        keys = key if isinstance(key, tuple) else (key,)
        if len(keys) > 2 or not all(isinstance(k, slice) for k in keys):
            raise TypeError(f"{self.name}: a dequantized weight is read by row and column "
                            f"slices, got {key!r}")
        keys = keys + (slice(None),) * (2 - len(keys))
        (r0, r1, rs), (c0, c1, cs) = (k.indices(n) for k, n in zip(keys, self.shape))
        if rs != 1 or cs != 1:
            raise TypeError(f"{self.name}: slices with a step are not supported, got {key!r}")
        return self._read(r0, max(r0, r1), c0, max(c0, c1))


class SpareZeroBias:
    """An all-zero bias GPTQ-for-LLaMa / AutoGPTQ saved beside packed modules whether the model
    has a bias or not: loaded where the model has one, skipped (`spare`) where it has none, as
    vLLM skips them. A nonzero bias without a parameter is still refused."""

    spare = True

    def __init__(self, tensor) -> None:
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, key):
        return self.tensor[key]


def quantized_checkpoint(index: dict[str, Path], quant: WeightQuant, native: bool = False
                         ) -> tuple[set[str], Iterator[tuple[str, Any]]]:
    """(tensor names as the model sees them, (name, lazy slice) pairs), the quantized modules'
    pieces joined into dequantizing `<module>.weight` slices; QuantCheckpointError (read from
    the headers alone) when the tensors do not fit the config. native: GPTQ / AWQ slices also
    offer their packed bands (read_packed) to the CPU's quantized linear layers."""
    files = CheckpointFiles(index)
    try:
        modules = _plan(files, quant)
    except ValueError as e:                 # a piece's shape (quant_regions.packed_shape)
        files.close()
        raise QuantCheckpointError(str(e)) from None
    except BaseException:
        files.close()
        raise
    names = {n for n in index if _owner(n, modules, quant) is None} | {
        f"{m}.weight" for m in modules}
    return names, _tensors(files, quant, modules, native)


def _plan(files: CheckpointFiles, quant: WeightQuant) -> dict[str, tuple[int, int]]:
    """Quantized module prefix -> its dequantized shape [R, C]; every piece checked."""
    main, method = MAIN_PIECE[quant.method], quant.method
    pieces = SCALE_PIECES[method] + OPTIONAL_PIECES.get(method, ())
    modules = {}
    for name in files.index:
        prefix, _, leaf = name.rpartition(".")
        if leaf in REFUSED_PIECES:
            raise QuantCheckpointError(
                f"checkpoint tensor {name!r} is not supported: {leaf} (static activation or "
                "KV-cache scales, asymmetric FP8) is not served")
        if leaf in SCALE_PIECES[method] and method not in ("gptq", "awq") \
                and f"{prefix}.{main}" in files.index:
            modules[prefix] = None
        elif leaf in pieces and f"{prefix}.{main}" not in files.index:
            raise QuantCheckpointError(f"checkpoint tensor {name!r} has no {prefix}.{main} "
                                       f"beside it ({method} packs both)")
        elif leaf == main and method in ("gptq", "awq"):
            modules[prefix] = None
    for prefix in modules:
        modules[prefix] = packed_shape(files, prefix, quant)
    _refuse_unpaired_fp8(files, modules, quant)
    return modules


def _refuse_unpaired_fp8(files: CheckpointFiles, modules: dict, quant: WeightQuant) -> None:
    """An FP8 tensor outside a quantized module would be copied as if it were plain."""
    for name in files.index:
        if name.rpartition(".")[0] in modules:
            continue
        if files.slice(name).get_dtype() in FP8_DTYPES:
            if quant.method in ("gptq", "awq"):
                raise QuantCheckpointError(f"checkpoint tensor {name!r} is FP8: a "
                                           f"{quant.method} checkpoint holds none")
            raise QuantCheckpointError(
                f"checkpoint tensor {name!r} is FP8 without a {SCALE_PIECES[quant.method][0]} "
                f"beside it: only {quant.method} modules with their scales are served")


def _owner(name: str, modules: dict, quant: WeightQuant) -> str | None:
    """The quantized module whose piece `name` is, or None for a plain tensor."""
    prefix, _, leaf = name.rpartition(".")
    pieces = (MAIN_PIECE[quant.method],) + SCALE_PIECES[quant.method] \
        + OPTIONAL_PIECES.get(quant.method, ())
    return prefix if prefix in modules and leaf in pieces else None


def _tensors(files: CheckpointFiles, quant: WeightQuant, modules: dict[str, tuple[int, int]],
             native: bool = False) -> Iterator[tuple[str, Any]]:
    """The checkpoint in file order: plain tensors as they are, each quantized module once (at
    its main piece) as a DequantSlice."""
    by_file: dict[Path, list[str]] = {}
    for name, path in files.index.items():
        by_file.setdefault(path, []).append(name)
    main = MAIN_PIECE[quant.method]
    reader = REGION_READERS[quant.method]
    packed = PACKED_READERS.get(quant.method) if native else None
    try:
        for path in sorted(by_file):
            for name in by_file[path]:
                prefix = _owner(name, modules, quant)
                if prefix is None:
                    yield name, _plain(files, name, modules, quant)
                elif name == f"{prefix}.{main}":
                    yield f"{prefix}.weight", DequantSlice(
                        f"{prefix}.weight", modules[prefix],
                        _region_of(files, prefix, quant, modules[prefix], reader),
                        packed and _packed_of(files, prefix, quant, modules[prefix], packed))
    finally:
        files.close()


def _plain(files: CheckpointFiles, name: str, modules: dict, quant: WeightQuant):
    """A plain tensor's lazy slice; a packed module's all-zero bias as a SpareZeroBias."""
    prefix, _, leaf = name.rpartition(".")
    if leaf == "bias" and prefix in modules and quant.method in ("gptq", "awq"):
        bias = files.tensor(name)
        if not bias.any():
            return SpareZeroBias(bias)
    return files.slice(name)


def _region_of(files, prefix, quant, shape, reader):
    return lambda r0, r1, c0, c1: reader(files, prefix, quant, shape, (r0, r1), (c0, c1))


def _packed_of(files, prefix, quant, shape, reader):
    return lambda rows, cols: reader(files, prefix, quant, shape, rows, cols)
