"""Switch a loaded CPU model onto the deltaserve_cpu kernels (kernels/cpu): every module that
defines `use_cpu_kernels()` (the linear layers and LM head, RMSNorm, the rope, SiluAndMul)
prepares itself. Each keeps its torch code for inputs the kernels do not take, and when the
library is missing."""
from __future__ import annotations

from torch import nn


def use_cpu_kernels(model: nn.Module) -> int:
    """Prepare every module that can use a CPU kernel; returns how many did."""
    used = 0
    for module in model.modules():
        prepare = getattr(module, "use_cpu_kernels", None)
        if callable(prepare):
            used += bool(prepare())
    return used
