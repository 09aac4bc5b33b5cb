"""Where DeltaServe keeps its files, and which device 'auto' means. A leaf: imports nothing of ours.

Torch is imported only when 'auto' must be resolved, so torch-free commands can use this module.
"""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$XDG_CACHE_HOME/deltaserve, or ~/.cache/deltaserve."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "deltaserve"


def resolve_device(device: str) -> str:
    """'auto' -> 'cuda' when torch sees a GPU, else 'cpu'; anything else is returned as is."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
