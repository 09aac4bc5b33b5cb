"""Read and validate one PEFT LoRA directory (adapter_config.json + adapter_model.safetensors).

Weights come back per checkpoint module ("model.layers.0.self_attn.q_proj") as (A [r, in],
B [out, r]) float32 tensors, with the scaling (alpha / r, rslora alpha / sqrt(r)) kept apart.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from engine_common.request.params import quoted
from worker_service.lora.errors import LoRAError
from worker_service.lora.expert_config import FUSED_MODULES, check_pattern_scope, expert_params

# The projections a Llama-family decoder has (checkpoint names); families.py has every model's.
SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_PREFIX = "base_model.model."
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
# Read before anything is parsed: a huge file must be a refusal, never a worker out of memory
# (that is a worker failure, which fails every tenant's requests). PEFT writes a config of about
# 1 KiB and a header of about 150 bytes per tensor (an 80-layer adapter on every projection:
# 1,120 tensors, ~170 KiB).
MAX_CONFIG_BYTES = 1 << 20
MAX_HEADER_BYTES = 16 << 20


@dataclass
class LoRAAdapter:
    name: str
    rank: int
    scaling: float
    # checkpoint module path -> (A [r, in], B [out, r]), float32; a fused expert parameter's
    # module (peft's target_parameters: "...mlp.experts", "...experts.base_layer") holds every
    # expert's A [E * r', in] and B [out, r' * E] as peft wrote them (lora/expert_weights.py)
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    # fused expert parameter (gate_up_proj, down_proj) -> (rank r', scaling)
    params: dict[str, tuple[int, float]] = field(default_factory=dict)


def _targets(name: str, cfg: dict) -> list[str]:
    t = cfg.get("target_modules") or []
    t = [t] if isinstance(t, str) else t
    if not isinstance(t, list) or not all(isinstance(x, str) for x in t):
        raise LoRAError(f"LoRA adapter {name!r}: target_modules={quoted(t)} is invalid: must "
                        f"be a module name or a list of them")
    return t


def read_adapter(name: str, path: str | Path, max_rank: int,
                 max_weights_bytes: int | None = None,
                 targets: tuple[str, ...] = SUPPORTED_TARGETS) -> LoRAAdapter:
    """LoRAError naming the adapter when the directory is missing a file, its rank exceeds
    max_rank, it targets a module outside `targets` (the model's: families.lora_targets), or
    a file is larger than it can be (the config, the safetensors header, the weights past
    `max_weights_bytes`: layers.max_adapter_bytes of the model)."""
    d = Path(path)
    cfg_file, weights_file = d / CONFIG_FILE, d / WEIGHTS_FILE
    for f in (cfg_file, weights_file):
        if not f.is_file():
            raise LoRAError(f"LoRA adapter {name!r}: {f} does not exist (a PEFT directory "
                            f"needs adapter_config.json and adapter_model.safetensors)")
    cfg = _read_config(name, cfg_file)
    try:      # Infinity and NaN are JSON to Python: int() raises OverflowError on the first
        rank, alpha = int(cfg.get("r", 8)), float(cfg.get("lora_alpha", 8))
        if not math.isfinite(alpha):
            raise ValueError(f"lora_alpha={alpha}")
    except (TypeError, ValueError, OverflowError) as e:
        raise LoRAError(f"LoRA adapter {name!r}: r / lora_alpha in {cfg_file} are not "
                        f"finite numbers ({e})") from None
    if not 1 <= rank <= max_rank:
        raise LoRAError(f"LoRA adapter {name!r}: r={rank} is invalid: must be in "
                        f"[1, max_lora_rank={max_rank}]")
    bad = [t for t in _targets(name, cfg) if t.rsplit(".", 1)[-1] not in targets]
    if bad:
        raise LoRAError(f"LoRA adapter {name!r}: target module(s) {bad} are not supported: "
                        f"must be among {list(targets)}")
    _refuse_features(name, cfg)
    params = expert_params(name, cfg, rank, alpha, max_rank)
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    _check_header_size(name, weights_file)
    size = weights_file.stat().st_size
    if max_weights_bytes is not None and size > max_weights_bytes:
        raise _too_big(name, weights_file, "a file", size, max_weights_bytes)
    try:      # a file named at run time (LoadLora) may be anything: never an INTERNAL error
        tensors = load_file(str(weights_file))
    except Exception as e:  # noqa: BLE001 - safetensors' own error is no ValueError
        raise LoRAError(f"LoRA adapter {name!r}: {weights_file} cannot be read "
                        f"({type(e).__name__}: {e})") from None
    weights = _pairs(name, tensors, rank, bool(params))
    check_pattern_scope(name, cfg, weights)
    return LoRAAdapter(name, rank, scaling, weights, params)


# adapter_config.json keys whose value changes what the weights mean, and the value that does
# not (peft's defaults): anything else is refused by name (as vLLM's PEFTHelper refuses DoRA
# and modules_to_save), never served as a plain LoRA that would give other tokens.
_PLAIN = {
    "use_dora": (False, "DoRA (its lora_magnitude_vector)"),
    "modules_to_save": (None, "whole modules saved with the adapter (they would replace the "
                              "base model's)"),
    "bias": ("none", "biases trained with the adapter"),
    "lora_bias": (False, "a bias on lora_B"),
    "fan_in_fan_out": (False, "a Conv1D base layer; the served projections are nn.Linear"),
    "layer_replication": (None, "decoder layers the adapter repeats: another model"),
    "trainable_token_indices": (None, "trained embedding rows"),
    # target_parameters, rank_pattern and alpha_pattern: expert_config.py
}


def _refuse_features(name: str, cfg: dict) -> None:
    """LoRAError naming the first key of adapter_config.json whose value is not plain LoRA."""
    for key, (plain, what) in _PLAIN.items():
        value = cfg.get(key)
        if value not in (plain, None, False, "", [], {}):    # absent, null, false, empty
            must = "unset" if plain is None else json.dumps(plain)
            raise LoRAError(f"LoRA adapter {name!r}: {key}={quoted(value)} is not supported "
                            f"({what}): must be {must}")


def _too_big(name: str, file: Path, what: str, size: int, limit: int) -> LoRAError:
    return LoRAError(f"LoRA adapter {name!r}: {file}: {what} of {size} bytes is invalid: must "
                     f"be at most {limit} bytes")


def _read_config(name: str, cfg_file: Path) -> dict:
    size = 0
    try:
        with open(cfg_file, "rb") as f:       # never more than the limit, whatever stat said
            raw = f.read(MAX_CONFIG_BYTES + 1)
            if len(raw) > MAX_CONFIG_BYTES:
                size = max(os.fstat(f.fileno()).st_size, len(raw))
            else:
                cfg = json.loads(raw.decode())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:   # nested too deep
        raise LoRAError(f"LoRA adapter {name!r}: {cfg_file} cannot be read "
                        f"({type(e).__name__}: {e})") from None
    if size:
        raise _too_big(name, cfg_file, "a file", size, MAX_CONFIG_BYTES)
    if not isinstance(cfg, dict):
        raise LoRAError(f"LoRA adapter {name!r}: {cfg_file} is not a JSON object")
    return cfg


def _check_header_size(name: str, weights_file: Path) -> None:
    """LoRAError when the safetensors header (its first 8 bytes: the JSON header's length,
    little-endian) is over MAX_HEADER_BYTES: safetensors would read and parse it whole."""
    try:
        with open(weights_file, "rb") as f:
            head = f.read(8)
    except OSError as e:
        raise LoRAError(f"LoRA adapter {name!r}: {weights_file} cannot be read "
                        f"({type(e).__name__}: {e})") from None
    size = int.from_bytes(head, "little") if len(head) == 8 else 0
    if size > MAX_HEADER_BYTES:
        raise _too_big(name, weights_file, "a safetensors header", size, MAX_HEADER_BYTES)


def _pairs(name: str, tensors: dict[str, torch.Tensor], rank: int,
           fused: bool) -> dict[str, tuple]:
    """PEFT keys 'base_model.model.<module>.lora_A.weight' / lora_B paired by module, each of
    rank `rank` (the config's r: the stacks are sized by it, and the scaling uses it); with
    target_parameters (`fused`), a fused experts module's rank is checked with the model's
    expert count (expert_weights.py)."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        if not key.startswith(_PREFIX) or not key.endswith(".weight"):
            raise LoRAError(f"LoRA adapter {name!r}: tensor {key!r} is not a PEFT LoRA weight")
        module, _, half = key[len(_PREFIX):-len(".weight")].rpartition(".")
        if half not in ("lora_A", "lora_B"):
            raise LoRAError(f"LoRA adapter {name!r}: tensor {key!r} is not supported "
                            f"(only lora_A / lora_B weights)")
        t = t.float()
        if not torch.isfinite(t).all():       # NaN would reach every token of the adapter
            raise LoRAError(f"LoRA adapter {name!r}: tensor {key!r} is invalid: it holds NaN "
                            f"or infinite values")
        halves.setdefault(module, {})[half] = t
    out = {}
    for module, h in halves.items():
        if set(h) != {"lora_A", "lora_B"}:
            raise LoRAError(f"LoRA adapter {name!r}: {module} lacks lora_A or lora_B")
        a, b = h["lora_A"], h["lora_B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise LoRAError(f"LoRA adapter {name!r}: {module}: lora_A {tuple(a.shape)} and "
                            f"lora_B {tuple(b.shape)} do not pair as [r, in] and [out, r]")
        if a.shape[0] != rank and not (fused and module.endswith(FUSED_MODULES)):
            raise LoRAError(f"LoRA adapter {name!r}: {module}: lora_A {tuple(a.shape)} has "
                            f"rank {a.shape[0]}: adapter_config.json says r={rank}")
        out[module] = (a, b)
    return out
