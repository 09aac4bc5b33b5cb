"""The adapters one runner holds, by slot (adapter id - 1), and loading or freeing one of them at
run time (docs/lora.md, "Loading at run time").

A load reads and checks the directory, then plans every projection's new stacks before it
changes anything (layers.plan_lora): an adapter that does not fit leaves the model as it was.
The stacks are rebuilt from the held adapters' float32 weights (kept on the host), so slots
and ranks may change freely; a load costs one pass over the held adapters.
"""
from __future__ import annotations

import numpy as np
from torch import nn

from worker_service.lora.adapter import LoRAAdapter, LoRAError, read_adapter
from worker_service.lora.families import lora_targets
from worker_service.lora.layers import LoRAState, apply_lora, max_adapter_bytes, plan_lora


class LoRASlots:
    """Slot -> adapter for one model, and the LoRAState its LoRALinear layers read."""

    def __init__(self, model: nn.Module, max_rank: int,
                 adapters: dict[int, LoRAAdapter] | None = None) -> None:
        self.model, self.max_rank = model, max_rank
        self.max_weights_bytes = max_adapter_bytes(model, max_rank)
        self.adapters: dict[int, LoRAAdapter] = {}
        self.state = LoRAState(next(model.parameters()).device, 0)
        self._apply(adapters or {})

    def holds(self, lora_id: int) -> bool:
        """Whether adapter id `lora_id` (slot + 1) is loaded."""
        return lora_id - 1 in self.adapters

    def set_rows(self, row_slots: np.ndarray, num_scheduled: np.ndarray) -> None:
        self.state.set_rows(row_slots, num_scheduled)

    def load(self, lora_id: int, name: str, path: str) -> None:
        """Read `path` and put it in slot lora_id - 1 (replacing what it held). LoRAError
        naming the path and the reason; then nothing changed."""
        try:
            adapter = read_adapter(name, path, self.max_rank, self.max_weights_bytes,
                                   lora_targets(self.model))
            self._apply({**self.adapters, lora_id - 1: adapter})
        except LoRAError as e:
            raise LoRAError(f"lora_path={path!r} is invalid: {e}") from None
        except (OSError, ValueError) as e:    # unreadable JSON or safetensors
            raise LoRAError(f"lora_path={path!r} is invalid: LoRA adapter {name!r}: "
                            f"{type(e).__name__}: {e}") from None

    def unload(self, lora_id: int) -> bool:
        """Free slot lora_id - 1; False when it held nothing."""
        if lora_id - 1 not in self.adapters:
            return False
        self._apply({s: a for s, a in self.adapters.items() if s != lora_id - 1})
        return True

    def _apply(self, adapters: dict[int, LoRAAdapter]) -> None:
        plan = plan_lora(self.model, adapters)          # raises before anything changes
        apply_lora(self.model, self.state, plan, max(adapters, default=-1) + 1)
        self.adapters = adapters
