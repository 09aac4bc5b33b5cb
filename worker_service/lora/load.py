"""The runner's LoRA set-up: every adapter of --lora-modules read, validated and attached, and
the adapters LoadLora / UnloadLora change at run time (slots.py)."""
from __future__ import annotations

from torch import nn

from engine_common.configuration.config import WorkerConfig
from worker_service.failures import FailureKind, StepFailure, StepProtocolError
from worker_service.lora.adapter import read_adapter
from worker_service.lora.families import lora_targets
from worker_service.lora.layers import max_adapter_bytes
from worker_service.lora.slots import LoRASlots


def load_lora(model: nn.Module, config: WorkerConfig) -> LoRASlots | None:
    """None without adapters (and without runtime updating); else the slots the runner sets
    each step. Adapter ids are the 1-based places in lora_modules, as the scheduler numbers
    them; runtime loads take free ids after them."""
    modules = config.lora
    if not modules and not (config.enable_lora and config.allow_runtime_lora_updating):
        return None
    limit, targets = max_adapter_bytes(model, config.max_lora_rank), lora_targets(model)
    adapters = {i: read_adapter(m.name, m.path, config.max_lora_rank, limit, targets)
                for i, m in enumerate(modules)}
    capacity = lora_slots(config) if config.max_cpu_loras is not None else None
    return LoRASlots(model, config.max_lora_rank, adapters, capacity)


def lora_slots(config: WorkerConfig) -> int:
    """The adapters a rank may hold at once, which the memory check counts (0 without LoRA):
    max_cpu_loras when set (LoRASlots refuses more), which a scheduler sets whenever its Init
    allows LoadLora (lora_updates.init_config: --max-cpu-loras, by default the larger of
    --max-loras + 1 and the --lora-modules); else the --lora-modules. A scheduler from before
    session 51 with runtime updating and no --max-cpu-loras sends neither: at least
    --max-loras is counted then, and its loads beyond that are not."""
    if not config.enable_lora:
        return 0
    if config.max_cpu_loras is not None:
        return max(config.max_cpu_loras, len(config.lora))
    if config.allow_runtime_lora_updating:
        return max(len(config.lora), config.max_loras)
    return len(config.lora)


def runtime_slots(lora: LoRASlots | None, config: WorkerConfig, call: str) -> LoRASlots:
    """The slots a LoadLora / UnloadLora changes; FAILED_PRECONDITION (BAD_STATE) naming the
    setting when the Init did not allow runtime updating."""
    if lora is None or not config.allow_runtime_lora_updating:
        raise StepFailure(FailureKind.BAD_STATE,
                          f"{call}: allow_runtime_lora_updating=false in this worker's Init "
                          "(start the scheduler with --enable-lora "
                          "--allow-runtime-lora-updating)")
    return lora


def check_lora_ids(new_requests, lora: LoRASlots | None) -> None:
    """StepProtocolError for a new request naming an adapter this worker does not hold (a
    scheduler started with other --lora-modules): never run it on the base model silently."""
    for r in new_requests:
        if r.lora_id and (lora is None or not lora.holds(r.lora_id)):
            held = [] if lora is None else sorted(s + 1 for s in lora.adapters)
            raise StepProtocolError(f"new request {r.handle}: lora_id={r.lora_id} is invalid: "
                                    f"this worker holds LoRA adapter ids {held}")
