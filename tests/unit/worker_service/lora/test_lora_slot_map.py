"""LoRASlots maps adapter ids to stack slots (one slot per held adapter, in id order): a step's
rows get their own adapter's slot, the base model's rows none, after loads and unloads that
move the slots; a row naming an adapter the rank does not hold is refused, never run on the
base model or another adapter's slot (docs/lora.md, "Memory")."""
from __future__ import annotations

import numpy as np
import pytest

from worker_service.failures import StepProtocolError
from worker_service.lora.slots import LoRASlots
from kernels.attention.torch_ref import TorchAttentionBackend
from worker_service.models.loader import load_model
from worker_service.parallel_state import single_rank_group
from tests.support.lora_adapters import make_adapter


@pytest.fixture(scope="module")
def slots_and_dirs(tiny_models, tmp_path_factory):
    model_dir = tiny_models("llama")
    root = tmp_path_factory.mktemp("slot-map")
    dirs = [make_adapter(model_dir, root / n, r=4, seed=i) for i, n in enumerate("abc")]
    model = load_model(model_dir, single_rank_group(), TorchAttentionBackend(), "cpu", "float32")
    return LoRASlots(model, 8), dirs


def _token_slots(slots: LoRASlots, row_ids, counts) -> list[int]:
    slots.set_rows(np.array(row_ids, dtype=np.int32), np.array(counts))
    return slots.state._slots.tolist()


def test_rows_follow_their_adapter_as_slots_move(slots_and_dirs):
    slots, dirs = slots_and_dirs
    for lora_id in (1, 3):
        slots.load(lora_id, f"id{lora_id}", dirs[lora_id - 1])
    assert slots.state.num_adapters == 2                    # ids 1 and 3: slots 0 and 1
    assert _token_slots(slots, [2, -1, 0], [2, 1, 1]) == [1, 1, -1, 0]
    slots.unload(1)                                         # id 3 moves to slot 0
    assert slots.state.num_adapters == 1
    assert _token_slots(slots, [-1, 2], [1, 2]) == [-1, 0, 0]
    a = slots.model.model.layers[0].self_attn.qkv_proj.lora_a
    assert a.shape[0] == 1 and a[0].abs().sum() > 0        # id 3's weights, not id 1's zeros


def test_a_row_of_an_adapter_not_held_is_refused(slots_and_dirs):
    slots, dirs = slots_and_dirs
    for lora_id in tuple(i + 1 for i in slots.adapters):
        slots.unload(lora_id)
    slots.load(3, "c", dirs[2])
    for row_ids in ([1], [-1, 0], [5]):       # id 2 (inside the map), id 1, id 6 (beyond it)
        with pytest.raises(StepProtocolError, match=r"lora_id=\d is invalid: this worker "
                                                    r"holds LoRA adapter ids \[3\]"):
            slots.set_rows(np.array(row_ids, dtype=np.int32), np.ones(len(row_ids), int))
