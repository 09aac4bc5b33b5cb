"""adapter_config.json's keys for LoRA on fused MoE expert parameters (docs/lora.md, "MoE
experts"): peft's `target_parameters`, and the `rank_pattern` / `alpha_pattern` entries peft
0.21 writes with them over transformers 5.

peft turns `target_modules` gate_proj + up_proj (Mixtral: w1 + w3) into one LoRA on the fused
`gate_up_proj` parameter of rank 2r and alpha 2 lora_alpha (`{".*\\.gate_up_proj": 2r}`), and
down_proj (w2) into one on `down_proj`. Only these two parameters are served, and a pattern
only in the form peft writes for one of them (or the bare name, which peft matches the same);
anything else is refused by name. peft matches a pattern against every adapted module too
(`(.*\\.)?<key>$`): a key that would also set a module's r / lora_alpha (Qwen2-MoE's
shared_expert.down_proj under `.*\\.down_proj`) is refused, since modules use r / lora_alpha.
"""
from __future__ import annotations

import json
import math
import re

from engine_common.request.params import quoted
from worker_service.lora.errors import LoRAError

EXPERT_PARAMS = ("gate_up_proj", "down_proj")
# a fused gate_up_proj holds gate's and up's LoRA side by side: up to twice the rank
_RANK_FACTOR = {"gate_up_proj": 2, "down_proj": 1}
_PATTERN = re.compile(r"^(\.\*\\\.)?(?P<param>\w+)$")
# the modules peft's target_parameters writes: the outer and, with both parameters, inner one
FUSED_MODULES = (".experts", ".experts.base_layer")
_PEFT_FORM = json.dumps(".*\\.gate_up_proj")


def _error(name: str, key: str, value, why: str) -> LoRAError:
    return LoRAError(f"LoRA adapter {name!r}: {key}={quoted(value)} is not supported ({why})")


def expert_params(name: str, cfg: dict, rank: int, alpha: float, max_rank: int
                  ) -> dict[str, tuple[int, float]]:
    """The fused expert parameters the adapter targets: param -> (rank, scaling). LoRAError
    naming the key and value for a target, pattern or rank that is not served."""
    params = cfg.get("target_parameters") or []
    if not isinstance(params, list) or not all(isinstance(p, str) for p in params):
        raise _error(name, "target_parameters", params, "must be a list of parameter names")
    leaves = [p.rsplit(".", 1)[-1] for p in params]
    bad = [p for p, leaf in zip(params, leaves) if leaf not in EXPERT_PARAMS]
    if bad:
        raise _error(name, "target_parameters", bad, f"LoRA on parameters other than the MoE "
                                                     f"experts' {list(EXPERT_PARAMS)}")
    ranks = _patterns(name, cfg, "rank_pattern", leaves, "per-module r")
    alphas = _patterns(name, cfg, "alpha_pattern", leaves, "per-module lora_alpha")
    out = {}
    for leaf in leaves:
        r, a = ranks.get(leaf, rank), alphas.get(leaf, alpha)
        limit = _RANK_FACTOR[leaf] * max_rank
        ok = (isinstance(r, int) and not isinstance(r, bool) and 1 <= r <= limit
              and isinstance(a, (int, float)) and math.isfinite(a))
        if not ok:
            raise _error(name, f"rank_pattern / alpha_pattern of {leaf}",
                         [ranks.get(leaf, rank), alphas.get(leaf, alpha)],
                         f"the rank must be an integer in [1, {limit}] "
                         f"({_RANK_FACTOR[leaf]} x max_lora_rank) and alpha finite")
        out[leaf] = (r, a / math.sqrt(r) if cfg.get("use_rslora") else a / r)
    return out


def _patterns(name: str, cfg: dict, key: str, leaves: list[str], what: str) -> dict:
    """{param: value} of a rank_pattern / alpha_pattern whose every key is peft's
    `.*\\.<param>` for a targeted fused expert parameter; LoRAError naming it otherwise."""
    pattern = cfg.get(key) or {}
    if not isinstance(pattern, dict):
        raise _error(name, key, pattern, f"{what}; must be an object")
    out = {}
    for k, v in pattern.items():
        m = _PATTERN.match(k)
        if m is None or m["param"] not in leaves:
            raise _error(name, key, {k: v}, f"{what}: only peft's {_PEFT_FORM} (or the bare "
                                            f"name) for a fused expert parameter of "
                                            f"target_parameters; every other module must use "
                                            f"r / lora_alpha")
        out.setdefault(m["param"], v)          # peft takes the first key that matches
    return out


def check_pattern_scope(name: str, cfg: dict, modules) -> None:
    """LoRAError naming the key and the module when a rank_pattern / alpha_pattern key
    (already one of a fused expert parameter) would also match one of the adapter's
    `modules` other than the fused experts' in peft: peft gives that module the key's r /
    lora_alpha, which a module here never takes."""
    for key in ("rank_pattern", "alpha_pattern"):
        for k, v in (cfg.get(key) or {}).items():
            param = _PATTERN.match(k)["param"]
            hit = next((m for m in modules if not m.endswith(FUSED_MODULES)
                        and (m == param or m.endswith(f".{param}"))), None)
            if hit is not None:
                raise _error(name, key, {k: v}, f"peft gives module {hit} its value too; "
                                                f"only the fused expert parameters may have "
                                                f"their own r / lora_alpha")
