"""Build a model from a Hugging Face directory (or a GGUF file) and load this rank's shard of its
weights.

Checkpoints are read lazily with safetensors `get_slice`, so each rank reads only the rows or
columns its parameters keep. A GGUF file is dequantized tensor by tensor as it is read
(models/gguf_weights.py). Each parameter's own `weight_loader` knows how it is sharded.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open
from torch import nn

from engine_common.configuration.config import CPU_QUANTIZED_WEIGHTS
from engine_common.model_files.checkpoint_dtype import INDEX_FILE, SINGLE_FILE, checkpoint_dtype
from engine_common.model_files.gguf_file import GGUFError, GGUFFile, find_gguf
from engine_common.model_files.model_dir import ModelDirError, load_json, read_model_configs
from engine_common.model_files.quant_config import quantization_problem
from engine_common.model_files.weight_quant import weight_quant
from engine_common.runtime.progress import Progress
from kernels.attention.backend import AttentionBackend
from worker_service.layers.cpu_kernels import use_cpu_kernels
from worker_service.models.gguf_weights import gguf_tensor_names, iter_gguf_weights
from worker_service.models.heap_trim import trim_heap
from worker_service.models.quant_checkpoint import QuantCheckpointError, quantized_checkpoint
from worker_service.models.registry import get_model_class
from worker_service.parallel_state import TPGroup

DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16, "half": torch.float16}
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

log = logging.getLogger(__name__)


class WeightLoadError(ValueError):
    """The checkpoint does not fit the model: missing, unexpected or mis-shaped weights."""


def resolve_dtype(hf_config: dict, dtype: str | torch.dtype | None = None,
                  model_dir: str | Path | None = None) -> torch.dtype:
    """`dtype` when given (a torch.dtype or one of DTYPES), else config's dtype/torch_dtype,
    else the checkpoint's in `model_dir` (checkpoint_dtype.py: transformers' "auto"; gpt-oss's
    config names none and its bfloat16 weights were loaded as float32), else float32. "auto"
    means "as the config (or the checkpoint) says"."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = dtype if dtype not in (None, "auto") else (
        hf_config.get("dtype") or hf_config.get("torch_dtype")
        or (checkpoint_dtype(model_dir) if model_dir is not None else None) or "float32")
    name = str(name).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"dtype={name!r} is invalid: must be one of {sorted(DTYPES)} or 'auto'")
    return DTYPES[name]


