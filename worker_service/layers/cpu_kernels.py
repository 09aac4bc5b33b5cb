"""Switch a loaded CPU model onto the deltaserve_cpu kernels (kernels/cpu): every module that
defines `use_cpu_kernels()` (the linear layers and LM head, RMSNorm, the rope, SiluAndMul)
prepares itself. Each keeps its torch code for inputs the kernels do not take, and when the
library is missing.

As soon as each module is prepared, a prepared linear's own parameter is let go
(release_dense_weights): its panels and pack are the two copies kept; so are packed MoE
experts' stacked weights (release_expert_weights): their panels are the one copy.

This is the long step after the weights load on a CPU (the GEMM weights are packed, about 2 s
for the 135M default model), and on a first start the library is compiled before it (1-3
minutes): both say how far they are."""
from __future__ import annotations

import logging

from torch import nn

from engine_common.runtime.progress import Progress, heartbeat
from kernels.cpu import extension

log = logging.getLogger(__name__)


def use_cpu_kernels(model: nn.Module) -> int:
    """Prepare every module that can use a CPU kernel; returns how many did."""
    if extension.needs_build():
        with heartbeat("building CPU kernels (about 1-3 minutes, once per checkout)",
                       emit=log.info):
            extension.load()
    # a pooling-only model's head (tied by the loader) is never run: no panels or pack for it
    unread = getattr(model, "lm_head", None) if getattr(model, "pooling_only", False) else None
    modules = [m for m in model.modules()
               if m is not unread and callable(getattr(m, "use_cpu_kernels", None))]
    progress = Progress("packing weights for the CPU kernels", len(modules), "layers",
                        emit=log.info)
    holders = storage_holders(model)
    used = 0
    for module in modules:
        used += bool(module.use_cpu_kernels())
        # each layer's weights go once it is packed: the load's peak is then one layer's
        # weights beside its panels, not every layer's (the memory check budgets the rest)
        release_dense_weights(module, holders)
        release_expert_weights(module)
        progress.advance()
    return used


def release_expert_weights(model: nn.Module) -> int:
    """Let every packed MoE experts module's stacked weights go (layers/moe.py's
    PackedExperts: the panels are their copy from then on), in `model` or a module of it;
    returns how many did."""
    return sum(bool(m.release_expert_weights()) for m in model.modules()
               if callable(getattr(m, "release_expert_weights", None)))


def storage_holders(model: nn.Module) -> dict[int, int]:
    """How many of `model`'s parameters each storage backs, by its data pointer."""
    holders: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        key = param.untyped_storage().data_ptr()
        holders[key] = holders.get(key, 0) + 1
    return holders


def release_dense_weights(model: nn.Module, holders: dict[int, int] | None = None) -> int:
    """Let every prepared linear's parameter go (cpu_gemm.CpuGemm.release_dense_weight) but
    one whose storage another module also holds (a head tied to the embedding, which reads
    it); returns how many went. `holders`: storage_holders of the whole model when `model`
    is one module of it (its own parameters cannot show who else shares them)."""
    holders = storage_holders(model) if holders is None else holders
    released = 0
    for module in model.modules():
        release = getattr(module, "release_dense_weight", None)
        weight = getattr(module, "weight", None)
        if release is None or weight is None or weight.numel() == 0:
            continue
        if holders.get(weight.untyped_storage().data_ptr(), 0) == 1:
            released += bool(release())
    return released
