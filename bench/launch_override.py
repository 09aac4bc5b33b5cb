"""`--triton-launch`: run the engine with other Triton attention launch choices (a bench-only
experiment; the engine's own are TritonLaunchConfig's defaults).

    --triton-launch decode.block_n=32,decode.num_warps=8,decode_splits=2

Names are TritonLaunchConfig fields, `prefill.` / `decode.` ones KernelTiles fields; values are
ints (decode_splits also `none`) or, for dispatch and decode_order, a name. Applied to the model's attention
backend after start-up, then the decode CUDA graphs are captured again, so that graph replays
use them too (split counts and tile sizes are fixed in each graph at capture).
"""
from __future__ import annotations

from dataclasses import fields, replace

STRING_FIELDS = ("dispatch", "decode_order")      # the rest are ints


def parse_launch(text: str):
    """A TritonLaunchConfig from "name=value,..." over the defaults; ValueError names the bad
    part."""
    from kernels.attention.triton_launch import KernelTiles, TritonLaunchConfig

    config = TritonLaunchConfig()
    tiles = {"prefill": {}, "decode": {}}
    top = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"--triton-launch part {part!r} is invalid: must be name=value")
        kernel, dot, field = name.partition(".")
        known = {f.name for f in fields(KernelTiles if dot else TritonLaunchConfig)}
        if (dot and kernel not in tiles) or (field if dot else name) not in known:
            raise ValueError(f"--triton-launch name {name!r} is invalid: must be one of "
                             f"{sorted(f.name for f in fields(TritonLaunchConfig))} or "
                             f"prefill./decode. + {sorted(f.name for f in fields(KernelTiles))}")
        parsed = value if name in STRING_FIELDS else _parse_int(name, value)
        if dot:
            tiles[kernel][field] = parsed
        else:
            top[name] = parsed
    return replace(config, prefill=replace(config.prefill, **tiles["prefill"]),
                   decode=replace(config.decode, **tiles["decode"]), **top)


def _parse_int(name: str, value: str) -> int | None:
    """An int field's value ("none": None, which only decode_splits allows); ValueError names
    the field, the value and what it must be."""
    if value == "none":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"--triton-launch {name}={value!r} is invalid: must be an integer"
                         + (" or none" if name == "decode_splits" else "")) from None


def apply_launch(llm, launch) -> None:
    """Give the engine's Triton backend `launch` and capture its decode graphs again."""
    import gc

    import torch

    backends = {id(m.backend): m.backend for m in llm.runner.model.modules()
                if hasattr(m, "backend") and hasattr(m.backend, "launch")}
    if not backends:
        raise ValueError("--triton-launch needs the triton attention backend")
    for backend in backends.values():
        backend.launch = launch
    graphs = llm.runner.graph_runner
    if graphs is not None:
        graphs.graphs.clear()
        gc.collect()
        torch.cuda.empty_cache()
        graphs.capture()
