"""The runner's LoRA set-up: every adapter of --lora-modules read, validated and attached."""
from __future__ import annotations

from torch import nn

from engine_common.configuration.config import WorkerConfig
from worker_service.failures import StepProtocolError
from worker_service.lora.adapter import read_adapter
from worker_service.lora.layers import LoRAState, attach_lora


def load_lora(model: nn.Module, config: WorkerConfig) -> LoRAState | None:
    """None without adapters; else the state the runner sets each step. Adapter ids are the
    1-based places in lora_modules (slot = id - 1), as the scheduler numbers them."""
    modules = config.lora
    if not modules:
        return None
    adapters = [read_adapter(m.name, m.path, config.max_lora_rank) for m in modules]
    return attach_lora(model, adapters)


def check_lora_ids(new_requests, lora: LoRAState | None) -> None:
    """StepProtocolError for a new request naming an adapter this worker does not hold (a
    scheduler started with other --lora-modules): never run it on the base model silently."""
    held = 0 if lora is None else lora.num_adapters
    for r in new_requests:
        if r.lora_id > held:
            raise StepProtocolError(f"new request {r.handle}: lora_id={r.lora_id} is invalid: "
                                    f"this worker holds {held} LoRA adapter(s)")
