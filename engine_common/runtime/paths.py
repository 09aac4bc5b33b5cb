"""Where DeltaServe keeps its files. A leaf: imports nothing of ours."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$XDG_CACHE_HOME/deltaserve, or ~/.cache/deltaserve."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "deltaserve"