def checkpoint_index(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (sharded index or a single file)."""
    index_path = model_dir / INDEX_FILE
    if index_path.exists():
        weight_map = load_json(index_path).get("weight_map") or {}
        return {name: model_dir / fname for name, fname in weight_map.items()}
    single = model_dir / SINGLE_FILE
    if not single.exists():
        raise ModelDirError(f"{model_dir} has neither {SINGLE_FILE} nor {INDEX_FILE}")
    with safe_open(single, framework="pt", device="cpu") as f:
        return {name: single for name in f.keys()}


def iter_checkpoint(index: dict[str, Path]) -> Iterator[tuple[str, Any]]:
    """(name, lazy slice) for every tensor, one file open at a time."""
    by_file: dict[Path, list[str]] = {}
    for name, path in index.items():
        by_file.setdefault(path, []).append(name)
    for path in sorted(by_file):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in by_file[path]:
                yield name, f.get_slice(name)


def target_of(model: nn.Module, name: str) -> tuple[str, Any] | None:
    """Checkpoint name -> (our parameter name, shard id), or None for a tensor we skip."""
    if name.endswith(IGNORED_SUFFIXES):
        return None
    if name == "lm_head.weight" and model.lm_head_is_tied:
        return None
    # a model with stacked weights (MoE experts) maps their per-piece names itself
    own_target = getattr(model, "checkpoint_target", None)
    target = own_target(name) if own_target is not None else None
    if target is not None:
        return target
    for ckpt_part, (packed, shard_id) in model.packed_modules.items():
        if f".{ckpt_part}." in name:
            return name.replace(f".{ckpt_part}.", f".{packed}."), shard_id
    return name, None


def open_checkpoint(model_path: Path, hf_config: dict, native_quant: bool = False
                    ) -> tuple[set[str], Iterator[tuple[str, Any]]]:
    """(tensor names, (name, tensor or lazy slice) pairs) of a safetensors directory or a GGUF;
    GGUF tensors are dequantized to float32 one at a time, a weight-quantized checkpoint's
    (FP8, GPTQ, AWQ: models/quant_checkpoint.py) region by region as each rank reads them.
    native_quant: GPTQ / AWQ linear weights are offered packed too (CPU kernels)."""
    try:
        gguf_path = find_gguf(model_path)
        if gguf_path is not None:
            gguf = GGUFFile.open(gguf_path)
            tensors = ((name, torch.from_numpy(w))
                       for name, w in iter_gguf_weights(gguf, hf_config))
            return gguf_tensor_names(gguf), tensors
    except GGUFError as e:
        raise ModelDirError(str(e)) from None
    index = checkpoint_index(model_path)
    quant = weight_quant(hf_config)
    if quant is not None:
        try:
            return quantized_checkpoint(index, quant, native_quant)
        except QuantCheckpointError as e:
            raise WeightLoadError(str(e)) from None
    return set(index), iter_checkpoint(index)


def load_weights(model: nn.Module, model_dir: Path, hf_config: dict | None = None,
                 native_quant: bool = False) -> None:
    """Copy this rank's slice of every checkpoint tensor into the model's parameters
    (native_quant: GPTQ / AWQ linear weights kept packed, layers/quant_linear.py)."""
    names, tensors = open_checkpoint(Path(model_dir), hf_config or {}, native_quant)
    if "lm_head.weight" not in names:
        model.tie_lm_head()                  # no separate head in the checkpoint: tie it
    params = dict(model.named_parameters())
    loaded: dict[str, set] = {}
    unexpected = []
    # A line at each quarter: a first start of a large model says how far it is.
    progress = Progress(f"loading weights of {Path(model_dir).name}", len(names), "tensors",
                        emit=log.info)
    with torch.no_grad():
        for name, tensor_slice in _gguf_errors(tensors):
            progress.advance()
            for piece_name, piece in _pieces(model, name, tensor_slice):
                target = target_of(model, piece_name)
                if target is None:
                    continue
                param_name, shard_id = target
                if param_name not in params:
                    if not getattr(tensor_slice, "spare", False):   # quant_checkpoint.py
                        unexpected.append(name)
                    continue
                param = params[param_name]
                try:
                    param.weight_loader(param, piece, shard_id)
                except ValueError as e:
                    raise WeightLoadError(f"checkpoint tensor {name!r}: {e}") from None
                loaded.setdefault(param_name, set()).add(shard_id)
    check_complete(params, loaded, unexpected)


def _pieces(model: nn.Module, name: str, tensor_slice) -> list[tuple[str, Any]]:
    """A checkpoint tensor as the model reads it: whole, or cut by the model's
    split_checkpoint_tensor (a fused projection in its unfused parts: models/phi3.py)."""
    split = getattr(model, "split_checkpoint_tensor", None)
    try:
        pieces = split(name, tensor_slice) if split is not None else None
    except ValueError as e:
        raise WeightLoadError(f"checkpoint tensor {name!r}: {e}") from None
    return pieces if pieces is not None else [(name, tensor_slice)]


def _gguf_errors(tensors: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """GGUF errors met while reading (an unsupported tensor type) as ModelDirError."""
    try:
        yield from tensors
    except GGUFError as e:
        raise ModelDirError(str(e)) from None


def check_complete(params: dict[str, nn.Parameter], loaded: dict[str, set],
                   unexpected: list[str]) -> None:
    """Raise WeightLoadError naming unexpected tensors and parameters left unloaded."""
    missing = []
    for name, param in params.items():
        got = loaded.get(name, set())
        # a stacked parameter read whole (shard None) needs none of its pieces: a GPT-OSS
        # checkpoint may hold some layers' experts dequantized beside MXFP4 ones, as
        # transformers loads it
        wanted = set(param.shard_ids) if getattr(param, "shard_ids", None) and None not in got \
            else {None}
        # a stacked parameter names the checkpoint tensor each missing shard is read from
        shard_name = getattr(param, "shard_name", None) or (lambda n, s: f"{n}[{s}]")
        missing += [shard_name(name, s) if s is not None else name
                    for s in sorted(wanted - got, key=str)]
    if unexpected:
        raise WeightLoadError(f"{len(unexpected)} checkpoint tensors match no parameter: "
                              f"{sorted(unexpected)[:10]}")
    if missing:
        raise WeightLoadError(f"{len(missing)} parameters are missing from the checkpoint: "
                              f"{missing[:10]}")


def load_model(model_dir: str | Path, tp: TPGroup, attn_backend: AttentionBackend,
               device: str | torch.device, dtype: str | torch.dtype | None = None,
               fused_ops: bool = False, cpu_quantized_weights: str = "native") -> nn.Module:
    """Build the model config.json names, on `device`, and load this rank's weights.

    fused_ops=True: the model's RMSNorms and rope run as Triton kernels (kernels/fused_norm.py,
    kernels/fused_rope.py); ValueError unless `device` is CUDA or Triton runs interpreted.
    cpu_quantized_weights: "native" keeps a GPTQ / AWQ checkpoint's linear weights packed on a
    CPU device (layers/quant_linear.py), "dequantize" expands them at load (always on CUDA)."""
    if cpu_quantized_weights not in CPU_QUANTIZED_WEIGHTS:
        raise ValueError(f"cpu_quantized_weights={cpu_quantized_weights!r} is invalid: must "
                         f"be one of {list(CPU_QUANTIZED_WEIGHTS)}")
    path = Path(model_dir)
    hf_config = read_model_configs(path)[0]
    problem = quantization_problem(hf_config)
    if problem is not None:
        raise ValueError(f"config.json: {problem}")
    archs = hf_config.get("architectures") or [None]
    model_class = get_model_class(archs[0], hf_config.get("auto_map"))
    torch_dtype = resolve_dtype(hf_config, dtype, path)
    if fused_ops:
        check_fused_ops_device(device)
    with torch.device(device):
        model = model_class(hf_config, tp, attn_backend, torch_dtype, fused_ops=fused_ops)
    on_cpu = torch.device(device).type == "cpu"
    load_weights(model, path, hf_config, on_cpu and cpu_quantized_weights == "native")
    if on_cpu:
        use_cpu_kernels(model)
        trim_heap()                          # the load's transients, freed but resident
    return model.eval()


def check_fused_ops_device(device: str | torch.device) -> None:
    """ValueError unless the fused Triton kernels can run on `device`."""
    from kernels.fused_rope import triton_runs_on   # imports triton: only when asked for
    if not triton_runs_on(device):
        raise ValueError(f"fused_ops=True on device={str(device)!r} is invalid: the fused "
                         f"kernels need a CUDA device, or TRITON_INTERPRET=1 set before triton "
                         f"is imported (the CPU interpreter)")


def kv_cache_shape(model: nn.Module, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """Shape of one layer's paged cache: [2, num_blocks, block_size, kv_heads_per_rank, D]."""
    return (2, num_blocks, block_size, model.num_kv_heads, model.head_dim)


def kv_cache_halves(model_or_class) -> int:
    """Halves of the cache held in memory: 2 (keys, values), or 1 for a model whose values
    are its keys (DeepSeek's latent: `kv_values_are_keys`), whose [2, ...] cache is one
    tensor seen twice (stride 0 on the first dimension)."""
    return 1 if getattr(model_or_class, "kv_values_are_keys", False) else 2


def new_kv_cache(shape: tuple[int, ...], halves: int, make) -> torch.Tensor:
    """A [2, ...] cache of `shape` from make(shape) (zeroed): its own values half, or with
    halves == 1 the keys half seen again as the values (writing both writes the same bytes)."""
    if halves == 2:
        return make(shape)
    return make((1, *shape[1:])).expand(shape)


def allocate_kv_caches(model: nn.Module, num_blocks: int, block_size: int,
                       device: str | torch.device,
                       dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """One zeroed cache per layer, in the model's dtype unless `dtype` is given."""
    shape = kv_cache_shape(model, num_blocks, block_size)
    return [new_kv_cache(shape, kv_cache_halves(model),
                         lambda s: torch.zeros(s, dtype=dtype or model.dtype, device=device))
            for _ in range(model.num_layers)]
