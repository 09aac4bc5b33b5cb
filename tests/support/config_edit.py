"""A copy of a model directory with config.json fields changed: for tests of how a model reads
(or refuses) a field."""
from __future__ import annotations

import json
import shutil


def with_config(src: str, dst, **changes) -> str:
    """Copy model directory `src` to `dst` with `changes` merged into its config.json."""
    shutil.copytree(src, dst)
    cfg = json.load(open(f"{dst}/config.json"))
    json.dump({**cfg, **changes}, open(f"{dst}/config.json", "w"))
    return str(dst)
