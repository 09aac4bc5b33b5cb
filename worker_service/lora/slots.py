"""The adapters one runner holds, by adapter id, and loading or freeing one of them at run time
(docs/lora.md, "Loading at run time").

A load reads and checks the directory, then plans every projection's new stacks before it
changes anything (layers.plan_lora): an adapter that does not fit leaves the model as it was.
The stacks are rebuilt from the held adapters' float32 weights (kept on the host), so slots
and ranks may change freely; a load costs one pass over the held adapters.

The stacks have one slot per held adapter, in id order (ids may reach 1,024 while
--max-cpu-loras keeps a few loaded): a step's rows are mapped from id to slot. With
--max-cpu-loras a load past that many held adapters is refused: the memory check counted that
many slots (runner/lora_memory.py).
"""
from __future__ import annotations

import numpy as np
from torch import nn

from worker_service.failures import StepProtocolError
from worker_service.lora.adapter import LoRAAdapter, LoRAError, read_adapter
from worker_service.lora.experts import LoRAExperts
from worker_service.lora.families import lora_targets
from worker_service.lora.layers import (LoRALinear, LoRAState, apply_lora, max_adapter_bytes,
                                        plan_lora)


class LoRASlots:
    """Adapter -> stack slot for one model, and the LoRAState its LoRA layers read."""

    def __init__(self, model: nn.Module, max_rank: int,
                 adapters: dict[int, LoRAAdapter] | None = None,
                 capacity: int | None = None) -> None:
        self.model, self.max_rank, self.capacity = model, max_rank, capacity
        self.max_weights_bytes = max_adapter_bytes(model, max_rank)
        self.adapters: dict[int, LoRAAdapter] = {}       # by adapter id - 1
        self._slot_of = np.full(1, -1, dtype=np.int64)    # id - 1 -> slot; [-1]: -1 (none)
        self.state = LoRAState(next(model.parameters()).device, 0)
        self._apply(adapters or {})

    def holds(self, lora_id: int) -> bool:
        """Whether adapter id `lora_id` is loaded."""
        return lora_id - 1 in self.adapters

    def set_rows(self, row_ids: np.ndarray, num_scheduled: np.ndarray) -> None:
        """row_ids: each row's adapter id - 1 (-1: the base model). StepProtocolError for a
        row of an adapter not held (a resumed request's evicted one): never another slot or
        the base model silently."""
        slot_of = self._slot_of
        slots = slot_of[np.minimum(row_ids, len(slot_of) - 1)]     # beyond the map: -1
        lost = (slots < 0) & (row_ids >= 0)
        if lost.any():
            raise StepProtocolError(f"lora_id={int(row_ids[lost][0]) + 1} is invalid: this "
                                    "worker holds LoRA adapter ids "
                                    f"{sorted(i + 1 for i in self.adapters)}")
        self.state.set_rows(slots, num_scheduled)

    def load(self, lora_id: int, name: str, path: str) -> None:
        """Read `path` and hold it as adapter `lora_id` (replacing what that id held).
        LoRAError naming the path and the reason; then nothing changed."""
        if (self.capacity is not None and not self.holds(lora_id)
                and len(self.adapters) >= self.capacity):
            raise LoRAError(f"lora_id={lora_id} is invalid: this rank holds "
                            f"{len(self.adapters)} LoRA adapter(s), the most --max-cpu-loras "
                            f"{self.capacity} allows (its memory check counted that many): "
                            "unload one first")
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
        """Free adapter `lora_id`; False when it was not held."""
        if lora_id - 1 not in self.adapters:
            return False
        self._apply({s: a for s, a in self.adapters.items() if s != lora_id - 1})
        return True

    def restart(self, num_static: int) -> None:
        """A new epoch's Init on a kept model: hold only the Init's --lora-modules (ids
        1..num_static). Another scheduler's runtime loads would stay held, never served, and
        fill the slots --max-cpu-loras allows; the new scheduler loads what it serves again
        (lora_updates.replay)."""
        kept = {i: a for i, a in self.adapters.items() if i < num_static}
        if len(kept) != len(self.adapters):
            self._apply(kept)

    def stack_bytes(self) -> int:
        """The bytes the model's LoRA stacks take now."""
        total = 0
        for m in self.model.modules():
            if isinstance(m, LoRALinear):
                stacks = (m.lora_a, m.lora_b)
            elif isinstance(m, LoRAExperts):
                stacks = (m.a13, m.b13, m.a2, m.b2, m.has)
            else:
                continue
            total += sum(t.numel() * t.element_size() for t in stacks)
        return total

    def _apply(self, adapters: dict[int, LoRAAdapter]) -> None:
        ids = sorted(adapters)
        slot_of = np.full(max(ids, default=-1) + 2, -1, dtype=np.int64)
        slot_of[ids] = np.arange(len(ids))
        plan = plan_lora(self.model, {i: adapters[k] for i, k in enumerate(ids)})   # may raise
        apply_lora(self.model, self.state, plan, len(ids))
        self.adapters, self._slot_of = adapters, slot_of
